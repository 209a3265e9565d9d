//! What a config file describes, decided before its model keys are read.
//!
//! Released draft-head configs come in three formats — Hugging Face `config.json` (SGLang's
//! and SpecForge's heads, SafeAILab's training configs), vLLM's nested EAGLE config
//! (`{"model_type": "eagle", "model": {...}}`) and the Speculators format
//! (`"speculators_model_type"` with a `transformer_layer_config`) — and beside EAGLE heads
//! the same files describe other drafters, MoE drafts and whole target models. This stage
//! lifts an interchange format into the flat key set the readers take (`max_sequence_length`
//! read as `max_position_embeddings`), decides the head kind from `architectures`,
//! `model_type` and the EAGLE markers (`draft_vocab_size`, `target_hidden_size`,
//! `eagle_config`), and refuses — naming the key and saying what the file is — everything
//! specplan cannot compile faithfully: another drafter family, a multi-token-prediction
//! module, an MoE draft, a target model, a non-Llama layer, and each key that would change
//! the forward. Keys it neither reads nor checks are returned as ignored (`compile -v`).

use serde_json::{Map, Value};

use super::Errors;

/// A config's model keys, flat, as the readers take them, and what was recognized.
pub struct Recognized {
    pub model: Value,
    /// The format the file was read as.
    pub format: &'static str,
    /// Keys present that nothing reads or checks (they do not change the plan).
    pub ignored: Vec<String>,
}

/// Keys that carry no forward semantics for a draft head (ids, training metadata).
const HARMLESS: &[&str] = &[
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "transformers_version",
    "use_cache",
    "pretraining_tp",
    "attention_dropout",
    "hidden_dropout",
    "torchscript",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
];

/// Keys this stage reads and checks itself (beside the readers' `MODEL_KEYS`).
const CHECKED: &[&str] = &[
    "model_type",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "use_qk_norm",
    "qk_layernorm",
    "use_qk_layernorm",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "partial_rotary_factor",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "quantization_config",
    "kv_lora_rank",
    "q_lora_rank",
    "max_sequence_length",
    "num_nextn_predict_layers",
    "medusa_num_heads",
];

fn path(prefix: &str, key: &str) -> String {
    format!("{prefix}{key}")
}

fn names(obj: &Map<String, Value>) -> Vec<String> {
    match obj.get("architectures") {
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect(),
        Some(Value::String(s)) => vec![s.clone()],
        _ => Vec::new(),
    }
}

/// Lifts an interchange format into a flat object, or refuses it. Returns the object and
/// the format's name.
fn lift(v: &Value, prefix: &str, e: &mut Errors) -> Option<(Map<String, Value>, &'static str)> {
    let Some(obj) = v.as_object() else {
        e.push(
            prefix.trim_end_matches('.').to_string(),
            format!("expected a table of model keys, got {v}"),
        );
        return None;
    };
    if let Some(kind) = obj.get("speculators_model_type") {
        let Some(layer) = obj.get("transformer_layer_config").and_then(Value::as_object) else {
            e.push(
                path(prefix, "transformer_layer_config"),
                "missing: a Speculators config keeps the draft layer's model keys there".into(),
            );
            return None;
        };
        let mut out = layer.clone();
        let head = match kind.as_str() {
            Some("eagle3") => "eagle3",
            Some("eagle") => "eagle1",
            _ => {
                e.push(
                    path(prefix, "speculators_model_type"),
                    format!("{kind} is not an EAGLE head (specplan compiles \"eagle\" and \"eagle3\")"),
                );
                return None;
            }
        };
        // The head's own keys live beside the layer config.
        for key in [
            "draft_vocab_size",
            "norm_before_residual",
            "target_hidden_size",
            "tie_word_embeddings",
            "layernorms",
            "fusion_bias",
        ] {
            if let Some(x) = obj.get(key).filter(|x| !x.is_null()) {
                out.insert(key.into(), x.clone());
            }
        }
        if let Some(b) = out.remove("fusion_bias") {
            out.insert("bias".into(), b);
        }
        out.remove("architectures");
        out.insert("head".into(), Value::String(head.into()));
        return Some((out, "Speculators config"));
    }
    let nested = obj.get("model").and_then(Value::as_object);
    if obj.get("model_type").and_then(Value::as_str) == Some("eagle") && nested.is_some() {
        let mut out = nested.cloned().unwrap_or_default();
        let top = names(obj);
        let head = if top.iter().any(|n| n.to_ascii_lowercase().contains("eagle3")) {
            "eagle3"
        } else {
            "eagle1"
        };
        // The nested `model` is the draft's layer config; its `architectures` names the
        // target's class, so the top level's decides.
        out.insert(
            "architectures".into(),
            Value::Array(top.into_iter().map(Value::String).collect()),
        );
        for (k, x) in obj {
            if !["model", "model_type", "architectures"].contains(&k.as_str()) && !out.contains_key(k) {
                out.insert(k.clone(), x.clone());
            }
        }
        out.insert("head".into(), Value::String(head.into()));
        return Some((out, "vLLM nested EAGLE config"));
    }
    Some((obj.clone(), "config"))
}

