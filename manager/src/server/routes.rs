//! Every route of the REST API: each feature's (registered by its `routes` module) and the cluster-wide ones
//! (replicas, settings, the OpenAPI document, metrics, liveness). The one module that knows every feature's
//! routes.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::api::Routes;
use crate::api::openapi::{self, Part, Shape};
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{self, Replica, Volume};
use crate::volume::views::ReplicaView;

type ApiResult<T> = Result<Json<T>, ApiError>;

/// Every route of the API.
pub fn routes() -> Routes {
    let mut r = Routes::new();
    crate::node::routes::register(&mut r);
    crate::volume::routes::register(&mut r);
    r.add("get", "/v1/replicas", "List replicas", list_replicas);
    crate::setting::routes::register(&mut r);
    crate::backing_image::routes::register(&mut r);
    crate::job::routes::register(&mut r);
    crate::backup::routes::register(&mut r);
    crate::v2::routes::register(&mut r);
    crate::token::routes::register(&mut r);
    r.add("get", "/v1/openapi.json", "This document", openapi);
    r.add("get", "/metrics", "Prometheus metrics", metrics);
    r.add("get", "/healthz", "Liveness", healthz);
    r
}

/// Every feature's part of the OpenAPI document, and this module's own.
const PARTS: [Part; 9] = [
    crate::node::openapi::PART,
    crate::volume::openapi::PART,
    crate::setting::openapi::PART,
    crate::backing_image::openapi::PART,
    crate::job::openapi::PART,
    crate::backup::openapi::PART,
    crate::v2::routes::PART,
    crate::token::openapi::PART,
    Part { shape, ..Part::NONE },
];

/// The shapes of this module's routes: the document itself, metrics, liveness.
fn shape(method: &str, path: &str) -> Option<Shape> {
    let plain = |media| Shape {
        body: None,
        status: 200,
        response: Some((json!({"type": "string"}), media)),
    };
    Some(match (method, path) {
        ("get", "/v1/openapi.json") => Shape::json(None, 200, Some(json!({"type": "object"}))),
        ("get", "/metrics") => plain("application/openmetrics-text"),
        ("get", "/healthz") => plain("text/plain"),
        _ => return None,
    })
}

/// The OpenAPI 3 document of [`routes()`] (see [`openapi`]): open routes are those that need no role.
pub fn openapi_document() -> serde_json::Value {
    let open = |method: &str, path: &str| {
        crate::token::auth::required_role(&method.to_uppercase().parse().unwrap_or_default(), path).is_none()
    };
    openapi::document(&routes().documented, &PARTS, &open)
}

async fn openapi() -> Json<serde_json::Value> {
    Json(openapi_document())
}

async fn metrics(State(ctx): State<Ctx>) -> Response {
    if let Ok(vols) = ctx.db.list::<Volume>().await {
        let count = |s: model::VolumeState| {
            i64::try_from(vols.iter().filter(|v| v.data.status.state == s).count()).unwrap_or(i64::MAX)
        };
        ctx.metrics.set_volume_counts(&[
            ("detached", count(model::VolumeState::Detached)),
            ("attaching", count(model::VolumeState::Attaching)),
            ("attached", count(model::VolumeState::Attached)),
            ("detaching", count(model::VolumeState::Detaching)),
        ]);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ctx.metrics.encode(),
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok"
}

async fn list_replicas(State(ctx): State<Ctx>) -> ApiResult<Vec<ReplicaView>> {
    Ok(Json(
        ctx.db
            .list::<Replica>()
            .await?
            .iter()
            .map(ReplicaView::from)
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_route_is_described_with_unique_operation_ids() {
        let doc = super::openapi_document();
        let mut ids = std::collections::BTreeSet::new();
        for (_, item) in doc["paths"].as_object().unwrap() {
            for (_, op) in item.as_object().unwrap() {
                assert!(ids.insert(op["operationId"].as_str().unwrap().to_owned()), "{op}");
            }
        }
        // Every link names an operation of the document.
        for (_, item) in doc["paths"].as_object().unwrap() {
            for (_, op) in item.as_object().unwrap() {
                for (_, resp) in op["responses"].as_object().unwrap() {
                    for (_, link) in resp["links"].as_object().into_iter().flatten() {
                        assert!(ids.contains(link["operationId"].as_str().unwrap()), "{link}");
                    }
                }
            }
        }
    }
}
