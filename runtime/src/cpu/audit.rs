//! Audited runs of the CPU executor on synthetic data, for the mutation test and the fuzz
//! target: one bucket of a validated plan, run with bounded deterministic weights and inputs
//! that mix valid values with the bad ones the kernels guard against (ids outside the
//! vocabulary, accept lengths outside [1, N], request slots outside the table or -1, pages
//! outside the pool or negative). After every launch the audit checks that the launch
//! changed only arena bytes of the buffers it names with write access (the entry's
//! declaration says which fields write) and only the K/V pools it names for writing.

use specplan_format::PhaseKind;
use specplan_format::{ArgValue, BucketPlan, DType, KvKind, LaunchKind, Plan, ValidatedPlan};
use specplan_kernels::abi::FieldKind;

use super::{CpuExecutor, ExecError, KvPool, Observed, WeightData, MAX_CPU_ARENA_BYTES};
use crate::step::{BucketInputs, PageTable, TableMode};

/// Bounds on what an audit allocates (on top of the executor's own arena limit).
#[derive(Clone, Copy, Debug)]
pub struct AuditLimits {
    /// Elements of all weights together.
    pub max_weight_elems: u64,
    /// Bytes of the bucket's arena.
    pub max_arena_bytes: u64,
    /// Elements of the K/V pool (every layer, K and V).
    pub max_pool_elems: u64,
}

impl Default for AuditLimits {
    fn default() -> Self {
        AuditLimits {
            max_weight_elems: 1 << 24,
            max_arena_bytes: 64 << 20,
            max_pool_elems: 1 << 24,
        }
    }
}

