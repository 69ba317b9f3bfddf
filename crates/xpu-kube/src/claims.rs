//! DRA on the scheduler's side: `resource.k8s.io/v1` ResourceSlices, DeviceClasses and
//! ResourceClaims in [`xpu_sched::dra`]'s terms, with CEL selectors compiled once per
//! expression ([`crate::cel`]), and an allocation written back as the claim's
//! `status.allocation`. Pure: objects in, terms or the field that is wrong out.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use crate::pod::Pod;
use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceSelector, DeviceToleration, ExactDeviceRequest, ResourceClaim, ResourceSlice,
};
use xpu_core::affinity::{NODE_NAME_FIELD, NodeSelectorTerm, Operator, Requirement};
use xpu_sched::dra;

use crate::cel::{self, Key, Program};

/// Capacity and counters are kept in thousandths of their quantity's unit.
const MILLI: f64 = 1000.0;

fn milli(q: &str) -> Option<u64> {
    crate::convert::quantity(q, MILLI)
}

/// A compiled CEL device selector. It remembers its result per device for one cycle
/// ([`Compiled::next_cycle`]): the same class and template selectors meet the same devices for
/// every waiting pod and every node.
#[derive(Debug)]
pub struct CelSelector {
    expression: String,
    program: Program,
    cycle: Arc<std::sync::atomic::AtomicU64>,
    memo: Mutex<(u64, Results)>,
}

/// A selector's results by device, for one cycle.
type Results = HashMap<dra::DeviceId, Result<bool, String>>;

impl dra::Selector for CelSelector {
    fn matches(&self, id: &dra::DeviceId, device: &dra::Device) -> Result<bool, String> {
        let now = self.cycle.load(std::sync::atomic::Ordering::Relaxed);
        {
            let mut memo = self.memo.lock().unwrap_or_else(PoisonError::into_inner);
            if memo.0 != now {
                *memo = (now, HashMap::new());
            }
            if let Some(r) = memo.1.get(id) {
                return r.clone();
            }
        }
        let r = self.evaluate(&id.driver, device);
        let mut memo = self.memo.lock().unwrap_or_else(PoisonError::into_inner);
        if memo.0 == now {
            memo.1.insert(id.clone(), r.clone());
        }
        r
    }
}

impl CelSelector {
    fn evaluate(&self, driver: &str, device: &dra::Device) -> Result<bool, String> {
        let value = device_value(driver, device);
        match self.program.eval(&[("device", value)]) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(format!(
                "CEL selector {:?} gave {other:?}, not a bool",
                shorten(&self.expression)
            )),
            Err(e) => Err(format!("CEL selector {:?}: {e}", shorten(&self.expression))),
        }
    }
}

/// An expression as messages quote it: at most 200 characters.
fn shorten(s: &str) -> String {
    if s.chars().count() <= 200 {
        return s.to_owned();
    }
    format!("{}...", s.chars().take(200).collect::<String>())
}

/// The CEL `device` a selector sees.
fn device_value(driver: &str, d: &dra::Device) -> cel::Value {
    let mut attrs: BTreeMap<Key, BTreeMap<Key, cel::Value>> = BTreeMap::new();
    for (name, v) in &d.attributes {
        let (domain, id) = name.split_once('/').unwrap_or((driver, name));
        attrs
            .entry(Key::String(domain.into()))
            .or_default()
            .insert(Key::String(id.into()), attr(v));
    }
    let mut caps: BTreeMap<Key, BTreeMap<Key, cel::Value>> = BTreeMap::new();
    for (name, v) in &d.capacity {
        let (domain, id) = name.split_once('/').unwrap_or((driver, name));
        let nanos = i128::from(*v) * 1_000_000;
        caps.entry(Key::String(domain.into()))
            .or_default()
            .insert(Key::String(id.into()), cel::Value::Quantity(nanos));
    }
    let domains = |m: BTreeMap<Key, BTreeMap<Key, cel::Value>>| {
        cel::Value::Domains(Arc::new(
            m.into_iter().map(|(k, v)| (k, cel::Value::Map(Arc::new(v)))).collect(),
        ))
    };
    cel::Value::Map(Arc::new(BTreeMap::from([
        (Key::String("driver".into()), cel::Value::String(driver.into())),
        (Key::String("attributes".into()), domains(attrs)),
        (Key::String("capacity".into()), domains(caps)),
        (Key::String("allowMultipleAllocations".into()), cel::Value::Bool(d.allow_multiple)),
    ])))
}

fn attr(v: &dra::Value) -> cel::Value {
    match v {
        dra::Value::Int(i) => cel::Value::Int(*i),
        dra::Value::Bool(b) => cel::Value::Bool(*b),
        dra::Value::String(s) => cel::Value::String(s.as_str().into()),
        dra::Value::Version(s) => match cel::Semver::parse(s) {
            Some(v) => cel::Value::Semver(Arc::new(v)),
            None => cel::Value::String(s.as_str().into()),
        },
        dra::Value::List(l) => cel::Value::List(Arc::new(l.iter().map(attr).collect())),
    }
}

/// Compiled selectors by expression, kept across cycles (bounded: a tenant can write many).
#[derive(Default)]
pub struct Compiled {
    cache: Mutex<HashMap<String, Result<Arc<CelSelector>, String>>>,
    /// The cycle selectors remember their results for.
    cycle: Arc<std::sync::atomic::AtomicU64>,
}

/// Expressions kept compiled at most.
const CACHE: usize = 4096;

impl Compiled {
    /// Starts a cycle: slices may have changed, so results remembered so far are dropped.
    pub fn next_cycle(&self) {
        self.cycle.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn get(&self, expression: &str) -> Result<Arc<CelSelector>, String> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = cache.get(expression) {
            return r.clone();
        }
        let r = Program::compile(expression)
            .map(|program| {
                Arc::new(CelSelector {
                    expression: expression.to_owned(),
                    program,
                    cycle: self.cycle.clone(),
                    memo: Mutex::default(),
                })
            })
            .map_err(|e| format!("CEL selector {:?} does not compile: {e}", shorten(expression)));
        if cache.len() >= CACHE {
            cache.clear();
        }
        cache.insert(expression.to_owned(), r.clone());
        r
    }

