//! The compile flags, declared once (in the spirit of Cranelift's settings): each flag's
//! field, value type, TOML table and key, CLI flag, Python keywords, bounds, default and
//! help. The [`flags!`] table below generates [`Overrides`] and [`FLAGS`]; from `FLAGS` the
//! TOML reader takes its known `[speculative]`/`[capture]` keys and field labels, the CLI
//! builds its arguments (`cli/src/flags.rs`), and the Python package its keyword arguments
//! (`Plan.compile`). A new flag is one entry here plus the reader code that gives it its
//! meaning.

/// A flag's value as a user gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlagValue {
    U32(u32),
    Text(String),
}

/// How a flag's value is spelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A non-negative integer.
    U32,
    /// A string.
    Text,
    /// A string; Python also takes a list of integers, joined by commas (`buckets`).
    IntList,
    /// A string; Python also takes a list of strings, joined by commas (`outputs`).
    TextList,
}

/// One compile flag.
#[derive(Clone, Copy, Debug)]
pub struct Flag {
    /// The field of [`Overrides`] and the TOML key.
    pub key: &'static str,
    /// The TOML table that holds the key.
    pub table: &'static str,
    /// The CLI flag without its dashes (`speculative-eagle-topk`).
    pub cli: &'static str,
    /// The Python keywords (snake_case; the first is the canonical one).
    pub python: &'static [&'static str],
    pub kind: Kind,
    /// Inclusive bounds of an integer flag (the readers check them with the rule's message;
    /// the help text shows them).
    pub bounds: Option<(u64, u64)>,
    /// What applies when the flag and the file both leave it out.
    pub default: &'static str,
    pub help: &'static str,
    set: fn(&mut Overrides, FlagValue) -> Result<(), String>,
}

impl Flag {
    /// `capture.page_size (--page-size)`: how errors name the field.
    pub fn label(&self) -> String {
        format!("{}.{} (--{})", self.table, self.key, self.cli)
    }

    /// Sets the flag on `o`; an error says what type was expected.
    pub fn set(&self, o: &mut Overrides, v: FlagValue) -> Result<(), String> {
        (self.set)(o, v)
    }

    /// The help line with bounds and default (the doc comment's lines joined, one space
    /// between words).
    pub fn help_text(&self) -> String {
        let mut s = self.help.split_whitespace().collect::<Vec<_>>().join(" ");
        if let Some((lo, hi)) = self.bounds {
            s.push_str(&format!(" [{lo}, {hi}]"));
        }
        if !self.default.is_empty() {
            s.push_str(&format!(" (default: {})", self.default));
        }
        s
    }
}

trait FromFlag: Sized {
    fn from_flag(v: FlagValue) -> Result<Self, String>;
}

impl FromFlag for u32 {
    fn from_flag(v: FlagValue) -> Result<u32, String> {
        match v {
            FlagValue::U32(x) => Ok(x),
            FlagValue::Text(t) => t
                .trim()
                .parse()
                .map_err(|_| format!("expected a non-negative integer, got {t:?}")),
        }
    }
}

impl FromFlag for String {
    fn from_flag(v: FlagValue) -> Result<String, String> {
        match v {
            FlagValue::Text(t) => Ok(t),
            FlagValue::U32(x) => Ok(x.to_string()),
        }
    }
}

