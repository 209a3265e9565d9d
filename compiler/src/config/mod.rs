//! Stage 1: inputs → [`Config`], the immutable, fully resolved compile input.
//!
//! Sources: a built-in preset, a TOML file with `[model]`, `[speculative]` and `[capture]`
//! tables, or a Hugging Face `config.json` of the draft head. CLI flags override the file.
//! Every rule violation is collected (not just the first) with the field, value and rule,
//! and the speculative rules suggest the flag value that would fix them.

mod model;

use serde_json::Value;
use specplan_format::{DType, SpecDesc};

pub use model::{rope_inv_freq, ModelConfig};

/// One violated rule: the field (as the user wrote it) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

/// All rule violations of one config.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid config:\n{}", .0.iter().map(|f| format!("  {}: {}", f.field, f.message)).collect::<Vec<_>>().join("\n"))]
pub struct ConfigError(pub Vec<FieldError>);

/// Collects field errors while reading a config.
#[derive(Default)]
pub struct Errors(Vec<FieldError>);

impl Errors {
    pub fn push(&mut self, field: String, message: String) {
        self.0.push(FieldError { field, message });
    }
}

/// Where the model (and possibly the rest) comes from.
#[derive(Clone, Debug)]
pub enum Source {
    Preset(String),
    Toml { name: String, text: String },
    HfConfig { name: String, text: String },
}

/// Capture flags as given on the command line; `None` = take the file's or the default.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub topk: Option<u32>,
    pub num_steps: Option<u32>,
    pub num_draft_tokens: Option<u32>,
    pub buckets: Option<String>,
    pub max_bs: Option<u32>,
    pub page_size: Option<u32>,
    pub max_context_len: Option<u32>,
    pub kv_pool_pages: Option<u32>,
    pub max_requests: Option<u32>,
    pub dtype: Option<String>,
    pub sliding_window: Option<u32>,
    pub hot_vocab_size: Option<u32>,
}

/// Capture settings after defaults and rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureConfig {
    pub buckets: Vec<u32>,
    pub page_size: u32,
    pub max_context_len: u32,
    pub kv_pool_pages: u32,
    /// Request slots of the device page table (the scratch slot comes on top).
    pub max_requests: u32,
    pub dtype: DType,
    pub hot_vocab_size: Option<u32>,
}

impl CaptureConfig {
    pub fn pages_per_request(&self) -> u32 {
        self.max_context_len.div_ceil(self.page_size)
    }
    pub fn max_bucket(&self) -> u32 {
        self.buckets.last().copied().unwrap_or(0)
    }
}

/// The resolved compile input.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub name: String,
    pub model: ModelConfig,
    pub spec: SpecDesc,
    pub capture: CaptureConfig,
}

pub struct Preset {
    pub name: &'static str,
    pub summary: &'static str,
    pub toml: &'static str,
}

pub const PRESETS: &[Preset] = &[
    Preset {
        name: "llama2-7b-eagle",
        summary: "EAGLE-1 head of Llama-2-7B-chat: H 4096, 32/32 heads, V 32000; topk 4, steps 3, N 8; page 1; buckets auto to 64",
        toml: include_str!("../../presets/llama2-7b-eagle.toml"),
    },
    Preset {
        name: "llama3-8b-eagle",
        summary: "EAGLE head of Llama-3-8B-Instruct: H 4096, 32/8 heads, V 128256; topk 4, steps 3, N 8; page 1; buckets auto to 64",
        toml: include_str!("../../presets/llama3-8b-eagle.toml"),
    },
    Preset {
        name: "tiny",
        summary: "2-layer GQA head for CPU tests: H 256, 4/2 heads, D 64, V 1000; topk 4, steps 3, N 4; page 4; buckets 1,2,4,8",
        toml: include_str!("../../presets/tiny.toml"),
    },
];