    fn selectors(
        &self,
        list: Option<&Vec<DeviceSelector>>,
        path: &str,
    ) -> Result<Vec<Arc<dyn dra::Selector>>, String> {
        let mut out: Vec<Arc<dyn dra::Selector>> = Vec::new();
        for (i, s) in list.into_iter().flatten().enumerate() {
            let Some(c) = &s.cel else { return Err(format!("{path}[{i}]: no cel selector")) };
            out.push(self.get(&c.expression).map_err(|e| format!("{path}[{i}]: {e}"))?);
        }
        Ok(out)
    }
}

pub fn node_terms(ns: &NodeSelector) -> Result<Vec<NodeSelectorTerm>, String> {
    let req = |r: &k8s_openapi::api::core::v1::NodeSelectorRequirement| {
        Ok::<_, String>(Requirement {
            key: r.key.clone(),
            operator: r.operator.parse::<Operator>()?,
            values: r.values.clone().unwrap_or_default(),
        })
    };
    ns.node_selector_terms
        .iter()
        .map(|t| {
            Ok(NodeSelectorTerm {
                match_expressions: t
                    .match_expressions
                    .iter()
                    .flatten()
                    .map(req)
                    .collect::<Result<_, _>>()?,
                match_fields: t
                    .match_fields
                    .iter()
                    .flatten()
                    .map(|r| {
                        if r.key != NODE_NAME_FIELD {
                            return Err(format!(
                                "matchFields key {:?}; only {NODE_NAME_FIELD}",
                                r.key
                            ));
                        }
                        req(r)
                    })
                    .collect::<Result<_, _>>()?,
            })
        })
        .collect()
}

fn scope(
    node: Option<&String>,
    selector: Option<&NodeSelector>,
    all: Option<bool>,
) -> Result<Option<dra::NodeScope>, String> {
    Ok(match (node, selector, all) {
        (Some(n), _, _) if !n.is_empty() => Some(dra::NodeScope::Node(n.clone())),
        (_, Some(s), _) => Some(dra::NodeScope::Selector(node_terms(s)?)),
        (_, _, Some(true)) => Some(dra::NodeScope::AllNodes),
        _ => None,
    })
}

/// A ResourceSlice. `Err` names the field.
pub fn slice(s: &ResourceSlice) -> Result<dra::Slice, String> {
    let name = s.metadata.name.as_deref().unwrap_or("");
    let at = |f: &str| format!("ResourceSlice {name}: {f}");
    let spec = &s.spec;
    let per_device = spec.per_device_node_selection == Some(true);
    let slice_scope =
        match scope(spec.node_name.as_ref(), spec.node_selector.as_ref(), spec.all_nodes)
            .map_err(|e| at(&format!("spec.nodeSelector: {e}")))?
        {
            Some(sc) => sc,
            // Per-device selection: each device says; the slice itself serves nowhere.
            None if per_device => dra::NodeScope::Selector(Vec::new()),
            None => {
                return Err(at(
                    "spec: none of nodeName, nodeSelector, allNodes, perDeviceNodeSelection",
                ));
            }
        };
    let mut devices = Vec::new();
    for (i, d) in spec.devices.iter().flatten().enumerate() {
        let mut attributes = BTreeMap::new();
        for (k, a) in d.attributes.iter().flatten() {
            let v = if let Some(i) = a.int {
                dra::Value::Int(i)
            } else if let Some(b) = a.bool {
                dra::Value::Bool(b)
            } else if let Some(s) = &a.string {
                dra::Value::String(s.clone())
            } else if let Some(v) = &a.version {
                dra::Value::Version(v.clone())
            } else if let Some(l) = &a.ints {
                dra::Value::List(l.iter().map(|i| dra::Value::Int(*i)).collect())
            } else if let Some(l) = &a.strings {
                dra::Value::List(l.iter().map(|s| dra::Value::String(s.clone())).collect())
            } else if let Some(l) = &a.bools {
                dra::Value::List(l.iter().map(|b| dra::Value::Bool(*b)).collect())
            } else if let Some(l) = &a.versions {
                dra::Value::List(l.iter().map(|s| dra::Value::Version(s.clone())).collect())
            } else {
                continue;
            };
            attributes.insert(qualified(k, &spec.driver), v);
        }
        let mut capacity = BTreeMap::new();
        for (k, c) in d.capacity.iter().flatten() {
            let v = milli(&c.value.0).ok_or_else(|| {
                at(&format!("spec.devices[{i}].capacity[{k}]: {:?} is not a quantity", c.value.0))
            })?;
            capacity.insert(qualified(k, &spec.driver), v);
        }
        let mut consumes = BTreeMap::new();
        for (j, c) in d.consumes_counters.iter().flatten().enumerate() {
            let mut m = BTreeMap::new();
            for (k, v) in &c.counters {
                let q = milli(&v.value.0).ok_or_else(|| {
                    at(&format!(
                        "spec.devices[{i}].consumesCounters[{j}].counters[{k}]: not a quantity"
                    ))
                })?;
                m.insert(k.clone(), q);
            }
            consumes.insert(c.counter_set.clone(), m);
        }
        let taints = d
            .taints
            .iter()
            .flatten()
            .map(|t| dra::DeviceTaint {
                key: t.key.clone(),
                value: t.value.clone().unwrap_or_default(),
                effect: t.effect.clone(),
            })
            .collect();
        let device_scope = if per_device {
            scope(d.node_name.as_ref(), d.node_selector.as_ref(), d.all_nodes)
                .map_err(|e| at(&format!("spec.devices[{i}].nodeSelector: {e}")))?
                .or(Some(dra::NodeScope::Selector(Vec::new())))
        } else {
            None
        };
        devices.push(dra::Device {
            name: d.name.clone(),
            attributes,
            capacity,
            consumes,
            taints,
            allow_multiple: d.allow_multiple_allocations == Some(true),
            scope: device_scope,
            binding_conditions: d.binding_conditions.clone().unwrap_or_default(),
            binding_failure_conditions: d.binding_failure_conditions.clone().unwrap_or_default(),
            binds_to_node: d.binds_to_node == Some(true),
            group: isolation_group(&spec.driver, d),
        });
    }
    let mut shared_counters = BTreeMap::new();
    for (i, set) in spec.shared_counters.iter().flatten().enumerate() {
        let mut m = BTreeMap::new();
        for (k, v) in &set.counters {
            let q = milli(&v.value.0).ok_or_else(|| {
                at(&format!("spec.sharedCounters[{i}].counters[{k}]: not a quantity"))
            })?;
            m.insert(k.clone(), q);
        }
        shared_counters.insert(set.name.clone(), m);
    }
    Ok(dra::Slice {
        driver: spec.driver.clone(),
        pool: spec.pool.name.clone(),
        generation: spec.pool.generation,
        slice_count: spec.pool.resource_slice_count,
        scope: slice_scope,
        devices,
        shared_counters,
    })
}

