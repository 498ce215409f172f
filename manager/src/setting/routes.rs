//! REST for the settings: `GET /v1/settings`, `GET|PUT /v1/settings/{setting}`.

use axum::Json;
use axum::extract::State;

use super::views::{SettingValue, SettingView};
use crate::api::Routes;
use crate::api::extract::{Body, Path};
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{self, Setting};

type ApiResult<T> = Result<Json<T>, ApiError>;

pub fn register(r: &mut Routes) {
    r.add("get", "/v1/settings", "List settings", list_settings);
    r.add("get", "/v1/settings/{setting}", "Get a setting", get_setting);
    r.add("put", "/v1/settings/{setting}", "Set a setting", put_setting);
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
        super::openapi::check_value(&name, default, &req.value)?;
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
