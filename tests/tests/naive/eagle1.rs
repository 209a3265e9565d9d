//! An EAGLE-1 head as the naive forwards read it: random bf16 weights written to a
//! safetensors file, and the RoPE table written from the definitions (independently of the
//! format crate's `rope_inv_freq`).

use std::path::Path;

use specplan_format::{RopeScaling, ValidatedPlan};
use specplan_tests::Rng;

use super::{bf16_tensor, i64_tensor, rand_vec, round_bf16, save};

/// Model weights as the naive forward reads them (already bf16-rounded, as in the file).
pub struct Model {
    pub h: usize,
    pub inter: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub layers: usize,
    pub vocab: usize,
    pub eps: f64,
    /// RoPE frequencies and the cos/sin scale, computed here from the config (not the plan's
    /// table): plain `θ^(−2t/d)`, or YaRN's blend and attention factor.
    pub inv_freq: Vec<f32>,
    pub rope_scale: f64,
    pub embed: Vec<f32>,
    pub fc_w: Vec<f32>,
    pub fc_b: Vec<f32>,
    pub wq: Vec<Vec<f32>>,
    pub wk: Vec<Vec<f32>>,
    pub wv: Vec<Vec<f32>>,
    pub wo: Vec<Vec<f32>>,
    pub wg: Vec<Vec<f32>>,
    pub wu: Vec<Vec<f32>>,
    pub wd: Vec<Vec<f32>>,
    pub n_in: Vec<Vec<f32>>,
    pub n_post: Vec<Vec<f32>>,
    pub lm: Vec<f32>,
    pub hot: Option<Vec<i64>>,
}

