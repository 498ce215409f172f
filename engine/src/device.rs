//! The volume as the NBD frontend's block device.

use crate::error::EngineError;
use crate::nbd::{Allocation, BlockDevice, DeviceError};
use crate::volume::Volume;

fn device_error(e: EngineError) -> DeviceError {
    match e {
        EngineError::InvalidArgument(m) => DeviceError::invalid(m),
        EngineError::NoSpace(v) => DeviceError::no_space(format!("no space left on the replicas of {v}")),
        other => DeviceError::io(other.to_string()),
    }
}

impl BlockDevice for Volume {
    fn size(&self) -> u64 {
        Volume::size(self)
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        Volume::read(self, offset, buf).await.map_err(device_error)
    }

    async fn write(&self, offset: u64, data: bytes::Bytes, fua: bool) -> Result<(), DeviceError> {
        Volume::write_bytes(self, offset, data, fua)
            .await
            .map_err(device_error)
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        Volume::flush(self).await.map_err(device_error)
    }

    async fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        Volume::trim(self, offset, len).await.map_err(device_error)
    }

    async fn write_zeroes(&self, offset: u64, len: u64, _may_trim: bool) -> Result<(), DeviceError> {
        Volume::write_zeroes(self, offset, len)
            .await
            .map_err(device_error)
    }

    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<(u64, Allocation)>, DeviceError> {
        Volume::block_status(self, offset, len)
            .await
            .map_err(device_error)
    }
}
