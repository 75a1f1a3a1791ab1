//! The rooms of ARCHITECTURE.md (Rooms) and what each may use, held by
//! reading the sources: every path a room's code names (`crate::x`,
//! `plan_intake::x`, and `super::` chains that climb out of the room) is
//! resolved to the room it reaches, and every room must reach only what
//! its row allows. What paths cannot show (a field of the facade reached
//! from the door) is kept out of reach by privacy: `Intake`'s database
//! and `Database`'s pool are private, with accessors only under the
//! `test-seams` feature, which the door must not call.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The rooms that use nothing and that every room may use.
const LEAVES: [&str; 6] = ["config", "deadline", "metrics", "report", "clock", "stdout"];

/// Macros exported at the crate's root, by the room that defines them.
const MACROS: [(&str, &str); 1] = [("with_conn", "storage")];

/// Each room (a module of the crate) and the rooms it may use besides the
/// leaves; `main.rs` may use everything and is not listed.
const RULES: [(&str, &[&str]); 12] = [
    ("serve", &["http", "intake", "storage"]),
    ("verify", &["intake", "storage"]),
    ("evidence", &["intake", "storage"]),
    ("http", &["intake"]),
    ("intake", &["storage"]),
    ("storage", &[]),
    ("config", &[]),
    ("metrics", &[]),
    ("deadline", &[]),
    ("report", &[]),
    ("stdout", &[]),
    ("clock", &[]),
];

/// The files of `room`: `src/room.rs` or `src/room/…`, each with its
/// module path inside the crate.
fn sources(room: &str) -> Vec<(PathBuf, Vec<String>, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    let file = src.join(format!("{room}.rs"));
    if file.exists() {
        let text = std::fs::read_to_string(&file).expect("a source file");
        found.push((file, vec![room.to_owned()], text));
    }
    let mut dirs = vec![src.join(room)];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(&src).expect("under src");
                let mut module: Vec<String> = relative
                    .with_extension("")
                    .iter()
                    .map(|p| p.to_string_lossy().into_owned())
                    .collect();
                if module.last().is_some_and(|m| m == "mod") {
                    module.pop();
                }
                let text = std::fs::read_to_string(&path).expect("a source file");
                found.push((path, module, text));
            }
        }
    }
    assert!(!found.is_empty(), "no sources for room {room}");
    found
}

/// The code of a line: comments and string literals cut away.
fn code_of(line: &str) -> String {
    let mut code = String::new();
    let mut in_string = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            // A char literal of a quote is not a string.
            '\'' if !in_string && chars.peek() == Some(&'"') => {
                chars.next();
                chars.next();
            }
            '"' => in_string = !in_string,
            '\\' if in_string => {
                chars.next();
            }
            '/' if !in_string && chars.peek() == Some(&'/') => break,
            c if !in_string => code.push(c),
            _ => {}
        }
    }
    code
}

/// Every room of the crate a line of a file at `module` reaches, with the
/// path that reaches it.
fn reached(module: &[String], code: &str) -> Vec<(String, String)> {
    let mut rooms = Vec::new();
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.contains("::"))
        .collect();
    for word in words {
        let parts: Vec<&str> = word.split("::").filter(|p| !p.is_empty()).collect();
        let room = match parts.first() {
            Some(&"crate") | Some(&"plan_intake") => parts.get(1).copied(),
            Some(&"super") => {
                // `self` is the file's module; each `super` climbs one.
                let climbs = parts.iter().take_while(|p| **p == "super").count();
                if climbs >= module.len() {
                    parts.get(climbs).copied()
                } else {
                    None
                }
            }
            _ => None,
        };
        if let Some(room) = room {
            let room = MACROS
                .iter()
                .find(|(name, _)| *name == room)
                .map_or(room, |(_, owner)| owner);
            rooms.push((room.to_owned(), word.to_owned()));
        }
    }
    rooms
}

#[test]
fn every_room_uses_only_what_its_row_allows() {
    let mut crossings = Vec::new();
    for (room, allowed) in RULES {
        for (path, module, text) in sources(room) {
            let mut in_tests = false;
            for (n, line) in text.lines().enumerate() {
                // A room's own unit tests may reach further (they build
                // what the room is given).
                if line.trim_start().starts_with("#[cfg(test)]") {
                    in_tests = true;
                }
                if in_tests {
                    continue;
                }
                for (reached, via) in reached(&module, &code_of(line)) {
                    let fine = reached == room
                        || LEAVES.contains(&reached.as_str())
                        || allowed.contains(&reached.as_str())
                        || ["std", "core", "alloc"].contains(&reached.as_str());
                    if !fine {
                        crossings.push(format!(
                            "{}:{}: {room} reaches {reached} ({via})",
                            path.display(),
                            n + 1
                        ));
                    }
                }
            }
        }
    }
    assert_eq!(crossings, Vec::<String>::new());
}

/// The reader itself: paths that climb out of a room are seen, and a
/// comment or a string naming a room is not.
#[test]
fn the_reader_resolves_paths_not_words() {
    let module = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let rooms = |m: &[&str], line: &str| -> BTreeSet<String> {
        reached(&module(m), &code_of(line))
            .into_iter()
            .map(|(room, _)| room)
            .collect()
    };
    let set = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        rooms(&["http", "plans"], "use crate::storage::Database;"),
        set(&["storage"])
    );
    assert_eq!(
        rooms(
            &["storage", "feed", "signal"],
            "use super::super::super::intake::X;"
        ),
        set(&["intake"])
    );
    assert_eq!(
        rooms(&["storage", "feed", "signal"], "use super::super::plans;"),
        set(&[])
    );
    assert_eq!(rooms(&["http"], "let x = 1; // crate::storage"), set(&[]));
    assert_eq!(
        rooms(&["http"], r#"let s = "crate::storage::x";"#),
        set(&[])
    );
    assert_eq!(
        rooms(&["intake", "mod"], "plan_intake::http::app(s)"),
        set(&["http"])
    );
}

/// The test seams that open the facade's database and the pool are for
/// tests only: no room's code calls them.
#[test]
fn the_test_seams_into_the_database_are_used_by_tests_only() {
    let mut found = Vec::new();
    for (room, _) in RULES {
        for (path, _, text) in sources(room) {
            for (n, line) in text.lines().enumerate() {
                let code = code_of(line);
                if code.contains(".database()") || code.contains(".pool_for_tests()") {
                    found.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert_eq!(found, Vec::<String>::new());
}

/// A planner that depends on the client crate gets nothing of the server:
/// its dependency tree holds no actix, diesel, libpq or SQLite.
#[test]
fn the_client_crate_brings_nothing_of_the_server() {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "--package",
            "plan-intake-client",
            "--edges",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(tree.contains("plan-intake-wire"), "{tree}");
    for server in [
        "actix",
        "diesel",
        "pq-sys",
        "libsqlite3-sys",
        "plan-intake v",
    ] {
        assert!(
            !tree.lines().any(|l| l.starts_with(server)),
            "the client brings {server}:\n{tree}"
        );
    }
}
