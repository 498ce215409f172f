//! Patterns the API's checks and its OpenAPI document share, in a leaf module so resource modules' schema
//! modules can use them without depending on `api::openapi`.

/// Names of volumes, snapshots, disks, backing images and nodes: one path component on disk (the same rule as
/// `corral_disk::identity::check_path_component`, which the daemons apply).
pub const NAME_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$";
