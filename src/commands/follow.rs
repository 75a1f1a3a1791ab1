//! `plan-intake follow`: the feed, page by page, the cursor saved after
//! each; or with `--into`, each page and the position after it committed
//! together in the consumer's database.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use plan_intake_client::{self as client, FollowError, FollowOptions};
use plan_intake_wire::feed;

use super::{CommandError, ServiceArgs, connect, stop_on_signals, tell};

pub const EXITS: &str = "SIGTERM or SIGINT finishes the page in hand, saves the cursor and exits 0. \
Exit status: 0 stopped or drained; 65 a cursor the service refuses, or keys that cannot be trusted; 66 the --keys file cannot be read; 77 not allowed (401, 403); \
76 (--verify) a page not proven to be the signed log's next leaves: nothing of it handed on or saved; \
74 the cursor file or the output cannot be written, or (--into) the inbox's tables are missing or hold a receipt twice; 71 CMD cannot be started; 2 a bad command line; 1 otherwise.";

#[derive(Args)]
pub struct FollowArgs {
    #[command(flatten)]
    pub service: ServiceArgs,
    /// Where the cursor is kept; when it does not exist, start at the feed's current end
    #[arg(long, required_unless_present = "into", conflicts_with = "into")]
    pub cursor_file: Option<PathBuf>,
    /// Exactly once into the consumer's database (postgres://…, postgresql://…, sqlite://PATH or a plain SQLite path): each page's receipts and the follower's position in one transaction, in the tables `plan-intake inbox migrate` creates; no cursor file
    #[arg(long, value_name = "DATABASE_URL", conflicts_with = "exec")]
    pub into: Option<String>,
    /// When nothing is saved yet (no cursor file, an empty inbox), start at the feed's first receipt instead
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
        into,
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
    // A cursor file's checkpoint and keys are read first, as before the
    // service is asked anything; an inbox's position once it is open.
    let file_saved = cursor_file.as_ref().map(|path| path.exists());
    let mut from_checkpoint = Some(from_checkpoint);
    let mut checkpoint_of = |saved: bool, held_by: &str| match from_checkpoint.take().flatten() {
        // Read only where it is used: beside a saved position it may be
        // gone (a restart of a unit that once started from it).
        Some(_) if saved => {
            tell!("--from-checkpoint is ignored: {held_by}, and the follower goes on from it");
            Ok(None)
        }
        Some(path) => std::fs::read_to_string(&path)
            .map(Some)
            .map_err(|e| CommandError::Usage(format!("--from-checkpoint {}: {e}", path.display()))),
        None => Ok(None),
    };
    let file_checkpoint = match (&cursor_file, file_saved) {
        (Some(path), Some(saved)) if into.is_none() => {
            checkpoint_of(saved, &format!("{} holds a cursor", path.display()))?
        }
        _ => None,
    };
    let pinned = match keys.filter(|_| verify) {
        Some(path) => Some(plan_intake::evidence::trusted_keys(&path)?),
        None => None,
    };
    let client = connect(&service)?;
    let stop = stop_on_signals()?;
    let (mut keeper, holder, saved, from_checkpoint) = match (&into, cursor_file) {
        (Some(url), _) => {
            let Some(mut inbox) = open_inbox(url, expand, &stop)? else {
                tell!("stopped before the inbox's database answered");
                return Ok(());
            };
            let saved = client::Sink::saved(&mut inbox)?.is_some();
            let checkpoint = checkpoint_of(saved, "the inbox holds a position")?;
            (
                Keeper::Inbox(Box::new(inbox)),
                PathBuf::new(),
                saved,
                checkpoint,
            )
        }
        (None, Some(path)) => (
            Keeper::CursorFile,
            path,
            file_saved.unwrap_or(false),
            file_checkpoint,
        ),
        (None, None) => {
            return Err(CommandError::Usage(
                "give --cursor-file FILE or --into DATABASE_URL".to_owned(),
            ));
        }
    };
    if from_start && saved {
        match &into {
            Some(_) => tell!(
                "--from-start is ignored: the inbox holds a position, and the follower goes on from it"
            ),
            None => tell!(
                "--from-start is ignored: {} holds a cursor, and the follower goes on from it (remove the file to start over)",
                holder.display()
            ),
        }
    }
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
        ..FollowOptions::new(holder)
    };
    // With --exec nothing goes to stdout, whatever it leads to
    // (a daemon's stdout is /dev/null opened for reading and writing).
    let followed = if let Keeper::Inbox(inbox) = &mut keeper {
        client::follow_into(&client, &options, &stop, inbox.as_mut())?
    } else if options.exec.is_some() {
        client::follow(&client, &options, &stop, &mut std::io::sink())?
    } else {
        let mut out = plan_intake::stdout::open().map_err(FollowError::Output)?;
        client::follow(&client, &options, &stop, &mut out)?
    };
    tell!(
        "stopped after {} receipt(s) in {} page(s); {}",
        followed.receipts,
        followed.pages,
        match (followed.cursor_saved, into.is_some()) {
            (true, false) => "the cursor is saved",
            (false, false) => "the cursor is unchanged",
            (true, true) => "the inbox holds them and its position",
            (false, true) => "the inbox's position is unchanged",
        }
    );
    Ok(())
}

/// What keeps the follower's position.
enum Keeper {
    CursorFile,
    Inbox(Box<plan_intake::inbox::Inbox>),
}

/// The inbox, its database waited for while it cannot be reached (as an
/// unreachable service is); missing tables end the run. `None`: asked to
/// stop meanwhile.
fn open_inbox(
    url: &str,
    expand: bool,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<Option<plan_intake::inbox::Inbox>, CommandError> {
    use plan_intake::inbox::{Inbox, InboxError};
    let mut delay = Duration::from_millis(250);
    loop {
        match Inbox::open(url, expand) {
            Ok(inbox) => return Ok(Some(inbox)),
            Err(InboxError::Connect(e)) => {
                super::tell_line(
                    "WARN",
                    &format!(
                        "cannot connect to the inbox's database ({e}); trying again in {} ms",
                        delay.as_millis()
                    ),
                    &[],
                );
            }
            Err(other) => return Err(super::inbox::inbox_error(other)),
        }
        let until = std::time::Instant::now() + delay;
        while std::time::Instant::now() < until {
            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
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
