//! Issue 13: what a client of a plugin socket may make the plugin hold. Over the device
//! plugin's own socket (the h2authority proxy in front of tonic, as the kubelet reaches it),
//! over the proxy in front of a tonic server that bounds nothing, and over tonic configured by
//! `limits::server` alone: streams past `SETTINGS_MAX_CONCURRENT_STREAMS` are refused, a gRPC
//! length prefix over the message cap is refused as soon as its five octets arrive, and a socket
//! serves a bounded number of connections.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use xpu_host::Root;
use xpu_integrations::deviceplugin::{self, Plugin};
use xpu_integrations::h2probe::{self, Answer, Probe};
use xpu_integrations::limits;
use xpu_integrations::selector::Resource;
use xpu_integrations::{pb, transport};
use xpu_testkit::hosts;

/// A bound on waiting for what a correct server sends at once; never reached when it works.
const WAIT: Duration = Duration::from_secs(10);
const ALLOCATE: &str = "/v1beta1.DevicePlugin/Allocate";
const LIST_AND_WATCH: &str = "/v1beta1.DevicePlugin/ListAndWatch";
const OPTIONS: &str = "/v1beta1.DevicePlugin/GetDevicePluginOptions";
/// Streams opened past the cap in a flood.
const EXTRA: usize = 200;

fn plugin() -> Arc<Plugin> {
    let fixture = hosts::a100_8x().build();
    let inv = xpu_host::discover(&Root::new(fixture.root()).unwrap(), &Default::default()).unwrap();
    Arc::new(Plugin::new(Resource::defaults()[0].clone(), &inv))
}

/// The device plugin as it runs: `deviceplugin::Server` on `socket`.
fn device_plugin(socket: &Path) -> deviceplugin::Server {
    deviceplugin::Server::start(socket, plugin()).unwrap()
}

/// The same service behind the proxy with tonic's defaults: no stream limit at all.
fn unbounded_behind_proxy(socket: &Path) -> JoinHandle<()> {
    let incoming = transport::bind(socket).unwrap();
    let svc = pb::device_plugin_server::DevicePluginServer::from_arc(plugin());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    })
}

fn sorted(v: &[u32]) -> Vec<u32> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v
}

/// Floods one connection, then checks the plugin still answers on it once a slot is free.
async fn streams_are_capped(socket: &Path, authority: &[u8]) {
    let cap = limits::MAX_CONCURRENT_STREAMS as usize;
    let mut p = Probe::connect(socket, WAIT).await.unwrap();
    p.authority = authority.to_vec();
    let flood = h2probe::flood(&mut p, ALLOCATE, cap + EXTRA, EXTRA, WAIT).await.unwrap();
    let summary = flood.summary();
    assert_eq!(flood.advertised, Some(limits::MAX_CONCURRENT_STREAMS), "{summary}");
    assert!(!flood.closed, "{summary}");
    assert_eq!(sorted(&flood.refused), flood.opened[cap..], "past the cap, only those: {summary}");
    assert!(flood.reset.is_empty(), "{summary}");
    assert_eq!(p.setting(h2probe::MAX_HEADER_LIST_SIZE), Some(limits::MAX_HEADER_LIST));
    // The server held 64 streams and no more; one ended by the client frees a slot for a call.
    p.reset(flood.opened[0], h2probe::CANCEL).await.unwrap();
    let answer = h2probe::call(&mut p, OPTIONS, &[], WAIT).await.unwrap();
    assert_eq!(answer, Answer::Status("0".into(), String::new()));
    // The call ended: one slot, so of two more streams the second is refused.
    let more = h2probe::flood(&mut p, ALLOCATE, 2, 1, WAIT).await.unwrap();
    assert_eq!(more.refused, more.opened[1..], "{}", more.summary());
}