/// SGLang's speculative capture list: 1–8, 10–32 step 2, 40–64 step 4, 72–256 step 8,
/// then step 16, up to `max_bs`.
pub fn auto_buckets(max_bs: u32) -> Vec<u32> {
    let mut v: Vec<u32> = (1..=8).collect();
    v.extend((10..=32).step_by(2));
    v.extend((40..=64).step_by(4));
    v.extend((72..=256).step_by(8));
    v.extend((272..=max_bs.max(272)).step_by(16));
    v.retain(|&b| b <= max_bs);
    v
}

const DEFAULT_MAX_BS: u32 = 256;

/// Resolves a source plus overrides into a [`Config`].
pub fn resolve(source: &Source, o: &Overrides) -> Result<Config, ConfigError> {
    let mut e = Errors::default();
    let (name, root, hf) = match source {
        Source::Preset(name) => match PRESETS.iter().find(|p| p.name == name) {
            Some(p) => (name.clone(), parse_toml(p.toml, name, &mut e), false),
            None => {
                let known: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
                e.push(
                    "--preset".into(),
                    format!("unknown preset \"{name}\" (known: {})", known.join(", ")),
                );
                return Err(ConfigError(e.0));
            }
        },
        Source::Toml { name, text } => (name.clone(), parse_toml(text, name, &mut e), false),
        Source::HfConfig { name, text } => match serde_json::from_str::<Value>(text) {
            Ok(v) => (name.clone(), Some(v), true),
            Err(err) => {
                e.push(name.clone(), format!("not valid JSON: {err}"));
                (name.clone(), None, true)
            }
        },
    };
    let Some(root) = root else { return Err(ConfigError(e.0)) };
    let empty = Value::Object(Default::default());
    let (model_v, spec_v, cap_v) = if hf {
        (&root, &empty, &empty)
    } else {
        let table = |k: &str| root.get(k).unwrap_or(&empty);
        if root.get("model").is_none() {
            e.push("model".into(), "missing (the config needs a [model] table)".into());
        }
        (table("model"), table("speculative"), table("capture"))
    };
    let model = read_model_checked(model_v, if hf { "" } else { "model." }, &mut e);
    let spec = read_spec(spec_v, o, &mut e);
    let capture = model
        .as_ref()
        .and_then(|m| read_capture(cap_v, o, m, spec.as_ref(), &mut e));
    let mut model = model;
    if let Some(m) = &model {
        if rope_inv_freq(&m.desc).iter().any(|f| !f.is_finite() || *f <= 0.0) {
            e.push(
                "model.rope_scaling".into(),
                "gives non-finite or zero RoPE frequencies (check factor, low_freq_factor, high_freq_factor)".into(),
            );
        }
    }
    if let (Some(m), Some(w)) = (model.as_mut(), o.sliding_window) {
        if w == 0 {
            e.push(
                "capture.sliding_window (--sliding-window)".into(),
                "0 is not a window; give W ≥ 1".into(),
            );
        }
        m.windows = vec![Some(w); m.windows.len()];
    }
    match (model, spec, capture) {
        (Some(model), Some(spec), Some(capture)) if e.0.is_empty() => Ok(Config {
            name,
            model,
            spec,
            capture,
        }),
        _ => Err(ConfigError(e.0)),
    }
}

fn parse_toml(text: &str, name: &str, e: &mut Errors) -> Option<Value> {
    match toml::from_str::<Value>(text) {
        Ok(v) => Some(v),
        Err(err) => {
            e.push(name.to_string(), format!("not valid TOML: {}", err.message()));
            None
        }
    }
}

fn read_model_checked(v: &Value, prefix: &str, e: &mut Errors) -> Option<ModelConfig> {
    model::read_model(v, prefix, e)
}

fn uint_field(v: &Value, key: &str, field: &str, e: &mut Errors) -> Option<u32> {
    match v.get(key) {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(n) if n <= u32::MAX as u64 => Some(n as u32),
            _ => {
                e.push(field.to_string(), format!("expected a non-negative integer, got {x}"));
                None
            }
        },
    }
}

