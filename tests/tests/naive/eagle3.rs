//! An EAGLE-3 head as the naive forwards read it: random bf16 weights under the released
//! checkpoint names (`fc` over three target layers, `midlayer.*` with its 2H-wide q/k/v,
//! `norm`, a draft-vocabulary `lm_head`, `d2t`), written to a safetensors file.

use std::path::Path;

use specplan_format::{HeadKind, ValidatedPlan};
use specplan_tests::Rng;

use super::{bf16_tensor, i64_tensor, rand_vec, round_bf16, save, Tensor};

/// The head's weights as the naive forward reads them (bf16-rounded, as in the file).
pub struct Head {
    pub h: usize,
    pub ht3: usize,
    pub inter: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub vocab: usize,
    pub vd: usize,
    pub eps: f64,
    pub theta: f64,
    pub embed: Vec<f32>,
    pub fc: Vec<f32>,
    pub n_embed: Vec<f32>,
    pub n_hidden: Vec<f32>,
    pub n_post: Vec<f32>,
    pub n_final: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub wo: Vec<f32>,
    pub wg: Vec<f32>,
    pub wu: Vec<f32>,
    pub wd: Vec<f32>,
    pub lm: Vec<f32>,
    pub d2t: Vec<i64>,
}

fn norm_w(rng: &mut Rng, h: usize) -> Vec<f32> {
    round_bf16(&(0..h).map(|_| 1.0 + 0.2 * rng.uniform()).collect::<Vec<_>>())
}

/// Random EAGLE-3 weights for `plan` (bf16-rounded, the released checkpoint names, a `t2d`
/// the contract ignores), saved as `dir/weights.safetensors`.
pub fn make_head(plan: &ValidatedPlan, rng: &mut Rng, dir: &Path) -> Head {
    let m = &plan.model;
    assert_eq!(m.head, HeadKind::Eagle3);
    let (h, hq, hkv, d) = (
        m.hidden as usize,
        m.heads as usize,
        m.kv_heads as usize,
        m.head_dim as usize,
    );
    let (vocab, vd, ht3, inter) = (
        m.vocab as usize,
        m.lm_vocab() as usize,
        m.hidden_in() as usize,
        m.intermediate as usize,
    );
    let s = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    // d2t: the draft vocabulary is a sorted random subset of the target's.
    let mut targets = rng.permutation(vocab);
    targets.truncate(vd);
    targets.sort_unstable();
    let d2t: Vec<i64> = targets.iter().enumerate().map(|(i, &t)| t as i64 - i as i64).collect();
    let head = Head {
        h,
        ht3,
        inter,
        hq,
        hkv,
        d,
        vocab,
        vd,
        eps: m.rms_norm_eps as f64,
        theta: m.rope_theta as f64,
        embed: rand_vec(rng, vocab * h, 1.0),
        fc: rand_vec(rng, h * ht3, s(ht3)),
        n_embed: norm_w(rng, h),
        n_hidden: norm_w(rng, h),
        n_post: norm_w(rng, h),
        n_final: norm_w(rng, h),
        wq: rand_vec(rng, hq * d * 2 * h, s(2 * h)),
        wk: rand_vec(rng, hkv * d * 2 * h, s(2 * h)),
        wv: rand_vec(rng, hkv * d * 2 * h, s(2 * h)),
        wo: rand_vec(rng, h * hq * d, s(hq * d)),
        wg: rand_vec(rng, inter * h, s(h)),
        wu: rand_vec(rng, inter * h, s(h)),
        wd: rand_vec(rng, h * inter, s(inter)),
        lm: rand_vec(rng, vd * h, 4.0 * s(h)),
        d2t,
    };
    let t2d: Vec<u8> = {
        let mut v = vec![0u8; vocab];
        for &t in &targets {
            v[t] = 1;
        }
        v
    };
    let p = "midlayer.";
    save(
        &dir.join("weights.safetensors"),
        &[
            bf16_tensor("embed_tokens.weight", vec![vocab, h], &head.embed),
            bf16_tensor("fc.weight", vec![h, ht3], &head.fc),
            bf16_tensor(&format!("{p}input_layernorm.weight"), vec![h], &head.n_embed),
            bf16_tensor(&format!("{p}hidden_norm.weight"), vec![h], &head.n_hidden),
            bf16_tensor(&format!("{p}post_attention_layernorm.weight"), vec![h], &head.n_post),
            bf16_tensor(&format!("{p}self_attn.q_proj.weight"), vec![hq * d, 2 * h], &head.wq),
            bf16_tensor(&format!("{p}self_attn.k_proj.weight"), vec![hkv * d, 2 * h], &head.wk),
            bf16_tensor(&format!("{p}self_attn.v_proj.weight"), vec![hkv * d, 2 * h], &head.wv),
            bf16_tensor(&format!("{p}self_attn.o_proj.weight"), vec![h, hq * d], &head.wo),
            bf16_tensor(&format!("{p}mlp.gate_proj.weight"), vec![inter, h], &head.wg),
            bf16_tensor(&format!("{p}mlp.up_proj.weight"), vec![inter, h], &head.wu),
            bf16_tensor(&format!("{p}mlp.down_proj.weight"), vec![h, inter], &head.wd),
            bf16_tensor("norm.weight", vec![h], &head.n_final),
            bf16_tensor("lm_head.weight", vec![vd, h], &head.lm),
            i64_tensor("d2t", vec![vd], &head.d2t),
            Tensor {
                name: "t2d".into(),
                dtype: safetensors::tensor::Dtype::BOOL,
                shape: vec![vocab],
                bytes: t2d,
            },
        ],
    );
    head
}
