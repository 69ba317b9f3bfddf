//! Nova semantics, case by case against the behaviour of `nova/pci/{devspec,request,stats}.py`.

use super::*;

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn dev(a: &str, vendor: u16, product: u16, numa: Option<u32>, t: SriovType) -> HostDevice {
    HostDevice {
        address: addr(a),
        parent: None,
        vendor_id: vendor,
        product_id: product,
        numa_node: numa,
        dev_type: t,
    }
}

fn spec(json: &str) -> DeviceSpec {
    let mut v = DeviceSpec::parse_all(json).unwrap();
    assert_eq!(v.len(), 1);
    v.remove(0)
}

fn spec_err(json: &str) -> String {
    DeviceSpec::parse_all(json).unwrap_err().to_string()
}

fn glob_matches(glob: &str, a: &str) -> bool {
    AddressSpec::parse_glob("t", glob).unwrap().matches(&addr(a))
}

#[test]
fn glob_fields_are_right_aligned_and_blank_means_any() {
    assert!(glob_matches("*:*:*.*", "0000:25:00.0"));
    assert!(glob_matches("0000:25:00.0", "0000:25:00.0"));
    assert!(!glob_matches("0000:25:00.0", "0000:25:00.1"));
    // bus:slot.func, slot.func, slot, .func
    assert!(glob_matches("25:00.1", "0001:25:00.1"));
    assert!(glob_matches(":00.", "0000:41:00.5"));
    assert!(!glob_matches(":01.", "0000:41:00.5"));
    assert!(glob_matches("00", "0000:41:00.5"));
    assert!(glob_matches(".5", "0000:41:00.5"));
    assert!(!glob_matches(".5", "0000:41:00.4"));
    assert!(glob_matches("*:0a:00.*", "0000:0a:00.3"));
    assert!(glob_matches("0:a:0.0", "0000:0a:00.0"), "values compare as numbers, not text");
    assert!(glob_matches(" 25 : 00 . 1 ", "0000:25:00.1"), "fields are stripped");
    assert!(glob_matches("0x25:00.0", "0000:25:00.0"), "python int(x, 16) takes 0x");
}

#[test]
fn glob_hex_limits() {
    for (glob, field) in [
        ("10000:00:00.0", "domain"),
        ("0000:100:00.0", "bus"),
        ("0000:00:20.0", "slot"),
        ("0000:00:00.8", "func"),
    ] {
        let e = AddressSpec::parse_glob("t", glob).unwrap_err().to_string();
        assert!(e.contains(&format!("property {field}")), "{glob}: {e}");
        assert!(e.contains("greater than the maximum allowable value"), "{glob}: {e}");
    }
    for ok in ["ffff:ff:1f.7", "FFFF:FF:1F.7"] {
        assert!(AddressSpec::parse_glob("t", ok).is_ok(), "{ok}");
    }
    let e = AddressSpec::parse_glob("t", "00:2*:00.0").unwrap_err().to_string();
    assert!(e.contains("does not parse as a hex number"), "{e}");
    let e = AddressSpec::parse_glob("t", "0:0:0:0.0").unwrap_err().to_string();
    assert!(e.contains("more than three"), "{e}");
}

