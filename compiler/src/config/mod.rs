//! Stage 1: inputs → [`Config`], the immutable, fully resolved compile input.
//!
//! Sources: a built-in preset, a TOML file with `[model]`, `[speculative]` and `[capture]`
//! tables, or a Hugging Face `config.json` of the draft head. CLI flags override the file.
//! Every rule violation is collected (not just the first) with the field, value and rule,
//! and the speculative rules suggest the flag value that would fix them.

mod eagle3;
pub mod flags;
mod keys;
mod recognize;
pub use keys::did_you_mean;
mod buckets;
pub mod limits;
mod model;
mod phases;
mod tp;
pub use buckets::auto_buckets;
use buckets::{check_bucket_bounds, read_buckets};

use serde_json::Value;
use specplan_format::limits::SpecField;
use specplan_format::{DType, HeadOutputs, SpecDesc};

pub use flags::{Overrides, FLAGS};
pub use keys::levenshtein;
use limits::*;
pub use model::ModelConfig;
pub use specplan_format::rope_inv_freq;

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
pub struct Errors {
    list: Vec<FieldError>,
    /// One-line notes of an accepted config (what was read how), for the user.
    notes: Vec<String>,
    /// Paths of non-finite numbers (already reported): a TOML `nan` reads as an absent
    /// value, which must not be reported again as "missing".
    non_finite: Vec<String>,
}

impl Errors {
    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn note(&mut self, line: String) {
        self.notes.push(line);
    }

    pub fn push(&mut self, field: String, message: String) {
        let path = field.split(' ').next().unwrap_or(&field);
        // A value already reported (non-finite, of the wrong type, out of range) reads as
        // absent afterwards: it is not reported again as "missing".
        let reported = |f: &FieldError| f.field.split(' ').next() == Some(path);
        if message.starts_with("missing")
            && (self.non_finite.iter().any(|p| p == path) || self.list.iter().any(reported))
        {
            return;
        }
        self.list.push(FieldError { field, message });
    }
}

/// Where the model (and possibly the rest) comes from.
#[derive(Clone, Debug)]
pub enum Source {
    Preset(String),
    Toml { name: String, text: String },
    HfConfig { name: String, text: String },
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
    /// What the head emits per request besides its hidden row.
    pub outputs: HeadOutputs,
    /// The draft-decode phase's step-count tiers, ascending (empty: no such phase).
    pub decode_steps: Vec<u32>,
    /// The draft-decode phases also emit the verify inputs (`draft_decode_outputs`).
    pub decode_verify: bool,
    /// The tensor-parallel rank the plan computes (`tp::shard` has divided the model).
    pub tp: specplan_format::TensorParallel,
    /// Parts the kv heads split into over the ranks: T, or the kv heads when T exceeds
    /// them (each replicated on T / Hkv ranks); 1 unsharded.
    pub kv_parts: u32,
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
    /// The format the model keys were read as (`config`, `vLLM nested EAGLE config`,
    /// `Speculators config`).
    pub format: &'static str,
    /// One line each: how the config was read where a user could be surprised (a serving
    /// context above the head's training length, say).
    pub notes: Vec<String>,
    /// Keys of the model config nothing reads (they do not change the plan).
    pub ignored: Vec<String>,
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
        name: "llama3.1-8b-eagle3",
        summary: "EAGLE-3 head of Llama-3.1-8B-Instruct: H 4096, fc 3·4096, 32/8 heads, V 128256, V_d 32000 (d2t); topk 4, steps 3, N 8; page 1; buckets auto to 64",
        toml: include_str!("../../presets/llama3.1-8b-eagle3.toml"),
    },
    Preset {
        name: "tiny",
        summary: "2-layer GQA head for CPU tests: H 256, 4/2 heads, D 64, V 1000; topk 4, steps 3, N 4; page 4; buckets 1,2,4,8",
        toml: include_str!("../../presets/tiny.toml"),
    },
];

