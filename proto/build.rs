//! Compiles every `.proto` under `proto/` with protox (pure Rust, no system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/corral/v1/replica.proto",
        "proto/corral/v1/syncagent.proto",
        "proto/corral/v1/controller.proto",
        "proto/corral/v1/backing_image_manager.proto",
        "proto/corral/v1/backup.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .type_attribute(".corral.v1", "#[derive(serde::Serialize, serde::Deserialize)]")
        .type_attribute(".corral.v1", "#[serde(rename_all = \"camelCase\")]")
        .compile_fds(fds)?;
    Ok(())
}
