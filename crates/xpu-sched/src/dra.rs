//! Dynamic Resource Allocation with structured parameters, as a pure function: ResourceSlices,
//! DeviceClasses, the claims of one pod and what the cluster has allocated already in; per claim
//! the devices allocated on one node out, or why the claims do not fit there. No I/O and no
//! clock; selectors are behind [`Selector`] (the Kubernetes side compiles CEL into it), so this
//! module carries no expression engine.
//!
//! The semantics follow upstream's allocator (`k8s.io/dynamic-resource-allocation/structured`,
//! Kubernetes 1.37):
//! - **Pools**: the slices of one `(driver, pool)` with the highest generation seen; a pool
//!   with fewer such slices than its `resourceSliceCount` is *incomplete* and none of its
//!   devices is used (a request for `All` devices fails outright, as it cannot know them all);
//!   two devices of one name in a pool make it invalid, and it is not used either.
//! - **Node**: a slice offers its devices on its node, on nodes its selector matches, or on all
//!   nodes.
//! - **Requests**, in order: `exactly` (a count, or `All` matching devices), or `firstAvailable`
//!   sub-requests tried in order. A device must match its class's selectors and the request's,
//!   tolerate its taints (`NoSchedule`, `NoExecute`), and be free: not allocated in the cluster
//!   nor to an earlier request, unless the request has `adminAccess` (which allocates without
//!   taking it). Constraints (`matchAttribute`, `distinctAttribute`) hold over the devices of
//!   the requests they name (all requests when none). Partitionable devices take their
//!   `consumesCounters` from their pool's shared counter sets, which are never over-drawn; a
//!   device that allows multiple allocations gives out capacity, never more than it has.
//! - **Binding conditions**: a device's `bindingConditions` and `bindingFailureConditions` are
//!   copied into its result; pools with such devices are tried after all others.
//! - **Search**: depth first, devices in pool and slice order, backtracking when a later
//!   request cannot be met, bounded by [`Limits::steps`] so that no claim costs unbounded time.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use xpu_core::affinity::NodeSelectorTerm;

/// An attribute value (`device.attributes["domain"].name`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Value {
    Int(i64),
    Bool(bool),
    String(String),
    /// A semantic version, as written.
    Version(String),
    /// A list-type attribute (`ints`, `strings`, ...).
    List(Vec<Value>),
}

/// A taint on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTaint {
    pub key: String,
    pub value: String,
    /// `NoSchedule` or `NoExecute` (anything else is ignored, as upstream's `None` effect).
    pub effect: String,
}

/// A claim's toleration of device taints.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceToleration {
    /// Empty with `exists`: every key.
    pub key: String,
    pub exists: bool,
    pub value: String,
    /// Empty: every effect.
    pub effect: String,
}

impl DeviceToleration {
    fn tolerates(&self, t: &DeviceTaint) -> bool {
        (self.effect.is_empty() || self.effect == t.effect)
            && (self.key.is_empty() && self.exists || self.key == t.key)
            && (self.exists || self.value == t.value)
    }
}

/// One device of a slice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Device {
    pub name: String,
    /// Fully qualified names (`gpu.nvidia.com/productName`; a bare name belongs to the driver).
    pub attributes: BTreeMap<String, Value>,
    /// Capacity by name (as the slice writes it), in thousandths of the quantity's unit.
    pub capacity: BTreeMap<String, u64>,
    /// Counter set name → counter → amount this device draws when allocated.
    pub consumes: BTreeMap<String, BTreeMap<String, u64>>,
    pub taints: Vec<DeviceTaint>,
    /// Consumable capacity: the device can be allocated to several requests, each taking
    /// capacity, until it has none left.
    pub allow_multiple: bool,
    /// Where this device is available, when its slice says per device
    /// (`perDeviceNodeSelection`); `None`: the slice's scope.
    pub scope: Option<NodeScope>,
    /// Conditions that must be True in the claim's `status.devices` before a pod using the
    /// device binds (`bindingConditions`), and those that fail the binding when True
    /// (`bindingFailureConditions`); copied into the allocation.
    pub binding_conditions: Vec<String>,
    pub binding_failure_conditions: Vec<String>,
    /// The allocation pins the device to the chosen node (`bindsToNode`).
    pub binds_to_node: bool,
    /// Devices of one pool with the same group share an isolation domain (an IOMMU group): a
    /// request that takes its device's whole group ([`Exact::whole_group`], passthrough to a
    /// VM) gets no device whose group-mate anyone holds, and nobody gets a device whose
    /// group-mate such a request holds.
    pub group: Option<String>,
}

/// Where a slice's devices are available.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeScope {
    Node(String),
    /// Any term matches.
    Selector(Vec<NodeSelectorTerm>),
    AllNodes,
}

impl NodeScope {
    /// Whether the node named `node` with `labels` is in scope.
    pub fn admits(&self, node: &str, labels: &BTreeMap<String, String>) -> bool {
        match self {
            NodeScope::Node(n) => n == node,
            NodeScope::Selector(terms) => terms.iter().any(|t| t.matches(node, labels)),
            NodeScope::AllNodes => true,
        }
    }
}

/// One ResourceSlice.
#[derive(Debug, Clone, PartialEq)]
pub struct Slice {
    pub driver: String,
    pub pool: String,
    pub generation: i64,
    pub slice_count: i64,
    pub scope: NodeScope,
    pub devices: Vec<Device>,
    /// Counter set name → counter → amount available.
    pub shared_counters: BTreeMap<String, BTreeMap<String, u64>>,
}

/// A device by name: driver, pool, device.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    pub driver: String,
    pub pool: String,
    pub device: String,
}

