//! The simulator: the OpenB placement benchmark ([`openb`]), trace replay over time
//! ([`replay`]) on a cluster described by the `--cluster` grammar ([`spec`]), and an SVG plot of
//! allocation curves ([`plot`]). Pure: traces come in already parsed ([`crate::trace`]).

pub mod dra;
pub mod openb;
pub mod plot;
pub mod replay;
pub mod spec;
pub mod variant;

/// Runs `run` on every job over up to `threads` scoped threads (each run independent and
/// deterministic, so the results do not depend on the thread count); results in job order.
pub(crate) fn parallel<J: Sync, R: Send>(
    jobs: &[J],
    threads: usize,
    run: impl Fn(&J) -> R + Sync,
) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = threads.clamp(1, jobs.len().max(1));
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(job) = jobs.get(i) else { break };
                        out.push((i, run(job)));
                    }
                    out
                })
            })
            .collect();
        // A worker only panics on a bug; surface it rather than lose its runs.
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}
