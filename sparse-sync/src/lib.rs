//! sparse-sync owns everything about moving sparse files: discovering which ranges of a file hold data
//! ([`layout`]), punching holes, and (as it grows) local sparse copy, fold and prune, and the HTTP sync protocol
//! used by replica rebuild, snapshot export and backing-image delivery.

pub mod layout;

pub use layout::{DataExtents, data_extents, punch_hole};
