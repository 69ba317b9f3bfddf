//! `xpu k8s`: plug this host into Kubernetes. `device-plugin` serves the kubelet device plugin
//! API; `nfd-features` writes the discovery labels where Node Feature Discovery reads them.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Subcommand, ValueEnum};
use xpu_host::{DiscoverOptions, Scope};
use xpu_integrations::deviceplugin::{self, DEFAULT_PLUGIN_DIR, Event, PluginError};
use xpu_integrations::nfd;
use xpu_integrations::selector::Resource;

use crate::cmd::discover::root_arg;
use crate::cmd::format::Format;
use crate::output::{CliError, CmdResult, print_json, warn_all};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: K8sCommand,
}

#[derive(Debug, Subcommand)]
pub enum K8sCommand {
    /// Serve the kubelet device plugin API (v1beta1) for this host's accelerators, one plugin per
    /// resource, until SIGINT or SIGTERM.
    DevicePlugin(DevicePluginArgs),
    /// Write the discovery labels as a Node Feature Discovery local feature file.
    NfdFeatures(NfdArgs),
    /// Schedule the pods whose spec.schedulerName is NAME (default xpu) with xpu-sched and bind
    /// them through the API server: gangs, TPU slices, fair-share queues. Runs until SIGTERM.
    Scheduler(SchedulerArgs),
    /// Dynamic Resource Allocation driver `xpu.dev`: publish this node's accelerators as
    /// resource.k8s.io/v1 ResourceSlices, register with the kubelet and prepare allocated claims
    /// as CDI specs. Runs until SIGINT or SIGTERM.
    DraDriver(DraDriverArgs),
    /// Print, as YAML, the CustomResourceDefinitions xpu's Kubernetes commands use and a
    /// cluster may lack: ProvisioningRequest (autoscaling.x-k8s.io/v1), which flex-start needs
    /// and the cluster autoscaler normally installs. `xpu k8s crd | kubectl apply -f -`.
    Crd,
}

#[derive(Debug, clap::Args)]
pub struct DraDriverArgs {
    /// Read the host under DIR instead of / (a fixture tree).
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// This node's name (the pool name); default $NODE_NAME, then the host name.
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// Kubeconfig file; default $KUBECONFIG, then ~/.kube/config, then the in-cluster config.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubelet's plugin directory; the driver serves on DIR/xpu.dev/dra.sock.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/kubelet/plugins")]
    pub plugin_dir: PathBuf,
    /// The kubelet's plugin registration directory.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/kubelet/plugins_registry")]
    pub registry_dir: PathBuf,
    /// Where per-claim CDI specs are written (the container runtime's CDI directory).
    #[arg(long, value_name = "DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// Milliseconds between re-discoveries of the host.
    #[arg(long, value_name = "MS", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(50..=60000))]
    pub interval_ms: u64,
    /// MIG partitions on demand: GPUs the admin put in MIG mode are published as their MIG
    /// profiles at each free placement, and a claim's instance is made on prepare and destroyed
    /// on unprepare, through `nvidia-smi mig` (instances xpu did not make are published as
    /// taken and never touched; MIG mode itself is never changed). Records the instances it
    /// made in DIR/xpu.dev/mig-instances.json under --plugin-dir.
    #[arg(long, conflicts_with = "fake_mig")]
    pub mig: bool,
    /// The nvidia-smi --mig runs (absolute, or found on PATH).
    #[arg(long, value_name = "PATH", default_value = "nvidia-smi", requires = "mig")]
    pub nvidia_smi: PathBuf,
    /// Tests only: MIG through a fake NVML whose GPUs, MIG modes and instances are the JSON
    /// state FILE (rewritten as instances are made and destroyed), with the `/dev/nvidia-caps`
    /// minors of the root's `/proc/driver/nvidia-caps/mig-minors`.
    #[arg(long, value_name = "FILE", hide = true)]
    pub fake_mig: Option<PathBuf>,
    /// Tests only: NVML's XIDs, resets and lost GPUs from this JSON file.
    #[arg(long, value_name = "FILE", hide = true)]
    pub fake_nvml: Option<PathBuf>,
    /// With --mps-dir, whole NVIDIA GPUs are published shareable (allowMultipleAllocations,
    /// `compute` 100 beside `memory`), and a claim allocated part of one (capacity.requests
    /// {compute: 25, memory: 36Gi}) is limited to what it was allocated; its GPU's daemon stops
    /// after the GPU's last such claim.
    #[command(flatten)]
    pub mps: crate::cmd::MpsArgs,
    /// Share whole NVIDIA GPUs by time-slicing, for users who want it: published as with
    /// --mps-dir (attribute sharing: time-slicing), but a claim given part of a GPU gets all of
    /// it, with no memory or compute limit and no fault isolation (XPU_SHARING=time-slicing).
    #[arg(long, conflicts_with = "mps_dir")]
    pub time_slicing: bool,
}

