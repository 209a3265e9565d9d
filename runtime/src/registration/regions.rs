//! Registered memory that must not share bytes, and a step's tensors against it: the K/V
//! pools, the page table and the weights are three kinds of memory no two of which may
//! overlap (a weight inside the pool would be overwritten by the K/V a step appends; a table
//! inside the pool would be read as slots after a step wrote K/V there), and a step's
//! outputs may overlap none of them, nor its inputs, nor each other (a step writes its
//! outputs last, but a batch above the largest bucket runs as consecutive replays, and the
//! CPU engine reads its inputs while it writes). Pairs of one kind are not compared: engines
//! may interleave layers' pools in one buffer (`check_kv` proves K and V of a layer apart
//! element by element), and tied weights share one tensor. Extents are byte ranges
//! `[lo, hi)`: a strided tensor's from its first to past its last element, so two strided
//! tensors that interleave count as overlapping (no engine lays a pool, a table and weights
//! out that way). Work per step is O(tensors × regions), independent of the KV.

use specplan_format::Plan;

use super::{bad, EngineMemory, RegError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Pool,
    Table,
    Weight,
}

#[derive(Clone, Debug)]
struct Span {
    lo: u64,
    hi: u64,
    kind: Kind,
    name: String,
}

/// The registered memory's byte ranges (built once, at registration).
#[derive(Clone, Debug, Default)]
pub struct Regions {
    spans: Vec<Span>,
    /// The plan's `max_requests`: the most requests a step may have (it bounds every extent
    /// below before one is computed).
    max_requests: u64,
}

/// One tensor of a step: its name, address, bytes per request (the tensor is `[b, ...]`)
/// and whether the step writes it.
#[derive(Clone, Copy, Debug)]
pub struct StepTensor<'a> {
    pub name: &'a str,
    pub ptr: u64,
    pub row: u64,
    pub written: bool,
}

impl StepTensor<'_> {
    /// Bytes of requests `[from, to)`.
    fn range(&self, from: u64, to: u64) -> (u64, u64) {
        (
            self.ptr.saturating_add(from.saturating_mul(self.row)),
            self.ptr.saturating_add(to.saturating_mul(self.row)),
        )
    }

    fn live(&self) -> bool {
        self.ptr != 0 && self.row > 0
    }
}

