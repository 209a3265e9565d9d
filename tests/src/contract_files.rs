//! The `run` contract's files for a plan, filled with random values, and the plan's facts as
//! JSON — what a program outside Rust (the PyTorch + FlashInfer peer of `tests/peer/`)
//! needs to run the same forward on the same inputs.
//!
//! - weights: every tensor under its Hugging Face name (what a checkpoint holds, before the
//!   plan's packing), in the plan's activation dtype, scaled so activations stay O(1) (the
//!   same distributions as `gpucheck`'s); under FR-Spec the full `lm_head.weight` and
//!   `hot_token_ids`;
//! - inputs: `input_ids`, `hidden_states`, `prefix_lens` (request 0 at the given maximum,
//!   the rest random below it), `accept_lens`, `page_table` (pages dealt in random order)
//!   and random `k_cache`/`v_cache` holding exactly the pages the requests use.
//!
//! Large tensors are generated in parallel chunks, each from its own generator seeded by
//! the seed and the chunk's index, so a seed gives the same files on any machine.

use specplan_format::io;
use specplan_format::PhaseKind;
use std::collections::HashSet;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use specplan_format::{DType, Packing, Plan};

use crate::Rng;

/// One safetensors tensor, little-endian bytes.
#[derive(Clone, Debug)]
pub struct FileTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

fn file_dtype(act: DType) -> Dtype {
    match act {
        DType::F16 => Dtype::F16,
        _ => Dtype::BF16,
    }
}

fn act_bits(x: f32, act: DType) -> u16 {
    match act {
        DType::F16 => half::f16::from_f32(x).to_bits(),
        _ => half::bf16::from_f32(x).to_bits(),
    }
}

/// splitmix64 of (seed, stream): independent, never-zero xorshift states.
fn stream_seed(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) | 1
}

const CHUNK: usize = 1 << 20;

/// `n` activation values `f(u)`, u uniform in [-1, 1), as bytes; tensor `stream` of `seed`.
fn random_act(n: usize, seed: u64, stream: u64, act: DType, f: impl Fn(f32) -> f32 + Sync) -> Vec<u8> {
    let mut out = vec![0u8; n * 2];
    let mut chunks: Vec<(usize, &mut [u8])> = out.chunks_mut(CHUNK * 2).enumerate().collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(chunks.len())
        .max(1);
    let per = chunks.len().div_ceil(threads).max(1);
    let f = &f;
    let base = stream_seed(seed, stream);
    std::thread::scope(|s| {
        for group in chunks.chunks_mut(per) {
            s.spawn(move || {
                for (c, bytes) in group.iter_mut() {
                    let mut rng = Rng(stream_seed(base, *c as u64));
                    for e in bytes.chunks_exact_mut(2) {
                        e.copy_from_slice(&act_bits(f(rng.uniform()), act).to_le_bytes());
                    }
                }
            });
        }
    });
    out
}

/// How a weight file tensor is initialized, from its name: RMSNorm weights 1 + 0.2·u, the
/// fc bias 0.1·u, the embedding u, lm_head 4·u/√cols, every other matrix u/√cols.
fn init_scale(name: &str, cols: usize) -> (f32, f32) {
    let cols = cols.max(1) as f32;
    // RMSNorm weights: layernorms, EAGLE-3's hidden_norm and final norm.
    if name.ends_with("norm.weight") {
        (1.0, 0.2)
    } else if name.ends_with("bias") {
        (0.0, 0.1)
    } else if name.contains("embed") {
        (0.0, 1.0)
    } else if name.contains("lm_head") {
        (0.0, 4.0 / cols.sqrt())
    } else {
        (0.0, 1.0 / cols.sqrt())
    }
}

/// Rows of one source of a `ConcatRows` weight (the runtime's rule, `source_rows`).
fn concat_rows(plan: &Plan, source: &str) -> Result<usize, String> {
    specplan_runtime::registration::source_rows(&plan.model, source)
        .map(|r| r as usize)
        .ok_or_else(|| format!("no row count known for the concatenated source {source}"))
}

