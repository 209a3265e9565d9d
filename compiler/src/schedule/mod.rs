//! Stage 5: per bucket, the fused graph → buffers at arena offsets and a launch list.
//!
//! The steps, in order (`schedule_bucket`):
//! 1. `liveness`: every arena tensor (by alias root) and workspace gets a live range over
//!    the op order — inputs for the whole step, outputs until the caller reads them;
//! 2. `pack`: inputs first and contiguous (one host copy moves them), then greedy packing
//!    (largest first, lowest offset clear of every intersecting live range), so tensors
//!    whose ranges do not intersect reuse the same bytes;
//! 3. `bind`: each op's launches from its entries' declarations, arguments bound to those
//!    buffers, to weights and to the KV pool through typed builders, never raw addresses.

mod bind;
mod liveness;
mod pack;

use std::collections::BTreeMap;

use petgraph::stable_graph::NodeIndex;
use specplan_format::{bucket_facts, BucketPlan, KernelFacts, Replay};
use specplan_kernels::abi::Kernel;
use specplan_kernels::entries::attention::AttnPartialParams;

use crate::codegen::KernelTable;
use crate::config::Config;
use crate::graph::{OpGraph, TensorId};

pub use pack::INPUT_ORDER;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("node {node}: a GEMM with a bias reached scheduling (the bias must be folded into a kernel)")]
    UnfoldedBias { node: String },
    #[error("node {node} ({kind}) has no kernel: an unfused op reached scheduling")]
    NoKernel { node: String, kind: &'static str },
    #[error("attention of {rows} rows per CTA (num_draft_tokens · heads/kv_heads) with head_dim {head_dim} does not fit in shared memory even with 16-key tiles")]
    AttentionSmem { rows: u32, head_dim: u32 },
    #[error(
        "capture.buckets (--buckets, --max-bs): bucket {batch} needs {bytes} bytes of activations ({} GiB), above the 64 GiB a plan's arena may hold; use smaller buckets",
        bytes.div_ceil(1 << 30)
    )]
    ArenaTooLarge { batch: u32, bytes: u64 },
}

/// Static facts shared by every bucket's schedule.
pub struct Shared<'a> {
    pub g: &'a OpGraph,
    pub order: &'a [NodeIndex],
    pub cfg: &'a Config,
    /// What the plan's kernels are specialized for (window 0).
    pub facts: &'a KernelFacts,
    /// Weight index in the plan for each weight tensor.
    pub weight_ids: &'a BTreeMap<TensorId, u32>,
    pub sm_count: u32,
    /// Splits may merge in thread block clusters: `Target::attn_cluster` on sm_90+.
    pub clusters: bool,
    /// Split top-K rows merge in their last CTA (`Target::topk_last_cta`).
    pub topk_last_cta: bool,
    /// Attention splits merge in their last CTA where an instance allows
    /// (`Target::attn_last_cta`).
    pub attn_last_cta: bool,
    /// The phase's rows per request (`PhaseKind::rows_per_request`).
    pub rows_per_request: u32,
}

/// KV splits for a bucket: as many CTAs as fit on the GPU at once (one wave: a second,
/// partial wave doubles a short context's time), at most one split per 256 keys of the
/// longest context, at most 16. CTAs per SM follow the attention's shared memory (228 KiB
/// an SM, 1 KiB reserved a CTA on sm_90) and at most 4 (registers).
pub fn attn_splits(cfg: &Config, f: &KernelFacts, batch: u32, (cluster, sm_count): (bool, u32)) -> u32 {
    let ctas = batch as u64 * cfg.model.desc.kv_heads as u64;
    let smem = AttnPartialParams::smem(f) + 1024;
    let per_sm = (228 * 1024 / smem.max(1)).clamp(1, 4);
    // Clusters (`Target::attn_cluster`: the splits of one request and kv head) must each
    // fit in one GPC, so the SMs a GPC cannot fill with whole clusters are lost: a quarter
    // left free keeps every cluster in the first wave.
    let slots = per_sm * sm_count as u64 * if cluster { 3 } else { 4 } / 4;
    let want = (slots / ctas.max(1)).max(1);
    let by_len = (cfg.capture.max_context_len as u64).div_ceil(256);
    want.min(by_len)
        .clamp(1, specplan_kernels::facts::MAX_ATTN_SPLITS as u64) as u32
}

/// Whether a bucket's attention splits merge in a thread block cluster (sm_90+, more than
/// one split; at most 16, as `attn_splits` gives): one launch instead of partials + merge.
pub fn attn_cluster(sh: &Shared, splits: u32) -> bool {
    sh.clusters && splits > 1
}

/// Whether a bucket's attention splits may merge in their last CTA (`Target::attn_last_cta`:
/// more than one split, no cluster, one arrival counter per (request, kv head) within the
/// runtime's words). Each instance then takes it if its rows a CTA allow
/// (`AttnFusedParams::serves`).
pub fn attn_last_cta(sh: &Shared, batch: u32, splits: u32) -> bool {
    let cluster = attn_cluster(sh, splits);
    sh.attn_last_cta && specplan_kernels::facts::attn_last_cta_fits(batch, sh.facts.kv_heads, splits, cluster)
}

pub fn schedule_bucket(
    sh: &Shared,
    kernels: &mut KernelTable,
    batch: u32,
    replay: Replay,
) -> Result<BucketPlan, ScheduleError> {
    let n = sh.rows_per_request;
    let splits = attn_splits(sh.cfg, sh.facts, batch, (sh.clusters, sh.sm_count));
    let live = liveness::live_ranges(sh, batch, splits);
    let (buffers, arena_bytes) = pack::pack(&live.items);
    // The config's lower bound catches most oversized buckets before lowering; the packed
    // arena is the exact size, refused here by the field that sets it rather than by the
    // validator (whose refusal would read as a compiler bug).
    if arena_bytes > crate::config::limits::MAX_REGION_BYTES {
        return Err(ScheduleError::ArenaTooLarge {
            batch,
            bytes: arena_bytes,
        });
    }
    let mut bucket = BucketPlan {
        batch,
        rows: batch * n,
        arena_bytes,
        qo_indptr: (0..=batch).map(|i| i * n).collect(),
        attn_splits: splits,
        attn_cluster: attn_cluster(sh, splits),
        attn_last_cta: attn_last_cta(sh, batch, splits),
        buffers,
        launches: Vec::new(),
        replay,
    };
    bucket.launches = bind::launches(sh, kernels, &bucket_facts(&bucket), &live)?;
    Ok(bucket)
}
