//! `plan-intake migrate`: apply, list, print, revert; the GRANTs of a
//! least-privilege role.

use clap::Subcommand;
use plan_intake::storage::{DbConn, MigrateOnOpen, StorageError, migrations};

use super::{CommandError, DatabaseArgs, open_single, say, tell};

#[derive(Subcommand)]
pub enum MigrateAction {
    /// Apply every pending migration
    Run,
    /// List applied and pending migrations
    Status,
    /// Print the SQL of the pending migrations (or, with --revert, what
    /// `migrate revert` would run) without changing anything
    Print {
        #[arg(long)]
        revert: bool,
    },
    /// Revert the most recent migration (shows its SQL first; refuses to
    /// drop tables that hold rows unless --yes)
    Revert {
        /// Drop tables even if they hold rows
        #[arg(long)]
        yes: bool,
    },
    /// Print the GRANT statements that let ROLE run the service and nothing more (Postgres)
    Grants {
        /// The Postgres role the service (or the pruner) connects as
        role: String,
        /// Print only the one extra grant a role needs to run `keys prune`
        #[arg(long)]
        pruner: bool,
    },
}

pub fn run(db: &DatabaseArgs, action: MigrateAction) -> Result<(), CommandError> {
    // What only prints may be cut short by its reader (`| head`): quietly.
    let only_prints = matches!(
        action,
        MigrateAction::Status | MigrateAction::Print { .. } | MigrateAction::Grants { .. }
    );
    match act(db, action) {
        Err(CommandError::Output(e))
            if only_prints && e.kind() == std::io::ErrorKind::BrokenPipe =>
        {
            Ok(())
        }
        done => done,
    }
}

fn act(db: &DatabaseArgs, action: MigrateAction) -> Result<(), CommandError> {
    if matches!(action, MigrateAction::Run | MigrateAction::Revert { .. }) {
        migrations::refuse_through_pooler(db.pg_pooler)?;
    }
    // Only `migrate run` creates a SQLite file that is not there.
    let open = match action {
        MigrateAction::Run => MigrateOnOpen::Create,
        _ => MigrateOnOpen::Skip,
    };
    let mut conn = open_single(db, open)?;
    let conn: &mut DbConn = &mut conn;
    match action {
        MigrateAction::Run => {
            let applied = migrations::run_pending(conn)?;
            if applied.is_empty() {
                tell!("no pending migrations");
            }
            for name in applied {
                tell!("applied {name}");
            }
        }
        MigrateAction::Status => {
            let pending = migrations::pending(conn)?;
            for name in migrations::applied(conn)? {
                say!("applied  {name}");
            }
            for name in pending {
                say!("pending  {name}");
            }
        }
        MigrateAction::Print { revert: false } => {
            let planned = migrations::pending_sql(conn)?;
            if planned.is_empty() {
                tell!("no pending migrations");
            }
            for (name, sql) in planned {
                say!("-- {name}\n{}\n", sql.trim_end());
            }
        }
        MigrateAction::Print { revert: true } => match migrations::revert_sql(conn)? {
            Some((name, sql)) => say!("-- revert {name}\n{}\n", sql.trim_end()),
            None => tell!("no applied migrations"),
        },
        MigrateAction::Revert { yes } => {
            migrations::require_owner(conn)?;
            let Some((name, sql)) = migrations::revert_sql(conn)? else {
                tell!("no applied migrations");
                return Ok(());
            };
            tell!("-- reverting {name}:\n{}", sql.trim_end());
            let holding = migrations::tables_with_rows_dropped_by(conn, &sql)?;
            if !holding.is_empty() && !yes {
                let tables: Vec<String> = holding
                    .iter()
                    .map(|(t, n)| format!("{t} ({n} rows)"))
                    .collect();
                return Err(CommandError::Storage(StorageError::Config(format!(
                    "reverting {name} would drop {}; run `migrate revert --yes` to drop them",
                    tables.join(", ")
                ))));
            }
            let name = migrations::revert_last(conn)?;
            tell!("reverted {name}");
        }
        MigrateAction::Grants { role, pruner: true } => {
            say!("{}", migrations::pruner_grant_for(conn, &role)?);
        }
        MigrateAction::Grants {
            role,
            pruner: false,
        } => {
            for statement in migrations::grants_for(conn, &role)? {
                say!("{statement}");
            }
        }
    }
    Ok(())
}