/// Random weights under their file names, one tensor per name.
pub fn weight_tensors(plan: &Plan, seed: u64) -> Result<Vec<FileTensor>, String> {
    let m = &plan.model;
    let act = plan.capture.dtype;
    let (vocab, h) = (m.vocab as usize, m.hidden as usize);
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut stream = 0u64;
    let mut float = |out: &mut Vec<FileTensor>, name: &str, shape: Vec<usize>| {
        let cols = if shape.len() > 1 {
            shape[1..].iter().product()
        } else {
            1
        };
        let (base, scale) = init_scale(name, cols);
        let n = shape.iter().product();
        stream += 1;
        out.push(FileTensor {
            name: name.to_string(),
            dtype: file_dtype(act),
            bytes: random_act(n, seed, stream, act, |u| base + scale * u),
            shape,
        });
    };
    let hot = |out: &mut Vec<FileTensor>, count: usize| {
        let mut rng = Rng(stream_seed(seed, u64::MAX));
        let mut ids = rng.permutation(vocab);
        ids.truncate(count);
        out.push(FileTensor {
            name: "hot_token_ids".into(),
            dtype: Dtype::I64,
            shape: vec![count],
            bytes: ids.iter().flat_map(|&x| (x as i64).to_le_bytes()).collect(),
        });
    };
    for w in &plan.weights {
        let shape: Vec<usize> = w.shape.iter().map(|&d| d as usize).collect();
        match w.packing {
            Packing::Single if w.name == "d2t" => {
                // EAGLE-3: the draft vocabulary is a sorted random subset of the target's.
                let mut rng = Rng(stream_seed(seed, u64::MAX - 1));
                let mut ids = rng.permutation(vocab);
                ids.truncate(shape[0]);
                ids.sort_unstable();
                out.push(FileTensor {
                    name: "d2t".into(),
                    dtype: Dtype::I64,
                    shape: vec![shape[0]],
                    bytes: ids
                        .iter()
                        .enumerate()
                        .flat_map(|(d, &t)| (t as i64 - d as i64).to_le_bytes())
                        .collect(),
                });
            }
            Packing::Single if w.name == "hot_token_ids" => {
                if seen.insert(w.name.clone()) {
                    hot(&mut out, shape[0]);
                }
            }
            Packing::Single => {
                if seen.insert(w.sources[0].clone()) {
                    float(&mut out, &w.sources[0], shape);
                }
            }
            Packing::ConcatRows => {
                let cols = shape.get(1).copied().unwrap_or(1);
                for s in &w.sources {
                    let rows = concat_rows(plan, s)?;
                    if seen.insert(s.clone()) {
                        float(&mut out, s, vec![rows, cols]);
                    }
                }
            }
            Packing::LeadingRows => {
                // The whole tensor whose first rows the weight is (the embedding).
                if seen.insert(w.sources[0].clone()) {
                    float(&mut out, &w.sources[0], vec![vocab, h]);
                }
            }
            Packing::GatherRows => {
                // The full table the hot rows are gathered from; the ids are their own weight.
                if seen.insert(w.sources[0].clone()) {
                    float(&mut out, &w.sources[0], vec![vocab, h]);
                }
                if w.sources.len() > 1 && seen.insert(w.sources[1].clone()) {
                    hot(&mut out, shape[0]);
                }
            }
        }
    }
    Ok(out)
}

/// One step's inputs: `b` requests, request 0 at prefix `max_prefix`, the others at random
/// prefixes in [0, max_prefix]; random accept lengths in [1, N].
pub fn input_tensors(plan: &Plan, seed: u64, b: usize, max_prefix: usize) -> Result<Vec<FileTensor>, String> {
    let m = &plan.model;
    let act = plan.capture.dtype;
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    // Input rows are 3·H_t wide for an EAGLE-3 head.
    let ps = plan.capture.page_size as usize;
    let h = m.hidden_in() as usize;
    let max_b = plan.buckets().last().map_or(0, |x| x.batch as usize);
    if b == 0 || b > max_b {
        return Err(format!("batch {b} is outside [1, {max_b}] (the plan's largest bucket)"));
    }
    let limit = plan.capture.max_context_len as usize - n;
    if max_prefix > limit {
        return Err(format!(
            "max prefix {max_prefix} + N {n} exceeds the plan's max context {}",
            plan.capture.max_context_len
        ));
    }
    let mut rng = Rng(stream_seed(seed, 1 << 32));
    let prefix: Vec<i32> = (0..b)
        .map(|i| {
            if i == 0 {
                max_prefix as i32
            } else {
                rng.below(max_prefix + 1) as i32
            }
        })
        .collect();
    let accept: Vec<i32> = (0..b).map(|_| 1 + rng.below(n) as i32).collect();
    let ids: Vec<i64> = (0..b * n).map(|_| rng.below(m.vocab as usize) as i64).collect();
    let need: Vec<usize> = prefix.iter().map(|&l| (l as usize + n).div_ceil(ps)).collect();
    let used: usize = need.iter().sum();
    let perm = rng.permutation(used);
    let cols = need.iter().copied().max().unwrap_or(1);
    let mut table = vec![0i32; b * cols];
    let mut next = 0;
    for (i, &c) in need.iter().enumerate() {
        for (j, &p) in perm[next..next + c].iter().enumerate() {
            table[i * cols + j] = p as i32;
        }
        next += c;
    }
    let kv_shape = vec![m.layers as usize, used, ps, m.kv_heads as usize, m.head_dim as usize];
    let kv_n: usize = kv_shape.iter().product();
    let le32 = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    Ok(vec![
        FileTensor {
            name: io::INPUT_IDS.into(),
            dtype: Dtype::I64,
            shape: vec![b, n],
            bytes: ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
        },
        FileTensor {
            name: io::HIDDEN_STATES.into(),
            dtype: file_dtype(act),
            shape: vec![b, n, h],
            bytes: random_act(b * n * h, seed, (1 << 32) + 1, act, |u| u),
        },
        FileTensor {
            name: io::PREFIX_LENS.into(),
            dtype: Dtype::I32,
            shape: vec![b],
            bytes: le32(&prefix),
        },
        FileTensor {
            name: io::ACCEPT_LENS.into(),
            dtype: Dtype::I32,
            shape: vec![b],
            bytes: le32(&accept),
        },
        FileTensor {
            name: io::PAGE_TABLE.into(),
            dtype: Dtype::I32,
            shape: vec![b, cols],
            bytes: le32(&table),
        },
        FileTensor {
            name: io::K_CACHE.into(),
            dtype: file_dtype(act),
            shape: kv_shape.clone(),
            bytes: random_act(kv_n, seed, (1 << 32) + 2, act, |u| u),
        },
        FileTensor {
            name: io::V_CACHE.into(),
            dtype: file_dtype(act),
            shape: kv_shape,
            bytes: random_act(kv_n, seed, (1 << 32) + 3, act, |u| u),
        },
    ])
}

