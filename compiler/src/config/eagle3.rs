//! Which EAGLE head a config describes, and EAGLE-3's own keys
//! (`../shared`-documented: fc over three target layers, `draft_vocab_size` with `d2t`,
//! one `midlayer`, RoPE from the head's own config).
//!
//! A head is EAGLE-3 when `architectures` names an `…Eagle3` class (Hugging Face
//! `config.json`, e.g. `LlamaForCausalLMEagle3`) or a TOML `[model]` table says
//! `head = "eagle3"`. Forms the engines disagree on or that specplan does not compute yet
//! are refused with the key that asks for them: more than one layer, `norm_before_residual`,
//! `use_aux_hidden_state = false`, an fc bias, and a target whose three
//! layers are exactly H wide (where EAGLE-3 skips its fc).

use serde_json::Value;
use specplan_format::HeadKind;

use super::limits::{MAX_HIDDEN, MAX_VOCAB};
use super::Errors;

/// The head facts a model config adds to the EAGLE-1/2 ones.
pub struct Head {
    pub kind: HeadKind,
    pub target_hidden: u32,
    pub draft_vocab: Option<u32>,
    pub fc_bias: bool,
    /// `tie_word_embeddings`: the head's lm_head is its embedding (SGLang 0.5.23 sets
    /// `lm_head = model.embed_tokens`, `srt/models/llama_eagle3.py:303-304`).
    pub tied: bool,
}

fn path(prefix: &str, key: &str) -> String {
    format!("{prefix}{key}")
}

fn is_eagle3(obj: &serde_json::Map<String, Value>, prefix: &str, e: &mut Errors) -> bool {
    let by_arch = match obj.get("architectures") {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => a.iter().any(|x| x.as_str().is_some_and(|s| s.ends_with("Eagle3"))),
        Some(v) => {
            e.push(
                path(prefix, "architectures"),
                format!("expected a list of class names, got {v}"),
            );
            false
        }
    };
    let by_head = match obj.get("head") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "eagle3" => Some(true),
        Some(Value::String(s)) if s == "eagle1" || s == "eagle" => Some(false),
        Some(v) => {
            e.push(
                path(prefix, "head"),
                format!("expected \"eagle1\" or \"eagle3\", got {v}"),
            );
            None
        }
    };
    by_head.unwrap_or(by_arch)
}

fn uint(obj: &serde_json::Map<String, Value>, prefix: &str, key: &str, max: u32, e: &mut Errors) -> Option<u32> {
    match obj.get(key) {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(x) if x > 0 && x <= max as u64 => Some(x as u32),
            _ => {
                e.push(
                    path(prefix, key),
                    format!("expected a positive integer at most {max}, got {v}"),
                );
                None
            }
        },
    }
}

/// Reads the head kind and EAGLE-3's keys. `hidden`, `vocab`, `layers`: the values the
/// model reader resolved (None when they were missing or bad: already reported).
pub fn read_head(
    obj: &serde_json::Map<String, Value>,
    prefix: &str,
    hidden: Option<u32>,
    vocab: Option<u32>,
    layers: Option<u32>,
    fc_bias: bool,
    e: &mut Errors,
) -> Head {
    if !is_eagle3(obj, prefix, e) {
        return Head {
            kind: HeadKind::Eagle1,
            target_hidden: hidden.unwrap_or(0),
            draft_vocab: None,
            fc_bias,
            tied: false,
        };
    }
    let target_hidden = uint(obj, prefix, "target_hidden_size", MAX_HIDDEN, e)
        .or(hidden)
        .unwrap_or(0);
    let draft_vocab = uint(obj, prefix, "draft_vocab_size", MAX_VOCAB, e);
    if let (Some(vd), Some(v)) = (draft_vocab, vocab) {
        if vd > v {
            e.push(
                path(prefix, "draft_vocab_size"),
                format!("{vd} exceeds vocab_size {v} (d2t maps each draft id to a target id)"),
            );
        }
    }
    if let Some(l) = layers.filter(|&l| l != 1) {
        e.push(
            path(prefix, "num_hidden_layers"),
            format!("{l}: EAGLE-3 heads with more than one layer are not supported (vLLM and SGLang compute layers after the first differently); the released heads have 1"),
        );
    }
    if obj.get("norm_before_residual").and_then(Value::as_bool) == Some(true) {
        e.push(
            path(prefix, "norm_before_residual"),
            "true is not supported: layer 0's residual is h, not hidden_norm(h)".into(),
        );
    }
    // Tied: the lm_head is the [V, H] embedding. Under a draft vocabulary SGLang 0.5.23
    // multiplies by the whole embedding and keeps the logits' first V_d columns
    // (logits_processor.py:1346-1347): lm_head is the embedding's first V_d rows. vLLM
    // 0.33.0 ignores the key for EAGLE-3 (its head loads lm_head.weight): say so.
    let tied = obj.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true);
    if let (true, Some(vd), Some(v)) = (tied, draft_vocab, vocab) {
        if vd < v {
            e.note(format!(
                "{}: lm_head is embed_tokens' first {vd} rows (draft_vocab_size {vd} of vocab_size {v}), as SGLang 0.5.23 computes a tied EAGLE-3 head; vLLM 0.33.0 ignores the key and loads lm_head.weight",
                path(prefix, "tie_word_embeddings")
            ));
        }
    }
    let aux = obj
        .get("eagle_config")
        .and_then(|c| c.get("use_aux_hidden_state"))
        .and_then(Value::as_bool);
    if aux == Some(false) {
        e.push(
            path(prefix, "eagle_config.use_aux_hidden_state"),
            "false is not supported: the head's input is three target layers' features".into(),
        );
    }
    // SGLang's fc-bias switch; an EAGLE-3 config without the key has none.
    let bias = obj.get("bias").and_then(Value::as_bool).unwrap_or(false);
    if bias {
        e.push(
            path(prefix, "bias"),
            "true is not supported: EAGLE-3's fc has no bias".into(),
        );
    }
    if let Some(h) = hidden {
        if target_hidden.saturating_mul(3) == h {
            e.push(
                path(prefix, "target_hidden_size"),
                format!("3 × {target_hidden} equals hidden_size {h}: EAGLE-3 would skip its fc, which specplan does not compile"),
            );
        }
    }
    Head {
        kind: HeadKind::Eagle3,
        target_hidden,
        draft_vocab,
        fc_bias: false,
        tied,
    }
}
