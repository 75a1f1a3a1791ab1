//! Where a follower hands its pages: each way of handing on is a sink of
//! its own (the output, `CMD`, a caller's code, a consumer's database),
//! and each keeps the follower's [`Position`] its own way. The loop in
//! `follow` owns every rule of reading, proving, waiting and retrying; a
//! sink only takes a page with the position after it.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::value::RawValue;

use plan_intake_wire::feed::FeedCursor;

use super::{FollowError, Page};

/// Where a follower stands after the pages it handed on: the feed cursor
/// and, verifying, the proof so far. Opaque: store [`Position::as_str`]
/// with what the page produced, in the same transaction, and give it back
/// ([`Position::from_saved`]) to resume exactly after that page. The text
/// is what a cursor file holds, so either can be moved into the other.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Position(String);

impl Position {
    /// After `cursor`, with the proof so far (`proof`: lines, or empty).
    pub(crate) fn after(cursor: &FeedCursor, proof: &str) -> Self {
        Self(format!("{cursor}\n{proof}"))
    }

    /// A position as it was stored. Blank text is refused: it is no
    /// position, and starting anywhere instead could skip receipts.
    pub fn from_saved(text: impl Into<String>) -> Result<Self, FollowError> {
        let text = text.into();
        if text.trim().is_empty() {
            return Err(FollowError::BadCursor(
                "the saved position is empty".to_owned(),
            ));
        }
        Ok(Self(text))
    }

    /// The text to store.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The feed cursor (the first line).
    pub(crate) fn cursor(&self) -> FeedCursor {
        let text = self.0.trim_start();
        let (cursor, _) = text.split_once('\n').unwrap_or((text, ""));
        FeedCursor::new(cursor.trim())
    }

    /// The lines after the cursor's: a verifying follower's proof.
    pub(crate) fn proof_lines(&self) -> &str {
        self.0
            .trim_start()
            .split_once('\n')
            .map_or("", |(_, rest)| rest)
    }

    /// Verifying: how many of the log's leaves were proven and handed on
    /// (the log index of the next receipt). `None` when not verifying.
    pub fn verified_leaves(&self) -> Option<u64> {
        self.proof_word("verified")?.parse().ok()
    }

    /// Verifying: the last checkpoint the proof met, `SIZE ROOT ORIGIN`.
    pub fn checkpoint(&self) -> Option<&str> {
        self.proof_word("checkpoint")
    }

    fn proof_word(&self, word: &str) -> Option<&str> {
        self.proof_lines().lines().find_map(|line| {
            line.strip_prefix(word)
                .and_then(|rest| rest.strip_prefix(' '))
        })
    }
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a sink did not take a page.
#[derive(Debug)]
pub enum Refusal {
    /// Not now (a consumer's database restarting, a command that failed):
    /// nothing of the page was kept, and it is handed on again after a
    /// backoff, without end, told at WARN.
    Again(String),
    /// Never: the follower stops with this error.
    Stop(FollowError),
    /// The saved position is no longer the one this follower saved last
    /// (its previous run's last COMMIT landing late, or another follower
    /// on the same store): nothing of the page was kept, and the follower
    /// goes on from the position now saved ([`Sink::saved`]), told at WARN.
    Moved,
}

impl From<FollowError> for Refusal {
    fn from(error: FollowError) -> Self {
        Self::Stop(error)
    }
}

/// A way of handing pages on. A fourth way is a fourth implementation;
/// the rules of following stay in the loop.
pub trait Sink {
    /// The position saved last; `None`: none yet (the follower starts at
    /// the feed's first receipt or its end, as the options say).
    fn saved(&mut self) -> Result<Option<Position>, FollowError>;

    /// Keeps `page` and `position` (where the follower stands after it)
    /// both or neither: after a crash at any instant the saved position
    /// and what was kept agree. `after`: the cursor the page was read
    /// after (`None` at the feed's start). A page may hold no receipts:
    /// only the position moved (the start at the feed's end, saved before
    /// the first page so that receipts written meanwhile are not skipped).
    fn take(
        &mut self,
        page: &Page,
        after: Option<&FeedCursor>,
        position: &Position,
    ) -> Result<(), Refusal>;

    /// What keeps the position, for messages (`cursor file X`).
    fn keeper(&self) -> String;
}

/// The cursor file's sinks: the page goes to the output or to `CMD`, and
/// only then is its position saved (at least once: a crash between the
/// two hands the page on again).
pub(crate) struct CursorFile<'a> {
    path: PathBuf,
    hand: Hand<'a>,
}

