//! io.cu's draft-decode prologue and epilogue: the engine-memory step of a draft-decode phase.
//! As `admit`/`emit` (entries/io.rs), the runtime launches them itself around a decode
//! bucket's launches; one instance serves every step-count tier: S, the parent-list width
//! and the node count are launch arguments, not constants.
//! `admit_decode` copies the caller's draft-extend outputs into the bucket's input buffers
//! and checks every request's lanes on the device (`kv::DeviceRule`, the CPU engine's
//! `admit_decode` order); `emit_decode` copies the admitted requests' trees (and verify
//! inputs) to the caller's tensors, zeros for a refused one.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{parent_width, BucketFacts, KernelFacts};
use crate::io;
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::io::IO_THREADS;

/// `admit_decode`: CTA i < batch fills request i's rows of the phase's input buffers — the
/// caller's values when i < b and the request passes every rule, else a padded request
/// (row −1: no K/V read or written, prefix 0, probabilities, ids, hidden and bonus 0) — and
/// records a failing request in the status words.
#[derive(KernelParams)]
#[repr(C)]
pub struct AdmitDecodeParams {
    /// `[b, K]` f32 draft-extend top-K probabilities.
    #[arg(caller)]
    pub src_probs: DevPtr<f32>,
    /// `[b, K]` their ids, target vocabulary (i64, or i32 with `ADMIT_FLAG_IDS_I32`).
    #[arg(caller)]
    pub src_ids: DevPtr<i64>,
    /// `[b, H]` draft-extend's hidden rows.
    #[arg(caller)]
    pub src_hidden: DevPtr<Act>,
    /// `[b]` request rows of the page table (i32 with flag bit 0).
    #[arg(caller)]
    pub src_req: DevPtr<i64>,
    /// `[b]` prefix lengths (i32 with flag bit 1), plus `prefix_bias`.
    #[arg(caller)]
    pub src_prefix: DevPtr<i64>,
    /// `[b]` the trees' roots (i32 with flag bit 2); null unless the plan emits the verify
    /// inputs.
    #[arg(caller)]
    pub src_bonus: DevPtr<i64>,
    #[arg(input = io::TOPK_PROBS, rw)]
    pub probs: DevPtrMut<f32>,
    #[arg(input = io::TOPK_IDS, rw)]
    pub ids: DevPtrMut<i64>,
    #[arg(input = io::HIDDEN_STATES, rw)]
    pub hidden: DevPtrMut<Act>,
    #[arg(input = io::REQ_SLOTS, rw)]
    pub req_slots: DevPtrMut<i32>,
    #[arg(input = io::PREFIX_LENS, rw)]
    pub prefix_lens: DevPtrMut<i32>,
    /// The bucket's `bonus_tokens` (null without the verify inputs).
    #[arg(input = io::BONUS_TOKENS, rw)]
    pub bonus: DevPtrMut<i64>,
    #[arg(table)]
    pub page_table: DevPtr<i32>,
    #[arg(layout)]
    pub kv_layout: DevPtr<i64>,
    #[arg(status, rw)]
    pub status: DevPtrMut<i64>,
    /// Real requests of the step (≤ batch).
    pub b: u32,
    pub batch: u32,
    /// Bits 0-2: `src_req` / `src_prefix` / `src_bonus` hold i32; `ADMIT_FLAG_LAST`,
    /// `ADMIT_FLAG_IDS_I32` as `admit`'s.
    pub flags: u32,
    /// Added to every prefix length, as an i32.
    pub prefix_bias: u32,
    /// The step-wide index of request 0 (chunks).
    pub base: u32,
    /// The step's tag in the status words.
    pub epoch: u32,
    /// S, the tier's step count (its lanes write forwards 0 .. S−2).
    pub steps: u32,
}

/// `emit_decode`: CTA i < the step's b copies request i's rows of the tree outputs (and the
/// verify inputs, where the plan has them) to the caller's tensors when it was admitted,
/// zeros when it was refused; a null destination is skipped. The last CTA resets the
/// completion counter and copies the step's refusal words to the host-mapped mirror.
#[derive(KernelParams)]
#[repr(C)]
pub struct EmitDecodeParams {
    /// `[batch]` rows as `admit_decode` wrote them (−1: refused or padding).
    #[arg(input = io::REQ_SLOTS, rw)]
    pub req_slots: DevPtrMut<i32>,
    /// The bucket's outputs: `parent_list [batch, pw]`, `top_scores_index` and
    /// `draft_tokens [batch, nodes]`, the five verify rows `[batch, nodes + 1]` (null
    /// without them) and `tree_mask [batch, nodes + 1, nodes + 1]` i32.
    #[arg(buffer)]
    pub parent_list: DevPtr<i64>,
    #[arg(buffer)]
    pub top_scores_index: DevPtr<i64>,
    #[arg(buffer)]
    pub draft_tokens: DevPtr<i64>,
    #[arg(buffer)]
    pub verify_tokens: DevPtr<i64>,
    #[arg(buffer)]
    pub verify_positions: DevPtr<i64>,
    #[arg(buffer)]
    pub retrieve_index: DevPtr<i64>,
    #[arg(buffer)]
    pub retrieve_next_token: DevPtr<i64>,
    #[arg(buffer)]
    pub retrieve_next_sibling: DevPtr<i64>,
    #[arg(buffer)]
    pub tree_mask: DevPtr<i32>,
    /// Where the step's rows go, in the same order (null: not copied).
    #[arg(caller, rw)]
    pub out_parent_list: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_top_scores_index: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_draft_tokens: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_verify_tokens: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_verify_positions: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_retrieve_index: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_retrieve_next_token: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_retrieve_next_sibling: DevPtrMut<i64>,
    #[arg(caller, rw)]
    pub out_tree_mask: DevPtrMut<i32>,
    #[arg(status, rw)]
    pub status: DevPtrMut<i64>,
    pub batch: u32,
    /// `parent_list`'s width, (S−1)·K + 1.
    pub pw: u32,
    /// The tier's drafted nodes, N − 1.
    pub nodes: u32,
}