fn read_spec(v: &Value, o: &Overrides, e: &mut Errors) -> Option<SpecDesc> {
    const TOPK: &str = "speculative.topk (--speculative-eagle-topk)";
    const STEPS: &str = "speculative.num_steps (--speculative-num-steps)";
    const DRAFT: &str = "speculative.num_draft_tokens (--speculative-num-draft-tokens)";
    let topk = o.topk.or_else(|| uint_field(v, "topk", TOPK, e));
    let steps = o.num_steps.or_else(|| uint_field(v, "num_steps", STEPS, e));
    let draft = o
        .num_draft_tokens
        .or_else(|| uint_field(v, "num_draft_tokens", DRAFT, e));
    for (val, field) in [(topk, TOPK), (steps, STEPS), (draft, DRAFT)] {
        match val {
            None => e.push(field.into(), "missing (required)".into()),
            Some(0) => e.push(field.into(), "must be at least 1".into()),
            Some(_) => {}
        }
    }
    let (k, s, n) = (topk?, steps?, draft?);
    if k == 0 || s == 0 || n == 0 {
        return None;
    }
    let max_topk = specplan_kernels::facts::MAX_TOPK;
    if k > max_topk {
        e.push(
            TOPK.into(),
            format!("{k} exceeds the {max_topk} candidates the sampling kernel keeps per request"),
        );
        return None;
    }
    if s > 64 {
        e.push(STEPS.into(), format!("{s} exceeds 64 draft steps"));
        return None;
    }
    if k == 1 && n != s + 1 {
        e.push(
            DRAFT.into(),
            format!("{n} is invalid with topk = 1: it must equal num_steps + 1 = {}; pass --speculative-num-draft-tokens {}", s + 1, s + 1),
        );
        return None;
    }
    if k > 1 {
        let max = 1 + k as u64 + (s as u64 - 1) * (k as u64) * (k as u64);
        if n < 2 || n as u64 > max {
            let fix = if n < 2 { 2 } else { max };
            e.push(
                DRAFT.into(),
                format!(
                    "{n} is invalid with topk = {k}, num_steps = {s}: it must be in [2, 1 + topk + (num_steps - 1)·topk² = {max}]; pass --speculative-num-draft-tokens {fix} or raise --speculative-num-steps"
                ),
            );
            return None;
        }
    }
    if n > 64 {
        e.push(
            DRAFT.into(),
            format!("{n} exceeds the 64 rows per request the attention kernel supports"),
        );
        return None;
    }
    Some(SpecDesc {
        topk: k,
        num_steps: s,
        num_draft_tokens: n,
    })
}

