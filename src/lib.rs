//! plan-intake: takes plans from planner services and keeps each one exactly
//! once. Rooms: `http` (the door) → `intake` (the domain) → `storage`; the
//! callers' side of the HTTP API is a crate of its own (`crates/client`).

pub mod clock;
pub mod config;
pub mod deadline;
pub mod evidence;
pub mod http;
pub mod inbox;
pub mod intake;
pub mod metrics;
pub mod report;
pub mod serve;
pub mod stdout;
pub mod storage;
pub mod verify;
