//! The history: every final answer a planner got, every receipt the
//! in-process follower handed on, every fault and phase, with its time
//! since the start, as JSON lines in a file and in memory for the checker.
//! At the end every answer the instances logged (status, key,
//! `Retry-After`) is copied to the file as well (`answer`); the reader
//! processes' output stays in files of their own.

use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use serde_json::{Value, json};

pub struct History {
    started: Instant,
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
        if let Ok(mut events) = self.events.lock() {
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

    /// Every event of `kind`, in the order recorded.
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
