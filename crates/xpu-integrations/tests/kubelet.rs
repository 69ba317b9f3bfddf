//! The device plugin against a test kubelet that speaks the same v1beta1 protobuf over the same
//! Unix sockets: registration, ListAndWatch with a device going unhealthy, preferred allocation
//! on the 8×A100 + NVSwitch fixture, Allocate with CDI names, and re-registration when the
//! kubelet restarts or the plugin's socket is deleted.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use xpu_host::{Root, Scope};
use xpu_integrations::deviceplugin::{self, Config, Event, PluginError};
use xpu_integrations::pb;
use xpu_integrations::selector::Resource;
use xpu_integrations::testkubelet::TestKubelet;
use xpu_testkit::{Fixture, hosts};

const WAIT: Duration = Duration::from_secs(10);
const GPU_SOCK: &str = "xpu-nvidia.com-gpu.sock";

struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), PluginError>>,
    events: mpsc::UnboundedReceiver<Event>,
}

impl Running {
    async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(WAIT, self.task).await.unwrap().unwrap().unwrap();
    }

    /// Waits for an event matching `f`.
    async fn wait_for(&mut self, f: impl Fn(&Event) -> bool) -> Event {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let e = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .expect("event in time")
                .expect("plugin still running");
            if f(&e) {
                return e;
            }
        }
    }
}

fn start(fixture: &Fixture, dir: &Path, resources: Vec<Resource>) -> Running {
    start_waiting(fixture, dir, resources, deviceplugin::LIST_AND_WATCH_WAIT)
}

/// [`start`] with every device offered `replicas` times (time-slicing).
fn start_sliced(fixture: &Fixture, dir: &Path, replicas: u16) -> Running {
    start_with(fixture, dir, Resource::defaults(), deviceplugin::LIST_AND_WATCH_WAIT, replicas)
}

/// [`start`], reporting a kubelet that opens no ListAndWatch within `watch_timeout`.
fn start_waiting(
    fixture: &Fixture,
    dir: &Path,
    resources: Vec<Resource>,
    watch_timeout: Duration,
) -> Running {
    start_with(fixture, dir, resources, watch_timeout, 1)
}

fn start_with(
    fixture: &Fixture,
    dir: &Path,
    resources: Vec<Resource>,
    watch_timeout: Duration,
    replicas: u16,
) -> Running {
    let cfg = Config {
        root: Root::new(fixture.root()).unwrap(),
        plugin_dir: dir.to_owned(),
        resources,
        interval: Duration::from_millis(40),
        health: None,
        watch_timeout,
        share: None,
        mps: None,
        replicas,
        mig: None,
        device_list: Default::default(),
    };
    let (tx, events) = mpsc::unbounded_channel();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(deviceplugin::run(cfg, Some(tx), async {
        let _ = stopped.await;
    }));
    Running { stop: Some(stop), task, events }
}

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

fn gpu(bus: u8) -> String {
    format!("0000:{bus:02x}:00.0")
}

#[tokio::test]
async fn registers_after_serving_and_lists_devices_with_numa() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin = start(&fixture, dir.path(), Resource::defaults());

    let reg = kubelet.next_registration(WAIT).await.expect("registration");
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.resource_name, "nvidia.com/gpu");
    assert_eq!(reg.endpoint, GPU_SOCK);
    let opts = reg.options.unwrap();
    assert!(opts.get_preferred_allocation_available && !opts.pre_start_required);
    // The plugin already serves when it registers.
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let got = client.get_device_plugin_options(pb::Empty {}).await.unwrap().into_inner();
    assert!(got.get_preferred_allocation_available);
    // Only NVIDIA GPUs on this host: no TPU or AMD plugin registers.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(kubelet.pending_registrations().is_empty());

    let mut stream = client.list_and_watch(pb::Empty {}).await.unwrap().into_inner();
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 8);
    for (i, d) in first.devices.iter().enumerate() {
        assert_eq!(d.id, gpu(hosts::A100_GPU_BUSES[i]));
        assert_eq!(d.health, "Healthy");
        let numa = d.topology.as_ref().unwrap().nodes[0].id;
        assert_eq!(numa, if i < 4 { 0 } else { 1 }, "{}", d.id);
    }
    plugin.shutdown().await;
    assert!(!dir.path().join(GPU_SOCK).exists(), "the plugin removes its socket on exit");
    kubelet.stop().await;
}

