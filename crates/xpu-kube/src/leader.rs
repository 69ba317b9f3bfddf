//! Leader election on a `coordination.k8s.io/v1` Lease, as kube-scheduler does it: the holder
//! renews every `retry_period`; a candidate takes the lease once it has seen the same record
//! (holder, times, transitions) unchanged for the lease duration, with the lease's
//! `resourceVersion` as the precondition so two candidates cannot both win; a holder that
//! cannot renew within `renew_deadline` stops leading. On a clean stop the holder gives the
//! lease up so a standby takes over at once.
//!
//! Expiry is timed on this replica's own monotonic clock, from when it last saw the record
//! change, as client-go's leader election does, never from the timestamps in the record: a
//! holder whose clock runs ahead, or a damaged `renewTime` (year 2999, say), costs at most one
//! lease duration. The duration is the record's `leaseDurationSeconds`, at most this replica's
//! own (a garbage duration cannot hold it off either).

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tracing::{info, warn};

/// Timings (kube-scheduler's defaults: 15 s, 10 s, 2 s).
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

pub struct Elector {
    api: Api<Lease>,
    cfg: LeaseConfig,
    observed: std::sync::Mutex<Observed>,
}

/// Another holder's record as last read, and when this replica first saw it so.
#[derive(Default)]
struct Observed(Option<(LeaseSpec, Instant)>);

impl Observed {
    /// Whether `spec` has stood unchanged, as seen from here, for its lease duration (at most
    /// `ours`), at `now`.
    fn expired(&mut self, spec: &LeaseSpec, ours: Duration, now: Instant) -> bool {
        let since = match &self.0 {
            Some((last, at)) if last == spec => *at,
            _ => {
                self.0 = Some((spec.clone(), now));
                return false;
            }
        };
        let theirs = u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0);
        let dur = Duration::from_secs(theirs).min(ours).max(Duration::from_secs(1));
        now.saturating_duration_since(since) >= dur
    }
}

enum Try {
    Acquired,
    HeldByOther,
}

impl Elector {
    pub fn new(client: Client, cfg: LeaseConfig) -> Self {
        Self { api: Api::namespaced(client, &cfg.namespace), cfg, observed: Default::default() }
    }

    /// Waits until this candidate holds the lease.
    pub async fn acquire(&self) {
        let mut said = false;
        loop {
            match self.try_once().await {
                Ok(Try::Acquired) => {
                    info!(lease = %self.cfg.name, identity = %self.cfg.identity, "became leader");
                    return;
                }
                Ok(Try::HeldByOther) => {
                    if !said {
                        info!(lease = %self.cfg.name, "another replica leads; standing by");
                        said = true;
                    }
                }
                Err(e) => warn!(lease = %self.cfg.name, error = %e, "leader election"),
            }
            tokio::time::sleep(self.cfg.retry_period).await;
        }
    }

    /// Renews until renewal fails for longer than the renew deadline, then returns: the caller
    /// must stop acting as leader.
    pub async fn hold(&self) {
        let mut last_ok = Instant::now();
        loop {
            tokio::time::sleep(self.cfg.retry_period).await;
            match self.try_once().await {
                Ok(Try::Acquired) => last_ok = Instant::now(),
                Ok(Try::HeldByOther) => {
                    warn!(lease = %self.cfg.name, "lease taken by another replica");
                    return;
                }
                Err(e) => {
                    warn!(lease = %self.cfg.name, error = %e, "could not renew the lease");
                    if last_ok.elapsed() >= self.cfg.renew_deadline {
                        return;
                    }
                }
            }
        }
    }

    /// Gives the lease up (clean shutdown).
    pub async fn release(&self) {
        if let Ok(Some(mut l)) = self.api.get_opt(&self.cfg.name).await
            && let Some(spec) = l.spec.as_mut()
            && spec.holder_identity.as_deref() == Some(self.cfg.identity.as_str())
        {
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            if let Err(e) = self.api.replace(&self.cfg.name, &PostParams::default(), &l).await {
                warn!(lease = %self.cfg.name, error = %e, "could not release the lease");
            }
        }
    }

    /// Whether another holder's record `spec` has stood unchanged, as this replica has seen
    /// it, for its lease duration.
    fn expired(&self, spec: &LeaseSpec) -> bool {
        let mut seen = self.observed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.expired(spec, self.cfg.lease_duration, Instant::now())
    }

    async fn try_once(&self) -> Result<Try, kube::Error> {
        let now = Timestamp::now();
        let secs = i32::try_from(self.cfg.lease_duration.as_secs()).unwrap_or(i32::MAX).max(1);
        let mine = LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            lease_duration_seconds: Some(secs),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        };
        let Some(mut lease) = self.api.get_opt(&self.cfg.name).await? else {
            let l = Lease {
                metadata: ObjectMeta {
                    name: Some(self.cfg.name.clone()),
                    namespace: Some(self.cfg.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(mine),
            };
            return match self.api.create(&PostParams::default(), &l).await {
                Ok(_) => Ok(Try::Acquired),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(Try::HeldByOther),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty());
        let ours = holder == Some(self.cfg.identity.as_str());
        if !ours && holder.is_some() && !self.expired(&spec) {
            return Ok(Try::HeldByOther);
        }
        let next = if ours {
            LeaseSpec {
                acquire_time: spec.acquire_time.clone(),
                lease_transitions: spec.lease_transitions,
                ..mine
            }
        } else {
            LeaseSpec { lease_transitions: Some(spec.lease_transitions.unwrap_or(0) + 1), ..mine }
        };
        lease.spec = Some(next);
        // `replace` carries the resourceVersion we read: a concurrent writer makes it 409.
        match self.api.replace(&self.cfg.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(Try::Acquired),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(Try::HeldByOther),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(holder: &str, renew: &str, secs: i32) -> LeaseSpec {
        let t: Timestamp = renew.parse().unwrap();
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(secs),
            acquire_time: Some(MicroTime(t)),
            renew_time: Some(MicroTime(t)),
            ..LeaseSpec::default()
        }
    }

    /// A record renewed "in 2999" expires one lease duration after it was first seen, and a
    /// record that keeps changing (a live holder) never does, whatever its timestamps say.
    #[test]
    fn expiry_is_timed_from_when_the_record_last_changed_here() {
        let ours = Duration::from_secs(15);
        let t0 = Instant::now();
        let mut seen = Observed::default();
        let future = record("ghost", "2999-01-01T00:00:00Z", 15);
        assert!(!seen.expired(&future, ours, t0));
        assert!(!seen.expired(&future, ours, t0 + Duration::from_secs(14)));
        assert!(seen.expired(&future, ours, t0 + Duration::from_secs(15)));

        // A garbage duration is capped at this replica's own.
        let mut seen = Observed::default();
        let long = record("ghost", "2999-01-01T00:00:00Z", i32::MAX);
        assert!(!seen.expired(&long, ours, t0));
        assert!(seen.expired(&long, ours, t0 + ours));

        // A holder renewing (with a clock far behind) stays the holder.
        let mut seen = Observed::default();
        for i in 0..20u64 {
            let r = record("alive", &format!("1999-01-01T00:00:{i:02}Z"), 15);
            assert!(!seen.expired(&r, ours, t0 + Duration::from_secs(2 * i)));
        }
    }
}
