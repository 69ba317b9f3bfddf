//! What the scheduler tells the API server about pods it does not bind (`PodScheduled=False`
//! and `FailedScheduling` Events, node and pod warnings), written off the scheduling loop.
//!
//! The loop hands each write to [`Writer`] and goes on: binding never waits for a status
//! patch. Writes wait in one bounded table, coalesced per pod (a newer reason replaces one not
//! yet written), and a few workers carry them out oldest first. When the table is full, a new
//! pod's write is refused and the loop tries again on a later cycle, so a flood of waiting
//! pods costs the API server at most [`WORKERS`] writes at a time and the scheduler at most
//! [`CAPACITY`] entries of memory.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use crate::pod::Pod;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::cycle::PodKey;
use crate::metrics::Metrics;

/// Writes waiting at most.
pub const CAPACITY: usize = 8192;
/// Writes in flight at once.
pub const WORKERS: usize = 4;

/// One write.
enum Write {
    /// `PodScheduled=False` with this message, and then `event` (a `FailedScheduling` Event)
    /// when the Event budget allowed one.
    Unschedulable { pod: PodKey, msg: String, event: Option<Box<Event>> },
    /// A Warning Event.
    Event(Box<Event>),
}

#[derive(Default)]
struct Table {
    order: VecDeque<String>,
    writes: HashMap<String, Write>,
    /// Keys being written now: a newer write for one waits until that write is done, so two
    /// workers never write one pod at once and the newer reason always lands last.
    busy: HashSet<String>,
    /// Numbers the keys of Events, which are never coalesced.
    events: u64,
}

struct Shared {
    table: Mutex<Table>,
    wake: Notify,
    metrics: Arc<Metrics>,
}

