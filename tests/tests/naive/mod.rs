//! What the naive forwards of the CPU-reference tests share: safetensors files, the
//! output reader, bf16 rounding, random vectors and the dense maths (matvec, RMSNorm, RoPE).
#![allow(dead_code)]

use std::path::Path;

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};
use specplan_tests::Rng;

mod eagle1;
// Not every test that includes these helpers builds an EAGLE-1 head.
#[allow(unused_imports)]
pub use eagle1::{make_model, reference_rope, Model};
mod eagle3;
#[allow(unused_imports)]
pub use eagle3::{make_head, Head};

pub fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect()
}

pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

pub fn bf16_tensor(name: &str, shape: Vec<usize>, v: &[f32]) -> Tensor {
    Tensor {
        name: name.into(),
        dtype: Dtype::BF16,
        shape,
        bytes: v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
    }
}
pub fn i64_tensor(name: &str, shape: Vec<usize>, v: &[i64]) -> Tensor {
    Tensor {
        name: name.into(),
        dtype: Dtype::I64,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}
pub fn i32_tensor(name: &str, shape: Vec<usize>, v: &[i32]) -> Tensor {
    Tensor {
        name: name.into(),
        dtype: Dtype::I32,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

pub fn save(path: &Path, tensors: &[Tensor]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes).expect("view"),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).expect("serialize")).expect("write");
}

pub fn rand_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    round_bf16(&(0..n).map(|_| rng.uniform() * scale).collect::<Vec<_>>())
}

pub fn matvec(w: &[f32], x: &[f64], rows: usize) -> Vec<f64> {
    let cols = x.len();
    (0..rows)
        .map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c]).sum())
        .collect()
}

pub fn rms(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    x.iter()
        .zip(w)
        .map(|(v, g)| v / (ms + eps).sqrt() * *g as f64)
        .collect()
}

/// RoPE with a given frequency table and a scale on cos and sin (YaRN's attention factor).
pub fn rope_with(x: &mut [f64], pos: usize, d: usize, inv: &[f32], scale: f64) {
    for head in x.chunks_mut(d) {
        for t in 0..d / 2 {
            let angle = (pos as f32 * inv[t]) as f64;
            let (s, c) = angle.sin_cos();
            let (s, c) = (s * scale, c * scale);
            let (a, b) = (head[t], head[t + d / 2]);
            head[t] = a * c - b * s;
            head[t + d / 2] = b * c + a * s;
        }
    }
}

pub fn rope(x: &mut [f64], pos: usize, d: usize, theta: f64) {
    for head in x.chunks_mut(d) {
        for t in 0..d / 2 {
            let inv = (1.0 / theta.powf(2.0 * t as f64 / d as f64)) as f32;
            let angle = (pos as f32 * inv) as f64;
            let (s, c) = angle.sin_cos();
            let (a, b) = (head[t], head[t + d / 2]);
            head[t] = a * c - b * s;
            head[t + d / 2] = b * c + a * s;
        }
    }
}

/// topk_probs, topk_ids, hidden_out, k_cache, v_cache.
pub type Outputs = (Vec<f32>, Vec<i64>, Vec<f32>, Vec<f32>, Vec<f32>);