/// A compiled device selector (CEL on the Kubernetes side). `Err` is the expression's run-time
/// error, which fails the claim with the expression named. `id` names the device (its driver
/// is `id.driver`), so an implementation may remember results per device.
pub trait Selector: Send + Sync + std::fmt::Debug {
    fn matches(&self, id: &DeviceId, device: &Device) -> Result<bool, String>;
}

/// A DeviceClass: its selectors.
#[derive(Debug, Clone, Default)]
pub struct Class {
    pub name: String,
    pub selectors: Vec<Arc<dyn Selector>>,
    /// Its requests take their devices' whole groups (a class for VMs).
    pub whole_group: bool,
}

/// How many devices a request wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Count(u32),
    All,
}

/// An `exactly` request, or one `firstAvailable` sub-request.
#[derive(Debug, Clone)]
pub struct Exact {
    pub class: String,
    pub selectors: Vec<Arc<dyn Selector>>,
    pub mode: Mode,
    pub admin_access: bool,
    pub tolerations: Vec<DeviceToleration>,
    /// Capacity asked of each device: taken from one that allows multiple allocations (a
    /// capacity not named is taken whole); on any other device a lower bound on what it has.
    pub capacity: BTreeMap<String, u64>,
    /// Takes its devices' whole groups ([`Device::group`]); so does any request of a class that
    /// does.
    pub whole_group: bool,
}

/// One request of a claim.
#[derive(Debug, Clone)]
pub struct Request {
    pub name: String,
    /// One alternative for `exactly`; the sub-requests (with their names) in order for
    /// `firstAvailable`.
    pub alternatives: Vec<(Option<String>, Exact)>,
}

/// A claim constraint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConstraintKind {
    MatchAttribute(String),
    DistinctAttribute(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Constraint {
    /// Request names it covers (a sub-request's parent name covers it); empty: all.
    pub requests: Vec<String>,
    pub kind: ConstraintKind,
}

/// A claim to allocate.
#[derive(Debug, Clone)]
pub struct Claim {
    /// `namespace/name`, for messages.
    pub name: String,
    pub requests: Vec<Request>,
    pub constraints: Vec<Constraint>,
}

/// What the cluster has allocated already.
#[derive(Debug, Clone, Default)]
pub struct InUse {
    /// Devices held whole (not through admin access).
    pub devices: HashSet<DeviceId>,
    /// Capacity given out of devices that allow multiple allocations.
    pub capacity: HashMap<DeviceId, BTreeMap<String, u64>>,
    /// Devices held with their whole group ([`Allocated::whole_group`]).
    pub whole_group: HashSet<DeviceId>,
}

impl InUse {
    /// Records an allocation result as the cluster's.
    pub fn add(&mut self, r: &Allocation) {
        for d in &r.devices {
            if d.admin_access {
                continue;
            }
            match &d.consumed {
                Some(c) => {
                    let have = self.capacity.entry(d.id.clone()).or_default();
                    for (k, v) in c {
                        let e = have.entry(k.clone()).or_default();
                        *e = e.saturating_add(*v);
                    }
                }
                None => {
                    self.devices.insert(d.id.clone());
                }
            }
            if d.whole_group {
                self.whole_group.insert(d.id.clone());
            }
        }
    }
}

impl InUse {
    /// Forgets an allocation recorded with [`InUse::add`] (the claim was deallocated).
    pub fn remove(&mut self, r: &Allocation) {
        for d in &r.devices {
            if d.admin_access {
                continue;
            }
            match &d.consumed {
                Some(c) => {
                    if let Some(have) = self.capacity.get_mut(&d.id) {
                        for (k, v) in c {
                            if let Some(e) = have.get_mut(k) {
                                *e = e.saturating_sub(*v);
                            }
                        }
                        have.retain(|_, v| *v > 0);
                        if have.is_empty() {
                            self.capacity.remove(&d.id);
                        }
                    }
                }
                None => {
                    self.devices.remove(&d.id);
                }
            }
            if d.whole_group {
                self.whole_group.remove(&d.id);
            }
        }
    }
}

/// One allocated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    /// `request` or `request/subrequest`.
    pub request: String,
    pub id: DeviceId,
    pub admin_access: bool,
    /// Capacity taken from a device that allows multiple allocations.
    pub consumed: Option<BTreeMap<String, u64>>,
    /// The device's binding conditions and binding failure conditions at allocation.
    pub binding_conditions: Vec<String>,
    pub binding_failure_conditions: Vec<String>,
    /// Held with its whole group ([`Exact::whole_group`]).
    pub whole_group: bool,
}

/// A claim's allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub devices: Vec<Allocated>,
}

/// Bounds on one allocation, and how devices are chosen.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Devices tried, over the whole search.
    pub steps: u64,
    /// Choose devices to keep topology domains whole ([`TOPOLOGY`]): among the devices that
    /// fit, those of the domain with the fewest free devices that still holds the request
    /// first, domain level by level from the finest (the claim's `matchAttribute` before
    /// all), and a capacity request on the shared device with the least left that holds it.
    /// Off: upstream's order (pools by name, devices in slice order, first fit).
    pub pack: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self { steps: 50_000, pack: true }
    }
}

/// Attributes (by their name within any domain) that group devices into interconnect or
/// locality domains, from the finest to the coarsest: PCIe roots, NUMA nodes, NVLink cliques
/// and domains (`interconnectDomain` is what xpu's DRA driver publishes). A claim's own
/// `matchAttribute` attribute groups first.
pub const TOPOLOGY: [&str; 7] =
    ["pcieRoot", "pciRoot", "numaNode", "numa", "cliqueId", "nvlinkDomain", "interconnectDomain"];

/// Why the claims do not fit on the node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unfit {
    #[error("claim {claim}, request {request}: {why}")]
    Request { claim: String, request: String, why: String },
    #[error("claim {claim}: no set of devices meets every request and constraint together")]
    Together { claim: String },
    #[error("claim {claim}, request {request}: device class {class} does not exist")]
    NoClass { claim: String, request: String, class: String },
    #[error("claim {claim}, request {request}: a selector failed: {why}")]
    Selector { claim: String, request: String, why: String },
    #[error(
        "gave up after trying {0} devices; the claims' requests and constraints are too many to search"
    )]
    Budget(u64),
}

