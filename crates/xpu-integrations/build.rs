//! Compiles the kubelet device plugin API (`proto/deviceplugin/v1beta1/api.proto`) into Rust with
//! protox, a pure-Rust protobuf compiler, so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/deviceplugin/v1beta1/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
