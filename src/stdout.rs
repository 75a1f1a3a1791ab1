//! Standard output as the command line hands results on: every write is
//! checked and flushed, and an output that is gone is an error, never a
//! silent success. A command whose stdout was closed before it started
//! finds it reopened on `/dev/null` by the Rust runtime (read and write, so
//! that writes succeed and go nowhere); that is told apart from a caller's
//! own `>/dev/null` (write only) and refused before anything is handed on.

use std::io::{self, Write};

/// The process's stdout, checked: see the module's documentation.
pub struct Stdout(io::Stdout);

/// Stdout if it leads somewhere; `Err` (`EBADF`) when it was closed.
pub fn open() -> io::Result<Stdout> {
    if closed_at_start() {
        return Err(io::Error::from_raw_os_error(9)); // EBADF
    }
    Ok(Stdout(io::stdout()))
}

/// Writes `text` and a newline to stdout, flushed; `Err` when it is gone.
pub fn line(text: &str) -> io::Result<()> {
    let mut out = open()?;
    writeln!(out, "{text}")?;
    out.flush()
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.0.lock().write_all(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.lock().flush()
    }
}

/// fd 1 is `/dev/null` opened for reading and writing: what the runtime
/// puts in place of a closed stdout (a shell's `>/dev/null` opens it write
/// only). Linux reads it from `/proc`; elsewhere it is not told apart.
fn closed_at_start() -> bool {
    if !cfg!(target_os = "linux") {
        return false;
    }
    let on_null = std::fs::read_link("/proc/self/fd/1").is_ok_and(|p| p.as_os_str() == "/dev/null");
    if !on_null {
        return false;
    }
    std::fs::read_to_string("/proc/self/fdinfo/1").is_ok_and(|info| {
        info.lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok())
            .is_some_and(|flags| flags & 0o3 == 0o2) // O_ACCMODE == O_RDWR
    })
}
