//! Leader election on a `coordination.k8s.io/v1` Lease, as kube-scheduler does it: the holder
//! renews `renewTime` every `retry_period`; a candidate takes the lease once `renewTime +
//! leaseDurationSeconds` has passed, with the lease's `resourceVersion` as the precondition so
//! two candidates cannot both win; a holder that cannot renew within `renew_deadline` stops
//! leading. On a clean stop the holder gives the lease up so a standby takes over at once.

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
}

enum Try {
    Acquired,
    HeldByOther,
}

impl Elector {
    pub fn new(client: Client, cfg: LeaseConfig) -> Self {
        Self { api: Api::namespaced(client, &cfg.namespace), cfg }
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
        if !ours && holder.is_some() {
            let renewed = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()).map(|t| t.0);
            let dur = i64::from(spec.lease_duration_seconds.unwrap_or(15));
            let expired = renewed.is_none_or(|r| r.as_second() + dur <= now.as_second());
            if !expired {
                return Ok(Try::HeldByOther);
            }
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
