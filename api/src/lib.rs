//! The manager's REST API as its clients see it (issue 44): the JSON views and requests of the routes the `corral`
//! CLI and `corral-csi` call, the enums and store documents those views embed (shown as stored), and a typed REST
//! [`client::Client`]. It depends on serde and reqwest only — never on the manager's store, controllers or server —
//! so a client links none of them. The manager re-exports these types where they used to live and builds the views
//! from its documents (`volume::views::volume_view`, `node::views::node_view`, …).

pub mod backup;
pub mod client;
pub mod clone;
pub mod model;
pub mod node;
pub mod token;
pub mod volume;
