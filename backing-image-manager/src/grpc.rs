//! The gRPC `BackingImageManagerService`, the one place server-side that knows the wire types: requests are
//! checked and turned into domain calls on [`Manager`], domain results and events into protobuf messages, errors
//! into status codes (`BimError`'s `From`).

use std::sync::Arc;

use corral_proto::v1;
use corral_proto::v1::backing_image_manager_service_server::BackingImageManagerService;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::BimError;
use crate::image::{DiskImages, ImageEvent, ImageSpec, ImageView, check_ref};
use crate::manager::Manager;
use crate::state::FileState;

/// Version of this API; clients older than `API_MIN_VERSION` are not served (one definition, shared with the
/// control plane's compatibility check).
pub use corral_proto::backing_image::{
    BIM_API_MIN_VERSION as API_MIN_VERSION, BIM_API_VERSION as API_VERSION,
};

/// The service over one manager.
pub struct BimService {
    manager: Arc<Manager>,
}

impl BimService {
    pub fn new(manager: Arc<Manager>) -> Self {
        BimService { manager }
    }
}

type Reply<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl BackingImageManagerService for BimService {
    async fn fetch(&self, req: Request<v1::BimFetchRequest>) -> Reply<v1::BimImage> {
        let r = req.into_inner();
        let spec = image_spec(r.spec)?;
        let span = tracing::info_span!("fetch", image = %spec.name, uuid = %spec.uuid, source = %r.data_source_address);
        let img = self
            .manager
            .fetch(spec, &r.data_source_address)
            .instrument(span)
            .await?;
        Ok(Response::new(image_proto(img)))
    }

    async fn sync(&self, req: Request<v1::BimSyncRequest>) -> Reply<v1::BimImage> {
        let r = req.into_inner();
        let spec = image_spec(r.spec)?;
        let span = tracing::info_span!("sync", image = %spec.name, uuid = %spec.uuid, from = %r.from_address);
        let img = self.manager.sync(spec, &r.from_address).instrument(span).await?;
        Ok(Response::new(image_proto(img)))
    }

    async fn send(&self, req: Request<v1::BimSendRequest>) -> Reply<v1::BimSendResponse> {
        let r = req.into_inner();
        let span = tracing::info_span!("send", image = %r.name, uuid = %r.uuid, to = %r.to_address);
        let s = self
            .manager
            .send(&r.name, &r.uuid, &r.to_address)
            .instrument(span)
            .await?;
        Ok(Response::new(v1::BimSendResponse {
            bytes_sent: s.bytes_sent,
            data_bytes: s.data_bytes,
            hole_bytes: s.hole_bytes,
            duration_ms: s.duration_ms,
        }))
    }

    async fn delete(&self, req: Request<v1::BimImageRef>) -> Reply<v1::Empty> {
        let r = req.into_inner();
        self.manager.delete(&r.name, &r.uuid).await?;
        Ok(Response::new(v1::Empty {}))
    }

    async fn get(&self, req: Request<v1::BimImageRef>) -> Reply<v1::BimImage> {
        let r = req.into_inner();
        Ok(Response::new(image_proto(self.manager.get(&r.name, &r.uuid)?)))
    }

    async fn list(&self, _req: Request<v1::Empty>) -> Reply<v1::BimImageList> {
        Ok(Response::new(list_proto(self.manager.list())))
    }

    async fn version_get(&self, _req: Request<v1::Empty>) -> Reply<v1::BimVersion> {
        Ok(Response::new(v1::BimVersion {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            git_commit: option_env!("CORRAL_GIT_COMMIT").unwrap_or("").to_owned(),
            api_version: API_VERSION,
            api_min_version: API_MIN_VERSION,
        }))
    }

    async fn prepare_download(&self, req: Request<v1::BimImageRef>) -> Reply<v1::BimPrepareDownloadResponse> {
        let r = req.into_inner();
        check_ref(&r.name, &r.uuid)?;
        let img = self.manager.get(&r.name, &r.uuid)?;
        if img.state != FileState::Ready {
            return Err(Status::failed_precondition(format!(
                "image {} is {}, not ready: nothing to download",
                r.name, img.state
            )));
        }
        let address = self.manager.config().http_address.clone();
        Ok(Response::new(v1::BimPrepareDownloadResponse {
            src_file_path: img.path,
            url: format!(
                "{}/v1/files/{}/download",
                sparse_sync::http_base(&address, corral_tls::installed().is_some()),
                r.name
            ),
            address,
        }))
    }

    type WatchStream = ReceiverStream<Result<v1::BimImageEvent, Status>>;

    async fn watch(&self, _req: Request<v1::Empty>) -> Reply<Self::WatchStream> {
        let mut events = self.manager.subscribe();
        let (tx, rx) = mpsc::channel(64);
        let stop = self.manager.cancel.clone();
        tokio::spawn(async move {
            loop {
                let ev = tokio::select! {
                    () = stop.cancelled() => return,
                    () = tx.closed() => return,
                    ev = events.recv() => ev,
                };
                let ev = match ev {
                    Ok(ev) => event_proto(ev),
                    Err(broadcast::error::RecvError::Lagged(_)) => v1::BimImageEvent {
                        image: None,
                        deleted: false,
                        resync: true,
                    },
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Checks a spec from the wire: names that stay one path component, a well-formed checksum.
fn image_spec(spec: Option<v1::BimImageSpec>) -> Result<ImageSpec, BimError> {
    let s = spec.ok_or_else(|| BimError::InvalidArgument("spec is missing".into()))?;
    ImageSpec::checked(s.name, s.uuid, s.size, s.checksum)
}

fn spec_proto(spec: ImageSpec) -> v1::BimImageSpec {
    v1::BimImageSpec {
        name: spec.name,
        uuid: spec.uuid,
        size: spec.size,
        checksum: spec.checksum,
    }
}

fn image_proto(img: ImageView) -> v1::BimImage {
    v1::BimImage {
        spec: Some(spec_proto(img.spec)),
        status: Some(v1::BimImageStatus {
            state: img.state.as_str().to_owned(),
            message: img.message,
            progress: u32::from(img.progress),
            current_checksum: img.current_checksum,
            sending_reference: img.sending,
            sender_address: img.sender_address,
            size: img.size,
            virtual_size: img.virtual_size,
            real_size: img.real_size,
        }),
        disk_uuid: img.disk_uuid,
        path: img.path,
    }
}

fn list_proto(list: DiskImages) -> v1::BimImageList {
    v1::BimImageList {
        images: list.images.into_iter().map(image_proto).collect(),
        disk_uuid: list.disk_uuid,
        disk_message: list.disk_message,
    }
}

fn event_proto(ev: ImageEvent) -> v1::BimImageEvent {
    let (img, deleted) = match ev {
        ImageEvent::Changed(img) => (img, false),
        ImageEvent::Deleted(img) => (img, true),
    };
    v1::BimImageEvent {
        image: Some(image_proto(img)),
        deleted,
        resync: false,
    }
}
