//! Every route of the REST API: each feature's (registered by its `routes` module) and the cluster-wide ones
//! (replicas, settings, the OpenAPI document, metrics, liveness). The one module that knows every feature's
//! routes.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use crate::api::Routes;
use crate::api::extract::{Body, Path};
use crate::api::openapi;
use crate::api::views::*;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{self, Replica, Setting, Volume};

type ApiResult<T> = Result<Json<T>, ApiError>;

/// Every route of the API.
pub fn routes() -> Routes {
    let mut r = Routes::new();
    crate::node::routes::register(&mut r);
    crate::volume::routes::register(&mut r);
    r.add("get", "/v1/replicas", "List replicas", list_replicas);
    r.add("get", "/v1/settings", "List settings", list_settings);
    r.add("get", "/v1/settings/{setting}", "Get a setting", get_setting);
    r.add("put", "/v1/settings/{setting}", "Set a setting", put_setting);
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

/// The OpenAPI 3 document of [`routes()`] (see [`openapi`]).
pub fn openapi_document() -> serde_json::Value {
    openapi::document(&routes().documented)
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

async fn setting_view(ctx: &Ctx, name: &str) -> Result<SettingView, ApiError> {
    let (n, default, desc) = model::SETTINGS
        .iter()
        .find(|s| s.0 == name)
        .ok_or_else(|| ApiError::NotFound(format!("unknown setting {name:?}")))?;
    Ok(SettingView {
        name: (*n).to_owned(),
        value: ctx.setting(name).await,
        default: (*default).to_owned(),
        description: (*desc).to_owned(),
    })
}

async fn list_settings(State(ctx): State<Ctx>) -> ApiResult<Vec<SettingView>> {
    let mut out = Vec::new();
    for s in model::SETTINGS {
        out.push(setting_view(&ctx, s.0).await?);
    }
    Ok(Json(out))
}

async fn get_setting(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<SettingView> {
    Ok(Json(setting_view(&ctx, &name).await?))
}

async fn put_setting(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    Body(req): Body<SettingValue>,
) -> ApiResult<SettingView> {
    if !model::SETTINGS.iter().any(|s| s.0 == name) {
        return Err(ApiError::NotFound(format!("unknown setting {name:?}")));
    }
    if let Some((_, default, _)) = model::SETTINGS.iter().find(|s| s.0 == name) {
        openapi::check_setting_value(&name, default, &req.value)?;
    }
    model::validate_setting(&name, &req.value).map_err(ApiError::Invalid)?;
    let value = Setting { value: req.value };
    match ctx.db.get::<Setting>(&name).await? {
        Some(mut s) => {
            s.data = value;
            ctx.db.update(&mut s).await?;
        }
        None => {
            ctx.db.create(&name, value).await?;
        }
    }
    Ok(Json(setting_view(&ctx, &name).await?))
}