/// The writer; its workers stop when it is dropped.
pub struct Writer {
    shared: Arc<Shared>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Writer {
    /// Starts [`WORKERS`] workers writing with `client`.
    pub fn start(client: Client, metrics: Arc<Metrics>) -> Self {
        let shared =
            Arc::new(Shared { table: Mutex::new(Table::default()), wake: Notify::new(), metrics });
        let workers = (0..WORKERS)
            .map(|_| {
                let (shared, client) = (shared.clone(), client.clone());
                tokio::spawn(async move { work(&shared, &client).await })
            })
            .collect();
        Self { shared, workers }
    }

    /// Queues `PodScheduled=False` for `pod` (with a `FailedScheduling` Event when `event` is
    /// given). False when the table is full and the pod has no write waiting: nothing was
    /// queued, so the caller should try again later.
    pub fn unschedulable(&self, pod: PodKey, msg: String, event: Option<Event>) -> bool {
        let mut t = self.shared.lock();
        let key = format!("pod/{}", pod.uid);
        if let Some(Write::Unschedulable { msg: m, event: e, .. }) = t.writes.get_mut(&key) {
            *m = msg;
            if let Some(ev) = event {
                *e = Some(Box::new(ev));
            }
            return true;
        }
        self.push(&mut t, key, Write::Unschedulable { pod, msg, event: event.map(Box::new) })
    }

    /// Queues a Warning Event. False when the table is full.
    pub fn event(&self, ev: Event) -> bool {
        let mut t = self.shared.lock();
        t.events += 1;
        let key = format!("event/{}", t.events);
        self.push(&mut t, key, Write::Event(Box::new(ev)))
    }

    /// Writes waiting now.
    pub fn waiting(&self) -> usize {
        self.shared.lock().order.len()
    }

    fn push(&self, t: &mut Table, key: String, w: Write) -> bool {
        if t.order.len() >= CAPACITY {
            self.shared.metrics.status_dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        t.order.push_back(key.clone());
        t.writes.insert(key, w);
        self.shared.metrics.status_queue.store(t.order.len() as u64, Ordering::Relaxed);
        self.shared.wake.notify_one();
        true
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        for w in &self.workers {
            w.abort();
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // A poisoned lock only means a worker panicked mid-update; the table is still whole.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The oldest write whose key is not being written now, marked busy until [`Shared::done`].
    fn next(&self) -> Option<(String, Write)> {
        let mut t = self.lock();
        for _ in 0..t.order.len() {
            let Some(key) = t.order.pop_front() else { break };
            if t.busy.contains(&key) {
                t.order.push_back(key);
                continue;
            }
            if let Some(w) = t.writes.remove(&key) {
                t.busy.insert(key.clone());
                self.metrics.status_queue.store(t.order.len() as u64, Ordering::Relaxed);
                if !t.order.is_empty() {
                    // Another worker may start on the next one.
                    self.wake.notify_one();
                }
                return Some((key, w));
            }
        }
        None
    }

    /// The write of `key` is done: a newer one for it may go.
    fn done(&self, key: &str) {
        let mut t = self.lock();
        t.busy.remove(key);
        if !t.order.is_empty() {
            self.wake.notify_one();
        }
    }
}

async fn work(shared: &Shared, client: &Client) {
    loop {
        let Some((key, w)) = shared.next() else {
            shared.wake.notified().await;
            continue;
        };
        match w {
            Write::Unschedulable { pod, msg, event } => {
                let t = std::time::Instant::now();
                let r = mark_unschedulable(client, &pod, &msg).await;
                shared.metrics.status_seconds.observe(t.elapsed().as_secs_f64());
                match r {
                    Ok(()) => {
                        shared.metrics.status_writes.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        shared.metrics.status_errors.fetch_add(1, Ordering::Relaxed);
                        warn!(pod = %pod, error = %e, "could not update PodScheduled");
                    }
                }
                if let Some(ev) = event {
                    create_event(client, &ev).await;
                }
            }
            Write::Event(ev) => create_event(client, &ev).await,
        }
        shared.done(&key);
    }
}

async fn create_event(client: &Client, ev: &Event) {
    let ns = ev.metadata.namespace.as_deref().unwrap_or("default");
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    if let Err(e) = api.create(&PostParams::default(), ev).await {
        debug!(object = ?ev.involved_object.name, reason = ?ev.reason, error = %e, "could not record an Event");
    }
}

/// Patches `PodScheduled=False`, reason `Unschedulable`, with `msg`.
pub async fn mark_unschedulable(
    client: &Client,
    pod: &PodKey,
    msg: &str,
) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let patch = serde_json::json!({
        "status": { "conditions": [{
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": msg,
            "lastTransitionTime": Time(k8s_openapi::jiff::Timestamp::now()),
        }]}
    });
    api.patch_status(&pod.name, &PatchParams::default(), &Patch::Strategic(&patch)).await?;
    Ok(())
}

/// Whether `p` already says `PodScheduled=False` with `msg` (after a restart or a leader
/// change, so the new leader does not write every waiting pod's reason again).
pub fn already_says(p: &Pod, msg: &str) -> bool {
    p.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| {
        c.iter().any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
                && c.message.as_deref() == Some(msg)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(uid: &str) -> PodKey {
        PodKey { namespace: "ns".into(), name: uid.into(), uid: uid.into() }
    }

    fn msg(w: &Write) -> &str {
        match w {
            Write::Unschedulable { msg, .. } => msg,
            Write::Event(_) => "",
        }
    }

    /// A newer reason for a pod whose older one is being written waits until that write is
    /// done (the race that left a held flex-start pod showing its first reason), while other
    /// pods' writes go on.
    #[test]
    fn a_pod_is_never_written_twice_at_once_and_the_newer_reason_lands_last() {
        let shared = Arc::new(Shared {
            table: Mutex::new(Table::default()),
            wake: Notify::new(),
            metrics: Arc::new(Metrics::default()),
        });
        let writer = Writer { shared: shared.clone(), workers: Vec::new() };
        assert!(writer.unschedulable(key("p"), "first".into(), None));
        let (k1, w1) = shared.next().unwrap();
        assert_eq!(msg(&w1), "first");
        assert!(writer.unschedulable(key("p"), "second".into(), None));
        assert!(writer.unschedulable(key("q"), "other".into(), None));
        let (k2, w2) = shared.next().unwrap();
        assert_eq!(msg(&w2), "other", "another pod's write goes on");
        assert!(shared.next().is_none(), "p's newer reason waits for its write in flight");
        shared.done(&k1);
        let (_, w3) = shared.next().unwrap();
        assert_eq!(msg(&w3), "second");
        shared.done(&k2);
        assert!(shared.next().is_none());
    }
}
