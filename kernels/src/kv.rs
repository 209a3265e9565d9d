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
    /// `slot_stride` back to back (the kernels then skip a division). With one slot per
    /// page, slots are `page_stride` apart (as [`KvGeometry::offset`] places them): the
    /// kernels, which step `slot_stride` when `page` is 1, get that stride (an HND pool at
    /// page size 1, `[pages, H, 1, D]`, has a slot stride of D but pages H·D apart).
    pub fn canonical(self) -> KvGeometry {
        if self.page <= 1 {
            return KvGeometry {
                page: 1,
                slot_stride: self.page_stride,
                ..self
            };
        }
        if self.page_stride == self.page.saturating_mul(self.slot_stride)
            && self.page_stride == self.page.saturating_mul(self.slot_stride)
        {
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

    /// One past the largest element offset of `heads` heads of `dim` over every slot: the
    /// layer's extent. The last slot's offset is not always the largest: where `slots` is
    /// not a whole number of pages and a slot lies further from its page's start than the
    /// next page does (`slot_stride > page_stride`), the previous page's last slot is.
    /// `None` when it overflows 64 bits or there is no slot.
    pub fn span(&self, heads: u64, dim: u64) -> Option<u64> {
        let page = self.page.max(1);
        let last = self.slots.checked_sub(1)?;
        // The last slot, and the last slot of the page before the last one (if any).
        let prev = (last / page).checked_sub(1).map(|p| p * page + page - 1);
        let (g, d) = (heads.checked_sub(1)?, dim.checked_sub(1)?);
        let a = self.offset(last, g, d)?;
        let b = match prev {
            Some(t) => self.offset(t, g, d)?,
            None => 0,
        };
        a.max(b).checked_add(1)
    }
}

/// Arrival counters (u32 each), in runtime memory after the status words: zero at load, and
/// every launch that counts on them leaves them zero (a self-resetting count: the CTA whose
/// `atomicInc` wraps a word back to 0 is the last of its group, and no other CTA of the launch
/// touches that word after it). A kernel whose CTAs finish a shared result in the last CTA to
/// arrive (`topk_fused`: the row's chunks; `attn_fused`: a (request, kv head)'s splits) counts
/// one word per group, so a launch covers at
/// most this many groups; launches of one runtime never overlap (one stream), so every
/// instance uses the words from 0.
pub const COUNTER_WORDS: usize = 4096;

/// Words of the step status (i64 each), in runtime memory.
pub const STATUS_WORDS: usize = 16;
/// `epoch << 32 | n`: the step tagged `epoch` refused `n` requests (`admit`). A word tagged
/// with another step says nothing about this one.
pub const STATUS_ERR_COUNT: usize = 0;
/// `epoch << 32 | request << 8 | rule`: the step's lowest refused request (24 bits) and the
/// rule it broke.
pub const STATUS_ERR_FIRST: usize = 1;

/// `epoch << 32 | reader << 16 | writer` (16 bits each, clamped): of the step's requests
/// refused by [`DeviceRule::Alias`], the lowest reader and the lowest request writing a
/// slot it reads (the reader itself when it writes one slot twice).
pub const STATUS_ERR_OTHER: usize = 12;

/// One step's refusals as the status words say them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRefusals {
    /// Requests refused (admission) or flagged (non-finite outputs).
    pub count: u64,
    /// The lowest such request, in the whole step.
    pub request: u64,
    /// The rule code it broke.
    pub rule: u64,
    /// For an alias refusal: the request writing what it reads.
    pub other: Option<u64>,
}

