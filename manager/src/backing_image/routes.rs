//! REST: `/v1/backingimages` (create, get, list, delete, cleanup of disks, upload). Every check runs before the
//! first write.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body as RawBody;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};

use super::image_controller::{MIN_COPIES_SETTING, data_source_for};
use super::model::{
    BackingImage, BackingImageDataSource, BackingImageSpec, DiskFileStatus, FileState, SourceType, state,
};
use super::openapi::{check_checksum as check_checksum_pattern, check_source_parameters};
use super::strategy::CopyStrategy as _;
use crate::api::extract::{Body, Path, Query};
use crate::api::openapi::{check_copies, check_name};
use crate::api::routes::Routes;
use crate::context::Ctx;
use crate::error::ApiError;
use crate::model::{DataEngine, Volume};
use crate::store::{Object, StoreError};

type ApiResult<T> = Result<Json<T>, ApiError>;

pub fn register(r: &mut Routes) {
    r.add("get", "/v1/backingimages", "List backing images", list);
    r.add(
        "post",
        "/v1/backingimages",
        "Create a backing image (sourceType download | upload | export-from-volume | restore | clone)",
        create,
    );
    r.add(
        "get",
        "/v1/backingimages/{backingimage}",
        "Get a backing image with its copies",
        get,
    );
    r.add(
        "delete",
        "/v1/backingimages/{backingimage}",
        "Delete a backing image no volume uses (its files go with it)",
        delete,
    );
    r.add(
        "post",
        "/v1/backingimages/{backingimage}/cleanup",
        "Remove the copies on some disks (`{disks: [diskUUID]}`); refused for disks whose replicas use it",
        cleanup,
    );
    r.add(
        "post",
        "/v1/backingimages/{backingimage}/copy",
        "Add copies on some disks (`{disks: [diskUUID]}`, ready disks of the image's engine); a v2 image's are \
         synced from a ready copy, one at a time",
        copy,
    );
    r.add(
        "post",
        "/v1/backingimages/{backingimage}/upload",
        "Upload the file of an upload-source image: `?size=BYTES`, multipart body (`curl -F file=@IMAGE`)",
        upload,
    );
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackingImageCreate {
    pub name: String,
    pub source_type: String,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    #[serde(default)]
    pub expected_checksum: String,
    /// Default: the `backing-image-min-copies` setting.
    #[serde(default)]
    pub min_number_of_copies: Option<u32>,
    #[serde(default)]
    pub disk_selector: Vec<String>,
    #[serde(default)]
    pub node_selector: Vec<String>,
    /// `v1` (default) | `v2` (copies are snapshot lvols in v2 disks' stores).
    #[serde(default)]
    pub data_engine: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CleanupRequest {
    /// Disk UUIDs.
    pub disks: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskFileView {
    #[serde(rename = "diskUUID")]
    pub disk_uuid: String,
    pub node_id: String,
    #[serde(deserialize_with = "super::model::file_state_serde::deserialize")]
    pub state: FileState,
    pub progress: u32,
    pub message: String,
    /// Unix seconds since when no replica uses this copy.
    pub last_ref_at: Option<i64>,
    /// `v1`: a file of the disk's `corral-bim`; `v2`: a snapshot lvol in the disk's store.
    pub data_engine: DataEngine,
    /// v2 copies: the disk daemon's last report (seed 001's `BackingImageV2CopyInfo`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub v2_copy: Option<super::model::V2CopyInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImageView {
    pub name: String,
    pub uuid: String,
    pub source_type: SourceType,
    pub parameters: BTreeMap<String, String>,
    pub expected_checksum: String,
    pub current_checksum: String,
    pub min_number_of_copies: u32,
    pub size: u64,
    pub virtual_size: u64,
    /// ready (a ready copy exists) | failed (every copy failed) | deleting | the first copy's state.
    pub state: String,
    /// Progress of the most advanced copy that is not ready.
    pub progress: u32,
    pub message: String,
    pub deletion_timestamp: Option<i64>,
    pub data_engine: DataEngine,
    /// v2 images: the first v2 copy (`pending` | `in-progress` | `ready` | `failed` | `unknown`; empty before it
    /// starts) and its disk.
    #[serde(with = "super::model::optional_state_serde")]
    pub v2_first_copy_status: Option<FileState>,
    pub v2_first_copy_disk: String,
    pub v2_first_copy_message: String,
    pub disks: Vec<DiskFileView>,
}

impl BackingImageView {
    pub fn new(o: &Object<BackingImage>) -> Self {
        let b = &o.data;
        let all: Vec<&DiskFileStatus> = b.status.disk_file_status_map.values().collect();
        // A v2 image is usable once a v2 copy is: before, its v1 file's state shows (a ready file is still only
        // the source of the first copy).
        let v2: Vec<&DiskFileStatus> = all.iter().copied().filter(|f| f.is_lvol()).collect();
        let v1_ready_as_source;
        let files: Vec<&DiskFileStatus> = if b.spec.data_engine.first_file_is_copy() {
            all
        } else if !v2.is_empty() {
            v2
        } else {
            v1_ready_as_source = all
                .iter()
                .map(|f| {
                    let mut f = (*f).clone();
                    if f.state == state::READY {
                        f.state = state::IN_PROGRESS;
                        f.message = "the file is ready: making the first v2 copy from it".to_owned();
                    }
                    f
                })
                .collect::<Vec<_>>();
            v1_ready_as_source.iter().collect()
        };
        let state = if b.spec.deletion_timestamp.is_some() {
            "deleting"
        } else if files.iter().any(|f| f.state == state::READY) {
            state::READY.as_str()
        } else if b.spec.data_engine.copies_are_lvols()
            && b.status.v2_first_copy_status == Some(state::FAILED)
        {
            // Also when no entry says so: an uploaded image whose every copy was lost has none left.
            state::FAILED.as_str()
        } else if !files.is_empty() && files.iter().all(|f| f.state == state::FAILED) {
            state::FAILED.as_str()
        } else {
            files
                .iter()
                .max_by_key(|f| f.progress)
                .map_or(state::PENDING, |f| f.state)
                .as_str()
        }
        .to_owned();
        let message = if b.status.message.is_empty() && !b.status.v2_first_copy_message.is_empty() {
            b.status.v2_first_copy_message.clone()
        } else if b.status.message.is_empty() {
            files
                .iter()
                .map(|f| f.message.as_str())
                .find(|m| !m.is_empty())
                .unwrap_or_default()
                .to_owned()
        } else {
            b.status.message.clone()
        };
        Self {
            name: o.name.clone(),
            uuid: b.spec.uuid.clone(),
            source_type: b.spec.source_type,
            parameters: b.spec.parameters.clone(),
            expected_checksum: b.spec.expected_checksum.clone(),
            current_checksum: b.status.current_checksum.clone(),
            min_number_of_copies: b.spec.min_number_of_copies,
            size: b.status.size,
            virtual_size: b.status.virtual_size,
            progress: files
                .iter()
                .filter(|f| f.state != state::READY)
                .map(|f| f.progress)
                .max()
                .unwrap_or(if state == state::READY.as_str() { 100 } else { 0 }),
            state,
            message,
            deletion_timestamp: b.spec.deletion_timestamp,
            data_engine: b.spec.data_engine,
            v2_first_copy_status: b.status.v2_first_copy_status,
            v2_first_copy_disk: b.status.v2_first_copy_disk.clone(),
            v2_first_copy_message: b.status.v2_first_copy_message.clone(),
            disks: b
                .status
                .disk_file_status_map
                .iter()
                .map(|(d, f)| DiskFileView {
                    disk_uuid: d.clone(),
                    node_id: f.node_id.clone(),
                    state: f.state,
                    progress: f.progress,
                    message: f.message.clone(),
                    last_ref_at: b.status.disk_last_ref_at_map.get(d).copied(),
                    data_engine: f.data_engine,
                    v2_copy: f.v2_copy.clone(),
                })
                .collect(),
        }
    }
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound(format!("backing image {name:?} not found"))
}

/// A live image. One whose deletion was accepted is gone for the API (its files are removed in the background; the
/// list still shows it as `deleting` until they are).
async fn must_get(ctx: &Ctx, name: &str) -> Result<Object<BackingImage>, ApiError> {
    match ctx.db.get::<BackingImage>(name).await? {
        Some(o) if o.data.spec.deletion_timestamp.is_some() => Err(ApiError::NotFound(format!(
            "backing image {name:?} not found: it is being deleted"
        ))),
        Some(o) => Ok(o),
        None => Err(not_found(name)),
    }
}

async fn list(State(ctx): State<Ctx>) -> ApiResult<Vec<BackingImageView>> {
    Ok(Json(
        ctx.db
            .list::<BackingImage>()
            .await?
            .iter()
            .map(BackingImageView::new)
            .collect(),
    ))
}

async fn get(State(ctx): State<Ctx>, Path(name): Path<String>) -> ApiResult<BackingImageView> {
    Ok(Json(BackingImageView::new(&must_get(&ctx, &name).await?)))
}

/// A SHA-512 in hex (any case) → lower case; empty stays empty.
fn check_checksum(c: &str) -> Result<String, ApiError> {
    check_checksum_pattern(c)?;
    Ok(c.to_ascii_lowercase())
}

async fn create(
    State(ctx): State<Ctx>,
    Body(req): Body<BackingImageCreate>,
) -> Result<(StatusCode, Json<BackingImageView>), ApiError> {
    check_name("backing image name", &req.name)?;
    let source_type = req.source_type.parse::<SourceType>().map_err(|_| {
        ApiError::Invalid(format!(
            "unknown sourceType {:?}; use download, upload, export-from-volume, restore or clone",
            req.source_type
        ))
    })?;
    check_source_parameters(source_type, &req.parameters)?;
    let expected_checksum = check_checksum(&req.expected_checksum)?;
    let data_engine = match req.data_engine.as_deref() {
        None => DataEngine::default(),
        Some(e) => e
            .parse::<DataEngine>()
            .map_err(|_| ApiError::Invalid(format!("dataEngine {e:?} is not v1 or v2")))?,
    };
    let min = match req.min_number_of_copies {
        Some(n) => n,
        None => u32::try_from(ctx.setting_u64(MIN_COPIES_SETTING).await).unwrap_or(1),
    };
    check_copies("minNumberOfCopies", min)?;
    if let Some(old) = ctx.db.get::<BackingImage>(&req.name).await? {
        if old.data.spec.deletion_timestamp.is_none() {
            return Err(ApiError::Conflict(format!(
                "backing image {:?} already exists",
                req.name
            )));
        }
        // Deleted (GET already answers 404): its files are being removed; the new image of that name waits for
        // them rather than refusing a name the API calls free.
        wait_deleted(&ctx, &req.name).await?;
    }
    let bi = BackingImage {
        spec: BackingImageSpec {
            // The UUID is part of the first write: nothing of this image exists before it is stored.
            uuid: uuid::Uuid::new_v4().to_string(),
            source_type,
            parameters: req.parameters.clone(),
            expected_checksum,
            min_number_of_copies: min,
            disk_selector: req.disk_selector.clone(),
            node_selector: req.node_selector.clone(),
            disk_file_spec_map: BTreeMap::new(),
            data_engine,
            deletion_timestamp: None,
        },
        status: Default::default(),
    };
    // The request is well formed (checked above); what is left depends on the cluster: a source volume, a ready
    // copy to clone, a disk with room.
    if data_engine.copies_are_lvols() {
        super::v2_controller::check_v2_disk(&ctx, &bi)
            .await
            .map_err(ApiError::Conflict)?;
    }
    let ds = data_source_for(&ctx, &bi).await.map_err(ApiError::Conflict)?;
    // A leftover data source of an earlier image of this name goes first (an image's deletion removes its data
    // source before the image, so none can belong to a live image here).
    ctx.db.delete_any::<BackingImageDataSource>(&req.name).await?;
    let obj = match ctx.db.create(&req.name, bi).await {
        Ok(o) => o,
        Err(StoreError::AlreadyExists { .. }) => {
            return Err(ApiError::Conflict(format!(
                "backing image {:?} already exists",
                req.name
            )));
        }
        Err(e) => return Err(e.into()),
    };
    match ctx.db.create(&req.name, ds).await {
        // The image controller saw the image first and made its data source: the same thing.
        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    Ok((StatusCode::CREATED, Json(BackingImageView::new(&obj))))
}

/// How long a create waits for a deleted image of the same name to be gone (its copies removed by the disk
/// managers, usually within seconds).
const DELETED_WAIT: Duration = Duration::from_secs(30);

/// Waits until the deleted image `name` is gone from the store; 409 when its files are still being removed after
/// [`DELETED_WAIT`] (a disk manager that does not answer), naming the disks.
async fn wait_deleted(ctx: &Ctx, name: &str) -> Result<(), ApiError> {
    let end = Instant::now() + DELETED_WAIT;
    loop {
        let Some(old) = ctx.db.get::<BackingImage>(name).await? else {
            return Ok(());
        };
        if Instant::now() >= end {
            let disks: Vec<&str> = old
                .data
                .status
                .disk_file_status_map
                .keys()
                .map(String::as_str)
                .collect();
            return Err(ApiError::Conflict(format!(
                "backing image {name:?} was deleted and its copies (disks {}) are still being removed after {}s: \
                 create it again once they are",
                disks.join(", "),
                DELETED_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Volumes that use `image`.
async fn users(ctx: &Ctx, image: &str) -> Result<Vec<String>, ApiError> {
    Ok(ctx
        .db
        .list::<Volume>()
        .await?
        .into_iter()
        .filter(|v| v.data.spec.backing_image.as_deref() == Some(image))
        .map(|v| v.name)
        .collect())
}

async fn delete(State(ctx): State<Ctx>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    let obj = must_get(&ctx, &name).await?;
    let vols = users(&ctx, &name).await?;
    if !vols.is_empty() {
        return Err(ApiError::Conflict(format!(
            "backing image {name} is used by volume(s) {}: delete them first",
            vols.join(", ")
        )));
    }
    drop(obj);
    // A read-modify-write that retries when a controller updated the image meanwhile (its status changes all the
    // time while copies sync): the user's delete must not fail on the controllers' writes.
    let now = crate::runtime::now();
    ctx.db
        .modify::<BackingImage>(&name, |b| {
            let first = b.spec.deletion_timestamp.is_none();
            if first {
                b.spec.deletion_timestamp = Some(now);
            }
            first
        })
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn cleanup(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    Body(req): Body<CleanupRequest>,
) -> ApiResult<BackingImageView> {
    let mut obj = must_get(&ctx, &name).await?;
    let used = super::image_controller::replica_disks(&ctx, &name)
        .await
        .map_err(|e| ApiError::Unavailable(format!("{e:#}")))?;
    for d in &req.disks {
        if !obj.data.spec.disk_file_spec_map.contains_key(d) {
            // The image exists; the disk named is what does not fit.
            return Err(ApiError::Conflict(format!(
                "backing image {name} has no copy on disk {d}"
            )));
        }
        if used.contains_key(d) {
            return Err(ApiError::Conflict(format!(
                "the copy of backing image {name} on disk {d} is used by replicas"
            )));
        }
    }
    for d in &req.disks {
        obj.data.spec.disk_file_spec_map.remove(d);
    }
    ctx.db.update(&mut obj).await?;
    Ok(Json(BackingImageView::new(&obj)))
}

async fn copy(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    Body(req): Body<CleanupRequest>,
) -> ApiResult<BackingImageView> {
    let obj = must_get(&ctx, &name).await?;
    let engine = obj.data.spec.data_engine;
    let all = super::disks::disks(&ctx)
        .await
        .map_err(|e| ApiError::Unavailable(format!("{e:#}")))?;
    let mut add = Vec::new();
    for d in &req.disks {
        let Some(disk) = all.iter().find(|x| &x.disk_uuid == d) else {
            return Err(ApiError::Conflict(format!("no disk {d}")));
        };
        if disk.engine != engine {
            return Err(ApiError::Conflict(format!(
                "disk {} on node {} is a {:?} disk; backing image {name} is {:?}",
                disk.disk_name, disk.node_id, disk.engine, engine
            )));
        }
        add.push((d.clone(), disk.node_id.clone()));
    }
    let obj =
        ctx.db
            .modify::<BackingImage>(&name, |b| {
                let before = b.spec.disk_file_spec_map.len();
                for (d, node) in &add {
                    b.spec.disk_file_spec_map.entry(d.clone()).or_insert_with(|| {
                        super::model::DiskFileSpec {
                            node_id: node.clone(),
                            data_engine: engine,
                        }
                    });
                }
                b.spec.disk_file_spec_map.len() != before
            })
            .await?;
    Ok(Json(BackingImageView::new(&obj)))
}

#[derive(Debug, Deserialize)]
pub struct UploadQuery {
    pub size: Option<u64>,
}

/// Streams the request body (the multipart form, unchanged) to the image's data source once it waits for data.
async fn upload(
    State(ctx): State<Ctx>,
    Path(name): Path<String>,
    Query(q): Query<UploadQuery>,
    headers: HeaderMap,
    body: RawBody,
) -> ApiResult<BackingImageView> {
    let size = q
        .size
        .filter(|s| *s > 0)
        .ok_or_else(|| ApiError::Invalid("upload needs ?size=BYTES (the file's size, more than 0)".into()))?;
    let bi = must_get(&ctx, &name).await?;
    if bi.data.spec.source_type != SourceType::Upload {
        return Err(ApiError::Conflict(format!(
            "backing image {name} comes from {}, not from an upload",
            bi.data.spec.source_type.as_str()
        )));
    }
    // The data source is ready for the data once its daemon answers in state `pending` (seed: wait up to 30 s).
    let end = Instant::now() + Duration::from_secs(30);
    let address = loop {
        let ds = ctx.db.get::<BackingImageDataSource>(&name).await?;
        if let Some(d) = &ds {
            if d.data.spec.started
                || d.data
                    .status
                    .state
                    .is_some_and(|s| s != state::PENDING && s != state::STARTING)
            {
                return Err(ApiError::Conflict(format!(
                    "backing image {name} does not wait for an upload (its data source is {})",
                    d.data.status.state.map_or("", FileState::as_str)
                )));
            }
            if d.data.status.state == Some(state::PENDING) && !d.data.status.address.is_empty() {
                break d.data.status.address.clone();
            }
        }
        if Instant::now() > end {
            return Err(ApiError::Unavailable(format!(
                "the data source of backing image {name} is not ready for the upload after 30 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (http, url) = super::datasource_controller::data_source_http(
        &address,
        &format!("/v1/file?action=upload&size={size}"),
    )
    .map_err(ApiError::Internal)?;
    let mut req = http
        .post(url)
        .body(reqwest::Body::wrap_stream(body.into_data_stream()));
    if let Some(ct) = headers.get(axum::http::header::CONTENT_TYPE) {
        req = req.header(reqwest::header::CONTENT_TYPE, ct.as_bytes());
    }
    let resp = req
        .send()
        .await
        .map_err(|e| ApiError::Unavailable(format!("data source of {name} at {address}: {e}")))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or(text);
        let message = format!("upload of {name} refused: {message}");
        return Err(if status == reqwest::StatusCode::CONFLICT {
            ApiError::Conflict(message)
        } else {
            ApiError::Invalid(message)
        });
    }
    Ok(Json(BackingImageView::new(&must_get(&ctx, &name).await?)))
}
