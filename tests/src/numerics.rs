//! The numerics targets of a draft-extend step against the exact CPU executor, and their
//! prediction from a plan's buffer types alone.
//!
//! Targets (stated once here; the GPU check asserts them: `checks::check_case` per case,
//! `gpucheck` and the soak over a plan's cases):
//! - `hidden_out`: relative RMS error per request ≤ [`HIDDEN_TARGET`];
//! - top-K probabilities: [`PROB_TARGET_REL`] relative, read as two standard deviations —
//!   the RMS of |p − p_ref| / p_ref over the probabilities with p_ref ≥ 1e-3, pooled over a
//!   plan's cases, ≤ [`PROB_RMS_TARGET`]. The largest error (`prob_rel`) and the count past
//!   `PROB_TARGET_REL·p_ref + PROB_TARGET_ABS` (`prob_off`) are reported beside it, and every
//!   probability stays asserted within the checks' correctness bound (`checks::PROB_REL`).
//!   Why not the largest: each probability's error is a draw, and the largest of a few dozen
//!   is a tail. On the tiny EAGLE-3 head the emulation below puts the largest of 96 past
//!   5e-3·p in 18% of random draws (1,000 seeds, up to 1.16e-2; the pooled RMS at most
//!   2.12e-3); the tail comes from the attention branch's bf16 stores (the layer input, the
//!   q/k/v rows, the new K/V and the attention output: with those exact the largest of 48
//!   stays under 4.6e-3 in 200 draws), so a bound on the largest failed the GPU check's cases
//!   in 12% of 500 draws (docs/perf-notes.md, "The probability target's tail");
//! - top-K ids equal wherever the reference's neighbouring probabilities are more than
//!   [`ID_GAP`] apart (a closer pair may swap).
//!
//! [`emulate`] runs the plan on the CPU executor twice — exact, and with every store into a
//! 16-bit buffer or the cache rounded to its type, as the device's memory does — and
//! compares the two with the same rules: the error the plan's precision design alone
//! costs, before any kernel's arithmetic differs. The device adds its own summation
//! orders (f32 against the executor's f64) to that, which are orders smaller.

use specplan_format::{DType, PhaseKind, ValidatedPlan};
use specplan_runtime::cpu::{BucketOutputs, WeightData};

use crate::random::Case;
use crate::reference::{cpu_reference, cpu_rounded};
use crate::tolerance::{id_mismatches, prob_close, rel_rms};

pub const HIDDEN_TARGET: f64 = 3e-3;
/// What the checks assert for `hidden_out` where the stream is fp32: the target holds on
/// the one-layer checkpoints' shapes (2.0–2.2e-3 on the H200) and typically on the two-layer
/// test model (2.2–2.9e-3), whose emulated tail reaches 3.1e-3 — hidden_out's own bf16
/// rounding is 1.5e-3 of it, the GEMMs' bf16 inputs the rest — so the assertion keeps a
/// margin above it, and the target is reported beside it.
pub const HIDDEN_ASSERTED: f64 = 4e-3;
pub const PROB_TARGET_REL: f64 = 5e-3;
pub const PROB_TARGET_ABS: f64 = 1e-5;
/// The probability target as asserted: the pooled RMS of the relative errors, half of
/// [`PROB_TARGET_REL`] (see the header).
pub const PROB_RMS_TARGET: f64 = PROB_TARGET_REL / 2.0;
pub const ID_GAP: f64 = 1e-3;

/// How far a step's outputs lie from the reference's (the worst request of a case).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Numerics {
    /// Largest relative RMS error of a request's `hidden_out`.
    pub hidden_rel: f64,
    /// Largest |p − p_ref| / p_ref over the probabilities with p_ref ≥ 1e-3.
    pub prob_rel: f64,
    /// RMS of |p − p_ref| / p_ref over the same probabilities (0 when there are none).
    pub prob_rms: f64,
    /// How many probabilities `prob_rel` and `prob_rms` cover.
    pub prob_count: usize,
    /// Probabilities outside `PROB_TARGET_REL·p_ref + PROB_TARGET_ABS`.
    pub prob_off: usize,
    /// Top-K ids that differ where the reference's gap to a neighbour exceeds `ID_GAP`.
    pub id_off: usize,
}

impl Numerics {
    pub fn meets_targets(&self) -> bool {
        self.hidden_rel <= HIDDEN_TARGET && self.prob_rms <= PROB_RMS_TARGET && self.id_off == 0
    }