#[tokio::test]
async fn list_and_watch_reports_a_device_going_unhealthy_and_back() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let mut plugin = start(&fixture, dir.path(), Resource::defaults());
    let reg = kubelet.next_registration(WAIT).await.unwrap();
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut stream = client.list_and_watch(pb::Empty {}).await.unwrap().into_inner();
    assert!(stream.next().await.unwrap().unwrap().devices.iter().all(|d| d.health == "Healthy"));

    let health = |r: &pb::ListAndWatchResponse, id: &str| {
        r.devices.iter().find(|d| d.id == id).map(|d| d.health.clone())
    };
    // Its driver changes: nvidia -> vfio-pci.
    let victim = gpu(0x48);
    let link = fixture.device_dir(&victim).join("driver");
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink("../../../bus/pci/drivers/vfio-pci", &link).unwrap();
    let next = tokio::time::timeout(WAIT, stream.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(health(&next, &victim).as_deref(), Some("Unhealthy"));
    assert_eq!(next.devices.iter().filter(|d| d.health == "Healthy").count(), 7);
    plugin.wait_for(|e| matches!(e, Event::Health { healthy: false, .. })).await;
    // Allocating it is refused while it is unhealthy.
    let e = client
        .allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: vec![victim.clone()],
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);

    // Back on its driver: healthy again.
    std::fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink("../../../bus/pci/drivers/nvidia", &link).unwrap();
    let next = tokio::time::timeout(WAIT, stream.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(health(&next, &victim).as_deref(), Some("Healthy"));

    // It disappears from the bus.
    let gone = gpu(0xcb);
    std::fs::remove_file(fixture.device_dir(&gone)).unwrap();
    let next = tokio::time::timeout(WAIT, stream.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(health(&next, &gone).as_deref(), Some("Unhealthy"), "still listed, as Unhealthy");
    plugin.shutdown().await;
    kubelet.stop().await;
}

#[tokio::test]
async fn preferred_allocation_keeps_to_one_nvswitch_domain_and_numa_node() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin = start(&fixture, dir.path(), Resource::defaults());
    let reg = kubelet.next_registration(WAIT).await.unwrap();
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let all: Vec<String> = hosts::A100_GPU_BUSES.iter().map(|&b| gpu(b)).collect();
    let ask =
        |available: Vec<String>, must: Vec<String>, size: i32| pb::PreferredAllocationRequest {
            container_requests: vec![pb::ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: must,
                allocation_size: size,
            }],
        };
    let mut call = async |r| {
        client.get_preferred_allocation(r).await.unwrap().into_inner().container_responses[0]
            .device_i_ds
            .clone()
    };
    // Four: one NUMA node's worth, in address order.
    assert_eq!(
        call(ask(all.clone(), vec![], 4)).await,
        ids(&[&gpu(0x25), &gpu(0x2b), &gpu(0x48), &gpu(0x4d)])
    );
    // A must-include on NUMA 1 pulls the rest there.
    assert_eq!(call(ask(all.clone(), ids(&[&gpu(0x8c)]), 2)).await, ids(&[&gpu(0x8c), &gpu(0x91)]));
    // NUMA 0 has only three left: the four free on NUMA 1 win over address order.
    let avail =
        ids(&[&gpu(0x25), &gpu(0x2b), &gpu(0x48), &gpu(0x8c), &gpu(0x91), &gpu(0xc5), &gpu(0xcb)]);
    assert_eq!(
        call(ask(avail, vec![], 4)).await,
        ids(&[&gpu(0x8c), &gpu(0x91), &gpu(0xc5), &gpu(0xcb)])
    );
    // Six: still one NVSwitch domain, the fuller NUMA node first.
    let six = call(ask(all.clone(), vec![], 6)).await;
    assert_eq!(six.len(), 6);
    assert_eq!(&six[..4], &all[..4]);
    plugin.shutdown().await;
    kubelet.stop().await;
}

