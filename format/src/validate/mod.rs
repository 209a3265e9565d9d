//! Plan validation: every index, offset, size and kernel fact is checked before anything
//! uses the plan. A plan that passes runs on the CPU executor without panicking or
//! allocating without bound, and cannot make an honest kernel binary index outside an
//! allocation (see ARCHITECTURE.md, "Trust").
//!
//! Rules (each violation names the field, kernel, bucket, buffer, launch or argument):
//! 0. Lengths: phases, each phase's buckets, kernels, weights, fusions, and each bucket's
//!    buffers and launches within caps far above what the compiler emits (`limits`),
//!    checked first.
//! 1. Model: dimensions positive and within the kernels' limits (`limits`), `heads % kv_heads
//!    == 0`, `head_dim` a multiple of 16 and at most 256, finite positive eps and theta,
//!    rope scaling factors finite and positive (Llama 3: low below high),
//!    `rope_inv_freq` has `head_dim / 2` finite positive entries, each within 2 f32 ulps of
//!    what `rope_theta` and `rope_scaling` give (`facts::rope_inv_freq`), one `LayerDesc`
//!    per layer, windows positive.
//! 2. Spec: SGLang's topk / num_steps / num_draft_tokens rules, topk ≤ 32, N ≤ 64
//!    (`limits::spec_rule`, the compiler's rule too).
//! 3. Capture: power-of-two page size ≤ 1024, page-table width = ceil(context / page), the
//!    page table within `MAX_TABLE_ENTRIES`, at least as many request slots as the largest
//!    bucket, the scratch page the pool's last, an activation dtype, hot vocabulary in
//!    `[topk, vocab]`; tensor parallelism: a power-of-two size ≤ `MAX_TP_SIZE`, the rank
//!    below it, the lm_head rows divisible by it.
//! 4. Weights: `bytes = prod(shape) · dtype`, 256-byte aligned, inside the weight region,
//!    no two overlapping, the region no larger than its last weight (rounded), packing
//!    arities; shards only in a sharded plan, one per packed part, each its rank's part of
//!    T (or, for replicated kv heads, of fewer) along an axis the weight has; every
//!    weight used by a launch and no larger than what its uses touch.
//! 5. Kernels (`rules.rs`): unique names, each the instance's mangled name; constants
//!    exactly the entry template's constants for the plan's facts (attention: for the
//!    window of the layers it serves);
//!    the source hash equals the regenerated source's; binaries for the plan's arch, bound
//!    to that source hash, ELF images whose header tables lie inside them; every kernel
//!    launched.
//! 6. Phases (`phase.rs`): ascending kinds, one per kind, the draft-extend phase present;
//!    `rows_per_request` the kind's (`PhaseKind::rows_per_request`); at least one bucket.
//!    Buckets (`bucket.rs`): strictly ascending batches; `rows = batch · R` (R the phase's
//!    rows per request); `qo_indptr[i] = i · R`; splits in [1, 16]; every buffer sized by
//!    its shape, aligned, inside the arena, with a printable name unique in the bucket; the
//!    phase signature's staged inputs and outputs present with their exact dtypes and shapes,
//!    and no other input or output; the arena no larger than its last buffer (rounded).
//! 7. Launches (`rules.rs`): each kernel launch has the grid, block, shared memory and
//!    `u32` arguments its entry's declaration gives for the bucket; one argument per field
//!    of the parameter struct, of an allowed kind (buffer, weight, page table, the K or V
//!    pool of one existing layer), the named input where the field names one, null exactly
//!    where the launch touches nothing, the field's dtype, and at least the bytes it
//!    touches; GEMM operands of matching shapes and dtypes.
//! 8. Data flow: inputs are only read; every other buffer is written before it is read;
//!    every output is written; no write is lost (overwritten before a read, or a scratch
//!    value never read); each layer's K and V pools are appended by the phase's number of
//!    launches (draft-extend: one) and read only after the first; every buffer is used and no larger than its uses touch; buffers
//!    sharing arena bytes are never live at the same time.

