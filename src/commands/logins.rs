//! `plan-intake logins`: the only way to create, list, revoke or rotate one.

use std::time::Duration;

use clap::Subcommand;
use plan_intake::intake::Permission;
use plan_intake::intake::login as logins;
use plan_intake::intake::receipt::format_timestamp;
use plan_intake::storage::MigrateOnOpen;

use super::{CommandError, DatabaseArgs, open_single, say, tell};

#[derive(Subcommand)]
pub enum LoginsAction {
    /// Create a login; prints only its token on stdout
    Add {
        /// The login's name (1-64 of A-Z a-z 0-9 - _ .): the maker of its plans
        name: String,
        /// plans:submit or receipts:read; repeat for several
        #[arg(long = "permission", required = true)]
        permissions: Vec<Permission>,
    },
    /// List logins (never tokens)
    List,
    /// Revoke a login's token at once
    Revoke {
        /// The login to revoke
        name: String,
    },
    /// Issue a new token for an active login (prints only the token); the
    /// token it replaces keeps working for the grace period. A rotation
    /// during an earlier one's grace period ends that grace at once: only
    /// the token just replaced keeps working. A revoked login is refused
    /// (see `reinstate`). Keys and receipts stay the login's.
    Rotate {
        /// The active login to give a new token
        name: String,
        /// How long the replaced token keeps working, e.g. 24h, 30m, 0s
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        grace: Duration,
    },
    /// Bring a revoked login back on purpose, under a new token only (prints
    /// only the token); no token it had before works again
    Reinstate {
        /// The revoked login to bring back
        name: String,
    },
}

pub fn run(db: &DatabaseArgs, action: LoginsAction) -> Result<(), CommandError> {
    // Logins live in the migrated schema, which only `migrate run` (or
    // `serve`) makes: a login added to a database no service reads (a
    // typo's new file) would be a token that works nowhere.
    let migrate = MigrateOnOpen::RequireNonePending;
    // Input is checked before anything is opened: a refused command
    // creates no database file.
    if let LoginsAction::Add { name, .. } = &action {
        logins::validate_name(name)?;
    }
    let mut conn = open_single(db, migrate)?;
    match action {
        LoginsAction::Add { name, permissions } => {
            // Printed before the login is committed: no login without its token.
            logins::create_handed_over(&mut conn, &name, &permissions, |token| {
                plan_intake::stdout::line(token)
            })?;
            tell!("created login `{name}`; the token above is shown only once");
        }
        LoginsAction::List => {
            let now = plan_intake::clock::now_micros();
            for login in logins::list(&mut conn)? {
                let state = match (login.revoked_at, login.previous_token_expires_at) {
                    (Some(at), _) => format!("revoked {}", format_timestamp(&at)),
                    (None, Some(until)) if until > now => format!(
                        "active; the replaced token works until {}",
                        format_timestamp(&until)
                    ),
                    (None, _) => "active".to_owned(),
                };
                say!(
                    "{}\t{}\tcreated {}\t{state}",
                    login.name,
                    login.permissions,
                    format_timestamp(&login.created_at)
                );
            }
        }
        LoginsAction::Revoke { name } => {
            logins::revoke(&mut conn, &name)?;
            tell!("revoked login `{name}`");
        }
        LoginsAction::Rotate { name, grace } => {
            logins::rotate_handed_over(&mut conn, &name, grace, |token| {
                plan_intake::stdout::line(token)
            })?;
            if grace.is_zero() {
                tell!(
                    "new token for login `{name}`, shown only once; the replaced one no longer works"
                );
            } else {
                tell!(
                    "new token for login `{name}`, shown only once; the replaced one works for {} more",
                    humantime::format_duration(grace)
                );
            }
        }
        LoginsAction::Reinstate { name } => {
            logins::reinstate_handed_over(&mut conn, &name, |token| {
                plan_intake::stdout::line(token)
            })?;
            tell!(
                "login `{name}` is active again under the token above, shown only once; no earlier token works"
            );
        }
    }
    Ok(())
}
