//! Kernel facts of a plan: what every kernel instance is specialized for, computed from the
//! plan's descriptors. The compiler calls the same function on the descriptors it emits,
//! so the constants it writes and the ones the validator expects cannot drift apart.

use specplan_kernels::facts::{BucketFacts, KernelFacts};
use specplan_kernels::DType;

use crate::types::{
    BucketPlan, CaptureDesc, LayerDesc, ModelDesc, PhaseKind, Plan, RopeScaling, SpecDesc, TensorParallel,
};

/// Facts of a plan with these descriptors (window 0: see [`KernelFacts::with_window`]), for
/// the kernels of the draft-extend phase (`n`: its rows per request, the one definition in
/// `PhaseKind::rows_per_request`).
pub fn kernel_facts(m: &ModelDesc, s: &SpecDesc, c: &CaptureDesc, inv_freq: &[f32]) -> KernelFacts {
    phase_facts(m, s, c, inv_freq, PhaseKind::DraftExtend)
}

/// Facts of the kernels of phase `kind` (step 0: see [`KernelFacts::at_step`]). Draft decode
/// always maps its ids (its tokens are target ids whatever the draft-extend outputs are).
pub fn phase_facts(m: &ModelDesc, s: &SpecDesc, c: &CaptureDesc, inv_freq: &[f32], kind: PhaseKind) -> KernelFacts {
    let decode = matches!(kind, PhaseKind::DraftDecode { .. });
    let maps = decode || c.outputs.maps_ids();
    let embed = c.tp.embedding_rows(m.vocab);
    KernelFacts {
        act: c.dtype,
        stream: stream_dtype(kind, c.dtype, c.tp),
        hidden: m.hidden,
        hidden_in: m.hidden_in(),
        intermediate: m.intermediate,
        heads: m.heads,
        kv_heads: m.kv_heads,
        head_dim: m.head_dim,
        vocab: m.vocab,
        // A rank's share of the lm_head rows (validation holds T to divide them).
        cols: c.hot_vocab_size.unwrap_or(m.lm_vocab()) / c.tp.size.max(1),
        n: kind.rows_per_request(s),
        topk: s.topk,
        page_size: c.page_size,
        max_context: c.max_context_len,
        eps: m.rms_norm_eps,
        inv_freq: inv_freq.to_vec(),
        rope_scale: rope_attention_scale(m),
        window: 0,
        select_from: 0,
        lanes: kind.steps(),
        step: 0,
        draft_tokens: kind.draft_tokens(s),
        has_bias: m.fc_bias,
        head_norm: m.head == crate::types::HeadKind::Eagle3,
        hot_map: c.hot_vocab_size.is_some() && maps,
        id_offset: m.draft_vocab.is_some() && maps,
        out_topk: c.outputs.topk || decode,
        out_logits: c.outputs.logits && !decode,
        tp_size: c.tp.size,
        tp_rank: c.tp.rank,
        embed_rows: embed.0,
        embed_start: embed.1,
        zero_hidden: c.tp.vocab_embedding && c.tp.rank > 0,
    }
}

