//! The in-graph timeline of one bucket, for benchmarks (never on the replay path): the
//! bucket's launches captured with an external event-record node before the first op and
//! after each op, replayed, and the time between consecutive events taken per op (the median
//! over runs). Each span is the op's kernels *plus* the gap since the previous node as the
//! graph runs them — what per-op graphs (specbench's `ops`, each with its own launch) cannot
//! show. The event nodes themselves add a little to every span; `total_us` against the plain
//! replay says how much. The bucket graphs' L2 branches (`prefetch.rs`), when on, are in it.

use cudarc::driver::{result, sys};
use specplan_format::LaunchKind;

use super::device::{cuda, cuda_rc, GpuError};
use super::graph;
use super::GpuRuntime;

/// One op of a timeline: its name, whether it is a GEMM, and its median span.
#[derive(Clone, Debug)]
pub struct OpSpan {
    pub op: String,
    pub gemm: bool,
    pub us: f64,
}

#[derive(Clone, Debug)]
pub struct Timeline {
    pub ops: Vec<OpSpan>,
    /// Median of first event to last.
    pub total_us: f64,
    pub runs: usize,
}

/// Events destroyed on every return.
struct Events(Vec<sys::CUevent>);

impl Drop for Events {
    fn drop(&mut self) {
        for &e in &self.0 {
            // SAFETY: created by `event::create` below, destroyed once; errors at teardown
            // have no one to report to.
            let _ = unsafe { result::event::destroy(e) };
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

impl GpuRuntime {
    /// The timeline of bucket `batch` over `runs` replays (inputs as they are in the arena;
    /// call after a step so they are real). Synchronizes after every replay.
    pub fn timeline(&self, batch: u32, runs: usize) -> Result<Timeline, GpuError> {
        let bi = self.bucket_index(batch)?;
        let b = &self.plan.buckets()[bi];
        // Consecutive launches of one op are one span: (name, gemm, launch range).
        let mut spans: Vec<(String, bool, std::ops::Range<usize>)> = Vec::new();
        for (i, l) in b.launches.iter().enumerate() {
            let gemm = matches!(l.kind, LaunchKind::Gemm(_));
            match spans.last_mut() {
                Some(s) if s.0 == l.op => s.2.end = i + 1,
                _ => spans.push((l.op.clone(), gemm, i..i + 1)),
            }
        }
        let mut events = Events(Vec::with_capacity(spans.len() + 1));
        for _ in 0..=spans.len() {
            let e = cuda(
                "cuEventCreate",
                result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT),
            )?;
            events.0.push(e);
        }
        let stream = self.stream.cu_stream();
        let ev = &events.0;
        // An external record inside a capture becomes an event-record node (a plain record
        // would only express a dependency).
        let record = |e: sys::CUevent| {
            // SAFETY: a live event on the runtime's live stream, which is capturing.
            cuda_rc("cuEventRecordWithFlags", unsafe {
                sys::cuEventRecordWithFlags(e, stream, sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32)
            })
        };
        // With the bucket graphs' L2 branches, when the options ask for them: each forks
        // where it would in the whole list, so the spans show what the branches do.
        let whole = 0..b.launches.len();
        let exec = graph::capture(&self.stream, self.fill_func(), || {
            let l = self.bucket_launcher(stream, true);
            record(ev[0])?;
            for (k, (_, _, range)) in spans.iter().enumerate() {
                l.issue_span(bi, range.clone(), whole.clone())?;
                record(ev[k + 1])?;
            }
            Ok(())
        })?;
        for _ in 0..3 {
            exec.launch()?;
        }
        let mut per: Vec<Vec<f64>> = vec![Vec::with_capacity(runs); spans.len()];
        let mut total = Vec::with_capacity(runs);
        let last = ev[spans.len()];
        for _ in 0..runs.max(1) {
            exec.launch()?;
            // SAFETY: live events, recorded by the replay just launched.
            unsafe {
                cuda("cuEventSynchronize", result::event::synchronize(last))?;
                for (k, v) in per.iter_mut().enumerate() {
                    v.push(cuda("cuEventElapsedTime", result::event::elapsed(ev[k], ev[k + 1]))? as f64 * 1e3);
                }
                total.push(cuda("cuEventElapsedTime", result::event::elapsed(ev[0], last))? as f64 * 1e3);
            }
        }
        drop(exec);
        Ok(Timeline {
            ops: spans
                .into_iter()
                .zip(per)
                .map(|((op, gemm, _), v)| OpSpan {
                    op,
                    gemm,
                    us: median(v),
                })
                .collect(),
            total_us: median(total),
            runs: runs.max(1),
        })
    }
}
