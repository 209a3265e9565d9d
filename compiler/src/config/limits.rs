//! The config reader's bounds are the plan format's (`specplan_format::limits`, re-exported
//! here: one table, so a config within them never produces a plan that the validator
//! rejects for its sizes — the user sees the field and its bound, not a compiler error).
//! What this file adds: derived sizes (weight bytes, the largest bucket's activations)
//! computed with checked arithmetic before anything is built.

use specplan_format::{ModelDesc, SpecDesc};

use super::{CaptureConfig, Errors};

pub use specplan_format::limits::*;

/// An upper bound of the plan's weight region (every weight in the activation type,
/// rounded up to its alignment; the FR-Spec id map as i64), or `None` on overflow.
pub fn weight_bytes_bound(m: &ModelDesc, hot_vocab: Option<u32>) -> Option<u64> {
    let (h, i, v) = (m.hidden as u64, m.intermediate as u64, m.vocab as u64);
    let qkv = (m.heads as u64 + 2 * m.kv_heads as u64).checked_mul(m.head_dim as u64)?;
    let q = (m.heads as u64).checked_mul(m.head_dim as u64)?;
    let elem = |n: u64| n.checked_mul(2)?.checked_add(ALIGN);
    let layer = [h, qkv * h, q * h, h, 2 * i * h, i * h]
        .into_iter()
        .try_fold(0u64, |a, n| a.checked_add(elem(n)?))?;
    let head_rows = hot_vocab.map_or(v, u64::from);
    let ids = hot_vocab.map_or(0, |x| x as u64 * 8 + ALIGN);
    [v * h, h, 2 * h * h, head_rows * h]
        .into_iter()
        .try_fold(ids, |a, n| a.checked_add(elem(n)?))?
        .checked_add(layer.checked_mul(m.layers as u64)?)
}

/// A lower bound of the largest bucket's activation arena: buffers that are live at the
/// same time in every plan — the step's inputs (reserved for the whole step) beside one of:
/// `fc`'s GEMM input `[rows, 2H]` and output `[rows, H]`; in the MLP, the residual stream
/// `[rows, H]` (added after the down projection) with the gate/up GEMM's input `[rows, H]`
/// and output `[rows, 2I]`, or with that output and the activation's `[rows, I]` (GEMMs
/// have no epilogue, so the activation is its own launch); the logits `[B, V]` in f32.
pub fn arena_bytes_lower_bound(m: &ModelDesc, s: &SpecDesc, c: &CaptureConfig) -> u64 {
    let b = c.max_bucket() as u64;
    let rows = b * s.num_draft_tokens as u64;
    let (h, i) = (m.hidden as u64, m.intermediate as u64);
    let v = c.hot_vocab_size.unwrap_or(m.vocab) as u64;
    // All factors are capped above (rows ≤ 2^18, widths ≤ 2^24), so no product overflows.
    let inputs = rows * 8 + rows * h * 2 + b * 12;
    let fc = rows * 2 * h * 2 + rows * h * 2;
    let mlp = rows * h * 2 + rows * 2 * i * 2 + (rows * h * 2).max(rows * i * 2);
    let logits = b * v * 4;
    inputs + fc.max(mlp).max(logits)
}

/// The derived-size rules: weights and the largest bucket's activations within
/// [`MAX_REGION_BYTES`].
pub fn check_derived(m: &ModelDesc, s: &SpecDesc, c: &CaptureConfig, e: &mut Errors) {
    let gib = |x: u64| format!("{:.1} GiB", x as f64 / (1u64 << 30) as f64);
    match weight_bytes_bound(m, c.hot_vocab_size) {
        Some(w) if w <= MAX_REGION_BYTES => {}
        w => e.push(
            "model".into(),
            format!(
                "the weights (hidden_size {}, intermediate_size {}, vocab_size {}, {} layers) take {}, above the {} a plan's weight region may hold",
                m.hidden,
                m.intermediate,
                m.vocab,
                m.layers,
                w.map_or("more than 2^64 bytes".into(), gib),
                gib(MAX_REGION_BYTES)
            ),
        ),
    }
    let arena = arena_bytes_lower_bound(m, s, c);
    if arena > MAX_REGION_BYTES {
        e.push(
            "capture.buckets (--buckets, --max-bs)".into(),
            format!(
                "the largest bucket ({} requests × {} rows) needs at least {} of activations, above the {} a plan's arena may hold; use smaller buckets",
                c.max_bucket(),
                s.num_draft_tokens,
                gib(arena),
                gib(MAX_REGION_BYTES)
            ),
        );
    }
}