/// A pool usable on one node.
struct Pool<'a> {
    driver: &'a str,
    pool: &'a str,
    /// Devices in slice order, with their slice.
    devices: Vec<(&'a Device, &'a Slice)>,
    /// Counters of the pool's shared counter sets, summed over its slices.
    counters: BTreeMap<(&'a str, &'a str), u64>,
    incomplete: bool,
    invalid: bool,
}

/// The pools of `slices` that offer devices on node `node` (with `labels`), sorted by driver
/// and pool name.
fn pools<'a>(slices: &[&'a Slice], node: &str, labels: &BTreeMap<String, String>) -> Vec<Pool<'a>> {
    let mut latest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for s in slices {
        let e = latest.entry((s.driver.as_str(), s.pool.as_str())).or_insert(s.generation);
        *e = (*e).max(s.generation);
    }
    let mut out: BTreeMap<(&str, &str), (Pool<'a>, i64, usize)> = BTreeMap::new();
    for &s in slices {
        let key = (s.driver.as_str(), s.pool.as_str());
        if latest.get(&key) != Some(&s.generation) {
            continue;
        }
        // As upstream: a slice counts towards its pool's completeness on the nodes it serves
        // (a slice that places each device itself serves every node).
        let per_device = s.devices.iter().any(|d| d.scope.is_some());
        if !per_device && !s.scope.admits(node, labels) {
            continue;
        }
        let entry = out.entry(key).or_insert_with(|| {
            let pool = Pool {
                driver: &s.driver,
                pool: &s.pool,
                devices: Vec::new(),
                counters: BTreeMap::new(),
                incomplete: false,
                invalid: false,
            };
            (pool, s.slice_count, 0)
        });
        entry.2 += 1;
        for (set, counters) in &s.shared_counters {
            for (name, v) in counters {
                let e = entry.0.counters.entry((set.as_str(), name.as_str())).or_default();
                *e = e.saturating_add(*v);
            }
        }
        let here = |d: &Device| d.scope.as_ref().unwrap_or(&s.scope).admits(node, labels);
        entry.0.devices.extend(s.devices.iter().filter(|d| here(d)).map(|d| (d, s)));
    }
    let mut out: Vec<Pool<'a>> = out
        .into_values()
        .filter(|(p, _, _)| !p.devices.is_empty())
        .map(|(mut p, count, seen)| {
            p.incomplete = i64::try_from(seen).unwrap_or(i64::MAX) < count;
            let mut names = HashSet::new();
            p.invalid = !p.devices.iter().all(|(d, _)| names.insert(d.name.as_str()));
            p
        })
        .collect();
    // As upstream: pools whose devices have binding conditions come after all others.
    out.sort_by_key(|p| p.binding());
    out
}

impl Pool<'_> {
    /// Whether a device of the pool has binding conditions (binding then waits on a driver).
    fn binding(&self) -> bool {
        self.devices.iter().any(|(d, _)| !d.binding_conditions.is_empty())
    }
}

/// One slot of the search: one device for one request.
struct Slot<'a> {
    claim: usize,
    request: usize,
    /// Index of this device among the request's.
    nth: u32,
    req: &'a Request,
}

/// A device taken for a request: pool index, device index, capacity taken (shareable devices).
type Taken = (usize, usize, Option<BTreeMap<String, u64>>);

/// The search's state.
struct Search<'a> {
    claims: &'a [Claim],
    classes: &'a HashMap<String, Class>,
    pools: Vec<Pool<'a>>,
    /// Each pool device's id, made once per search (the sets of devices in use are keyed by
    /// it); shared so that a method may hold ids while it changes the search.
    ids: Arc<Vec<Vec<DeviceId>>>,
    in_use: &'a InUse,
    /// Devices taken whole in this allocation.
    taken: HashSet<DeviceId>,
    /// Of those, the ones taken with their whole group.
    whole_taken: HashSet<DeviceId>,
    /// Capacity taken in this allocation.
    capacity: HashMap<DeviceId, BTreeMap<String, u64>>,
    /// Counters drawn in this allocation and by the cluster's allocations, per pool.
    drawn: HashMap<(usize, &'a str, &'a str), u64>,
    /// Per (claim, request): the alternative chosen and the devices so far.
    chosen: HashMap<(usize, usize), (usize, Vec<Taken>)>,
    steps: u64,
    limits: Limits,
    /// The first hard error met (a missing class, a failing selector).
    error: Option<Unfit>,
    /// Why the deepest request that failed found nothing.
    deepest: Option<(usize, Unfit)>,
}

/// Allocates `claims` (those of one pod not yet allocated) on node `node` with `labels`, from
/// `slices` (every slice that may serve the node: the caller may leave out other nodes'
/// node-local slices, which the allocator would skip anyway). Returns one [`Allocation`] per
/// claim, in order.
pub fn allocate(
    claims: &[Claim],
    classes: &HashMap<String, Class>,
    slices: &[&Slice],
    in_use: &InUse,
    node: &str,
    labels: &BTreeMap<String, String>,
    limits: Limits,
) -> Result<Vec<Allocation>, Unfit> {
    allocate_counted(claims, classes, slices, in_use, node, labels, limits, &mut 0)
}

