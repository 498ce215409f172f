//! End-to-end tests that span Corral's daemons as users deploy them. The crate has no library code of its own: the
//! tests live in `tests/` (`containers.rs`: the images `docker/build.sh` makes and the compose cluster of
//! `docker/compose.yaml`, exercised from the host through NBD).