/// An attribute or capacity name as the allocator keys it: qualified by the driver's domain
/// when written bare.
fn qualified(name: &str, driver: &str) -> String {
    if name.contains('/') { name.to_owned() } else { format!("{driver}/{name}") }
}

/// A DeviceClass.
pub fn class(c: &DeviceClass, compiled: &Compiled) -> Result<dra::Class, String> {
    let name = c.metadata.name.clone().unwrap_or_default();
    let selectors = compiled.selectors(
        c.spec.as_ref().and_then(|s| s.selectors.as_ref()),
        &format!("DeviceClass {name}: spec.selectors"),
    )?;
    let whole_group = c
        .spec
        .as_ref()
        .and_then(|s| s.config.as_ref())
        .into_iter()
        .flatten()
        .any(|cfg| cfg.opaque.as_ref().is_some_and(passthrough));
    Ok(dra::Class { name, selectors, whole_group })
}

/// An xpu.dev device's IOMMU group, which a passthrough claim takes whole (MIG partitions
/// are never passed through: none).
fn isolation_group(driver: &str, d: &k8s_openapi::api::resource::v1::Device) -> Option<String> {
    if driver != crate::dra::DRIVER {
        return None;
    }
    let a = d.attributes.as_ref()?;
    if a.get("kind").and_then(|k| k.string.as_deref()) == Some("mig") {
        return None;
    }
    a.get("iommuGroup").and_then(|g| g.int).map(|g| g.to_string())
}

/// Whether an opaque configuration asks xpu.dev's passthrough mode (a VM takes the device
/// with its whole IOMMU group).
fn passthrough(o: &k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration) -> bool {
    o.driver == crate::dra::DRIVER
        && o.parameters.0.get("mode").and_then(serde_json::Value::as_str) == Some("passthrough")
}

/// Whether the configurations in `configs` (requests they apply to, opaque) put `request`
/// (`name` or `name/sub`) in passthrough mode.
fn passthrough_for<'c>(
    configs: impl IntoIterator<
        Item = (
            Option<&'c Vec<String>>,
            Option<&'c k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration>,
        ),
    >,
    request: &str,
) -> bool {
    let parent = request.split('/').next().unwrap_or(request);
    configs.into_iter().any(|(reqs, o)| {
        o.is_some_and(passthrough)
            && reqs.is_none_or(|r| r.is_empty() || r.iter().any(|x| x == request || x == parent))
    })
}

