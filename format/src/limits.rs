//! The bounds every plan obeys and the speculative rule, defined once: the validator checks
//! plans against them and the compiler's config reader checks configs against the same
//! items (it re-exports this module), so a config within them never compiles to a plan the
//! validator refuses for its sizes.

use crate::types::SpecDesc;

pub const MAX_HIDDEN: u32 = 1 << 16;
pub const MAX_INTERMEDIATE: u32 = 1 << 18;
pub const MAX_HEADS: u32 = 256;
/// The attention kernel's tensor-core steps: a multiple of 16, at most 256.
pub const MAX_HEAD_DIM: u32 = 256;
pub const MAX_LAYERS: u32 = 256;
/// Column indices travel as exact f32 values between the split top-K kernels.
pub const MAX_VOCAB: u32 = (1 << 24) - 1;
/// Rows per request of the attention kernel (draft-extend: num_draft_tokens).
pub const MAX_DRAFT_TOKENS: u32 = 64;
pub const MAX_STEPS: u32 = 64;
pub const MAX_CONTEXT: u32 = 1 << 22;
pub const MAX_PAGE_SIZE: u32 = 1024;
pub const MAX_REQUESTS: u32 = 1 << 20;
/// Largest batch bucket (and `max_bs`).
pub const MAX_BATCH: u32 = 4096;
/// Page ids are `i32` in the page table.
pub const MAX_POOL_PAGES: u32 = i32::MAX as u32;
/// Largest weight region, KV pool and activation arena: 64 GiB, more than any GPU's memory.
pub const MAX_REGION_BYTES: u64 = 64 << 30;
/// List lengths, far above what the compiler emits (256 layers of ~15 launches each),
/// so that validation's work is bounded too (its overlap rule is quadratic in a
/// bucket's buffers). `MAX_BUCKETS` bounds each phase's buckets.
pub const MAX_BUCKETS: usize = 256;
pub const MAX_PHASES: usize = 16;
/// Entries of a draft-decode tree's score list per request (`K + (S−1)·K²`): the tree
/// kernels rank them in one CTA.
pub const MAX_TREE_CANDIDATES: u32 = 4096;
pub const MAX_KERNELS: usize = 1024;
pub const MAX_WEIGHTS: usize = 4096;
pub const MAX_FUSIONS: usize = 4096;
/// Buffers, and launches, of one bucket.
pub const MAX_BUCKET_ITEMS: usize = 4096;
/// Buffers and launches of all buckets together.
pub const MAX_PLAN_ITEMS: usize = 1 << 18;
/// Rows of one replay the device admission checks (its write set lives in shared memory).
pub use specplan_kernels::entries::io::ADMIT_MAX_ROWS;
pub use specplan_kernels::facts::{MAX_TABLE_ENTRIES, MAX_TOPK};
/// Largest tensor-parallel degree: a power of two up to one NVLink domain's 8 GPUs (every
/// rank's top-K records meet in one 32-lane merge warp).
pub const MAX_TP_SIZE: u32 = 8;
/// Alignment of every weight in the weight region and every buffer in the arena.
pub const ALIGN: u64 = 256;

/// Which speculative parameter a [`SpecRule`] violation is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecField {
    Topk,
    NumSteps,
    NumDraftTokens,
}

/// A broken speculative rule: the parameter, what is wrong, and the value that would fix it
/// where one exists (the config reader turns it into a flag suggestion).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecRule {
    pub field: SpecField,
    pub message: String,
    pub fix: Option<u32>,
}

