//! The draft model's config: a TOML `[model]` table or a Hugging Face `config.json`.
//!
//! Both arrive as a JSON value with Hugging Face key names. Unknown keys are ignored here
//! (a `config.json` carries many; a TOML table's keys were checked by `keys`); a missing,
//! ill-typed or out-of-bounds key is an error naming the key, the value and the rule.

use serde_json::Value;
use specplan_format::{DType, ModelDesc, RopeScaling};

use super::limits::*;
use super::Errors;

/// The resolved model: the plan's `ModelDesc` plus what capture needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub desc: ModelDesc,
    /// Sliding window per layer, from `sliding_window` (and `layer_types` when present).
    pub windows: Vec<Option<u32>>,
    /// `torch_dtype`, when it names an activation type.
    pub torch_dtype: Option<DType>,
    /// EAGLE-3 with `tie_word_embeddings`: lm_head's rows are `embed_tokens.weight`.
    pub tied_lm_head: bool,
}

struct Reader<'a> {
    obj: &'a serde_json::Map<String, Value>,
    prefix: &'a str,
}

impl Reader<'_> {
    fn path(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn present(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A positive integer at most `max` (the bound the kernels and the plan format hold).
    fn uint(&self, key: &str, required: bool, max: u32, e: &mut Errors) -> Option<u32> {
        match self.present(key) {
            None => {
                if required {
                    e.push(self.path(key), "missing (required key)".into());
                }
                None
            }
            Some(v) => match v.as_u64() {
                Some(x) if x > 0 && x <= max as u64 => Some(x as u32),
                Some(x) if x > 0 => {
                    e.push(self.path(key), format!("{x} exceeds {max}, the largest supported"));
                    None
                }
                _ => {
                    e.push(self.path(key), format!("expected a positive integer, got {v}"));
                    None
                }
            },
        }
    }

    fn float(&self, key: &str, required: bool, e: &mut Errors) -> Option<f64> {
        match self.present(key) {
            None => {
                if required {
                    e.push(self.path(key), "missing (required key)".into());
                }
                None
            }
            // Stored as f32: a value that overflows (1e39) or flushes to zero (1e-50) in
            // f32 is refused here, not turned into inf or 0 in the plan.
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 && (x as f32).is_finite() && x as f32 > 0.0 => Some(x),
                Some(x) if x.is_finite() && x > 0.0 => {
                    e.push(
                        self.path(key),
                        format!("{v} is not representable as a positive finite f32"),
                    );
                    None
                }
                _ => {
                    e.push(self.path(key), format!("expected a positive number, got {v}"));
                    None
                }
            },
        }
    }
}