fn tolerations(list: Option<&Vec<DeviceToleration>>) -> Vec<dra::DeviceToleration> {
    list.into_iter()
        .flatten()
        .map(|t| dra::DeviceToleration {
            key: t.key.clone().unwrap_or_default(),
            exists: t.operator.as_deref() == Some("Exists"),
            value: t.value.clone().unwrap_or_default(),
            effect: t.effect.clone().unwrap_or_default(),
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn exact(
    class: &str,
    selectors: Option<&Vec<DeviceSelector>>,
    mode: Option<&str>,
    count: Option<i64>,
    admin: Option<bool>,
    tols: Option<&Vec<DeviceToleration>>,
    capacity: Option<&k8s_openapi::api::resource::v1::CapacityRequirements>,
    path: &str,
    compiled: &Compiled,
) -> Result<dra::Exact, String> {
    let mode = match mode.unwrap_or("ExactCount") {
        "All" => dra::Mode::All,
        "ExactCount" => {
            let n = count.unwrap_or(1);
            dra::Mode::Count(
                u32::try_from(n).ok().filter(|n| (1..=128).contains(n)).ok_or_else(|| {
                    format!("{path}.count: {n}; a request takes 1 to 128 devices")
                })?,
            )
        }
        other => return Err(format!("{path}.allocationMode: {other:?}; use ExactCount or All")),
    };
    let mut cap = BTreeMap::new();
    for (k, q) in capacity.and_then(|c| c.requests.as_ref()).into_iter().flatten() {
        let v =
            milli(&q.0).ok_or_else(|| format!("{path}.capacity.requests[{k}]: not a quantity"))?;
        cap.insert(k.clone(), v);
    }
    Ok(dra::Exact {
        class: class.to_owned(),
        selectors: compiled.selectors(selectors, &format!("{path}.selectors"))?,
        mode,
        admin_access: admin == Some(true),
        tolerations: tolerations(tols),
        capacity: cap,
        whole_group: false,
    })
}

/// A ResourceClaim's requests and constraints. `Err` names the field (a selector that does not
/// compile among them).
pub fn claim(c: &ResourceClaim, compiled: &Compiled) -> Result<dra::Claim, String> {
    let name = format!(
        "{}/{}",
        c.metadata.namespace.as_deref().unwrap_or("default"),
        c.metadata.name.as_deref().unwrap_or("")
    );
    let devices = &c.spec.as_ref().and_then(|s| s.devices.clone());
    let mut requests = Vec::new();
    for (i, r) in
        devices.as_ref().and_then(|d| d.requests.as_ref()).into_iter().flatten().enumerate()
    {
        let path = format!("ResourceClaim {name}: spec.devices.requests[{i}]");
        let alternatives = match (&r.exactly, &r.first_available) {
            (Some(e), _) => {
                let ExactDeviceRequest {
                    device_class_name,
                    selectors,
                    allocation_mode,
                    count,
                    admin_access,
                    tolerations,
                    capacity,
                    ..
                } = e;
                let p = format!("{path}.exactly");
                vec![(
                    None,
                    exact(
                        device_class_name,
                        selectors.as_ref(),
                        allocation_mode.as_deref(),
                        *count,
                        *admin_access,
                        tolerations.as_ref(),
                        capacity.as_ref(),
                        &p,
                        compiled,
                    )?,
                )]
            }
            (None, Some(subs)) if !subs.is_empty() => subs
                .iter()
                .enumerate()
                .map(|(j, s)| {
                    let p = format!("{path}.firstAvailable[{j}]");
                    Ok((
                        Some(s.name.clone()),
                        exact(
                            &s.device_class_name,
                            s.selectors.as_ref(),
                            s.allocation_mode.as_deref(),
                            s.count,
                            None,
                            s.tolerations.as_ref(),
                            s.capacity.as_ref(),
                            &p,
                            compiled,
                        )?,
                    ))
                })
                .collect::<Result<_, String>>()?,
            _ => return Err(format!("{path}: neither exactly nor firstAvailable")),
        };
        // A request the claim configures for passthrough takes its devices' whole groups.
        let configs = devices
            .as_ref()
            .and_then(|d| d.config.as_ref())
            .into_iter()
            .flatten()
            .map(|c| (c.requests.as_ref(), c.opaque.as_ref()));
        let mut alternatives = alternatives;
        for (sub, e) in &mut alternatives {
            let name = match sub {
                Some(s) => format!("{}/{s}", r.name),
                None => r.name.clone(),
            };
            e.whole_group = passthrough_for(configs.clone(), &name);
        }
        requests.push(dra::Request { name: r.name.clone(), alternatives });
    }
    let mut constraints = Vec::new();
    for (i, k) in
        devices.as_ref().and_then(|d| d.constraints.as_ref()).into_iter().flatten().enumerate()
    {
        let kind = match (&k.match_attribute, &k.distinct_attribute) {
            (Some(a), None) => dra::ConstraintKind::MatchAttribute(a.clone()),
            (None, Some(a)) => dra::ConstraintKind::DistinctAttribute(a.clone()),
            _ => {
                return Err(format!(
                    "ResourceClaim {name}: spec.devices.constraints[{i}]: one of matchAttribute, distinctAttribute"
                ));
            }
        };
        constraints
            .push(dra::Constraint { requests: k.requests.clone().unwrap_or_default(), kind });
    }
    Ok(dra::Claim { name, requests, constraints })
}

/// What every allocated claim of the cluster holds.
pub fn in_use<'a>(claims: impl IntoIterator<Item = &'a ResourceClaim>) -> dra::InUse {
    let mut out = dra::InUse::default();
    for a in claims.into_iter().filter_map(allocation) {
        out.add(&a);
    }
    out
}

/// The devices a claim's `status.allocation` holds, if it is allocated.
pub fn allocation(c: &ResourceClaim) -> Option<dra::Allocation> {
    let allocated = c.status.as_ref()?.allocation.as_ref()?.devices.as_ref()?;
    let results = allocated.results.as_ref()?;
    // Class configs come before the claim's here: a passthrough one holds whole groups.
    let configs = allocated.config.as_deref().unwrap_or_default();
    let devices = results
        .iter()
        .map(|r| dra::Allocated {
            request: r.request.clone(),
            id: dra::DeviceId {
                driver: r.driver.clone(),
                pool: r.pool.clone(),
                device: r.device.clone(),
            },
            admin_access: r.admin_access == Some(true),
            // Keyed as the allocator keys devices' capacity: qualified by the driver.
            consumed: r.consumed_capacity.as_ref().map(|m| {
                m.iter()
                    .filter_map(|(k, q)| Some((qualified(k, &r.driver), milli(&q.0)?)))
                    .collect()
            }),
            binding_conditions: r.binding_conditions.clone().unwrap_or_default(),
            binding_failure_conditions: r.binding_failure_conditions.clone().unwrap_or_default(),
            whole_group: passthrough_for(
                configs.iter().map(|c| (c.requests.as_ref(), c.opaque.as_ref())),
                &r.request,
            ),
        })
        .collect();
    Some(dra::Allocation { devices })
}

/// The cluster's ResourceClaims as a cycle reads them (by namespace and name) and what the
/// allocated ones hold ([`in_use`]), kept from one cycle to the next: [`ClaimBook::update`]
/// reads only the claims written since the last (by `resourceVersion`) and takes out those
/// gone, so a cycle costs what changed, not every claim of the cluster. Devices are counted by
/// the claims holding them, so that one claim let go never frees a device another still holds.
/// Equals [`in_use`] over every claim after every event
/// (`tests::the_claim_book_equals_a_rebuild_after_every_event`; capacity consumed down to 0 may
/// stay listed as 0, which is what an absent entry means).
#[derive(Debug, Default)]
pub struct ClaimBook {
    by_key: HashMap<(String, String), Arc<ResourceClaim>>,
    /// By uid (or `namespace/name` for a claim without one).
    entries: HashMap<String, ClaimEntry>,
    in_use: dra::InUse,
    /// Per device, the claims holding it whole, and those holding capacity of it.
    whole: HashMap<dra::DeviceId, u32>,
    shared: HashMap<dra::DeviceId, u32>,
    round: u64,
}

#[derive(Debug)]
struct ClaimEntry {
    /// `None`: read again on every update.
    version: Option<String>,
    key: (String, String),
    allocation: Option<dra::Allocation>,
    /// `status.allocation` is set (even with no device results).
    allocated: bool,
    seen: u64,
}

impl ClaimBook {
    /// Brings the book up to `claims`, every claim of the cluster.
    pub fn update(&mut self, claims: &[Arc<ResourceClaim>]) {
        self.round += 1;
        let round = self.round;
        for c in claims {
            let (Some(ns), Some(name)) =
                (c.metadata.namespace.as_deref(), c.metadata.name.as_deref())
            else {
                continue;
            };
            let version = c.metadata.resource_version.as_deref();
            let id = match c.metadata.uid.as_deref() {
                Some(u) => std::borrow::Cow::Borrowed(u),
                None => std::borrow::Cow::Owned(format!("{ns}/{name}")),
            };
            if let Some(e) = self.entries.get_mut(id.as_ref())
                && version.is_some()
                && e.version.as_deref() == version
            {
                e.seen = round;
                continue;
            }
            self.forget(id.as_ref());
            let allocation = allocation(c);
            if let Some(a) = &allocation {
                self.hold(a);
            }
            let key = (ns.to_owned(), name.to_owned());
            self.by_key.insert(key.clone(), c.clone());
            let version = version.map(str::to_owned);
            let allocated = c.status.as_ref().is_some_and(|s| s.allocation.is_some());
            let e = ClaimEntry { version, key, allocation, allocated, seen: round };
            self.entries.insert(id.into_owned(), e);
        }
        let gone: Vec<String> =
            self.entries.iter().filter(|(_, e)| e.seen != round).map(|(k, _)| k.clone()).collect();
        for id in gone {
            self.forget(&id);
        }
    }

    /// Takes a claim out of the book.
    fn forget(&mut self, id: &str) {
        let Some(e) = self.entries.remove(id) else { return };
        if let Some(a) = &e.allocation {
            self.let_go(a);
        }
        // Its name may name a newer claim by now (deleted and made again).
        let same = |c: &Arc<ResourceClaim>| match c.metadata.uid.as_deref() {
            Some(u) => u == id,
            None => id.split_once('/') == Some((e.key.0.as_str(), e.key.1.as_str())),
        };
        if self.by_key.get(&e.key).is_some_and(same) {
            self.by_key.remove(&e.key);
        }
    }

    /// Counts what allocation `a` holds as in use (an allocated claim, or one a cycle is
    /// writing: [`ClaimBook::let_go`] takes it out again).
    pub fn hold(&mut self, a: &dra::Allocation) {
        for d in a.devices.iter().filter(|d| !d.admin_access) {
            let counts = if d.consumed.is_some() { &mut self.shared } else { &mut self.whole };
            *counts.entry(d.id.clone()).or_default() += 1;
        }
        self.in_use.add(a);
    }

    /// Takes out what [`ClaimBook::hold`] counted for `a`.
    pub fn let_go(&mut self, a: &dra::Allocation) {
        for d in a.devices.iter().filter(|d| !d.admin_access) {
            match &d.consumed {
                Some(c) => {
                    let last = release(&mut self.shared, &d.id);
                    if last {
                        self.in_use.capacity.remove(&d.id);
                    } else if let Some(have) = self.in_use.capacity.get_mut(&d.id) {
                        for (k, v) in c {
                            if let Some(x) = have.get_mut(k) {
                                *x = x.saturating_sub(*v);
                            }
                        }
                    }
                }
                None => {
                    if release(&mut self.whole, &d.id) {
                        self.in_use.devices.remove(&d.id);
                        self.in_use.whole_group.remove(&d.id);
                    }
                }
            }
        }
    }

    /// Claims by namespace and name.
    pub fn claims(&self) -> &HashMap<(String, String), Arc<ResourceClaim>> {
        &self.by_key
    }

    /// What the allocated claims (and those held with [`ClaimBook::hold`]) hold.
    pub fn in_use(&self) -> &dra::InUse {
        &self.in_use
    }

    /// Whether the claim with this uid is in the book, allocated (`Some(true)`) or not.
    pub fn allocated(&self, uid: &str) -> Option<bool> {
        self.entries.get(uid).map(|e| e.allocated)
    }
}

/// One claim fewer holding `id`; whether it was the last.
fn release(counts: &mut HashMap<dra::DeviceId, u32>, id: &dra::DeviceId) -> bool {
    match counts.get_mut(id) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        Some(_) => {
            counts.remove(id);
            true
        }
        None => false,
    }
}

/// How long a claim allocated with binding conditions may wait for them, from its
/// `allocationTimestamp` (kube-scheduler's `DynamicResourcesArgs.bindingTimeout` default).
pub const BINDING_TIMEOUT_SECS: i64 = 600;

/// Where an allocated claim stands with its devices' binding conditions (KEP-5007): a pod
/// using it binds only once every `bindingConditions` entry is True in the claim's
/// `status.devices` for that device; a True `bindingFailureConditions` entry, or the timeout
/// passing, fails the allocation, which is then taken back so that it can be made again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    Ready,
    Waiting(String),
    Failed(String),
}