/// Where a cursor file's pages go.
pub(crate) enum Hand<'a> {
    /// Written and flushed.
    Output(&'a mut dyn Write),
    /// `sh -c CMD`, until it exits 0.
    Exec(String),
    /// Handed on by the caller before `take` (the async follower's).
    #[cfg_attr(not(feature = "async"), allow(dead_code))]
    Before,
}

impl<'a> CursorFile<'a> {
    /// Checked before anything is read: a page handed on whose cursor then
    /// cannot be saved would come again.
    pub(crate) fn new(path: &Path, hand: Hand<'a>) -> Result<Self, FollowError> {
        if path.as_os_str().is_empty() {
            return Err(FollowError::Options(
                "no cursor_file: following into a cursor file needs one (or follow_from, follow_into keep a Position instead)".to_owned(),
            ));
        }
        check_cursor_writable(path)?;
        Ok(Self {
            path: path.to_owned(),
            hand,
        })
    }

    /// The position in the file; an empty file is refused.
    pub(crate) fn read(&self) -> Result<Option<Position>, FollowError> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) if text.trim().is_empty() => Err(FollowError::BadCursor(format!(
                "cursor file {} is empty; remove it to start at the feed's end",
                self.path.display()
            ))),
            Ok(text) => Ok(Some(Position(text))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(FollowError::CursorFile {
                path: self.path.clone(),
                source,
            }),
        }
    }

    pub(crate) fn save(&self, position: &Position) -> Result<(), FollowError> {
        save_position(&self.path, position)
    }
}

impl Sink for CursorFile<'_> {
    fn saved(&mut self) -> Result<Option<Position>, FollowError> {
        self.read()
    }

    fn take(
        &mut self,
        page: &Page,
        after: Option<&FeedCursor>,
        position: &Position,
    ) -> Result<(), Refusal> {
        if !page.receipts.is_empty() {
            #[cfg(feature = "test-seams")]
            defect_cursor_saved_before_page(self, position)?;
            match &mut self.hand {
                Hand::Output(out) => out
                    .write_all(&lines_of(page))
                    .and_then(|()| out.flush())
                    .map_err(FollowError::Output)?,
                Hand::Exec(command) => exec(command, page, after)?,
                Hand::Before => {}
            }
        }
        self.save(position)?;
        Ok(())
    }

    fn keeper(&self) -> String {
        format!("cursor file {}", self.path.display())
    }
}

/// Test seam, a known defect for the soak to find: with
/// `PLAN_INTAKE_TEST_DEFECT_CURSOR_BEFORE_PAGE` set, a page's cursor is
/// saved before the page is handed on, so a crash in between loses it.
#[cfg(feature = "test-seams")]
fn defect_cursor_saved_before_page(
    file: &CursorFile<'_>,
    position: &Position,
) -> Result<(), FollowError> {
    if std::env::var_os("PLAN_INTAKE_TEST_DEFECT_CURSOR_BEFORE_PAGE").is_some() {
        file.save(position)?;
    }
    Ok(())
}

/// One page to `sh -c CMD`: taken when it exits 0.
fn exec(command: &str, page: &Page, after: Option<&FeedCursor>) -> Result<(), Refusal> {
    match run_command(command, &lines_of(page), &PageFacts::of(page, after)) {
        Ok(status) if status.success() => Ok(()),
        // `sh`'s own answer for a command it could not start: not
        // found (127) or not executable (126). Retrying cannot help.
        Ok(status) if matches!(status.code(), Some(126 | 127)) => {
            Err(Refusal::Stop(FollowError::Exec {
                command: command.to_owned(),
                source: io::Error::other(format!(
                    "{status}: the command was not found or is not executable"
                )),
            }))
        }
        Ok(status) => Err(Refusal::Again(format!("`{command}` {status}"))),
        Err(source) => Err(Refusal::Stop(FollowError::Exec {
            command: command.to_owned(),
            source,
        })),
    }
}

/// A caller's code as the sink: it commits each page with its position
/// itself, and gave the follower the position it saved last.
pub(crate) struct Handler<H> {
    pub(crate) saved: Option<Position>,
    pub(crate) handle: H,
}

impl<H, E> Sink for Handler<H>
where
    H: FnMut(&Page, &Position) -> Result<(), E>,
    E: std::fmt::Display,
{
    fn saved(&mut self) -> Result<Option<Position>, FollowError> {
        Ok(self.saved.clone())
    }

    fn take(
        &mut self,
        page: &Page,
        _after: Option<&FeedCursor>,
        position: &Position,
    ) -> Result<(), Refusal> {
        (self.handle)(page, position)
            .map_err(|e| Refusal::Again(format!("the page's handler failed: {e}")))
    }

    fn keeper(&self) -> String {
        "the position given".to_owned()
    }
}

