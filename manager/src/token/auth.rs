//! The middleware in front of every route: which role a request needs ([`required_role`]), and whether the
//! `Authorization: Bearer` token it presents has it. No, malformed, unknown or revoked token: 401; a role too low:
//! 403; a token in the query string: 400; an Authorization header over [`MAX_AUTHORIZATION`]: 431. Each is a JSON
//! error like every other, and each refusal is logged with the token's name when known, never its text.

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::model::Role;
use super::service;
use crate::context::Ctx;
use crate::error::ApiError;

/// The longest Authorization header taken (a token is 71 bytes; this leaves room for other schemes' values).
pub const MAX_AUTHORIZATION: usize = 4096;

/// Query parameters that would carry a credential in a URL (and so in logs and browser history): refused.
const CREDENTIAL_PARAMS: &[&str] = &["token", "access_token", "bearer", "authorization", "api_key"];

/// Who made a request, for the handlers that want to know (inserted as a request extension).
#[derive(Debug, Clone)]
pub struct Caller {
    pub token: String,
    pub role: Role,
}

/// The role a request needs; `None`: open to anyone (health, metrics, the UI's page and static files).
pub fn required_role(method: &Method, path: &str) -> Option<Role> {
    let open = matches!(path, "/healthz" | "/readyz" | "/metrics" | "/")
        || (path.starts_with("/ui/") && path != "/ui/events");
    if open {
        return None;
    }
    let under = |prefix: &str| path == prefix || path.starts_with(&format!("{prefix}/"));
    let admin_only = under("/v1/tokens");
    // Settings, backup targets (they hold credentials), tokens, nodes and their disks change only by an admin.
    let admin_writes =
        admin_only || under("/v1/settings") || under("/v1/backuptargets") || under("/v1/nodes");
    if admin_only {
        return Some(Role::Admin);
    }
    if *method == Method::GET || *method == Method::HEAD {
        return Some(Role::Viewer);
    }
    Some(if admin_writes { Role::Admin } else { Role::Operator })
}

/// Why a request was refused, before any handler ran.
fn refuse(err: ApiError, method: &Method, path: &str, token: Option<&str>, reason: &str) -> Response {
    let (status, _) = err.status_and_code();
    tracing::warn!(%method, path, token = token.unwrap_or("-"), status = status.as_u16(), reason, "request refused");
    let mut resp = err.into_response();
    if status.as_u16() == 401 {
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"corral\""),
        );
    }
    resp
}

fn query_carries_credential(query: &str) -> bool {
    query.contains(service::PREFIX)
        || query.split('&').any(|kv| {
            let key = kv.split('=').next().unwrap_or("");
            CREDENTIAL_PARAMS.iter().any(|p| key.eq_ignore_ascii_case(p))
        })
}

/// The middleware (`axum::middleware::from_fn_with_state`).
pub async fn require_token(State(ctx): State<Ctx>, mut req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    if req.uri().query().is_some_and(query_carries_credential) {
        // The whole query is left out of the log: it may hold the token.
        return refuse(
            ApiError::Invalid(
                "credentials are not taken in the query string (it ends up in logs): send Authorization: Bearer TOKEN"
                    .into(),
            ),
            &method,
            &path,
            None,
            "credential in the query string",
        );
    }
    let Some(needed) = required_role(&method, &path) else {
        return next.run(req).await;
    };
    let secret = match req.headers().get(header::AUTHORIZATION) {
        None => {
            return refuse(
                ApiError::Unauthorized(
                    "no token: send Authorization: Bearer TOKEN (see `corral token`)".into(),
                ),
                &method,
                &path,
                None,
                "no Authorization header",
            );
        }
        Some(v) if v.len() > MAX_AUTHORIZATION => {
            return refuse(
                ApiError::HeaderTooLarge(format!(
                    "the Authorization header is {} bytes, over the {MAX_AUTHORIZATION} taken",
                    v.len()
                )),
                &method,
                &path,
                None,
                "Authorization header too large",
            );
        }
        Some(v) => match v
            .to_str()
            .ok()
            .and_then(|s| s.strip_prefix("Bearer "))
            .map(str::trim)
        {
            Some(s) if !s.is_empty() => s.to_owned(),
            _ => {
                return refuse(
                    ApiError::Unauthorized("malformed Authorization header: expected `Bearer TOKEN`".into()),
                    &method,
                    &path,
                    None,
                    "malformed Authorization header",
                );
            }
        },
    };
    let token = match service::authenticate(&ctx.db, &secret).await {
        Ok(Some(t)) => t,
        Ok(None) => {
            return refuse(
                ApiError::Unauthorized("unknown or revoked token".into()),
                &method,
                &path,
                None,
                "unknown or revoked token",
            );
        }
        Err(e) => {
            return refuse(ApiError::Store(e), &method, &path, None, "token lookup failed");
        }
    };
    if token.data.role < needed {
        return refuse(
            ApiError::Forbidden(format!(
                "token {} has role {}; {method} {path} needs {needed}",
                token.name, token.data.role
            )),
            &method,
            &path,
            Some(&token.name),
            "role insufficient",
        );
    }
    req.extensions_mut().insert(Caller {
        token: token.name,
        role: token.data.role,
    });
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_needed_per_route() {
        let get = Method::GET;
        let post = Method::POST;
        let put = Method::PUT;
        let delete = Method::DELETE;
        assert_eq!(required_role(&get, "/healthz"), None);
        assert_eq!(required_role(&get, "/metrics"), None);
        assert_eq!(required_role(&get, "/ui/app.js"), None);
        assert_eq!(required_role(&get, "/ui/events"), Some(Role::Viewer));
        assert_eq!(required_role(&get, "/v1/volumes"), Some(Role::Viewer));
        assert_eq!(required_role(&delete, "/v1/volumes/v"), Some(Role::Operator));
        assert_eq!(required_role(&post, "/v1/backingimages"), Some(Role::Operator));
        assert_eq!(required_role(&put, "/v1/settings/x"), Some(Role::Admin));
        assert_eq!(required_role(&get, "/v1/settings"), Some(Role::Viewer));
        assert_eq!(required_role(&get, "/v1/tokens"), Some(Role::Admin));
        assert_eq!(required_role(&post, "/v1/nodes/n/disks"), Some(Role::Admin));
        assert_eq!(required_role(&put, "/v1/backuptargets/t"), Some(Role::Admin));
        assert_eq!(required_role(&get, "/v1/tokensx"), Some(Role::Viewer));
    }

    #[test]
    fn credentials_in_the_query_are_seen() {
        assert!(query_carries_credential("token=abc"));
        assert!(query_carries_credential("size=1&Access_Token=abc"));
        assert!(query_carries_credential("x=corral_00ff"));
        assert!(!query_carries_credential("size=4096"));
    }
}