macro_rules! flags {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $ty:ty {
            table: $table:literal,
            cli: $cli:literal,
            python: [$($py:literal),+],
            kind: $kind:ident,
            bounds: $bounds:expr,
            default: $default:literal $(,)?
        }
    )*) => {
        /// Compile flags as given on the command line or to `Plan.compile`; `None` = take
        /// the file's value or the default. Generated from the flag table.
        #[derive(Clone, Debug, Default)]
        pub struct Overrides {
            $( $(#[doc = $doc])* pub $field: Option<$ty>, )*
        }

        mod setters {
            use super::*;
            $(
                pub fn $field(o: &mut Overrides, v: FlagValue) -> Result<(), String> {
                    o.$field = Some(<$ty as FromFlag>::from_flag(v)?);
                    Ok(())
                }
            )*
        }

        /// Every compile flag, in help order.
        pub const FLAGS: &[Flag] = &[$(
            Flag {
                key: stringify!($field),
                table: $table,
                cli: $cli,
                python: &[$($py),+],
                kind: Kind::$kind,
                bounds: $bounds,
                default: $default,
                help: concat!($($doc, " "),*),
                set: setters::$field,
            },
        )*];
    };
}

use crate::config::limits::{
    MAX_BATCH, MAX_CONTEXT, MAX_PAGE_SIZE, MAX_POOL_PAGES, MAX_REQUESTS, MAX_STEPS, MAX_TOPK, MAX_TP_SIZE,
};

const fn b(lo: u64, hi: u32) -> Option<(u64, u64)> {
    Some((lo, hi as u64))
}

flags! {
    /// Candidates per request (SGLang's --speculative-eagle-topk).
    topk: u32 { table: "speculative", cli: "speculative-eagle-topk",
        python: ["speculative_eagle_topk", "topk"], kind: U32, bounds: b(1, MAX_TOPK), default: "" }
    /// Draft steps per decoding step (SGLang's --speculative-num-steps).
    num_steps: u32 { table: "speculative", cli: "speculative-num-steps",
        python: ["speculative_num_steps", "num_steps"], kind: U32, bounds: b(1, MAX_STEPS), default: "" }
    /// Tokens verified per request: the draft-extend rows per request (SGLang's
    /// --speculative-num-draft-tokens).
    num_draft_tokens: u32 { table: "speculative", cli: "speculative-num-draft-tokens",
        python: ["speculative_num_draft_tokens", "num_draft_tokens"], kind: U32,
        bounds: b(1, crate::config::limits::MAX_DRAFT_TOKENS), default: "" }
    /// "auto" (SGLang's speculative capture list up to --max-bs) or e.g. 1,2,4,8.
    buckets: String { table: "capture", cli: "buckets", python: ["buckets"], kind: IntList,
        bounds: None, default: "auto" }
    /// Largest batch bucket of "auto".
    max_bs: u32 { table: "capture", cli: "max-bs", python: ["max_bs"], kind: U32,
        bounds: b(1, MAX_BATCH), default: "256" }
    /// Tokens per KV page (a power of two).
    page_size: u32 { table: "capture", cli: "page-size", python: ["page_size"], kind: U32,
        bounds: b(1, MAX_PAGE_SIZE), default: "1" }
    /// Longest prefix + draft rows of a request (above num_draft_tokens).
    max_context_len: u32 { table: "capture", cli: "max-context-len", python: ["max_context_len"],
        kind: U32, bounds: b(2, MAX_CONTEXT), default: "the model's max_position_embeddings" }
    /// Pages in the KV pool.
    kv_pool_pages: u32 { table: "capture", cli: "kv-pool-pages", python: ["kv_pool_pages"],
        kind: U32, bounds: b(2, MAX_POOL_PAGES),
        default: "largest bucket × pages per request + 1 scratch page" }
    /// Request slots in the device page table.
    max_requests: u32 { table: "capture", cli: "max-requests", python: ["max_requests"],
        kind: U32, bounds: b(1, MAX_REQUESTS), default: "the largest bucket" }
    /// Activation dtype: bf16 or fp16.
    dtype: String { table: "capture", cli: "dtype", python: ["dtype"], kind: Text, bounds: None,
        default: "the model's torch_dtype, or bf16" }
    /// Sliding window W for every layer (overrides the model's).
    sliding_window: u32 { table: "model", cli: "sliding-window", python: ["sliding_window"],
        kind: U32, bounds: b(1, MAX_CONTEXT), default: "the model's" }
    /// FR-Spec: keep V_h hot lm_head rows (needs hot_token_ids in the weights).
    hot_vocab_size: u32 { table: "capture", cli: "hot-vocab-size", python: ["hot_vocab_size"],
        kind: U32, bounds: None, default: "" }
    /// What the head emits per request besides its hidden row: topk (the fused top-K,
    /// target ids), topk-draft (the fused top-K with ids left in the lm_head's vocabulary,
    /// for an engine that maps them itself), logits (the selected row's logits over the
    /// lm_head's rows, for an engine that samples itself, as SGLang's draft-extend slot
    /// does), or a top-K and logits joined by a comma.
    outputs: String { table: "capture", cli: "outputs", python: ["outputs"], kind: TextList,
        bounds: None, default: "topk" }
    /// The draft-decode phase's step-count tiers, e.g. 3, or 2,3,5 for SGLang's adaptive
    /// speculation (one graph per tier and bucket; tiers other than num_steps need topk 1);
    /// "auto" is num_steps; "none" compiles draft-extend only.
    draft_decode_steps: String { table: "capture", cli: "draft-decode-steps",
        python: ["draft_decode_steps"], kind: IntList, bounds: None, default: "none" }
    /// What the draft-decode phases emit: tree (SGLang's slot: parent_list,
    /// top_scores_index, draft_tokens) or tree,verify (also the target's verify inputs SGLang
    /// builds after its slot: tokens with the bonus root, positions, retrieve_index /
    /// retrieve_next_token / retrieve_next_sibling and the tree mask, from bonus_tokens).
    draft_decode_outputs: String { table: "capture", cli: "draft-decode-outputs",
        python: ["draft_decode_outputs"], kind: TextList, bounds: None, default: "tree" }
    /// Tensor-parallel degree T of the engine's draft head (a power of two): the plan
    /// computes one rank's share (column-parallel q/k/v and gate/up, row-parallel o and down
    /// with an all-reduce after each, vocabulary-parallel lm_head with a cross-rank top-K).
    tp_size: u32 { table: "capture", cli: "tp-size", python: ["tp_size", "tensor_parallel_size"],
        kind: U32, bounds: b(1, MAX_TP_SIZE), default: "1" }
    /// With tp_size > 1: replicated (every rank holds the whole embedding) or vocab (rank r
    /// holds its 1/T of the rows, as SGLang's and vLLM's VocabParallelEmbedding: what an
    /// engine's draft weights are in place; costs an all-reduce of the fc input).
    tp_embedding: String { table: "capture", cli: "tp-embedding", python: ["tp_embedding"], kind: Text,
        bounds: None, default: "replicated" }
    /// The rank whose share the plan computes (below tp_size).
    tp_rank: u32 { table: "capture", cli: "tp-rank", python: ["tp_rank"], kind: U32,
        bounds: b(0, MAX_TP_SIZE - 1), default: "0" }
}

/// The flag a Python keyword or a TOML/field key names.
pub fn by_python(name: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.python.contains(&name))
}

