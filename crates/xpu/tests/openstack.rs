//! `xpu openstack nova-config` and `xpu openstack check` as processes, on the fixture hosts.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use xpu_testkit::hosts;

fn xpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xpu")).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn plan(root: &Path) -> Value {
    let o =
        xpu(&["openstack", "nova-config", "--root", root.to_str().unwrap(), "--format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn nova_config_on_sriov_gives_type_pf_for_the_pf_and_type_vf_for_its_vfs() {
    let fx = hosts::sriov().build();
    let p = plan(fx.root());
    let aliases = p["aliases"].as_array().unwrap();
    assert_eq!(aliases.len(), 2);
    assert_eq!(aliases[0]["device_type"], "type-PF");
    assert_eq!(aliases[0]["devices"], serde_json::json!(["0000:41:00.0"]));
    assert_eq!(aliases[1]["device_type"], "type-VF");
    assert_eq!(
        aliases[1]["devices"],
        serde_json::json!(["0000:41:00.4", "0000:41:00.5", "0000:41:00.6", "0000:41:00.7"])
    );
    // One device_spec covers the PF and its VFs (same ids).
    assert_eq!(
        p["device_spec"],
        serde_json::json!([r#"{"vendor_id": "10de", "product_id": "20f1"}"#])
    );

    let o = xpu(&["openstack", "nova-config", "--root", fx.root().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains(
        "alias = {\"name\": \"nvidia-a100-pcie-40gb-pf\", \"vendor_id\": \"10de\", \"product_id\": \"20f1\", \"device_type\": \"type-PF\"}\n"
    ), "{text}");
    assert!(text.contains("\"device_type\": \"type-VF\"}"), "{text}");
    // The PF is still on the nvidia driver: the output says so.
    assert!(
        text.contains("# note: 0000:41:00.0 (type-PF) is bound to nvidia, not vfio-pci"),
        "{text}"
    );
}

#[test]
fn nova_config_on_8x_a100_gives_type_pci_10de_20b0() {
    let fx = hosts::a100_8x_vfio().build();
    let p = plan(fx.root());
    let aliases = p["aliases"].as_array().unwrap();
    assert_eq!(aliases.len(), 1, "NVSwitches are not offered as aliases");
    let a = &aliases[0];
    assert_eq!((a["vendor_id"].as_str(), a["product_id"].as_str()), (Some("10de"), Some("20b0")));
    assert_eq!(a["device_type"], "type-PCI");
    assert_eq!(a["devices"].as_array().unwrap().len(), 8);
    assert_eq!(p["notes"], serde_json::json!([]), "every GPU is already on vfio-pci");
    assert!(p["enabled_filters"].as_str().unwrap().ends_with(",PciPassthroughFilter"));

    let o = xpu(&["openstack", "nova-config", "--root", fx.root().to_str().unwrap()]);
    let text = stdout(&o);
    let pci_sections = text.matches("[pci]\n").count();
    assert_eq!(pci_sections, 2, "compute and controller: {text}");
    assert!(text.contains("device_spec = {\"vendor_id\": \"10de\", \"product_id\": \"20b0\"}\n"));
    assert!(text.contains(
        "alias = {\"name\": \"nvidia-a100-sxm4-40gb\", \"vendor_id\": \"10de\", \"product_id\": \"20b0\", \"device_type\": \"type-PCI\"}\n"
    ), "{text}");
    assert!(text.contains("[filter_scheduler]\nenabled_filters = ComputeFilter,"));
    assert!(text.contains(
        "openstack flavor set nvidia-a100-sxm4-40gb-x8 --property 'pci_passthrough:alias=nvidia-a100-sxm4-40gb:8'"
    ), "{text}");
    assert!(text.contains(
        "openstack flavor create --vcpus 8 --ram 65536 --disk 100 nvidia-a100-sxm4-40gb-x1"
    ));

    // The seed's naming, by template.
    let o = xpu(&[
        "openstack",
        "nova-config",
        "--root",
        fx.root().to_str().unwrap(),
        "--alias-name",
        "{vendor}-a100",
        "--only",
        "controller",
    ]);
    assert!(stdout(&o).contains("alias = {\"name\": \"nvidia-a100\","), "{}", stdout(&o));
    assert!(!stdout(&o).contains("device_spec"));
}

/// A mixed node: the devices `/etc/xpu/vm-devices` lists are Nova's, named by address so that
/// nova-compute never claims the GPUs Kubernetes has; a bad list is an input error naming it.
#[test]
fn nova_config_on_a_mixed_node_configures_only_the_listed_devices_by_address() {
    let fx = hosts::a100_8x_vfio().build();
    let all = plan(fx.root());
    let gpus: Vec<String> = all["aliases"][0]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    let list = fx.root().join("etc/xpu/vm-devices");
    std::fs::create_dir_all(list.parent().unwrap()).unwrap();
    std::fs::write(&list, format!("# Nova's\n{}\n{}  # second\n", gpus[6], gpus[7])).unwrap();
    let p = plan(fx.root());
    let a = &p["aliases"][0];
    assert_eq!(a["devices"], serde_json::json!([gpus[6], gpus[7]]));
    let want: Vec<String> = [&gpus[6], &gpus[7]]
        .iter()
        .map(|g| {
            format!("{{\"address\": \"{g}\", \"vendor_id\": \"10de\", \"product_id\": \"20b0\"}}")
        })
        .collect();
    assert_eq!(p["device_spec"], serde_json::json!(want));
    assert!(
        p["notes"][0].as_str().unwrap().contains("only the 2 devices /etc/xpu/vm-devices lists")
    );
    assert!(p["flavors"].as_array().unwrap().iter().any(|f| f["count"] == 2));

    let root = fx.root().to_str().unwrap();
    std::fs::write(&list, "0000:07:00.0\nsecond-gpu\n").unwrap();
    let o = xpu(&["openstack", "nova-config", "--root", root]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("/etc/xpu/vm-devices:2: \"second-gpu\" is not a PCI address"),
        "{}",
        stderr(&o)
    );
    std::fs::write(&list, "0000:99:00.0\n").unwrap();
    let o = xpu(&["openstack", "nova-config", "--root", root]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("0000:99:00.0 is not an accelerator of this host"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn nova_config_template_errors_are_input_errors() {
    let fx = hosts::sriov().build();
    let root = fx.root().to_str().unwrap();
    let o = xpu(&["openstack", "nova-config", "--root", root, "--alias-name", "{vendor}"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("gives the same name \"nvidia\""), "{}", stderr(&o));
    let o = xpu(&["openstack", "nova-config", "--root", root, "--alias-name", "{model}"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown placeholder {model}"), "{}", stderr(&o));
}

fn write_conf(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_owned()
}

fn check(root: &Path, conf: &str, extra: &[&str]) -> Output {
    let mut args = vec!["openstack", "check", "--root", root.to_str().unwrap(), "--config", conf];
    args.extend(extra);
    xpu(&args)
}

#[test]
fn generated_config_satisfies_its_own_flavors() {
    let fx = hosts::a100_8x_vfio().build();
    let dir = tempfile::tempdir().unwrap();
    let o = xpu(&[
        "openstack",
        "nova-config",
        "--root",
        fx.root().to_str().unwrap(),
        "--only",
        "compute",
    ]);
    let conf = write_conf(dir.path(), "nova.conf", &stdout(&o));
    let o = check(fx.root(), &conf, &["--flavor", "nvidia-a100-sxm4-40gb:8"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("fits this host"), "{}", stdout(&o));
    let o = check(fx.root(), &conf, &["--flavor", "nvidia-a100-sxm4-40gb:9"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("needs 9 device(s) but only 8 free device(s)"), "{}", stdout(&o));
    // Requests in one flavor consume from the same pools.
    let o = check(
        fx.root(),
        &conf,
        &["--flavor", "nvidia-a100-sxm4-40gb:4, nvidia-a100-sxm4-40gb : 5"],
    );
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn check_explains_a_device_type_that_libvirt_does_not_report() {
    // The seed's warning: device_type must be what libvirt reports. These A100s have no SR-IOV,
    // so they are type-PCI, and an alias asking for type-PF matches nothing.
    let fx = hosts::a100_8x_vfio().build();
    let dir = tempfile::tempdir().unwrap();
    let conf = write_conf(
        dir.path(),
        "nova.conf",
        "[DEFAULT]\ndebug = True\n\n[pci]\npassthrough_whitelist = { \"vendor_id\": \"10de\", \"product_id\": \"20b0\" }\nalias = { \"name\": \"nvidia-a100\", \"product_id\": \"20b0\", \"vendor_id\": \"10de\", \"device_type\": \"type-PF\" }\n",
    );
    let o = check(fx.root(), &conf, &["--flavor", "nvidia-a100:1", "--format", "json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["fits"], false);
    let hint = r["filter_failure"]["hint"].as_str().unwrap();
    assert!(hint.contains("this host reports type-PCI for 10de:20b0"), "{hint}");
    assert!(stderr(&o).contains("passthrough_whitelist is the pre-Zed name"), "{}", stderr(&o));
}

#[test]
fn check_sees_the_claim_fail_where_the_filter_passes() {
    let fx = hosts::sriov().build();
    let dir = tempfile::tempdir().unwrap();
    let conf = write_conf(
        dir.path(),
        "nova.conf",
        "[pci]\ndevice_spec = {\"vendor_id\": \"10de\", \"product_id\": \"20f1\"}\nalias = {\"name\": \"pf\", \"vendor_id\": \"10de\", \"product_id\": \"20f1\", \"device_type\": \"type-PF\"}\nalias = {\"name\": \"vf\", \"vendor_id\": \"10de\", \"product_id\": \"20f1\", \"device_type\": \"type-VF\"}\n",
    );
    let o = check(fx.root(), &conf, &["--flavor", "vf:4", "--format", "json"]);
    assert!(o.status.success(), "{}", stdout(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["claimed"].as_array().unwrap().len(), 4);
    let o = check(fx.root(), &conf, &["--flavor", "pf:1, vf:1", "--format", "json"]);
    assert_eq!(o.status.code(), Some(1));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["filter_failure"], Value::Null, "PciPassthroughFilter counts pools only");
    assert_eq!(r["claim_failure"]["alias"], "vf", "claiming the PF took its VFs");
}

#[test]
fn check_applies_numa_policies_to_numa_guests() {
    let fx = hosts::a100_8x_vfio().build();
    let dir = tempfile::tempdir().unwrap();
    let conf = write_conf(
        dir.path(),
        "nova.conf",
        "[pci]\ndevice_spec = {\"vendor_id\": \"10de\"}\nalias = {\"name\": \"a100\", \"vendor_id\": \"10de\", \"product_id\": \"20b0\", \"numa_policy\": \"required\"}\n",
    );
    let o = check(fx.root(), &conf, &["--flavor", "a100:4", "--numa-nodes", "1"]);
    assert!(o.status.success(), "{}", stdout(&o));
    assert!(stdout(&o).contains("guest NUMA nodes on host cell(s) 0"), "{}", stdout(&o));
    let o = check(fx.root(), &conf, &["--flavor", "a100:5", "--numa-nodes", "1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("satisfy NUMA policy required"), "{}", stdout(&o));
    // Preferred lets the fifth come from the other node; so does a two-node guest.
    let o = check(
        fx.root(),
        &conf,
        &["--flavor", "a100:5", "--numa-nodes", "1", "--numa-policy", "preferred"],
    );
    assert!(o.status.success(), "{}", stdout(&o));
    let o = check(fx.root(), &conf, &["--flavor", "a100:5", "--numa-nodes", "2"]);
    assert!(o.status.success(), "{}", stdout(&o));
    // Without a guest NUMA topology no policy applies.
    let o = check(fx.root(), &conf, &["--flavor", "a100:8"]);
    assert!(o.status.success(), "{}", stdout(&o));
}

#[test]
fn check_rejects_bad_input_with_exit_2() {
    let fx = hosts::a100_8x_vfio().build();
    let dir = tempfile::tempdir().unwrap();
    let good = write_conf(
        dir.path(),
        "good.conf",
        "[pci]\nalias = {\"name\": \"a\", \"vendor_id\": \"10de\", \"product_id\": \"20b0\"}\n",
    );
    let cases: Vec<(String, &str, &str)> = vec![
        (
            write_conf(
                dir.path(),
                "k.conf",
                "[pci]\nalias = {\"name\": \"a\", \"vendor_id\": \"10de\", \"product_id\": \"20b0\", \"count\": 2}\n",
            ),
            "a:1",
            "\"count\" was unexpected",
        ),
        (
            write_conf(
                dir.path(),
                "d.conf",
                "[pci]\ndevice_spec = {\"devname\": \"eth0\"}\nalias = {\"name\": \"a\", \"vendor_id\": \"10de\", \"product_id\": \"20b0\"}\n",
            ),
            "a:1",
            "devname is not supported",
        ),
        (write_conf(dir.path(), "s.conf", "alias = x\n"), "a:1", "before any [section]"),
        (good.clone(), "a:x", "is not a whole number"),
        (good.clone(), "b:1", "alias \"b\""),
        (
            dir.path().join("missing.conf").to_str().unwrap().to_owned(),
            "a:1",
            "cannot read nova.conf",
        ),
    ];
    for (conf, flavor, want) in cases {
        let o = check(fx.root(), &conf, &["--flavor", flavor]);
        assert_eq!(o.status.code(), Some(2), "{conf} {flavor}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{conf} {flavor}: {}", stderr(&o));
    }
}

#[test]
fn check_cuts_echoed_input_to_a_short_prefix() {
    // A 10 MB line must not come back in the error: 80 characters of it and "…".
    let fx = hosts::a100_8x_vfio().build();
    let dir = tempfile::tempdir().unwrap();
    let big = "x".repeat(10 << 20);
    let alias =
        "[pci]\nalias = {\"name\": \"a\", \"vendor_id\": \"10de\", \"product_id\": \"20b0\"}\n";
    let cases = [
        (format!("[pci]\n{big}\n"), "a:1".to_owned(), "is not KEY = VALUE"),
        (format!("{big} = 1\n"), "a:1".to_owned(), "comes before any [section] header"),
        (format!("[pci]\ndevice_spec = {big}\n"), "a:1".to_owned(), "is not valid JSON"),
        (
            format!("[pci]\ndevice_spec = {{\"vendor_id\": \"{big}\"}}\n{}", &alias[6..]),
            "a:1".to_owned(),
            "does not parse as a hex number",
        ),
        (
            format!("[pci]\nalias = {{\"name\": \"a\", \"device_type\": \"{big}\"}}\n"),
            "a:1".to_owned(),
            "is not one of type-PCI",
        ),
        // A command-line argument is at most 128 KiB (MAX_ARG_STRLEN).
        (alias.to_owned(), format!("a:{}x", "9".repeat(100_000)), "is not a whole number"),
    ];
    for (i, (text, flavor, want)) in cases.iter().enumerate() {
        let conf = write_conf(dir.path(), &format!("{i}.conf"), text);
        let o = check(fx.root(), &conf, &["--flavor", flavor]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "case {i}: {}", &e[..e.len().min(500)]);
        assert!(e.len() < 600, "case {i}: {} bytes: {}", e.len(), &e[..500]);
        let cut = format!("{}…", if i == 5 { "9" } else { "x" }.repeat(40));
        assert!(e.contains(want) && e.contains(&cut), "case {i}: {e}");
    }
}