/// [`allocate`], adding the devices it tried to `spent`, so that a caller trying many nodes
/// for one pod can bound the whole.
#[allow(clippy::too_many_arguments)]
pub fn allocate_counted(
    claims: &[Claim],
    classes: &HashMap<String, Class>,
    slices: &[&Slice],
    in_use: &InUse,
    node: &str,
    labels: &BTreeMap<String, String>,
    limits: Limits,
    spent: &mut u64,
) -> Result<Vec<Allocation>, Unfit> {
    let mut steps = 0;
    let r = search(claims, classes, slices, in_use, node, labels, limits, &mut steps);
    *spent = spent.saturating_add(steps);
    r
}

#[allow(clippy::too_many_arguments)]
fn search(
    claims: &[Claim],
    classes: &HashMap<String, Class>,
    slices: &[&Slice],
    in_use: &InUse,
    node: &str,
    labels: &BTreeMap<String, String>,
    limits: Limits,
    steps: &mut u64,
) -> Result<Vec<Allocation>, Unfit> {
    let pools = pools(slices, node, labels);
    let ids = pools
        .iter()
        .map(|p| {
            p.devices
                .iter()
                .map(|(d, _)| DeviceId {
                    driver: p.driver.to_owned(),
                    pool: p.pool.to_owned(),
                    device: d.name.clone(),
                })
                .collect()
        })
        .collect();
    let mut search = Search {
        claims,
        classes,
        pools,
        ids: Arc::new(ids),
        in_use,
        taken: HashSet::new(),
        whole_taken: HashSet::new(),
        capacity: HashMap::new(),
        drawn: HashMap::new(),
        chosen: HashMap::new(),
        steps: 0,
        limits,
        error: None,
        deepest: None,
    };
    search.draw_cluster_counters();
    // `All` requests are resolved up front: their count is the number of matching devices.
    let mut counts: HashMap<(usize, usize, usize), u32> = HashMap::new();
    for (ci, c) in claims.iter().enumerate() {
        for (ri, r) in c.requests.iter().enumerate() {
            for (ai, (_, exact)) in r.alternatives.iter().enumerate() {
                let n = match exact.mode {
                    Mode::Count(n) => n,
                    Mode::All => match search.count_all(ci, r, exact) {
                        Ok(n) => n,
                        // One sub-request that cannot be met leaves the others to try.
                        Err(Unfit::Request { .. }) if r.alternatives.len() > 1 => 0,
                        Err(e) => return Err(e),
                    },
                };
                counts.insert((ci, ri, ai), n);
            }
        }
    }
    let mut slots = Vec::new();
    for (ci, c) in claims.iter().enumerate() {
        for (ri, r) in c.requests.iter().enumerate() {
            // The slots of a request: as many as its first alternative wants; alternatives with
            // another count are handled by `Search::place` (the request's slots follow the
            // alternative chosen at its first slot).
            let most = (0..r.alternatives.len())
                .map(|ai| counts.get(&(ci, ri, ai)).copied().unwrap_or(0))
                .max()
                .unwrap_or(0);
            for nth in 0..most.max(1) {
                slots.push(Slot { claim: ci, request: ri, nth, req: r });
            }
        }
    }
    let placed = search.place(&slots, 0, &counts);
    *steps = search.steps;
    if placed {
        return Ok(search.results());
    }
    if let Some(e) = search.error.take() {
        return Err(e);
    }
    if search.steps >= search.limits.steps {
        return Err(Unfit::Budget(search.steps));
    }
    Err(search.deepest.map(|(_, e)| e).unwrap_or_else(|| Unfit::Together {
        claim: claims.first().map(|c| c.name.clone()).unwrap_or_default(),
    }))
}

impl<'a> Search<'a> {
    fn id(&self, pi: usize, di: usize) -> &DeviceId {
        &self.ids[pi][di]
    }

    /// Counts what the cluster's allocations draw from the pools' counters.
    fn draw_cluster_counters(&mut self) {
        for pi in 0..self.pools.len() {
            for di in 0..self.pools[pi].devices.len() {
                let id = self.id(pi, di);
                let held = self.in_use.devices.contains(id)
                    || self.in_use.capacity.get(id).is_some_and(|c| !c.is_empty());
                if held {
                    let device = self.pools[pi].devices[di].0;
                    for (set, counters) in &device.consumes {
                        for (name, v) in counters {
                            let e =
                                self.drawn.entry((pi, set.as_str(), name.as_str())).or_default();
                            *e = e.saturating_add(*v);
                        }
                    }
                }
            }
        }
    }

    /// Whether device `di` of pool `pi` is kept from a request by its group ([`Device::group`]):
    /// a group-mate is held with its whole group, or the request takes the whole group
    /// (`whole_group`) and a group-mate is held at all, by the cluster or this allocation.
    fn group_blocked(&self, pi: usize, di: usize, whole_group: bool) -> bool {
        let devices = &self.pools[pi].devices;
        let Some(group) = devices[di].0.group.as_deref() else { return false };
        devices.iter().enumerate().any(|(dj, (other, _))| {
            if dj == di || other.group.as_deref() != Some(group) {
                return false;
            }
            let id = &self.ids[pi][dj];
            let exclusive = self.in_use.whole_group.contains(id) || self.whole_taken.contains(id);
            let held =
                self.in_use.devices.contains(id) || self.taken.contains(id) || self.holds(id);
            exclusive || (whole_group && held)
        })
    }

    /// Whether `device` passes the class's and the request's selectors. A hard error is kept.
    fn selected(
        &mut self,
        ci: usize,
        r: &Request,
        exact: &Exact,
        id: &DeviceId,
        device: &Device,
    ) -> bool {
        let claim = &self.claims[ci].name;
        let Some(class) = self.classes.get(&exact.class) else {
            self.error.get_or_insert(Unfit::NoClass {
                claim: claim.clone(),
                request: r.name.clone(),
                class: exact.class.clone(),
            });
            return false;
        };
        for s in class.selectors.iter().chain(&exact.selectors) {
            match s.matches(id, device) {
                Ok(true) => {}
                Ok(false) => return false,
                Err(why) => {
                    self.error.get_or_insert(Unfit::Selector {
                        claim: claim.clone(),
                        request: r.name.clone(),
                        why,
                    });
                    return false;
                }
            }
        }
        true
    }

