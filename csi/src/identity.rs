//! The Identity service: who the plugin is, what it offers, and whether it can work (the manager answers).

use tonic::{Request, Response, Status};

use crate::error::CsiError;
use crate::manager_api::ManagerApi;
use crate::proto::identity_server::Identity;
use crate::proto::plugin_capability::{self, service, volume_expansion};
use crate::proto::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest, GetPluginInfoResponse,
    PluginCapability, ProbeRequest, ProbeResponse,
};

pub struct IdentityService {
    pub manager: ManagerApi,
    /// Whether this process also serves the Controller service (the capability is advertised only then).
    pub controller: bool,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: crate::DRIVER_NAME.to_owned(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: [("manager".to_owned(), self.manager.url().to_owned())].into(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let service = |t: service::Type| PluginCapability {
            r#type: Some(plugin_capability::Type::Service(plugin_capability::Service {
                r#type: t.into(),
            })),
        };
        let mut caps = vec![service(service::Type::VolumeAccessibilityConstraints)];
        if self.controller {
            caps.push(service(service::Type::ControllerService));
        }
        // An NBD client sees the export's size at connect time only: a volume grows while unpublished.
        caps.push(PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: volume_expansion::Type::Offline.into(),
                },
            )),
        });
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: caps,
        }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        self.manager.healthy().await.map_err(|e| {
            Status::from(CsiError::FailedPrecondition(format!(
                "the manager at {} does not answer: {e}",
                self.manager.url()
            )))
        })?;
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}