/// Every prefix over the cap is refused before its message arrives, however it is cut; the
/// connection goes on serving.
async fn messages_are_capped(socket: &Path, authority: &[u8]) {
    let mut p = Probe::connect(socket, WAIT).await.unwrap();
    p.authority = authority.to_vec();
    let over = u32::try_from(limits::MAX_MESSAGE + 1).unwrap();
    for declared in [over, 1 << 30, u32::MAX] {
        let answer = h2probe::oversized(&mut p, ALLOCATE, declared, WAIT).await.unwrap();
        assert!(answer.is_resource_exhausted(), "{declared} octets: {answer:?}");
    }
    // The prefix cut over two DATA frames.
    let s = p.open(ALLOCATE).await.unwrap();
    p.data(s, &[0, 0x40], false).await.unwrap();
    p.data(s, &[0, 0, 0, 1, 2, 3], false).await.unwrap();
    let answer = h2probe::answer(&mut p, s, WAIT).await.unwrap();
    assert!(answer.is_resource_exhausted(), "{answer:?}");
    // A whole message, then one over the cap in the same frame, on a stream that stays open
    // after its first message.
    let s = p.open(LIST_AND_WATCH).await.unwrap();
    p.data(s, &[0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 9], false).await.unwrap();
    let answer = h2probe::answer(&mut p, s, WAIT).await.unwrap();
    assert!(answer.is_resource_exhausted(), "{answer:?}");
    // A prefix of exactly the cap is taken: nothing ends the stream.
    let s = p.open(ALLOCATE).await.unwrap();
    let mut first = vec![0];
    first.extend_from_slice(&u32::try_from(limits::MAX_MESSAGE).unwrap().to_be_bytes());
    p.data(s, &first, false).await.unwrap();
    let seen = p.ping_pong(WAIT).await.unwrap();
    assert!(
        !seen.iter().any(|f| f.stream == s && f.kind == h2probe::RST_STREAM),
        "a message of the cap is allowed: {seen:?}"
    );
    // And the connection serves a call.
    let answer = h2probe::call(&mut p, OPTIONS, &[], WAIT).await.unwrap();
    assert_eq!(answer, Answer::Status("0".into(), String::new()));
}

#[tokio::test]
async fn device_plugin_refuses_streams_past_the_cap_and_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("xpu.sock");
    let server = device_plugin(&socket);
    streams_are_capped(&socket, b"localhost").await;
    // An old kubelet's :authority (the socket's path) takes the proxy's rewriting path.
    streams_are_capped(&socket, socket.to_str().unwrap().as_bytes()).await;
    server.stop().await;
}

#[tokio::test]
async fn device_plugin_refuses_a_message_prefix_over_the_cap_without_waiting_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("xpu.sock");
    let server = device_plugin(&socket);
    messages_are_capped(&socket, b"localhost").await;
    messages_are_capped(&socket, socket.to_str().unwrap().as_bytes()).await;
    server.stop().await;
}

/// A connection may not have more than `MAX_BUFFERED` octets of messages announced and not
/// finished: two messages of the cap, then the next is refused.
#[tokio::test]
async fn device_plugin_bounds_the_messages_a_connection_has_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("xpu.sock");
    let server = device_plugin(&socket);
    let mut p = Probe::connect(&socket, WAIT).await.unwrap();
    let cap = u32::try_from(limits::MAX_MESSAGE).unwrap();
    let n = limits::MAX_BUFFERED / limits::MAX_MESSAGE;
    let mut prefix = vec![0];
    prefix.extend_from_slice(&cap.to_be_bytes());
    let mut open = Vec::new();
    for _ in 0..n {
        let s = p.open(ALLOCATE).await.unwrap();
        p.data(s, &prefix, false).await.unwrap();
        open.push(s);
    }
    let answer = h2probe::oversized(&mut p, ALLOCATE, cap, WAIT).await.unwrap();
    assert!(answer.is_resource_exhausted(), "{answer:?}");
    // Ending one of the first frees its share.
    p.reset(open[0], h2probe::CANCEL).await.unwrap();
    let s = p.open(ALLOCATE).await.unwrap();
    p.data(s, &prefix, false).await.unwrap();
    let seen = p.ping_pong(WAIT).await.unwrap();
    assert!(!seen.iter().any(|f| f.stream == s && f.kind == h2probe::RST_STREAM), "{seen:?}");
    server.stop().await;
}

