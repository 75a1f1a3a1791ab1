//! `Authorization: Bearer TOKEN` → the login, or 401. The token is hashed
//! and found by its hash; it is never logged.

use actix_web::http::header;
use actix_web::{HttpMessage, HttpRequest};

use super::observe::LoggedMaker;
use super::{ApiError, AppState};
use crate::intake::{Login, Permission};

const MAX_TOKEN_BYTES: usize = 256;

pub async fn authenticate(req: &HttpRequest, state: &AppState) -> Result<Login, ApiError> {
    let token = bearer_token(req)?.to_owned();
    if !state.intake.may_look_up(&token) {
        return Err(ApiError::StrangersTurnedAway);
    }
    let deadline = super::deadline::of(req, state);
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

pub fn bearer_token(req: &HttpRequest) -> Result<&str, ApiError> {
    let value = req
        .headers()
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
