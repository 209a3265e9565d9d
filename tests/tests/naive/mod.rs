//! What the naive forwards of the CPU-reference tests share: safetensors files, the
//! output reader, bf16 rounding, random vectors and the dense maths (matvec, RMSNorm, RoPE).
#![allow(dead_code)]

use std::path::Path;

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};
use specplan_tests::Rng;

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