/// Writes tensors as a safetensors file (streamed; through a temporary file renamed into
/// place).
pub fn write_safetensors(path: &Path, tensors: &[FileTensor]) -> Result<(), String> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| format!("{}: {e}", t.name))
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The facts a peer implementation needs to compute the plan's forward, as JSON. f32
/// values (RMSNorm epsilon, RoPE inverse frequencies) are also given as their IEEE bit
/// patterns, so the peer uses exactly the plan's values.
pub fn plan_json(plan: &Plan) -> String {
    let m = &plan.model;
    let rope_scaling = match &m.rope_scaling {
        specplan_format::RopeScaling::None => serde_json::Value::Null,
        specplan_format::RopeScaling::Linear { factor } => {
            serde_json::json!({"rope_type": "linear", "factor": factor})
        }
        specplan_format::RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => serde_json::json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
        specplan_format::RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => serde_json::json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "mscale": mscale,
            "mscale_all_dim": mscale_all_dim,
            "truncate": truncate,
        }),
        specplan_format::RopeScaling::LongRope {
            short_factor,
            original_max_position_embeddings,
            short_mscale,
        } => serde_json::json!({
            "rope_type": "longrope",
            "short_factor": short_factor,
            "long_factor": short_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "short_mscale": short_mscale,
        }),
    };
    let v = serde_json::json!({
        "name": plan.name,
        "compiler": plan.compiler,
        "dtype": plan.capture.dtype.name(),
        "head": m.head.name(),
        "hidden": m.hidden,
        "hidden_in": m.hidden_in(),
        "target_hidden": m.target_hidden,
        "draft_vocab": m.draft_vocab,
        "intermediate": m.intermediate,
        "heads": m.heads,
        "kv_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "layers": m.layers,
        "vocab": m.vocab,
        "fc_bias": m.fc_bias,
        "rms_norm_eps": m.rms_norm_eps,
        "rms_norm_eps_bits": m.rms_norm_eps.to_bits(),
        "rope_theta": m.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_inv_freq_bits": plan.rope_inv_freq.iter().map(|f| f.to_bits()).collect::<Vec<u32>>(),
        // YaRN's / LongRoPE's attention factor on cos and sin (1 otherwise), as rope_append.
        "rope_scale_bits": specplan_format::rope_attention_scale(&plan.model).to_bits(),
        "attn_scale": 1.0 / (m.head_dim as f64).sqrt(),
        "windows": plan.layers.iter().map(|l| l.window).collect::<Vec<Option<u32>>>(),
        "topk": plan.spec.topk,
        "num_steps": plan.spec.num_steps,
        "num_draft_tokens": plan.rows_per_request(PhaseKind::DraftExtend),
        "page_size": plan.capture.page_size,
        "max_context_len": plan.capture.max_context_len,
        "max_requests": plan.capture.max_requests,
        "hot_vocab_size": plan.capture.hot_vocab_size,
        "buckets": plan.buckets().iter().map(|b| b.batch).collect::<Vec<u32>>(),
        "weights": plan.weights.iter().map(|w| serde_json::json!({
            "name": w.name,
            "sources": w.sources,
            "shape": w.shape,
            "packing": format!("{:?}", w.packing),
        })).collect::<Vec<_>>(),
    });
    let mut s = serde_json::to_string_pretty(&v).unwrap_or_else(|_| "{}".into());
    s.push('\n');
    s
}