/// [`Binding`] of claim `c` at `unix_now` (seconds).
pub fn binding_state(c: &ResourceClaim, unix_now: i64) -> Binding {
    let Some(status) = c.status.as_ref() else { return Binding::Ready };
    let Some(alloc) = status.allocation.as_ref() else { return Binding::Ready };
    let results = alloc.devices.as_ref().and_then(|d| d.results.as_ref());
    let mut waiting = Vec::new();
    for r in results.into_iter().flatten() {
        let wanted = r.binding_conditions.as_deref().unwrap_or_default();
        if wanted.is_empty() {
            continue;
        }
        let device = format!("{}/{}/{}", r.driver, r.pool, r.device);
        let conditions = status
            .devices
            .iter()
            .flatten()
            .find(|d| d.driver == r.driver && d.pool == r.pool && d.device == r.device)
            .and_then(|d| d.conditions.as_deref())
            .unwrap_or_default();
        let is_true = |t: &str| conditions.iter().any(|c| c.type_ == t && c.status == "True");
        if let Some(f) = r.binding_failure_conditions.iter().flatten().find(|f| is_true(f.as_str()))
        {
            return Binding::Failed(format!(
                "device {device}: binding failure condition {f} is True"
            ));
        }
        waiting.extend(
            wanted.iter().filter(|w| !is_true(w.as_str())).map(|w| format!("{device} {w}")),
        );
    }
    if waiting.is_empty() {
        return Binding::Ready;
    }
    let since = alloc.allocation_timestamp.as_ref().map(|t| t.0.as_second());
    if since.is_some_and(|t| unix_now.saturating_sub(t) > BINDING_TIMEOUT_SECS) {
        return Binding::Failed(format!(
            "binding conditions not True within {BINDING_TIMEOUT_SECS} s of the allocation: {}",
            waiting.join(", ")
        ));
    }
    Binding::Waiting(format!("binding conditions not True yet: {}", waiting.join(", ")))
}

