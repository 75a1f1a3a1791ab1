//! The shipped systemd unit as systemd runs it: its `ExecStart=` as an
//! unprivileged user (what `DynamicUser=yes` gives), the signing key
//! handed over by `LoadCredential=` in a credentials directory, and its
//! state in the `StateDirectory=`.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;

use crate::evidence::{checkpoint_of_at_least, generate_key, submit};
use crate::support::process::{BIN, ServeProcess};

/// The unprivileged user the service runs as here (`nobody`), as
/// `DynamicUser=` gives it one of its own.
const UID: u32 = 65534;

/// The unit's settings named `key`, in order.
fn settings<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .filter_map(|line| line.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

fn chown(path: &Path) {
    std::os::unix::fs::chown(path, Some(UID), Some(UID)).expect("chown to the service's user");
}

fn as_the_unit_user(args: &[String]) -> Command {
    let mut command = Command::new("setpriv");
    command
        .args([
            "--reuid",
            &UID.to_string(),
            "--regid",
            &UID.to_string(),
            "--clear-groups",
        ])
        .args(args);
    command
}

#[test]
fn the_unit_runs_as_an_unprivileged_user_with_its_key_as_a_credential() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("NOTICE: not root: the unit's user cannot be taken; this test is skipped");
        return;
    }
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/systemd/plan-intake.service"),
    )
    .expect("the unit");
    assert_eq!(settings(&unit, "DynamicUser"), ["yes"]);
    assert_eq!(settings(&unit, "StateDirectory"), ["plan-intake"]);
    let [credential] = settings(&unit, "LoadCredential")[..] else {
        panic!("one LoadCredential= in {unit}");
    };
    let (credential, source) = credential.split_once(':').expect("NAME:PATH");
    let [exec_start] = settings(&unit, "ExecStart")[..] else {
        panic!("one ExecStart= in {unit}");
    };

    // What systemd makes: the state directory, the service's own; the
    // credentials directory, readable by the service alone; the key's
    // source stays root's, 0600.
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("a directory the service's user can enter");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("state directory");
    chown(&state);
    let etc = dir.path().join("etc");
    std::fs::create_dir(&etc).expect("etc");
    let key = generate_key(&etc, "receipts.key");
    assert_eq!(
        std::fs::metadata(&key)
            .expect("the key")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let credentials = dir.path().join("credentials");
    std::fs::create_dir(&credentials).expect("credentials directory");
    std::fs::copy(&key, credentials.join(credential)).expect("the credential");
    chown(&credentials.join(credential));
    std::fs::set_permissions(
        credentials.join(credential),
        std::fs::Permissions::from_mode(0o400),
    )
    .expect("mode 0400");
    chown(&credentials);
    std::fs::set_permissions(&credentials, std::fs::Permissions::from_mode(0o500))
        .expect("mode 0500");
    assert_eq!(source, "/etc/plan-intake/receipts.key");

    let database_url = settings(&unit, "Environment")
        .iter()
        .find_map(|e| e.strip_prefix("DATABASE_URL="))
        .expect("the unit's DATABASE_URL")
        .replace("/var/lib/plan-intake", &state.display().to_string());
    let mut args: Vec<String> = exec_start
        .split_whitespace()
        .map(|word| {
            word.replace("/usr/local/bin/plan-intake", BIN).replace(
                "${CREDENTIALS_DIRECTORY}",
                &credentials.display().to_string(),
            )
        })
        .collect();
    assert_eq!(args[0], BIN, "{exec_start}");
    // Socket activation aside (tests/it/restart.rs hands a socket over),
    // it listens on a port of its own.
    args.extend(["--bind".to_owned(), "127.0.0.1:0".to_owned()]);
    let state_env = state.display().to_string();
    let credentials_env = credentials.display().to_string();
    let env = [
        ("STATE_DIRECTORY", state_env.as_str()),
        ("CREDENTIALS_DIRECTORY", credentials_env.as_str()),
    ];

    // The key's file itself, as the README once had the unit read it, is
    // not the user's to read: exit 66, naming it.
    let mut direct = as_the_unit_user(&[
        BIN.to_owned(),
        "serve".to_owned(),
        "--signing-key".to_owned(),
        key.display().to_string(),
    ]);
    let refused = direct
        .env("DATABASE_URL", &database_url)
        .env("PLAN_INTAKE_BIND", "127.0.0.1:0")
        .current_dir(&state)
        .output()
        .expect("run serve");
    assert_eq!(refused.status.code(), Some(66), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("cannot read the signing key"),
        "{refused:?}"
    );

    let mut command = as_the_unit_user(&args);
    command.current_dir(&state);
    let service = ServeProcess::start_command(command, &database_url, &env);
    let mut add = as_the_unit_user(&[
        BIN.to_owned(),
        "logins".to_owned(),
        "add".to_owned(),
        "planner-a".to_owned(),
        "--permission".to_owned(),
        "plans:submit".to_owned(),
    ]);
    let added = add
        .env("DATABASE_URL", &database_url)
        .current_dir(&state)
        .output()
        .expect("logins add");
    assert!(added.status.success(), "{added:?}");
    let token = String::from_utf8(added.stdout).expect("utf-8");
    let receipts = submit(&service.addr, token.trim(), "unit", 2);
    assert!(
        receipts
            .iter()
            .all(|r| r["signature"]["ed25519"].is_string()),
        "signed with the credential: {receipts:?}"
    );
    // The checkpoint kept in the state directory, beside the SQLite file.
    let note = checkpoint_of_at_least(&service.addr, 2);
    let file = format!(
        "{}.checkpoint",
        database_url.trim_start_matches("sqlite://")
    );
    assert_eq!(
        std::fs::read_to_string(&file).expect("the checkpoint file"),
        note,
        "{file}"
    );
    assert!(file.starts_with(&state_env), "{file}");
}
