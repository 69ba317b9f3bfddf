use super::*;

/// `device.attributes[name] == value`.
#[derive(Debug)]
struct AttrIs(&'static str, Value);

impl Selector for AttrIs {
    fn matches(&self, id: &DeviceId, device: &Device) -> Result<bool, String> {
        Ok(attribute(device, &id.driver, self.0) == Some(&self.1))
    }
}

/// A selector that fails at run time.
#[derive(Debug)]
struct Fails;

impl Selector for Fails {
    fn matches(&self, _: &DeviceId, _: &Device) -> Result<bool, String> {
        Err("device.attributes[\"x\"].y: no such key".into())
    }
}

const DRIVER: &str = "gpu.xpu.dev";

fn gpu(name: &str, domain: i64) -> Device {
    Device {
        name: name.into(),
        attributes: BTreeMap::from([
            ("nvlinkDomain".into(), Value::Int(domain)),
            ("model".into(), Value::String("A100".into())),
        ]),
        ..Device::default()
    }
}

fn slice(node: &str, devices: Vec<Device>) -> Slice {
    Slice {
        driver: DRIVER.into(),
        pool: node.into(),
        generation: 1,
        slice_count: 1,
        scope: NodeScope::Node(node.into()),
        devices,
        shared_counters: BTreeMap::new(),
    }
}

fn exact(count: u32) -> Exact {
    Exact {
        class: "gpu".into(),
        selectors: Vec::new(),
        mode: Mode::Count(count),
        admin_access: false,
        tolerations: Vec::new(),
        capacity: BTreeMap::new(),
        whole_group: false,
    }
}

fn claim(name: &str, requests: Vec<(&str, Exact)>) -> Claim {
    Claim {
        name: name.into(),
        requests: requests
            .into_iter()
            .map(|(n, e)| Request { name: n.into(), alternatives: vec![(None, e)] })
            .collect(),
        constraints: Vec::new(),
    }
}

/// The cluster holds device `name` of pool `n1`.
fn held(name: &str) -> InUse {
    let mut in_use = InUse::default();
    in_use.devices.insert(DeviceId {
        driver: DRIVER.into(),
        pool: "n1".into(),
        device: name.into(),
    });
    in_use
}

/// All of a claim's devices in one NVLink domain.
fn same_domain() -> Constraint {
    Constraint {
        requests: Vec::new(),
        kind: ConstraintKind::MatchAttribute(format!("{DRIVER}/nvlinkDomain")),
    }
}

fn refs(s: &[Slice]) -> Vec<&Slice> {
    s.iter().collect()
}

fn classes() -> HashMap<String, Class> {
    let gpu = Class { name: "gpu".into(), selectors: Vec::new(), whole_group: false };
    HashMap::from([("gpu".to_owned(), gpu)])
}

fn run(claims: &[Claim], slices: &[Slice], in_use: &InUse) -> Result<Vec<Allocation>, Unfit> {
    allocate(claims, &classes(), &refs(slices), in_use, "n1", &BTreeMap::new(), Limits::default())
}

fn names(a: &Allocation) -> Vec<&str> {
    a.devices.iter().map(|d| d.id.device.as_str()).collect()
}

#[test]
fn counts_take_free_devices_of_the_node_in_order() {
    let slices = [
        slice("n1", vec![gpu("g0", 0), gpu("g1", 0), gpu("g2", 1)]),
        slice("n2", vec![gpu("h0", 0)]),
    ];
    let in_use = held("g0");
    let got = run(&[claim("a", vec![("r", exact(2))])], &slices, &in_use).unwrap();
    assert_eq!(names(&got[0]), ["g1", "g2"]);
    let e = run(&[claim("a", vec![("r", exact(3))])], &slices, &in_use).unwrap_err();
    assert!(e.to_string().contains("only 2 of the 3 devices"), "{e}");
    // Two claims of one pod never share a device.
    let got = run(
        &[claim("a", vec![("r", exact(1))]), claim("b", vec![("r", exact(1))])],
        &slices,
        &in_use,
    )
    .unwrap();
    assert!(double_booked(&got).is_empty());
    assert_eq!((names(&got[0]), names(&got[1])), (vec!["g1"], vec!["g2"]));
}

#[test]
fn incomplete_and_stale_pools_are_not_used() {
    let mut a = slice("n1", vec![gpu("g0", 0)]);
    a.slice_count = 2;
    let err =
        run(&[claim("a", vec![("r", exact(1))])], std::slice::from_ref(&a), &InUse::default())
            .unwrap_err();
    assert!(matches!(err, Unfit::Request { .. }), "{err}");
    let mut all = exact(1);
    all.mode = Mode::All;
    let err =
        run(&[claim("a", vec![("r", all.clone())])], std::slice::from_ref(&a), &InUse::default())
            .unwrap_err();
    assert!(err.to_string().contains("being updated"), "{err}");
    // A newer generation replaces the older slice's devices.
    let old = slice("n1", vec![gpu("old", 0)]);
    let mut new = slice("n1", vec![gpu("new0", 0), gpu("new1", 0)]);
    new.generation = 2;
    let got = run(&[claim("a", vec![("r", all)])], &[old, new], &InUse::default()).unwrap();
    assert_eq!(names(&got[0]), ["new0", "new1"]);
}

#[test]
fn first_available_tries_sub_requests_in_order() {
    let slices = [slice("n1", vec![gpu("g0", 0), gpu("g1", 0), gpu("g2", 0), gpu("g3", 0)])];
    let r = Request {
        name: "gpus".into(),
        alternatives: vec![(Some("eight".into()), exact(8)), (Some("four".into()), exact(4))],
    };
    let c = Claim { name: "a".into(), requests: vec![r], constraints: Vec::new() };
    let got = run(&[c], &slices, &InUse::default()).unwrap();
    assert_eq!(got[0].devices.len(), 4);
    assert!(got[0].devices.iter().all(|d| d.request == "gpus/four"));
}

#[test]
fn match_attribute_backtracks_to_a_whole_domain_and_distinct_keeps_them_apart() {
    let slices = [slice("n1", vec![gpu("a0", 0), gpu("b0", 1), gpu("b1", 1), gpu("a1", 0)])];
    let in_use = held("a1");
    let mut c = claim("a", vec![("r", exact(2))]);
    c.constraints.push(same_domain());
    let got = run(std::slice::from_ref(&c), &slices, &in_use).unwrap();
    assert_eq!(names(&got[0]), ["b0", "b1"]);
    let mut d = claim("a", vec![("x", exact(1)), ("y", exact(1))]);
    d.constraints.push(Constraint {
        requests: vec!["x".into(), "y".into()],
        kind: ConstraintKind::DistinctAttribute(format!("{DRIVER}/nvlinkDomain")),
    });
    let got = run(&[d], &slices, &InUse::default()).unwrap();
    assert_eq!(names(&got[0]), ["a0", "b0"]);
    // A device without the attribute never satisfies the constraint.
    let mut bare = gpu("z", 0);
    bare.attributes.clear();
    let e = run(&[c], &[slice("n1", vec![bare.clone(), bare])], &InUse::default());
    assert!(e.is_err());
}

#[test]
fn shared_counters_are_never_overdrawn() {
    // One GPU of 4 memory slices; each 1g profile draws one, the whole-GPU profile all four.
    let profile = |name: &str, slices: u64| Device {
        name: name.into(),
        consumes: BTreeMap::from([("gpu0".into(), BTreeMap::from([("memory".into(), slices)]))]),
        ..Device::default()
    };
    let mut s = slice(
        "n1",
        vec![
            profile("whole", 4),
            profile("1g-0", 1),
            profile("1g-1", 1),
            profile("1g-2", 1),
            profile("1g-3", 1),
        ],
    );
    s.shared_counters = BTreeMap::from([("gpu0".into(), BTreeMap::from([("memory".into(), 4)]))]);
    let slices = [s];
    let mut one_g = exact(1);
    one_g.selectors.push(Arc::new(Never("whole")));
    let got = run(
        &[claim("a", vec![("r", one_g.clone())]), claim("b", vec![("r", exact(1))])],
        &slices,
        &InUse::default(),
    );
    // `b` could take the whole GPU only if `a` drew nothing: the search finds a 1g for b instead.
    let got = got.unwrap();
    assert_eq!(names(&got[1]), ["1g-1"]);
    let mut in_use = InUse::default();
    in_use.add(&got[0]);
    in_use.add(&got[1]);
    let e = run(&[claim("c", vec![("r", exact(3))])], &slices, &in_use).unwrap_err();
    assert!(e.to_string().contains("only 2 of the 3"), "{e}");
}

/// Selects every device but one by name.
#[derive(Debug)]
struct Never(&'static str);

impl Selector for Never {
    fn matches(&self, _: &DeviceId, device: &Device) -> Result<bool, String> {
        Ok(device.name != self.0)
    }
}

#[test]
fn consumable_capacity_is_shared_and_never_overcommitted() {
    let mut d = gpu("g0", 0);
    d.allow_multiple = true;
    d.capacity = BTreeMap::from([("memory".into(), 80)]);
    let slices = [slice("n1", vec![d])];
    let mut ask = exact(1);
    ask.capacity = BTreeMap::from([("memory".into(), 30)]);
    let mut in_use = InUse::default();
    for _ in 0..2 {
        let got = run(&[claim("a", vec![("r", ask.clone())])], &slices, &in_use).unwrap();
        assert_eq!(got[0].devices[0].consumed, Some(BTreeMap::from([("memory".into(), 30)])));
        in_use.add(&got[0]);
    }
    assert!(run(&[claim("a", vec![("r", ask)])], &slices, &in_use).is_err());
}

#[test]
fn taints_admin_access_selectors_and_classes() {
    let mut tainted = gpu("t0", 0);
    tainted.taints.push(DeviceTaint {
        key: "maintenance".into(),
        value: "".into(),
        effect: "NoSchedule".into(),
    });
    let slices = [slice("n1", vec![tainted, gpu("g1", 0)])];
    let got = run(&[claim("a", vec![("r", exact(1))])], &slices, &InUse::default()).unwrap();
    assert_eq!(names(&got[0]), ["g1"]);
    let mut tolerant = exact(2);
    tolerant.tolerations.push(DeviceToleration {
        key: "maintenance".into(),
        exists: true,
        ..Default::default()
    });
    assert_eq!(
        run(&[claim("a", vec![("r", tolerant)])], &slices, &InUse::default()).unwrap()[0]
            .devices
            .len(),
        2
    );

    // Admin access reaches a device in use, and takes nothing.
    let in_use = held("g1");
    let mut admin = exact(1);
    admin.admin_access = true;
    let got = run(&[claim("a", vec![("r", admin)])], &slices[..], &in_use).unwrap();
    assert!(got[0].devices[0].admin_access);

    let mut sel = exact(1);
    sel.selectors.push(Arc::new(AttrIs("gpu.xpu.dev/model", Value::String("H100".into()))));
    assert!(run(&[claim("a", vec![("r", sel)])], &slices, &InUse::default()).is_err());
    let mut bad = exact(1);
    bad.selectors.push(Arc::new(Fails));
    let e = run(&[claim("ns/a", vec![("r", bad)])], &slices, &InUse::default()).unwrap_err();
    assert!(
        e.to_string().contains("claim ns/a, request r: a selector failed: device.attributes"),
        "{e}"
    );
    let mut missing = exact(1);
    missing.class = "tpu".into();
    let e = run(&[claim("a", vec![("r", missing)])], &slices, &InUse::default()).unwrap_err();
    assert!(matches!(e, Unfit::NoClass { .. }), "{e}");
}

#[test]
fn slices_for_a_node_selector_or_all_nodes_are_offered_there() {
    let mut shared = slice("fabric", vec![gpu("x0", 0)]);
    shared.scope = NodeScope::AllNodes;
    let mut rack = slice("rack", vec![gpu("r0", 0)]);
    rack.scope = NodeScope::Selector(vec![NodeSelectorTerm {
        match_expressions: vec![xpu_core::affinity::Requirement {
            key: "rack".into(),
            operator: xpu_core::affinity::Operator::In,
            values: vec!["r1".into()],
        }],
        match_fields: Vec::new(),
    }]);
    let slices = [shared, rack];
    let labels = BTreeMap::from([("rack".to_owned(), "r1".to_owned())]);
    let got = allocate(
        &[claim("a", vec![("r", exact(2))])],
        &classes(),
        &refs(&slices),
        &InUse::default(),
        "n9",
        &labels,
        Limits::default(),
    )
    .unwrap();
    assert_eq!(got[0].devices.len(), 2);
    let got = allocate(
        &[claim("a", vec![("r", exact(2))])],
        &classes(),
        &refs(&slices),
        &InUse::default(),
        "n9",
        &BTreeMap::new(),
        Limits::default(),
    );
    assert!(got.is_err());
}

/// A claim whose constraint no device set meets costs a bounded search, not an exponential one.
#[test]
fn an_impossible_claim_gives_up_within_its_budget() {
    let devices: Vec<Device> = (0..64).map(|i| gpu(&format!("g{i}"), i)).collect();
    let slices = [slice("n1", devices)];
    let mut c = claim("a", vec![("r", exact(8))]);
    c.constraints.push(same_domain());
    let t = std::time::Instant::now();
    let e = allocate(
        &[c],
        &classes(),
        &refs(&slices),
        &InUse::default(),
        "n1",
        &BTreeMap::new(),
        Limits { steps: 10_000, ..Limits::default() },
    )
    .unwrap_err();
    assert!(t.elapsed() < std::time::Duration::from_secs(2));
    assert!(matches!(e, Unfit::Request { .. } | Unfit::Budget(_)), "{e}");
}

/// Random small clusters and claims, checked two ways: every allocation the allocator returns
/// passes an independent checker, and it finds one exactly when a brute-force enumeration of
/// every device choice finds one.
#[test]
fn random_claims_agree_with_brute_force_and_every_allocation_checks() {
    use crate::rng::Rng;
    let mut found = 0;
    for (seed, pack) in (0..1500u64).flat_map(|s| [(s, false), (s, true)]) {
        let mut rng = Rng::new(seed);
        let case = Case::random(&mut rng);
        let got = allocate(
            &case.claims,
            &case.classes,
            &refs(&case.slices),
            &case.in_use,
            "n1",
            &BTreeMap::new(),
            Limits { steps: 1_000_000, pack },
        );
        let brute = case.brute_force();
        match got {
            Ok(allocs) => {
                found += 1;
                let picks: Vec<Vec<(usize, usize, Vec<usize>)>> =
                    allocs.iter().enumerate().map(|(ci, a)| case.as_picks(ci, a)).collect();
                if let Err(e) = case.check(&picks) {
                    panic!(
                        "seed {seed}: the allocator returned an invalid allocation: {e}\n{allocs:?}"
                    );
                }
                assert!(brute, "seed {seed}: allocator found one, brute force none");
            }
            Err(e) => assert!(!brute, "seed {seed}: brute force found one, the allocator said {e}"),
        }
    }
    assert!(found > 400, "the generator makes enough cases that fit: {found}");
}

struct Case {
    slices: Vec<Slice>,
    classes: HashMap<String, Class>,
    claims: Vec<Claim>,
    in_use: InUse,
    /// Devices of the one pool, for the brute force.
    devices: Vec<Device>,
    counters: BTreeMap<String, u64>,
}

impl Case {
    fn random(rng: &mut crate::rng::Rng) -> Case {
        let n = 2 + rng.index(4);
        let mut devices = Vec::new();
        for i in 0..n {
            let mut d = gpu(&format!("g{i}"), rng.below(2) as i64);
            if rng.below(4) == 0 {
                d.attributes.insert("model".into(), Value::String("H100".into()));
            }
            if rng.below(6) == 0 {
                d.taints.push(DeviceTaint {
                    key: "bad".into(),
                    value: String::new(),
                    effect: "NoSchedule".into(),
                });
            }
            if rng.below(3) == 0 {
                d.consumes.insert("set".into(), BTreeMap::from([("mem".into(), 1 + rng.below(2))]));
            }
            if rng.below(5) == 0 {
                d.allow_multiple = true;
                d.consumes.clear();
                d.capacity.insert("memory".into(), 4);
            }
            devices.push(d);
        }
        let counters = BTreeMap::from([("mem".to_owned(), 1 + rng.below(3))]);
        let mut s = slice("n1", devices.clone());
        s.shared_counters.insert("set".into(), counters.clone());
        let mut in_use = InUse::default();
        for d in &devices {
            if rng.below(5) == 0 {
                let id =
                    DeviceId { driver: DRIVER.into(), pool: "n1".into(), device: d.name.clone() };
                if d.allow_multiple {
                    in_use.capacity.insert(id, BTreeMap::from([("memory".into(), 2)]));
                } else {
                    in_use.devices.insert(id);
                }
            }
        }
        let mut classes = classes();
        classes.insert(
            "h100".into(),
            Class {
                name: "h100".into(),
                selectors: vec![Arc::new(AttrIs(
                    "gpu.xpu.dev/model",
                    Value::String("H100".into()),
                ))],
                whole_group: false,
            },
        );
        let mut claims = Vec::new();
        for c in 0..1 + rng.index(2) {
            let mut requests = Vec::new();
            for r in 0..1 + rng.index(2) {
                let alt = |rng: &mut crate::rng::Rng| {
                    let mut e = exact(1 + rng.below(2) as u32);
                    if rng.below(4) == 0 {
                        e.class = "h100".into();
                    }
                    if rng.below(5) == 0 {
                        e.tolerations.push(DeviceToleration {
                            key: "bad".into(),
                            exists: true,
                            ..Default::default()
                        });
                    }
                    if rng.below(3) == 0 {
                        e.capacity.insert("memory".into(), 1 + rng.below(3));
                    }
                    e
                };
                let alternatives = if rng.below(3) == 0 {
                    vec![(Some("a".to_owned()), alt(rng)), (Some("b".to_owned()), alt(rng))]
                } else {
                    vec![(None, alt(rng))]
                };
                requests.push(Request { name: format!("r{r}"), alternatives });
            }
            let mut constraints = Vec::new();
            match rng.below(4) {
                0 => constraints.push(Constraint {
                    requests: Vec::new(),
                    kind: ConstraintKind::MatchAttribute(format!("{DRIVER}/nvlinkDomain")),
                }),
                1 => constraints.push(Constraint {
                    requests: Vec::new(),
                    kind: ConstraintKind::DistinctAttribute(format!("{DRIVER}/nvlinkDomain")),
                }),
                _ => {}
            }
            claims.push(Claim { name: format!("c{c}"), requests, constraints });
        }
        Case { slices: vec![s], classes, claims, in_use, devices, counters }
    }

    /// An allocation as (request, alternative, device indices) per request.
    fn as_picks(&self, ci: usize, a: &Allocation) -> Vec<(usize, usize, Vec<usize>)> {
        let claim = &self.claims[ci];
        let mut out = Vec::new();
        for (ri, r) in claim.requests.iter().enumerate() {
            for (ai, (sub, _)) in r.alternatives.iter().enumerate() {
                let name = match sub {
                    Some(s) => format!("{}/{s}", r.name),
                    None => r.name.clone(),
                };
                let ds: Vec<usize> = a
                    .devices
                    .iter()
                    .filter(|d| d.request == name)
                    .map(|d| self.devices.iter().position(|x| x.name == d.id.device).unwrap())
                    .collect();
                if !ds.is_empty() {
                    out.push((ri, ai, ds));
                }
            }
        }
        out
    }

    /// The independent checker: every rule, from the case's own data.
    fn check(&self, picks: &[Vec<(usize, usize, Vec<usize>)>]) -> Result<(), String> {
        let mut whole: HashSet<usize> = HashSet::new();
        let mut cap: HashMap<usize, u64> = HashMap::new();
        let mut drawn: u64 = 0;
        let held = |i: usize| {
            let id = DeviceId {
                driver: DRIVER.into(),
                pool: "n1".into(),
                device: self.devices[i].name.clone(),
            };
            (
                self.in_use.devices.contains(&id),
                self.in_use.capacity.get(&id).and_then(|c| c.get("memory")).copied().unwrap_or(0),
            )
        };
        for i in 0..self.devices.len() {
            let (w, c) = held(i);
            if w || c > 0 {
                drawn += self.devices[i]
                    .consumes
                    .get("set")
                    .and_then(|m| m.get("mem"))
                    .copied()
                    .unwrap_or(0);
            }
        }
        let mut drew: HashSet<usize> = HashSet::new();
        let mut new_draw = 0;
        for (ci, claim) in self.claims.iter().enumerate() {
            let p = &picks[ci];
            if p.len() != claim.requests.len() {
                return Err(format!(
                    "claim {ci}: {} of {} requests allocated",
                    p.len(),
                    claim.requests.len()
                ));
            }
            for (ri, ai, ds) in p {
                let e = &claim.requests[*ri].alternatives[*ai].1;
                let Mode::Count(n) = e.mode else { unreachable!() };
                if ds.len() != n as usize {
                    return Err(format!("claim {ci} request {ri}: {} devices for {n}", ds.len()));
                }
                let mut once = HashSet::new();
                for &i in ds {
                    let d = &self.devices[i];
                    if !once.insert(i) {
                        return Err(format!("{} twice in one request", d.name));
                    }
                    if e.class == "h100"
                        && d.attributes.get("model") != Some(&Value::String("H100".into()))
                    {
                        return Err(format!("{} is not of class h100", d.name));
                    }
                    if !d.taints.is_empty() && e.tolerations.is_empty() {
                        return Err(format!("{} is tainted", d.name));
                    }
                    let (w, c) = held(i);
                    if d.allow_multiple {
                        let want = e.capacity.get("memory").copied().unwrap_or(4);
                        let total = cap.entry(i).or_insert(c);
                        *total += want;
                        if *total > 4 || w {
                            return Err(format!("{} over capacity", d.name));
                        }
                    } else if w || c > 0 || !whole.insert(i) || cap.contains_key(&i) {
                        return Err(format!("{} not free", d.name));
                    } else if !e.capacity.is_empty() {
                        // The case's whole devices have no capacity, so none meets the bound.
                        return Err(format!("{} has less capacity than asked", d.name));
                    }
                    if !(w || c > 0) && drew.insert(i) {
                        let v =
                            d.consumes.get("set").and_then(|m| m.get("mem")).copied().unwrap_or(0);
                        drawn += v;
                        new_draw += v;
                    }
                }
            }
            for con in &claim.constraints {
                let vals: Vec<i64> = p
                    .iter()
                    .flat_map(|(_, _, ds)| ds.iter())
                    .map(|&i| match self.devices[i].attributes.get("nvlinkDomain") {
                        Some(Value::Int(v)) => *v,
                        _ => -1,
                    })
                    .collect();
                let ok = match con.kind {
                    ConstraintKind::MatchAttribute(_) => vals.windows(2).all(|w| w[0] == w[1]),
                    ConstraintKind::DistinctAttribute(_) => {
                        vals.iter().collect::<HashSet<_>>().len() == vals.len()
                    }
                };
                if !ok {
                    return Err(format!("claim {ci}: constraint {con:?} broken by {vals:?}"));
                }
            }
        }
        if new_draw > 0 && drawn > self.counters["mem"] {
            return Err(format!("counter mem drawn {drawn} of {}", self.counters["mem"]));
        }
        for (&i, &c) in &cap {
            if whole.contains(&i) || c > 4 {
                return Err(format!("device {i} over capacity"));
            }
        }
        Ok(())
    }

    /// Whether any choice of alternatives and devices passes [`Case::check`].
    fn brute_force(&self) -> bool {
        // Every (claim, request) slot: its alternatives and their counts.
        let slots: Vec<(usize, usize)> = self
            .claims
            .iter()
            .enumerate()
            .flat_map(|(ci, c)| (0..c.requests.len()).map(move |ri| (ci, ri)))
            .collect();
        let mut picks: Vec<Vec<(usize, usize, Vec<usize>)>> = vec![Vec::new(); self.claims.len()];
        self.enumerate(&slots, 0, &mut picks)
    }

    fn enumerate(
        &self,
        slots: &[(usize, usize)],
        at: usize,
        picks: &mut Vec<Vec<(usize, usize, Vec<usize>)>>,
    ) -> bool {
        let Some(&(ci, ri)) = slots.get(at) else { return self.check(picks).is_ok() };
        let r = &self.claims[ci].requests[ri];
        for (ai, (_, e)) in r.alternatives.iter().enumerate() {
            let Mode::Count(n) = e.mode else { unreachable!() };
            for set in subsets(self.devices.len(), n as usize) {
                picks[ci].push((ri, ai, set));
                if self.enumerate(slots, at + 1, picks) {
                    return true;
                }
                picks[ci].pop();
            }
        }
        false
    }
}

/// Every `k`-subset of `0..n`, in order.
fn subsets(n: usize, k: usize) -> Vec<Vec<usize>> {
    if k == 0 {
        return vec![Vec::new()];
    }
    if n < k {
        return Vec::new();
    }
    let mut out = subsets(n - 1, k);
    for mut s in subsets(n - 1, k - 1) {
        s.push(n - 1);
        out.push(s);
    }
    out
}

/// xpu's order keeps interconnect domains whole: a one-GPU claim goes to the domain with the
/// fewest free GPUs, so a later four-GPU claim that needs one whole domain still fits; the
/// upstream order (first fit) breaks the whole domain and the second claim fails.
#[test]
fn packing_keeps_whole_domains_for_the_claims_that_follow() {
    let devices: Vec<Device> =
        (0..8).map(|i| gpu(&format!("g{i}"), if i < 4 { 1 } else { 0 })).collect();
    let slices = [slice("n1", devices)];
    let in_use = held("g7");
    let mut four = claim("big", vec![("r", exact(4))]);
    four.constraints.push(same_domain());
    for (pack, fits) in [(true, true), (false, false)] {
        let limits = Limits { pack, ..Limits::default() };
        let run = |c: &Claim, u: &InUse| {
            allocate(
                std::slice::from_ref(c),
                &classes(),
                &refs(&slices),
                u,
                "n1",
                &BTreeMap::new(),
                limits,
            )
        };
        let one = run(&claim("small", vec![("r", exact(1))]), &in_use).unwrap();
        let mut after = in_use.clone();
        after.add(&one[0]);
        assert_eq!(
            run(&four, &after).is_ok(),
            fits,
            "pack {pack}: the small claim took {:?}",
            names(&one[0])
        );
    }
}

/// `InUse::remove` undoes `InUse::add`, for whole devices and for capacity.
#[test]
fn removing_an_allocation_frees_what_adding_it_took() {
    let id = |d: &str| DeviceId { driver: "d".into(), pool: "n1".into(), device: d.into() };
    let a = Allocation {
        devices: vec![
            Allocated {
                request: "r".into(),
                id: id("g0"),
                admin_access: false,
                consumed: None,
                binding_conditions: Vec::new(),
                binding_failure_conditions: Vec::new(),
                whole_group: false,
            },
            Allocated {
                request: "r".into(),
                id: id("g1"),
                admin_access: false,
                consumed: Some(BTreeMap::from([("memory".to_owned(), 10)])),
                binding_conditions: Vec::new(),
                binding_failure_conditions: Vec::new(),
                whole_group: false,
            },
            Allocated {
                request: "r".into(),
                id: id("g2"),
                admin_access: true,
                consumed: None,
                binding_conditions: Vec::new(),
                binding_failure_conditions: Vec::new(),
                whole_group: false,
            },
        ],
    };
    let mut u = held("g5");
    let before = (u.devices.clone(), u.capacity.clone());
    u.add(&a);
    assert!(u.devices.contains(&id("g0")) && !u.devices.contains(&id("g2")));
    assert_eq!(u.capacity.get(&id("g1")).and_then(|c| c.get("memory")), Some(&10));
    u.remove(&a);
    assert_eq!((u.devices, u.capacity), before);
}

/// Devices with binding conditions are taken after every other pool's, and their conditions
/// travel into the allocation.
#[test]
fn pools_with_binding_conditions_come_last_and_their_conditions_are_copied() {
    let mut slow = slice("n1", vec![gpu("f0", 0)]);
    slow.pool = "a-fabric".into();
    slow.devices[0].binding_conditions = vec!["example.com/attached".into()];
    slow.devices[0].binding_failure_conditions = vec!["example.com/failed".into()];
    let mut local = slice("n1", vec![gpu("g0", 0)]);
    local.pool = "z-local".into();
    let slices = [slow, local];
    for pack in [false, true] {
        let limits = Limits { pack, ..Limits::default() };
        let run = |c: &Claim, u: &InUse| {
            allocate(
                std::slice::from_ref(c),
                &classes(),
                &refs(&slices),
                u,
                "n1",
                &BTreeMap::new(),
                limits,
            )
        };
        let one = claim("c", vec![("r", exact(1))]);
        let first = run(&one, &InUse::default()).unwrap();
        assert_eq!(names(&first[0]), ["g0"], "pack {pack}");
        assert!(first[0].devices[0].binding_conditions.is_empty());
        let mut used = InUse::default();
        used.add(&first[0]);
        let second = run(&one, &used).unwrap();
        assert_eq!(names(&second[0]), ["f0"], "pack {pack}");
        assert_eq!(second[0].devices[0].binding_conditions, ["example.com/attached"]);
        assert_eq!(second[0].devices[0].binding_failure_conditions, ["example.com/failed"]);
    }
}

/// A request for passthrough ([`Exact::whole_group`], or a class that asks it) takes its
/// device's whole isolation group: no device whose group-mate is held, and none of its
/// group-mates for anyone after it, in one allocation and across the cluster's.
#[test]
fn a_passthrough_request_takes_its_devices_whole_group() {
    let grouped = |name: &str, group: &str| Device { group: Some(group.into()), ..gpu(name, 0) };
    // g0 and g1 share IOMMU group 7; g2 and g3 are alone.
    let slices = [slice(
        "n1",
        vec![grouped("g0", "7"), grouped("g1", "7"), grouped("g2", "9"), grouped("g3", "11")],
    )];
    let vm = Exact { whole_group: true, ..exact(1) };
    // A VM and two containers at once: the VM never shares a group; the containers may.
    let got = run(
        &[claim("ctr", vec![("r", exact(1))]), claim("vm", vec![("r", vm.clone())])],
        &slices,
        &InUse::default(),
    )
    .unwrap();
    let (ctr, vm_dev) = (names(&got[0])[0], names(&got[1])[0]);
    assert_eq!(ctr, "g0");
    assert_eq!(vm_dev, "g2", "not g1: its group-mate g0 is a container's");
    assert!(got[1].devices[0].whole_group && !got[0].devices[0].whole_group);
    // Across allocations: the VM's group held whole keeps everyone off its mates.
    let mut in_use = InUse::default();
    let vm_first = run(&[claim("vm", vec![("r", vm.clone())])], &slices, &in_use).unwrap();
    assert_eq!(names(&vm_first[0]), ["g0"]);
    in_use.add(&vm_first[0]);
    let next = run(&[claim("c", vec![("r", exact(3))])], &slices, &in_use);
    assert!(next.is_err(), "g1 is in the VM's group: only g2 and g3 are left");
    let next = run(&[claim("c", vec![("r", exact(2))])], &slices, &in_use).unwrap();
    assert_eq!(names(&next[0]), ["g2", "g3"]);
    // A class for VMs does the same to its requests; letting go frees the group.
    let mut classes = classes();
    classes
        .insert("vm".into(), Class { name: "vm".into(), selectors: Vec::new(), whole_group: true });
    let by_class = Exact { class: "vm".into(), ..exact(1) };
    let mut held = InUse::default();
    held.add(&Allocation {
        devices: vec![Allocated { whole_group: false, ..vm_first[0].devices[0].clone() }],
    });
    let got = allocate(
        &[claim("v", vec![("r", by_class)])],
        &classes,
        &refs(&slices),
        &held,
        "n1",
        &BTreeMap::new(),
        Limits::default(),
    )
    .unwrap();
    assert_eq!(names(&got[0]), ["g2"], "g1's mate g0 is held");
    in_use.remove(&vm_first[0]);
    assert!(in_use.whole_group.is_empty());
    let all = run(&[claim("c", vec![("r", exact(4))])], &slices, &in_use).unwrap();
    assert_eq!(names(&all[0]).len(), 4);
}