#[tokio::test]
async fn allocate_returns_cdi_names_device_nodes_and_env() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin = start(&fixture, dir.path(), Resource::defaults());
    let reg = kubelet.next_registration(WAIT).await.unwrap();
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let resp = client
        .allocate(pb::AllocateRequest {
            container_requests: vec![
                pb::ContainerAllocateRequest { devices_ids: ids(&[&gpu(0x2b), &gpu(0x48)]) },
                pb::ContainerAllocateRequest { devices_ids: ids(&[&gpu(0xcb)]) },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.container_responses.len(), 2);
    let c = &resp.container_responses[0];
    let cdi: Vec<&str> = c.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(cdi, ["nvidia.com/gpu=1", "nvidia.com/gpu=2"]);
    let nodes: Vec<&str> = c.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidia1",
            "/dev/nvidia2",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-modeset"
        ]
    );
    assert!(c.devices.iter().all(|d| d.container_path == d.host_path && d.permissions == "rw"));
    assert_eq!(
        c.envs["NVIDIA_VISIBLE_DEVICES"],
        format!("{},{}", hosts::gpu_uuid(1), hosts::gpu_uuid(2))
    );
    assert_eq!(c.envs["XPU_VISIBLE_DEVICES"], "0000:2b:00.0,0000:48:00.0");
    assert_eq!(resp.container_responses[1].cdi_devices[0].name, "nvidia.com/gpu=7");

    let e = client
        .allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: ids(&["0000:b7:00.0"]),
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert!(e.message().contains("not a nvidia.com/gpu device"), "{}", e.message());
    plugin.shutdown().await;
    kubelet.stop().await;
}

#[tokio::test]
async fn tpu_plugin_allocates_vfio_groups() {
    let fixture = hosts::tpu_v5p().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin = start(&fixture, dir.path(), Resource::defaults());
    let reg = kubelet.next_registration(WAIT).await.unwrap();
    assert_eq!(reg.resource_name, "google.com/tpu");
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let resp = client
        .allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: ids(&["0000:00:05.0", "0000:00:07.0"]),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let c = &resp.container_responses[0];
    let cdi: Vec<&str> = c.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(cdi, ["google.com/tpu=1", "google.com/tpu=3"]);
    let nodes: Vec<&str> = c.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(nodes, ["/dev/vfio/1", "/dev/vfio/3", "/dev/vfio/vfio"]);
    assert!(!c.envs.contains_key("NVIDIA_VISIBLE_DEVICES"));
    plugin.shutdown().await;
    kubelet.stop().await;
}

#[tokio::test]
async fn reregisters_when_the_kubelet_restarts_or_the_socket_is_deleted() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    // The plugin starts before the kubelet: it serves, and registers once the kubelet is up.
    let mut plugin = start(&fixture, dir.path(), Resource::defaults());
    plugin.wait_for(|e| matches!(e, Event::Serving { .. })).await;
    assert!(dir.path().join(GPU_SOCK).exists());
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    assert_eq!(kubelet.next_registration(WAIT).await.unwrap().resource_name, "nvidia.com/gpu");

    // The kubelet restarts: kubelet.sock is deleted and created again.
    kubelet.stop().await;
    assert!(!dir.path().join("kubelet.sock").exists());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let reg = kubelet.next_registration(WAIT).await.expect("registers with the new kubelet");
    assert_eq!(reg.endpoint, GPU_SOCK);
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    assert_eq!(
        client
            .list_and_watch(pb::Empty {})
            .await
            .unwrap()
            .into_inner()
            .next()
            .await
            .unwrap()
            .unwrap()
            .devices
            .len(),
        8
    );

    // A restarting kubelet deletes every plugin socket: the plugin serves anew and registers.
    std::fs::remove_file(dir.path().join(GPU_SOCK)).unwrap();
    plugin.wait_for(|e| matches!(e, Event::Reserving { .. })).await;
    let reg = kubelet.next_registration(WAIT).await.expect("registers after its socket is gone");
    assert_eq!(reg.endpoint, GPU_SOCK);
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    assert!(client.get_device_plugin_options(pb::Empty {}).await.is_ok());
    plugin.shutdown().await;
    kubelet.stop().await;
}