#[derive(Debug, clap::Args)]
pub struct SchedulerArgs {
    /// Kubeconfig file; default $KUBECONFIG, then ~/.kube/config, then the in-cluster config.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Pods with this spec.schedulerName are scheduled.
    #[arg(long, value_name = "NAME", default_value = "xpu")]
    pub scheduler_name: String,
    /// Placement policy, the names `xpu sim` takes: xpu, fgd, bestfit, dotprod, gpupacking,
    /// gpuclustering, random.
    #[arg(long, value_name = "NAME", default_value = "xpu")]
    pub policy: String,
    /// Run only while holding a coordination.k8s.io/v1 Lease (for several replicas).
    #[arg(long)]
    pub leader_elect: bool,
    /// The Lease's namespace.
    #[arg(long, value_name = "NS", default_value = "kube-system")]
    pub leader_elect_resource_namespace: String,
    /// The Lease's name; default: the scheduler name.
    #[arg(long, value_name = "NAME")]
    pub leader_elect_resource_name: Option<String>,
    /// Seconds a lease lasts without renewal before a standby takes it.
    #[arg(long, value_name = "SECONDS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub leader_elect_lease_duration: u64,
    /// Seconds the leader keeps trying to renew before it gives up leading.
    #[arg(long, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub leader_elect_renew_deadline: u64,
    /// Seconds between lease attempts.
    #[arg(long, value_name = "SECONDS", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(1..=600))]
    pub leader_elect_retry_period: u64,
    /// Serve Prometheus metrics and /healthz here (e.g. 0.0.0.0:10259).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Bindings in flight at once.
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub bind_concurrency: u64,
    /// Key that signs the GPU chosen for each xpu.dev/gpu-milli pod (32 or more random bytes,
    /// the same file the device plugins get, normally a mounted Secret). Without it, GPU-share
    /// pods wait and are told why.
    #[arg(long, value_name = "FILE")]
    pub share_key: Option<PathBuf>,
    /// reserve: a pod that cannot be placed reserves the nodes it will get as they free up, and
    /// later pods are placed on the other nodes (the cluster fills, the large pod is not
    /// starved); strict: it holds back the later pods of its queue that ask for the same device
    /// kind; best-effort: later pods are placed around it anywhere, as kube-scheduler does.
    #[arg(long, value_enum, default_value_t = Queueing::Reserve)]
    pub queueing: Queueing,
    /// Seed of the placement policy's tie-breaking (the seed `xpu sim openb` prints).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Never evict lower-priority pods to place a higher-priority one (by default xpu does,
    /// through the Eviction API, as kube-scheduler's preemption does through deletes).
    #[arg(long)]
    pub no_preemption: bool,
    /// Flex-start: seconds to wait after a gang's ProvisioningRequest ends (Failed,
    /// BookingExpired, CapacityRevoked) before asking again; doubled per attempt, at most 900.
    #[arg(long, value_name = "SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=900))]
    pub provisioning_backoff: u64,
    /// The ConfigMap (NAMESPACE/NAME, key queues.yaml) in which the admin maps namespaces to
    /// fair-share queues and sets their quotas; without it each namespace is its own queue.
    /// Keep it where tenants cannot write.
    #[arg(long, value_name = "NAMESPACE/NAME", default_value = xpu_kube::queues::DEFAULT_CONFIG)]
    pub queue_config: String,
    /// Benchmarks only: bind every waiting pod to the next Ready node in turn, deciding
    /// nothing (the API server's ceiling for any scheduler).
    #[arg(long, hide = true)]
    pub null_binder: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Queueing {
    Reserve,
    Strict,
    BestEffort,
}

#[derive(Debug, clap::Args)]
pub struct DevicePluginArgs {
    /// A resource and the devices it advertises: NAME=TERM[,TERM...] with terms vendor:HEX4,
    /// device:HEX4, kind:gpu|tpu|npu|nvswitch|other, driver:NAME, driver:!NAME (repeatable). Default:
    /// nvidia.com/gpu, google.com/tpu and amd.com/gpu.
    #[arg(long = "resource", value_name = "NAME=SELECTOR")]
    pub resources: Vec<String>,
    /// The kubelet's device plugin directory (where kubelet.sock is).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PLUGIN_DIR)]
    pub plugin_dir: PathBuf,
    /// Read the host under this directory instead of `/`.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// How often to re-discover devices (health) and check the sockets, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..))]
    pub interval_ms: u64,
    /// Offer GPUs as shares (xpu.dev/gpu-milli, 1000 per GPU) instead of whole
    /// (nvidia.com/gpu, amd.com/gpu); each container gets the GPU the xpu scheduler chose for
    /// its pod. Needs --node-name, --share-key and access to the API server.
    #[arg(long)]
    pub share: bool,
    /// Offer devices on vfio-pci to VMs: one resource per accelerator model,
    /// xpu.dev/<model>-vfio (xpu.dev/h100-sxm5-80gb-vfio), whose Allocate answers as KubeVirt's
    /// permittedHostDevices (externalResourceProvider: true) expects: PCI_RESOURCE_<NAME> with
    /// the PCI addresses, /dev/vfio/vfio and /dev/vfio/<group>. The container resources
    /// (nvidia.com/gpu, ...) then leave devices on vfio-pci out.
    #[arg(long, conflicts_with_all = ["share", "resources"])]
    pub vfio: bool,
    /// This node's name (default $NODE_NAME, set from the downward API).
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// The scheduler's share key (see `xpu k8s scheduler --share-key`).
    #[arg(long, value_name = "FILE")]
    pub share_key: Option<PathBuf>,
    /// Kubeconfig for --share; default $KUBECONFIG, ~/.kube/config, then in-cluster.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// With --share, --mps-dir serves shares of less than a GPU through MPS, the limits given
    /// to each container through CDI.
    #[command(flatten)]
    pub mps: crate::cmd::MpsArgs,
    /// Where the MPS shares' CDI specs are written (the runtime's CDI directory).
    #[arg(long, value_name = "DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// Tests only: NVML's XIDs, resets and lost GPUs from this JSON file.
    #[arg(long, value_name = "FILE", hide = true)]
    pub fake_nvml: Option<PathBuf>,
    /// Time-slicing, with no isolation: offer each device N times under the resource's name
    /// with `.shared` (nvidia.com/gpu.shared); a container asks for 1 and gets a whole GPU
    /// that other pods use at the same time (no memory or compute limit, no fault isolation).
    #[arg(long, value_name = "N", conflicts_with = "share",
          value_parser = clap::value_parser!(u16).range(2..=64))]
    pub time_slicing: Option<u16>,
    /// MIG: `none` offers every NVIDIA GPU whole; `mixed` (NVIDIA's device plugin's name) offers
    /// each MIG instance on a GPU in MIG mode as one `nvidia.com/mig-<profile>`
    /// (`nvidia.com/mig-1g.18gb`) and such GPUs no longer as `nvidia.com/gpu`. The instances
    /// are the admin's (`nvidia-smi mig -cgi ... -C`, or a MIG manager), read through
    /// --nvidia-smi; for instances made on demand use the DRA driver's --mig.
    #[arg(long, value_name = "STRATEGY", default_value = "none",
          value_parser = ["none", "mixed"])]
    pub mig_strategy: String,
    /// The nvidia-smi --mig-strategy mixed reads MIG instances with (absolute, or on PATH).
    #[arg(long, value_name = "PATH", default_value = "nvidia-smi")]
    pub nvidia_smi: PathBuf,
    /// Tests only: MIG state from a fake NVML's JSON state FILE (see the DRA driver's).
    #[arg(long, value_name = "FILE", hide = true)]
    pub fake_mig: Option<PathBuf>,
    /// How Allocate names a container's devices: `cdi-cri` (CDI names, `/dev` nodes and the
    /// environment) or `envvar` (the environment alone, `NVIDIA_VISIBLE_DEVICES`..., for nodes
    /// whose containerd runs `xpu-container-runtime` in place of runc, which injects them).
    #[arg(long, value_name = "STRATEGY", default_value = "cdi-cri",
          value_parser = ["cdi-cri", "envvar"])]
    pub device_list_strategy: String,
    #[command(flatten)]
    pub log: crate::output::LogArgs,
}