/// Lane writes of one request in a tier of `steps` forwards: K·(S−1).
pub fn lane_writes(topk: u32, steps: u32) -> u32 {
    topk * steps.saturating_sub(1)
}

/// `admit_decode`'s write-set slots for a bucket of `batch` requests: a power of two at
/// least twice the lane writes.
pub fn admit_decode_hash_slots(batch: u32, topk: u32, steps: u32) -> u32 {
    (2 * batch.max(1) * lane_writes(topk, steps).max(1))
        .next_power_of_two()
        .max(32)
}

/// `admit_decode`'s dynamic shared memory: the write set, then one rule byte per request.
pub fn admit_decode_smem_bytes(batch: u32, topk: u32, steps: u32) -> u32 {
    8 * admit_decode_hash_slots(batch, topk, steps) + batch.div_ceil(8) * 8
}

impl Kernel for AdmitDecodeParams {
    const ENTRY: Entry = Entry::AdmitDecode;
    fn threads(_: &KernelFacts) -> u32 {
        IO_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], AdmitDecodeScalars) {
        (
            [b.batch, 1, 1],
            AdmitDecodeScalars {
                b: b.batch,
                batch: b.batch,
                flags: 0,
                prefix_bias: 0,
                base: 0,
                epoch: 0,
                steps: f.lanes,
            },
        )
    }
    fn extents(s: &AdmitDecodeScalars, f: &KernelFacts) -> AdmitDecodePtrs<Extent> {
        let (b, bb, k, h) = (s.b as u64, s.batch as u64, f.topk as u64, f.hidden as u64);
        let e = Extent::Elems;
        AdmitDecodePtrs {
            src_probs: e(b * k),
            src_ids: e(b * k),
            src_hidden: e(b * h),
            src_req: e(b),
            src_prefix: e(b),
            src_bonus: e(b),
            probs: e(bb * k),
            ids: e(bb * k),
            hidden: e(bb * h),
            req_slots: e(bb),
            prefix_lens: e(bb),
            bonus: e(bb),
            page_table: e(0),
            kv_layout: e(crate::kv::KV_WORDS as u64),
            status: e(crate::kv::STATUS_WORDS as u64),
        }
    }
}

impl Kernel for EmitDecodeParams {
    const ENTRY: Entry = Entry::EmitDecode;
    fn threads(_: &KernelFacts) -> u32 {
        IO_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], EmitDecodeScalars) {
        let steps = f.lanes;
        (
            [b.batch, 1, 1],
            EmitDecodeScalars {
                batch: b.batch,
                pw: parent_width(f.topk, steps) as u32,
                nodes: f.draft_tokens.saturating_sub(1),
            },
        )
    }
    fn extents(s: &EmitDecodeScalars, _: &KernelFacts) -> EmitDecodePtrs<Extent> {
        let (bb, pw, nodes) = (s.batch as u64, s.pw as u64, s.nodes as u64);
        let n = nodes + 1;
        let e = Extent::Elems;
        EmitDecodePtrs {
            req_slots: e(bb),
            parent_list: e(bb * pw),
            top_scores_index: e(bb * nodes),
            draft_tokens: e(bb * nodes),
            verify_tokens: e(bb * n),
            verify_positions: e(bb * n),
            retrieve_index: e(bb * n),
            retrieve_next_token: e(bb * n),
            retrieve_next_sibling: e(bb * n),
            tree_mask: e(bb * n * n),
            out_parent_list: e(bb * pw),
            out_top_scores_index: e(bb * nodes),
            out_draft_tokens: e(bb * nodes),
            out_verify_tokens: e(bb * n),
            out_verify_positions: e(bb * n),
            out_retrieve_index: e(bb * n),
            out_retrieve_next_token: e(bb * n),
            out_retrieve_next_sibling: e(bb * n),
            out_tree_mask: e(bb * n * n),
            status: e(crate::kv::STATUS_WORDS as u64),
        }
    }
}