/// The drafter or module class a name says, when it is not an EAGLE head.
fn other_family(name: &str) -> Option<&'static str> {
    let n = name.to_ascii_lowercase();
    let families: &[(&str, &str)] = &[
        ("dflash", "a DFlash draft model (a block-diffusion drafter)"),
        ("dspark", "a DSpark draft model"),
        ("domino", "a Domino draft model"),
        ("peagle", "a parallel-EAGLE (PEagle) draft model"),
        ("medusa", "a Medusa head set"),
        ("hydra", "a Hydra head set"),
        ("mlpspeculator", "an MLP speculator"),
        ("assistant", "an assistant (small LM) drafter"),
        ("nextn", "a multi-token-prediction (NextN) module"),
        ("mtp", "a multi-token-prediction (MTP) module"),
    ];
    families.iter().find(|(k, _)| n.contains(k)).map(|(_, what)| *what)
}

/// `model_type` values of drafters that are not EAGLE heads.
fn other_model_type(t: &str) -> Option<&'static str> {
    match t {
        "medusa" => Some("a Medusa head set"),
        "mlp_speculator" => Some("an MLP speculator"),
        "deepseek_mtp" | "mtp" => Some("a multi-token-prediction module"),
        "dflash" => Some("a DFlash draft model"),
        _ => None,
    }
}