#[derive(Debug, clap::Args)]
pub struct NfdArgs {
    /// Read the host under this directory instead of `/`.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Where to write; `-` prints the file to stdout instead. Default:
    /// ROOT/etc/kubernetes/node-feature-discovery/features.d/xpu.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Print the file that would be written, and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long, value_parser = Format::only(&[Format::Text, Format::Json]), default_value_t = Format::Text)]
    pub format: Format,
    /// How the device plugin shares this node's NVIDIA GPUs, for GFD's labels
    /// (`nvidia.com/gpu.sharing-strategy`, `.replicas`, `-SHARED` after the product when
    /// time-sliced): none, mps or time-slicing:N. Default: no sharing labels.
    #[arg(long, value_name = "MODE")]
    pub sharing: Option<xpu_core::labels::vendor::Sharing>,
}

pub fn run(args: Args) -> CmdResult {
    match args.command {
        K8sCommand::DevicePlugin(a) => device_plugin(a),
        K8sCommand::NfdFeatures(a) => nfd_features(a),
        K8sCommand::Scheduler(a) => scheduler(a),
        K8sCommand::DraDriver(a) => dra_driver(a),
        K8sCommand::Crd => {
            let crd = xpu_kube::flex::crd();
            let text = serde_norway::to_string(&crd).map_err(CliError::failed)?;
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn dra_driver(a: DraDriverArgs) -> CmdResult {
    let root = root_arg(a.root)?;
    let node_name = match a.node_name.or_else(|| std::env::var("NODE_NAME").ok()) {
        Some(n) => n,
        None => root
            .read_file("/proc/sys/kernel/hostname")
            .ok()
            .flatten()
            .map(|f| String::from_utf8_lossy(&f.bytes).trim().to_owned())
            .filter(|h| !h.is_empty())
            .ok_or_else(|| {
                CliError::input(anyhow::anyhow!(
                    "no node name: pass --node-name NAME or set NODE_NAME (the downward API's spec.nodeName)"
                ))
            })?,
    };
    crate::output::init_tracing();
    // Telemetry on the discovery interval: a device NVML (or amdgpu's RAS counters) reports
    // unhealthy is tainted in the published pool (xpu.dev/unhealthy, NoSchedule).
    let interval = Duration::from_millis(a.interval_ms);
    let health = xpu_integrations::exporter::health_collector(&root, interval, a.fake_nvml.clone());
    let mig_ledger = xpu_telemetry::mig::smi::ledger_in(&a.plugin_dir.join(xpu_kube::dra::DRIVER));
    let args = xpu_kube::dra::DriverArgs {
        root,
        node_name,
        kubeconfig: a.kubeconfig,
        paths: xpu_kube::dra::plugin::Paths {
            plugin_dir: a.plugin_dir,
            registry_dir: a.registry_dir,
            cdi_dir: a.cdi_dir,
        },
        interval: Duration::from_millis(a.interval_ms),
        health: Some(health),
        // MIG partitions are published from a MigControl: nvidia-smi's with --mig, a test's
        // fake with --fake-mig; without either, GPUs are published whole.
        mig: match (&a.fake_mig, a.mig) {
            (Some(f), _) => Some(std::sync::Arc::new(
                xpu_telemetry::mig::FakeMig::open(f).map_err(CliError::input)?,
            )),
            (None, true) => Some(std::sync::Arc::new(xpu_telemetry::mig::smi::SmiMig::new(
                a.nvidia_smi.clone(),
                mig_ledger,
            ))),
            (None, false) => None,
        },
        mps: match a.mps.mps_dir {
            Some(dir) => Some(std::sync::Arc::new(
                xpu_host::mps::Daemons::new(dir, a.mps.mps_control)
                    .map_err(|e| CliError::input(anyhow::anyhow!("--mps-dir: {e}")))?,
            )),
            None => None,
        },
        time_slicing: a.time_slicing,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::failed)?;
    rt.block_on(xpu_kube::dra::run(args, shutdown_signal())).map_err(|e| match e {
        xpu_kube::dra::DriverError::Discover(_) => CliError::input(e),
        _ => CliError::failed(e),
    })?;
    Ok(ExitCode::SUCCESS)
}

fn scheduler(a: SchedulerArgs) -> CmdResult {
    let policy = a
        .policy
        .parse::<xpu_sched::PolicyKind>()
        .map_err(|e| CliError::input(anyhow::anyhow!(e)))?;
    if a.leader_elect_renew_deadline >= a.leader_elect_lease_duration {
        return Err(CliError::input(anyhow::anyhow!(
            "--leader-elect-renew-deadline ({} s) must be shorter than --leader-elect-lease-duration ({} s)",
            a.leader_elect_renew_deadline,
            a.leader_elect_lease_duration
        )));
    }
    let queue_config = match a.queue_config.split_once('/') {
        Some((ns, name))
            if xpu_core::job::is_dns_label(ns) && xpu_core::job::is_dns_subdomain(name) =>
        {
            (ns.to_owned(), name.to_owned())
        }
        _ => {
            return Err(CliError::input(anyhow::anyhow!(
                "--queue-config {:?}: expected NAMESPACE/NAME of a ConfigMap, like {}",
                a.queue_config,
                xpu_kube::queues::DEFAULT_CONFIG
            )));
        }
    };
    let share_key = match &a.share_key {
        Some(path) => Some(std::sync::Arc::new(
            xpu_kube::share::ShareKey::load(path).map_err(CliError::input)?,
        )),
        None => None,
    };
    crate::output::init_tracing();
    let identity = format!(
        "{}_{}",
        std::env::var("POD_NAME")
            .or_else(|_| std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned()))
            .unwrap_or_else(|_| "xpu".into()),
        std::process::id()
    );
    let args = xpu_kube::SchedulerArgs {
        kubeconfig: a.kubeconfig,
        options: xpu_kube::scheduler::Options {
            scheduler_name: a.scheduler_name.clone(),
            policy,
            bind_concurrency: a.bind_concurrency as usize,
            share_key,
            best_effort: a.queueing == Queueing::BestEffort,
            reserve: a.queueing == Queueing::Reserve,
            seed: a.seed,
            preemption: !a.no_preemption,
            provisioning_backoff: Duration::from_secs(a.provisioning_backoff),
            queue_config,
            null_binder: a.null_binder,
            ..xpu_kube::scheduler::Options::default()
        },
        leader_elect: a.leader_elect.then(|| xpu_kube::leader::LeaseConfig {
            namespace: a.leader_elect_resource_namespace,
            name: a.leader_elect_resource_name.unwrap_or(a.scheduler_name),
            identity,
            lease_duration: Duration::from_secs(a.leader_elect_lease_duration),
            renew_deadline: Duration::from_secs(a.leader_elect_renew_deadline),
            retry_period: Duration::from_secs(a.leader_elect_retry_period),
        }),
        metrics_addr: a.metrics_addr,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(CliError::failed)?;
    rt.block_on(xpu_kube::run_scheduler(args, shutdown_signal()))
        .map_err(|e| CliError::failed(anyhow::Error::from_boxed(e)))?;
    Ok(ExitCode::SUCCESS)
}

fn device_plugin(args: DevicePluginArgs) -> CmdResult {
    crate::output::init_tracing_with(&args.log);
    let root = root_arg(args.root)?;
    let resources = if args.vfio {
        let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
        let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
        Resource::vfio_for(&inv)
    } else if args.resources.is_empty() {
        if args.share { Resource::share_defaults() } else { Resource::defaults() }
    } else {
        args.resources
            .iter()
            .map(|r| r.parse::<Resource>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(CliError::input)?
    };
    let share_setup = if args.share {
        let node = args.node_name.clone().or_else(|| std::env::var("NODE_NAME").ok()).ok_or_else(|| {
            CliError::input(anyhow::anyhow!(
                "--share needs this node's name: pass --node-name NAME or set NODE_NAME (downward API spec.nodeName)"
            ))
        })?;
        let path = args.share_key.clone().ok_or_else(|| {
            CliError::input(anyhow::anyhow!(
                "--share needs --share-key FILE, the key the xpu scheduler signs its GPU choices with"
            ))
        })?;
        let key = xpu_kube::share::ShareKey::load(&path).map_err(CliError::input)?;
        Some((node, key, args.kubeconfig.clone()))
    } else {
        None
    };
    if args.mps.mps_dir.is_some() && !args.share {
        return Err(CliError::input(anyhow::anyhow!(
            "--mps-dir serves GPU shares: add --share (MPS limits a share, not a whole GPU)"
        )));
    }
    let mig_cdi_dir = args.cdi_dir.clone();
    let mps = match args.mps.mps_dir {
        Some(dir) => {
            let opts = xpu_integrations::mps::MpsOptions {
                dir,
                control: args.mps.mps_control,
                cdi_dir: args.cdi_dir,
            };
            let mps = xpu_integrations::mps::Mps::new(opts)
                .map_err(|e| CliError::input(anyhow::anyhow!(e)))?;
            Some(std::sync::Arc::new(mps))
        }
        None => None,
    };
    let interval = Duration::from_millis(args.interval_ms);
    // Telemetry on the same interval: XIDs and uncorrectable memory errors reported by NVML (or
    // amdgpu's RAS counters) mark a device Unhealthy, not only a vanished one.
    let health =
        xpu_integrations::exporter::health_collector(&root, interval, args.fake_nvml.clone());
    let cfg = deviceplugin::Config {
        root,
        plugin_dir: args.plugin_dir,
        resources,
        interval,
        health: Some(health),
        watch_timeout: deviceplugin::LIST_AND_WATCH_WAIT,
        share: None,
        mps,
        replicas: args.time_slicing.unwrap_or(1),
        device_list: args
            .device_list_strategy
            .parse()
            .map_err(|e: String| CliError::input(anyhow::anyhow!(e)))?,
        mig: match (args.mig_strategy.as_str(), &args.fake_mig) {
            ("none", _) => None,
            (_, fake) => Some(deviceplugin::MigOptions {
                control: match fake {
                    Some(f) => std::sync::Arc::new(
                        xpu_telemetry::mig::FakeMig::open(f).map_err(CliError::input)?,
                    ),
                    // Reading only: the device plugin makes no instance.
                    None => std::sync::Arc::new(xpu_telemetry::mig::smi::SmiMig::read_only(
                        args.nvidia_smi.clone(),
                    )),
                },
                cdi_dir: mig_cdi_dir,
            }),
        },
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::failed)?;
    let mut cfg = cfg;
    rt.block_on(async {
        if let Some((node, key, kubeconfig)) = share_setup {
            let client = xpu_kube::client(kubeconfig.as_deref())
                .await
                .map_err(|e| PluginError::Share(e.to_string()))?;
            cfg.share =
                Some(std::sync::Arc::new(xpu_kube::share::ApiResolver::new(client, node, key)));
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let printer = tokio::spawn(async move {
            while let Some(e) = rx.recv().await {
                let line = describe(&e);
                match e {
                    Event::NoListAndWatch { .. } => {
                        tracing::error!(resource = %resource_of(&e), "{line}")
                    }
                    Event::RegisterFailed { .. } => {
                        tracing::warn!(resource = %resource_of(&e), "{line}")
                    }
                    Event::Health { healthy: false, .. } => {
                        tracing::warn!(resource = %resource_of(&e), "{line}")
                    }
                    _ => tracing::info!(resource = %resource_of(&e), "{line}"),
                }
            }
        });
        let mps = cfg.mps.clone();
        let result = deviceplugin::run(cfg, Some(tx), shutdown_signal()).await;
        let _ = printer.await;
        if let Some(m) = mps {
            m.stop_all();
        }
        result
    })
    .map_err(|e| match e {
        PluginError::NoPluginDir { .. } | PluginError::Discover(_) => CliError::input(e),
        _ => CliError::failed(e),
    })?;
    Ok(ExitCode::SUCCESS)
}

/// SIGINT, or SIGTERM (what a pod's shutdown sends).
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

fn resource_of(e: &Event) -> &str {
    match e {
        Event::Skipped { resource }
        | Event::Serving { resource, .. }
        | Event::Registered { resource }
        | Event::RegisterFailed { resource, .. }
        | Event::Reserving { resource }
        | Event::NoListAndWatch { resource, .. }
        | Event::Health { resource, .. } => resource,
    }
}

fn describe(e: &Event) -> String {
    match e {
        Event::Skipped { resource } => {
            format!("{resource}: no matching device on this host; not served")
        }
        Event::Serving { resource, socket, devices } => {
            format!("{resource}: serving {devices} device(s) on {}", socket.display())
        }
        Event::Registered { resource } => format!("{resource}: registered with the kubelet"),
        Event::RegisterFailed { resource, error } => {
            format!("{resource}: registration failed ({error}); retrying")
        }
        Event::Reserving { resource } => {
            format!("{resource}: its socket was removed; serving on a new one")
        }
        Event::NoListAndWatch { resource, waited } => format!(
            "{resource}: the kubelet took the registration but has not opened ListAndWatch in {} s, so the resource will not appear in the node's allocatable; the kubelet most likely cannot talk to the plugin's socket (look for ListAndWatch errors in the kubelet's log; a kubelet that cannot reach the plugin directory's sockets, or one whose device-plugin API differs from v1beta1, does this); registering again",
            waited.as_secs()
        ),
        Event::Health { resource, id, healthy } => {
            format!("{resource}: device {id} is {}", if *healthy { "Healthy" } else { "Unhealthy" })
        }
    }
}

fn nfd_features(args: NfdArgs) -> CmdResult {
    let root = root_arg(args.root)?;
    // NFD's pci source looks at every PCI function, so the labels do too.
    let opts = DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
    warn_all(&inv.warnings);
    let mut labels = xpu_core::labels::labels(&inv);
    if let Some(mode) = args.sharing {
        xpu_core::labels::vendor::sharing(&mut labels, mode);
    }
    let content = nfd::render(&labels);
    let to_stdout = args.output.as_deref() == Some(Path::new("-"));
    let path =
        args.output.clone().unwrap_or_else(|| root.path(nfd::FEATURES_DIR).join(nfd::FILE_NAME));
    nfd::check_size(&path, &content).map_err(CliError::failed)?;
    let write = !(to_stdout || args.dry_run);
    if write {
        nfd::write_atomic(&path, &content).map_err(|e| match e {
            nfd::NfdError::NoDir { .. } => CliError::input(e),
            _ => CliError::failed(e),
        })?;
    }
    match args.format {
        Format::Json => print_json(&serde_json::json!({
            "path": (!to_stdout).then(|| path.display().to_string()),
            "written": write,
            "bytes": content.len(),
            "labels": labels,
        }))?,
        // Text: `Format::only` lets only it and JSON through.
        _ if write => println!(
            "wrote {} labels ({} bytes) to {}",
            labels.len(),
            content.len(),
            path.display()
        ),
        _ => print!("{content}"),
    }
    Ok(ExitCode::SUCCESS)
}