/// SGLang's rules for the speculative parameters, and the kernels' bounds on them: topk in
/// [1, MAX_TOPK], num_steps in [1, MAX_STEPS]; with topk = 1 the chain has
/// num_draft_tokens = num_steps + 1 (SGLang 0.5.23 adjusts it to that,
/// `srt/arg_groups/speculative_hook.py:1255-1266`; a plan is explicit, so any other value is
/// refused with the fix); with topk > 1 the verify tree keeps num_draft_tokens − 1 of the
/// topk + (num_steps − 1)·topk² candidates the draft tree holds; num_draft_tokens within the
/// attention kernel's rows per request.
pub fn spec_rule(s: &SpecDesc) -> Option<SpecRule> {
    let (k, st, n) = (s.topk, s.num_steps, s.num_draft_tokens);
    let rule = |field, message: String, fix| Some(SpecRule { field, message, fix });
    if k == 0 {
        return rule(SpecField::Topk, "must be at least 1".into(), None);
    }
    if k > MAX_TOPK {
        return rule(
            SpecField::Topk,
            format!("{k} exceeds the {MAX_TOPK} candidates the sampling kernel keeps per request"),
            None,
        );
    }
    if st == 0 {
        return rule(SpecField::NumSteps, "must be at least 1".into(), None);
    }
    if st > MAX_STEPS {
        return rule(
            SpecField::NumSteps,
            format!("{st} exceeds {MAX_STEPS} draft steps"),
            None,
        );
    }
    if n == 0 {
        return rule(SpecField::NumDraftTokens, "must be at least 1".into(), None);
    }
    if k == 1 && n != st + 1 {
        return rule(
            SpecField::NumDraftTokens,
            format!("{n} is invalid with topk = 1: it must equal num_steps + 1 = {}", st + 1),
            Some(st + 1),
        );
    }
    if k > 1 {
        let (k64, st64) = (k as u64, st as u64);
        let max = 1 + k64 + (st64 - 1) * k64 * k64;
        if n < 2 || n as u64 > max {
            return rule(
                SpecField::NumDraftTokens,
                format!(
                    "{n} is invalid with topk = {k}, num_steps = {st}: it must be in [2, 1 + topk + (num_steps - 1)·topk² = {max}]"
                ),
                Some(if n < 2 { 2 } else { max.min(u32::MAX as u64) as u32 }),
            );
        }
    }
    if n > MAX_DRAFT_TOKENS {
        return rule(
            SpecField::NumDraftTokens,
            format!("{n} exceeds the {MAX_DRAFT_TOKENS} rows per request the attention kernel supports"),
            None,
        );
    }
    None
}

/// Why a draft-decode tier cannot be compiled: `None` when it can. Tiers hold at least two
/// steps (SGLang 0.5.23 runs no draft-decode forward at one step and has no slot there,
/// `srt/speculative/eagle_worker_v2.py:496-509`), at most `MAX_STEPS`; a tier other than the
/// configured `num_steps` needs topk = 1 (its N is steps + 1, as SGLang's adaptive tiers);
/// the tree's candidates within `MAX_TREE_CANDIDATES` and at least its N − 1 nodes.
pub fn decode_tier_rule(s: &SpecDesc, steps: u32) -> Option<String> {
    let kind = crate::types::PhaseKind::DraftDecode { steps };
    if !(2..=MAX_STEPS).contains(&steps) {
        return Some(format!(
            "{steps} steps is outside [2, {MAX_STEPS}] (at one step SGLang runs no draft-decode forward)"
        ));
    }
    if steps != s.num_steps && s.topk != 1 {
        return Some(format!(
            "a tier of {steps} steps beside num_steps = {} needs topk = 1 (SGLang's adaptive tiers are chains), topk is {}",
            s.num_steps, s.topk
        ));
    }
    let (k, n) = (s.topk as u64, kind.draft_tokens(s) as u64);
    let cands = specplan_kernels::facts::tree_candidates(s.topk, steps);
    if cands > MAX_TREE_CANDIDATES as u64 {
        return Some(format!(
            "the tree of topk {k} over {steps} steps has {cands} candidates, above {MAX_TREE_CANDIDATES}"
        ));
    }
    if n < 2 || n - 1 > cands || n > MAX_DRAFT_TOKENS as u64 {
        return Some(format!(
            "num_draft_tokens {n} must keep 1 to {cands} of the tree's candidates (at most {MAX_DRAFT_TOKENS} tokens)"
        ));
    }
    None
}