#[tokio::test]
async fn refuses_a_host_without_matching_devices_and_a_missing_directory() {
    let fixture = hosts::gpu_with_audio().build();
    let dir = tempfile::tempdir().unwrap();
    let only_amd: Resource = "amd.com/gpu=vendor:1002,kind:gpu".parse().unwrap();
    let cfg = Config {
        root: Root::new(fixture.root()).unwrap(),
        plugin_dir: dir.path().to_owned(),
        resources: vec![only_amd],
        interval: Duration::from_millis(40),
        health: None,
        watch_timeout: deviceplugin::LIST_AND_WATCH_WAIT,
        share: None,
        mps: None,
        replicas: 1,
        mig: None,
        device_list: Default::default(),
    };
    let e = deviceplugin::run(cfg.clone(), None, async {}).await.unwrap_err();
    assert!(e.to_string().contains("no device on this host matches any resource"), "{e}");
    let cfg = Config { plugin_dir: dir.path().join("missing"), ..cfg };
    let e = deviceplugin::run(cfg, None, async {}).await.unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

/// What a raw HTTP/2 unary gRPC call got back: the response and trailer headers, the DATA
/// octets, and the RST_STREAM error code if the stream was reset instead.
#[derive(Debug, Default)]
struct RawReply {
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    data: Vec<u8>,
    reset: Option<u32>,
}

/// One unary gRPC call written frame by frame, as a kubelet built with grpc-go before
/// Kubernetes 1.26 makes it: `:authority` is whatever the caller gives (the socket's path).
async fn raw_call(socket: &Path, authority: &[u8], path: &str) -> RawReply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }
    let mut conn = tokio::net::UnixStream::connect(socket).await.unwrap();
    let mut enc = fluke_hpack::Encoder::new();
    let block = enc.encode([
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", path.as_bytes()),
        (b":authority", authority),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]);
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[]));
    out.extend(frame(0x1, 0x4, 1, &block));
    out.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0])); // an empty message, end of stream
    conn.write_all(&out).await.unwrap();
    let mut dec = fluke_hpack::Decoder::new();
    let mut reply = RawReply::default();
    let read = async {
        loop {
            let mut head = [0u8; 9];
            if conn.read_exact(&mut head).await.is_err() {
                return;
            }
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await.unwrap();
            match (head[3], stream) {
                (0x4, 0) if head[4] & 0x1 == 0 => {
                    conn.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap();
                }
                (0x1, 1) => {
                    reply.headers.extend(dec.decode(&payload).unwrap());
                    if head[4] & 0x1 != 0 {
                        return;
                    }
                }
                (0x0, 1) => reply.data.extend_from_slice(&payload),
                (0x3, 1) => {
                    reply.reset = Some(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                    return;
                }
                _ => {}
            }
        }
    };
    tokio::time::timeout(WAIT, read).await.expect("an answer in time");
    reply
}

/// Issue 22: a kubelet that sends the socket's path as the HTTP/2 `:authority` (grpc-go before
/// Kubernetes 1.26) is served. The same call to a plain tonic server is reset with
/// PROTOCOL_ERROR, which is what such a kubelet met before.
#[tokio::test]
async fn a_socket_path_authority_is_served_as_older_kubelets_send_it() {
    use prost::Message;
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin = start(&fixture, dir.path(), Resource::defaults());
    let reg = kubelet.next_registration(WAIT).await.expect("registration");
    let socket = dir.path().join(&reg.endpoint);
    let authority = socket.to_str().unwrap().as_bytes().to_vec();
    let method = "/v1beta1.DevicePlugin/GetDevicePluginOptions";

    let reply = raw_call(&socket, &authority, method).await;
    assert_eq!(reply.reset, None, "{reply:?}");
    let get = |k: &[u8]| reply.headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(get(b":status").as_deref(), Some(&b"200"[..]), "{reply:?}");
    assert_eq!(get(b"grpc-status").as_deref(), Some(&b"0"[..]), "{reply:?}");
    let options = pb::DevicePluginOptions::decode(&reply.data[5..]).unwrap();
    assert_eq!(options, deviceplugin::options());

    // The control: tonic alone resets the stream.
    let plain = dir.path().join("plain.sock");
    let listener = tokio::net::UnixListener::bind(&plain).unwrap();
    let inv = xpu_host::discover(&Root::new(fixture.root()).unwrap(), &Default::default()).unwrap();
    let served =
        std::sync::Arc::new(deviceplugin::Plugin::new(Resource::defaults()[0].clone(), &inv));
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::device_plugin_server::DevicePluginServer::from_arc(served))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let reply = raw_call(&plain, &authority, method).await;
    assert_eq!(reply.reset, Some(0x1), "PROTOCOL_ERROR from h2 without the fix: {reply:?}");
    server.abort();

    plugin.shutdown().await;
    kubelet.stop().await;
}

