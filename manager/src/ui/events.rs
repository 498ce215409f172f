//! `/ui/events`: the store's watches as server-sent events, so open pages follow rebuilds, downloads and state
//! changes without reloading. Each event names only what changed (`{"kind","name"}`); the page fetches the
//! resource again through the API, so the UI shows nothing the API would not.

use std::convert::Infallible;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};

use crate::context::Ctx;
use crate::error::ApiError;
use crate::store::RawEvent;

/// The kinds the pages show. Internal bookkeeping (data sources, backing-image managers) changes often and is
/// reflected in the kinds it feeds (a backing image's status), so it is not streamed.
const KINDS: &[&str] = &[
    "volume",
    "replica",
    "engine",
    "node",
    "setting",
    "snapshot",
    "backingimage",
    "volume-clone",
    "backup-target",
    "backup-volume",
    "backup",
    "volume-restore",
    "recurring-job",
];

pub async fn stream(
    State(ctx): State<Ctx>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let mut watches = Vec::with_capacity(KINDS.len());
    for kind in KINDS {
        let w = ctx.db.raw().watch(kind).await?;
        watches.push(w.map(move |ev| (*kind, ev)).boxed());
    }
    let events = futures::stream::select_all(watches).filter_map(|(kind, ev)| async move {
        let name = match ev {
            Ok(RawEvent::Put(doc)) => doc.name,
            Ok(RawEvent::Delete { name, .. }) => name,
            // A watch that lagged or broke: the page refreshes everything it shows.
            Err(e) => {
                tracing::debug!(kind, error = %e, "UI event watch");
                String::new()
            }
        };
        let data = serde_json::json!({ "kind": kind, "name": name }).to_string();
        Some(Ok(Event::default().event("change").data(data)))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}
