//! Corral manager: control plane (store, controllers, supervision, REST API, CLI) (skeleton; see issue 10)