/// Issue 22: a kubelet that takes the registration and never opens ListAndWatch is noticed:
/// an event naming it, and a second registration.
#[tokio::test]
async fn a_kubelet_that_never_opens_list_and_watch_is_reported_and_registered_again() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    // Long enough that this test's own ListAndWatch below always comes in time.
    let mut plugin =
        start_waiting(&fixture, dir.path(), Resource::defaults(), Duration::from_secs(1));
    let first = kubelet.next_registration(WAIT).await.expect("registration");
    // This kubelet never calls: reported, then registered again.
    let e = plugin.wait_for(|e| matches!(e, Event::NoListAndWatch { .. })).await;
    let Event::NoListAndWatch { resource, waited } = e else { unreachable!() };
    assert_eq!(resource, "nvidia.com/gpu");
    assert!(waited >= Duration::from_secs(1));
    let again = kubelet.next_registration(WAIT).await.expect("a second registration");
    assert_eq!(again.endpoint, first.endpoint);
    // Once the kubelet watches, nothing more is reported.
    let mut client = kubelet.plugin(&again.endpoint).await.unwrap();
    let _stream = client.list_and_watch(pb::Empty {}).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(kubelet.pending_registrations().is_empty(), "no third registration");
    while let Ok(e) = plugin.events.try_recv() {
        assert!(
            !matches!(e, Event::NoListAndWatch { .. }) || matches!(e, Event::Registered { .. }),
            "{e:?}"
        );
    }
    plugin.shutdown().await;
    kubelet.stop().await;
}

/// A kubelet that opens ListAndWatch before it answers Register (kubelet 1.37 on a real node
/// did, found by the multi-node test) is watching: nothing reported, no second registration.
#[tokio::test]
async fn a_kubelet_that_watches_before_answering_register_is_not_reported() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start_watching_first(dir.path()).unwrap();
    let mut plugin =
        start_waiting(&fixture, dir.path(), Resource::defaults(), Duration::from_millis(500));
    kubelet.next_registration(WAIT).await.expect("registration");
    plugin.wait_for(|e| matches!(e, Event::Registered { .. })).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(kubelet.pending_registrations().is_empty(), "no second registration");
    while let Ok(e) = plugin.events.try_recv() {
        assert!(!matches!(e, Event::NoListAndWatch { .. }), "{e:?}");
    }
    plugin.shutdown().await;
    kubelet.stop().await;
}

