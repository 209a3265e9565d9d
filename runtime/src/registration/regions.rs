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
}

/// One tensor of a step: its name, address, bytes and whether the step writes it.
#[derive(Clone, Copy, Debug)]
pub struct StepTensor<'a> {
    pub name: &'a str,
    pub ptr: u64,
    pub bytes: u64,
    pub written: bool,
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
            .slots
            .checked_sub(1)
            .and_then(|t| g.offset(t, heads.saturating_sub(1), d.saturating_sub(1)))
            .and_then(|x| x.checked_add(1))
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
        Ok(Regions { spans })
    }

    /// A step's tensors (null or empty ones skipped): each written one against the
    /// registered memory and against every other tensor of the step.
    pub fn check_step(&self, tensors: &[StepTensor]) -> Result<(), String> {
        let live: Vec<&StepTensor> = tensors.iter().filter(|t| t.ptr != 0 && t.bytes > 0).collect();
        for (i, a) in live.iter().enumerate() {
            let ra = (a.ptr, a.ptr.saturating_add(a.bytes));
            // A written tensor against all the registered memory; an input against the pool,
            // which the step writes (a later chunk of a large batch would read K/V there).
            let hit = |s: &&Span| (a.written || s.kind == Kind::Pool) && overlaps(ra, (s.lo, s.hi));
            if let Some(s) = self.spans.iter().find(hit) {
                return Err(format!(
                    "{}: [{:#x}, {:#x}) overlaps the registered {} at [{:#x}, {:#x}): {}",
                    a.name,
                    ra.0,
                    ra.1,
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
            for b in &live[i + 1..] {
                let rb = (b.ptr, b.ptr.saturating_add(b.bytes));
                if (a.written || b.written) && overlaps(ra, rb) {
                    let (w, o) = if a.written { (a, b) } else { (b, a) };
                    return Err(format!(
                        "{}: [{:#x}, {:#x}) overlaps {} at [{:#x}, {:#x}): a step's outputs must not share memory with its inputs or each other",
                        w.name,
                        w.ptr,
                        w.ptr.saturating_add(w.bytes),
                        o.name,
                        o.ptr,
                        o.ptr.saturating_add(o.bytes)
                    ));
                }
            }
        }
        Ok(())
    }
}