/// The `max_bs` default (the flag table's `default` says the same).
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
                return Err(ConfigError(e.list));
            }
        },
        Source::Toml { name, text } => (name.clone(), parse_toml(text, name, &mut e), false),
        Source::HfConfig { name, text } => match serde_json::from_str::<Value>(text) {
            Ok(v) if !v.is_object() => {
                let mut got = v.to_string();
                if got.len() > 60 {
                    let cut = (0..=60).rev().find(|&i| got.is_char_boundary(i)).unwrap_or(0);
                    got.truncate(cut);
                    got.push('…');
                }
                e.push(
                    name.clone(),
                    format!("expected a JSON object of model keys (a Hugging Face config.json), got {got}"),
                );
                (name.clone(), None, true)
            }
            Ok(v) => match keys::json_repeated_key(text) {
                // serde_json keeps a repeated key's last value; TOML refuses the file.
                Some(at) => {
                    e.push(name.clone(), format!("not a usable config: {at}"));
                    (name.clone(), None, true)
                }
                None => (name.clone(), Some(v), true),
            },
            Err(err) => {
                e.push(name.clone(), keys::json_error(text, &err));
                (name.clone(), None, true)
            }
        },
    };
    let Some(root) = root else {
        return Err(ConfigError(e.list));
    };
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
    let prefix = if hf { "" } else { "model." };
    let recognized = recognize::recognize(model_v, prefix, &mut e);
    let model = recognized
        .as_ref()
        .and_then(|r| model::read_model(&r.model, prefix, &mut e));
    let spec = read_spec(spec_v, o, &mut e);
    let capture = model
        .as_ref()
        .and_then(|m| read_capture(cap_v, o, m, spec.as_ref(), &mut e));
    let mut model = model;
    let mut capture = capture;
    if let (Some(m), Some(c), Some(s)) = (model.as_mut(), capture.as_mut(), spec.as_ref()) {
        tp::shard(m, c, s.topk, prefix, &mut e);
    }
    if let Some(m) = &model {
        if rope_inv_freq(&m.desc).iter().any(|f| !f.is_finite() || *f <= 0.0) {
            e.push(
                "model.rope_scaling".into(),
                "gives non-finite or zero RoPE frequencies (check its factors)".into(),
            );
        }
        let scale = specplan_format::rope_attention_scale(&m.desc);
        if !(scale.is_finite() && scale > 0.0) {
            e.push(
                "model.rope_scaling".into(),
                format!("gives the attention factor {scale} (check mscale, mscale_all_dim, short_mscale)"),
            );
        }
    }
    if let (Some(m), Some(w)) = (model.as_mut(), o.sliding_window) {
        if w == 0 || w > MAX_CONTEXT {
            e.push(
                "model.sliding_window (--sliding-window)".into(),
                format!("{w} is not a window in [1, {MAX_CONTEXT}]"),
            );
        }
        m.windows = vec![Some(w); m.windows.len()];
    }
    if let (Some(m), Some(s), Some(c)) = (&model, &spec, &capture) {
        if e.list.is_empty() {
            limits::check_derived(&m.desc, s, c, &mut e);
        }
    }
    match (model, spec, capture) {
        (Some(model), Some(spec), Some(capture)) if e.list.is_empty() => {
            let r = recognized.as_ref();
            Ok(Config {
                name,
                model,
                spec,
                capture,
                format: r.map_or("config", |r| r.format),
                notes: e.notes,
                ignored: r.map(|r| r.ignored.clone()).unwrap_or_default(),
            })
        }
        _ => Err(ConfigError(e.list)),
    }
}

/// Parses a TOML config, checks its tables, keys and numbers ([`keys::check_toml`]) and
/// returns it as JSON with Hugging Face key names, as the readers take it.
fn parse_toml(text: &str, name: &str, e: &mut Errors) -> Option<Value> {
    match toml::from_str::<toml::Table>(text) {
        Ok(t) => {
            keys::check_toml(&t, e);
            match serde_json::to_value(&t) {
                Ok(v) => Some(v),
                Err(err) => {
                    e.push(name.to_string(), format!("cannot be read as a config: {err}"));
                    None
                }
            }
        }
        Err(err) => {
            e.push(name.to_string(), format!("not valid TOML: {}", err.message()));
            None
        }
    }
}

fn uint_field(v: &Value, key: &str, field: &str, e: &mut Errors) -> Option<u32> {
    match v.get(key) {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(n) if n <= u32::MAX as u64 => Some(n as u32),
            Some(n) => {
                e.push(field.to_string(), format!("{n} exceeds {}", u32::MAX));
                None
            }
            None => {
                e.push(field.to_string(), format!("expected a non-negative integer, got {x}"));
                None
            }
        },
    }
}

