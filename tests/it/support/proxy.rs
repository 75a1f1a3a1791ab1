//! A fault-injecting TCP proxy between the service's pool and Postgres. It
//! reads the frontend protocol just far enough to find the moment a write
//! commits: a simple-query `COMMIT`, or the `Sync` that ends (and so
//! autocommits) an extended-protocol statement that writes the plan, found
//! by the SQL its prepared statement was parsed from.
//! It can act on that moment:
//!
//! - `CutBeforeCommit`: close both sides without forwarding it (it did not land);
//! - `CutAfterCommit`: forward it, let the server answer, swallow the answer
//!   and close (it landed, the answer was lost);
//! - after either, optionally cut every other session and refuse new ones
//!   (the re-read fails).
//!
//! The client must connect with `sslmode=disable&gssencmode=disable` so that
//! every message after the startup packet is framed as type + length.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    CutBeforeCommit,
    CutAfterCommit,
}

type Hook = Box<dyn FnOnce() + Send>;

struct Armed {
    fault: Fault,
    /// Then cut every session and refuse new ones, until `heal`.
    refuse_after: bool,
    /// Runs after the server side is closed and before the client side is.
    hook: Option<Hook>,
}

#[derive(Default)]
struct Shared {
    armed: Mutex<Option<Armed>>,
    refusing: AtomicBool,
    sockets: Mutex<Vec<TcpStream>>,
    fired: Mutex<Vec<Fault>>,
}

pub struct FaultProxy {
    pub port: u16,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Listens on a free local port and forwards to `upstream` (`host:port`).
    pub fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared::default());
        let accept_shared = Arc::clone(&shared);
        thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if accept_shared.refusing.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                // Messages are forwarded one by one: without NODELAY, Nagle and
                // delayed ACKs add tens of milliseconds to every round trip.
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                Session::start(client, server, Arc::clone(&accept_shared));
            }
        });
        Self { port, shared }
    }

    /// Acts on the next COMMIT that passes, once.
    pub fn arm(&self, fault: Fault, refuse_after: bool, hook: Option<Hook>) {
        *self.shared.armed.lock().expect("lock") = Some(Armed {
            fault,
            refuse_after,
            hook,
        });
    }

    /// Accepts connections again after a refusal.
    pub fn heal(&self) {
        self.shared.refusing.store(false, Ordering::SeqCst);
    }

    /// The faults that have fired, in order.
    pub fn fired(&self) -> Vec<Fault> {
        self.shared.fired.lock().expect("lock").clone()
    }

    /// `url` (which names the upstream) rewritten to pass through this proxy.
    pub fn url_for(&self, url: &str, upstream: &str) -> String {
        let proxied = url.replacen(upstream, &format!("127.0.0.1:{}", self.port), 1);
        let separator = if proxied.contains('?') { '&' } else { '?' };
        format!("{proxied}{separator}sslmode=disable&gssencmode=disable")
    }
}

/// `host:port` of a `postgres://user@host:port/db` URL (port 5432 if absent).
pub fn upstream_of(url: &str) -> String {
    let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
    let after_user = after_scheme
        .rsplit_once('@')
        .map_or(after_scheme, |(_, rest)| rest);
    let host_port = after_user.split(['/', '?']).next().unwrap_or(after_user);
    if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    }
}

struct Session {
    client: TcpStream,
    server: TcpStream,
    /// Set once COMMIT was forwarded under `CutAfterCommit`: the server's
    /// answer is swallowed up to ReadyForQuery, then both sides are closed.
    swallow: Arc<Mutex<Option<Armed>>>,
    shared: Arc<Shared>,
}