/// The names of the ResourceClaims a pod uses, in `spec.resourceClaims` order: the claim it
/// names, or the one made from its template (`status.resourceClaimStatuses`). `Err` for a
/// template whose claim does not exist yet.
pub fn pod_claims(p: &Pod) -> Result<Vec<String>, String> {
    let Some(spec) = p.spec.as_ref() else { return Ok(Vec::new()) };
    let made: HashMap<&str, Option<&String>> = p
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .map(|s| (s.name.as_str(), s.resource_claim_name.as_ref()))
        .collect();
    let mut out = Vec::new();
    for c in spec.resource_claims.iter().flatten() {
        if let Some(n) = &c.resource_claim_name {
            out.push(n.clone());
        } else if c.resource_claim_template_name.is_some() {
            match made.get(c.name.as_str()) {
                Some(Some(n)) => out.push((*n).clone()),
                Some(None) => {}
                None => {
                    return Err(format!(
                        "waiting for the ResourceClaim of spec.resourceClaims[{}] to be made from its template",
                        c.name
                    ));
                }
            }
        }
    }
    Ok(out)
}

/// The claim's `status.allocation` for allocation `a` made on `node`, as JSON for a patch.
/// The node selector pins node-local devices to the node (as kube-scheduler writes it).
pub fn allocation_json(
    a: &dra::Allocation,
    claim: &ResourceClaim,
    classes: &HashMap<String, DeviceClass>,
    node: &str,
) -> serde_json::Value {
    let results: Vec<serde_json::Value> = a
        .devices
        .iter()
        .map(|d| {
            let mut r = serde_json::json!({
                "request": d.request,
                "driver": d.id.driver,
                "pool": d.id.pool,
                "device": d.id.device,
            });
            if d.admin_access {
                r["adminAccess"] = true.into();
            }
            if let Some(c) = &d.consumed {
                // Named as the driver publishes them (bare in its own domain), as kube-scheduler
                // writes them; whole units where the amount is whole.
                let own = format!("{}/", d.id.driver);
                let m: serde_json::Map<String, serde_json::Value> = c
                    .iter()
                    .map(|(k, v)| {
                        let k = k.strip_prefix(&own).unwrap_or(k).to_owned();
                        let q =
                            if v % 1000 == 0 { (v / 1000).to_string() } else { format!("{v}m") };
                        (k, q.into())
                    })
                    .collect();
                r["consumedCapacity"] = m.into();
            }
            if !d.binding_conditions.is_empty() {
                r["bindingConditions"] = serde_json::json!(d.binding_conditions);
            }
            if !d.binding_failure_conditions.is_empty() {
                r["bindingFailureConditions"] = serde_json::json!(d.binding_failure_conditions);
            }
            r
        })
        .collect();
    // Class configuration first, then the claim's, each for the requests it names.
    let mut config = Vec::new();
    let spec_devices = claim.spec.as_ref().and_then(|s| s.devices.as_ref());
    let requests = spec_devices.and_then(|d| d.requests.as_ref());
    let mut class_names: Vec<&str> = requests
        .into_iter()
        .flatten()
        .flat_map(|r| {
            r.exactly
                .iter()
                .map(|e| e.device_class_name.as_str())
                .chain(r.first_available.iter().flatten().map(|s| s.device_class_name.as_str()))
        })
        .collect();
    class_names.dedup();
    for name in class_names {
        let class_config =
            classes.get(name).and_then(|c| c.spec.as_ref()).and_then(|s| s.config.as_ref());
        for c in class_config.into_iter().flatten() {
            if let Some(o) = &c.opaque {
                config.push(serde_json::json!({ "source": "FromClass", "opaque": o }));
            }
        }
    }
    for c in spec_devices.and_then(|d| d.config.as_ref()).into_iter().flatten() {
        if let Some(o) = &c.opaque {
            let mut v = serde_json::json!({ "source": "FromClaim", "opaque": o });
            if let Some(r) = &c.requests {
                v["requests"] = serde_json::json!(r);
            }
            config.push(v);
        }
    }
    let mut devices = serde_json::json!({ "results": results });
    if !config.is_empty() {
        devices["config"] = config.into();
    }
    serde_json::json!({
        "devices": devices,
        "nodeSelector": { "nodeSelectorTerms": [{ "matchFields": [
            { "key": NODE_NAME_FIELD, "operator": "In", "values": [node] }
        ] }] },
        "allocationTimestamp": k8s_openapi::jiff::Timestamp::now().to_string(),
    })
}

