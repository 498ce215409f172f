//! The REST API kit (`/v1/...`, JSON), which names no feature: every route is registered through [`Routes`]
//! (each feature's `routes` module registers its own; `crate::server::routes` assembles them), which also lists
//! the routes for the OpenAPI document served at `/v1/openapi.json` ([`openapi`] assembles it from each
//! feature's part), so the document cannot miss a route; the extractors ([`extract`]), and the router with its
//! middleware. Each feature's JSON shapes are its `views` module. Errors are `{code, message}` with the status of [`ApiError`]. Validation
//! happens before anything is written: a refused request leaves nothing behind.

pub mod extract;
pub mod openapi;
pub mod routes;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::context::Ctx;
use crate::error::ApiError;

pub use routes::Routes;

/// The router serving `routes`.
pub fn router(ctx: Ctx, routes: Routes) -> Router {
    let mut app = Router::new();
    for (path, mr) in routes.paths {
        app = app.route(path, mr);
    }
    app.fallback(|req: Request| async move {
        ApiError::NotFound(format!("no route {} {}", req.method(), req.uri().path()))
    })
    .layer(DefaultBodyLimit::max(openapi::BODY_LIMIT))
    .layer(axum::middleware::from_fn(extract::json_errors))
    .layer(axum::middleware::from_fn_with_state(ctx.clone(), count_requests))
    .with_state(ctx)
}

async fn count_requests(State(ctx): State<Ctx>, req: Request, next: Next) -> Response {
    let method = req.method().to_string();
    let resp = next.run(req).await;
    ctx.metrics.request(&method, resp.status().as_u16());
    resp
}