/// Time-slicing: every GPU offered three times under `nvidia.com/gpu.shared`; the preferred
/// replica is one of the least shared GPU; a container gets exactly its GPU with the mode in
/// its environment; asking for two replicas, or for an id that is no replica, is refused.
#[tokio::test]
async fn time_slicing_offers_replicas_under_a_shared_name_and_gives_one_gpu() {
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin = start_sliced(&fixture, dir.path(), 3);
    let reg = kubelet.next_registration(WAIT).await.unwrap();
    assert_eq!(reg.resource_name, "nvidia.com/gpu.shared");
    assert_eq!(reg.endpoint, "xpu-nvidia.com-gpu.shared.sock");
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut stream = client.list_and_watch(pb::Empty {}).await.unwrap().into_inner();
    let listed = stream.next().await.unwrap().unwrap().devices;
    assert_eq!(listed.len(), 24);
    let first = gpu(hosts::A100_GPU_BUSES[0]);
    assert_eq!(listed[0].id, format!("{first}-r0"));
    assert_eq!(listed[2].id, format!("{first}-r2"));
    assert_eq!(listed[2].topology.as_ref().unwrap().nodes[0].id, 0);

    // Every replica free but one of the first GPU: the preferred one is of another GPU.
    let available: Vec<String> =
        listed.iter().map(|d| d.id.clone()).filter(|id| id != &format!("{first}-r0")).collect();
    let r = pb::PreferredAllocationRequest {
        container_requests: vec![pb::ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: 1,
        }],
    };
    let pick = client.get_preferred_allocation(r).await.unwrap().into_inner().container_responses
        [0]
    .device_i_ds
    .clone();
    assert_eq!(pick.len(), 1);
    assert!(!pick[0].starts_with(&first), "{pick:?}");

    let allocate = |ids: Vec<String>| pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest { devices_ids: ids }],
    };
    let second = gpu(hosts::A100_GPU_BUSES[1]);
    let got = client.allocate(allocate(vec![format!("{second}-r2")])).await.unwrap().into_inner();
    let c = &got.container_responses[0];
    assert_eq!(c.envs.get("XPU_SHARING").map(String::as_str), Some("time-slicing"));
    assert_eq!(c.envs.get("XPU_TIME_SLICE_REPLICAS").map(String::as_str), Some("3"));
    assert_eq!(c.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&hosts::gpu_uuid(1)));
    let gpus: Vec<&str> = c
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .filter(|p| p.strip_prefix("/dev/nvidia").is_some_and(|n| n.parse::<u32>().is_ok()))
        .collect();
    assert_eq!(gpus, ["/dev/nvidia1"]);

    let e = client
        .allocate(allocate(vec![format!("{second}-r0"), format!("{second}-r1")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("nvidia.com/gpu.shared is time-sliced"), "{}", e.message());
    for bad in [second.clone(), format!("{second}-r3"), format!("{second}-rx")] {
        let e = client.allocate(allocate(vec![bad.clone()])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound, "{bad}: {}", e.message());
    }
    plugin.shutdown().await;
    kubelet.stop().await;
}

/// `--vfio`: on a host whose GPUs are on vfio-pci, the plugin registers one resource for the
/// model (`xpu.dev/a100-sxm4-40gb-vfio`) and none for containers, and `Allocate` answers as
/// KubeVirt's `permittedHostDevices` with `externalResourceProvider` expects, field by field:
/// `PCI_RESOURCE_<resource, upper case, '/' and '.' as '_'>` holding the allocated PCI
/// addresses joined by ',' (virt-launcher hands one to each hostDevice naming the resource),
/// and the device nodes `/dev/vfio/<group>` of each and `/dev/vfio/vfio`; no vendor runtime
/// variable (`NVIDIA_VISIBLE_DEVICES`) that would hand the function to a container runtime.
#[tokio::test]
async fn vfio_resources_answer_as_kubevirt_reads_host_devices() {
    let fixture = hosts::a100_8x_vfio().build();
    let dir = tempfile::tempdir().unwrap();
    let root = Root::new(fixture.root()).unwrap();
    let opts =
        xpu_host::DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).unwrap();
    let resources = Resource::vfio_for(&inv);
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin = start(&fixture, dir.path(), resources);
    let reg = kubelet.next_registration(WAIT).await.unwrap();
    assert_eq!(reg.resource_name, "xpu.dev/a100-sxm4-40gb-vfio");
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let listed = client.list_and_watch(pb::Empty {}).await.unwrap().into_inner().message().await;
    assert_eq!(listed.unwrap().unwrap().devices.len(), 8, "every GPU, no NVSwitch");
    let (a, b) = (gpu(hosts::A100_GPU_BUSES[0]), gpu(hosts::A100_GPU_BUSES[3]));
    let resp = client
        .allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: vec![a.clone(), b.clone()],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let c = &resp.container_responses[0];
    assert_eq!(
        c.envs.get("PCI_RESOURCE_XPU_DEV_A100-SXM4-40GB-VFIO"),
        Some(&format!("{a},{b}")),
        "{:?}",
        c.envs
    );
    assert!(!c.envs.contains_key("NVIDIA_VISIBLE_DEVICES"), "{:?}", c.envs);
    assert!(c.cdi_devices.is_empty(), "no vendor CDI edits: {:?}", c.cdi_devices);
    let group = |addr: &str| {
        inv.devices.iter().find(|d| d.address.to_string() == addr).unwrap().iommu_group.unwrap()
    };
    let nodes: Vec<(&str, &str)> =
        c.devices.iter().map(|d| (d.host_path.as_str(), d.container_path.as_str())).collect();
    let want = [
        format!("/dev/vfio/{}", group(&a)),
        format!("/dev/vfio/{}", group(&b)),
        "/dev/vfio/vfio".to_owned(),
    ];
    assert_eq!(nodes, want.iter().map(|p| (p.as_str(), p.as_str())).collect::<Vec<_>>());
    assert!(c.devices.iter().all(|d| d.permissions == "rw"));
    plugin.shutdown().await;
    kubelet.stop().await;
}