mod bucket;
mod common;
mod gemm;
mod phase;
mod rules;

use std::collections::HashSet;

use common::{printable, Errors};

use crate::location::Location;
use crate::types::*;
use crate::PlanError;

pub use rules::kernel_source;

pub use crate::limits::*;

/// A plan that passed [`validate`]. The only way to build one, so every consumer can
/// rely on the rules above.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedPlan(Plan);

impl ValidatedPlan {
    pub fn plan(&self) -> &Plan {
        &self.0
    }
    pub fn into_inner(self) -> Plan {
        self.0
    }
}

impl std::ops::Deref for ValidatedPlan {
    type Target = Plan;
    fn deref(&self) -> &Plan {
        &self.0
    }
}

pub fn validate(plan: Plan) -> Result<ValidatedPlan, PlanError> {
    let mut e = Errors(Vec::new());
    lengths(&plan, &mut e);
    model(&plan, &mut e);
    spec(&plan.spec, &mut e);
    capture(&plan, &mut e);
    phase::phases(&plan, &mut e);
    // Everything below sizes work by the facts above: stop here when they are broken.
    if e.0.is_empty() {
        weights(&plan, &mut e);
        rules::kernels(&plan, &mut e);
        let mut touched = rules::Touched {
            kernels: vec![false; plan.kernels.len()],
            ..Default::default()
        };
        for ph in &plan.phases {
            let facts = crate::facts::phase_facts_of(&plan, ph.kind);
            phase::buckets(&plan, ph, &facts, &mut touched, &mut e);
        }
        rules::usage(&plan, &touched, &mut e);
    }
    if e.0.is_empty() {
        Ok(ValidatedPlan(plan))
    } else {
        Err(PlanError::Invalid(e.0))
    }
}