#[test]
fn regex_address_is_anchored_at_the_start_only() {
    let s =
        spec(r#"{"address": {"domain": ".*", "bus": "0", "slot": "0[01]", "function": "[0-2]"}}"#);
    let d = |a: &str| dev(a, 0x10de, 0x20b0, None, SriovType::Pci);
    // re.match("0", "0a") matches: only the start is anchored.
    assert!(s.matches(&d("0000:0a:01.2"), false));
    assert!(s.matches(&d("0000:00:00.0"), false));
    // ... but the start is: "0" does not match bus "a0".
    assert!(!s.matches(&d("0000:a0:00.0"), false));
    assert!(!s.matches(&d("0000:0a:02.0"), false));
    assert!(!s.matches(&d("0000:0a:01.3"), false));
    // The end is not anchored either: "2" matches bus "25" and "2b", not "b2".
    let s = spec(r#"{"address": {"bus": "2"}}"#);
    assert!(s.matches(&d("0000:25:00.0"), false));
    assert!(s.matches(&d("0000:2b:00.0"), false));
    assert!(!s.matches(&d("0000:b2:00.0"), false));
    // Fields are matched in Nova's formatting: domain 4 digits, function 1 digit.
    let s = spec(r#"{"address": {"domain": "0000$", "function": "1$"}}"#);
    assert!(s.matches(&d("0000:25:00.1"), false));
    let e = spec_err(r#"{"address": {"bus": "(["}}"#);
    assert!(e.contains("address bus regex") && e.contains("does not compile"), "{e}");
    let e = spec_err(r#"{"address": {"bus": 25}}"#);
    assert!(e.contains("must be a regex string"), "{e}");
}

#[test]
fn ids_wildcards_and_limits() {
    let s = spec(r#"{"vendor_id": "10de", "product_id": "*"}"#);
    assert_eq!(s.vendor_id, Some(0x10de));
    assert_eq!(s.product_id, None);
    assert!(s.matches(&dev("0000:25:00.0", 0x10de, 0x1234, None, SriovType::Pci), false));
    assert!(!s.matches(&dev("0000:25:00.0", 0x1002, 0x1234, None, SriovType::Pci), false));
    let s = spec(r#"{"vendor_id": " 10DE ", "product_id": "0x20b0"}"#);
    assert_eq!((s.vendor_id, s.product_id), (Some(0x10de), Some(0x20b0)));
    let e = spec_err(r#"{"vendor_id": "10000"}"#);
    assert!(e.contains("vendor_id") && e.contains("maximum allowable value (FFFF)"), "{e}");
    let e = spec_err(r#"{"product_id": "zz"}"#);
    assert!(e.contains("does not parse as a hex number"), "{e}");
    let e = spec_err(r#"{"vendor_id": 4318}"#);
    assert!(e.contains("must be a string"), "{e}");
}

#[test]
fn devname_is_rejected_with_the_fix() {
    let e = spec_err(r#"{"devname": "eth0", "physical_network": "physnet1"}"#);
    assert!(e.starts_with("[pci] device_spec {"), "{e}");
    assert!(e.contains("devname is not supported") && e.contains("\"address\""), "{e}");
}

#[test]
fn extra_keys_become_tags_and_bools_normalise() {
    let s = spec(
        r#"{"vendor_id": "15b3", "physical_network": "physnet1", "trusted": "true", "managed": "Yes", "remote_managed": "false", "numvfs": 4}"#,
    );
    assert_eq!(s.tags["physical_network"], "physnet1");
    assert_eq!(s.tags["trusted"], "true");
    assert_eq!(s.tags["managed"], "true");
    assert_eq!(s.tags["numvfs"], "4");
    let e = spec_err(r#"{"managed": "maybe"}"#);
    assert!(e.contains("cannot parse tag \"managed\""), "{e}");
}

#[test]
fn list_entries_and_bad_json() {
    let v =
        DeviceSpec::parse_all(r#"[{"vendor_id": "10de"}, {"address": "0000:41:00.*"}]"#).unwrap();
    assert_eq!(v.len(), 2);
    let e = DeviceSpec::parse_all("{vendor_id: 10de}").unwrap_err().to_string();
    assert!(e.contains("is not valid JSON"), "{e}");
    let e = DeviceSpec::parse_all("[1]").unwrap_err().to_string();
    assert!(e.contains("expecting a dict"), "{e}");
    let e = DeviceSpec::parse_all("\"x\"").unwrap_err().to_string();
    assert!(e.contains("expecting a list or dict"), "{e}");
}

#[test]
fn pf_address_matches_its_vfs() {
    let mut vf = dev("0000:41:00.4", 0x10de, 0x20f1, Some(0), SriovType::Vf);
    vf.parent = Some(addr("0000:41:00.0"));
    let s = spec(r#"{"address": "0000:41:00.0"}"#);
    assert_eq!(s.address.single_address().as_deref(), Some("0000:41:00.0"));
    assert!(s.matches(&vf, true), "a PF's address selects its VFs");
    assert!(!s.matches(&vf, false), "unless that address is not a PF on this host");
    assert_eq!(spec(r#"{"address": "41:00.*"}"#).address.single_address(), None);
}

#[test]
fn resource_class_and_traits_normalise_as_placement() {
    assert_eq!(normalize_resource_class("pgpu"), "PGPU");
    assert_eq!(normalize_resource_class("custom_a100"), "CUSTOM_A100");
    assert_eq!(normalize_resource_class("nvidia a100/40g"), "CUSTOM_NVIDIA_A100_40G");
    assert_eq!(normalize_resource_class("gpu--x"), "CUSTOM_GPU_X");
    let t = get_traits("HW_GPU_API_VULKAN,custom_fast,nvlink-3, x");
    let t: Vec<&str> = t.iter().map(String::as_str).collect();
    assert_eq!(t, ["CUSTOM_FAST", "CUSTOM_NVLINK_3", "CUSTOM__X", "HW_GPU_API_VULKAN"]);
    let s = spec(r#"{"vendor_id": "10de", "resource_class": "a100", "traits": "nvlink"}"#);
    let d = dev("0000:25:00.0", 0x10de, 0x20b0, None, SriovType::Pci);
    assert_eq!(s.resource_class(&d), "CUSTOM_A100");
    assert!(s.traits().contains("COMPUTE_MANAGED_PCI_DEVICE"));
    assert!(s.traits().contains("CUSTOM_NVLINK"));
    assert_eq!(spec(r#"{"vendor_id": "10de"}"#).resource_class(&d), "CUSTOM_PCI_10DE_20B0");
}

fn aliases(entries: &[&str]) -> Result<Aliases, NovaError> {
    Aliases::parse(entries.iter().copied())
}

#[test]
fn alias_schema() {
    let a = aliases(&[
        r#"{"name": " a100 ", "vendor_id": "10de", "product_id": "20B0", "device_type": "type-PF", "numa_policy": "required"}"#,
    ])
    .unwrap();
    let x = a.get("a100").unwrap();
    assert_eq!(x.numa_policy, NumaPolicy::Required);
    assert_eq!(x.specs[0].dev_type, Some(SriovType::Pf));
    // No numa_policy: legacy.
    let a = aliases(&[r#"{"name": "t4", "vendor_id": "10de", "product_id": "1eb8"}"#]).unwrap();
    assert_eq!(a.get("t4").unwrap().numa_policy, NumaPolicy::Legacy);

    let cases = [
        (
            r#"{"name": "x", "vendor_id": "10de", "product_id": "20b0", "count": 1}"#,
            "\"count\" was unexpected",
        ),
        (r#"{"vendor_id": "10de", "product_id": "20b0"}"#, "'name' is a required property"),
        (r#"{"name": "", "vendor_id": "10de", "product_id": "20b0"}"#, "too short"),
        (r#"{"name": "x", "vendor_id": "10dE0", "product_id": "20b0"}"#, "does not match"),
        (r#"{"name": "x", "vendor_id": "0x10", "product_id": "20b0"}"#, "does not match"),
        (
            r#"{"name": "x", "vendor_id": "10de", "product_id": "20b0", "device_type": "PF"}"#,
            "is not one of type-PCI",
        ),
        (
            r#"{"name": "x", "vendor_id": "10de", "product_id": "20b0", "device_type": "vdpa"}"#,
            "is not one of type-PCI",
        ),
        (
            r#"{"name": "x", "vendor_id": "10de", "product_id": "20b0", "numa_policy": "strict"}"#,
            "is not one of required",
        ),
        (
            r#"{"name": "x", "vendor_id": "10de", "product_id": "20b0", "capability_type": "usb"}"#,
            "capability_type",
        ),
        (r#"{"name": 5, "vendor_id": "10de", "product_id": "20b0"}"#, "is not of type 'string'"),
        (r#"{"name": "x", "vendor_id": "10de"}"#, "does not have vendor_id and product_id"),
        (r#"["x"]"#, "is not of type 'object'"),
        (r#"{"name": "x","#, "is not valid JSON"),
    ];
    for (entry, want) in cases {
        let e = aliases(&[entry]).unwrap_err().to_string();
        assert!(e.contains(want), "{entry}: {e}");
        assert!(e.starts_with("[pci] alias"), "{entry}: {e}");
    }
}

#[test]
fn repeated_alias_ors_its_specs() {
    let a = aliases(&[
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "20b0", "device_type": "type-PCI"}"#,
        r#"{"name": "tpu", "vendor_id": "1ae0", "product_id": "0062", "device_type": "type-PCI"}"#,
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "1eb8", "device_type": "type-PCI"}"#,
    ])
    .unwrap();
    assert_eq!(a.aliases.len(), 2);
    let gpu = a.get("gpu").unwrap();
    assert_eq!(gpu.specs.len(), 2);
    // One A100 and one T4 both serve "gpu:2".
    let devices = vec![
        dev("0000:25:00.0", 0x10de, 0x20b0, Some(0), SriovType::Pci),
        dev("0000:26:00.0", 0x10de, 0x1eb8, Some(0), SriovType::Pci),
    ];
    let stats = PciStats::new(devices, &[spec(r#"{"vendor_id": "10de"}"#)], Vec::new());
    assert_eq!(stats.pools.len(), 2);
    let reqs = a.requests("gpu:2", None).unwrap();
    assert!(stats.support_requests(&reqs, None).is_ok());
    assert!(stats.support_requests(&a.requests("gpu:3", None).unwrap(), None).is_err());

    let e = aliases(&[
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "20b0", "device_type": "type-PCI"}"#,
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "1eb8", "device_type": "type-PF"}"#,
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("device type mismatch"), "{e}");
    let e = aliases(&[
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "20b0", "device_type": "type-PCI", "numa_policy": "required"}"#,
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "1eb8", "device_type": "type-PCI"}"#,
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("NUMA policy mismatch"), "{e}");
    let e = aliases(&[
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "20b0"}"#,
        r#"{"name": "gpu", "vendor_id": "10de", "product_id": "1eb8"}"#,
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("requires device_type on every entry"), "{e}");
}

#[test]
fn flavor_strings_with_spaces() {
    assert_eq!(
        parse_flavor_alias("a100:2, t4 : 1").unwrap(),
        [("a100".to_owned(), 2), ("t4".to_owned(), 1)]
    );
    assert_eq!(parse_flavor_alias(" nvidia-a100 :1").unwrap(), [("nvidia-a100".to_owned(), 1)]);
    for bad in ["a100", "a100:1:2", "a100:two", "a100:-1", "a100:1,", "", "a100:"] {
        let e = parse_flavor_alias(bad).unwrap_err().to_string();
        assert!(e.contains("NAME:COUNT"), "{bad}: {e}");
    }
    let a = aliases(&[r#"{"name": "a100", "vendor_id": "10de", "product_id": "20b0"}"#]).unwrap();
    let e = a.requests("a100:1, t4:1", None).unwrap_err().to_string();
    assert!(e.contains("alias \"t4\"") && e.contains("defined: a100"), "{e}");
    let r = a.requests("a100 : 2", Some(NumaPolicy::Preferred)).unwrap();
    assert_eq!((r[0].count, r[0].numa_policy), (2, NumaPolicy::Preferred));
}

/// Four GPUs on node 0, two on node 1, two that report no NUMA node; sockets 0 and 1.
fn numa_host() -> PciStats {
    let mut devices = Vec::new();
    for i in 0..4 {
        devices.push(dev(&format!("0000:1{i}:00.0"), 0x10de, 0x20b0, Some(0), SriovType::Pci));
    }
    for i in 0..2 {
        devices.push(dev(&format!("0000:8{i}:00.0"), 0x10de, 0x20b0, Some(1), SriovType::Pci));
    }
    for i in 0..2 {
        devices.push(dev(&format!("0000:c{i}:00.0"), 0x10de, 0x20b0, None, SriovType::Pci));
    }
    let cells = vec![
        NumaCell { id: 0, socket: Some(0) },
        NumaCell { id: 1, socket: Some(1) },
        NumaCell { id: 2, socket: Some(1) },
    ];
    PciStats::new(devices, &[spec(r#"{"vendor_id": "10de", "product_id": "20b0"}"#)], cells)
}

fn req(n: u32, policy: NumaPolicy) -> Vec<PciRequest> {
    let a = aliases(&[r#"{"name": "a100", "vendor_id": "10de", "product_id": "20b0"}"#]).unwrap();
    a.requests(&format!("a100:{n}"), Some(policy)).unwrap()
}

#[test]
fn without_guest_numa_no_policy_applies() {
    let h = numa_host();
    assert!(h.support_requests(&req(8, NumaPolicy::Required), None).is_ok());
    let e = h.support_requests(&req(9, NumaPolicy::Required), None).unwrap_err();
    assert_eq!(e.stage, FitStage::Spec { matching: 8 });
}

#[test]
fn numa_policy_required() {
    let h = numa_host();
    assert!(h.support_requests(&req(2, NumaPolicy::Required), Some(&[1])).is_ok());
    let e = h.support_requests(&req(3, NumaPolicy::Required), Some(&[1])).unwrap_err();
    assert_eq!(e.stage, FitStage::Numa { matching: 8, after_numa: 2 });
    assert!(e.to_string().contains("satisfy NUMA policy required"), "{e}");
}

#[test]
fn numa_policy_legacy_accepts_devices_without_numa_info() {
    let h = numa_host();
    // Node 1 has 2, plus 2 without NUMA information.
    assert!(h.support_requests(&req(4, NumaPolicy::Legacy), Some(&[1])).is_ok());
    let e = h.support_requests(&req(5, NumaPolicy::Legacy), Some(&[1])).unwrap_err();
    assert_eq!(e.stage, FitStage::Numa { matching: 8, after_numa: 4 });
}

#[test]
fn numa_policy_preferred_uses_any_device_local_first() {
    let mut h = numa_host();
    assert!(h.support_requests(&req(8, NumaPolicy::Preferred), Some(&[1])).is_ok());
    // With 3 requested on node 1, the claim takes the node-1 pair and one without NUMA info
    // before reaching node 0.
    let got = h.consume_requests(&req(3, NumaPolicy::Preferred), Some(&[1])).unwrap();
    let nodes: Vec<Option<u32>> = got
        .iter()
        .map(|c| h.devices.iter().find(|d| d.address == c.address).unwrap().numa_node)
        .collect();
    assert_eq!(nodes.iter().filter(|n| **n == Some(1)).count(), 2, "{nodes:?}");
    assert!(!nodes.contains(&Some(0)), "{nodes:?}");
}

#[test]
fn numa_policy_socket() {
    let h = numa_host();
    // Guest on cell 2 (socket 1): node-1 devices are on the same socket.
    assert!(h.support_requests(&req(2, NumaPolicy::Socket), Some(&[2])).is_ok());
    // Devices without NUMA information do not satisfy socket (they do satisfy legacy).
    let e = h.support_requests(&req(3, NumaPolicy::Socket), Some(&[2])).unwrap_err();
    assert_eq!(e.stage, FitStage::Numa { matching: 8, after_numa: 2 });
    assert!(h.support_requests(&req(3, NumaPolicy::Legacy), Some(&[1])).is_ok());
    // Without socket information for every host cell, socket affinity cannot be met.
    let mut unknown = numa_host();
    unknown.cells[2].socket = None;
    assert!(unknown.support_requests(&req(1, NumaPolicy::Socket), Some(&[2])).is_err());
    // Enough on the guest's own node: socket is satisfied like required.
    assert!(unknown.support_requests(&req(4, NumaPolicy::Socket), Some(&[0])).is_ok());
}

#[test]
fn guest_numa_fit_tries_host_cells() {
    let h = numa_host();
    // Three required devices fit only on cell 0.
    assert_eq!(h.fit_numa_guest(&req(3, NumaPolicy::Required), 1).unwrap(), [0]);
    assert_eq!(h.fit_numa_guest(&req(6, NumaPolicy::Required), 2).unwrap(), [0, 1]);
    assert!(h.fit_numa_guest(&req(5, NumaPolicy::Required), 1).is_err());
    let e = h.fit_numa_guest(&req(1, NumaPolicy::Required), 4).unwrap_err();
    assert_eq!(e.stage, FitStage::NumaCells { guest: 4, host: 3 });
    assert!(e.to_string().contains("asks for 4 NUMA node(s) but the host has 3"), "{e}");
}

/// An SR-IOV PF with two VFs, all `10de:20f1`, plus a plain GPU.
fn sriov_host() -> PciStats {
    let mut devices = vec![dev("0000:41:00.0", 0x10de, 0x20f1, Some(0), SriovType::Pf)];
    for f in [4, 5] {
        let mut vf = dev(&format!("0000:41:00.{f}"), 0x10de, 0x20f1, Some(0), SriovType::Vf);
        vf.parent = Some(addr("0000:41:00.0"));
        devices.push(vf);
    }
    PciStats::new(devices, &[spec(r#"{"vendor_id": "10de"}"#)], Vec::new())
}

#[test]
fn pools_are_keyed_by_type_and_pfs_are_kept_for_pf_requests() {
    let h = sriov_host();
    assert_eq!(h.pools.len(), 2);
    let a = aliases(&[
        r#"{"name": "any", "vendor_id": "10de", "product_id": "20f1"}"#,
        r#"{"name": "pf", "vendor_id": "10de", "product_id": "20f1", "device_type": "type-PF"}"#,
        r#"{"name": "vf", "vendor_id": "10de", "product_id": "20f1", "device_type": "type-VF"}"#,
        r#"{"name": "pci", "vendor_id": "10de", "product_id": "20f1", "device_type": "type-PCI"}"#,
    ])
    .unwrap();
    // An alias without device_type matches the PF's pool too, but PFs are held back.
    assert!(h.support_requests(&a.requests("any:2", None).unwrap(), None).is_ok());
    let e = h.support_requests(&a.requests("any:3", None).unwrap(), None).unwrap_err();
    assert_eq!(e.stage, FitStage::Pf { after_numa: 3, without_pfs: 2 });
    assert!(e.to_string().contains("1 of them are PFs"), "{e}");
    assert!(h.support_requests(&a.requests("pf:1", None).unwrap(), None).is_ok());
    // The seed's mistake: asking for type-PCI when libvirt says type-PF / type-VF.
    let e = h.support_requests(&a.requests("pci:1", None).unwrap(), None).unwrap_err();
    let hint = e.hint.clone().unwrap();
    assert!(hint.contains("this host reports type-PF, type-VF for 10de:20f1"), "{hint}");
}

#[test]
fn filter_does_not_see_pf_vf_dependencies_but_the_claim_does() {
    let a = aliases(&[
        r#"{"name": "pf", "vendor_id": "10de", "product_id": "20f1", "device_type": "type-PF"}"#,
        r#"{"name": "vf", "vendor_id": "10de", "product_id": "20f1", "device_type": "type-VF"}"#,
    ])
    .unwrap();
    let reqs = a.requests("pf:1, vf:1", None).unwrap();
    let mut h = sriov_host();
    // Pool counts allow it (PciPassthroughFilter passes)...
    assert!(h.support_requests(&reqs, None).is_ok());
    // ... but claiming the PF takes its VFs with it, so the compute node's claim fails, and
    // leaves the pools as they were.
    let e = h.consume_requests(&reqs, None).unwrap_err();
    assert_eq!(e.alias, "vf");
    assert_eq!(h.free_devices(), 3);
    // A VF claim takes its PF out.
    let got = h.consume_requests(&a.requests("vf:1", None).unwrap(), None).unwrap();
    assert_eq!(got[0].address.to_string(), "0000:41:00.5", "last device of the pool first");
    assert_eq!(h.free_devices(), 1);
    assert!(h.support_requests(&a.requests("pf:1", None).unwrap(), None).is_err());
}

#[test]
fn requests_consume_across_a_flavor() {
    let h = numa_host();
    let a = aliases(&[r#"{"name": "a100", "vendor_id": "10de", "product_id": "20b0"}"#]).unwrap();
    assert!(h.support_requests(&a.requests("a100:4, a100:4", None).unwrap(), None).is_ok());
    assert!(h.support_requests(&a.requests("a100:4, a100:5", None).unwrap(), None).is_err());
}

#[test]
fn tags_split_pools_and_must_match_requests() {
    let devices = vec![
        dev("0000:25:00.0", 0x10de, 0x20b0, Some(0), SriovType::Pci),
        dev("0000:2b:00.0", 0x10de, 0x20b0, Some(0), SriovType::Pci),
    ];
    let specs = DeviceSpec::parse_all(
        r#"[{"address": "0000:25:00.0", "tier": "Gold", "resource_class": "a100"}, {"vendor_id": "10de"}]"#,
    )
    .unwrap();
    let h = PciStats::new(devices, &specs, Vec::new());
    assert_eq!(h.pools.len(), 2);
    assert_eq!(h.pools[0].key.tags.len(), 0, "pools with fewer keys first");
    assert_eq!(h.pools[1].key.tags.get("tier").map(String::as_str), Some("Gold"));
    assert!(!h.pools[1].key.tags.contains_key("resource_class"));
    // An alias cannot name tags (its schema forbids it), but capability_type is compared as one:
    // no pool has it, so such an alias matches nothing, as in Nova.
    let a = aliases(&[
        r#"{"name": "c", "vendor_id": "10de", "product_id": "20b0", "capability_type": "pci"}"#,
    ])
    .unwrap();
    assert!(h.support_requests(&a.requests("c:1", None).unwrap(), None).is_err());
}

#[test]
fn combinations_in_order() {
    assert_eq!(combinations(&[0, 1, 2], 2), [vec![0, 1], vec![0, 2], vec![1, 2]]);
    assert_eq!(combinations(&[0, 1], 2), [vec![0, 1]]);
    assert!(combinations(&[0], 2).is_empty());
}

#[test]
fn place_stacks_like_pci_weigher_and_explains_every_host() {
    let a = aliases(&[r#"{"name": "a100", "vendor_id": "10de", "product_id": "20b0"}"#]).unwrap();
    let host = |n: usize| {
        let devices = (0..n)
            .map(|i| {
                dev(&format!("0000:{:02x}:00.0", 0x10 + i), 0x10de, 0x20b0, Some(0), SriovType::Pci)
            })
            .collect();
        PciStats::new(devices, &[spec(r#"{"vendor_id": "10de"}"#)], Vec::new())
    };
    let mut hosts = vec![host(8), host(2), host(4)];
    // One GPU goes to the host with the fewest free: the 8-GPU host stays whole.
    let c = place(&mut hosts, &a.requests("a100:1", None).unwrap(), None).unwrap();
    assert_eq!(c.host, 1);
    assert_eq!(hosts[1].free_devices(), 1);
    // Four: host 1 (1 left) cannot, host 2 (4) can and has fewer than host 0.
    assert_eq!(place(&mut hosts, &a.requests("a100:4", None).unwrap(), None).unwrap().host, 2);
    assert_eq!(place(&mut hosts, &a.requests("a100:8", None).unwrap(), None).unwrap().host, 0);
    let e = place(&mut hosts, &a.requests("a100:2", None).unwrap(), None).unwrap_err();
    assert_eq!(e.len(), 3, "one reason per host: {e:?}");
}

#[test]
fn echoed_input_is_cut_to_a_short_prefix_on_a_char_boundary() {
    assert_eq!(excerpt("short"), "short");
    let long = "é".repeat(EXCERPT_CHARS + 1);
    assert_eq!(excerpt(&long), format!("{}…", "é".repeat(EXCERPT_CHARS)));
    assert_eq!(excerpt(&"é".repeat(EXCERPT_CHARS)), "é".repeat(EXCERPT_CHARS));
    let e = DeviceSpec::parse_all(&format!("{{\"vendor_id\": \"{}\"}}", "z".repeat(1 << 20)))
        .unwrap_err()
        .to_string();
    assert!(e.len() < 300, "{e}");
    assert!(
        e.contains(&format!("(\"{}…\") does not parse as a hex number", "z".repeat(80))),
        "{e}"
    );
}
