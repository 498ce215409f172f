//! Compiles every `.proto` under `proto/` with protox (pure Rust, no system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let corral = [
        "proto/corral/v1/replica.proto",
        "proto/corral/v1/syncagent.proto",
        "proto/corral/v1/controller.proto",
        "proto/corral/v1/backing_image_manager.proto",
        "proto/corral/v1/backup.proto",
        "proto/corral/v1/lvstore.proto",
        "proto/corral/v1/instance.proto",
    ];
    // etcd v3's own API (trimmed): Corral is only ever its client, so no server code and no serde.
    let etcd = ["proto/etcd/mvccpb/kv.proto", "proto/etcd/etcdserverpb/rpc.proto"];
    for f in corral.iter().chain(&etcd) {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure()
        .type_attribute(".corral.v1", "#[derive(serde::Serialize, serde::Deserialize)]")
        .type_attribute(".corral.v1", "#[serde(rename_all = \"camelCase\")]")
        .compile_fds(protox::compile(corral, ["proto"])?)?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(protox::compile(etcd, ["proto"])?)?;
    Ok(())
}
