//! The daemon's HTTP edge against what a hostile or broken client sends, byte for byte: a web
//! page's cross-site posts and DNS-rebound reads (loopback TCP asks for no token), log reads
//! that must stream rather than load the whole file, and connections that never finish a
//! request.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serve_support::{Daemon, WAIT, kill_tasks};

/// A response read off the wire.
struct Raw {
    status: u16,
    /// The status line and header lines, lower-cased.
    head: String,
    body: Vec<u8>,
}

/// Sends `request` as is on a fresh connection to 127.0.0.1:`port` and reads the whole
/// response (the request should say `Connection: close`).
fn raw(port: u16, request: &[u8]) -> Raw {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(WAIT))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
    let head = String::from_utf8_lossy(&out[..split]).to_lowercase();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap();
    let mut body = out[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Raw { status, head, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").unwrap();
        let size =
            usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

fn post(host: &str, extra: &str, body: &str) -> Vec<u8> {
    format!(
        "POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn job_count(d: &Daemon) -> usize {
    d.cli_json(&["jobs", "--format", "json"])["jobs"].as_array().unwrap().len()
}

/// Loopback TCP needs no token, so a page in a browser on the host must not be able to use it:
/// the exact requests a browser sends for a cross-site `fetch`/form post, or for a name rebound
/// to 127.0.0.1, are refused and create no job; the daemon's own clients still work.
#[test]
fn browser_cross_site_requests_are_refused_on_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(&dir.path().join("data"), None, &["--devices", "nvidia-a100:1"]);
    let port = d.port;
    let me = format!("127.0.0.1:{port}");
    let marker = dir.path().join("pwned");
    let evil = format!("command: [sh, -c, \"touch {}\"]\n", marker.display());

    // fetch("http://evil.example:PORT/v1/jobs", {method: "POST", mode: "no-cors", body}) from a
    // page whose name now resolves to 127.0.0.1.
    let r = raw(
        port,
        &post(
            &format!("evil.example:{port}"),
            "Origin: http://evil.example\r\nContent-Type: text/plain;charset=UTF-8\r\nSec-Fetch-Site: cross-site\r\n",
            &evil,
        ),
    );
    assert_eq!(r.status, 403, "{}", String::from_utf8_lossy(&r.body));
    // The same page reading the API under its rebound name.
    let r = raw(
        port,
        format!("GET /v1/jobs HTTP/1.1\r\nHost: evil.example:{port}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    );
    assert_eq!(r.status, 403);
    // An absolute-form target naming another host.
    let r = raw(
        port,
        format!(
            "GET http://evil.example:{port}/v1/jobs HTTP/1.1\r\nHost: {me}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    );
    assert_eq!(r.status, 403);
    // <form method=post action="http://127.0.0.1:PORT/v1/jobs"> on another site: right Host,
    // foreign Origin.
    for ty in ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain"]
    {
        let r = raw(
            port,
            &post(&me, &format!("Origin: http://evil.example\r\nContent-Type: {ty}\r\n"), &evil),
        );
        assert_eq!(r.status, 403, "{ty}: {}", String::from_utf8_lossy(&r.body));
    }
    // Fetch metadata alone is enough, as is an opaque origin.
    let r = raw(
        port,
        &post(&me, "Sec-Fetch-Site: cross-site\r\nContent-Type: application/json\r\n", &evil),
    );
    assert_eq!(r.status, 403);
    let r = raw(port, &post(&me, "Origin: null\r\nContent-Type: application/yaml\r\n", &evil));
    assert_eq!(r.status, 403);
    // No Origin (an old browser, a form in a privacy mode): the content type decides.
    for extra in
        ["Content-Type: text/plain\r\n", "Content-Type: application/x-www-form-urlencoded\r\n", ""]
    {
        let r = raw(port, &post(&me, extra, &evil));
        assert_eq!(r.status, 415, "{extra:?}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.head.contains("content-type: application/json"), "{}", r.head);
        assert!(String::from_utf8_lossy(&r.body).contains("application/yaml"));
    }
    // A cancel is a change too.
    let r = raw(
        port,
        format!("POST /v1/jobs/1/cancel HTTP/1.1\r\nHost: {me}\r\nOrigin: http://evil.example\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    assert_eq!(r.status, 403);
    assert_eq!(job_count(&d), 0, "a refused request created a job");
    assert!(!marker.exists());

    // The daemon's own page (same origin) and its names: 127.0.0.1 and localhost.
    let ok = "command: [\"true\"]\n";
    let r = raw(
        port,
        &post(
            &me,
            // The dashboard after /login: its cookie says who sends the change.
            &format!(
                "Origin: http://{me}\r\nSec-Fetch-Site: same-origin\r\nContent-Type: application/yaml\r\nCookie: xpu_token={}\r\n",
                d.token()
            ),
            ok,
        ),
    );
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let r = raw(
        port,
        format!("GET /v1/jobs HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    );
    assert_eq!(r.status, 200);
    let r = raw(
        port,
        &post(
            &format!("LOCALHOST:{port}"),
            &format!("Content-Type: application/json\r\nAuthorization: Bearer {}\r\n", d.token()),
            "{\"command\": [\"true\"]}",
        ),
    );
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    // The CLI over TCP (with the token: loopback does not take changes without one) and over
    // the socket: submit and cancel.
    let out = std::process::Command::new(serve_support::xpu_bin())
        .args(["submit", "--server", &d.url(), "--", "sleep", "60"])
        .env("XPU_TOKEN", d.token())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let out = d.cli(&["cancel", &id]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(job_count(&d), 3);
    // No browser reaches the socket: any Host, or none, is fine there.
    for host in ["Host: evil.example\r\n", ""] {
        let mut s = std::os::unix::net::UnixStream::connect(d.data_dir.join("xpu.sock")).unwrap();
        write!(s, "GET /v1/jobs HTTP/1.1\r\n{host}Connection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{host:?}: {out}");
    }
    kill_tasks(&d.data_dir);
}

/// The daemon's peak resident memory (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap();
    kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

/// A log is streamed from its file, not read into memory: four readers of a 30 MB log at once
/// get it all, chunked, and the daemon's peak memory grows by far less than one copy. `tail`
/// and `limitBytes` cut it as `kubectl logs --tail/--limit-bytes` do.
#[test]
fn logs_stream_from_the_file_with_tail_and_limit_bytes() {
    const LINES: u64 = 4_000_000;
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(&dir.path().join("data"), None, &["--devices", "nvidia-a100:1"]);
    let big = d.submit(&format!("command: [seq, \"1\", \"{LINES}\"]\n"));
    let ragged = d.submit("command: [printf, 'a\\nb\\n\\nc']\n");
    d.wait_state(big, &["succeeded"]);
    d.wait_state(ragged, &["succeeded"]);
    let expected: String = (1..=LINES).map(|i| format!("{i}\n")).collect();
    assert!(expected.len() > 30_000_000);

    let before = peak_rss(d.child.id());
    let port = d.port;
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let token = d.token();
            std::thread::spawn(move || {
                let req = format!(
                    "GET /v1/jobs/{big}/logs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
                );
                raw(port, req.as_bytes())
            })
        })
        .collect();
    for r in readers {
        let r = r.join().unwrap();
        assert_eq!(r.status, 200);
        assert!(r.head.contains("transfer-encoding: chunked"), "{}", r.head);
        assert_eq!(r.body.len(), expected.len());
        assert!(r.body == expected.as_bytes(), "the streamed log differs from the file");
    }
    let grew = peak_rss(d.child.id()).saturating_sub(before);
    assert!(grew < 16 << 20, "reading the log raised the daemon's peak memory by {grew} bytes");

    let log = |q: &str, id: i64| {
        let r = d.client().request("GET", &format!("/v1/jobs/{id}/logs?{q}"), None, &[]).unwrap();
        (r.status, String::from_utf8(r.body).unwrap())
    };
    let ok = |q: &str, id: i64| {
        let (status, text) = log(q, id);
        assert_eq!(status, 200, "{q}: {text}");
        text
    };
    assert_eq!(ok("tail=3", big), "3999998\n3999999\n4000000\n");
    assert_eq!(ok("tailLines=1", big), "4000000\n");
    assert_eq!(ok("tail=0", big), "");
    // Across many read blocks from the end.
    assert_eq!(ok("tail=50000", big), expected[expected.len() - 50000 * 8..]);
    assert_eq!(ok("limitBytes=5", big), "1\n2\n3");
    assert_eq!(ok("tail=2&limitBytes=3", big), "399");
    assert_eq!(ok("tail=1&follow=true", big), "4000000\n");
    assert_eq!(ok("limitBytes=4&follow=true", big), "1\n2\n");
    // No final newline; an empty line is a line.
    assert_eq!(ok("tail=1", ragged), "c");
    assert_eq!(ok("tail=2", ragged), "\nc");
    assert_eq!(ok("tail=3", ragged), "b\n\nc");
    assert_eq!(ok("tail=99", ragged), "a\nb\n\nc");
    assert_eq!(ok("", ragged), "a\nb\n\nc");
    assert_eq!(log("limitBytes=0", big).0, 400);
    assert_eq!(log("tail=-1", big).0, 400);
    kill_tasks(&d.data_dir);
}

/// A counter or gauge from `/metrics`, read over the Unix socket (which has its own slots).
fn metric(d: &Daemon, series: &str) -> u64 {
    let socket = xpu_server::client::Target::Unix(d.data_dir.join("xpu.sock"));
    let r = xpu_server::client::Client::new(socket, None)
        .request("GET", "/metrics", None, &[])
        .unwrap();
    let text = String::from_utf8(r.body).unwrap();
    let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| {
        panic!("{series} missing from /metrics:\n{text}");
    });
    line[series.len()..].trim().parse().unwrap()
}

/// Reads until the server closes the connection (any response first included) and returns
/// what came; fails if it is still open after [`WAIT`] seconds.
fn read_until_closed(s: &mut TcpStream, what: &str) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(WAIT))).unwrap();
    let mut out = Vec::new();
    match s.read_to_end(&mut out) {
        Ok(_) => out,
        // Closed with data unread on the server's side.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => out,
        Err(e) => panic!("{what}: still open after {WAIT} s ({e})"),
    }
}

/// A client that opens connections and sends half a request, or nothing, or half a body, or
/// goes quiet after a response, or stops reading one, is disconnected after the (here 1 s)
/// timeouts instead of holding a connection for ever.
#[test]
fn stalled_connections_are_closed_after_the_timeouts() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        &dir.path().join("data"),
        None,
        &[
            "--devices",
            "nvidia-a100:1",
            "--request-timeout-seconds",
            "1",
            "--send-timeout-seconds",
            "1",
        ],
    );
    let port = d.port;
    let connect = || TcpStream::connect(("127.0.0.1", port)).unwrap();
    let timed_out = "xpu_http_connections_timed_out_total{listener=\"tcp\"}";
    let before = metric(&d, timed_out);

    // Half a head, slowloris style.
    let mut half = connect();
    write!(half, "GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: 1").unwrap();
    let got = read_until_closed(&mut half, "a half-sent head");
    assert!(got.is_empty() || got.starts_with(b"HTTP/1.1 4"), "{}", String::from_utf8_lossy(&got));
    // Nothing at all.
    let mut silent = connect();
    read_until_closed(&mut silent, "a silent connection");
    // A whole head and part of its body.
    let mut body = connect();
    write!(
        body,
        "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/yaml\r\nContent-Length: 100\r\n\r\ncommand: [\"tr"
    )
    .unwrap();
    let got =
        String::from_utf8_lossy(&read_until_closed(&mut body, "a half-sent body")).into_owned();
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert_eq!(job_count(&d), 0);
    // Idle after a response on a kept-alive connection.
    let mut idle = connect();
    write!(idle, "GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").unwrap();
    let got =
        String::from_utf8_lossy(&read_until_closed(&mut idle, "an idle connection")).into_owned();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(metric(&d, timed_out) >= before + 3);

    // A reader that stops reading a 30 MB log: more than the socket buffers hold, so the
    // daemon's writes stall, and it gives up after the send timeout.
    let big = d.submit("command: [seq, \"1\", \"4000000\"]\n");
    d.wait_state(big, &["succeeded"]);
    let before = metric(&d, timed_out);
    let mut stalled = connect();
    write!(
        stalled,
        "GET /v1/jobs/{big}/logs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        d.token()
    )
    .unwrap();
    d.wait_for("the stalled reader to be dropped", || {
        (metric(&d, timed_out) > before).then_some(())
    });
    let got = read_until_closed(&mut stalled, "a stalled reader");
    assert!(got.starts_with(b"HTTP/1.1 200"));
    assert!(got.len() < 30_000_000, "the whole log was sent: {} bytes", got.len());
    assert!(!got.ends_with(b"0\r\n\r\n"), "the chunked body was ended as if complete");
    kill_tasks(&d.data_dir);
}

/// Over `--max-connections`, a connection waits to be accepted until one closes: two
/// half-sent requests hold both slots and a third, well-formed one is answered only once one
/// of them goes, not before and not never.
#[test]
fn connections_over_the_cap_wait_for_a_free_slot() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        &dir.path().join("data"),
        None,
        &["--max-connections", "2", "--request-timeout-seconds", "600"],
    );
    let port = d.port;
    let open = "xpu_http_connections{listener=\"tcp\"}";
    let accepted = "xpu_http_connections_accepted_total{listener=\"tcp\"}";
    let base = metric(&d, accepted);
    let half = || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(s, "GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n").unwrap();
        s
    };
    let (a, mut b) = (half(), half());
    d.wait_for("both half-sent connections to hold the two slots", || {
        (metric(&d, accepted) == base + 2 && metric(&d, open) == 2).then_some(())
    });

    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(c, "GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")
        .unwrap();
    // Not answered while both slots are held (a daemon without the cap answers at once).
    c.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut first = [0u8; 1];
    let early = c.read(&mut first);
    assert!(
        matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "answered over the cap: {early:?}"
    );
    assert_eq!(metric(&d, accepted), base + 2);

    drop(a);
    let got =
        String::from_utf8_lossy(&read_until_closed(&mut c, "the waiting request")).into_owned();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(metric(&d, accepted), base + 3);
    // The other half-sent request still holds its slot (600 s to finish its head).
    b.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    assert!(b.read(&mut first).is_err());
    kill_tasks(&d.data_dir);
}