/// The residual stream's dtype in phase `kind` (`KernelFacts::stream`; the lowering builds
/// the stream's tensors with it): f32 in an unsharded draft-extend phase — its fc, o_proj and
/// down GEMMs accumulate in f32 and the stream is rounded once, into `hidden_out` — and the
/// activation type in draft decode (whose forwards hand each other activation rows) and in
/// sharded plans (whose all-reduces sum activation rows).
pub fn stream_dtype(kind: PhaseKind, act: DType, tp: TensorParallel) -> DType {
    if matches!(kind, PhaseKind::DraftDecode { .. }) || tp.is_sharded() {
        act
    } else {
        DType::F32
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
                y @ RopeScaling::Yarn { .. } => yarn_inv_freq(theta, d, i, y),
                RopeScaling::LongRope { short_factor, .. } => {
                    base / short_factor.get(i as usize).copied().unwrap_or(1.0) as f64
                }
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

/// YaRN's frequency `i` of `d`: the blend of interpolated and extrapolated frequencies
/// (SGLang's `_compute_inv_freq`, in f64).
fn yarn_inv_freq(theta: f64, d: f64, i: u32, y: &RopeScaling) -> f64 {
    let RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: orig,
        beta_fast,
        beta_slow,
        truncate,
        ..
    } = *y
    else {
        return 1.0 / theta.powf(2.0 * i as f64 / d);
    };
    let (factor, orig, fast, slow) = (factor as f64, orig as f64, beta_fast as f64, beta_slow as f64);
    let pos_freq = theta.powf(2.0 * i as f64 / d);
    let (extra, inter) = (1.0 / pos_freq, 1.0 / (factor * pos_freq));
    // The dimension whose wavelength fits `rot` rotations into `orig` positions.
    let dim_of = |rot: f64| d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (dim_of(fast), dim_of(slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001;
    }
    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
    let keep = 1.0 - ramp;
    inter * (1.0 - keep) + extra * keep
}

/// `0.1·m·ln(scale) + 1` (1 for scale ≤ 1): YaRN's magnitude correction.
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// The factor the rotated q and k are multiplied by (1 except under YaRN and LongRoPE):
/// SGLang 0.5.23's `YaRNScalingRotaryEmbedding.mscale`
/// (`srt/layers/rotary_embedding/yarn.py:122-130`) and `Phi3LongRoPEScaledRotaryEmbedding.
/// short_mscale` (`rope_variant.py:66-78`), rounded once to f32.
pub fn rope_attention_scale(m: &ModelDesc) -> f32 {
    match &m.rope_scaling {
        RopeScaling::Yarn {
            factor,
            mscale: Some(a),
            mscale_all_dim: Some(b),
            ..
        } => (yarn_mscale(*factor as f64, *a as f64) / yarn_mscale(*factor as f64, *b as f64)) as f32,
        RopeScaling::Yarn { factor, .. } => yarn_mscale(*factor as f64, 1.0) as f32,
        RopeScaling::LongRope {
            short_mscale: Some(x), ..
        } => *x,
        RopeScaling::LongRope {
            original_max_position_embeddings: orig,
            ..
        } => {
            let scale = m.max_position_embeddings as f64 / *orig as f64;
            if scale <= 1.0 || *orig <= 1 {
                1.0
            } else {
                (1.0 + scale.ln() / (*orig as f64).ln()).sqrt() as f32
            }
        }
        _ => 1.0,
    }
}

/// The sliding window that bounds every layer's reads (0: some layer reads its whole
/// prefix): the widest of the layers' windows. `admit` and `admit_decode` check the table
/// entries of prefix positions from `max(0, L − W + 1)` on, the oldest any layer's attention
/// reads (the io kernels' WINDOW constant).
pub fn read_window(windows: impl IntoIterator<Item = Option<u32>>) -> u32 {
    let mut widest = 0;
    for w in windows {
        match w {
            Some(w) => widest = widest.max(w),
            None => return 0,
        }
    }
    widest
}

/// The io kernels' facts (`admit`, `emit`, their draft-decode forms, `fill`, `stage_in`,
/// `l2_prefetch`): the draft-extend facts with the layers' read window.
pub fn io_facts(f: &KernelFacts, layers: &[LayerDesc]) -> KernelFacts {
    let w = read_window(layers.iter().map(|l| l.window));
    f.with_window((w != 0).then_some(w))
}

pub fn kernel_facts_of(p: &Plan) -> KernelFacts {
    kernel_facts(&p.model, &p.spec, &p.capture, &p.rope_inv_freq)
}

/// [`phase_facts`] of a plan's phase.
pub fn phase_facts_of(p: &Plan, kind: PhaseKind) -> KernelFacts {
    phase_facts(&p.model, &p.spec, &p.capture, &p.rope_inv_freq, kind)
}

pub fn bucket_facts(b: &BucketPlan) -> BucketFacts {
    BucketFacts {
        batch: b.batch,
        rows: b.rows,
        splits: b.attn_splits,
        attn_cluster: b.attn_cluster,
        attn_last_cta: b.attn_last_cta,
    }
}