fn model(p: &Plan, e: &mut Errors) {
    let m = &p.model;
    for (name, v, max) in [
        ("hidden", m.hidden, MAX_HIDDEN),
        ("intermediate", m.intermediate, MAX_INTERMEDIATE),
        ("heads", m.heads, MAX_HEADS),
        ("kv_heads", m.kv_heads, MAX_HEADS),
        ("head_dim", m.head_dim, MAX_HEAD_DIM),
        ("layers", m.layers, MAX_LAYERS),
        ("vocab", m.vocab, MAX_VOCAB),
    ] {
        e.field(v > 0 && v <= max, &format!("model.{name}"), || {
            format!("{v} is outside [1, {max}]")
        });
    }
    e.field(
        m.target_hidden > 0 && m.target_hidden <= MAX_HIDDEN,
        "model.target_hidden",
        || format!("{} is outside [1, {MAX_HIDDEN}]", m.target_hidden),
    );
    match m.head {
        crate::types::HeadKind::Eagle1 => {
            e.field(m.target_hidden == m.hidden, "model.target_hidden", || {
                format!(
                    "{} must equal hidden {} for an EAGLE-1/2 head",
                    m.target_hidden, m.hidden
                )
            });
            e.field(m.draft_vocab.is_none(), "model.draft_vocab", || {
                "an EAGLE-1/2 head has no draft vocabulary (its lm_head is the target's)".into()
            });
        }
        crate::types::HeadKind::Eagle3 => {
            e.field(m.layers == 1, "model.layers", || {
                format!("{} layers: EAGLE-3 heads have one (midlayer)", m.layers)
            });
            e.field(!m.fc_bias, "model.fc_bias", || "EAGLE-3's fc has no bias".into());
            e.field(p.capture.hot_vocab_size.is_none(), "capture.hot_vocab_size", || {
                "FR-Spec hot rows and EAGLE-3's d2t map are exclusive".into()
            });
        }
    }
    if let Some(v) = m.draft_vocab {
        e.field(v >= p.spec.topk && v <= m.vocab, "model.draft_vocab", || {
            format!("{v} must be in [topk = {}, vocab = {}]", p.spec.topk, m.vocab)
        });
    }
    e.field(
        m.kv_heads == 0 || m.heads.is_multiple_of(m.kv_heads),
        "model.heads",
        || format!("{} is not a multiple of kv_heads {}", m.heads, m.kv_heads),
    );
    e.field(m.head_dim.is_multiple_of(16), "model.head_dim", || {
        format!(
            "{} is not a multiple of 16 (the attention's tensor-core steps)",
            m.head_dim
        )
    });
    e.field(
        m.rms_norm_eps.is_finite() && m.rms_norm_eps > 0.0,
        "model.rms_norm_eps",
        || format!("{} must be finite and positive", m.rms_norm_eps),
    );
    e.field(
        m.rope_theta.is_finite() && m.rope_theta > 0.0,
        "model.rope_theta",
        || format!("{} must be finite and positive", m.rope_theta),
    );
    let pos = |x: f32| x.is_finite() && x > 0.0;
    let scaling_ok = match m.rope_scaling {
        RopeScaling::None => true,
        RopeScaling::Linear { factor } => pos(factor),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_position_embeddings: orig,
        } => pos(factor) && pos(lo) && pos(hi) && lo < hi && orig > 0,
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            ..
        } => {
            pos(factor)
                && orig > 0
                && pos(beta_fast)
                && pos(beta_slow)
                && beta_slow < beta_fast
                && mscale.is_none_or(pos)
                && mscale_all_dim.is_none_or(pos)
        }
        RopeScaling::LongRope {
            ref short_factor,
            original_max_position_embeddings: orig,
            short_mscale,
        } => {
            short_factor.len() as u64 == m.head_dim as u64 / 2
                && short_factor.iter().all(|&x| pos(x))
                && orig > 0
                && short_mscale.is_none_or(pos)
        }
    };
    e.field(scaling_ok, "model.rope_scaling", || {
        format!(
            "{:?}: factors must be finite and positive, low_freq_factor below high_freq_factor (YaRN: beta_slow below beta_fast; LongRoPE: head_dim/2 short factors), original_max_position_embeddings positive",
            m.rope_scaling
        )
    });
    let scale = crate::facts::rope_attention_scale(m);
    e.field(
        scaling_ok && scale.is_finite() && scale > 0.0,
        "model.rope_scaling",
        || format!("gives the attention factor {scale}, not a finite positive f32"),
    );
    if let RopeScaling::LongRope {
        original_max_position_embeddings: orig,
        ..
    } = m.rope_scaling
    {
        e.field(
            p.capture.max_context_len <= orig,
            "capture.max_context_len",
            || {
                format!(
                    "{} is above LongRoPE's original_max_position_embeddings {orig}: from position {orig} on the engines use the long factors",
                    p.capture.max_context_len
                )
            },
        );
    }
    e.field(
        p.rope_inv_freq.len() as u64 == m.head_dim as u64 / 2,
        "rope_inv_freq",
        || {
            format!(
                "{} entries, expected head_dim/2 = {}",
                p.rope_inv_freq.len(),
                m.head_dim / 2
            )
        },
    );
    e.field(
        p.rope_inv_freq.iter().all(|f| f.is_finite() && *f > 0.0),
        "rope_inv_freq",
        || "an entry is not finite and positive".into(),
    );
    // The table must be the one rope_theta and rope_scaling give (the kernels read the
    // table, the CPU executor too: a table of another theta would rotate both the same
    // wrong way). Within 2 ulps of f32: the compiler's f64 `powf` may differ by an ulp
    // between platforms' libm before the rounding to f32.
    let theta_ok = m.rope_theta.is_finite() && m.rope_theta > 0.0;
    if theta_ok && scaling_ok && p.rope_inv_freq.len() as u64 == m.head_dim as u64 / 2 {
        let want = crate::facts::rope_inv_freq(m);
        let off = p
            .rope_inv_freq
            .iter()
            .zip(&want)
            .position(|(&a, &b)| (a - b).abs() > 2.0 * f32::EPSILON * b.abs());
        if let Some(i) = off {
            e.field(false, &format!("rope_inv_freq[{i}]"), || {
                format!(
                    "{:e}, but rope_theta {} with {:?} gives {:e}",
                    p.rope_inv_freq[i], m.rope_theta, m.rope_scaling, want[i]
                )
            });
        }
    }
    e.field(p.layers.len() as u64 == m.layers as u64, "layers", || {
        format!("{} entries, expected model.layers = {}", p.layers.len(), m.layers)
    });
    for (i, l) in p.layers.iter().enumerate() {
        e.field(l.window != Some(0), &format!("layers[{i}].window"), || {
            "must be positive".into()
        });
    }
}