/// The cursor file can be written where it is to be (its directory exists
/// and takes a file), checked before anything is read: a page handed on
/// whose cursor then cannot be saved would come again.
pub(crate) fn check_cursor_writable(path: &Path) -> Result<(), FollowError> {
    let failed = |source| FollowError::CursorFile {
        path: path.to_owned(),
        source,
    };
    let directory = directory_of(path);
    let mut probe_name = path.file_name().unwrap_or_default().to_owned();
    probe_name.push(".probe");
    let probe = directory.join(probe_name);
    File::create(&probe).map_err(failed)?;
    std::fs::remove_file(&probe).map_err(failed)
}

/// A page's entries as JSON lines, byte for byte as sent.
pub(crate) fn lines_of(page: &Page) -> Vec<u8> {
    let entries = &page.receipts;
    let mut lines = Vec::with_capacity(entries.iter().map(|e| e.get().len() + 1).sum());
    for entry in entries {
        lines.extend_from_slice(entry.get().as_bytes());
        lines.push(b'\n');
    }
    lines
}

/// What `CMD` is told about the page it is handed, in its environment.
struct PageFacts {
    receipts: usize,
    first: String,
    last: String,
    after: String,
    next: String,
}

impl PageFacts {
    fn of(page: &Page, after: Option<&FeedCursor>) -> Self {
        let receipt_id = |entry: Option<&Box<RawValue>>| {
            #[derive(serde::Deserialize)]
            struct Entry {
                receipt_id: Option<String>,
                receipt: Option<Receipted>,
            }
            #[derive(serde::Deserialize)]
            struct Receipted {
                receipt_id: String,
            }
            entry
                .and_then(|e| serde_json::from_str::<Entry>(e.get()).ok())
                .and_then(|e| e.receipt_id.or(e.receipt.map(|r| r.receipt_id)))
                .unwrap_or_default()
        };
        Self {
            receipts: page.receipts.len(),
            first: receipt_id(page.receipts.first()),
            last: receipt_id(page.receipts.last()),
            after: after.map(|c| c.as_str().to_owned()).unwrap_or_default(),
            next: page.next.as_str().to_owned(),
        }
    }
}

/// `sh -c CMD` with `lines` on its stdin and the page's facts in its
/// environment (`PLAN_INTAKE_PAGE_RECEIPTS`, `_FIRST`, `_LAST`: the count
/// and the first and last receipt ids; `_AFTER`: the cursor the page was
/// read after, empty at the feed's start; `_NEXT`: the cursor saved once
/// CMD exits 0). Never the reader's token: `PLAN_INTAKE_TOKEN` is removed.
/// It runs in a process group of its own, so a Ctrl-C meant for the
/// follower does not cut the page short: the follower finishes the page and
/// then stops.
fn run_command(
    command: &str,
    lines: &[u8],
    page: &PageFacts,
) -> io::Result<std::process::ExitStatus> {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(command)
        .env_remove("PLAN_INTAKE_TOKEN")
        .env("PLAN_INTAKE_PAGE_RECEIPTS", page.receipts.to_string())
        .env("PLAN_INTAKE_PAGE_FIRST", &page.first)
        .env("PLAN_INTAKE_PAGE_LAST", &page.last)
        .env("PLAN_INTAKE_PAGE_AFTER", &page.after)
        .env("PLAN_INTAKE_PAGE_NEXT", &page.next)
        .stdin(Stdio::piped())
        .process_group(0)
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        // A CMD that exits without reading everything is judged by its exit
        // status, not by the broken pipe.
        let _ = stdin.write_all(lines);
    }
    child.wait()
}

/// Replaces the cursor file so that a crash at any moment leaves either the
/// old cursor or the new one, never a torn one: temp file, fsync, rename,
/// fsync of the directory (which makes the rename itself durable).
pub(crate) fn save_position(path: &Path, position: &Position) -> Result<(), FollowError> {
    let failed = |source| FollowError::CursorFile {
        path: path.to_owned(),
        source,
    };
    let directory = directory_of(path);
    let mut temporary_name = path.file_name().unwrap_or_default().to_owned();
    temporary_name.push(".tmp");
    let temporary = directory.join(temporary_name);
    let mut file = File::create(&temporary).map_err(failed)?;
    file.write_all(position.as_str().as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(failed)?;
    drop(file);
    std::fs::rename(&temporary, path).map_err(failed)?;
    File::open(directory)
        .and_then(|dir| dir.sync_all())
        .map_err(failed)
}

/// The directory a file is in (`.` for a bare name).
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}
