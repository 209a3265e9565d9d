//! Collectives of the CPU executor: a sharded plan's T ranks, each a [`super::CpuExecutor`]
//! of its own rank's plan, run in lockstep — each on its own thread, meeting at every
//! collective launch through a [`Communicator`] (docs/tensor-parallel.md).
//!
//! The sums are exact oracles: every rank's values in f64, added in rank order.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::ExecError;

/// How the ranks of a sharded plan meet at a collective launch.
pub trait Communicator: Sync {
    /// Ranks in the group.
    fn size(&self) -> u32;
    /// Rank `rank`'s values of the group's next collective; returns every rank's values of
    /// it, in rank order, once all have given theirs.
    fn exchange(&self, rank: u32, values: Vec<f64>) -> Result<Arc<Vec<Vec<f64>>>, String>;
    /// Ends every wait of the group (a rank failed): the others' exchanges return errors.
    fn abort(&self);
}

/// A communicator between threads of one process.
pub struct LocalGroup {
    size: u32,
    state: Mutex<GroupState>,
    cv: Condvar,
    /// Longest wait at one collective before a rank gives up (a rank that stopped without
    /// aborting the group, a bug in the caller).
    timeout: Duration,
}

#[derive(Default)]
struct GroupState {
    /// Collectives completed so far.
    generation: u64,
    slots: Vec<Option<Vec<f64>>>,
    /// The values of collective `generation − 1`: no rank can complete the next one while
    /// another still reads this, since it needs that rank's values.
    done: Option<Arc<Vec<Vec<f64>>>>,
    aborted: bool,
}

impl LocalGroup {
    pub fn new(size: u32) -> LocalGroup {
        LocalGroup {
            size,
            state: Mutex::new(GroupState {
                slots: vec![None; size as usize],
                ..Default::default()
            }),
            cv: Condvar::new(),
            timeout: Duration::from_secs(120),
        }
    }
}

impl Communicator for LocalGroup {
    fn size(&self) -> u32 {
        self.size
    }

    fn exchange(&self, rank: u32, values: Vec<f64>) -> Result<Arc<Vec<Vec<f64>>>, String> {
        let poisoned = |_| "a rank panicked inside a collective".to_string();
        let mut st = self.state.lock().map_err(poisoned)?;
        let slot = rank as usize;
        if slot >= st.slots.len() {
            return Err(format!("rank {rank} outside a group of {}", self.size));
        }
        // A rank a collective ahead waits for the others to finish the current one.
        while st.slots[slot].is_some() && !st.aborted {
            st = self.wait(st)?;
        }
        if st.aborted {
            return Err("another rank failed; the group was aborted".into());
        }
        st.slots[slot] = Some(values);
        let mine = st.generation;
        if st.slots.iter().all(Option::is_some) {
            let all: Vec<Vec<f64>> = st.slots.iter_mut().map(|s| s.take().unwrap_or_default()).collect();
            st.done = Some(Arc::new(all));
            st.generation += 1;
            self.cv.notify_all();
        }
        while st.generation == mine && !st.aborted {
            st = self.wait(st)?;
        }
        if st.aborted {
            return Err("another rank failed; the group was aborted".into());
        }
        st.done
            .clone()
            .ok_or_else(|| "a collective completed without values".into())
    }

    fn abort(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.aborted = true;
        }
        self.cv.notify_all();
    }
}

impl LocalGroup {
    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, GroupState>,
    ) -> Result<std::sync::MutexGuard<'a, GroupState>, String> {
        let (st, to) = self
            .cv
            .wait_timeout(st, self.timeout)
            .map_err(|_| "a rank panicked inside a collective".to_string())?;
        if to.timed_out() {
            return Err(format!(
                "waited {} s at a collective: a rank stopped without reaching it",
                self.timeout.as_secs()
            ));
        }
        Ok(st)
    }
}

/// Runs `f(rank, group)` for every rank of a `size`-rank group on its own thread, in
/// lockstep through the group; the first rank to fail aborts the others. Returns the ranks'
/// results in rank order, or the first error (by rank).
pub fn lockstep<R: Send>(
    size: u32,
    f: impl Fn(u32, &LocalGroup) -> Result<R, ExecError> + Sync,
) -> Result<Vec<R>, ExecError> {
    let group = LocalGroup::new(size);
    let results: Vec<Result<R, ExecError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|r| {
                let (g, f) = (&group, &f);
                s.spawn(move || {
                    // A rank that panics aborts the group too, so the others do not wait.
                    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(r, g)))
                        .unwrap_or_else(|_| Err(ExecError::Setup(format!("rank {r} panicked"))));
                    if out.is_err() {
                        g.abort();
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(ExecError::Setup("a rank's thread panicked".into())))
            })
            .collect()
    });
    // The failure that caused the abort, not a rank that only saw it.
    let first = results
        .iter()
        .position(|r| matches!(r, Err(e) if !e.to_string().contains("aborted")))
        .or_else(|| results.iter().position(Result::is_err));
    if let Some(i) = first {
        return Err(results
            .into_iter()
            .nth(i)
            .and_then(Result::err)
            .unwrap_or_else(|| ExecError::Setup("a rank failed".into())));
    }
    Ok(results.into_iter().filter_map(Result::ok).collect())
}

/// A stand-in group for auditing one rank's plan alone (`audit_bucket`): every other rank
/// gives this rank's values. The values are not a real forward's (an all-reduce comes out
/// T times this rank's partial); what the audit checks — that every launch stays inside
/// what it may touch — holds for any values.
pub struct Mirror {
    pub size: u32,
}

impl Communicator for Mirror {
    fn size(&self) -> u32 {
        self.size
    }

    fn exchange(&self, _rank: u32, values: Vec<f64>) -> Result<Arc<Vec<Vec<f64>>>, String> {
        Ok(Arc::new(vec![values; self.size as usize]))
    }

    fn abort(&self) {}
}