/// The RoPE table and cos/sin scale of a model, written from the definitions (YaRN: Peng et
/// al., as SGLang's `YaRNScalingRotaryEmbedding` applies it), independently of the format
/// crate's `rope_inv_freq`.
pub fn reference_rope(m: &specplan_format::ModelDesc) -> (Vec<f32>, f64) {
    let (d, theta) = (m.head_dim as f64, m.rope_theta as f64);
    let plain = |t: usize| theta.powf(-2.0 * t as f64 / d);
    match &m.rope_scaling {
        RopeScaling::None => ((0..m.head_dim as usize / 2).map(|t| plain(t) as f32).collect(), 1.0),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            let f = *factor as f64;
            // The dimension index at which `rot` full turns fit the training length.
            let at = |rot: f32| d * (*orig as f64 / (rot as f64 * std::f64::consts::TAU)).ln() / (2.0 * theta.ln());
            let (mut lo, mut hi) = (at(*beta_fast), at(*beta_slow));
            if *truncate {
                (lo, hi) = (lo.floor(), hi.ceil());
            }
            let (lo, hi) = (lo.max(0.0), hi.min(d - 1.0));
            let hi = if hi == lo { hi + 0.001 } else { hi };
            let inv = (0..m.head_dim as usize / 2)
                .map(|t| {
                    // 0 below `lo` (keep the trained frequency), 1 above `hi` (interpolate).
                    let gamma = ((t as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    (plain(t) * (1.0 - gamma) + plain(t) / f * gamma) as f32
                })
                .collect();
            let ms = |m: f64| if f <= 1.0 { 1.0 } else { 0.1 * m * f.ln() + 1.0 };
            let scale = match (mscale, mscale_all_dim) {
                (Some(a), Some(b)) => ms(*a as f64) / ms(*b as f64),
                _ => ms(1.0),
            };
            (inv, scale as f32 as f64)
        }
        RopeScaling::LongRope {
            short_factor,
            original_max_position_embeddings: orig,
            short_mscale,
        } => {
            let inv = (0..m.head_dim as usize / 2)
                .map(|t| (plain(t) / short_factor[t] as f64) as f32)
                .collect();
            let ratio = m.max_position_embeddings as f64 / *orig as f64;
            let scale = short_mscale.map_or_else(
                || {
                    if ratio > 1.0 {
                        (1.0 + ratio.ln() / (*orig as f64).ln()).sqrt()
                    } else {
                        1.0
                    }
                },
                |x| x as f64,
            );
            (inv, scale as f32 as f64)
        }
        other => panic!("the naive forward has no reference for {other:?}"),
    }
}

/// Random EAGLE-1 weights for `plan` (bf16-rounded), saved as `dir/weights.safetensors`;
/// lm_head's scale is `lm_scale / sqrt(hidden)` (larger: more peaked distributions).
pub fn make_model(plan: &ValidatedPlan, rng: &mut Rng, dir: &Path, lm_scale: f32) -> Model {
    let m = &plan.model;
    let (h, inter, hq, hkv, d, layers, vocab) = (
        m.hidden as usize,
        m.intermediate as usize,
        m.heads as usize,
        m.kv_heads as usize,
        m.head_dim as usize,
        m.layers as usize,
        m.vocab as usize,
    );
    let s = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let per_layer = |rng: &mut Rng, rows: usize, cols: usize| -> Vec<Vec<f32>> {
        (0..layers).map(|_| rand_vec(rng, rows * cols, s(cols))).collect()
    };
    let hot = plan.capture.hot_vocab_size.map(|vh| {
        let vh = vh as usize;
        let mut ids: Vec<i64> = (0..vocab as i64).collect();
        for i in 0..vh {
            let j = i + rng.below(vocab - i);
            ids.swap(i, j);
        }
        ids.truncate(vh);
        ids
    });
    let norm = |rng: &mut Rng| -> Vec<Vec<f32>> {
        (0..layers)
            .map(|_| round_bf16(&(0..h).map(|_| 1.0 + 0.2 * rng.uniform()).collect::<Vec<_>>()))
            .collect()
    };
    let model = Model {
        h,
        inter,
        hq,
        hkv,
        d,
        layers,
        vocab,
        eps: m.rms_norm_eps as f64,
        inv_freq: reference_rope(m).0,
        rope_scale: reference_rope(m).1,
        embed: rand_vec(rng, vocab * h, 1.0),
        fc_w: rand_vec(rng, h * 2 * h, s(2 * h)),
        fc_b: rand_vec(rng, h, 0.1),
        wq: per_layer(rng, hq * d, h),
        wk: per_layer(rng, hkv * d, h),
        wv: per_layer(rng, hkv * d, h),
        wo: per_layer(rng, h, hq * d),
        wg: per_layer(rng, inter, h),
        wu: per_layer(rng, inter, h),
        wd: per_layer(rng, h, inter),
        n_in: norm(rng),
        n_post: norm(rng),
        lm: rand_vec(rng, vocab * h, lm_scale * s(h)),
        hot,
    };
    let mut t = vec![
        bf16_tensor("embed_tokens.weight", vec![vocab, h], &model.embed),
        bf16_tensor("fc.weight", vec![h, 2 * h], &model.fc_w),
        bf16_tensor("fc.bias", vec![h], &model.fc_b),
        bf16_tensor("lm_head.weight", vec![vocab, h], &model.lm),
    ];
    for l in 0..layers {
        let p = format!("layers.{l}.");
        t.push(bf16_tensor(
            &format!("{p}self_attn.q_proj.weight"),
            vec![hq * d, h],
            &model.wq[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}self_attn.k_proj.weight"),
            vec![hkv * d, h],
            &model.wk[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}self_attn.v_proj.weight"),
            vec![hkv * d, h],
            &model.wv[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}self_attn.o_proj.weight"),
            vec![h, hq * d],
            &model.wo[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}mlp.gate_proj.weight"),
            vec![inter, h],
            &model.wg[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}mlp.up_proj.weight"),
            vec![inter, h],
            &model.wu[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}mlp.down_proj.weight"),
            vec![h, inter],
            &model.wd[l],
        ));
        // Layer 0's input norm is present in checkpoints but must be ignored (identity).
        t.push(bf16_tensor(
            &format!("{p}input_layernorm.weight"),
            vec![h],
            &model.n_in[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}post_attention_layernorm.weight"),
            vec![h],
            &model.n_post[l],
        ));
    }
    if let Some(ids) = &model.hot {
        t.push(i64_tensor("hot_token_ids", vec![ids.len()], ids));
    }
    save(&dir.join("weights.safetensors"), &t);
    model
}