/// List lengths within the caps (checked first: everything after is linear or worse in them).
fn lengths(p: &Plan, e: &mut Errors) {
    for (path, n, max) in [
        ("phases", p.phases.len(), MAX_PHASES),
        ("kernels", p.kernels.len(), MAX_KERNELS),
        ("weights", p.weights.len(), MAX_WEIGHTS),
        ("fusions", p.fusions.len(), MAX_FUSIONS),
    ] {
        e.field(n <= max, path, || format!("{n} entries exceed {max}"));
    }
    let mut total = 0usize;
    for ph in p.phases.iter().take(MAX_PHASES) {
        let name = ph.kind.label();
        e.field(ph.buckets.len() <= MAX_BUCKETS, &format!("{name}.buckets"), || {
            format!("{} entries exceed {MAX_BUCKETS}", ph.buckets.len())
        });
        for (bi, b) in ph.buckets.iter().enumerate() {
            for (what, n) in [("buffers", b.buffers.len()), ("launches", b.launches.len())] {
                e.check(n <= MAX_BUCKET_ITEMS, || {
                    (
                        Location::bucket(ph.kind, bi, b.batch),
                        format!("{name}.buckets[{bi}].{what}: {n} entries exceed {MAX_BUCKET_ITEMS}"),
                    )
                });
                total = total.saturating_add(n);
            }
        }
    }
    e.field(total <= MAX_PLAN_ITEMS, "phases", || {
        format!("{total} buffers and launches in all exceed {MAX_PLAN_ITEMS}")
    });
}

fn spec(s: &SpecDesc, e: &mut Errors) {
    if let Some(r) = spec_rule(s) {
        let path = match r.field {
            SpecField::Topk => "spec.topk",
            SpecField::NumSteps => "spec.num_steps",
            SpecField::NumDraftTokens => "spec.num_draft_tokens",
        };
        e.field(false, path, || r.message);
    }
}

