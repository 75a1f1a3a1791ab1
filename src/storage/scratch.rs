//! A Postgres schema of its own, for work that must not touch the
//! service's tables: verify's trials, the tests, the benchmark.

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};

use super::StorageError;

/// A fresh schema in the database at `admin_url`, reached through `url`
/// (which selects it by `search_path`). Dropped, with everything in it,
/// when this is dropped.
pub struct ScratchSchema {
    /// The schema's name: `{prefix}_{pid}_{random}`.
    pub name: String,
    /// The database URL with the schema as its `search_path`.
    pub url: String,
    admin_url: String,
}

impl ScratchSchema {
    pub fn create(admin_url: &str, prefix: &str) -> Result<Self, StorageError> {
        let name = format!(
            "{prefix}_{}_{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        super::keep_tls_state_past_exit();
        let mut admin = PgConnection::establish(admin_url).map_err(|e| {
            StorageError::unavailable("cannot connect to create a scratch schema", e)
        })?;
        admin.batch_execute(&format!("CREATE SCHEMA {name}"))?;
        let separator = if admin_url.contains('?') { '&' } else { '?' };
        Ok(Self {
            url: format!("{admin_url}{separator}options=-csearch_path%3D{name}"),
            name,
            admin_url: admin_url.to_owned(),
        })
    }
}

impl Drop for ScratchSchema {
    fn drop(&mut self) {
        let dropped = PgConnection::establish(&self.admin_url)
            .map_err(|e| StorageError::unavailable("cannot connect", e))
            .and_then(|mut admin| {
                Ok(admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name))?)
            });
        if let Err(e) = dropped {
            tracing::warn!(schema = %self.name, error = %crate::report::chain(&e), "could not drop a scratch schema");
        }
    }
}