pub fn read_out(path: &Path) -> Outputs {
    let bytes = std::fs::read(path).expect("read outputs");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("outputs parse");
    let f32s = |n: &str| -> Vec<f32> {
        let t = st.tensor(n).expect(n);
        match t.dtype() {
            Dtype::F32 => t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            _ => t
                .data()
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    };
    let ids = st
        .tensor("topk_ids")
        .expect("ids")
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
        .collect();
    (
        f32s("topk_probs"),
        ids,
        f32s("hidden_out"),
        f32s("k_cache"),
        f32s("v_cache"),
    )
}

/// The updated caches `kc`/`vc` against the naive forward: every written slot (its element
/// offset `base` and expected K and V rows, `what` naming it in messages) holds the new
/// values within bf16 rounding, and every other element is bit-identical to `k0`/`v0`.
pub fn check_cache(
    kc: &[f32],
    vc: &[f32],
    k0: &[f32],
    v0: &[f32],
    writes: &[(usize, String, &[f64], &[f64])],
    tag: &str,
) {
    let mut written = vec![false; kc.len()];
    for (base, what, k, v) in writes {
        for t in 0..k.len() {
            written[base + t] = true;
            for (got, exp, which) in [(kc[base + t], k[t], "k"), (vc[base + t], v[t], "v")] {
                let tol = 1e-2 * exp.abs().max(0.05);
                assert!(
                    (got as f64 - exp).abs() <= tol,
                    "{tag} {which}_cache {what} [{t}]: {got} vs {exp}"
                );
            }
        }
    }
    for (e, w) in written.iter().enumerate() {
        if !w {
            assert_eq!(kc[e].to_bits(), k0[e].to_bits(), "{tag}: k_cache element {e} changed");
            assert_eq!(vc[e].to_bits(), v0[e].to_bits(), "{tag}: v_cache element {e} changed");
        }
    }
}

/// What a random step is made of: the pool's layers and heads, the target vocabulary the
/// input ids come from, the width of the target's hidden states, the longest prefix.
pub struct StepShape {
    pub layers: usize,
    pub hkv: usize,
    pub d: usize,
    pub vocab: usize,
    pub hidden_in: usize,
    pub max_prefix: usize,
}

/// One step's inputs as the naive forward reads them (the file holds their bf16 rounding
/// where the dtype is bf16: the caches and hidden states are drawn as bf16 values).
pub struct Step {
    pub b: usize,
    pub ids: Vec<i64>,
    pub hidden: Vec<f32>,
    pub prefix: Vec<i32>,
    pub accept: Vec<i32>,
    /// `[b, cols]` page ids.
    pub table: Vec<i32>,
    pub cols: usize,
    /// Pages in the pool, per layer.
    pub pages: usize,
    /// `[layers, pages, page_size, hkv, d]`.
    pub k_cache: Vec<f32>,
    pub v_cache: Vec<f32>,
}

/// A random step of `b` requests for `plan`, written to `dir/inputs.safetensors`: prefixes up
/// to `s.max_prefix`, accept lengths in [1, N], pages dealt in a random order so requests
/// interleave in the pool, and every cache value random (so an unwritten slot that changes
/// shows).
pub fn random_step(plan: &specplan_format::ValidatedPlan, s: &StepShape, rng: &mut Rng, b: usize, dir: &Path) -> Step {
    let n = plan.spec.num_draft_tokens as usize;
    let ps = plan.capture.page_size as usize;
    let cols = (s.max_prefix + n).div_ceil(ps) + 1;
    let pages = b * cols + 3;
    let mut order: Vec<i32> = (0..pages as i32).collect();
    for i in (1..pages).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let per_layer = pages * ps * s.hkv * s.d;
    let step = Step {
        b,
        ids: (0..b * n).map(|_| rng.below(s.vocab) as i64).collect(),
        hidden: rand_vec(rng, b * n * s.hidden_in, 1.0),
        prefix: (0..b).map(|_| rng.below(s.max_prefix + 1) as i32).collect(),
        accept: (0..b).map(|_| 1 + rng.below(n) as i32).collect(),
        table: order[..b * cols].to_vec(),
        cols,
        pages,
        k_cache: rand_vec(rng, s.layers * per_layer, 1.0),
        v_cache: rand_vec(rng, s.layers * per_layer, 1.0),
    };
    let kv_shape = vec![s.layers, pages, ps, s.hkv, s.d];
    save(
        &dir.join("inputs.safetensors"),
        &[
            i64_tensor("input_ids", vec![b, n], &step.ids),
            bf16_tensor("hidden_states", vec![b, n, s.hidden_in], &step.hidden),
            i32_tensor("prefix_lens", vec![b], &step.prefix),
            i32_tensor("accept_lens", vec![b], &step.accept),
            i32_tensor("page_table", vec![b, cols], &step.table),
            bf16_tensor("k_cache", kv_shape.clone(), &step.k_cache),
            bf16_tensor("v_cache", kv_shape, &step.v_cache),
        ],
    );
    step
}

/// Each request's outputs against the naive forward: `hidden_out` (one bf16 rounding in the
/// file) within 8e-3 relative, every top-K probability within 1e-4 + 1e-3·p, the target id
/// equal wherever the probability is not within 1e-4 of a neighbour's, and inside `[0, vocab)`.
pub fn check_requests(got: &Outputs, want_hidden: &[Vec<f64>], want_top: &[Vec<(f64, i64)>], vocab: usize, tag: &str) {
    let (probs, ids, hidden_out, _, _) = got;
    for (i, (wh, wt)) in want_hidden.iter().zip(want_top).enumerate() {
        let h = wh.len();
        let (mut num, mut den) = (0f64, 0f64);
        for (c, w) in wh.iter().enumerate() {
            num += (hidden_out[i * h + c] as f64 - w).powi(2);
            den += w.powi(2);
        }
        let rel = (num / den).sqrt();
        println!("{tag} request {i}: hidden_out relative error {rel:.2e}");
        assert!(rel < 8e-3, "{tag} request {i}: hidden_out relative error {rel}");
        let k_top = wt.len();
        for (s, &(p, id)) in wt.iter().enumerate() {
            let got_p = probs[i * k_top + s] as f64;
            assert!(
                (got_p - p).abs() < 1e-4 + 1e-3 * p,
                "{tag} req {i} slot {s}: prob {got_p} vs {p}"
            );
            let gap_prev = if s > 0 { wt[s - 1].0 - p } else { 1.0 };
            let gap_next = wt.get(s + 1).map_or(1.0, |x| p - x.0);
            let got_id = ids[i * k_top + s];
            if gap_prev > 1e-4 && gap_next > 1e-4 {
                assert_eq!(got_id, id, "{tag} req {i} slot {s}: target id");
            }
            assert!(
                (0..vocab as i64).contains(&got_id),
                "{tag} req {i} slot {s}: id {got_id} outside the vocabulary"
            );
        }
    }
}