fn capture(p: &Plan, e: &mut Errors) {
    let c = &p.capture;
    e.field(
        c.page_size.is_power_of_two() && c.page_size <= MAX_PAGE_SIZE,
        "capture.page_size",
        || format!("{} is not a power of two in [1, {MAX_PAGE_SIZE}]", c.page_size),
    );
    e.field(
        c.max_context_len > p.spec.num_draft_tokens && c.max_context_len <= MAX_CONTEXT,
        "capture.max_context_len",
        || {
            format!(
                "{} is outside [num_draft_tokens + 1 = {}, {MAX_CONTEXT}]",
                c.max_context_len,
                p.spec.num_draft_tokens as u64 + 1
            )
        },
    );
    let pages = (c.max_context_len as u64).div_ceil(c.page_size.max(1) as u64);
    e.field(
        c.max_pages_per_request as u64 == pages,
        "capture.max_pages_per_request",
        || {
            format!(
                "{}, expected ceil(max_context_len / page_size) = {pages}",
                c.max_pages_per_request
            )
        },
    );
    let largest = p
        .phases
        .iter()
        .filter_map(|ph| ph.buckets.last())
        .map(|b| b.batch)
        .max()
        .unwrap_or(0);
    e.field(
        c.max_requests >= largest && c.max_requests <= MAX_REQUESTS,
        "capture.max_requests",
        || {
            format!(
                "{} is outside [largest bucket {largest}, {MAX_REQUESTS}]",
                c.max_requests
            )
        },
    );
    let entries = (c.max_requests as u64 + 1).saturating_mul(c.max_pages_per_request as u64);
    e.field(entries <= MAX_TABLE_ENTRIES, "capture.max_requests", || {
        format!(
            "the page table of {} rows × {} pages ({entries} entries) exceeds {MAX_TABLE_ENTRIES}",
            c.max_requests as u64 + 1,
            c.max_pages_per_request
        )
    });
    e.field(
        c.kv_pool_pages >= 2 && c.kv_pool_pages <= i32::MAX as u32,
        "capture.kv_pool_pages",
        || format!("{} is outside [2, 2^31 - 1]", c.kv_pool_pages),
    );
    e.field(
        c.scratch_page == c.kv_pool_pages.wrapping_sub(1),
        "capture.scratch_page",
        || {
            format!(
                "{} is not the pool's last page {}",
                c.scratch_page,
                c.kv_pool_pages.wrapping_sub(1)
            )
        },
    );
    let pool = (c.kv_pool_pages as u64)
        .checked_mul(c.page_size as u64)
        .and_then(|x| x.checked_mul(p.model.kv_heads as u64 * p.model.head_dim as u64 * 2))
        .and_then(|x| x.checked_mul(2 * p.model.layers as u64));
    e.field(
        pool.is_some_and(|b| b <= MAX_REGION_BYTES),
        "capture.kv_pool_pages",
        || format!("a pool of {} pages exceeds {MAX_REGION_BYTES} bytes", c.kv_pool_pages),
    );
    e.field(c.dtype.is_act(), "capture.dtype", || {
        format!("{} is not an activation type (bf16 or f16)", c.dtype.name())
    });
    if let Some(v) = c.hot_vocab_size {
        e.field(v >= p.spec.topk && v <= p.model.vocab, "capture.hot_vocab_size", || {
            format!("{v} must be in [topk = {}, vocab = {}]", p.spec.topk, p.model.vocab)
        });
    }
    e.field(c.outputs.topk || c.outputs.logits, "capture.outputs", || {
        "names no output besides hidden_out (expected topk, logits or both)".into()
    });
    e.field(c.outputs.topk || !c.outputs.draft_ids, "capture.outputs", || {
        "draft ids without a top-K".into()
    });
    e.field(printable(&p.name, 256), "name", || {
        "must be 1–256 printable characters".into()
    });
    let tp = c.tp;
    e.field(
        tp.size.is_power_of_two() && tp.size <= MAX_TP_SIZE,
        "capture.tp.size",
        || format!("{} is not a power of two in [1, {MAX_TP_SIZE}]", tp.size),
    );
    e.field(tp.rank < tp.size, "capture.tp.rank", || {
        format!("{} is not below tp size {}", tp.rank, tp.size)
    });
    e.field(
        !tp.vocab_embedding || (tp.is_sharded() && p.model.vocab.is_multiple_of(tp.size)),
        "capture.tp.vocab_embedding",
        || format!("needs tp size > 1 dividing vocab {}", p.model.vocab),
    );
    let lm_rows = c.hot_vocab_size.unwrap_or(p.model.lm_vocab());
    e.field(lm_rows.is_multiple_of(tp.size.max(1)), "capture.tp.size", || {
        format!("{} does not divide the {lm_rows} lm_head rows", tp.size)
    });
}

