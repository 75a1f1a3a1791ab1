//! `plan-intake serve`: the database to open, the service's settings (one
//! typed struct, `serve::ServeSettings`) and the signing keys they name.

use clap::Args;
use plan_intake::evidence;
use plan_intake::serve::{self, ServeSettings};

use super::{CommandError, DatabaseArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub settings: ServeSettings,
}

/// Runs the service with `args` until it is stopped.
pub fn run(args: ServeArgs) -> Result<(), CommandError> {
    // First, while this process has one thread: taking the sockets clears
    // their variables from the environment.
    let inherited = serve::inherited_listeners().map_err(|source| serve::ServeError::Bind {
        bind: "the sockets systemd handed over (LISTEN_FDS)".to_owned(),
        source,
    })?;
    let ServeArgs { db, settings } = args;
    let signing_keys = settings
        .signing_key_env
        .iter()
        .map(|name| evidence::load_key_env(name))
        .chain(
            settings
                .signing_key
                .iter()
                .map(|path| evidence::load_key_file(path)),
        )
        .collect::<Result<_, _>>()?;
    Ok(serve::run(
        &db.database_url,
        db.pg_pooler,
        &settings,
        signing_keys,
        inherited,
    )?)
}
