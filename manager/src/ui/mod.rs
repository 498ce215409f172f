//! The web UI served at `/`: a small hand-written JavaScript application (ES modules, one per page, no build step)
//! that calls the REST API (`/v1/...`) as any client does, so the UI can do nothing the API refuses and shows the
//! API's own error messages. Its files are compiled into the binary ([`assets`]); live updates come from the store's
//! watches as server-sent events ([`events`]). Routes: `/` (the page), `/ui/{*file}` (assets), `/ui/events` (SSE).
//! The page and its assets are open; the feed, like the API, needs a bearer token (`crate::token::auth`): the page
//! asks for one on its sign-in page and keeps it in the tab's `sessionStorage`.

pub mod assets;
pub mod events;

use axum::Router;
use axum::routing::get;

use crate::context::Ctx;

/// The UI's routes, merged beside the API's router by the server (none of them under `/v1`, so the OpenAPI
/// document stays the API's; the API's fallback answers every other path).
pub fn router(ctx: Ctx) -> Router {
    Router::new()
        .route("/", get(assets::index))
        .route("/ui/events", get(events::stream))
        .route("/ui/{*file}", get(assets::file))
        .with_state(ctx)
}
