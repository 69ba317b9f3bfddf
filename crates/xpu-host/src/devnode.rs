//! `stat` of device nodes under a root: type, major, minor and mode come from the real node.

use std::os::unix::fs::{FileTypeExt, MetadataExt};

use xpu_core::inventory::{DevNode, NodeType};

use crate::Root;

/// Linux `dev_t` split (glibc's `gnu_dev_major`/`gnu_dev_minor` encoding).
pub fn major_minor(rdev: u64) -> (u32, u32) {
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    // Both halves are 32-bit by construction of the encoding.
    (major as u32, minor as u32)
}

/// The node at host path `path` (e.g. `/dev/nvidia0`), or `None` when nothing is there.
/// A path that exists but is not a device node (a fixture placeholder) has no type/major/minor.
pub fn stat(root: &Root, path: &str) -> Option<DevNode> {
    let meta = std::fs::metadata(root.path(path)).ok()?;
    let ft = meta.file_type();
    let node_type = if ft.is_char_device() {
        Some(NodeType::Char)
    } else if ft.is_block_device() {
        Some(NodeType::Block)
    } else {
        None
    };
    let (major, minor) = match node_type {
        Some(_) => {
            let (ma, mi) = major_minor(meta.rdev());
            (Some(ma), Some(mi))
        }
        None => (None, None),
    };
    Some(DevNode {
        path: path.to_owned(),
        node_type,
        major,
        minor,
        mode: Some(meta.mode() & 0o7777),
        uid: Some(meta.uid()),
        gid: Some(meta.gid()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_dev_t() {
        // makedev(195, 3) and makedev(511, 300) in glibc's encoding.
        assert_eq!(major_minor((195 << 8) | 3), (195, 3));
        let dev: u64 = ((511u64 & 0xfff) << 8) | (300u64 & 0xff) | ((300u64 & !0xff) << 12);
        assert_eq!(major_minor(dev), (511, 300));
    }

    #[test]
    fn real_char_device() {
        let n = stat(&Root::host(), "/dev/null").unwrap();
        assert_eq!((n.node_type, n.major, n.minor), (Some(NodeType::Char), Some(1), Some(3)));
        assert!(stat(&Root::host(), "/dev/definitely-not-here").is_none());
    }
}
