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

/// The workspace's member crates, as the rooms they are.
const CRATES: [(&str, &str); 3] = [
    ("plan_intake_json", "json"),
    ("plan_intake_wire", "wire"),
    ("plan_intake_client", "client"),
];

/// Macros exported at the crate's root, by the room that defines them.
const MACROS: [(&str, &str); 1] = [("with_conn", "storage")];

/// Each room (a module of the crate) and the rooms it may use besides the
/// leaves; `main.rs` may use everything and is not listed.
const RULES: [(&str, &[&str]); 12] = [
    ("serve", &["http", "intake", "storage"]),
    ("verify", &["intake", "storage"]),
    ("evidence", &["intake", "storage"]),
    ("http", &["intake"]),
    ("intake", &["storage", "wire", "json"]),
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

/// The code of `text` a statement at a time, with the line it starts on:
/// comments and strings cut away, a `use` joined onto one line and its
/// group spread (`use crate::{a::X, b};` is `crate::a::X` and `crate::b`),
/// and each item marked `#[cfg(test)]` (a room's own unit tests, which
/// build what the room is given) left out.
fn statements(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<String> = text.lines().map(code_of).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim().to_owned();
        if line.starts_with("#[cfg(test)]") {
            // Skip the item that follows: to its `;`, or to the brace that
            // closes what it opens.
            let (mut depth, mut opened) = (0i32, false);
            i += 1;
            while i < lines.len() {
                let l = &lines[i];
                depth += l.matches('{').count() as i32 - l.matches('}').count() as i32;
                opened |= l.contains('{');
                i += 1;
                if (opened && depth <= 0) || (!opened && l.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        let is_use = ["use ", "pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .any(|start| line.starts_with(start));
        if is_use {
            let start = i;
            let mut joined = line.clone();
            while !joined.trim_end().ends_with(';') && i + 1 < lines.len() {
                i += 1;
                joined.push(' ');
                joined.push_str(lines[i].trim());
            }
            for path in spread(&joined) {
                out.push((start + 1, path));
            }
            i += 1;
            continue;
        }
        out.push((i + 1, line));
        i += 1;
    }
    out
}

/// A `use` statement's paths, its first group spread: `use
/// crate::{a::X, b::{Y, Z}};` is `crate::a::X` and `crate::b::{Y, Z}`.
fn spread(statement: &str) -> Vec<String> {
    let body = statement
        .trim_end_matches(';')
        .split_once("use ")
        .map_or("", |(_, rest)| rest)
        .trim();
    let Some((prefix, group)) = body.split_once("::{") else {
        return vec![body.to_owned()];
    };
    let group = group.strip_suffix('}').unwrap_or(group);
    let mut items = Vec::new();
    let (mut depth, mut current) = (0, String::new());
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    items.push(current);
    items
        .into_iter()
        .map(|item| item.trim().to_owned())
        .filter(|item| !item.is_empty())
        .map(|item| format!("{prefix}::{item}"))
        .collect()
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
        if let Some((_, room)) = parts
            .first()
            .and_then(|p| CRATES.iter().find(|(c, _)| c == p))
        {
            rooms.push((room.to_string(), word.to_owned()));
            continue;
        }
        let room = match parts.first() {
            // `crate::*` (or a path ending at the root): everything.
            Some(&"crate") | Some(&"plan_intake") => parts.get(1).copied().or(Some("*")),
            Some(&"super") => {
                // `self` is the file's module; each `super` climbs one.
                let climbs = parts.iter().take_while(|p| **p == "super").count();
                if climbs >= module.len() {
                    parts.get(climbs).copied().or(Some("*"))
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
            for (n, line) in statements(&text) {
                for (reached, via) in reached(&module, &line) {
                    // A leaf uses no other room, leaves included.
                    let fine = reached == room
                        || (LEAVES.contains(&reached.as_str()) && !LEAVES.contains(&room))
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
    let spread_rooms = |m: &[&str], text: &str| -> BTreeSet<String> {
        statements(text)
            .into_iter()
            .flat_map(|(_, line)| reached(&module(m), &line))
            .map(|(room, _)| room)
            .collect()
    };
    assert_eq!(
        spread_rooms(
            &["http"],
            "use crate::{\n    intake::Login,\n    storage::Database,\n};"
        ),
        set(&["intake", "storage"])
    );
    assert_eq!(spread_rooms(&["http"], "use crate::*;"), set(&["*"]));
    assert_eq!(
        spread_rooms(&["http"], "use plan_intake_wire::Problem;"),
        set(&["wire"])
    );
    assert_eq!(
        spread_rooms(
            &["intake"],
            "#[cfg(test)]\nmod properties;\nuse crate::http::X;"
        ),
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