    fn tolerated(exact: &Exact, device: &Device) -> bool {
        device.taints.iter().all(|t| {
            !matches!(t.effect.as_str(), "NoSchedule" | "NoExecute")
                || exact.tolerations.iter().any(|tol| tol.tolerates(t))
        })
    }

    /// The number of devices an `All` request takes: every matching device on the node.
    fn count_all(&mut self, ci: usize, r: &Request, exact: &Exact) -> Result<u32, Unfit> {
        let mut n = 0u32;
        for pi in 0..self.pools.len() {
            let (driver, incomplete) = (self.pools[pi].driver, self.pools[pi].incomplete);
            for di in 0..self.pools[pi].devices.len() {
                let device = self.pools[pi].devices[di].0;
                let ids = self.ids.clone();
                let id = &ids[pi][di];
                if !self.selected(ci, r, exact, id, device) || !Self::tolerated(exact, device) {
                    continue;
                }
                if incomplete || self.pools[pi].invalid {
                    return Err(Unfit::Request {
                        claim: self.claims[ci].name.clone(),
                        request: r.name.clone(),
                        why: format!(
                            "asks for all devices, but resource pool {}/{} is being updated or invalid",
                            driver, self.pools[pi].pool
                        ),
                    });
                }
                n += 1;
            }
        }
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if n == 0 {
            return Err(Unfit::Request {
                claim: self.claims[ci].name.clone(),
                request: r.name.clone(),
                why: "asks for all devices, and none on this node matches".into(),
            });
        }
        Ok(n)
    }

    /// Capacity a request takes of a shareable device, or `None` if it does not fit.
    fn capacity_fit(
        &self,
        id: &DeviceId,
        device: &Device,
        exact: &Exact,
    ) -> Option<BTreeMap<String, u64>> {
        let mut take = BTreeMap::new();
        for (name, &total) in &device.capacity {
            let want = asked(exact, &id.driver, name).unwrap_or(total);
            let used = |m: Option<&BTreeMap<String, u64>>| {
                m.and_then(|c| c.get(name)).copied().unwrap_or(0)
            };
            let held =
                used(self.in_use.capacity.get(id)).saturating_add(used(self.capacity.get(id)));
            if held.saturating_add(want) > total {
                return None;
            }
            take.insert(name.clone(), want);
        }
        // A capacity asked for that the device does not have cannot be given.
        if exact.capacity.keys().any(|k| !has_capacity(device, &id.driver, k)) {
            return None;
        }
        Some(take)
    }

    /// Whether taking `device` keeps every counter of its pool within bounds.
    fn counters_fit(&self, pi: usize, device: &Device) -> bool {
        device.consumes.iter().all(|(set, counters)| {
            counters.iter().all(|(name, v)| {
                let have = self.pools[pi].counters.get(&(set.as_str(), name.as_str())).copied();
                let drawn =
                    self.drawn.get(&(pi, set.as_str(), name.as_str())).copied().unwrap_or(0);
                have.is_some_and(|h| drawn.saturating_add(*v) <= h)
            })
        })
    }

    fn draw(&mut self, pi: usize, device: &'a Device, sign: bool) {
        for (set, counters) in &device.consumes {
            for (name, v) in counters {
                let e = self.drawn.entry((pi, set.as_str(), name.as_str())).or_default();
                *e = if sign { e.saturating_add(*v) } else { e.saturating_sub(*v) };
            }
        }
    }

    /// Whether the claim's constraints still hold with `device` added for request `ri`.
    fn constraints_hold(&self, ci: usize, ri: usize, device: &Device, driver: &str) -> bool {
        let claim = &self.claims[ci];
        let name = &claim.requests[ri].name;
        claim.constraints.iter().all(|c| {
            if !c.requests.is_empty() && !c.requests.contains(name) {
                return true;
            }
            let attr = match &c.kind {
                ConstraintKind::MatchAttribute(a) | ConstraintKind::DistinctAttribute(a) => a,
            };
            let Some(v) = attribute(device, driver, attr) else { return false };
            let others = claim
                .requests
                .iter()
                .enumerate()
                .filter(|(_, r)| c.requests.is_empty() || c.requests.contains(&r.name));
            let mut values = others.flat_map(|(rj, _)| {
                self.chosen.get(&(ci, rj)).into_iter().flat_map(|(_, ds)| ds.iter()).map(
                    |(pi, di, _)| {
                        let (d, _) = self.pools[*pi].devices[*di];
                        attribute(d, self.pools[*pi].driver, attr)
                    },
                )
            });
            match c.kind {
                ConstraintKind::MatchAttribute(_) => values.all(|o| o == Some(v)),
                ConstraintKind::DistinctAttribute(_) => values.all(|o| o != Some(v)),
            }
        })
    }

