//! The command line: `serve`, `migrate`, `verify`, `keys`, `logins` for the
//! service and its DBA; `signing-keys`, `receipts`, `audit` for its
//! evidence; `submit` and `follow` for its callers. This file holds the
//! command line only; each command's body is a module of `commands`.
//! Informational output goes to stderr; an error is one line and a
//! non-zero exit.

mod commands;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use commands::evidence::{AuditArgs, ReceiptsAction, SigningKeysAction};
use commands::follow::FollowArgs;
use commands::keys::KeysAction;
use commands::logins::LoginsAction;
use commands::migrate::MigrateAction;
use commands::serve::ServeArgs;
use commands::submit::SubmitArgs;
use commands::{CommandError, DatabaseArgs};

/// Each request allocates and frees many small strings and JSON nodes;
/// glibc's malloc spent about 15 % of the service's CPU on them (`perf`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "plan-intake",
    version,
    about = "Takes plans from planner services and keeps each one exactly once",
    arg_required_else_help = true
)]
struct Cli {
    /// Log format on stderr
    #[arg(long, env = "PLAN_INTAKE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service (applies pending migrations first unless --no-migrate)
    Serve(ServeArgs),
    /// Signing keys for receipts and the receipt log
    #[command(name = "signing-keys", arg_required_else_help = true)]
    SigningKeys {
        #[command(subcommand)]
        action: SigningKeysAction,
    },
    /// Check receipts offline, with no service or database
    #[command(arg_required_else_help = true)]
    Receipts {
        #[command(subcommand)]
        action: ReceiptsAction,
    },
    /// Recompute the receipt log from the tables and hold it against every signed checkpoint; one line per finding, exit 65 if any
    Audit(AuditArgs),
    /// Apply or inspect migrations
    #[command(arg_required_else_help = true)]
    Migrate {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(subcommand)]
        action: MigrateAction,
    },
    /// Check that the database upholds the guarantees (one line per check)
    Verify {
        #[command(flatten)]
        db: DatabaseArgs,
    },
    /// One of verify's contending processes (internal)
    #[command(hide = true)]
    VerifyContender {
        #[command(flatten)]
        db: DatabaseArgs,
    },
    /// Idempotency-key retention (run as the owner, or a role with the --pruner grant)
    #[command(arg_required_else_help = true)]
    Keys {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(subcommand)]
        action: KeysAction,
    },
    /// Submit a plan, retrying under one Idempotency-Key until the service keeps it; prints the receipt
    #[command(after_help = commands::submit::EXITS)]
    Submit(SubmitArgs),
    /// Follow the feed, in order: every receipt at least once, the cursor saved after each page; with --into, exactly once into the consumer's database
    #[command(after_help = commands::follow::EXITS)]
    Follow(FollowArgs),
    /// The ordering system's inbox tables, for `follow --into`: created in the consumer's database, or printed for its DBA
    #[command(arg_required_else_help = true)]
    Inbox {
        #[command(subcommand)]
        action: commands::inbox::InboxAction,
    },
    /// Manage logins (the only way to create one)
    #[command(arg_required_else_help = true)]
    Logins {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(subcommand)]
        action: LoginsAction,
    },
}

fn main() -> ExitCode {
    // Before any thread and any Postgres connection: OpenSSL's state then
    // outlives the process's exit, however busy its threads are then.
    plan_intake::storage::keep_tls_state_past_exit();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // clap's own message, whole: what is wrong, the allowed values, the
        // usage (or the help, for a bare command); exit 2. --help and
        // --version go to stdout with exit 0.
        Err(e) => {
            if !e.use_stderr() {
                // --help and --version: on stdout, as they are.
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // A command line clap could not read has no parsed format: the
            // one asked for, if it can be found, decides.
            if json_asked() {
                commands::stderr_in_json(true);
                let text = e.render().to_string();
                commands::tell_line(
                    "ERROR",
                    &format!("plan-intake: {}", text.trim_end()),
                    &[("exit", 2.into())],
                );
            } else {
                let _ = e.print();
            }
            return ExitCode::from(2);
        }
    };
    commands::stderr_in_json(matches!(cli.log_format, LogFormat::Json));
    if let Err(e) = init_tracing(cli.log_format) {
        commands::tell_line(
            "ERROR",
            &format!("plan-intake: {}", plan_intake::report::chain(&e)),
            &[("exit", 2.into())],
        );
        return ExitCode::from(2);
    }
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A broken stderr is not worth a panic: the exit status tells.
            commands::tell_line(
                "ERROR",
                &format!(
                    "plan-intake: error: {}{}",
                    plan_intake::report::chain(&e),
                    e.hint()
                ),
                &[("exit", e.exit_code().into())],
            );
            ExitCode::from(e.exit_code())
        }
    }
}

/// Whether `--log-format json` (or `PLAN_INTAKE_LOG_FORMAT=json`) is on a
/// command line clap refused.
fn json_asked() -> bool {
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--log-format=json" => return true,
            "--log-format" => return args.next().as_deref() == Some("json"),
            _ => {}
        }
    }
    std::env::var("PLAN_INTAKE_LOG_FORMAT").as_deref() == Ok("json")
}

fn run(command: Command) -> Result<(), CommandError> {
    match command {
        Command::Serve(args) => commands::serve::run(args),
        Command::Submit(args) => commands::submit::run(args),
        Command::Follow(args) => commands::follow::run(args),
        Command::Inbox { action } => commands::inbox::run(action),
        Command::Migrate { db, action } => commands::migrate::run(&db, action),
        Command::Logins { db, action } => commands::logins::run(&db, action),
        Command::Keys { db, action } => commands::keys::run(&db, action),
        Command::SigningKeys { action } => commands::evidence::signing_keys(action),
        Command::Receipts { action } => commands::evidence::receipts(action),
        Command::Audit(args) => commands::evidence::audit(args),
        Command::Verify { db } => commands::evidence::check(&db),
        Command::VerifyContender { db } => commands::evidence::contend(&db),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("PLAN_INTAKE_LOG `{filter}` is not a tracing filter")]
struct BadLogFilter {
    filter: String,
    #[source]
    source: tracing_subscriber::filter::ParseError,
}

/// Logging to stderr; an unreadable `PLAN_INTAKE_LOG` is refused, not ignored.
fn init_tracing(format: LogFormat) -> Result<(), BadLogFilter> {
    let filter = match std::env::var("PLAN_INTAKE_LOG") {
        Ok(text) => {
            tracing_subscriber::EnvFilter::try_new(&text).map_err(|source| BadLogFilter {
                filter: text,
                source,
            })?
        }
        Err(_) => tracing_subscriber::EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    Ok(())
}
