//! The K/V cache and page-table geometry a runtime registers at load, as the kernels that
//! walk the cache read it: eight i64 words in device memory (written once, read once per
//! CTA), and the step status words the engine-memory prologue and epilogue share. The word
//! indices are declared here and emitted into every prelude (`KV_WORD_*`, `STATUS_*`).
//!
//! A token slot is one row of `[kv_heads, head_dim]` activations: position p of a request
//! is at slot `table[req][p]` (token-slot tables, SGLang's `req_to_token`) or
//! `table[req][p / PAGE_SIZE] · PAGE_SIZE + p % PAGE_SIZE` (page-id tables, vLLM's and
//! FlashInfer's block tables); its K is at `k_cache + slot · KV_STRIDE`. A request index
//! outside `[0, TABLE_ROWS)`, a position outside its row, a negative page or a slot outside
//! `[0, KV_SLOTS)` names no slot: reads are zero, writes are skipped.

/// Words of the layout (i64 each).
pub const KV_WORDS: usize = 8;
pub const KV_WORD_MODE: usize = 0;
pub const KV_WORD_TABLE_ROWS: usize = 1;
pub const KV_WORD_TABLE_COLS: usize = 2;
pub const KV_WORD_TABLE_STRIDE: usize = 3;
pub const KV_WORD_SLOTS: usize = 4;
pub const KV_WORD_KV_STRIDE: usize = 5;

/// Words of the step status (i64 each), in runtime memory.
pub const STATUS_WORDS: usize = 8;
/// `epoch << 32 | n`: the step tagged `epoch` refused `n` requests (`admit`). A word tagged
/// with another step says nothing about this one.
pub const STATUS_ERR_COUNT: usize = 0;
/// `epoch << 32 | request << 8 | rule`: the step's lowest refused request (24 bits) and the
/// rule it broke.
pub const STATUS_ERR_FIRST: usize = 1;

/// What the status words say about the step tagged `epoch`: `(refused, first request, rule
/// code)`, or `None` when it refused nothing.
pub fn step_refusals(words: [u64; 2], epoch: u32) -> Option<(u64, u64, u64)> {
    let [count, first] = words;
    let mine = |w: u64| (w >> 32) as u32 == epoch;
    if !mine(count) || count & 0xffff_ffff == 0 {
        return None;
    }
    let first = if mine(first) {
        first & 0xffff_ffff
    } else {
        u32::MAX as u64
    };
    Some((count & 0xffff_ffff, first >> 8, first & 0xff))
}
/// Real requests of the step being run (written by `admit`, read by `emit`).
pub const STATUS_STEP_B: usize = 2;
/// The caller's output addresses for the step (0: not copied).
pub const STATUS_OUT_PROBS: usize = 3;
pub const STATUS_OUT_IDS: usize = 4;
pub const STATUS_OUT_HIDDEN: usize = 5;

/// How a page table's entries name K/V slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TableMode {
    /// `table[r][p / page_size]` is a page of `page_size` consecutive slots (vLLM, FlashInfer).
    PageIds,
    /// `table[r][p]` is the token slot itself (SGLang's `req_to_token`).
    TokenSlots,
}

impl TableMode {
    pub fn word(self) -> i64 {
        match self {
            TableMode::PageIds => 0,
            TableMode::TokenSlots => 1,
        }
    }
}

/// Rules `admit` checks per request; a request that breaks one writes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceRule {
    /// The request index is outside the table's rows.
    Request = 1,
    /// `L < 0` or `L + N > max_context_len`.
    Prefix = 2,
    /// Positions `L .. L+N−1` do not fit the request's table row.
    Row = 3,
    /// `A` outside `[1, N]`.
    Accept = 4,
    /// A new position's token slot is outside the pool (or its page is negative).
    Slot = 5,
    /// An input id is outside `[0, vocab)`.
    Id = 6,
}

impl DeviceRule {
    pub const ALL: [DeviceRule; 6] = [
        DeviceRule::Request,
        DeviceRule::Prefix,
        DeviceRule::Row,
        DeviceRule::Accept,
        DeviceRule::Slot,
        DeviceRule::Id,
    ];

    pub fn from_code(c: u64) -> Option<DeviceRule> {
        DeviceRule::ALL.into_iter().find(|r| *r as u64 == c)
    }

    /// What the rule means, for the error report.
    pub fn describe(self) -> &'static str {
        match self {
            DeviceRule::Request => "req_pool_indices: the request index is outside the page table's rows",
            DeviceRule::Prefix => {
                "prefix_lens: prefix + num_draft_tokens is outside [num_draft_tokens, max_context_len]"
            }
            DeviceRule::Row => {
                "prefix_lens: positions up to prefix + num_draft_tokens - 1 do not fit the request's table row"
            }
            DeviceRule::Accept => "accept_lens: outside [1, num_draft_tokens]",
            DeviceRule::Slot => "page table: a new token's slot (or page) is outside the registered KV pool",
            DeviceRule::Id => "input_ids: an id is outside [0, vocab)",
        }
    }
}

/// The prelude lines declaring the word indices and codes (every template gets them).
pub(crate) fn prelude_lines() -> String {
    let mut s = String::new();
    for (name, v) in [
        ("KV_WORD_MODE", KV_WORD_MODE),
        ("KV_WORD_TABLE_ROWS", KV_WORD_TABLE_ROWS),
        ("KV_WORD_TABLE_COLS", KV_WORD_TABLE_COLS),
        ("KV_WORD_TABLE_STRIDE", KV_WORD_TABLE_STRIDE),
        ("KV_WORD_SLOTS", KV_WORD_SLOTS),
        ("KV_WORD_KV_STRIDE", KV_WORD_KV_STRIDE),
        ("STATUS_ERR_COUNT", STATUS_ERR_COUNT),
        ("STATUS_ERR_FIRST", STATUS_ERR_FIRST),
        ("STATUS_STEP_B", STATUS_STEP_B),
        ("STATUS_OUT_PROBS", STATUS_OUT_PROBS),
        ("STATUS_OUT_IDS", STATUS_OUT_IDS),
        ("STATUS_OUT_HIDDEN", STATUS_OUT_HIDDEN),
    ] {
        s.push_str(&format!("constexpr int {name} = {v};\n"));
    }
    s.push_str(&format!(
        "constexpr long long KV_MODE_TOKENS = {};\n",
        TableMode::TokenSlots.word()
    ));
    for r in DeviceRule::ALL {
        s.push_str(&format!(
            "constexpr int RULE_{} = {};\n",
            format!("{r:?}").to_ascii_uppercase(),
            r as u32
        ));
    }
    s
}

#[cfg(test)]
mod status_tests {
    use super::step_refusals;

    #[test]
    fn words_of_another_step_say_nothing() {
        let tag = |e: u64, v: u64| (e << 32) | v;
        assert_eq!(step_refusals([tag(7, 2), tag(7, (5 << 8) | 3)], 7), Some((2, 5, 3)));
        assert_eq!(step_refusals([tag(6, 2), tag(6, (5 << 8) | 3)], 7), None);
        assert_eq!(step_refusals([0, u64::MAX], 1), None);
    }
}
