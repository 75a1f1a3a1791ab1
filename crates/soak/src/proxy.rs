//! A fault proxy between an instance and Postgres: every connection the
//! instance makes (its pool, its batch writers, its feed listener) passes
//! through it, so the nemesis can cut them all at once, cut the next one
//! that sends a `COMMIT` right after forwarding it (the commit's outcome
//! unknown to the instance: the case the write path's re-read exists for),
//! or stall them all for a while (a network that stops delivering: locks
//! and key rows stay held meanwhile). The instance connects without TLS
//! (`sslmode=disable`), so the proxy can read the frontend protocol's
//! message frames to find a `COMMIT`.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Shared {
    /// Both ends of every connection open now.
    sockets: Mutex<Vec<(TcpStream, TcpStream)>>,
    /// The next `COMMIT` is forwarded and its connection then cut.
    cut_at_commit: AtomicBool,
    /// Nothing is forwarded while set.
    stalled: AtomicBool,
    /// Set once a cut at a COMMIT fired.
    cut_a_commit: AtomicBool,
    /// The proxy is dropped: accept no more.
    closed: AtomicBool,
    /// Called once, from the connection's own thread, just before the
    /// next statement that writes plans (`plan_intake_write`) is
    /// forwarded: the instance frozen mid-batch.
    at_next_write: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// Where new connections go (`host:port`).
    upstream: Mutex<String>,
    /// Bytes pumped both ways unread: no `COMMIT` to find (a forwarder,
    /// which TLS may pass through).
    plain: bool,
}

pub struct FaultProxy {
    pub port: u16,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Listens on a free local port, forwarding to `upstream` (`host:port`).
    pub fn start(upstream: String) -> Result<Self, String> {
        Self::listen(upstream, false)
    }

    /// A plain forwarder to `upstream` that [`FaultProxy::set_upstream`]
    /// points elsewhere: the one address that follows the primary (a
    /// virtual IP, or a proxy that asks Patroni who leads).
    pub fn forwarder(upstream: String) -> Result<Self, String> {
        Self::listen(upstream, true)
    }

    fn listen(upstream: String, plain: bool) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream),
            plain,
            ..Shared::default()
        });
        let accepting = shared.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if accepting.closed.load(Ordering::SeqCst) {
                    break;
                }
                let upstream = accepting
                    .upstream
                    .lock()
                    .map(|u| u.clone())
                    .unwrap_or_default();
                let Ok(server) = TcpStream::connect(&upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
                    client.try_clone(),
                    server.try_clone(),
                    client.try_clone(),
                    server.try_clone(),
                ) else {
                    continue;
                };
                if let Ok(mut sockets) = accepting.sockets.lock() {
                    sockets.retain(|(c, _)| c.peer_addr().is_ok());
                    sockets.push((c3, s3));
                }
                let up = accepting.clone();
                if accepting.plain {
                    std::thread::spawn(move || pump(client, server, &up));
                } else {
                    std::thread::spawn(move || frontend_to_server(client, server, &up));
                }
                let down = accepting.clone();
                std::thread::spawn(move || pump(s2, c2, &down));
            }
        });
        Ok(Self { port, shared })
    }

    /// New connections go to `upstream` from now on (the ones open stay
    /// where they are: [`FaultProxy::cut_all`] ends them).
    pub fn set_upstream(&self, upstream: String) {
        if let Ok(mut to) = self.shared.upstream.lock() {
            *to = upstream;
        }
    }

    /// Every connection open now, cut.
    pub fn cut_all(&self) {
        if let Ok(mut sockets) = self.shared.sockets.lock() {
            for (client, server) in sockets.drain(..) {
                let _ = server.shutdown(Shutdown::Both);
                let _ = client.shutdown(Shutdown::Both);
            }
        }
    }

    /// The next connection to send a `COMMIT` is cut right after it is
    /// forwarded; true when one was within `within`.
    pub fn cut_at_next_commit(&self, within: Duration) -> bool {
        self.shared.cut_a_commit.store(false, Ordering::SeqCst);
        self.shared.cut_at_commit.store(true, Ordering::SeqCst);
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            if self.shared.cut_a_commit.load(Ordering::SeqCst) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shared.cut_at_commit.store(false, Ordering::SeqCst);
        self.shared.cut_a_commit.load(Ordering::SeqCst)
    }

    /// `hook` runs once, just before the next statement writing plans is
    /// forwarded; true when one was within `within` (else it is dropped
    /// unrun).
    pub fn at_next_write(&self, within: Duration, hook: Box<dyn FnOnce() + Send>) -> bool {
        if let Ok(mut armed) = self.shared.at_next_write.lock() {
            *armed = Some(hook);
        }
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            if self
                .shared
                .at_next_write
                .lock()
                .map_or(true, |armed| armed.is_none())
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shared
            .at_next_write
            .lock()
            .map_or(true, |mut armed| armed.take().is_none())
    }

    /// Nothing forwarded, either way, while `stalled`.
    pub fn set_stalled(&self, stalled: bool) {
        self.shared.stalled.store(stalled, Ordering::SeqCst);
    }

    /// Nothing forwarded, either way, for `stall`.
    pub fn stall(&self, stall: Duration) {
        self.shared.stalled.store(true, Ordering::SeqCst);
        std::thread::sleep(stall);
        self.shared.stalled.store(false, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.shared.stalled.store(false, Ordering::SeqCst);
        // Wakes the accepting thread, which then ends.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        self.cut_all();
    }
}

