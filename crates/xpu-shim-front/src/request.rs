//! Whether a container's spec could ask for devices at all: the shim's first question, so that
//! a container asking for nothing costs it no look at the host.

/// NVIDIA's variable: GPU indices, UUIDs, `all`, `none`, or `void`.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// xpu's vendor-neutral variable: CDI names.
pub const XPU_VISIBLE_DEVICES: &str = "XPU_VISIBLE_DEVICES";
/// The prefix of CDI's OCI annotations (`cdi.k8s.io/<name>: <devices>`).
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// Whether a container with environment `env` (`process.env` entries, `NAME=value`) and
/// annotation names `annotations` may ask for devices: `NVIDIA_VISIBLE_DEVICES` or
/// `XPU_VISIBLE_DEVICES` set (its last definition, as runc and `execve` see it) to something
/// other than empty or `void`, or any CDI annotation.
pub fn may_request<'a>(
    env: impl IntoIterator<Item = &'a str>,
    mut annotations: impl Iterator<Item = &'a str>,
) -> bool {
    let (mut nvidia, mut xpu) = (None, None);
    for entry in env {
        let (name, value) = entry.split_once('=').unwrap_or((entry, ""));
        if name == NVIDIA_VISIBLE_DEVICES {
            nvidia = Some(value);
        } else if name == XPU_VISIBLE_DEVICES {
            xpu = Some(value);
        }
    }
    let asks = |v: Option<&str>| v.is_some_and(|v| !matches!(v.trim(), "" | "void"));
    asks(nvidia) || asks(xpu) || annotations.any(|k| k.starts_with(CDI_ANNOTATION_PREFIX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_definition_decides() {
        let none = core::iter::empty();
        assert!(may_request(["NVIDIA_VISIBLE_DEVICES=0"], none.clone()));
        assert!(!may_request(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=void"], none));
        assert!(!may_request(["NVIDIA_VISIBLE_DEVICES= "], core::iter::empty()));
        assert!(!may_request(["NVIDIA_VISIBLE_DEVICES"], core::iter::empty()));
        assert!(may_request(["XPU_VISIBLE_DEVICES=nvidia.com/gpu=1"], core::iter::empty()));
        assert!(may_request([], ["cdi.k8s.io/x"].into_iter()));
        assert!(!may_request(["PATH=/bin"], ["io.kubernetes.cri.x"].into_iter()));
    }
}
