//! Kernel facts of a plan: what every kernel instance is specialized for, computed from the
//! plan's descriptors. The compiler calls the same function on the descriptors it emits,
//! so the constants it writes and the ones the validator expects cannot drift apart.

use specplan_kernels::facts::{BucketFacts, KernelFacts};

use crate::types::{BucketPlan, CaptureDesc, ModelDesc, PhaseKind, Plan, RopeScaling, SpecDesc};

/// Facts of a plan with these descriptors (window 0: see [`KernelFacts::with_window`]), for
/// the kernels of the draft-extend phase (`n`: its rows per request, the one definition in
/// `PhaseKind::rows_per_request`).
pub fn kernel_facts(m: &ModelDesc, s: &SpecDesc, c: &CaptureDesc, inv_freq: &[f32]) -> KernelFacts {
    KernelFacts {
        act: c.dtype,
        hidden: m.hidden,
        hidden_in: m.hidden_in(),
        intermediate: m.intermediate,
        heads: m.heads,
        kv_heads: m.kv_heads,
        head_dim: m.head_dim,
        vocab: m.vocab,
        cols: c.hot_vocab_size.unwrap_or(m.lm_vocab()),
        n: PhaseKind::DraftExtend.rows_per_request(s),
        topk: s.topk,
        page_size: c.page_size,
        max_context: c.max_context_len,
        eps: m.rms_norm_eps,
        inv_freq: inv_freq.to_vec(),
        window: 0,
        has_bias: m.fc_bias,
        hot_map: c.hot_vocab_size.is_some() && c.outputs.maps_ids(),
        id_offset: m.draft_vocab.is_some() && c.outputs.maps_ids(),
        out_topk: c.outputs.topk,
        out_logits: c.outputs.logits,
    }
}

/// Hugging Face Llama `inv_freq` after `rope_scaling`, computed in f64 and rounded once. The
/// compiler writes it into the plan; the validator checks a plan's table against it.
pub fn rope_inv_freq(m: &ModelDesc) -> Vec<f32> {
    let d = m.head_dim as f64;
    let theta = m.rope_theta as f64;
    (0..m.head_dim / 2)
        .map(|i| {
            let base = 1.0 / theta.powf(2.0 * i as f64 / d);
            let scaled = match &m.rope_scaling {
                RopeScaling::None => base,
                RopeScaling::Linear { factor } => base / *factor as f64,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => {
                    let (factor, low, high) = (*factor as f64, *low_freq_factor as f64, *high_freq_factor as f64);
                    let old = *original_max_position_embeddings as f64;
                    let low_wavelen = old / low;
                    let high_wavelen = old / high;
                    let wavelen = 2.0 * std::f64::consts::PI / base;
                    if wavelen < high_wavelen {
                        base
                    } else if wavelen > low_wavelen {
                        base / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * base / factor + smooth * base
                    }
                }
            };
            scaled as f32
        })
        .collect()
}

pub fn kernel_facts_of(p: &Plan) -> KernelFacts {
    kernel_facts(&p.model, &p.spec, &p.capture, &p.rope_inv_freq)
}

pub fn bucket_facts(b: &BucketPlan) -> BucketFacts {
    BucketFacts {
        batch: b.batch,
        rows: b.rows,
        splits: b.attn_splits,
    }
}
