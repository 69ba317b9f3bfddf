//! Helpers shared by the shim's tests and its `hot-functions` example.

#![allow(clippy::unwrap_used, dead_code)]

use xpu_testkit::bundle::TestHost;
use xpu_testkit::hosts;

/// The 8×A100 fixture host with the host snapshot in its CDI directory (`dir/cdi`, where its
/// `runtime.toml` looks), as `xpu cdi generate` leaves it.
pub fn a100_host_with_snapshot() -> TestHost {
    let host = TestHost::new(&hosts::a100_8x());
    let root = xpu_host::Root::new(host.fixture.root()).unwrap();
    let snap = xpu_shim::host_snapshot(&root, xpu_host::host_key(&root)).unwrap();
    let cdi = host.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    std::fs::write(cdi.join(xpu_container::snapshot::FILE_NAME), snap.to_json()).unwrap();
    host
}
