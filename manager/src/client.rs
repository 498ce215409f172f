//! The manager's REST client lives in `corral_api::client`; re-exported here for the CLI and the tests.

pub use corral_api::client::{Client, ClientError};