/// Reads a model from a JSON object with Hugging Face key names. `prefix` is prepended to
/// key names in errors (`model.` for a TOML table, empty for a `config.json`).
pub fn read_model(v: &Value, prefix: &str, e: &mut Errors) -> Option<ModelConfig> {
    let Some(obj) = v.as_object() else {
        e.push(
            prefix.trim_end_matches('.').to_string(),
            format!("expected a table of model keys, got {v}"),
        );
        return None;
    };
    let r = Reader { obj, prefix };
    let hidden = r.uint("hidden_size", true, MAX_HIDDEN, e);
    let intermediate = r.uint("intermediate_size", true, MAX_INTERMEDIATE, e);
    let heads = r.uint("num_attention_heads", true, MAX_HEADS, e);
    let kv_heads = r.uint("num_key_value_heads", false, MAX_HEADS, e).or(heads);
    let layers = r.uint("num_hidden_layers", true, MAX_LAYERS, e);
    let vocab = r.uint("vocab_size", true, MAX_VOCAB, e);
    let eps = r.float("rms_norm_eps", true, e);
    let theta = r.float("rope_theta", false, e).unwrap_or(10000.0);
    let max_pos = r.uint("max_position_embeddings", true, u32::MAX, e);
    let head_dim = match r.uint("head_dim", false, u32::MAX, e) {
        Some(d) => Some(d),
        None => match (hidden, heads) {
            (Some(h), Some(n)) if h % n == 0 => Some(h / n),
            (Some(h), Some(n)) => {
                e.push(
                    r.path("head_dim"),
                    format!("absent, and hidden_size {h} is not divisible by num_attention_heads {n}; set head_dim"),
                );
                None
            }
            _ => None,
        },
    };
    let fc_bias = match r.present("bias") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            e.push(r.path("bias"), format!("expected true or false, got {v}"));
            true
        }
    };
    let torch_dtype = match r.present("torch_dtype").or_else(|| r.present("dtype")) {
        None => None,
        Some(Value::String(s)) => match s.as_str() {
            "bfloat16" | "bf16" => Some(DType::Bf16),
            "float16" | "fp16" | "half" => Some(DType::F16),
            "float32" | "fp32" | "float" => None,
            other => {
                e.push(
                    r.path("torch_dtype"),
                    format!("unknown dtype \"{other}\" (expected bfloat16, float16 or float32)"),
                );
                None
            }
        },
        Some(v) => {
            e.push(r.path("torch_dtype"), format!("expected a string, got {v}"));
            None
        }
    };
    // SGLang's Llama layers copy a top-level `original_max_position_embeddings` into
    // `rope_scaling` before building the rotary embedding (`srt/models/llama.py:329-334`).
    let outer = RopeOuter {
        max_pos,
        head_dim,
        original: r.uint("original_max_position_embeddings", false, u32::MAX, e),
    };
    let rope_scaling = read_rope_scaling(&r, &outer, e);
    let window = read_window(&r, e);

    if let (Some(h), Some(kv)) = (heads, kv_heads) {
        if h % kv != 0 {
            e.push(
                r.path("num_key_value_heads"),
                format!("{kv} does not divide num_attention_heads {h} (GQA needs heads = G · kv_heads)"),
            );
        }
    }
    if let Some(d) = head_dim {
        if d % 16 != 0 || d == 0 || d > MAX_HEAD_DIM {
            e.push(
                r.path("head_dim"),
                format!("{d} is not supported (the attention kernel's tensor-core steps need a multiple of 16, at most {MAX_HEAD_DIM})"),
            );
        }
    }
    let head = super::eagle3::read_head(obj, prefix, hidden, vocab, layers, fc_bias, e);
    let layers_n = layers?;
    let windows = match (window, r.present("layer_types")) {
        (w, None) => vec![w; layers_n as usize],
        (w, Some(Value::Array(types))) => {
            if types.len() != layers_n as usize {
                e.push(
                    r.path("layer_types"),
                    format!("{} entries, expected num_hidden_layers = {layers_n}", types.len()),
                );
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("sliding_attention") => {
                        if w.is_none() {
                            e.push(
                                r.path(&format!("layer_types[{i}]")),
                                "sliding_attention needs sliding_window".into(),
                            );
                        }
                        w
                    }
                    Some("full_attention") => None,
                    _ => {
                        e.push(
                            r.path(&format!("layer_types[{i}]")),
                            format!("expected \"sliding_attention\" or \"full_attention\", got {t}"),
                        );
                        None
                    }
                })
                .collect()
        }
        (_, Some(v)) => {
            e.push(r.path("layer_types"), format!("expected a list, got {v}"));
            vec![None; layers_n as usize]
        }
    };
    Some(ModelConfig {
        desc: ModelDesc {
            head: head.kind,
            target_hidden: head.target_hidden,
            draft_vocab: head.draft_vocab,
            hidden: hidden?,
            intermediate: intermediate?,
            heads: heads?,
            kv_heads: kv_heads?,
            head_dim: head_dim?,
            layers: layers_n,
            vocab: vocab?,
            rms_norm_eps: eps? as f32,
            rope_theta: theta as f32,
            rope_scaling: rope_scaling?,
            max_position_embeddings: max_pos?,
            fc_bias: head.fc_bias,
        },
        windows,
        torch_dtype,
        tied_lm_head: head.tied,
    })
}

fn read_window(r: &Reader, e: &mut Errors) -> Option<u32> {
    let enabled = match r.present("use_sliding_window") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            e.push(r.path("use_sliding_window"), format!("expected true or false, got {v}"));
            true
        }
    };
    let w = r.uint("sliding_window", false, MAX_CONTEXT, e);
    if enabled {
        w
    } else {
        None
    }
}

