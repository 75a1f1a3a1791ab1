//! An operator's disaster drills, through the real binary on both
//! backends: a checkpoint kept before it is handed out, and what a
//! verifying reader does when the database behind the service is
//! restored, rolled back or loses a row.

use std::path::Path;

use crate::evidence::{arg, checkpoint_of_at_least, checkpoint_size, generate_key, submit};
use crate::on_both_backends_sync;
use crate::support::TestDb;
use crate::support::process::{ServeProcess, login_via_cli};

on_both_backends_sync!(a_checkpoint_is_kept_before_it_is_handed_out,);

/// The second line of a checkpoint note: its root.
fn root_of(note: &str) -> &str {
    note.lines().nth(2).unwrap_or_default()
}

fn kept(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `--checkpoint-file` holds a checkpoint before any reader can be handed
/// it: with the round that signs it held between its writes and its
/// COMMIT, the file already holds it. Killed there, the service starts
/// again (the database still holds every receipt of that round) and signs
/// the very tree the file holds.
fn a_checkpoint_is_kept_before_it_is_handed_out(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let file = dir.path().join("last.checkpoint");
    let args = ["--signing-key", arg(&key), "--checkpoint-file", arg(&file)];
    let stalled = ServeProcess::start_env(
        &db.url,
        "127.0.0.1:0",
        &args,
        &[("PLAN_INTAKE_TEST_STALL_APPEND", "3")],
    );
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&stalled.addr, &token, "kept", 3);
    const STALLED: &str = "written, not committed, root ";
    let said = stalled.await_said(STALLED);
    let stalled_root = said
        .split_once(STALLED)
        .map(|(_, root)| root.lines().next().unwrap_or_default().trim().to_owned())
        .unwrap_or_default();
    let in_file = kept(&file);
    assert!(
        checkpoint_size(&in_file) >= 3 && root_of(&in_file) == stalled_root,
        "the round is not committed, yet the file holds: {in_file:?} (the round's root {stalled_root})"
    );
    stalled.kill_9();

    let service = ServeProcess::start_with(&db.url, &args);
    let signed = checkpoint_of_at_least(&service.addr, checkpoint_size(&in_file));
    if checkpoint_size(&signed) == checkpoint_size(&in_file) {
        assert_eq!(root_of(&signed), root_of(&in_file), "{signed}");
    }
    assert_eq!(kept(&file), signed, "the file keeps what is handed out");
    drop(service);
}
