//! The history: every final answer a planner got, every receipt the
//! in-process follower handed on, every fault and phase, with its time
//! since the start, as JSON lines in a file; in memory too, for the
//! checker, all but the submissions (millions in a long run), which it
//! reads back from the file.
//! At the end every answer the instances logged (status, key,
//! `Retry-After`) is copied to the file as well (`answer`); the reader
//! processes' output stays in files of their own.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use serde_json::{Value, json};

pub struct History {
    started: Instant,
    path: PathBuf,
    file: Mutex<std::io::BufWriter<std::fs::File>>,
    events: Mutex<Vec<Value>>,
}

impl History {
    pub fn create(path: &Path) -> Result<Self, String> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self {
            started: Instant::now(),
            path: path.to_owned(),
            file: Mutex::new(std::io::BufWriter::new(file)),
            events: Mutex::new(Vec::new()),
        })
    }

    /// Records `event` (an object) with its time in seconds since the start.
    pub fn record(&self, mut event: Value) {
        event["t"] = json!(self.started.elapsed().as_secs_f64());
        if let Ok(mut file) = self.file.lock() {
            let _ = writeln!(file, "{event}");
            let _ = file.flush();
        }
        if event["kind"] != "submit"
            && let Ok(mut events) = self.events.lock()
        {
            events.push(event);
        }
    }

    /// Writes `event` (an object) to the file only: one of the instances'
    /// answers, copied at the end (its own time kept).
    pub fn record_to_file(&self, event: Value) {
        if let Ok(mut file) = self.file.lock() {
            let _ = writeln!(file, "{event}");
        }
    }

    /// Calls `each` with every submission's event, in the order
    /// recorded, read back from the file one line at a time.
    pub fn each_submit(&self, mut each: impl FnMut(&Value)) -> Result<(), String> {
        use std::io::BufRead as _;
        if let Ok(mut file) = self.file.lock() {
            file.flush().map_err(|e| e.to_string())?;
        }
        let file =
            std::fs::File::open(&self.path).map_err(|e| format!("{}: {e}", self.path.display()))?;
        for line in std::io::BufReader::new(file).lines() {
            let line = line.map_err(|e| format!("{}: {e}", self.path.display()))?;
            // Cheap before parsing: most lines of a long run are not.
            if !line.contains(r#""kind":"submit""#) {
                continue;
            }
            let event: Value = serde_json::from_str(&line)
                .map_err(|e| format!("{}: {e}: {line}", self.path.display()))?;
            if event["kind"] == "submit" {
                each(&event);
            }
        }
        Ok(())
    }

    /// Every event of `kind` but a submission, in the order recorded.
    pub fn of_kind(&self, kind: &str) -> Vec<Value> {
        self.events
            .lock()
            .map(|events| {
                events
                    .iter()
                    .filter(|e| e["kind"] == kind)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}