/// What the RoPE readers need from the model config around `rope_scaling`.
struct RopeOuter {
    max_pos: Option<u32>,
    head_dim: Option<u32>,
    /// A top-level `original_max_position_embeddings`: it wins over `rope_scaling`'s.
    original: Option<u32>,
}

fn read_rope_scaling(r: &Reader, outer: &RopeOuter, e: &mut Errors) -> Option<RopeScaling> {
    let Some(v) = r.present("rope_scaling") else {
        return Some(RopeScaling::None);
    };
    let Some(obj) = v.as_object() else {
        e.push(r.path("rope_scaling"), format!("expected a table or null, got {v}"));
        return None;
    };
    let prefix = r.path("rope_scaling.");
    let s = Reader { obj, prefix: &prefix };
    let kind = s
        .present("rope_type")
        .or_else(|| s.present("type"))
        .and_then(|t| t.as_str());
    // Multimodal RoPE on text positions: the three sections' positions are all the token
    // index, so the rotation is plain RoPE (a request with image tokens is not).
    if kind == Some("mrope") || (matches!(kind, None | Some("default")) && s.present("mrope_section").is_some()) {
        e.note(format!(
            "{}: mrope is read as plain RoPE, exact for text positions (the plan computes no image-token positions)",
            s.path("rope_type")
        ));
        return Some(RopeScaling::None);
    }
    match kind {
        None | Some("default") => Some(RopeScaling::None),
        Some("linear") => Some(RopeScaling::Linear {
            factor: s.float("factor", true, e)? as f32,
        }),
        Some("llama3") => {
            let factor = s.float("factor", true, e);
            let low = s.float("low_freq_factor", true, e);
            let high = s.float("high_freq_factor", true, e);
            let orig = s.uint("original_max_position_embeddings", true, u32::MAX, e);
            if let (Some(l), Some(h)) = (low, high) {
                if h <= l {
                    e.push(
                        s.path("high_freq_factor"),
                        format!("{h} must exceed low_freq_factor {l}"),
                    );
                    return None;
                }
            }
            Some(RopeScaling::Llama3 {
                factor: factor? as f32,
                low_freq_factor: low? as f32,
                high_freq_factor: high? as f32,
                original_max_position_embeddings: orig?,
            })
        }
        Some("yarn") => read_yarn(&s, outer, e),
        Some("longrope") => read_longrope(&s, outer, e),
        Some(other) => {
            e.push(
                s.path("rope_type"),
                format!("\"{other}\" is not supported (expected default, linear, llama3, yarn, longrope or mrope)"),
            );
            None
        }
    }
}

/// YaRN as SGLang 0.5.23 reads it (`srt/layers/rotary_embedding/factory.py:311-330`):
/// `factor`, `original_max_position_embeddings` (a top-level one wins; default: the model's
/// `max_position_embeddings`), `beta_fast` 32 and `beta_slow` 1 by default, `mscale` and
/// `mscale_all_dim` (their ratio is the attention factor when both are given), `truncate`
/// (default true). Keys whose meaning the engines do not share are refused: Hugging Face's
/// `attention_factor` replaces the factor where SGLang ignores it, SGLang's `attn_factor` and
/// `extrapolation_factor` are unknown to Hugging Face; YaRN over mrope sections is another
/// rotation.
fn read_yarn(s: &Reader, outer: &RopeOuter, e: &mut Errors) -> Option<RopeScaling> {
    let mut ok = true;
    for key in ["attention_factor", "attn_factor", "extrapolation_factor"] {
        if let Some(v) = s.present(key) {
            if v.as_f64() != Some(1.0) {
                e.push(
                    s.path(key),
                    format!("{v} is not supported: SGLang and Hugging Face do not read this key the same way (leave it out or 1.0)"),
                );
                ok = false;
            }
        }
    }
    if s.present("mrope_section").is_some() {
        e.push(
            s.path("mrope_section"),
            "YaRN over multimodal RoPE sections is not supported".into(),
        );
        ok = false;
    }
    let factor = s.float("factor", true, e);
    let orig = s
        .uint("original_max_position_embeddings", false, u32::MAX, e)
        .or(outer.max_pos);
    let orig = outer.original.or(orig);
    let beta_fast = s.float("beta_fast", false, e).unwrap_or(32.0);
    let beta_slow = s.float("beta_slow", false, e).unwrap_or(1.0);
    if beta_slow >= beta_fast {
        e.push(
            s.path("beta_slow"),
            format!("{beta_slow} must be below beta_fast {beta_fast}"),
        );
        ok = false;
    }
    let mscale = s.float("mscale", false, e).map(|x| x as f32);
    let mscale_all_dim = s.float("mscale_all_dim", false, e).map(|x| x as f32);
    let truncate = match s.present("truncate") {
        None => true,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(v) => {
            e.push(s.path("truncate"), format!("expected true or false, got {v}"));
            ok = false;
            true
        }
    };
    let (factor, orig) = (factor?, orig?);
    ok.then_some(RopeScaling::Yarn {
        factor: factor as f32,
        original_max_position_embeddings: orig,
        beta_fast: beta_fast as f32,
        beta_slow: beta_slow as f32,
        mscale,
        mscale_all_dim,
        truncate,
    })
}

