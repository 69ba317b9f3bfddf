//! Host-readiness state for fixture trees, laid over a built [`crate::Fixture`]: ACPI IOMMU
//! tables, `/dev/kvm` and friends, cgroup mounts, `/proc/self/limits`, limits.conf and
//! limits.d, `/etc/default/grub`, transparent huge pages, huge pages in `/proc/meminfo`,
//! modprobe.d files. The device side (drivers, groups, `/proc/cmdline`, modules) stays in the
//! [`crate::HostSpec`].

use std::fs;
use std::path::Path;

/// How cgroups are mounted in the fixture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupLayout {
    None,
    /// One v1 hierarchy per controller, plus an empty unified hierarchy (hybrid, as systemd
    /// mounts it).
    V1(Vec<String>),
    /// The unified hierarchy with these controllers enabled for the process's cgroup.
    V2(Vec<String>),
}

/// Readiness files to write under a fixture root.
#[derive(Debug, Clone)]
pub struct Readiness {
    /// ACPI tables present under `/sys/firmware/acpi/tables` (`DMAR`, `IVRS`).
    pub acpi_tables: Vec<String>,
    /// Device nodes to create as placeholders (`/dev/kvm`, `/dev/net/tun`, `/dev/vhost-net`).
    pub dev_nodes: Vec<String>,
    pub cgroups: CgroupLayout,
    /// `/proc/self/limits` content.
    pub proc_limits: Option<String>,
    pub limits_conf: Option<String>,
    /// `(file name, content)` in `/etc/security/limits.d`.
    pub limits_d: Vec<(String, String)>,
    /// `/etc/default/grub` content.
    pub grub: Option<String>,
    /// `/sys/kernel/mm/transparent_hugepage/enabled` content.
    pub thp: Option<String>,
    pub hugepages_total: Option<u64>,
    /// `(file name, content)` in `/etc/modprobe.d`.
    pub modprobe_d: Vec<(String, String)>,
}

/// A `/proc/<pid>/limits` text with the given memlock (`None`: unlimited) and nofile limits.
pub fn proc_limits(memlock_bytes: Option<u64>, nofile: u64) -> String {
    let m = memlock_bytes.map_or("unlimited".to_owned(), |b| b.to_string());
    format!(
        "Limit                     Soft Limit           Hard Limit           Units     \n\
         Max cpu time              unlimited            unlimited            seconds   \n\
         Max open files            {nofile:<20} {nofile:<20} files     \n\
         Max locked memory         {m:<20} {m:<20} bytes     \n\
         Max address space         unlimited            unlimited            bytes     \n"
    )
}

/// A typical Debian/Ubuntu `/etc/default/grub` with the given command-line values.
pub fn grub_file(linux: &str, linux_default: &str) -> String {
    format!(
        "# If you change this file, run 'update-grub' afterwards to update\n# /boot/grub/grub.cfg.\n\nGRUB_DEFAULT=0\nGRUB_TIMEOUT=5\nGRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`\nGRUB_CMDLINE_LINUX_DEFAULT=\"{linux_default}\"\nGRUB_CMDLINE_LINUX=\"{linux}\"\n"
    )
}

const ALL_CONTROLLERS: [&str; 8] =
    ["cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids"];

impl Readiness {
    /// Nothing prepared: no IOMMU tables, no device nodes, no cgroups, no limits files.
    pub fn bare() -> Self {
        Self {
            acpi_tables: Vec::new(),
            dev_nodes: Vec::new(),
            cgroups: CgroupLayout::None,
            proc_limits: Some(proc_limits(Some(8 * 1024 * 1024), 1024)),
            limits_conf: None,
            limits_d: Vec::new(),
            grub: None,
            thp: Some("always [madvise] never\n".to_owned()),
            hugepages_total: Some(0),
            modprobe_d: Vec::new(),
        }
    }