    /// Fills `slots[at..]`; true when all are filled.
    fn place(
        &mut self,
        slots: &[Slot<'a>],
        at: usize,
        counts: &HashMap<(usize, usize, usize), u32>,
    ) -> bool {
        let Some(slot) = slots.get(at) else { return true };
        let (ci, ri) = (slot.claim, slot.request);
        // Later slots of a request follow the alternative chosen at its first slot; slots
        // beyond that alternative's count are skipped.
        let alternatives: Vec<usize> = match self.chosen.get(&(ci, ri)) {
            Some((ai, _)) if slot.nth > 0 => vec![*ai],
            _ => (0..slot.req.alternatives.len()).collect(),
        };
        for ai in alternatives {
            let want = counts.get(&(ci, ri, ai)).copied().unwrap_or(0);
            if want == 0 {
                // An `All` sub-request that nothing on this node meets.
                continue;
            }
            if slot.nth >= want {
                // This alternative needs no more devices: go on.
                if self.place(slots, at + 1, counts) {
                    return true;
                }
                continue;
            }
            let exact = &slot.req.alternatives[ai].1;
            // Whether the request takes its devices' whole groups: once, not per device tried.
            let whole_group = !exact.admin_access
                && (exact.whole_group
                    || self.classes.get(&exact.class).is_some_and(|c| c.whole_group));
            let mut tried_any = false;
            // Devices that matched and were free but broke a constraint of the claim.
            let mut constrained = false;
            let order = self.order(ci, ri, want - slot.nth);
            let ids = self.ids.clone();
            // The devices of one request are a set: after its first, each is taken after the
            // one before it in (pool, device) order, so no set is tried in every order.
            let after = match self.chosen.get(&(ci, ri)) {
                Some((_, ds)) if slot.nth > 0 => ds.last().map(|&(p, d, _)| (p, d)),
                _ => None,
            };
            {
                for (pi, di) in order {
                    if after.is_some_and(|a| (pi, di) <= a) {
                        continue;
                    }
                    self.steps += 1;
                    if self.steps >= self.limits.steps || self.error.is_some() {
                        return false;
                    }
                    let (device, _) = self.pools[pi].devices[di];
                    let driver = self.pools[pi].driver;
                    let id = &ids[pi][di];
                    if self
                        .chosen
                        .get(&(ci, ri))
                        .is_some_and(|(_, ds)| ds.iter().any(|(p, d, _)| (*p, *d) == (pi, di)))
                    {
                        continue;
                    }
                    let consumed = if exact.admin_access {
                        None
                    } else if device.allow_multiple {
                        match self.capacity_fit(id, device, exact) {
                            Some(c) => Some(c),
                            None => continue,
                        }
                    } else {
                        // A capacity asked of a device taken whole is a bound on what it has.
                        let short = exact.capacity.iter().any(|(k, want)| {
                            capacity_of(device, driver, k).is_none_or(|have| have < *want)
                        });
                        if short
                            || self.in_use.devices.contains(id)
                            || self.taken.contains(id)
                            || self.in_use.capacity.get(id).is_some_and(|c| !c.is_empty())
                            || self.capacity.get(id).is_some_and(|c| !c.is_empty())
                        {
                            continue;
                        }
                        None
                    };
                    if !Self::tolerated(exact, device)
                        || self.group_blocked(pi, di, whole_group)
                        || !self.selected(ci, slot.req, exact, id, device)
                    {
                        continue;
                    }
                    if !self.constraints_hold(ci, ri, device, driver) {
                        constrained = true;
                        continue;
                    }
                    let draws = !exact.admin_access && !self.holds(id);
                    if draws && !self.counters_fit(pi, device) {
                        continue;
                    }
                    tried_any = true;
                    // Take it.
                    if draws {
                        self.draw(pi, device, true);
                    }
                    match &consumed {
                        Some(c) => {
                            let have = self.capacity.entry(id.clone()).or_default();
                            for (k, v) in c {
                                *have.entry(k.clone()).or_default() += v;
                            }
                        }
                        None if !exact.admin_access => {
                            self.taken.insert(id.clone());
                        }
                        None => {}
                    }
                    if whole_group {
                        self.whole_taken.insert(id.clone());
                    }
                    let entry = self.chosen.entry((ci, ri)).or_insert((ai, Vec::new()));
                    entry.0 = ai;
                    entry.1.push((pi, di, consumed.clone()));
                    if self.place(slots, at + 1, counts) {
                        return true;
                    }
                    // Undo.
                    if let Some((_, ds)) = self.chosen.get_mut(&(ci, ri)) {
                        ds.pop();
                        if ds.is_empty() {
                            self.chosen.remove(&(ci, ri));
                        }
                    }
                    match &consumed {
                        Some(c) => {
                            if let Some(have) = self.capacity.get_mut(id) {
                                for (k, v) in c {
                                    if let Some(e) = have.get_mut(k) {
                                        *e = e.saturating_sub(*v);
                                    }
                                }
                                have.retain(|_, v| *v > 0);
                                if have.is_empty() {
                                    self.capacity.remove(id);
                                }
                            }
                        }
                        None => {
                            self.taken.remove(id);
                        }
                    }
                    if whole_group {
                        self.whole_taken.remove(id);
                    }
                    if draws {
                        self.draw(pi, device, false);
                    }
                    if self.steps >= self.limits.steps || self.error.is_some() {
                        return false;
                    }
                }
            }
            if !tried_any && self.deepest.as_ref().is_none_or(|(d, _)| *d < at) {
                let why = if constrained {
                    let names: Vec<String> = self.claims[ci]
                        .constraints
                        .iter()
                        .map(|c| match &c.kind {
                            ConstraintKind::MatchAttribute(a) => format!("matchAttribute {a}"),
                            ConstraintKind::DistinctAttribute(a) => {
                                format!("distinctAttribute {a}")
                            }
                        })
                        .collect();
                    format!(
                        "{} of the {want} devices it asks for can be found that also meet the claim's constraints ({})",
                        slot.nth,
                        names.join(", ")
                    )
                } else if slot.nth == 0 {
                    "no device on this node matches and is free".to_owned()
                } else {
                    format!(
                        "only {} of the {want} devices it asks for match and are free",
                        slot.nth
                    )
                };
                let e = Unfit::Request {
                    claim: self.claims[ci].name.clone(),
                    request: slot.req.name.clone(),
                    why,
                };
                self.deepest = Some((at, e));
            }
        }
        false
    }

    /// The usable devices in the order to try them for `need` more devices of claim `ci`.
    fn order(&self, ci: usize, ri: usize, need: u32) -> Vec<(usize, usize)> {
        let mut all: Vec<(usize, usize)> = Vec::new();
        for (pi, p) in self.pools.iter().enumerate() {
            if !p.incomplete && !p.invalid {
                all.extend((0..p.devices.len()).map(|di| (pi, di)));
            }
        }
        self.prune_for_match(ci, ri, need, &mut all);
        if !self.limits.pack {
            return all;
        }
        let claim = &self.claims[ci];
        let name = &claim.requests[ri].name;
        // Grouping levels: the claim's own matchAttribute first (its devices must share one
        // value), then the topology attributes from the finest domain to the coarsest.
        let matched = claim.constraints.iter().find_map(|c| match &c.kind {
            ConstraintKind::MatchAttribute(a)
                if c.requests.is_empty() || c.requests.contains(name) =>
            {
                Some(a.as_str())
            }
            _ => None,
        });
        // Each device's topology values, one pass over its attributes (by bare name).
        let topo: HashMap<(usize, usize), [Option<&'a Value>; TOPOLOGY.len()]> = all
            .iter()
            .map(|&(pi, di)| {
                let mut at = [None; TOPOLOGY.len()];
                for (k, v) in &self.pools[pi].devices[di].0.attributes {
                    let bare = k.rsplit_once('/').map_or(k.as_str(), |(_, b)| b);
                    if let Some(i) = TOPOLOGY.iter().position(|t| *t == bare) {
                        at[i].get_or_insert(v);
                    }
                }
                ((pi, di), at)
            })
            .collect();
        let mut levels: Vec<Option<usize>> = Vec::new();
        if matched.is_some() {
            levels.push(None);
        }
        for t in 0..TOPOLOGY.len() {
            if topo.values().any(|at| at[t].is_some()) {
                levels.push(Some(t));
            }
        }
        let value = |level: Option<usize>, pi: usize, di: usize| -> Option<&'a Value> {
            match level {
                Some(t) => topo.get(&(pi, di)).and_then(|at| at[t]),
                None => {
                    let d = self.pools[pi].devices[di].0;
                    matched.and_then(|a| attribute(d, self.pools[pi].driver, a))
                }
            }
        };
        let free = |pi: usize, di: usize| {
            let id = self.id(pi, di);
            !self.in_use.devices.contains(id)
                && !self.taken.contains(id)
                && !self.in_use.capacity.contains_key(id)
                && !self.capacity.contains_key(id)
        };
        let frees: Vec<bool> = all.iter().map(|&(pi, di)| free(pi, di)).collect();
        let mut free_in: Vec<HashMap<(usize, Option<&Value>), u32>> = Vec::new();
        for &level in &levels {
            let mut m: HashMap<(usize, Option<&Value>), u32> = HashMap::new();
            for (&(pi, di), &f) in all.iter().zip(&frees) {
                if f {
                    *m.entry((pi, value(level, pi, di))).or_default() += 1;
                }
            }
            free_in.push(m);
        }
        // Capacity asked of shareable devices goes best fit: a device already shared, with the
        // least left that still holds the request, before one still whole.
        let exact = claim.requests[ri].alternatives.first().map(|(_, e)| e);
        let left = |pi: usize, di: usize| -> u64 {
            let d = self.pools[pi].devices[di].0;
            let Some(e) = exact.filter(|e| d.allow_multiple && !e.capacity.is_empty()) else {
                return u64::MAX;
            };
            let id = self.id(pi, di);
            let held = |name: &str| {
                let of = |m: Option<&BTreeMap<String, u64>>| {
                    m.and_then(|c| c.get(name)).copied().unwrap_or(0)
                };
                of(self.in_use.capacity.get(id)).saturating_add(of(self.capacity.get(id)))
            };
            let mut any = false;
            let mut sum = 0u64;
            for (name, want) in &e.capacity {
                let have = capacity_of(d, &id.driver, name).unwrap_or(0);
                let name = device_key(d, &id.driver, name).unwrap_or(name);
                let h = held(name);
                any |= h > 0;
                sum = sum.saturating_add(have.saturating_sub(h).saturating_sub(*want));
            }
            if any { sum } else { u64::MAX }
        };
        // Partitionable devices (MIG) go best fit: the counter set with the least left first
        // (a partly used GPU before a whole one), and in it the placement that starts highest,
        // since the large partitions can only start low (a 4g, a 7g at slice 0; a 3g at 0 or 4).
        let partition = |pi: usize, di: usize| -> (u64, std::cmp::Reverse<i64>) {
            let d = self.pools[pi].devices[di].0;
            if d.consumes.is_empty() {
                return (u64::MAX, std::cmp::Reverse(0));
            }
            let mut left = 0u64;
            for set in d.consumes.keys() {
                for (&(s, name), have) in &self.pools[pi].counters {
                    if s == set.as_str() {
                        let drawn = self.drawn.get(&(pi, s, name)).copied().unwrap_or(0);
                        left = left.saturating_add(have.saturating_sub(drawn));
                    }
                }
            }
            let start = d.attributes.iter().find_map(|(k, v)| match v {
                Value::Int(i) if k.rsplit('/').next() == Some("placementStart") => Some(*i),
                _ => None,
            });
            (left, std::cmp::Reverse(start.unwrap_or(0)))
        };
        // Per level, domains that can hold what is still needed, smallest first; then the others.
        all.sort_by_cached_key(|&(pi, di)| {
            let per_level: Vec<(bool, u32)> = levels
                .iter()
                .zip(&free_in)
                .map(|(&level, m)| {
                    let n = m.get(&(pi, value(level, pi, di))).copied().unwrap_or(0);
                    (n < need, n)
                })
                .collect();
            (self.pools[pi].binding(), left(pi, di), partition(pi, di), per_level, pi, di)
        });
        all
    }

    /// Under a `matchAttribute` constraint that covers request `ri`, every device it still needs
    /// shares one value of the attribute: devices without it, or whose value fewer than `need`
    /// free devices have, cannot be part of a solution and are left out of the search.
    fn prune_for_match(&self, ci: usize, ri: usize, need: u32, all: &mut Vec<(usize, usize)>) {
        let claim = &self.claims[ci];
        let name = &claim.requests[ri].name;
        // Admin access may take devices in use: what is free says nothing then.
        if claim.requests[ri].alternatives.iter().any(|(_, e)| e.admin_access) {
            return;
        }
        let attrs: Vec<&str> = claim
            .constraints
            .iter()
            .filter(|c| c.requests.is_empty() || c.requests.contains(name))
            .filter_map(|c| match &c.kind {
                ConstraintKind::MatchAttribute(a) => Some(a.as_str()),
                ConstraintKind::DistinctAttribute(_) => None,
            })
            .collect();
        for a in attrs {
            let value = |pi: usize, di: usize| {
                attribute(self.pools[pi].devices[di].0, self.pools[pi].driver, a)
            };
            let mut free_by_value: HashMap<&Value, u32> = HashMap::new();
            for &(pi, di) in all.iter() {
                let id = self.id(pi, di);
                let device = self.pools[pi].devices[di].0;
                let free = device.allow_multiple
                    || !(self.in_use.devices.contains(id) || self.taken.contains(id));
                if let (true, Some(v)) = (free, value(pi, di)) {
                    *free_by_value.entry(v).or_default() += 1;
                }
            }
            all.retain(|&(pi, di)| {
                value(pi, di).is_some_and(|v| free_by_value.get(v).copied().unwrap_or(0) >= need)
            });
        }
    }

    /// Whether the device is held already in this allocation or the cluster's (its counters
    /// are drawn already: a shareable device draws once).
    fn holds(&self, id: &DeviceId) -> bool {
        self.in_use.capacity.get(id).is_some_and(|c| !c.is_empty())
            || self.capacity.get(id).is_some_and(|c| !c.is_empty())
    }

    fn results(&self) -> Vec<Allocation> {
        let mut out = Vec::with_capacity(self.claims.len());
        for (ci, c) in self.claims.iter().enumerate() {
            let mut devices = Vec::new();
            for (ri, r) in c.requests.iter().enumerate() {
                let Some((ai, ds)) = self.chosen.get(&(ci, ri)) else { continue };
                let (sub, exact) = &r.alternatives[*ai];
                let request = match sub {
                    Some(s) => format!("{}/{s}", r.name),
                    None => r.name.clone(),
                };
                for (pi, di, consumed) in ds {
                    let device = self.pools[*pi].devices[*di].0;
                    devices.push(Allocated {
                        request: request.clone(),
                        id: self.id(*pi, *di).clone(),
                        admin_access: exact.admin_access,
                        consumed: consumed.clone(),
                        binding_conditions: device.binding_conditions.clone(),
                        binding_failure_conditions: device.binding_failure_conditions.clone(),
                        whole_group: self.whole_taken.contains(self.id(*pi, *di)),
                    });
                }
            }
            out.push(Allocation { devices });
        }
        out
    }
}

/// A device's attribute by fully qualified name; a name in the driver's own domain may be
/// written bare on the device.
fn attribute<'d>(device: &'d Device, driver: &str, name: &str) -> Option<&'d Value> {
    device.attributes.get(name).or_else(|| {
        let (domain, bare) = name.split_once('/')?;
        (domain == driver).then(|| device.attributes.get(bare)).flatten()
    })
}