fn read_spec(v: &Value, o: &Overrides, e: &mut Errors) -> Option<SpecDesc> {
    let topk_label = &flags::label("topk");
    let steps_label = &flags::label("num_steps");
    let draft_label = &flags::label("num_draft_tokens");
    let topk = o.topk.or_else(|| uint_field(v, "topk", topk_label, e));
    let steps = o.num_steps.or_else(|| uint_field(v, "num_steps", steps_label, e));
    let draft = o
        .num_draft_tokens
        .or_else(|| uint_field(v, "num_draft_tokens", draft_label, e));
    for (val, field) in [(topk, topk_label), (steps, steps_label), (draft, draft_label)] {
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
    let spec = SpecDesc {
        topk: k,
        num_steps: s,
        num_draft_tokens: n,
    };
    // The rule is the format crate's (the validator applies the same one to plans); the
    // reader names the flag and turns the fix into a suggestion.
    if let Some(r) = specplan_format::limits::spec_rule(&spec) {
        let (field, flag) = match r.field {
            SpecField::Topk => (topk_label, "--speculative-eagle-topk"),
            SpecField::NumSteps => (steps_label, "--speculative-num-steps"),
            SpecField::NumDraftTokens => (draft_label, "--speculative-num-draft-tokens"),
        };
        let hint = match (r.field, r.fix) {
            (SpecField::NumDraftTokens, Some(fix)) if k > 1 => {
                format!("; pass {flag} {fix} or raise --speculative-num-steps")
            }
            (_, Some(fix)) => format!("; pass {flag} {fix}"),
            (_, None) => String::new(),
        };
        e.push(field.into(), format!("{}{hint}", r.message));
        return None;
    }
    Some(spec)
}

fn read_capture(
    v: &Value,
    o: &Overrides,
    m: &ModelConfig,
    spec: Option<&SpecDesc>,
    e: &mut Errors,
) -> Option<CaptureConfig> {
    let max_bs_label = &flags::label("max_bs");
    let ctx_label = &flags::label("max_context_len");
    let max_bs_given = o.max_bs.or_else(|| uint_field(v, "max_bs", max_bs_label, e));
    let max_bs = max_bs_given.unwrap_or(DEFAULT_MAX_BS);
    if max_bs == 0 || max_bs > MAX_BATCH {
        // Checked before the bucket list is built from it.
        e.push(max_bs_label.into(), format!("{max_bs} must be in [1, {MAX_BATCH}]"));
        return None;
    }
    let buckets = read_buckets(v, o, max_bs, e);
    if let Some(list) = buckets.as_ref() {
        check_bucket_bounds(list, spec, e);
    }
    if let (Some(given), Some(largest)) = (max_bs_given, buckets.as_ref().and_then(|b| b.last())) {
        if *largest > given {
            e.push(
                max_bs_label.into(),
                format!("{given} is below the largest bucket {largest} of capture.buckets (give a larger --max-bs or smaller buckets)"),
            );
        }
    }
    let page_size = o
        .page_size
        .or_else(|| uint_field(v, "page_size", &flags::label("page_size"), e))
        .unwrap_or(1);
    if !page_size.is_power_of_two() || page_size > MAX_PAGE_SIZE {
        e.push(
            flags::label("page_size"),
            format!("{page_size} must be a power of two in [1, {MAX_PAGE_SIZE}]"),
        );
    }
    let max_pos = m.desc.max_position_embeddings;
    let ctx_given = o
        .max_context_len
        .or_else(|| uint_field(v, "max_context_len", ctx_label, e));
    let ctx = ctx_given.unwrap_or(max_pos);
    let ctx_ok = ctx <= MAX_CONTEXT;
    if ctx > max_pos && ctx <= MAX_CONTEXT {
        // Engines serve a head at the target's context (SGLang sets the draft's context
        // length to the target's); RoPE is defined at every position.
        e.note(format!(
            "max_context_len {ctx} is above the head's max_position_embeddings {max_pos} (its training length): positions past {max_pos} are served as the engines serve them; the plan records both"
        ));
    }
    if let specplan_format::RopeScaling::LongRope {
        original_max_position_embeddings: orig,
        ..
    } = m.desc.rope_scaling
    {
        // Positions run to ctx − 1; SGLang's short table has L₀ rows (positions 0..L₀−1)
        // and a position of L₀ already reads the long table.
        if ctx > orig && ctx <= MAX_CONTEXT {
            e.push(
                ctx_label.into(),
                format!("{ctx} is above LongRoPE's original_max_position_embeddings {orig}: the engines switch to the long factors at position {orig} and switch a whole batch once any position passes it, which a plan cannot follow; give --max-context-len {orig}"),
            );
        }
    }
    if ctx > MAX_CONTEXT {
        let from = if ctx_given.is_none() {
            " (the default: max_position_embeddings; give a smaller --max-context-len)"
        } else {
            ""
        };
        e.push(ctx_label.into(), format!("{ctx}{from} exceeds {MAX_CONTEXT}"));
    }
    if let Some(s) = spec {
        if ctx <= s.num_draft_tokens {
            e.push(
                ctx_label.into(),
                format!(
                    "{ctx} must exceed num_draft_tokens {} (prefix + N rows must fit)",
                    s.num_draft_tokens
                ),
            );
        }
    }
    let dtype = read_dtype(v, o, m, e);
    let hot = o
        .hot_vocab_size
        .or_else(|| uint_field(v, "hot_vocab_size", &flags::label("hot_vocab_size"), e));
    if hot.is_some() && m.desc.head == specplan_format::HeadKind::Eagle3 {
        e.push(
            flags::label("hot_vocab_size"),
            "does not apply to an EAGLE-3 head: its draft vocabulary already maps to target ids through d2t".into(),
        );
    }
    if let (None, Some(s)) = (m.desc.draft_vocab, spec) {
        if m.desc.vocab < s.topk {
            e.push(
                "model.vocab_size".into(),
                format!(
                    "{} is below topk = {}: the top-K needs at least topk vocabulary rows",
                    m.desc.vocab, s.topk
                ),
            );
        }
    }
    if let (Some(vd), Some(s)) = (m.desc.draft_vocab, spec) {
        if vd < s.topk {
            e.push(
                "model.draft_vocab_size".into(),
                format!(
                    "{vd} is below topk = {}: the top-K needs at least topk draft-vocabulary rows",
                    s.topk
                ),
            );
        }
    }
    if let (Some(h), Some(s)) = (hot, spec) {
        if h < s.topk || h > m.desc.vocab {
            e.push(
                flags::label("hot_vocab_size"),
                format!("{h} must be in [topk = {}, vocab_size = {}]", s.topk, m.desc.vocab),
            );
        }
    }
    let outputs = read_outputs(v, o, e);
    let decode_steps = spec.map_or_else(Vec::new, |s| phases::read_decode_steps(v, o, s, e));
    let decode_verify = phases::read_decode_outputs(v, o, !decode_steps.is_empty(), e);
    let buckets = buckets?;
    let max_b = *buckets.last()?;
    // Sizes derived from a refused context length would only repeat its error.
    let (kv_pool_pages, max_requests) = read_pool_and_slots(v, o, m, ctx_ok.then_some(ctx), page_size, max_b, e);
    Some(CaptureConfig {
        buckets,
        page_size,
        max_context_len: ctx,
        kv_pool_pages,
        max_requests,
        dtype,
        hot_vocab_size: hot,
        outputs,
        decode_steps,
        decode_verify,
        tp: tp::read_tp(v, o, e),
        kv_parts: 1,
    })
}

/// `capture.outputs`: the fused top-K (the default), the selected row's logits, or both.
fn read_outputs(v: &Value, o: &Overrides, e: &mut Errors) -> HeadOutputs {
    let outputs_label = &flags::label("outputs");
    let text = match (&o.outputs, v.get("outputs")) {
        (Some(s), _) => s.clone(),
        (None, None | Some(Value::Null)) => return HeadOutputs::TOPK,
        (None, Some(Value::String(s))) => s.clone(),
        (None, Some(Value::Array(a))) => a
            .iter()
            .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string))
            .collect::<Vec<_>>()
            .join(","),
        (None, Some(x)) => {
            e.push(
                outputs_label.into(),
                format!("expected \"topk\", \"topk-draft\", \"logits\" or a top-K and \"logits\" joined by a comma, got {x}"),
            );
            return HeadOutputs::TOPK;
        }
    };
    HeadOutputs::parse(&text).unwrap_or_else(|| {
        e.push(
            outputs_label.into(),
            format!("\"{text}\" is not an output set (expected topk, topk-draft, logits, or a top-K and logits joined by a comma)"),
        );
        HeadOutputs::TOPK
    })
}

