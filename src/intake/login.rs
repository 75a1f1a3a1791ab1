//! Who is calling, and what they may do. Both come from the login, never
//! from the request body.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Permission {
    /// Submit plans and read one's own receipts.
    PlansSubmit,
    /// Read every receipt and plan: the ordering system.
    ReceiptsRead,
}

impl Permission {
    pub const ALL: [Permission; 2] = [Permission::PlansSubmit, Permission::ReceiptsRead];

    pub fn as_str(self) -> &'static str {
        match self {
            Permission::PlansSubmit => "plans:submit",
            Permission::ReceiptsRead => "receipts:read",
        }
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Permission {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Permission::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown permission `{s}`: use plans:submit or receipts:read"))
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Login {
    pub name: String,
    /// Sorted, without duplicates.
    pub permissions: Vec<Permission>,
}

impl Login {
    pub fn has(&self, permission: Permission) -> bool {
        self.permissions.contains(&permission)
    }

    /// The permissions as stored with a plan and shown in its receipt.
    pub fn permission_names(&self) -> Vec<&'static str> {
        self.permissions.iter().map(|p| p.as_str()).collect()
    }
}

/// Parses the JSON array of permission names stored in `logins.permissions`.
pub fn parse_permissions(stored: &str) -> Result<Vec<Permission>, String> {
    let names: Vec<String> =
        serde_json::from_str(stored).map_err(|e| format!("stored permissions unreadable: {e}"))?;
    let mut permissions = names
        .iter()
        .map(|n| n.parse())
        .collect::<Result<Vec<Permission>, String>>()?;
    permissions.sort();
    permissions.dedup();
    Ok(permissions)
}
