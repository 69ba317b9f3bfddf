//! Compiles the kubelet gRPC APIs into Rust with protox, a pure-Rust protobuf compiler, so
//! building needs no system `protoc`:
//! - the device plugin API (`proto/deviceplugin/v1beta1`, package `v1beta1`) into `OUT_DIR`;
//! - the DRA plugin service (`proto/dra/v1`, `proto/dra/v1beta1`, packages
//!   `k8s.io.kubelet.pkg.apis.dra.v1` and `...v1beta1` as upstream), its device health service
//!   (`proto/drahealth/v1alpha1`, package `v1alpha1`) and plugin registration
//!   (`proto/pluginregistration/v1`), each into its own directory under `OUT_DIR`, one
//!   descriptor set and one generated file each;
//! - the kubelet's PodResources API (`proto/podresources/v1`, package `v1`) into its own
//!   directory too;
//! - the TPU runtime's metrics service (`proto/tpuruntime`, package `tpu.monitoring.runtime`).

fn compile(proto: &str, out: Option<&str>) -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    let mut builder = tonic_prost_build::configure().build_client(true).build_server(true);
    if let Some(sub) = out {
        let dir = std::path::Path::new(&std::env::var("OUT_DIR")?).join(sub);
        std::fs::create_dir_all(&dir)?;
        builder = builder.out_dir(dir);
    }
    builder.compile_fds(fds)?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    compile("proto/deviceplugin/v1beta1/api.proto", None)?;
    compile("proto/dra/v1/api.proto", Some("dra_v1"))?;
    compile("proto/dra/v1beta1/api.proto", Some("dra_v1beta1"))?;
    compile("proto/pluginregistration/v1/api.proto", Some("pluginregistration_v1"))?;
    compile("proto/drahealth/v1alpha1/api.proto", Some("drahealth_v1alpha1"))?;
    compile("proto/podresources/v1/api.proto", Some("podresources_v1"))?;
    compile("proto/tpuruntime/metrics.proto", Some("tpuruntime"))?;
    Ok(())
}