fn read_capture(
    v: &Value,
    o: &Overrides,
    m: &ModelConfig,
    spec: Option<&SpecDesc>,
    e: &mut Errors,
) -> Option<CaptureConfig> {
    const BUCKETS: &str = "capture.buckets (--buckets)";
    let max_bs = o
        .max_bs
        .or_else(|| uint_field(v, "max_bs", "capture.max_bs (--max-bs)", e))
        .unwrap_or(DEFAULT_MAX_BS);
    if max_bs == 0 || max_bs > 4096 {
        // Checked before the bucket list is built from it.
        e.push(
            "capture.max_bs (--max-bs)".into(),
            format!("{max_bs} must be in [1, 4096]"),
        );
        return None;
    }
    let bucket_text = match (&o.buckets, v.get("buckets")) {
        (Some(s), _) => Some(s.clone()),
        (None, Some(Value::String(s))) => Some(s.clone()),
        (None, Some(Value::Array(a))) => Some(a.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")),
        (None, Some(x)) => {
            e.push(
                BUCKETS.into(),
                format!("expected \"auto\" or a list of batch sizes, got {x}"),
            );
            None
        }
        (None, None) => Some("auto".into()),
    };
    let buckets = bucket_text.and_then(|t| parse_buckets(&t, max_bs, e));
    let page_size = o
        .page_size
        .or_else(|| uint_field(v, "page_size", "capture.page_size (--page-size)", e))
        .unwrap_or(1);
    if !page_size.is_power_of_two() || page_size > 1024 {
        e.push(
            "capture.page_size (--page-size)".into(),
            format!("{page_size} must be a power of two in [1, 1024]"),
        );
    }
    let max_pos = m.desc.max_position_embeddings;
    let ctx = o
        .max_context_len
        .or_else(|| uint_field(v, "max_context_len", "capture.max_context_len (--max-context-len)", e))
        .unwrap_or(max_pos);
    if ctx > max_pos {
        e.push(
            "capture.max_context_len (--max-context-len)".into(),
            format!("{ctx} exceeds the model's max_position_embeddings {max_pos}"),
        );
    }
    if let Some(s) = spec {
        if ctx <= s.num_draft_tokens {
            e.push(
                "capture.max_context_len (--max-context-len)".into(),
                format!(
                    "{ctx} must exceed num_draft_tokens {} (prefix + N rows must fit)",
                    s.num_draft_tokens
                ),
            );
        }
    }
    let dtype_text = o
        .dtype
        .clone()
        .or_else(|| v.get("dtype").and_then(|d| d.as_str()).map(str::to_string));
    let dtype = match dtype_text.as_deref() {
        None => m.torch_dtype.unwrap_or(DType::Bf16),
        Some("bf16") | Some("bfloat16") => DType::Bf16,
        Some("fp16") | Some("f16") | Some("float16") => DType::F16,
        Some(other) => {
            e.push(
                "capture.dtype (--dtype)".into(),
                format!("\"{other}\" is not supported (expected bf16 or fp16)"),
            );
            DType::Bf16
        }
    };
    let hot = o
        .hot_vocab_size
        .or_else(|| uint_field(v, "hot_vocab_size", "capture.hot_vocab_size (--hot-vocab-size)", e));
    if let (Some(h), Some(s)) = (hot, spec) {
        if h < s.topk || h > m.desc.vocab {
            e.push(
                "capture.hot_vocab_size (--hot-vocab-size)".into(),
                format!("{h} must be in [topk = {}, vocab_size = {}]", s.topk, m.desc.vocab),
            );
        }
    }
    let buckets = buckets?;
    let pages_per_req = ctx.div_ceil(page_size.max(1));
    let max_b = *buckets.last()?;
    let default_pool = (max_b as u64 * pages_per_req as u64 + 1).min(u32::MAX as u64) as u32;
    let pool = o
        .kv_pool_pages
        .or_else(|| uint_field(v, "kv_pool_pages", "capture.kv_pool_pages (--kv-pool-pages)", e))
        .unwrap_or(default_pool);
    if pool < 2 {
        e.push(
            "capture.kv_pool_pages (--kv-pool-pages)".into(),
            format!("{pool} must be at least 2 (one page for requests, one scratch page)"),
        );
    }
    const REQS: &str = "capture.max_requests (--max-requests)";
    let max_requests = o
        .max_requests
        .or_else(|| uint_field(v, "max_requests", REQS, e))
        .unwrap_or(max_b);
    let pages_cols = ctx.div_ceil(page_size.max(1)) as u64;
    if (max_requests as u64 + 1) * pages_cols > i32::MAX as u64 {
        e.push(
            REQS.into(),
            format!(
                "{max_requests} request slots × {pages_cols} pages each exceed the 2^31 entries a page table may hold"
            ),
        );
    }
    if max_requests < max_b {
        e.push(
            REQS.into(),
            format!("{max_requests} is below the largest bucket {max_b} (every request of a step needs a slot)"),
        );
    }
    Some(CaptureConfig {
        buckets,
        page_size,
        max_context_len: ctx,
        kv_pool_pages: pool,
        max_requests,
        dtype,
        hot_vocab_size: hot,
    })
}

fn parse_buckets(text: &str, max_bs: u32, e: &mut Errors) -> Option<Vec<u32>> {
    const BUCKETS: &str = "capture.buckets (--buckets)";
    if text.trim() == "auto" {
        return Some(auto_buckets(max_bs));
    }
    let mut out = Vec::new();
    for part in text.split(',') {
        match part.trim().parse::<u32>() {
            Ok(b) if (1..=4096).contains(&b) => out.push(b),
            _ => {
                e.push(
                    BUCKETS.into(),
                    format!(
                        "\"{}\" is not a batch size in [1, 4096] (expected \"auto\" or e.g. 1,2,4,8)",
                        part.trim()
                    ),
                );
                return None;
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}
