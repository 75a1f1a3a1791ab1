//! A planner that adds the client to its own Cargo.toml: nothing else in
//! its build changes. `tests/dependent` is such a crate (the client and
//! plain serde_json, its own workspace and lockfile); it is built and
//! tested here with a cargo of its own, so its features are unified with
//! the client's alone, as in a planner's build.

#[test]
fn a_crate_that_adds_the_client_keeps_its_own_serde_behaviour() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = std::process::Command::new(cargo)
        // Its lockfile as committed: a client that needs a dependency the
        // lockfile lacks fails here, not by rewriting a tracked file.
        .args(["test", "--quiet", "--locked", "--manifest-path"])
        .arg(root.join("tests/dependent/Cargo.toml"))
        .env("CARGO_TARGET_DIR", root.join("target/dependent-check"))
        // Built as a planner builds it, not with this workspace's checks.
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .output()
        .expect("run cargo");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the dependent crate's tests: {said}");
    assert!(said.contains("3 passed"), "{said}");
}