/// Slices with the taints of `DeviceTaintRule`s added to the devices each rule selects (its
/// `deviceSelector`: driver, pool and device, each optional; none selects every device).
/// Slices no rule touches are shared, not copied.
pub fn with_taint_rules(
    slices: Vec<Arc<dra::Slice>>,
    rules: &[Arc<k8s_openapi::api::resource::v1::DeviceTaintRule>],
) -> Vec<Arc<dra::Slice>> {
    if rules.is_empty() {
        return slices;
    }
    let selects = |r: &k8s_openapi::api::resource::v1::DeviceTaintRule, s: &dra::Slice, d: &str| {
        let sel = r.spec.device_selector.as_ref();
        sel.and_then(|x| x.driver.as_deref()).is_none_or(|v| v == s.driver)
            && sel.and_then(|x| x.pool.as_deref()).is_none_or(|v| v == s.pool)
            && sel.and_then(|x| x.device.as_deref()).is_none_or(|v| v == d)
    };
    slices
        .into_iter()
        .map(|s| {
            let hit = s.devices.iter().any(|d| rules.iter().any(|r| selects(r, &s, &d.name)));
            if !hit {
                return s;
            }
            let mut copy = (*s).clone();
            for d in &mut copy.devices {
                for r in rules.iter().filter(|r| selects(r, &s, &d.name)) {
                    let t = &r.spec.taint;
                    d.taints.push(dra::DeviceTaint {
                        key: t.key.clone(),
                        value: t.value.clone().unwrap_or_default(),
                        effect: t.effect.clone(),
                    });
                }
            }
            Arc::new(copy)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(conditions: serde_json::Value, allocated_at: &str) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": { "name": "c", "namespace": "ns" },
            "spec": {},
            "status": {
                "allocation": { "allocationTimestamp": allocated_at, "devices": { "results": [
                    { "request": "r", "driver": "d", "pool": "p", "device": "x",
                      "bindingConditions": ["attached"], "bindingFailureConditions": ["failed"] },
                    { "request": "r", "driver": "d", "pool": "p", "device": "plain" } ] } },
                "devices": [{ "driver": "d", "pool": "p", "device": "x", "conditions": conditions }]
            }
        }))
        .unwrap()
    }

    fn cond(ty: &str, status: &str) -> serde_json::Value {
        json!({ "type": ty, "status": status, "reason": "R", "message": "",
                "lastTransitionTime": "2026-11-28T00:00:00Z" })
    }

    /// Waiting until every binding condition is True, failed on a True failure condition (even
    /// with the binding conditions True) or once the timeout has passed since the allocation.
    #[test]
    fn binding_waits_for_conditions_fails_on_failure_or_timeout() {
        let at = "2026-11-28T00:00:00Z";
        let t0 = k8s_openapi::jiff::Timestamp::from_second(1_795_824_000).unwrap();
        assert_eq!(t0.to_string(), at);
        let now = t0.as_second() + 10;
        assert!(
            matches!(binding_state(&claim(json!([]), at), now), Binding::Waiting(w) if w.contains("d/p/x attached"))
        );
        let false_ = json!([cond("attached", "False")]);
        assert!(matches!(binding_state(&claim(false_.clone(), at), now), Binding::Waiting(_)));
        assert_eq!(
            binding_state(&claim(json!([cond("attached", "True")]), at), now),
            Binding::Ready
        );
        let both = json!([cond("attached", "True"), cond("failed", "True")]);
        assert!(
            matches!(binding_state(&claim(both, at), now), Binding::Failed(w) if w.contains("failed is True"))
        );
        let late = t0.as_second() + BINDING_TIMEOUT_SECS + 1;
        assert!(
            matches!(binding_state(&claim(false_, at), late), Binding::Failed(w) if w.contains("within 600 s"))
        );
    }

    /// The claim book kept across cycles equals a rebuild from every claim after every event
    /// of random sequences: claims made, allocated (whole devices, capacity, admin access; two
    /// claims on one device among them), let go, written unchanged, deleted and made again
    /// under the same name, and allocations held for a cycle and let go.
    #[test]
    fn the_claim_book_equals_a_rebuild_after_every_event() {
        fn normal(u: &dra::InUse) -> (Vec<String>, Vec<String>) {
            let mut d: Vec<String> = u.devices.iter().map(|x| format!("{x:?}")).collect();
            d.sort_unstable();
            let mut c: Vec<String> = u
                .capacity
                .iter()
                .map(|(k, v)| {
                    let v: Vec<_> = v.iter().filter(|(_, n)| **n > 0).collect();
                    format!("{k:?} {v:?}")
                })
                .collect();
            c.sort_unstable();
            (d, c)
        }
        for seed in 0..24u64 {
            let mut rng = xpu_sched::rng::Rng::new(seed);
            let mut book = ClaimBook::default();
            let mut claims: Vec<Arc<ResourceClaim>> = Vec::new();
            let (mut version, mut made) = (0u64, 0u64);
            let mut held: Vec<dra::Allocation> = Vec::new();
            for step in 0..120 {
                version += 1;
                let results = |rng: &mut xpu_sched::rng::Rng| {
                    let n = 1 + rng.index(2);
                    (0..n)
                        .map(|_| {
                            let mut r = json!({ "request": "r", "driver": "d", "pool": "p",
                                                "device": format!("g{}", rng.index(4)) });
                            match rng.index(4) {
                                0 => {
                                    r["consumedCapacity"] =
                                        json!({ "memory": format!("{}Gi", rng.index(3)) })
                                }
                                1 => r["adminAccess"] = json!(true),
                                _ => {}
                            }
                            r
                        })
                        .collect::<Vec<_>>()
                };
                match rng.index(7) {
                    0 | 1 => {
                        made += 1;
                        let name = format!("c{}", rng.index(6));
                        claims.retain(|c| c.metadata.name.as_deref() != Some(name.as_str()));
                        let status = if rng.below(2) == 0 {
                            json!({ "allocation": { "devices": { "results": results(&mut rng) } } })
                        } else {
                            json!({})
                        };
                        claims.push(Arc::new(
                            serde_json::from_value(json!({
                                "metadata": { "name": name, "namespace": "ns", "uid": format!("u{made}"),
                                              "resourceVersion": version.to_string() },
                                "spec": {}, "status": status }))
                            .unwrap(),
                        ));
                    }
                    2 | 3 if !claims.is_empty() => {
                        let k = rng.index(claims.len());
                        let mut c = (*claims[k]).clone();
                        let status = match rng.index(3) {
                            0 => {
                                json!({ "allocation": { "devices": { "results": results(&mut rng) } } })
                            }
                            1 => json!({}),
                            _ => serde_json::to_value(&c.status).unwrap(),
                        };
                        c.status = serde_json::from_value(status).unwrap();
                        c.metadata.resource_version = Some(version.to_string());
                        claims[k] = Arc::new(c);
                    }
                    4 if !claims.is_empty() => {
                        claims.remove(rng.index(claims.len()));
                    }
                    5 => {
                        let c: ResourceClaim = serde_json::from_value(json!({
                            "metadata": { "name": "x", "namespace": "ns" }, "spec": {},
                            "status": { "allocation": { "devices": { "results": results(&mut rng) } } } }))
                        .unwrap();
                        held.push(allocation(&c).unwrap());
                    }
                    _ => {}
                }
                book.update(&claims);
                for a in &held {
                    book.hold(a);
                }
                let mut fresh = in_use(claims.iter().map(|c| c.as_ref()));
                for a in &held {
                    fresh.add(a);
                }
                assert_eq!(normal(book.in_use()), normal(&fresh), "seed {seed} step {step}");
                let mut keys: Vec<_> = book
                    .claims()
                    .iter()
                    .map(|(k, c)| (k.clone(), c.metadata.uid.clone()))
                    .collect();
                keys.sort();
                let mut want: Vec<_> = claims
                    .iter()
                    .map(|c| {
                        let key = (
                            c.metadata.namespace.clone().unwrap(),
                            c.metadata.name.clone().unwrap(),
                        );
                        (key, c.metadata.uid.clone())
                    })
                    .collect();
                want.sort();
                assert_eq!(keys, want, "seed {seed} step {step}");
                for a in &held {
                    book.let_go(a);
                }
                if rng.below(3) == 0 {
                    held.clear();
                }
            }
        }
    }

    /// What says a request takes its devices' whole IOMMU groups reaches the allocator: a
    /// class whose config asks passthrough, a claim's config for some of its requests, the
    /// config in an allocation's status; and an xpu.dev device's `iommuGroup` is its group (a
    /// MIG partition's and another driver's are not).
    #[test]
    fn passthrough_configs_and_iommu_groups_reach_the_allocator() {
        let pass = json!({ "driver": "xpu.dev", "parameters": {
            "apiVersion": "xpu.dev/v1", "kind": "DeviceConfig", "mode": "passthrough" } });
        let compiled = Compiled::default();
        let vm_class: DeviceClass = serde_json::from_value(json!({
            "metadata": { "name": "passthrough.xpu.dev" },
            "spec": { "config": [{ "opaque": pass }] } }))
        .unwrap();
        assert!(class(&vm_class, &compiled).unwrap().whole_group);
        let plain: DeviceClass =
            serde_json::from_value(json!({ "metadata": { "name": "gpu.xpu.dev" }, "spec": {} }))
                .unwrap();
        assert!(!class(&plain, &compiled).unwrap().whole_group);
        let c: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "name": "c", "namespace": "ns" },
            "spec": { "devices": {
                "requests": [
                    { "name": "vm", "exactly": { "deviceClassName": "gpu.xpu.dev" } },
                    { "name": "ctr", "exactly": { "deviceClassName": "gpu.xpu.dev" } }],
                "config": [{ "requests": ["vm"], "opaque": pass }] } },
            "status": { "allocation": { "devices": {
                "results": [
                    { "request": "vm", "driver": "xpu.dev", "pool": "n", "device": "gpu-a" },
                    { "request": "ctr", "driver": "xpu.dev", "pool": "n", "device": "gpu-b" }],
                "config": [{ "source": "FromClaim", "requests": ["vm"], "opaque": pass }] } } },
        }))
        .unwrap();
        let converted = super::claim(&c, &compiled).unwrap();
        let whole: Vec<bool> =
            converted.requests.iter().map(|r| r.alternatives[0].1.whole_group).collect();
        assert_eq!(whole, [true, false]);
        let held: Vec<bool> =
            allocation(&c).unwrap().devices.iter().map(|d| d.whole_group).collect();
        assert_eq!(held, [true, false]);
        let s: ResourceSlice = serde_json::from_value(json!({
            "metadata": { "name": "s" },
            "spec": { "driver": "xpu.dev", "nodeName": "n",
                "pool": { "name": "n", "generation": 1, "resourceSliceCount": 1 },
                "devices": [
                    { "name": "gpu-a", "attributes": { "iommuGroup": { "int": 7 }, "kind": { "string": "gpu" } } },
                    { "name": "gpu-a-mig", "attributes": { "iommuGroup": { "int": 7 }, "kind": { "string": "mig" } } },
                    { "name": "gpu-c" }] } }))
        .unwrap();
        let groups: Vec<Option<String>> =
            slice(&s).unwrap().devices.into_iter().map(|d| d.group).collect();
        assert_eq!(groups, [Some("7".to_owned()), None, None]);
    }
}
