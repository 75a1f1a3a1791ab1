//! The names the schema pins, and what the live catalog holds. DBAs depend on
//! these names; Postgres would silently cut any longer than 63 bytes.

use diesel::prelude::*;
use diesel::sql_types::Text;

use super::DbConn;

pub const TABLES: [&str; 8] = [
    "logins",
    "plans",
    "intake_keys",
    "receipt_log",
    "receipt_log_hashes",
    "receipt_log_checkpoints",
    "receipt_log_state",
    "signing_keys",
];

/// [`TABLES`] as an SQL list.
const TABLES_SQL: &str = "('logins', 'plans', 'intake_keys', 'receipt_log', 'receipt_log_hashes', \
                          'receipt_log_checkpoints', 'receipt_log_state', 'signing_keys')";

/// Every index and primary key, unique, check and foreign key constraint,
/// as `(table, name)`, sorted.
pub const PINNED_NAMES: [(&str, &str); 20] = [
    ("intake_keys", "intake_keys_maker_key_uq"),
    ("intake_keys", "intake_keys_pk"),
    ("intake_keys", "intake_keys_plan_id_fk"),
    ("intake_keys", "intake_keys_plan_id_ix"),
    ("logins", "logins_name_not_blank_ck"),
    ("logins", "logins_pk"),
    ("logins", "logins_previous_token_hash_uq"),
    ("logins", "logins_token_hash_uq"),
    ("plans", "plans_feed_ix"),
    ("plans", "plans_maker_run_content_uq"),
    ("plans", "plans_pk"),
    ("plans", "plans_receipt_id_uq"),
    ("plans", "plans_run_id_not_blank_ck"),
    ("receipt_log", "receipt_log_pk"),
    ("receipt_log", "receipt_log_receipt_id_uq"),
    ("receipt_log_checkpoints", "receipt_log_checkpoints_pk"),
    ("receipt_log_hashes", "receipt_log_hashes_pk"),
    ("receipt_log_state", "receipt_log_state_one_row_ck"),
    ("receipt_log_state", "receipt_log_state_pk"),
    ("signing_keys", "signing_keys_pk"),
];

#[derive(QueryableByName)]
struct NamedObject {
    #[diesel(sql_type = Text)]
    table_name: String,
    #[diesel(sql_type = Text)]
    name: String,
}

#[derive(QueryableByName)]
struct TableSql {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Text)]
    sql: String,
}

/// The index and constraint names the live catalog holds for our tables,
/// as `(table, name)`, sorted. On SQLite, whose catalog keeps constraint
/// names only in the table's SQL, they are read from there; an index SQLite
/// named itself (`sqlite_autoindex_…`) is listed as found, so an unnamed
/// unique rule shows up as a mismatch.
pub fn live_names(conn: &mut DbConn) -> QueryResult<Vec<(String, String)>> {
    let mut names: Vec<(String, String)> = match conn {
        DbConn::Postgres(pg) => diesel::sql_query(format!(
            "SELECT t.relname::text AS table_name, c.conname::text AS name
               FROM pg_constraint c
               JOIN pg_class t ON t.oid = c.conrelid
              WHERE t.relnamespace = current_schema()::regnamespace
                AND t.relname IN {TABLES_SQL}
             UNION
             SELECT t.relname::text, i.relname::text
               FROM pg_index x
               JOIN pg_class i ON i.oid = x.indexrelid
               JOIN pg_class t ON t.oid = x.indrelid
              WHERE t.relnamespace = current_schema()::regnamespace
                AND t.relname IN {TABLES_SQL}"
        ))
        .load::<NamedObject>(pg)?
        .into_iter()
        .map(|o| (o.table_name, o.name))
        .collect(),
        DbConn::Sqlite(lite) => {
            let mut names: Vec<(String, String)> = diesel::sql_query(format!(
                "SELECT tbl_name AS table_name, name FROM sqlite_master
                  WHERE type = 'index' AND tbl_name IN {TABLES_SQL}
                    AND name NOT IN (SELECT name FROM sqlite_master WHERE type = 'table')"
            ))
            .load::<NamedObject>(lite)?
            .into_iter()
            .map(|o| (o.table_name, o.name))
            .collect();
            let tables = diesel::sql_query(format!(
                "SELECT name, sql FROM sqlite_master
                  WHERE type = 'table' AND name IN {TABLES_SQL}"
            ))
            .load::<TableSql>(lite)?;
            for table in tables {
                names.extend(
                    constraint_names(&table.sql)
                        .into_iter()
                        .map(|name| (table.name.clone(), name)),
                );
            }
            names
        }
    };
    names.sort();
    names.dedup();
    Ok(names)
}

/// The word after each `CONSTRAINT` keyword in a CREATE TABLE statement.
fn constraint_names(sql: &str) -> Vec<String> {
    let words: Vec<&str> = sql
        .split(|c: char| c.is_whitespace() || c == '(' || c == ',')
        .filter(|w| !w.is_empty())
        .collect();
    words
        .windows(2)
        .filter(|pair| pair[0].eq_ignore_ascii_case("CONSTRAINT"))
        .map(|pair| pair[1].trim_matches('"').to_owned())
        .collect()
}

/// The pinned names as owned pairs, in the same order as [`live_names`].
pub fn pinned_names() -> Vec<(String, String)> {
    PINNED_NAMES
        .iter()
        .map(|(t, n)| (t.to_string(), n.to_string()))
        .collect()
}