/// LongRoPE as SGLang 0.5.23 reads it (`srt/layers/rotary_embedding/factory.py:402-425`):
/// `short_factor` and `long_factor` (head_dim/2 each), `original_max_position_embeddings`
/// (default: the model's `max_position_embeddings`), `short_mscale`. The plan computes the
/// short factors, which the engines use while no position passes the training length (the
/// capture reader holds `max_context_len` to it). `factor` and `attention_factor`, which
/// Hugging Face reads and SGLang does not, are refused unless they agree with SGLang.
fn read_longrope(s: &Reader, outer: &RopeOuter, e: &mut Errors) -> Option<RopeScaling> {
    let (max_pos, half) = (outer.max_pos, outer.head_dim.map(|d| d as usize / 2));
    let list = |key: &str, e: &mut Errors| -> Option<Vec<f32>> {
        let Some(v) = s.present(key) else {
            e.push(s.path(key), "missing (required key)".into());
            return None;
        };
        let xs: Option<Vec<f32>> = v.as_array().and_then(|a| {
            a.iter()
                .map(|x| {
                    x.as_f64()
                        .filter(|f| f.is_finite() && *f > 0.0 && (*f as f32) > 0.0)
                        .map(|f| f as f32)
                })
                .collect()
        });
        match (xs, half) {
            (Some(xs), Some(h)) if xs.len() == h => Some(xs),
            (Some(xs), Some(h)) => {
                e.push(
                    s.path(key),
                    format!("{} factors, expected head_dim / 2 = {h}", xs.len()),
                );
                None
            }
            (Some(xs), None) => Some(xs),
            (None, _) => {
                e.push(s.path(key), format!("expected a list of positive numbers, got {v}"));
                None
            }
        }
    };
    let short = list("short_factor", e);
    let _long = list("long_factor", e);
    let orig = s
        .uint("original_max_position_embeddings", false, u32::MAX, e)
        .or(max_pos);
    let orig = outer.original.or(orig);
    let mut ok = true;
    if let Some(v) = s.present("attention_factor") {
        e.push(
            s.path("attention_factor"),
            format!("{v} is not supported: Hugging Face scales cos and sin by it, SGLang does not read it (use short_mscale)"),
        );
        ok = false;
    }
    if let (Some(f), Some(mp), Some(o)) = (s.present("factor").and_then(|v| v.as_f64()), max_pos, orig) {
        let sglang = mp as f64 / o as f64;
        if (f - sglang).abs() > 1e-6 * sglang.max(1.0) {
            e.push(
                s.path("factor"),
                format!("{f} differs from max_position_embeddings / original_max_position_embeddings = {sglang}, which SGLang uses for the attention factor"),
            );
            ok = false;
        }
    }
    let short_mscale = s.float("short_mscale", false, e).map(|x| x as f32);
    let (short, orig) = (short?, orig?);
    ok.then_some(RopeScaling::LongRope {
        short_factor: short,
        original_max_position_embeddings: orig,
        short_mscale,
    })
}