/// The proxy enforces the caps by itself, in front of a tonic server that has none.
#[tokio::test]
async fn the_proxy_bounds_a_server_that_bounds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("plain.sock");
    let server = unbounded_behind_proxy(&socket);
    streams_are_capped(&socket, b"localhost").await;
    messages_are_capped(&socket, b"localhost").await;
    server.abort();
}

/// tonic as `limits::server` configures it, with no proxy in front: it advertises and enforces
/// the same stream cap, and refuses a prefix over the message cap (tonic's own `OUT_OF_RANGE`)
/// without waiting for the message.
#[tokio::test]
async fn limits_server_alone_caps_streams_and_messages() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("plain.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let svc = pb::device_plugin_server::DevicePluginServer::from_arc(plugin())
        .max_decoding_message_size(limits::MAX_MESSAGE)
        .max_encoding_message_size(limits::MAX_MESSAGE);
    let server = tokio::spawn(
        limits::server()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let cap = limits::MAX_CONCURRENT_STREAMS as usize;
    let mut p = Probe::connect(&socket, WAIT).await.unwrap();
    assert_eq!(p.setting(h2probe::MAX_CONCURRENT_STREAMS), Some(limits::MAX_CONCURRENT_STREAMS));
    assert_eq!(p.setting(h2probe::MAX_HEADER_LIST_SIZE), Some(limits::MAX_HEADER_LIST));
    let flood = h2probe::flood(&mut p, ALLOCATE, cap + EXTRA, EXTRA, WAIT).await.unwrap();
    assert_eq!(sorted(&flood.refused), flood.opened[cap..], "{}", flood.summary());

    let mut p = Probe::connect(&socket, WAIT).await.unwrap();
    let over = u32::try_from(limits::MAX_MESSAGE + 1).unwrap();
    let answer = h2probe::oversized(&mut p, ALLOCATE, over, WAIT).await.unwrap();
    assert!(matches!(&answer, Answer::Status(code, _) if code == "11"), "{answer:?}");
    server.abort();
}

/// One socket serves `MAX_CONNECTIONS` connections at once; the next is closed as it is
/// accepted, and a connection that ends makes room for another.
#[tokio::test]
async fn a_plugin_socket_serves_a_bounded_number_of_connections() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("xpu.sock");
    let server = device_plugin(&socket);
    let mut held = Vec::new();
    for _ in 0..limits::MAX_CONNECTIONS {
        held.push(Probe::connect(&socket, WAIT).await.unwrap());
    }
    let past = Probe::connect(&socket, WAIT).await;
    assert!(past.is_err(), "a connection past the cap is served");
    drop(held.pop());
    // The freed slot is taken back once the proxy has seen the connection end.
    let mut again = None;
    for _ in 0..100 {
        if let Ok(p) = Probe::connect(&socket, WAIT).await {
            again = Some(p);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut p = again.expect("a connection once one ended");
    let answer = h2probe::call(&mut p, OPTIONS, &[], WAIT).await.unwrap();
    assert_eq!(answer, Answer::Status("0".into(), String::new()));
    server.stop().await;
}

/// What a gRPC library makes of it: a request over the cap fails with RESOURCE_EXHAUSTED (the
/// proxy's ENHANCE_YOUR_CALM, as gRPC maps it) while the library is still sending it; one well
/// within the cap reaches the plugin, which answers on its merits, in a bounded answer.
#[tokio::test]
async fn a_grpc_client_sees_resource_exhausted_for_a_request_over_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("xpu.sock");
    let server = device_plugin(&socket);
    let channel = transport::connect(&socket).await.unwrap();
    let mut client = pb::device_plugin_client::DevicePluginClient::new(channel);
    let request = |octets: usize| pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest {
            devices_ids: vec!["x".repeat(octets)],
        }],
    };
    let status = client.allocate(request(limits::MAX_MESSAGE + 1)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    // The answer quotes the id shortened: the whole of it would be a megabyte of trailers.
    let status = client.allocate(request(limits::MAX_MESSAGE / 4)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    assert!(status.message().len() < 1024, "{}", status.message().len());
    // The connection serves on.
    let options = client.get_device_plugin_options(pb::Empty {}).await.unwrap().into_inner();
    assert_eq!(options, deviceplugin::options());
    server.stop().await;
}