/// The devices of `slices` in any node's pools, by id (for checkers and the driver).
pub fn devices_by_id(slices: &[Slice]) -> BTreeMap<DeviceId, &Device> {
    slices
        .iter()
        .flat_map(|s| {
            s.devices.iter().map(move |d| {
                (
                    DeviceId {
                        driver: s.driver.clone(),
                        pool: s.pool.clone(),
                        device: d.name.clone(),
                    },
                    d,
                )
            })
        })
        .collect()
}

/// Devices named twice across allocations (a checker's test: none may be).
pub fn double_booked<'r>(allocs: impl IntoIterator<Item = &'r Allocation>) -> BTreeSet<DeviceId> {
    let mut seen = HashSet::new();
    let mut twice = BTreeSet::new();
    for a in allocs {
        for d in &a.devices {
            if !d.admin_access && d.consumed.is_none() && !seen.insert(d.id.clone()) {
                twice.insert(d.id.clone());
            }
        }
    }
    twice
}

/// A capacity name as devices are keyed: a request may name a capacity bare (`memory`), which
/// means the one of the device's own driver (`<driver>/memory`).
fn qualified(driver: &str, name: &str) -> String {
    if name.contains('/') { name.to_owned() } else { format!("{driver}/{name}") }
}

/// What `exact` asks of the device capacity `name` (qualified), however the request names it.
fn asked(exact: &Exact, driver: &str, name: &str) -> Option<u64> {
    exact.capacity.get(name).copied().or_else(|| {
        let bare = name.strip_prefix(driver)?.strip_prefix('/')?;
        exact.capacity.get(bare).copied()
    })
}

/// The device's capacity name a request's `name` (bare or qualified) stands for.
fn device_key<'d>(device: &'d Device, driver: &str, name: &str) -> Option<&'d str> {
    device
        .capacity
        .get_key_value(name)
        .or_else(|| device.capacity.get_key_value(&qualified(driver, name)))
        .map(|(k, _)| k.as_str())
}

/// The device's capacity a request names `name`.
fn capacity_of(device: &Device, driver: &str, name: &str) -> Option<u64> {
    device_key(device, driver, name).and_then(|k| device.capacity.get(k)).copied()
}

fn has_capacity(device: &Device, driver: &str, name: &str) -> bool {
    device_key(device, driver, name).is_some()
}

#[cfg(test)]
mod tests;