/// Waits while the proxy is stalled.
fn wait_while_stalled(shared: &Shared) {
    while shared.stalled.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Server to client: bytes as they come.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        wait_while_stalled(shared);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// Client to server, read as the frontend protocol's frames (a startup
/// packet, then a type byte and a length each): a simple-query `COMMIT`
/// while a cut is armed is forwarded, and then both ends are closed.
fn frontend_to_server(mut client: TcpStream, mut server: TcpStream, shared: &Shared) {
    let mut buf = [0u8; 16 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    let mut started = false;
    loop {
        let n = match client.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        // Whole frames go on; a partial one waits for the rest.
        let mut whole = 0;
        let mut commit_ends = None;
        let mut writes = false;
        loop {
            let rest = &pending[whole..];
            let (header, frame) = if started {
                if rest.len() < 5 {
                    break;
                }
                (1, 1 + be_u32(&rest[1..5]))
            } else {
                if rest.len() < 4 {
                    break;
                }
                (0, be_u32(&rest[0..4]))
            };
            if frame < 4 + header || rest.len() < frame {
                break;
            }
            if started && rest[0] == b'Q' && is_commit(&rest[5..frame]) {
                commit_ends = Some(whole + frame);
            }
            // A simple query or a prepared statement's Parse.
            if started && matches!(rest[0], b'Q' | b'P') && writes_plans(&rest[5..frame]) {
                writes = true;
            }
            started = true;
            whole += frame;
        }
        wait_while_stalled(shared);
        if writes && let Some(hook) = shared.at_next_write.lock().ok().and_then(|mut h| h.take()) {
            hook();
        }
        if let Some(end) = commit_ends
            && shared.cut_at_commit.swap(false, Ordering::SeqCst)
        {
            let _ = server.write_all(&pending[..end]);
            shared.cut_a_commit.store(true, Ordering::SeqCst);
            break;
        }
        if server.write_all(&pending[..whole]).is_err() {
            break;
        }
        pending.drain(..whole);
    }
    let _ = server.shutdown(Shutdown::Both);
    let _ = client.shutdown(Shutdown::Both);
}

/// A statement that calls the write function (alone or for a batch).
fn writes_plans(frame: &[u8]) -> bool {
    frame
        .windows(b"plan_intake_write".len())
        .any(|w| w == b"plan_intake_write")
}

fn be_u32(bytes: &[u8]) -> usize {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize
}

/// A simple query that is `COMMIT` (diesel ends its transactions so).
fn is_commit(query: &[u8]) -> bool {
    let text = String::from_utf8_lossy(query);
    text.trim_end_matches('\0')
        .trim()
        .trim_end_matches(';')
        .eq_ignore_ascii_case("COMMIT")
}
