//! The isolation the service's guarantees rely on, whatever a DBA sets as
//! the database's or role's default: READ COMMITTED, pinned on each of the
//! service's sessions, said by `/readyz` and `verify`, and required behind
//! a transaction pooler (where no session setting holds).

use actix_web::http::StatusCode;
use diesel::RunQueryDsl;

use crate::support::{AppOptions, TestApp, TestDb, send};

/// `default_transaction_isolation` as a DBA's `ALTER DATABASE … SET` would
/// give it, carried by the connection (the test database is shared).
const REPEATABLE_READ: (&str, &str) = ("default_transaction_isolation", "repeatable%5C%20read");

#[derive(diesel::QueryableByName)]
struct Isolation {
    #[diesel(sql_type = diesel::sql_types::Text)]
    transaction_isolation: String,
}

/// Under a default of REPEATABLE READ, the service's sessions still run at
/// READ COMMITTED: a key held by a transaction that commits while the
/// write waits on it is found by the write's next statement (answered 422
/// for other content, never 503); `/readyz` says what the default is.
#[actix_web::test]
async fn a_default_of_repeatable_read_is_pinned_to_read_committed() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    let schema = db.schema.clone().expect("a scratch schema");
    let direct_url = db.url.clone();
    let url = db.postgres_url_with(&[REPEATABLE_READ]);
    let app = TestApp::with(
        db,
        AppOptions {
            url: Some(url.clone()),
            ..AppOptions::default()
        },
    );
    // The service's own pool over that URL.
    let service_db = plan_intake::storage::Database::open(
        &url,
        &plan_intake::storage::PoolOptions::default(),
        plan_intake::storage::MigrateOnOpen::Skip,
    )
    .expect("open");
    let shown: Isolation = match &mut *service_db.conn().expect("a connection") {
        plan_intake::storage::DbConn::Postgres(pg) => {
            diesel::sql_query("SHOW transaction_isolation")
                .get_result(pg)
                .expect("SHOW")
        }
        plan_intake::storage::DbConn::Sqlite(_) => unreachable!("Postgres"),
    };
    assert_eq!(shown.transaction_isolation, "read committed");

    let token = app.login("planner-a", &[plan_intake::intake::Permission::PlansSubmit]);
    let service = app.service().await;
    let answer = crate::support::answer_to_a_key_committed_while_waiting(
        &app,
        &service,
        &token,
        &direct_url,
        &schema,
    )
    .await;
    assert_eq!(
        answer.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{:?}",
        answer.body
    );
    app.assert_rows(1, 1);

    // Said to a login; a stranger learns only that there is something.
    let ready = send(
        &service,
        actix_web::test::TestRequest::get()
            .uri("/readyz")
            .insert_header(("Authorization", format!("Bearer {token}"))),
    )
    .await;
    assert_eq!(ready.status, StatusCode::OK, "{:?}", ready.body);
    let warning = ready.body["warning"].as_str().unwrap_or_default();
    assert!(warning.contains("'repeatable read'"), "{:?}", ready.body);
    let stranger = send(&service, actix_web::test::TestRequest::get().uri("/readyz")).await;
    let told = stranger.body["warning"].as_str().unwrap_or_default();
    assert!(
        !told.is_empty() && !told.contains("repeatable"),
        "{:?}",
        stranger.body
    );
}

/// Behind a transaction pooler the service cannot pin its isolation: a
/// default other than READ COMMITTED refuses every connection, naming it.
#[test]
fn behind_a_transaction_pooler_another_default_is_refused() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    let url = db.postgres_url_with(&[REPEATABLE_READ]);
    let options = plan_intake::storage::PoolOptions {
        pg_pooler: plan_intake::storage::PgPooler::Transaction,
        ..plan_intake::storage::PoolOptions::default()
    };
    let refused = plan_intake::storage::Database::open(
        &url,
        &options,
        plan_intake::storage::MigrateOnOpen::Skip,
    )
    .err()
    .map(|e| plan_intake::report::chain(&e))
    .unwrap_or_default();
    assert!(
        refused.contains("default_transaction_isolation is 'repeatable read'"),
        "{refused}"
    );
}

/// `verify` names a default other than READ COMMITTED.
#[test]
fn verify_names_another_default() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    let url = db.postgres_url_with(&[REPEATABLE_READ]);
    let out = crate::support::process::run_cli_at(&url, &["verify"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.lines().any(
            |l| l.starts_with("ok    transaction isolation") && l.contains("'repeatable read'")
        ),
        "{said}"
    );
}
