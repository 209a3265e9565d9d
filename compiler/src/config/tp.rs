//! Tensor parallelism: the rank's share of a model (`--tp-size`, `--tp-rank`), as SGLang
//! 0.5.23 and vLLM 0.33.0 shard a Llama-style draft head (docs/tensor-parallel.md).
//!
//! q heads, gate/up rows and the lm_head rows split into T equal parts; kv heads too when
//! T divides them, else (T a multiple of the kv heads) each kv head is replicated on T/Hkv
//! ranks, as the engines' `QKVParallelLinear` does. Every refusal names the field.

use serde_json::Value;
use specplan_format::TensorParallel;

use super::{flags, model::ModelConfig, uint_field, CaptureConfig, Errors, Overrides};
use crate::config::limits::MAX_TP_SIZE;

/// `capture.tp_size` / `capture.tp_rank` from the flags or the file (default: unsharded).
pub(super) fn read_tp(v: &Value, o: &Overrides, e: &mut Errors) -> TensorParallel {
    let (size_label, rank_label) = (flags::label("tp_size"), flags::label("tp_rank"));
    let size = o
        .tp_size
        .or_else(|| uint_field(v, "tp_size", &size_label, e))
        .unwrap_or(1);
    let rank = o
        .tp_rank
        .or_else(|| uint_field(v, "tp_rank", &rank_label, e))
        .unwrap_or(0);
    let embed_label = flags::label("tp_embedding");
    let embed = o
        .tp_embedding
        .clone()
        .or_else(|| v.get("tp_embedding").and_then(|x| x.as_str()).map(str::to_string))
        .unwrap_or_else(|| "replicated".into());
    let vocab_embedding = match embed.trim() {
        "replicated" => false,
        "vocab" => true,
        other => {
            e.push(embed_label, format!("{other:?}: expected \"replicated\" or \"vocab\""));
            false
        }
    };
    if !size.is_power_of_two() || size > MAX_TP_SIZE {
        e.push(
            size_label,
            format!("{size} is not a power of two in [1, {MAX_TP_SIZE}]"),
        );
        return TensorParallel::SINGLE;
    }
    if rank >= size {
        e.push(rank_label, format!("{rank} is not below tp_size {size}"));
        return TensorParallel::SINGLE;
    }
    TensorParallel {
        size,
        rank,
        vocab_embedding,
    }
}

/// Replaces the model's heads, kv heads and intermediate rows by rank `c.tp.rank`'s share
/// and sets `c.kv_parts`; refuses what does not split.
pub(super) fn shard(m: &mut ModelConfig, c: &mut CaptureConfig, topk: u32, prefix: &str, e: &mut Errors) {
    let t = c.tp.size;
    c.kv_parts = 1;
    if t <= 1 {
        // One rank: the table is whole whatever the flag says (said, so that a flag that
        // did nothing is not taken for one that did).
        if c.tp.vocab_embedding {
            e.note(format!(
                "{}: vocab applies only with tp_size > 1; the embedding stays whole",
                flags::label("tp_embedding")
            ));
        }
        c.tp.vocab_embedding = false;
        return;
    }
    let d = &mut m.desc;
    let why = format!("tp_size {t}");
    if !d.heads.is_multiple_of(t) {
        e.push(
            format!("{prefix}num_attention_heads"),
            format!(
                "{} does not split over {why} (each rank needs whole query heads)",
                d.heads
            ),
        );
    }
    let (kv_local, kv_parts) = if d.kv_heads.is_multiple_of(t) {
        (d.kv_heads / t, t)
    } else if t.is_multiple_of(d.kv_heads) {
        (1, d.kv_heads)
    } else {
        e.push(
            format!("{prefix}num_key_value_heads"),
            format!(
                "{} neither splits over {why} nor divides it (replicated kv heads)",
                d.kv_heads
            ),
        );
        (1, 1)
    };
    if !d.intermediate.is_multiple_of(t) {
        e.push(
            format!("{prefix}intermediate_size"),
            format!("{} does not split over {why}", d.intermediate),
        );
    }
    let (rows, field) = match (c.hot_vocab_size, d.draft_vocab) {
        (Some(h), _) => (h, flags::label("hot_vocab_size")),
        (None, Some(v)) => (v, format!("{prefix}draft_vocab_size")),
        (None, None) => (d.vocab, format!("{prefix}vocab_size")),
    };
    if !rows.is_multiple_of(t) {
        e.push(
            field,
            format!("{rows} lm_head rows do not split over {why} (the vocabulary-parallel head needs equal shares)"),
        );
    }
    if rows / t < topk {
        e.push(
            flags::label("tp_size"),
            format!("{t} leaves each rank {} lm_head rows, below topk = {}", rows / t, topk),
        );
    }
    if c.tp.vocab_embedding && !d.vocab.is_multiple_of(t) {
        e.push(
            format!("{prefix}vocab_size"),
            format!(
                "{} embedding rows do not split over {why} (tp_embedding vocab)",
                d.vocab
            ),
        );
    }
    d.heads /= t;
    d.kv_heads = kv_local;
    d.intermediate /= t;
    c.kv_parts = kv_parts;
}
