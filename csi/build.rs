//! Compiles `proto/csi/v1/csi.proto` with protox (pure Rust, no system `protoc`), like `proto/build.rs`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "proto/csi/v1/csi.proto";
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(fds)?;
    Ok(())
}