fn weights(p: &Plan, e: &mut Errors) {
    let mut spans: Vec<(u64, u64, usize)> = Vec::new();
    let mut names = HashSet::new();
    for (i, w) in p.weights.iter().enumerate() {
        let at = |msg: String| (Location::Weight(i as u32), format!("weights[{i}] ({}): {msg}", w.name));
        e.check(printable(&w.name, 256) && names.insert(w.name.as_str()), || {
            at("the name must be printable and unique".into())
        });
        e.check(!w.shape.is_empty() && w.shape.len() <= 2, || {
            at(format!("rank {} (weights are vectors or matrices)", w.shape.len()))
        });
        let elems = w.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let want = elems.and_then(|n| n.checked_mul(w.dtype.size()));
        e.check(want == Some(w.bytes) && w.bytes > 0, || {
            at(format!(
                "bytes {} do not match shape {:?} of {}",
                w.bytes,
                w.shape,
                w.dtype.name()
            ))
        });
        e.check(w.offset % ALIGN == 0, || {
            at(format!("offset {} not {ALIGN}-byte aligned", w.offset))
        });
        e.check(
            w.offset.checked_add(w.bytes).is_some_and(|end| end <= p.weight_bytes),
            || {
                at(format!(
                    "[{}, +{}) outside the weight region of {} bytes",
                    w.offset, w.bytes, p.weight_bytes
                ))
            },
        );
        let arity_ok = match w.packing {
            Packing::Single => w.sources.len() == 1,
            Packing::ConcatRows => !w.sources.is_empty() && w.sources.len() <= 8,
            Packing::GatherRows => w.sources.len() == 2,
            Packing::LeadingRows => w.sources.len() == 1 && w.shape.len() == 2,
        };
        e.check(arity_ok, || {
            at(format!(
                "{} sources do not fit packing {:?}",
                w.sources.len(),
                w.packing
            ))
        });
        e.check(w.sources.iter().all(|s| printable(s, 256)), || {
            at("a source name is not printable".into())
        });
        let tp = p.capture.tp;
        e.check(w.shard.is_empty() || w.dtype != DType::I64, || {
            at("an id map is whole on every rank (it has no shard)".into())
        });
        let parts = if w.packing == Packing::ConcatRows {
            w.sources.len()
        } else {
            1
        };
        e.check(
            w.shard.is_empty() || (tp.is_sharded() && w.shard.len() == parts),
            || {
                at(format!(
                    "{} shards for {parts} packed parts in a plan of tp size {}",
                    w.shard.len(),
                    tp.size
                ))
            },
        );
        for sh in &w.shard {
            // Kv heads replicated over ranks (T > kv heads) split into fewer parts than T (one
            // part: a single kv head every rank holds whole).
            let parts_ok = sh.parts >= 1 && sh.parts <= tp.size && tp.size.is_multiple_of(sh.parts);
            let index_ok = parts_ok && sh.index == tp.part_index(sh.parts);
            e.check(index_ok && (sh.axis as usize) < w.shape.len(), || {
                at(format!(
                    "shard {} of {} along axis {} does not fit rank {} of tp size {} (a rank-{} weight)",
                    sh.index,
                    sh.parts,
                    sh.axis,
                    tp.rank,
                    tp.size,
                    w.shape.len()
                ))
            });
        }
        let float = w.dtype == p.capture.dtype;
        let ids = w.dtype == DType::I64 && w.packing == Packing::Single;
        e.check(float || ids, || {
            at(format!(
                "dtype {} is neither the activation type nor an i64 id map",
                w.dtype.name()
            ))
        });
        spans.push((w.offset, w.offset.saturating_add(w.bytes), i));
    }
    spans.sort();
    for pair in spans.windows(2) {
        e.check(pair[0].1 <= pair[1].0, || {
            (
                Location::Weight(pair[1].2 as u32),
                format!(
                    "weights[{}] and weights[{}] overlap in the weight region",
                    pair[0].2, pair[1].2
                ),
            )
        });
    }
    let end = spans.iter().map(|s| s.1).max().unwrap_or(0);
    e.field(
        p.weight_bytes.div_ceil(ALIGN) <= end.div_ceil(ALIGN) && p.weight_bytes <= MAX_REGION_BYTES,
        "weight_bytes",
        || format!("{} bytes, but the weights end at {end}", p.weight_bytes),
    );
}
