//! `GetPreferredAllocation`: which of the available devices a container should get, so that
//! multi-device jobs land on devices that talk fast to each other.
//!
//! Preference, in order:
//! 1. every `must_include` device (the kubelet requires them in the answer);
//! 2. one NUMA node inside one interconnect domain (NVLink through NVSwitch, an XGMI hive, TPU
//!    ICI) that can hold the rest, the fullest-fitting (smallest) such group first so that big
//!    groups stay free for big requests;
//! 3. else one interconnect domain, taking its NUMA nodes with the most free devices first;
//! 4. else anything, devices sharing the anchor's domain and NUMA node first.
//!
//! The anchor is the `must_include` devices' domain and NUMA node, when they agree. Ties go to the
//! lower PCI address, so the answer is deterministic.

use std::collections::BTreeMap;

/// What the choice looks at for one device. Ids are PCI addresses, so ordering them orders ties
/// by address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate<'a> {
    pub id: &'a str,
    pub numa: Option<u32>,
    pub domain: Option<&'a str>,
}

/// Picks `size` devices from `available` (ids in `devices`), including `must_include`.
/// Unknown ids are ignored; fewer than `size` come back when not enough are available.
pub fn choose<'a>(
    devices: &[Candidate<'a>],
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<String> {
    let find = |id: &str| devices.iter().find(|d| d.id == id);
    let mut chosen: Vec<&Candidate<'a>> = Vec::new();
    for id in must_include {
        if let Some(d) = find(id)
            && !chosen.iter().any(|c| c.id == d.id)
        {
            chosen.push(d);
        }
    }
    let mut rest: Vec<&Candidate<'a>> = available
        .iter()
        .filter_map(|id| find(id))
        .filter(|d| !chosen.iter().any(|c| c.id == d.id))
        .collect();
    rest.sort_by(|a, b| a.id.cmp(b.id));
    rest.dedup_by(|a, b| a.id == b.id);
    let need = size.saturating_sub(chosen.len());
    if need > 0 {
        let same = |f: fn(&Candidate<'a>) -> Option<String>| {
            let first = chosen.first().map(|d| f(d));
            first.filter(|v| chosen.iter().all(|d| f(d) == *v)).flatten()
        };
        let anchor_domain = same(|d| d.domain.map(str::to_owned));
        let anchor_numa = same(|d| d.numa.map(|n| n.to_string()));
        let in_anchor_domain = |d: &Candidate<'_>| match &anchor_domain {
            Some(a) => d.domain == Some(a.as_str()),
            None => true,
        };
        let anchored = |d: &Candidate<'_>| match &anchor_numa {
            Some(a) => d.numa.map(|n| n.to_string()).as_ref() == Some(a),
            None => true,
        };
        chosen.extend(pick(&rest, need, &in_anchor_domain, &anchored));
    }
    chosen.iter().map(|d| d.id.to_owned()).collect()
}

fn pick<'c, 'a>(
    rest: &[&'c Candidate<'a>],
    need: usize,
    in_anchor_domain: &dyn Fn(&Candidate<'a>) -> bool,
    anchored: &dyn Fn(&Candidate<'a>) -> bool,
) -> Vec<&'c Candidate<'a>> {
    // (domain, numa) groups of candidates compatible with the anchor, in address order.
    let mut groups: BTreeMap<(Option<&str>, Option<u32>), Vec<&'c Candidate<'a>>> = BTreeMap::new();
    for d in rest.iter().filter(|d| in_anchor_domain(d) && anchored(d)) {
        groups.entry((d.domain, d.numa)).or_default().push(d);
    }
    // 2. The smallest single (domain, NUMA) group that holds everything, domain known first.
    if let Some(g) = groups
        .iter()
        .filter(|(k, g)| k.0.is_some() && g.len() >= need)
        .min_by_key(|(_, g)| g.len())
        .or_else(|| groups.iter().filter(|(_, g)| g.len() >= need).min_by_key(|(_, g)| g.len()))
    {
        return g.1[..need].to_vec();
    }
    // 3. One interconnect domain, its fullest NUMA nodes first.
    let mut domains: BTreeMap<&str, Vec<&'c Candidate<'a>>> = BTreeMap::new();
    for d in rest.iter().filter(|d| in_anchor_domain(d)) {
        if let Some(dom) = d.domain {
            domains.entry(dom).or_default().push(d);
        }
    }
    if let Some((_, members)) =
        domains.iter().filter(|(_, m)| m.len() >= need).min_by_key(|(_, m)| m.len())
    {
        let mut by_numa: BTreeMap<Option<u32>, Vec<&'c Candidate<'a>>> = BTreeMap::new();
        for d in members {
            by_numa.entry(d.numa).or_default().push(d);
        }
        let mut nodes: Vec<Vec<&'c Candidate<'a>>> = by_numa.into_values().collect();
        // Anchor's node first, then the fullest; stable, so lower NUMA ids win ties.
        nodes.sort_by_key(|n| (!n.iter().all(|d| anchored(d)), std::cmp::Reverse(n.len())));
        return nodes.into_iter().flatten().take(need).collect();
    }
    // 4. Anything, closest first.
    let mut all: Vec<&'c Candidate<'a>> = rest.to_vec();
    all.sort_by_key(|d| (!in_anchor_domain(d), !anchored(d), d.id));
    all.into_iter().take(need).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    /// Two hives of four: hive a on NUMA 0 (a0..a3), hive b split over NUMA 0 (b0, b1) and 1.
    fn devices() -> Vec<Candidate<'static>> {
        let mut v = Vec::new();
        for (id, numa, dom) in [
            ("a0", 0, "a"),
            ("a1", 0, "a"),
            ("a2", 0, "a"),
            ("a3", 0, "a"),
            ("b0", 0, "b"),
            ("b1", 0, "b"),
            ("b2", 1, "b"),
            ("b3", 1, "b"),
        ] {
            v.push(Candidate { id, numa: Some(numa), domain: Some(dom) });
        }
        v
    }

    #[test]
    fn smallest_fitting_numa_group_in_one_domain() {
        let d = devices();
        let all = ids(&["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]);
        assert_eq!(choose(&d, &all, &[], 2), ["b0", "b1"]);
        assert_eq!(choose(&d, &all, &[], 3), ["a0", "a1", "a2"]);
        // Four in one hive across NUMA nodes beats four on NUMA 0 across hives.
        assert_eq!(
            choose(&d, &ids(&["a0", "a1", "b0", "b1", "b2", "b3"]), &[], 4),
            ["b0", "b1", "b2", "b3"]
        );
    }

    #[test]
    fn must_include_anchors_the_rest() {
        let d = devices();
        let all = ids(&["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]);
        assert_eq!(choose(&d, &all, &ids(&["b2"]), 2), ["b2", "b3"]);
        assert_eq!(choose(&d, &all, &ids(&["a3"]), 3), ["a3", "a0", "a1"]);
        // The anchor's hive even when it spans NUMA nodes.
        assert_eq!(choose(&d, &all, &ids(&["b3"]), 4), ["b3", "b2", "b0", "b1"]);
    }

    #[test]
    fn falls_back_to_anything_and_never_invents() {
        let d = devices();
        assert_eq!(choose(&d, &ids(&["a0", "b2", "zz"]), &[], 2), ["a0", "b2"]);
        assert_eq!(choose(&d, &ids(&["a0"]), &[], 2), ["a0"]);
    }
}