/// Whether input `read` shares a byte with a written tensor of `tensors` over `b` requests
/// (where the CPU engine, which reads its inputs while it writes, takes a copy of it first).
pub fn shares_with_outputs(read: &StepTensor, tensors: &[StepTensor], b: u64) -> bool {
    read.live()
        && tensors
            .iter()
            .any(|w| w.written && w.live() && overlaps(read.range(0, b), w.range(0, b)))
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

impl Regions {
    /// The registration's byte ranges, refused where two kinds overlap. Call after
    /// `check_kv` and `check_table` (whose bounds keep the extents below 2^64).
    pub fn of(plan: &Plan, mem: &EngineMemory) -> Result<Regions, RegError> {
        let (heads, d) = (plan.model.kv_heads as u64, plan.model.head_dim as u64);
        let g = &mem.kv.geom;
        let elem = plan.capture.dtype.size();
        let pool = g
            .span(heads, d)
            .and_then(|x| x.checked_mul(elem))
            .ok_or_else(|| bad("k_cache/v_cache", "the pool's extent overflows 64 bits".into()))?;
        let mut spans = Vec::new();
        for (l, (&k, &v)) in mem.kv.k.iter().zip(&mem.kv.v).enumerate() {
            for (name, p) in [(specplan_format::io::K_CACHE, k), (specplan_format::io::V_CACHE, v)] {
                spans.push(Span {
                    lo: p,
                    hi: p.saturating_add(pool),
                    kind: Kind::Pool,
                    name: format!("{name}[{l}]"),
                });
            }
        }
        let t = &mem.table;
        let entries = t.rows.saturating_sub(1).saturating_mul(t.stride).saturating_add(t.cols);
        spans.push(Span {
            lo: t.ptr,
            hi: t.ptr.saturating_add(entries.saturating_mul(4)),
            kind: Kind::Table,
            name: match t.mode {
                specplan_kernels::kv::TableMode::TokenSlots => "req_to_token".into(),
                specplan_kernels::kv::TableMode::PageIds => "block_table".into(),
            },
        });
        let mut names: Vec<&String> = mem.weights.keys().collect();
        names.sort();
        for name in names {
            let w = &mem.weights[name];
            let bytes = w.elems().saturating_mul(w.dtype.size());
            if w.ptr != 0 && bytes > 0 {
                spans.push(Span {
                    lo: w.ptr,
                    hi: w.ptr.saturating_add(bytes),
                    kind: Kind::Weight,
                    name: format!("weight {name}"),
                });
            }
        }
        for (i, a) in spans.iter().enumerate() {
            if let Some(b) = spans[i + 1..]
                .iter()
                .find(|b| b.kind != a.kind && overlaps((a.lo, a.hi), (b.lo, b.hi)))
            {
                return Err(bad(
                    &b.name,
                    format!(
                        "[{:#x}, {:#x}) overlaps {} at [{:#x}, {:#x}): registered memory of different kinds must not share bytes",
                        b.lo, b.hi, a.name, a.lo, a.hi
                    ),
                ));
            }
        }
        Ok(Regions {
            spans,
            max_requests: plan.capture.max_requests as u64,
        })
    }

    /// A step of `b` requests run in chunks of `chunk` (consecutive replays; the CPU engine
    /// runs one): each written tensor against the registered memory and the other written
    /// ones; each input against the pool (the step writes K/V there); and a chunk's outputs
    /// against the inputs of the chunks after it, which are read later. Within a chunk an
    /// output may overlap an input (vLLM's drafter writes its hidden rows over its input
    /// buffer): the device reads a chunk's inputs before it writes the chunk's outputs.
    /// Null or empty tensors are skipped. First of all, `b` must be in `[1, max_requests]`.
    /// Work: O(tensors² × b / chunk), with no allocation (it runs on every engine step).
    pub fn check_step(&self, tensors: &[StepTensor], b: u64, chunk: u64) -> Result<(), String> {
        if b == 0 || b > self.max_requests {
            return Err(format!(
                "b: {b} requests is outside [1, {}] (the plan's max_requests)",
                self.max_requests
            ));
        }
        let live = || tensors.iter().filter(|t| t.live());
        let span = |t: &StepTensor, r: (u64, u64)| format!("{}: [{:#x}, {:#x})", t.name, r.0, r.1);
        for a in live() {
            let ra = a.range(0, b);
            let hit = |s: &&Span| (a.written || s.kind == Kind::Pool) && overlaps(ra, (s.lo, s.hi));
            if let Some(s) = self.spans.iter().find(hit) {
                return Err(format!(
                    "{} overlaps the registered {} at [{:#x}, {:#x}): {}",
                    span(a, ra),
                    s.name,
                    s.lo,
                    s.hi,
                    if a.written {
                        "the step would overwrite it"
                    } else {
                        "the step writes K/V there"
                    }
                ));
            }
        }
        for (i, a) in tensors.iter().enumerate().filter(|(_, t)| t.live()) {
            for o in tensors[i + 1..].iter().filter(|t| t.live()) {
                let (ra, ro) = (a.range(0, b), o.range(0, b));
                if a.written && o.written && overlaps(ra, ro) {
                    return Err(format!(
                        "{} overlaps {} at [{:#x}, {:#x}): two outputs of a step must not share memory",
                        span(a, ra),
                        o.name,
                        ro.0,
                        ro.1
                    ));
                }
            }
        }
        let chunk = chunk.max(1);
        for w in live().filter(|t| t.written) {
            for r in live().filter(|t| !t.written) {
                let mut s = 0;
                while s < b {
                    let e = (s + chunk).min(b);
                    let (rw, rr) = (w.range(s, e), r.range(e, b));
                    if e < b && overlaps(rw, rr) {
                        return Err(format!(
                            "{} (requests {s}..{e}) overlaps {} of later requests at [{:#x}, {:#x}): a batch above the largest bucket runs in consecutive replays, and this one's outputs would overwrite the next one's inputs",
                            span(w, rw),
                            r.name,
                            rr.0,
                            rr.1
                        ));
                    }
                    s = e;
                }
            }
        }
        Ok(())
    }
}
