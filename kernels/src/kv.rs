//! The K/V cache and page-table geometry a runtime registers at load, as the kernels that
//! walk the cache read it: eight i64 words in device memory (written once, read once per
//! CTA), and the step status words the engine-memory prologue and epilogue share. The word
//! indices are declared here and emitted into every prelude (`KV_WORD_*`, `STATUS_*`).
//!
//! A token slot holds `kv_heads` rows of `head_dim` activations: position p of a request
//! is at slot `table[req][p]` (token-slot tables, SGLang's `req_to_token`) or
//! `table[req][p / PAGE_SIZE] · PAGE_SIZE + p % PAGE_SIZE` (page-id tables, vLLM's and
//! FlashInfer's block tables). Where a slot's bytes are is the pool's geometry
//! ([`KvGeometry`]): element d of kv head g of slot t is at
//! `(t / PHYS_PAGE) · PAGE_STRIDE + (t % PHYS_PAGE) · KV_STRIDE + g · HEAD_STRIDE + d` from
//! the layer's K (or V) address — which covers every engine layout in place: SGLang's NHD
//! `[slots, H, D]` and HND `[pages, H, P, D]` pools, and vLLM's `[blocks, block, H, 2·D]`
//! (or HND) tensors with V at K + D. A request index outside `[0, TABLE_ROWS)`, a position
//! outside its row, a negative page or a slot outside `[0, KV_SLOTS)` names no slot: reads
//! are zero, writes are skipped.

/// Words of the layout (i64 each).
pub const KV_WORDS: usize = 12;
pub const KV_WORD_MODE: usize = 0;
pub const KV_WORD_TABLE_ROWS: usize = 1;
pub const KV_WORD_TABLE_COLS: usize = 2;
pub const KV_WORD_TABLE_STRIDE: usize = 3;
pub const KV_WORD_SLOTS: usize = 4;
/// Elements between consecutive slots of a physical page.
pub const KV_WORD_KV_STRIDE: usize = 5;
/// Slots of one physical page of the pool's memory (1: slots are `KV_STRIDE` apart
/// throughout).
pub const KV_WORD_PHYS_PAGE: usize = 6;
/// Elements between consecutive physical pages.
pub const KV_WORD_PAGE_STRIDE: usize = 7;
/// Elements between consecutive kv heads of a slot.
pub const KV_WORD_HEAD_STRIDE: usize = 8;

/// Where a pool's slots, heads and elements are, in elements of the activation type from a
/// layer's K (or V) address. Every stride is a multiple of 8 elements (16-byte rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Token slots (valid slot indices are `[0, slots)`).
    pub slots: u64,
    /// Slots per physical page (1: `slot_stride` apart throughout).
    pub page: u64,
    pub page_stride: u64,
    pub slot_stride: u64,
    pub head_stride: u64,
}

impl KvGeometry {
    /// Slots `stride` elements apart, each `[kv_heads, head_dim]` contiguous (NHD).
    pub fn dense(slots: u64, stride: u64, head_dim: u64) -> KvGeometry {
        KvGeometry {
            slots,
            page: 1,
            page_stride: stride,
            slot_stride: stride,
            head_stride: head_dim,
        }
    }

    /// The same geometry with a physical page folded away when pages are `page` slots of
    /// `slot_stride` back to back (the kernels then skip a division).
    pub fn canonical(self) -> KvGeometry {
        if self.page > 1 && self.page_stride == self.page.saturating_mul(self.slot_stride) {
            KvGeometry {
                page: 1,
                page_stride: self.slot_stride,
                ..self
            }
        } else {
            self
        }
    }

    /// Element offset of element `d` of head `g` of slot `t` (`None` on overflow).
    pub fn offset(&self, t: u64, g: u64, d: u64) -> Option<u64> {
        let page = self.page.max(1);
        (t / page)
            .checked_mul(self.page_stride)?
            .checked_add((t % page).checked_mul(self.slot_stride)?)?
            .checked_add(g.checked_mul(self.head_stride)?)?
            .checked_add(d)
    }
}

/// Words of the step status (i64 each), in runtime memory.
pub const STATUS_WORDS: usize = 12;
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
pub const STATUS_OUT_LOGITS: usize = 6;
/// Device address of the host-mapped refusal ring (0: none), written once at load: at the
/// end of every step `emit` writes the step's two refusal words into ring slot
/// `epoch % MIRROR_SLOTS` and then, after a system-wide fence, the step's epoch as the
/// slot's tag — so the host reads any finished step's refusals there, in order, with no
/// copy and no wait (`GpuRuntime::poll_error`).
pub const STATUS_MIRROR: usize = 7;
/// The epoch `emit` tags the mirror with: the step's, written by `admit` on the step's last
/// chunk, 0 on earlier chunks (which leave the mirror alone).
pub const STATUS_EPOCH: usize = 8;
/// Slots of the mirror ring (three words each: tag, refusal count word, first-refusal word).
pub const MIRROR_SLOTS: usize = 16;
/// `admit`'s flag bit: this launch is the step's last chunk.
pub const ADMIT_FLAG_LAST: u32 = 8;
/// `admit`'s flag bit: the ids are int32 (vLLM's, older SGLang's), else int64.
pub const ADMIT_FLAG_IDS_I32: u32 = 16;
/// `admit`'s flag bit: the accept tensor holds each request's selected row `r·N + A − 1`
/// in the whole batch (SGLang's `select_index`, vLLM's `last_token_indices`), else `A`.
pub const ADMIT_FLAG_SELECT: u32 = 32;

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
        ("KV_WORD_PHYS_PAGE", KV_WORD_PHYS_PAGE),
        ("KV_WORD_PAGE_STRIDE", KV_WORD_PAGE_STRIDE),
        ("KV_WORD_HEAD_STRIDE", KV_WORD_HEAD_STRIDE),
        ("STATUS_ERR_COUNT", STATUS_ERR_COUNT),
        ("STATUS_ERR_FIRST", STATUS_ERR_FIRST),
        ("STATUS_STEP_B", STATUS_STEP_B),
        ("STATUS_OUT_PROBS", STATUS_OUT_PROBS),
        ("STATUS_OUT_IDS", STATUS_OUT_IDS),
        ("STATUS_OUT_HIDDEN", STATUS_OUT_HIDDEN),
        ("STATUS_OUT_LOGITS", STATUS_OUT_LOGITS),
        ("STATUS_MIRROR", STATUS_MIRROR),
        ("STATUS_EPOCH", STATUS_EPOCH),
        ("MIRROR_SLOTS", MIRROR_SLOTS),
    ] {
        s.push_str(&format!("constexpr int {name} = {v};\n"));
    }
    for (name, v) in [
        ("ADMIT_FLAG_LAST", ADMIT_FLAG_LAST),
        ("ADMIT_FLAG_IDS_I32", ADMIT_FLAG_IDS_I32),
        ("ADMIT_FLAG_SELECT", ADMIT_FLAG_SELECT),
    ] {
        s.push_str(&format!("constexpr unsigned {name} = {v}u;\n"));
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
