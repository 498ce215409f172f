//! REST: `/v1/tokens` (create, list) and `/v1/tokens/{token}` (revoke), admin only ([`super::auth`]). A created
//! token's text is in the create answer and nowhere else; lists show name, role, created and last used.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::model::{Role, Token};
use super::service;
use crate::api::extract::{Body, Path};
use crate::api::openapi::check_name;
use crate::api::routes::Routes;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::store::{Object, StoreError};

pub fn register(r: &mut Routes) {
    r.add(
        "get",
        "/v1/tokens",
        "List API tokens (name, role, created, last used; never the secret)",
        list,
    );
    r.add(
        "post",
        "/v1/tokens",
        "Create an API token with a role; the answer holds its secret, shown this once",
        create,
    );
    r.add(
        "delete",
        "/v1/tokens/{token}",
        "Revoke an API token: requests presenting it are refused from now on",
        revoke,
    );
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenCreate {
    pub name: String,
    pub role: Role,
}

/// A token as listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenView {
    pub name: String,
    pub role: Role,
    pub created: String,
    /// Empty: never used.
    pub last_used: String,
}

/// The answer to a create: the view and, this once, the secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenCreated {
    #[serde(flatten)]
    pub view: TokenView,
    pub token: String,
}

impl From<Object<Token>> for TokenView {
    fn from(o: Object<Token>) -> Self {
        Self {
            name: o.name,
            role: o.data.role,
            created: o.data.created,
            last_used: o.data.last_used,
        }
    }
}

async fn list(State(ctx): State<Ctx>) -> Result<Json<Vec<TokenView>>, ApiError> {
    let mut ts: Vec<TokenView> = service::list(&ctx.db)
        .await?
        .into_iter()
        .map(Into::into)
        .collect();
    ts.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Json(ts))
}

async fn create(
    State(ctx): State<Ctx>,
    Body(req): Body<TokenCreate>,
) -> Result<(StatusCode, Json<TokenCreated>), ApiError> {
    check_name("token name", &req.name)?;
    match service::create(&ctx.db, &req.name, req.role).await {
        Ok((obj, token)) => {
            tracing::info!(token = obj.name, role = %obj.data.role, "token created");
            Ok((
                StatusCode::CREATED,
                Json(TokenCreated {
                    view: obj.into(),
                    token,
                }),
            ))
        }
        Err(service::TokenError::Store(StoreError::AlreadyExists { .. })) => {
            Err(ApiError::Conflict(format!(
                "token {:?} already exists (revoke it first to replace it)",
                req.name
            )))
        }
        Err(service::TokenError::Store(e)) => Err(e.into()),
        Err(e @ service::TokenError::Rng(_)) => Err(ApiError::Internal(e.to_string())),
    }
}

async fn revoke(State(ctx): State<Ctx>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    if ctx.db.get::<Token>(&name).await?.is_none() {
        return Err(ApiError::NotFound(format!("token {name:?} not found")));
    }
    service::revoke(&ctx.db, &name).await?;
    tracing::info!(token = name, "token revoked");
    Ok(StatusCode::NO_CONTENT)
}