    /// A hypervisor ready for passthrough (pair it with a vfio host spec whose command line has
    /// the IOMMU parameters): DMAR, KVM nodes, cgroup v1 controllers, limits configured and in
    /// effect, huge pages reserved, nouveau blacklisted.
    pub fn ready_vfio_host() -> Self {
        Self {
            acpi_tables: vec!["DMAR".to_owned()],
            dev_nodes: ["/dev/kvm", "/dev/net/tun", "/dev/vhost-net"].map(str::to_owned).to_vec(),
            cgroups: CgroupLayout::V1(ALL_CONTROLLERS.map(str::to_owned).to_vec()),
            proc_limits: Some(proc_limits(None, 100_000)),
            limits_conf: Some("# /etc/security/limits.conf\n#<domain> <type> <item> <value>\n".to_owned()),
            limits_d: vec![(
                "90-xpu.conf".to_owned(),
                "* - memlock unlimited\nroot - memlock unlimited\n* - nofile 100000\nroot - nofile 100000\n".to_owned(),
            )],
            grub: Some(grub_file("intel_iommu=on iommu=pt", "quiet")),
            thp: Some("always [madvise] never\n".to_owned()),
            hugepages_total: Some(1024),
            modprobe_d: vec![("blacklist.conf".to_owned(), "blacklist nouveau\n".to_owned())],
        }
    }

    /// A TPU VM image prepared as the custom-image seed says.
    pub fn ready_tpu_vm() -> Self {
        Self {
            acpi_tables: vec!["DMAR".to_owned()],
            dev_nodes: vec!["/dev/net/tun".to_owned()],
            cgroups: CgroupLayout::V2(["cpuset", "cpu", "io", "memory", "pids"].map(str::to_owned).to_vec()),
            proc_limits: Some(proc_limits(None, 100_000)),
            limits_conf: Some(
                "*  hard  memlock  unlimited\n*  soft  memlock  unlimited\n*    soft    nofile       100000\n*    hard    nofile       100000\nroot soft    nofile       100000\nroot hard    nofile       100000\nroot - memlock unlimited\n"
                    .to_owned(),
            ),
            limits_d: Vec::new(),
            grub: Some(grub_file("idle=poll intel_iommu=on,sm_on transparent_hugepage=always", "")),
            thp: Some("[always] madvise never\n".to_owned()),
            hugepages_total: Some(0),
            modprobe_d: Vec::new(),
        }
    }

    /// Writes the files under `root` (a built fixture's root).
    pub fn write(&self, root: &Path) {
        let w = |rel: &str, content: &str| {
            let p = root.join(rel.trim_start_matches('/'));
            fs::create_dir_all(p.parent().expect("fixture paths have a parent")).unwrap();
            fs::write(p, content).unwrap();
        };
        fs::create_dir_all(root.join("sys/firmware/acpi/tables")).unwrap();
        for t in &self.acpi_tables {
            w(&format!("sys/firmware/acpi/tables/{t}"), "ACPI table placeholder");
        }
        for n in &self.dev_nodes {
            w(n, "");
        }
        match &self.cgroups {
            CgroupLayout::None => w("proc/self/mounts", "proc /proc proc rw 0 0\n"),
            CgroupLayout::V1(ctls) => {
                let mut mounts = String::from("tmpfs /sys/fs/cgroup tmpfs rw,mode=755 0 0\n");
                let mut own = String::new();
                for (i, c) in ctls.iter().enumerate() {
                    mounts.push_str(&format!(
                        "cgroup /sys/fs/cgroup/{c} cgroup rw,relatime,{c} 0 0\n"
                    ));
                    own.push_str(&format!("{}:{c}:/\n", i + 1));
                }
                mounts.push_str("cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n");
                own.push_str("0::/\n");
                w("proc/self/mounts", &mounts);
                w("proc/self/cgroup", &own);
                w("sys/fs/cgroup/unified/cgroup.controllers", "");
            }
            CgroupLayout::V2(ctls) => {
                w(
                    "proc/self/mounts",
                    "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec 0 0\n",
                );
                w("proc/self/cgroup", "0::/\n");
                w("sys/fs/cgroup/cgroup.controllers", &format!("{}\n", ctls.join(" ")));
            }
        }
        if let Some(l) = &self.proc_limits {
            w("proc/self/limits", l);
        }
        if let Some(c) = &self.limits_conf {
            w("etc/security/limits.conf", c);
        }
        for (name, c) in &self.limits_d {
            w(&format!("etc/security/limits.d/{name}"), c);
        }
        if let Some(g) = &self.grub {
            w("etc/default/grub", g);
        }
        if let Some(t) = &self.thp {
            w("sys/kernel/mm/transparent_hugepage/enabled", t);
        }
        if let Some(h) = self.hugepages_total {
            w(
                "proc/meminfo",
                &format!(
                    "MemTotal:       263842380 kB\nHugePages_Total:    {h}\nHugePages_Free:     {h}\nHugepagesize:       2048 kB\n"
                ),
            );
        }
        for (name, c) in &self.modprobe_d {
            w(&format!("etc/modprobe.d/{name}"), c);
        }
    }
}
