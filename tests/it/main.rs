//! One integration binary (it links once). Every test runs against a real
//! database: its own SQLite file or its own Postgres schema.

mod access;
mod admission;
mod answers;
mod async_client;
mod batch_horizon;
mod cli;
mod crash;
mod dba;
mod deadline;
mod dependent;
mod door;
mod evidence;
mod expect_continue;
mod failover;
mod faults;
mod feed;
mod forward;
mod group_commit;
mod hostile;
mod intake;
mod layers;
mod monitoring;
mod operations;
mod patroni;
mod pg_batch;
mod pooler;
mod privilege;
mod processes;
mod receipt_log;
mod restart;
mod retention;
mod schema;
mod support;
pub(crate) mod tools;
mod verified_feed;
mod way_out;
