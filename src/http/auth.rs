//! `Authorization: Bearer TOKEN` → the login, or 401. The token is hashed
//! and found by its hash; it is never logged.

use actix_web::http::header;
use actix_web::{HttpMessage, HttpRequest};

use super::observe::LoggedMaker;
use super::{ApiError, AppState};
use crate::intake::{Login, Permission};

const MAX_TOKEN_BYTES: usize = 256;

pub async fn authenticate(req: &HttpRequest, state: &AppState) -> Result<Login, ApiError> {
    let token = bearer_token(req.headers())?.to_owned();
    let deadline = super::deadline::of(req, state);
    admit_lookup(state, &token, deadline).await?;
    let found = state
        .blocking(deadline, move |intake| {
            intake.authenticate(&deadline, &token)
        })
        .await;
    match found {
        Ok(Some(login)) => {
            req.extensions_mut().insert(LoggedMaker(login.name.clone()));
            Ok(login)
        }
        Ok(None) => Err(ApiError::Unauthorized("unknown or revoked token")),
        Err(e) => Err(e),
    }
}

/// Whether `token` may be looked up now: always when familiar, else while
/// the strangers' lookups of this second last. Past them it waits (no
/// thread, no connection) for a read of every active login begun after it
/// arrived, shared with everyone waiting: a new login's token is found
/// there and goes on; a stranger's is turned away (503) before it reaches
/// the pool.
pub(super) async fn admit_lookup(
    state: &AppState,
    token: &str,
    deadline: crate::deadline::Deadline,
) -> Result<(), ApiError> {
    use crate::intake::login::Reread;
    if state.intake.may_look_up(token) {
        return Ok(());
    }
    let arrived = std::time::Instant::now();
    loop {
        if state.intake.familiar(token) {
            return Ok(());
        }
        match state.intake.reread_for(arrived) {
            Reread::Covered => break,
            Reread::Mine(begun) => {
                state
                    .blocking(deadline, move |intake| {
                        intake.remember_active_logins(begun, &deadline)
                    })
                    .await?;
            }
            Reread::Wait(at_most, mut done) => {
                let left = deadline.remaining();
                if left.is_zero() {
                    break;
                }
                let _ = actix_web::rt::time::timeout(at_most.min(left), done.changed()).await;
            }
        }
    }
    state.intake.turn_away();
    Err(ApiError::StrangersTurnedAway)
}

pub fn require(login: &Login, permission: Permission) -> Result<(), ApiError> {
    if login.has(permission) {
        Ok(())
    } else {
        Err(ApiError::Forbidden(format!(
            "login `{}` lacks the {permission} permission",
            login.name
        )))
    }
}

/// The token of `Authorization: Bearer TOKEN`, from a request's headers.
pub fn bearer_token(headers: &header::HeaderMap) -> Result<&str, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or(ApiError::Unauthorized(
            "missing Authorization: Bearer token",
        ))?;
    let value = value
        .to_str()
        .map_err(|_| ApiError::Unauthorized("malformed Authorization header"))?;
    let (scheme, token) = value
        .split_once(' ')
        .ok_or(ApiError::Unauthorized("malformed Authorization header"))?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(ApiError::Unauthorized(
            "Authorization must be `Bearer TOKEN`",
        ));
    }
    // No token this service issues is longer; don't hash megabytes.
    if token.len() > MAX_TOKEN_BYTES {
        return Err(ApiError::Unauthorized("unknown or revoked token"));
    }
    Ok(token)
}
