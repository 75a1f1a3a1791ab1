//! The history: every answer a planner got, every receipt the follower
//! handed on, every fault, with its time since the start, as JSON lines in
//! a file and in memory for the checker.

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