    /// Two cases together: the worse hidden and largest errors, the counts added, the RMS
    /// pooled over both cases' probabilities.
    pub fn max(self, o: Numerics) -> Numerics {
        let n = self.prob_count + o.prob_count;
        let sq = self.prob_rms.powi(2) * self.prob_count as f64 + o.prob_rms.powi(2) * o.prob_count as f64;
        Numerics {
            hidden_rel: self.hidden_rel.max(o.hidden_rel),
            prob_rel: self.prob_rel.max(o.prob_rel),
            prob_rms: if n == 0 { 0.0 } else { (sq / n as f64).sqrt() },
            prob_count: n,
            prob_off: self.prob_off + o.prob_off,
            id_off: self.id_off + o.id_off,
        }
    }

    /// What the plan-level probability assertion reports where it fails: the pooled RMS
    /// past [`PROB_RMS_TARGET`] (None where it holds, or where `plan` does not assert the
    /// targets: [`asserted`]).
    pub fn probability_failure(&self, plan: &ValidatedPlan) -> Option<String> {
        (asserted(plan) && self.prob_rms > PROB_RMS_TARGET).then(|| {
            format!(
                "top-K probabilities: RMS relative error {:.3e} over {} probabilities > {PROB_RMS_TARGET:e} \
                 (the {PROB_TARGET_REL:e} target at two standard deviations; largest {:.3e}, {} past \
                 {PROB_TARGET_REL:e}·p + {PROB_TARGET_ABS:e})",
                self.prob_rms, self.prob_count, self.prob_rel, self.prob_off
            )
        })
    }
}

/// Whether a plan's checks assert the targets: where its draft-extend stream is fp32 (the
/// top-K refinement and the MLP pairs apply there: docs/semantics.md "Precision"). Plans
/// whose stream is in act (draft decode, sharded) report them only.
pub fn asserted(plan: &ValidatedPlan) -> bool {
    specplan_format::stream_dtype(PhaseKind::DraftExtend, plan.capture.dtype, plan.capture.tp) == DType::F32
}

/// `got` against `want` for the first `b` requests (hidden rows `H` wide, `k` top-K slots
/// per request; `k = 0` when the plan emits no top-K).
pub fn compare(plan: &ValidatedPlan, got: &BucketOutputs, want: &BucketOutputs, b: usize) -> Numerics {
    let h = plan.model.hidden as usize;
    let k = if plan.capture.outputs.topk {
        plan.spec.topk as usize
    } else {
        0
    };
    let mut n = Numerics::default();
    let mut sq = 0f64;
    for i in 0..b {
        let row = |v: &[f32]| -> Vec<f64> { v[i * h..(i + 1) * h].iter().map(|&x| x as f64).collect() };
        n.hidden_rel = n.hidden_rel.max(rel_rms(&row(&got.hidden_out), &row(&want.hidden_out)));
        if k == 0 {
            continue;
        }
        let sl = i * k..(i + 1) * k;
        for s in sl.clone() {
            let (gp, wp) = (got.topk_probs[s] as f64, want.topk_probs[s] as f64);
            if wp >= 1e-3 {
                // A non-finite probability is an infinite error (f64::max would drop a NaN).
                let r = if gp.is_finite() {
                    (gp - wp).abs() / wp
                } else {
                    f64::INFINITY
                };
                n.prob_rel = n.prob_rel.max(r);
                sq += r * r;
                n.prob_count += 1;
            }
            if !prob_close(gp, wp, PROB_TARGET_REL, PROB_TARGET_ABS) {
                n.prob_off += 1;
            }
        }
        n.id_off += id_mismatches(
            &got.topk_ids[sl.clone()],
            &want.topk_ids[sl.clone()],
            &got.topk_probs[sl.clone()],
            &want.topk_probs[sl],
            ID_GAP,
        )
        .len();
    }
    if n.prob_count > 0 {
        n.prob_rms = (sq / n.prob_count as f64).sqrt();
    }
    n
}

/// The plan's storage precision against the exact executor on one case (see the header).
pub fn emulate(plan: &ValidatedPlan, weights: &[WeightData], c: &Case) -> Result<Numerics, String> {
    let (want, _) = cpu_reference(plan, weights, c)?;
    let (got, _) = cpu_rounded(plan, weights, c)?;
    Ok(compare(plan, &got, &want, c.b))
}
