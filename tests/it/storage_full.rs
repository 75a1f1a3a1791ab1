//! A full disk under the database: a reason of its own. Writes answer 503
//! `storage-full` with nothing written, `/readyz` says `storage-full`, the
//! gauge `plan_intake_storage_full` is 1; once space is freed the same
//! request (the same key) is kept and all of it clears. SQLite on a small
//! filesystem of its own; Postgres with `plans` moved to a tablespace on one.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::support::process::{ServeProcess, client, login_via_cli, post_plan};

/// A tmpfs of `size` mounted for one test, unmounted when dropped. `None`
/// (said) where this machine does not let the test mount one, unless CI
/// requires every test to run.
struct SmallDisk {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str, owner: Option<&str>) -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("disk");
        std::fs::create_dir(&path).expect("a mount point");
        let mut options = format!("size={size}");
        if let Some(owner) = owner {
            options.push_str(&format!(",uid={owner},gid={owner},mode=0700"));
        }
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &options, "tmpfs"])
            .arg(&path)
            .output();
        match mounted {
            Ok(out) if out.status.success() => Some(Self { path, _dir: dir }),
            other => {
                assert!(
                    std::env::var_os("PLAN_INTAKE_REQUIRE_POSTGRES").is_none(),
                    "cannot mount a small filesystem for the full-disk test: {other:?}"
                );
                eprintln!("SKIPPING the full-disk test: cannot mount a tmpfs ({other:?})");
                None
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// A plan whose content is `bytes` of characters that do not compress.
fn bulky_plan(run: &str, bytes: usize) -> String {
    let mut state: u64 = run.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let blob: String = (0..bytes / 16)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            format!("{state:016x}")
        })
        .collect();
    serde_json::json!({
        "run_id": run,
        "approved_inputs": [{"id": "forecast-v12"}],
        "content": {"blob": blob},
    })
    .to_string()
}

/// Plans until one is refused for a full storage: how many were kept, and
/// the refused one's key and body.
fn fill(addr: &str, token: &str) -> (usize, String, String) {
    let agent = client();
    for i in 0..400 {
        let key = format!("bulky-{i}");
        let body = bulky_plan(&key, 48 * 1024);
        let (status, answer) = post_plan(&agent, addr, token, &key, &body).expect("an answer");
        match status {
            201 => {}
            503 if answer["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("/storage-full")) =>
            {
                let detail = answer["detail"].as_str().unwrap_or_default();
                assert!(detail.contains("storage is full"), "{answer}");
                return (i, key, body);
            }
            other => panic!("{other}: {answer}"),
        }
    }
    panic!("400 plans of 48 KiB were all kept: the storage never filled");
}

fn readyz(addr: &str) -> (u16, Value) {
    let (status, text) = crate::evidence::get_text(addr, None, "/readyz");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn gauge(service: &ServeProcess) -> String {
    service
        .metrics_text()
        .lines()
        .find(|l| l.starts_with("plan_intake_storage_full "))
        .unwrap_or_default()
        .to_owned()
}

/// What a full storage looks like from outside, then freed.
fn full_then_freed(service: &ServeProcess, token: &str, free: impl FnOnce()) {
    let (kept, key, body) = fill(&service.addr, token);
    assert!(kept > 0, "not one plan was kept before the storage filled");
    let (status, ready) = readyz(&service.addr);
    assert_eq!(status, 503, "{ready}");
    assert!(
        ready["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("/storage-full")),
        "{ready}"
    );
    assert_eq!(gauge(service), "plan_intake_storage_full 1");
    // A replay reads and writes nothing: it says nothing about room.
    let (status, replayed) = post_plan(
        &client(),
        &service.addr,
        token,
        "bulky-0",
        &bulky_plan("bulky-0", 48 * 1024),
    )
    .expect("an answer");
    assert_eq!(status, 200, "{replayed}");
    assert_eq!(readyz(&service.addr).0, 503);
    assert_eq!(gauge(service), "plan_intake_storage_full 1");

    free();
    let (status, receipt) =
        post_plan(&client(), &service.addr, token, &key, &body).expect("an answer");
    assert_eq!(status, 201, "{receipt}");
    let (status, ready) = readyz(&service.addr);
    assert_eq!(status, 200, "{ready}");
    assert_eq!(gauge(service), "plan_intake_storage_full 0");
}

#[test]
fn a_full_disk_under_sqlite_is_named_and_mended_by_freeing_space() {
    let Some(disk) = SmallDisk::mount("4m", None) else {
        return;
    };
    let filler = disk.path.join("filler");
    std::fs::write(&filler, vec![0u8; 1024 * 1024]).expect("a filler");
    let url = format!("sqlite://{}", disk.path.join("intake.db").display());
    let service = ServeProcess::start(&url);
    let token = login_via_cli(&url, "planner-a", "plans:submit");
    full_then_freed(&service, &token, || {
        std::fs::remove_file(&filler).expect("free the filler's space");
    });
    let integrity = Command::new("sqlite3")
        .arg(disk.path.join("intake.db"))
        .arg("PRAGMA integrity_check")
        .output()
        .expect("sqlite3");
    assert_eq!(String::from_utf8_lossy(&integrity.stdout).trim(), "ok");
    service.terminate();
}

/// `plans` on a tablespace of its own, on a small filesystem, in a
/// cluster of the test's own (a cluster that lost a tablespace's directory
/// cannot recover from a crash; the shared one must never risk that).
#[test]
fn a_full_tablespace_under_postgres_is_named_and_mended_by_freeing_space() {
    if !crate::support::postgres_available() {
        return;
    }
    let Some(disk) = SmallDisk::mount("3m", Some("postgres")) else {
        return;
    };
    let Some(cluster) = crate::support::cluster::TempCluster::create() else {
        return;
    };
    let location = disk.path.join("tablespace");
    let made = Command::new("install")
        .args(["-d", "-o", "postgres", "-g", "postgres", "-m", "0700"])
        .arg(&location)
        .status()
        .expect("install");
    assert!(made.success());
    let url = cluster.url("postgres");
    let service = ServeProcess::start(&url);
    let token = login_via_cli(&url, "planner-a", "plans:submit");
    cluster.psql(&format!(
        "CREATE TABLESPACE small LOCATION '{}'",
        location.display()
    ));
    cluster.psql("ALTER TABLE plans SET TABLESPACE small");
    let filler = disk.path.join("filler");
    std::fs::write(&filler, vec![0u8; 512 * 1024]).expect("a filler");
    full_then_freed(&service, &token, || {
        std::fs::remove_file(&filler).expect("free the filler's space");
    });
    service.terminate();
    // The cluster goes before its tablespace's filesystem.
    drop(cluster);
    drop(disk);
}