impl Session {
    fn start(client: TcpStream, server: TcpStream, shared: Arc<Shared>) {
        {
            let mut sockets = shared.sockets.lock().expect("lock");
            for socket in [&client, &server] {
                if let Ok(clone) = socket.try_clone() {
                    sockets.push(clone);
                }
            }
        }
        let swallow = Arc::new(Mutex::new(None));
        let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
            return;
        };
        let upstream = Session {
            client,
            server,
            swallow: Arc::clone(&swallow),
            shared: Arc::clone(&shared),
        };
        let downstream = Session {
            client: client2,
            server: server2,
            swallow,
            shared,
        };
        thread::spawn(move || {
            let _ = upstream.client_to_server();
        });
        thread::spawn(move || {
            let _ = downstream.server_to_client();
        });
    }

    fn client_to_server(mut self) -> io::Result<()> {
        // The startup packet: length (itself included), then its body.
        let startup = read_untyped(&mut self.client)?;
        self.server.write_all(&startup)?;
        // Prepared statements that write the plan (by name), and whether the
        // statement bound last is one: its Sync commits it.
        let mut writing_statements = std::collections::HashSet::new();
        let mut write_pending = false;
        loop {
            let message = read_typed(&mut self.client)?;
            match message[0] {
                // Parse: statement name, then its SQL.
                b'P' => {
                    let mut parts = message[5..].split(|b| *b == 0);
                    let name = parts.next().unwrap_or_default().to_vec();
                    let sql = String::from_utf8_lossy(parts.next().unwrap_or_default());
                    // A name (the unnamed one included) is reused by the next Parse.
                    if sql.contains("plan_intake_write") {
                        writing_statements.insert(name);
                    } else {
                        writing_statements.remove(&name);
                    }
                }
                // Bind: portal name, then statement name.
                b'B' => {
                    let mut parts = message[5..].split(|b| *b == 0);
                    let _portal = parts.next();
                    let statement = parts.next().unwrap_or_default();
                    write_pending = writing_statements.contains(statement);
                }
                _ => {}
            }
            let commits =
                is_commit(&message) || (message[0] == b'S' && std::mem::take(&mut write_pending));
            if commits {
                let armed = self.shared.armed.lock().expect("lock").take();
                if let Some(armed) = armed {
                    self.shared.fired.lock().expect("lock").push(armed.fault);
                    match armed.fault {
                        Fault::CutBeforeCommit => {
                            // Server first: its transaction aborts and releases
                            // its locks before the hook runs.
                            let _ = self.server.shutdown(Shutdown::Both);
                            finish(armed, &self.shared);
                            let _ = self.client.shutdown(Shutdown::Both);
                            return Ok(());
                        }
                        Fault::CutAfterCommit => {
                            *self.swallow.lock().expect("lock") = Some(armed);
                        }
                    }
                }
            }
            self.server.write_all(&message)?;
        }
    }

    fn server_to_client(mut self) -> io::Result<()> {
        loop {
            let message = read_typed(&mut self.server)?;
            let swallowing = self.swallow.lock().expect("lock").is_some();
            if !swallowing {
                self.client.write_all(&message)?;
                continue;
            }
            // ReadyForQuery: COMMIT's answer is complete, and lost.
            if message[0] == b'Z' {
                let armed = self.swallow.lock().expect("lock").take();
                let _ = self.server.shutdown(Shutdown::Both);
                if let Some(armed) = armed {
                    finish(armed, &self.shared);
                }
                let _ = self.client.shutdown(Shutdown::Both);
                return Ok(());
            }
        }
    }
}

fn finish(armed: Armed, shared: &Shared) {
    if let Some(hook) = armed.hook {
        hook();
    }
    if armed.refuse_after {
        shared.refusing.store(true, Ordering::SeqCst);
        for socket in shared.sockets.lock().expect("lock").drain(..) {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

fn is_commit(message: &[u8]) -> bool {
    if message.first() != Some(&b'Q') {
        return false;
    }
    let text = String::from_utf8_lossy(&message[5..]);
    let text = text.trim_end_matches('\0').trim().trim_end_matches(';');
    text.eq_ignore_ascii_case("COMMIT")
}

fn read_untyped(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let total = u32::from_be_bytes(len) as usize;
    let mut message = len.to_vec();
    message.resize(total.max(4), 0);
    stream.read_exact(&mut message[4..])?;
    Ok(message)
}

fn read_typed(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut head = [0u8; 5];
    stream.read_exact(&mut head)?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let mut message = head.to_vec();
    message.resize(1 + len.max(4), 0);
    stream.read_exact(&mut message[5..])?;
    Ok(message)
}
