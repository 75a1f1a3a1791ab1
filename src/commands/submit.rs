//! `plan-intake submit`: one plan, retried under one key until it is kept.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use plan_intake_client::{self as client, SubmitOptions};

use super::{CommandError, ServiceArgs, connect, parse_key, read_request, say, tell};

pub const EXITS: &str = "Exit status: 0 created, replayed or already_received (the receipt on stdout); \
65 refused (400, 413, 415, 422: fix the request); 77 not allowed (401, 403); \
75 attempts or time ran out (safe to run again: same request, same key); \
74 stdout cannot be written (the plan is kept: run it again for its receipt); 2 a bad command line; 1 otherwise.";

#[derive(Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub service: ServiceArgs,
    /// The request `{run_id, approved_inputs, content}`; `-` or absent: stdin
    pub file: Option<PathBuf>,
    /// The Idempotency-Key (default: derived from the request, so the same request is a replay)
    #[arg(long, value_parser = parse_key)]
    pub key: Option<String>,
    #[arg(long, help = format!(
        "Cap of the first retry's random delay, in ms; doubles per retry up to {}",
        humantime::format_duration(client::MAX_RETRY_DELAY)
    ), default_value_t = plan_intake::config::millis(SubmitOptions::default().retry_base), value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub retry_base_ms: u64,
    /// At most this many attempts, the first included (default: as many as --timeout-secs allows)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_attempts: Option<u32>,
    /// Seconds for the whole call, every attempt and wait included
    #[arg(long, default_value_t = SubmitOptions::default().timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..=SubmitOptions::MAX_TIMEOUT.as_secs()))]
    pub timeout_secs: u64,
}

pub fn run(args: SubmitArgs) -> Result<(), CommandError> {
    let SubmitArgs {
        service,
        file,
        key,
        retry_base_ms,
        max_attempts,
        timeout_secs,
    } = args;
    let client = connect(&service)?;
    let body = read_request(file.as_deref())?;
    let key = key.unwrap_or_else(|| client::derive_key(&body));
    tell!("idempotency-key: {key}");
    let submitted = client.submit(
        &body,
        &SubmitOptions {
            key: Some(key),
            max_attempts,
            retry_base: Duration::from_millis(retry_base_ms),
            timeout: Duration::from_secs(timeout_secs),
        },
    )?;
    say!("{}", submitted.receipt);
    Ok(())
}
