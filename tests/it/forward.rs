//! Tomorrow's receipts: a newer service that adds a member to its receipt
//! (here `region`, signed over like the rest) breaks no deployed tool:
//! `submit` and `follow` accept it, keep it and print it; `receipts
//! verify` checks the signature over the receipt as received, the new
//! member included, so changing it is caught. A member given twice is
//! still refused. The newer service is a stand-in speaking HTTP/1.1.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;

use plan_intake::intake::Receipt;
use plan_intake::intake::signing::SigningKey;

use crate::support::plan_body;
use crate::tools::tool;

/// A receipt as a newer service would answer it: `region` added, and the
/// signature over the receipt with it. The JSON (with `outcome`) and the
/// verifier key to trust.
fn newer_receipt() -> (String, String) {
    let (key, _) = SigningKey::generate("newer").expect("a key");
    let mut receipt = Receipt {
        receipt_id: "rcpt_newer".to_owned(),
        maker: "planner-a".to_owned(),
        run_id: "run-newer".to_owned(),
        content_hash: format!("blake3:{}", "c".repeat(64)),
        request_hash: format!("blake3:{}", "r".repeat(64)),
        approved_inputs: vec!["forecast-v12".to_owned()],
        permissions: vec!["plans:submit".to_owned()],
        received_at: "2026-12-03T10:00:00.000000Z".to_owned(),
        signature: None,
        outcome: None,
        extra: BTreeMap::from([("region".to_owned(), serde_json::json!("eu-west"))]),
    };
    receipt.signature = Some(key.sign(&receipt).expect("signed"));
    receipt.outcome = Some(plan_intake::intake::Outcome::Created);
    (
        serde_json::to_string(&receipt).expect("JSON"),
        key.verifier_key().to_owned(),
    )
}

/// A stand-in service on a port of its own answering every request with
/// `answer(method, path)`: `(status, body)`. Serves until the test ends.
fn stand_in(answer: impl Fn(&str, &str) -> (u16, String) + Send + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream);
            let mut head = String::new();
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = value.trim().parse().unwrap_or(0);
                }
                head.push_str(&line);
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let mut words = head.split_whitespace();
            let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
            let (status, text) = answer(method, path);
            let _ = write!(
                reader.get_mut(),
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
    format!("http://{addr}")
}

/// `submit` keeps and prints the new member; `receipts verify` holds the
/// signature over it, and catches it changed.
#[test]
fn submit_and_verify_keep_a_member_a_newer_service_added() {
    let (receipt, verifier) = newer_receipt();
    let answered = receipt.clone();
    let base = stand_in(move |_, _| (201, answered.clone()));
    let dir = tempfile::tempdir().expect("temp dir");
    let request = dir.path().join("plan.json");
    std::fs::write(&request, plan_body("run-newer", "x")).expect("a request");
    let out = tool(
        &["submit", request.to_str().expect("utf-8")],
        &base,
        "pit_0",
    )
    .output()
    .expect("submit");
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(printed.contains(r#""region":"eu-west""#), "{printed}");

    let keys = dir.path().join("keys.pub");
    std::fs::write(&keys, format!("{verifier}\n")).expect("the key file");
    let verify = |text: &str| {
        let file = dir.path().join("receipt.json");
        std::fs::write(&file, text).expect("the receipt file");
        tool(
            &[
                "receipts",
                "verify",
                file.to_str().expect("utf-8"),
                "--keys",
                keys.to_str().expect("utf-8"),
            ],
            &base,
            "pit_0",
        )
        .output()
        .expect("receipts verify")
    };
    let verified = verify(&printed);
    assert_eq!(
        verified.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&verified.stderr)
    );
    let changed = verify(&printed.replace("eu-west", "us-east"));
    assert_eq!(
        changed.status.code(),
        Some(65),
        "a changed new member escaped the signature: {}",
        String::from_utf8_lossy(&changed.stdout)
    );
    // A member given twice is still no receipt.
    let twice = receipt.replacen('{', r#"{"region":"elsewhere","#, 1);
    assert_eq!(verify(&twice).status.code(), Some(65));
}

/// A receipt with a member given twice is no receipt: `submit` refuses
/// the answer instead of printing one of the two.
#[test]
fn submit_refuses_a_receipt_with_a_member_twice() {
    let (receipt, _) = newer_receipt();
    let twice = receipt.replacen('{', r#"{"region":"elsewhere","#, 1);
    let base = stand_in(move |_, _| (201, twice.clone()));
    let dir = tempfile::tempdir().expect("temp dir");
    let request = dir.path().join("plan.json");
    std::fs::write(&request, plan_body("run-twice", "x")).expect("a request");
    let out = tool(
        &["submit", request.to_str().expect("utf-8")],
        &base,
        "pit_0",
    )
    .output()
    .expect("submit");
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
}

/// `follow` hands on a page whose receipt has a member it does not know,
/// as received.
#[test]
fn follow_hands_on_a_member_a_newer_service_added() {
    let (receipt, _) = newer_receipt();
    let base = stand_in(move |_, path| {
        if path.contains("after=") {
            (200, r#"{"receipts":[],"next":"c1"}"#.to_owned())
        } else {
            (200, format!(r#"{{"receipts":[{receipt}],"next":"c1"}}"#))
        }
    });
    let dir = tempfile::tempdir().expect("temp dir");
    let cursor = dir.path().join("c");
    let out = tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("utf-8"),
            "--from-start",
            "--drain",
        ],
        &base,
        "pit_0",
    )
    .output()
    .expect("follow");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(r#""region":"eu-west""#),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
