//! `plan-intake follow`: the feed, page by page, the cursor saved after each.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use plan_intake_client::{self as client, FollowError, FollowOptions};
use plan_intake_wire::feed;

use super::{CommandError, ServiceArgs, connect, stop_on_signals, tell};

pub const EXITS: &str = "SIGTERM or SIGINT finishes the page in hand, saves the cursor and exits 0. \
Exit status: 0 stopped or drained; 65 a cursor the service refuses, or keys that cannot be trusted; 66 the --keys file cannot be read; 77 not allowed (401, 403); \
76 (--verify) a page not proven to be the signed log's next leaves: nothing of it handed on or saved; \
74 the cursor file or the output cannot be written; 71 CMD cannot be started; 2 a bad command line; 1 otherwise.";

#[derive(Args)]
pub struct FollowArgs {
    #[command(flatten)]
    pub service: ServiceArgs,
    /// Where the cursor is kept; when it does not exist, start at the feed's current end
    #[arg(long)]
    pub cursor_file: PathBuf,
    /// When the cursor file does not exist, start at the feed's first receipt instead
    #[arg(long)]
    pub from_start: bool,
    /// Each entry is {receipt, approved_inputs, content} (expand=plan)
    #[arg(long)]
    pub expand: bool,
    /// Receipts per page
    #[arg(long, default_value_t = feed::DEFAULT_LIMIT, value_parser = clap::value_parser!(u32).range(1..=i64::from(feed::MAX_LIMIT)))]
    pub limit: u32,
    /// Seconds one request waits for a receipt (with --drain: 0 unless given)
    #[arg(
        long,
        default_value_t = FollowOptions::DEFAULT_WAIT.as_secs(),
        default_value_if("drain", "true", "0"),
        value_parser = clap::value_parser!(u64).range(0..=feed::MAX_WAIT.as_secs())
    )]
    pub wait_secs: u64,
    /// Run `sh -c CMD` once per non-empty page, its receipts as JSON lines on CMD's stdin; the cursor advances only when CMD exits 0
    #[arg(long, value_name = "CMD")]
    pub exec: Option<String>,
    /// Exit 0 at the first empty page (for batch jobs); give up (exit 1) after 10 failed tries in a row instead of waiting a service out
    #[arg(long)]
    pub drain: bool,
    /// Seconds between two lines saying how far behind the feed's end the follower is (INFO; 0: after every page)
    #[arg(long, default_value_t = FollowOptions::DEFAULT_LAG_EVERY.as_secs())]
    pub lag_every_secs: u64,
    /// Hand on only receipts proven to be the signed receipt log's next leaves (each signature under --keys, one consistency proof a page); the proof so far is saved with the cursor. Starts at the feed's first receipt (--from-start), from a cursor file a verifying follower saved, or at a checkpoint (--from-checkpoint FILE; with neither, the first one it sees, trusted, and said so); exits 76 at the first receipt that fails, naming its log index
    #[arg(long, requires = "keys")]
    pub verify: bool,
    /// The keys --verify trusts, pinned: what `GET /v1/signing-keys` answered once, or verifier keys (`.pub` lines) one per line; nothing the service says adds one
    #[arg(long, value_name = "FILE", requires = "verify")]
    pub keys: Option<PathBuf>,
    /// With --verify and no cursor file: start at this checkpoint (a signed note, as `GET /v1/checkpoint` answers it, or the service's --checkpoint-file), trusted as the log's; receipts after it are verified against it, the ones before it are not handed on
    #[arg(
        long,
        value_name = "FILE",
        requires = "verify",
        conflicts_with = "from_start"
    )]
    pub from_checkpoint: Option<PathBuf>,
    /// With --verify: the log's first N receipts were kept before its first signing key and carry no signature (`plan-intake audit` counts them); any other unsigned receipt is refused (76). Default 0: every receipt must be signed
    #[arg(long, value_name = "N", default_value_t = 0, requires = "verify")]
    pub unsigned_prelude: u64,
}

pub fn run(args: FollowArgs) -> Result<(), CommandError> {
    let FollowArgs {
        service,
        cursor_file,
        from_start,
        expand,
        limit,
        wait_secs,
        exec,
        drain,
        lag_every_secs,
        verify,
        keys,
        from_checkpoint,
        unsigned_prelude,
    } = args;
    // Read only where it is used: beside a cursor file it may be gone
    // (a restart of a unit that once started from it).
    let from_checkpoint = match from_checkpoint {
        Some(_) if cursor_file.exists() => {
            tell!(
                "--from-checkpoint is ignored: {} holds a cursor, and the follower goes on from it",
                cursor_file.display()
            );
            None
        }
        Some(path) => Some(std::fs::read_to_string(&path).map_err(|e| {
            CommandError::Usage(format!("--from-checkpoint {}: {e}", path.display()))
        })?),
        None => None,
    };
    let pinned = match keys.filter(|_| verify) {
        Some(path) => Some(plan_intake::evidence::trusted_keys(&path)?),
        None => None,
    };
    if from_start && cursor_file.exists() {
        tell!(
            "--from-start is ignored: {} holds a cursor, and the follower goes on from it (remove the file to start over)",
            cursor_file.display()
        );
    }
    let client = connect(&service)?;
    let options = FollowOptions {
        from_start,
        expand,
        limit,
        wait: Duration::from_secs(wait_secs),
        exec,
        drain,
        verify: pinned,
        from_checkpoint,
        unsigned_prelude,
        lag_every: Duration::from_secs(lag_every_secs),
        ..FollowOptions::new(cursor_file)
    };
    let stop = stop_on_signals()?;
    // With --exec nothing goes to stdout, whatever it leads to
    // (a daemon's stdout is /dev/null opened for reading and writing).
    let followed = if options.exec.is_some() {
        client::follow(&client, &options, &stop, &mut std::io::sink())?
    } else {
        let mut out = plan_intake::stdout::open().map_err(FollowError::Output)?;
        client::follow(&client, &options, &stop, &mut out)?
    };
    tell!(
        "stopped after {} receipt(s) in {} page(s); {}",
        followed.receipts,
        followed.pages,
        if followed.cursor_saved {
            "the cursor is saved"
        } else {
            "the cursor is unchanged"
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::FollowArgs;

    #[derive(Parser)]
    struct Line {
        #[command(flatten)]
        follow: FollowArgs,
    }

    fn wait_of(args: &[&str]) -> u64 {
        let line = ["follow", "--cursor-file", "c"].iter().chain(args);
        Line::try_parse_from(line)
            .expect("a command line")
            .follow
            .wait_secs
    }

    /// `--drain` polls without waiting unless told to wait; otherwise the
    /// client's default wait.
    #[test]
    fn drain_waits_zero_unless_told() {
        let default = plan_intake_client::FollowOptions::DEFAULT_WAIT.as_secs();
        assert_eq!(wait_of(&[]), default);
        assert_eq!(wait_of(&["--drain"]), 0);
        assert_eq!(wait_of(&["--drain", "--wait-secs", "5"]), 5);
        assert_eq!(wait_of(&["--wait-secs", "7"]), 7);
    }
}