/// What the status words `[STATUS_ERR_COUNT, STATUS_ERR_FIRST, STATUS_ERR_OTHER]` say
/// about the step tagged `epoch` (`None`: nothing refused).
pub fn step_refusals(words: [u64; 3], epoch: u32) -> Option<StepRefusals> {
    let [count, first, other] = words;
    let mine = |w: u64| (w >> 32) as u32 == epoch;
    if !mine(count) || count & 0xffff_ffff == 0 {
        return None;
    }
    let first = if mine(first) {
        first & 0xffff_ffff
    } else {
        u32::MAX as u64
    };
    let (request, rule) = (first >> 8, first & 0xff);
    let other = (rule == DeviceRule::Alias as u64 && mine(other) && (other >> 16) & 0xffff == request.min(0xffff))
        .then_some(other & 0xffff);
    Some(StepRefusals {
        count: count & 0xffff_ffff,
        request,
        rule,
        other,
    })
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
/// `emit`'s CTAs done so far (the last one finishes the step's words and resets it to 0).
pub const STATUS_EMIT_DONE: usize = 9;
/// The step's tag on every chunk (`admit` writes it; `emit` folds its flags under it).
pub const STATUS_STEP_EPOCH: usize = 10;
/// The step-wide index of the chunk's request 0 (`admit` writes it for `emit`).
pub const STATUS_BASE: usize = 11;
/// Slots of the mirror ring.
pub const MIRROR_SLOTS: usize = 16;
/// Words of a mirror slot: tag, then the words of `STATUS_ERR_COUNT`, `STATUS_ERR_FIRST`
/// and `STATUS_ERR_OTHER`.
pub const MIRROR_WORDS: usize = 4;
/// The bit `emit` sets in a request's `req_slots` entry when one of its outputs is not
/// finite (an entry of an admitted request is a table row, below it).
pub const NON_FINITE_MARK: u32 = 1 << 30;
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
    /// A new position's token slot is outside the pool (or its page is negative); or, found
    /// in the aliasing walk after rules 1–6 (the request then still counts among the
    /// writers), one of a prefix position some layer reads (from `max(0, L − W + 1)` on, W
    /// the layers' read window, `format::read_window`; all of the prefix without one): the
    /// attention would read its key as zeros. Reported ahead of `Alias`.
    Slot = 5,
    /// An input id is outside `[0, vocab)`.
    Id = 6,
    /// The request reads a cache slot (of any position) that another request of the same
    /// replay writes, or writes one slot at two of its positions, or reads a slot it
    /// writes at another position: the writes and reads would race. Checked after rules
    /// 1–6, against the writes of the replay's requests that pass them.
    Alias = 7,
    /// One of the request's outputs (hidden state, top-K probabilities, logits) is not
    /// finite. Checked by `emit` after the forward: the request's K/V were written and its
    /// outputs are left as computed.
    NonFinite = 8,
}

impl DeviceRule {
    pub const ALL: [DeviceRule; 8] = [
        DeviceRule::Request,
        DeviceRule::Prefix,
        DeviceRule::Row,
        DeviceRule::Accept,
        DeviceRule::Slot,
        DeviceRule::Id,
        DeviceRule::Alias,
        DeviceRule::NonFinite,
    ];

    /// Whether a request the rule names wrote nothing (every rule but `NonFinite`).
    pub fn wrote_nothing(self) -> bool {
        self != DeviceRule::NonFinite
    }

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
            DeviceRule::Slot => {
                "page table: a slot (or page) of a new token, or of a prefix token the attention reads, is outside the registered KV pool"
            }
            DeviceRule::Id => "input_ids: an id is outside [0, vocab)",
            DeviceRule::Alias => {
                "page table: the request reads a cache slot that a request of the same replay writes (or writes one slot twice)"
            }
            DeviceRule::NonFinite => {
                "outputs: a non-finite value in the request's outputs (its inputs, K/V or the weights are out of the activation type's range); its K/V were written"
            }
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
        ("STATUS_EMIT_DONE", STATUS_EMIT_DONE),
        ("STATUS_STEP_EPOCH", STATUS_STEP_EPOCH),
        ("STATUS_BASE", STATUS_BASE),
        ("STATUS_ERR_OTHER", STATUS_ERR_OTHER),
        ("MIRROR_SLOTS", MIRROR_SLOTS),
        ("MIRROR_WORDS", MIRROR_WORDS),
    ] {
        s.push_str(&format!("constexpr int {name} = {v};\n"));
    }
    for (name, v) in [
        ("ADMIT_FLAG_LAST", ADMIT_FLAG_LAST),
        ("ADMIT_FLAG_IDS_I32", ADMIT_FLAG_IDS_I32),
        ("ADMIT_FLAG_SELECT", ADMIT_FLAG_SELECT),
        ("NON_FINITE_MARK", NON_FINITE_MARK),
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
        let r = |count, request, rule, other| {
            Some(super::StepRefusals {
                count,
                request,
                rule,
                other,
            })
        };
        assert_eq!(step_refusals([tag(7, 2), tag(7, (5 << 8) | 3), 0], 7), r(2, 5, 3, None));
        assert_eq!(step_refusals([tag(6, 2), tag(6, (5 << 8) | 3), 0], 7), None);
        assert_eq!(step_refusals([0, u64::MAX, 0], 1), None);
        // An alias refusal names its writer when the other word is this step's and names
        // the same reader.
        let alias = (5 << 8) | 7;
        assert_eq!(
            step_refusals([tag(7, 1), tag(7, alias), tag(7, (5 << 16) | 2)], 7),
            r(1, 5, 7, Some(2))
        );
        assert_eq!(
            step_refusals([tag(7, 1), tag(7, alias), tag(6, (5 << 16) | 2)], 7),
            r(1, 5, 7, None)
        );
        assert_eq!(
            step_refusals([tag(7, 1), tag(7, alias), tag(7, (4 << 16) | 2)], 7),
            r(1, 5, 7, None)
        );
    }
}
