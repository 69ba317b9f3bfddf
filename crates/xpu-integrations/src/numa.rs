//! Host NUMA cells and the socket each is on, as Nova's libvirt driver reports them (the
//! `socket` PCI NUMA policy needs them): `/sys/devices/system/node/node<N>/cpulist` and each
//! CPU's `topology/physical_package_id`. A cell whose CPUs span sockets, or whose socket cannot
//! be read, has no socket. Hosts (or fixtures) without `/sys/devices/system/node` fall back to the
//! NUMA nodes the devices report, without sockets.

use std::collections::BTreeSet;

use xpu_core::Inventory;
use xpu_core::nova::NumaCell;
use xpu_host::Root;

/// Parses a kernel CPU list (`0-3,8-11`).
pub fn parse_cpulist(s: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>())
                    && a <= b
                    && b - a < 65536
                {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

/// The host's NUMA cells, in id order.
pub fn host_cells(root: &Root, inv: &Inventory) -> Vec<NumaCell> {
    let dir = root.path("/sys/devices/system/node");
    let mut cells = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_prefix("node"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let cpus = std::fs::read_to_string(e.path().join("cpulist")).unwrap_or_default();
            let sockets: BTreeSet<Option<u32>> = parse_cpulist(&cpus)
                .into_iter()
                .map(|cpu| {
                    let p = root.path(format!(
                        "/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"
                    ));
                    std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse().ok())
                })
                .collect();
            let socket = match sockets.into_iter().collect::<Vec<_>>()[..] {
                [Some(s)] => Some(s),
                _ => None,
            };
            cells.push(NumaCell { id, socket });
        }
    }
    if cells.is_empty() {
        let ids: BTreeSet<u32> = inv.devices.iter().filter_map(|d| d.numa_node).collect();
        cells = ids.into_iter().map(|id| NumaCell { id, socket: None }).collect();
    }
    cells.sort_by_key(|c| c.id);
    cells
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), [0, 1, 2, 3, 8, 10, 11]);
        assert!(parse_cpulist("").is_empty());
        assert!(parse_cpulist("5-2,x").is_empty());
    }

    #[test]
    fn reads_cells_and_sockets_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::new(dir.path()).unwrap();
        for (node, cpus, socket) in [(0, "0-1", "0"), (1, "2-3", "1")] {
            let n = dir.path().join(format!("sys/devices/system/node/node{node}"));
            std::fs::create_dir_all(&n).unwrap();
            std::fs::write(n.join("cpulist"), cpus).unwrap();
            for cpu in parse_cpulist(cpus) {
                let t = dir.path().join(format!("sys/devices/system/cpu/cpu{cpu}/topology"));
                std::fs::create_dir_all(&t).unwrap();
                std::fs::write(t.join("physical_package_id"), socket).unwrap();
            }
        }
        let cells = host_cells(&root, &Inventory::default());
        assert_eq!(
            cells,
            [NumaCell { id: 0, socket: Some(0) }, NumaCell { id: 1, socket: Some(1) }]
        );
    }
}