fn truthy(x: &Value) -> bool {
    match x {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Recognizes the file, lifts it and checks the keys that would change the forward.
/// `None` when it is refused (every reason pushed to `e`).
pub fn recognize(v: &Value, prefix: &str, e: &mut Errors) -> Option<Recognized> {
    let (mut obj, format) = lift(v, prefix, e)?;
    let before = e.len();
    let archs = names(&obj);
    let arch_key = path(prefix, "architectures");
    let shown = archs.join(", ");
    // 1. Another drafter family, or a module of a target model.
    if let Some(what) = archs.iter().find_map(|a| other_family(a)) {
        e.push(
            arch_key.clone(),
            format!(
                "[{shown}]: the file is {what}, not an EAGLE draft head; specplan compiles EAGLE-1/2 and EAGLE-3 heads"
            ),
        );
        return None;
    }
    if let Some(what) = obj.get("model_type").and_then(Value::as_str).and_then(other_model_type) {
        e.push(
            path(prefix, "model_type"),
            format!("the file is {what}, not an EAGLE draft head"),
        );
        return None;
    }
    // 2. An MoE draft.
    for key in ["num_experts", "num_local_experts", "n_routed_experts"] {
        if let Some(x) = obj.get(key).filter(|x| truthy(x)) {
            e.push(
                path(prefix, key),
                format!("{x}: the file describes an MoE model (its MLP routes among experts); specplan compiles dense draft layers only"),
            );
            return None;
        }
    }
    if archs.iter().any(|a| a.to_ascii_lowercase().contains("moe")) {
        e.push(
            arch_key.clone(),
            format!("[{shown}]: an MoE draft; specplan compiles dense draft layers only"),
        );
        return None;
    }
    // 3. The head kind, from an explicit `head`, the class name or the EAGLE-3 markers.
    let marker3 = ["draft_vocab_size", "target_hidden_size", "eagle_config"]
        .into_iter()
        .find(|k| obj.get(*k).is_some_and(|x| !x.is_null()));
    let arch3 = archs.iter().any(|a| a.to_ascii_lowercase().contains("eagle3"));
    let arch1 = archs.iter().any(|a| a.to_ascii_lowercase().contains("eagle"));
    let layers = obj.get("num_hidden_layers").and_then(Value::as_u64);
    if obj.get("head").is_none() {
        if arch3 || marker3.is_some() {
            obj.insert("head".into(), Value::String("eagle3".into()));
        } else if arch1 {
            obj.insert("head".into(), Value::String("eagle1".into()));
        } else if !archs.is_empty() && layers.is_some_and(|l| l > 1) {
            // 4. A target model: a plain causal-LM class, several layers, no EAGLE marker.
            e.push(
                path(prefix, "num_hidden_layers"),
                format!(
                    "{}: with architectures [{shown}] and no EAGLE marker (an …Eagle/…Eagle3 class, draft_vocab_size, target_hidden_size, eagle_config) the file is a target model's config, not a draft head; pass the draft head's config.json",
                    layers.unwrap_or(0)
                ),
            );
            return None;
        }
    }
    // 5. The layer must be Llama's (SGLang's llama_eagle/llama_eagle3 and Mistral's EAGLE-1
    // class, vLLM's Eagle/Eagle3 Llama classes, SafeAILab's Llama-based training configs).
    if let Some(a) = archs.iter().find(|a| {
        let n = a.to_ascii_lowercase();
        !(n.contains("llama") || n.starts_with("mistralforcausallm") || n == "eaglemodel" || n == "eagle3speculator")
    }) {
        e.push(
            arch_key.clone(),
            format!("\"{a}\": not a Llama-architecture head (its layers differ: attention bias, q/k norms or latent attention); specplan compiles Llama-layer EAGLE heads (LlamaForCausalLMEagle, LlamaForCausalLMEagle3, MistralForCausalLMEagle, and 1-layer LlamaForCausalLM training configs)"),
        );
        return None;
    }
    // 6. Keys that would change the forward.
    if let Some(x) = obj.get("hidden_act").filter(|x| !x.is_null()) {
        if x.as_str() != Some("silu") {
            e.push(
                path(prefix, "hidden_act"),
                format!("{x} is not supported: the MLP is SiLU-gated (silu)"),
            );
        }
    }
    for (key, what) in [
        ("attention_bias", "q/k/v/o projections with a bias"),
        ("mlp_bias", "MLP projections with a bias"),
        ("use_qk_norm", "RMS norms on q and k"),
        ("qk_layernorm", "norms on q and k"),
        ("use_qk_layernorm", "norms on q and k"),
        ("attn_logit_softcapping", "soft-capped attention logits"),
        ("final_logit_softcapping", "soft-capped output logits"),
        ("quantization_config", "a quantized checkpoint"),
        ("kv_lora_rank", "multi-head latent attention"),
        ("q_lora_rank", "multi-head latent attention"),
        ("layernorms", "the extra norms of a HASS-style head"),
        ("moe_intermediate_size", "MoE experts"),
        ("num_experts_per_tok", "MoE routing"),
    ] {
        if let Some(x) = obj.get(key).filter(|x| truthy(x)) {
            e.push(path(prefix, key), format!("{x}: {what} is not supported"));
        }
    }
    if let Some(x) = obj.get("partial_rotary_factor").and_then(Value::as_f64) {
        if x != 1.0 {
            e.push(
                path(prefix, "partial_rotary_factor"),
                format!("{x}: RoPE on part of each head is not supported (the whole head rotates)"),
            );
        }
    }
    for key in [
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
    ] {
        if let Some(x) = obj.get(key).and_then(Value::as_f64) {
            if x != 1.0 {
                e.push(
                    path(prefix, key),
                    format!("{x}: a scaled residual stream is not supported"),
                );
            }
        }
    }
    // 7. Old configs name the training length max_sequence_length.
    if !obj.contains_key("max_position_embeddings") {
        if let Some(x) = obj.get("max_sequence_length").cloned() {
            obj.insert("max_position_embeddings".into(), x);
        }
    }
    if e.len() > before {
        return None;
    }
    let mut ignored: Vec<String> = obj
        .keys()
        .filter(|k| {
            let k = k.as_str();
            !super::keys::MODEL_KEYS.contains(&k) && !CHECKED.contains(&k) && !HARMLESS.contains(&k)
        })
        .map(|k| path(prefix, k))
        .collect();
    ignored.sort();
    Some(Recognized {
        model: Value::Object(obj),
        format,
        ignored,
    })
}