/// How an audited run ended; both are fine for a validated plan.
#[derive(Debug)]
pub enum Audit {
    /// Every launch ran.
    Ran,
    /// The executor returned an error instead of running (bad data it refuses).
    Refused(ExecError),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuditError {
    /// The plan is valid but larger than the audit's limits: nothing was run.
    #[error("too large for an audit: {0}")]
    TooLarge(String),
    #[error("the plan has no bucket {0}")]
    NoBucket(usize),
    /// A launch changed memory it does not name for writing (an executor bug).
    #[error("launch {launch} ({op}) wrote outside the memory it names for writing: {what}")]
    Write { launch: usize, op: String, what: String },
}

/// Deterministic weights for every plan weight (floats of magnitude below 1 scaled by the
/// row length; the FR-Spec map a valid id list), refused above `limits.max_weight_elems`.
pub fn synthetic_weights(plan: &Plan, limits: &AuditLimits) -> Result<Vec<WeightData>, AuditError> {
    let mut total = 0u64;
    for w in &plan.weights {
        let n = w.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        total = n.and_then(|n| total.checked_add(n)).unwrap_or(u64::MAX);
    }
    if total > limits.max_weight_elems {
        return Err(AuditError::TooLarge(format!(
            "{total} weight elements (limit {})",
            limits.max_weight_elems
        )));
    }
    let vocab = plan.model.vocab.max(1) as usize;
    Ok(plan
        .weights
        .iter()
        .enumerate()
        .map(|(wi, w)| {
            let n = w.shape.iter().product::<u64>() as usize;
            if w.dtype == DType::I64 {
                return WeightData::I64((0..n).map(|i| ((i * 7 + wi) % vocab) as i64).collect());
            }
            let scale = 1.0 / (*w.shape.last().unwrap_or(&1)).max(1) as f32;
            WeightData::F32(
                (0..n)
                    .map(|i| (((i + wi * 97) * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
                    .map(|x| x * scale.sqrt())
                    .collect(),
            )
        })
        .collect())
}

/// What one launch may write: arena cell ranges and pools.
#[derive(Default)]
struct Writes {
    cells: Vec<(usize, usize)>,
    kv: Vec<(usize, KvKind)>,
}

fn writes_of(plan: &Plan, b: &BucketPlan) -> Vec<Writes> {
    let cells = |id: u32| {
        b.buffers.get(id as usize).map(|x| {
            (
                (x.offset / 2) as usize,
                x.offset.saturating_add(x.bytes).div_ceil(2) as usize,
            )
        })
    };
    b.launches
        .iter()
        .map(|l| {
            let mut w = Writes::default();
            match &l.kind {
                LaunchKind::Gemm(g) => {
                    w.cells.extend(cells(g.c));
                    if let Some(r) = g.rounded {
                        w.cells.extend(cells(r));
                    }
                }
                LaunchKind::Collective(c) => w.cells.extend(cells(c.recv)),
                LaunchKind::Kernel { kernel, args, .. } => {
                    let fields = plan
                        .kernels
                        .get(*kernel as usize)
                        .map_or(&[][..], |k| k.entry.abi().fields);
                    for (a, f) in args.iter().zip(fields) {
                        let FieldKind::Ptr(pf) = f.kind else { continue };
                        if !pf.access.writes() {
                            continue;
                        }
                        match a {
                            ArgValue::Buffer(id) => w.cells.extend(cells(*id)),
                            ArgValue::KvCache { layer, kind } => w.kv.push((*layer as usize, *kind)),
                            _ => {}
                        }
                    }
                }
            }
            w
        })
        .collect()
}

/// Bits of a pool layer, for exact comparison (NaN included).
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The first change of `now` against `before` that `w` does not allow.
fn check_writes(w: &Writes, before: &[f64], before_kv: &KvPool, now: &Observed<'_>) -> Option<String> {
    if let Some(c) = (0..now.cells.len().min(before.len()))
        .find(|&c| now.cells[c].to_bits() != before[c].to_bits() && !w.cells.iter().any(|&(lo, hi)| lo <= c && c < hi))
    {
        return Some(format!("arena bytes {}..{}", 2 * c, 2 * c + 2));
    }
    for (kind, was, is) in [
        (KvKind::K, &before_kv.k, &now.kv.k),
        (KvKind::V, &before_kv.v, &now.kv.v),
    ] {
        for (layer, (x, y)) in was.iter().zip(is).enumerate() {
            if !same(x, y) && !w.kv.contains(&(layer, kind)) {
                return Some(format!("the {kind:?} pool of layer {layer}"));
            }
        }
    }
    None
}

/// Runs bucket `index` of `plan` on synthetic inputs (see the module doc) and checks every
/// launch's writes. `weights` as [`synthetic_weights`] gives them (or any packed set).
pub fn audit_bucket(
    plan: &ValidatedPlan,
    weights: &[WeightData],
    index: usize,
    limits: &AuditLimits,
) -> Result<Audit, AuditError> {
    let b = plan.buckets().get(index).ok_or(AuditError::NoBucket(index))?;
    let arena_limit = limits.max_arena_bytes.min(MAX_CPU_ARENA_BYTES);
    if b.arena_bytes > arena_limit {
        return Err(AuditError::TooLarge(format!(
            "an arena of {} bytes (limit {arena_limit})",
            b.arena_bytes
        )));
    }
    let (inputs, table, mut kv) = synthetic_inputs(plan, b, limits)?;
    // A sharded plan's collectives meet mirrored ranks (`collective::Mirror`).
    let mirror = super::collective::Mirror {
        size: plan.capture.tp.size,
    };
    let exec = match CpuExecutor::borrowing(plan, weights).and_then(|x| {
        if plan.capture.tp.is_sharded() {
            x.with_communicator(&mirror)
        } else {
            Ok(x)
        }
    }) {
        Ok(x) => x,
        Err(e) => return Ok(Audit::Refused(e)),
    };
    let writes = writes_of(plan, b);
    let mut before: Vec<f64> = Vec::new();
    let mut before_kv = kv.clone();
    let mut bad: Option<AuditError> = None;
    let mut observe = |o: Observed<'_>| {
        if let (Some(li), None) = (o.launch, &bad) {
            let w = writes.get(li);
            if let Some(what) = w.and_then(|w| check_writes(w, &before, &before_kv, &o)) {
                bad = Some(AuditError::Write {
                    launch: li,
                    op: b.launches.get(li).map_or(String::new(), |l| l.op.clone()),
                    what,
                });
            }
        }
        before.clear();
        before.extend_from_slice(o.cells);
        before_kv.clone_from(o.kv);
    };
    let result = exec.run_observed(b, &inputs, &table, &mut kv, &mut observe);
    match (bad, result) {
        (Some(e), _) => Err(e),
        (None, Ok(_)) => Ok(Audit::Ran),
        (None, Err(e)) => Ok(Audit::Refused(e)),
    }
}

/// A value in [-1, 1) from an index (inputs and cache contents).
fn pattern(i: usize) -> f32 {
    ((i * 37 + 11) % 101) as f32 / 50.5 - 1.0
}

/// Padded inputs, a small page table and a pool holding exactly the pages the first few
/// requests use (plus the scratch page), with the bad values the kernels guard against.
fn synthetic_inputs(
    plan: &Plan,
    b: &BucketPlan,
    limits: &AuditLimits,
) -> Result<(BucketInputs, PageTable, KvPool), AuditError> {
    let (bb, n, h) = (
        b.batch as usize,
        plan.rows_per_request(PhaseKind::DraftExtend) as usize,
        plan.model.hidden as usize,
    );
    let ps = plan.capture.page_size.max(1) as usize;
    let max_l = (plan.capture.max_context_len as usize).saturating_sub(n);
    let vocab = plan.model.vocab as i64;
    // Requests with a table row; the others are padding (slot -1).
    let real = bb.min(8);
    let prefix: Vec<usize> = (0..bb)
        .map(|i| [0, 1, ps + 1, 2 * ps + 3, max_l][i % 5].min(max_l).min(600))
        .collect();
    let need: Vec<usize> = prefix[..real].iter().map(|&l| (l + n).div_ceil(ps)).collect();
    let cols = need.iter().copied().max().unwrap_or(1).max(1);
    let pages: usize = need.iter().sum::<usize>() + 1;
    let m = &plan.model;
    let per_layer = (pages as u64) * ps as u64 * m.kv_heads as u64 * m.head_dim as u64;
    let pool_elems = per_layer.saturating_mul(2 * m.layers as u64);
    if pool_elems > limits.max_pool_elems {
        return Err(AuditError::TooLarge(format!(
            "a pool of {pool_elems} elements (limit {})",
            limits.max_pool_elems
        )));
    }
    let scratch = (pages - 1) as i32;
    let mut table = PageTable {
        rows: real + 1,
        cols,
        data: vec![scratch; (real + 1) * cols],
        mode: if ps == 1 {
            TableMode::TokenSlots
        } else {
            TableMode::PageIds
        },
    };
    let mut next = 0i32;
    for (i, &c) in need.iter().enumerate() {
        let row = &mut table.data[i * cols..(i + 1) * cols];
        for (j, e) in row.iter_mut().enumerate() {
            *e = if j < c {
                next += 1;
                next - 1
            } else {
                -1
            };
        }
        // The guards: a page outside the pool (request 1), a negative page (request 3).
        match (i, c) {
            (1, c) => row[c - 1] = scratch + 5,
            (3, c) if c > 1 => row[c / 2] = -7,
            _ => {}
        }
    }
    let slots = (0..bb)
        .map(|i| match i {
            _ if i >= real || (bb > 1 && i == bb - 1) => -1,
            2 if bb >= 4 => (real + 3) as i32,
            _ => i as i32,
        })
        .collect();
    let inputs = BucketInputs {
        input_ids: (0..bb * n)
            .map(|r| match r {
                0 => -1,
                1 => vocab,
                _ => (r as i64 * 7919) % vocab.max(1),
            })
            .collect(),
        hidden_states: (0..bb * n * h).map(pattern).collect(),
        prefix_lens: prefix.iter().map(|&l| l as i32).collect(),
        accept_lens: (0..bb).map(|i| [1, n as i32, 0, n as i32 + 1, 2][i % 5]).collect(),
        req_slots: slots,
    };
    let layer = |k: usize| -> Vec<f32> { (0..per_layer as usize).map(|i| pattern(i + k) * 0.5).collect() };
    let kv = KvPool {
        pages,
        k: (0..m.layers as usize).map(|l| layer(2 * l)).collect(),
        v: (0..m.layers as usize).map(|l| layer(2 * l + 1)).collect(),
    };
    Ok((inputs, table, kv))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(v: f32) -> KvPool {
        KvPool {
            pages: 1,
            k: vec![vec![v; 4]; 2],
            v: vec![vec![v; 4]; 2],
        }
    }

    #[test]
    fn writes_inside_the_named_memory_pass_and_others_are_caught() {
        let w = Writes {
            cells: vec![(4, 8)],
            kv: vec![(1, KvKind::V)],
        };
        let before = vec![f64::NAN; 16];
        let kv0 = pool(0.0);
        let mut cells = before.clone();
        cells[4] = 1.0;
        cells[7] = 2.0;
        let mut kv = pool(0.0);
        kv.v[1][3] = 5.0;
        let ok = Observed {
            launch: Some(0),
            cells: &cells,
            kv: &kv,
        };
        assert_eq!(check_writes(&w, &before, &kv0, &ok), None);
        cells[8] = 0.0;
        let bad = Observed {
            launch: Some(0),
            cells: &cells,
            kv: &kv,
        };
        assert_eq!(
            check_writes(&w, &before, &kv0, &bad).as_deref(),
            Some("arena bytes 16..18")
        );
        cells[8] = f64::NAN;
        kv.k[1][0] = 1.0;
        let bad = Observed {
            launch: Some(0),
            cells: &cells,
            kv: &kv,
        };
        assert_eq!(
            check_writes(&w, &before, &kv0, &bad).as_deref(),
            Some("the K pool of layer 1")
        );
    }
}