pub fn by_key(key: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.key == key)
}

/// The label of the flag with field `key` (`speculative.topk (--speculative-eagle-topk)`);
/// the key itself if no flag has it.
pub fn label(key: &str) -> String {
    by_key(key).map_or_else(|| key.to_string(), Flag::label)
}

/// The TOML keys of `table` that are flags.
pub fn table_keys(table: &str) -> Vec<&'static str> {
    FLAGS.iter().filter(|f| f.table == table).map(|f| f.key).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_is_named_once_everywhere() {
        let mut seen = std::collections::HashSet::new();
        for f in FLAGS {
            assert!(seen.insert(f.key), "{}", f.key);
            assert!(seen.insert(f.cli) || f.cli == f.key, "{}", f.cli);
            for p in f.python {
                assert!(by_python(p).is_some_and(|g| g.key == f.key), "{p}");
            }
            assert!(!f.help.trim().is_empty(), "{} has no help", f.key);
        }
    }

    #[test]
    fn setting_a_flag_fills_its_field() {
        let mut o = Overrides::default();
        by_key("page_size").map(|f| f.set(&mut o, FlagValue::U32(16)));
        assert_eq!(o.page_size, Some(16));
        let e = by_key("topk").map(|f| f.set(&mut o, FlagValue::Text("x".into())));
        assert!(matches!(e, Some(Err(m)) if m.contains("non-negative integer")));
        assert_eq!(label("max_bs"), "capture.max_bs (--max-bs)");
    }
}
