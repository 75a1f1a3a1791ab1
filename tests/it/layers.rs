//! The rooms' one-way flow (ARCHITECTURE.md, Rooms), held by reading the
//! sources: the door (`src/http`) never names `storage`, `storage` never
//! names `intake` or `http`, `intake` never names `http`, and the callers'
//! `client` reaches nothing but the HTTP API and `intake`'s pure helpers.

use std::path::{Path, PathBuf};

fn sources(room: &str) -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(room);
    let mut found = Vec::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source folder") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                found.push((path, text));
            }
        }
    }
    assert!(!found.is_empty(), "no sources in src/{room}");
    found
}

/// Every line of `room` that names one of `forbidden` as a path
/// (`crate::storage`, `storage::…`, `use …storage`), comments aside.
fn crossings(room: &str, forbidden: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, text) in sources(room) {
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            for name in forbidden {
                let named = code.contains(&format!("crate::{name}"))
                    || code.contains(&format!("{name}::"))
                    || code.contains(&format!("plan_intake::{name}"));
                if named {
                    found.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                }
            }
        }
    }
    found
}

#[test]
fn the_door_never_reaches_the_database() {
    assert_eq!(crossings("http", &["storage"]), Vec::<String>::new());
}

#[test]
fn storage_knows_neither_the_domain_nor_the_door() {
    assert_eq!(
        crossings("storage", &["intake", "http"]),
        Vec::<String>::new()
    );
}

#[test]
fn the_domain_never_reaches_the_door() {
    assert_eq!(crossings("intake", &["http"]), Vec::<String>::new());
}

#[test]
fn the_client_speaks_http_only() {
    assert_eq!(
        crossings("client", &["storage", "http"]),
        Vec::<String>::new()
    );
}
