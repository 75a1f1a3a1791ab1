// The migrations are embedded at compile time (`embed_migrations!`); without
// this, a migration added to the folder is missing from an incremental build.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