fn read_dtype(v: &Value, o: &Overrides, m: &ModelConfig, e: &mut Errors) -> DType {
    let text = match (&o.dtype, v.get("dtype")) {
        (Some(s), _) => Some(s.clone()),
        (None, None | Some(Value::Null)) => None,
        (None, Some(Value::String(s))) => Some(s.clone()),
        (None, Some(x)) => {
            e.push(
                "capture.dtype (--dtype)".into(),
                format!("expected a string (bf16 or fp16), got {x}"),
            );
            None
        }
    };
    match text.as_deref() {
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
    }
}

/// `kv_pool_pages` and `max_requests`, with the sizes derived from them: the pool's bytes
/// and the page table's entries (checked arithmetic, against the plan validator's bounds;
/// not checked when the context length `ctx` was refused).
fn read_pool_and_slots(
    v: &Value,
    o: &Overrides,
    m: &ModelConfig,
    ctx: Option<u32>,
    page_size: u32,
    max_b: u32,
    e: &mut Errors,
) -> (u32, u32) {
    let pool_label = &flags::label("kv_pool_pages");
    let reqs_label = &flags::label("max_requests");
    let pages_per_req = ctx.unwrap_or(1).div_ceil(page_size.max(1)) as u64;
    let pool_given = o
        .kv_pool_pages
        .or_else(|| uint_field(v, "kv_pool_pages", pool_label, e));
    let pool = pool_given
        .map_or(max_b as u64 * pages_per_req + 1, u64::from)
        .min(u32::MAX as u64) as u32;
    let from = if pool_given.is_none() {
        " (the default: largest bucket × pages per request + 1 scratch page; give --kv-pool-pages)"
    } else {
        ""
    };
    if pool < 2 {
        e.push(
            pool_label.into(),
            format!("{pool} must be at least 2 (one page for requests, one scratch page)"),
        );
    } else if pool > MAX_POOL_PAGES {
        e.push(
            pool_label.into(),
            format!("{pool}{from} exceeds {MAX_POOL_PAGES} (page ids are i32)"),
        );
    } else if ctx.is_some() {
        let d = &m.desc;
        // K and V, every layer, 2-byte elements.
        let page_bytes = page_size as u64 * d.kv_heads as u64 * d.head_dim as u64 * 2 * 2 * d.layers as u64;
        let bytes = (pool as u64).checked_mul(page_bytes);
        if bytes.is_none_or(|b| b > MAX_REGION_BYTES) {
            e.push(
                pool_label.into(),
                format!(
                    "{pool}{from} pages of {page_bytes} bytes (K and V of {} layers) exceed the 64 GiB ({MAX_REGION_BYTES} bytes) a KV pool may take",
                    d.layers
                ),
            );
        }
    }
    let max_requests = o
        .max_requests
        .or_else(|| uint_field(v, "max_requests", reqs_label, e))
        .unwrap_or(max_b);
    let entries = (max_requests as u64 + 1) * pages_per_req;
    if max_requests > MAX_REQUESTS {
        e.push(reqs_label.into(), format!("{max_requests} exceeds {MAX_REQUESTS}"));
    } else if entries > MAX_TABLE_ENTRIES && ctx.is_some() {
        e.push(
            reqs_label.into(),
            format!(
                "{max_requests} request slots + 1 scratch slot × {pages_per_req} pages each = {entries} page-table entries exceed {MAX_TABLE_ENTRIES}"
            ),
        );
    }
    if max_requests < max_b {
        e.push(
            reqs_label.into(),
            format!("{max_requests} is below the largest bucket {max_b} (every request of a step needs a slot)"),
        );
    }
    (pool, max_requests)
}
