//! The plan facts kernels are specialized by and launched with.
//!
//! [`KernelFacts`] are bucket independent (model, speculative and capture facts, plus the
//! window of the layer an attention instance serves); [`BucketFacts`] are one bucket's.
//! The compiler builds both from its config and the validator from the plan, through the
//! same constructor in the format crate, so the two always agree on what a kernel is.

use crate::DType;

/// Hopper's opt-in shared memory per block.
pub const MAX_SMEM_BYTES: u32 = 227 * 1024;
/// Largest top-K the sampling kernel's shared memory is sized for.
pub const MAX_TOPK: u32 = 32;
/// Candidates past TOPK that the refinement recomputes (`KernelFacts::topk_cands`). The
/// lists are chosen on lm_head's bf16-input logits, whose error (~3e-3 of a logit at the
/// 8B heads) can swap the K-th and (K+1)-th columns; refining the next two as well lets the
/// fp32 values decide the K-th place (docs/perf-notes.md item 30).
pub const TOPK_REFINE_EXTRA: u32 = 2;
/// Largest number of column chunks a row of the top-K is split into (`topk_merge` has one
/// lane per chunk).
pub const MAX_TOPK_CHUNKS: u32 = 32;
/// Rows of at most this many columns are one CTA's (`softmax_topk`, no merge).
pub const TOPK_SINGLE_COLS: u32 = 8192;
/// Columns per chunk the plan aims at when splitting a longer logits row across CTAs
/// (docs/perf-notes.md items 6 and 18: a small batch's chunk is bound by its scan's latency and
/// its 512 lists' merge, not by memory).
pub const TOPK_CHUNK_COLS: u32 = 2048;
/// Most columns one `topk_partial` CTA scans when the batch alone fills the GPU (64 a
/// thread: two batches of loads in flight; docs/perf-notes.md item 27).
pub const TOPK_WIDEST_CHUNK: u32 = 32768;
/// `topk_partial` CTAs of one wave on an H200: two 512-thread CTAs per SM (the kernel keeps
/// to 64 registers a thread), 132 SMs.
pub const TOPK_WAVE: u32 = 264;
/// Largest number of KV splits of the attention.
pub const MAX_ATTN_SPLITS: u32 = 16;
/// Most packed rows a CTA (N·G) of an attention instance whose splits the last CTA merges
/// (`BucketFacts::attn_last_cta`): that CTA reads every split's partials of its rows, so a
/// wider instance keeps the `attn_merge` launch (docs/perf-notes.md items 39 and 52).
pub const ATTN_LAST_CTA_ROWS: u32 = 16;
/// Largest page table (entries): the kernels index it in 32 bits, and every executor
/// holds one.
pub const MAX_TABLE_ENTRIES: u64 = 1 << 26;

/// Everything a kernel instance is specialized for.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelFacts {
    /// Activation type (`act_t`).
    pub act: DType,
    /// The residual stream's type (`stream_t`): f32 in an unsharded draft-extend phase (the
    /// stream is rounded once, into `hidden_out`), else `act`.
    pub stream: DType,
    pub hidden: u32,
    /// Width of a row of the head's input hidden states: `hidden` for EAGLE-1/2, three
    /// target layers' (`3 · H_t`) for EAGLE-3.
    pub hidden_in: u32,
    pub intermediate: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Rows of the embedding table (the target vocabulary).
    pub vocab: u32,
    /// Columns of a logits row: the vocabulary, or the FR-Spec hot rows.
    pub cols: u32,
    /// N: rows per request of the phase the kernel serves (draft-extend: num_draft_tokens).
    pub n: u32,
    pub topk: u32,
    /// Tokens per page of a page-id table (the plan's page size).
    pub page_size: u32,
    /// Largest `prefix + N` of a request (`max_context_len`).
    pub max_context: u32,
    pub eps: f32,
    /// RoPE inverse frequencies, `[head_dim / 2]`.
    pub inv_freq: Vec<f32>,
    /// What the rotated q and k are multiplied by (YaRN's and LongRoPE's attention factor;
    /// else 1).
    pub rope_scale: f32,
    /// The sliding window of the layer an attention instance serves (0 = none).
    pub window: u32,
    /// An attention instance over the selected query rows (`select_from` = N of the
    /// N-row q it reads; `n` is then 1): request i's one query row is q row
    /// `i·N + A_i − 1` at position `L + A_i − 1` (A_i its accept length, clamped to
    /// [1, N]), the only row whose output the draft-extend head's last layer keeps. 0: every
    /// row of the phase.
    pub select_from: u32,
    /// Draft decode: S, the phase's step count. Its rows are lanes (K per request, `n` =
    /// topk), every row of forward `step` sits at position `L + step`, writes its K/V at
    /// the lane's slot `L + lane_offset(L, lane) + step` and attends the prefix plus its own
    /// lane's slots (kernels/cuda/common.cuh, `lane_offset`). 0: draft-extend's causal rows.
    pub lanes: u32,
    /// The forward (0-based) of a multi-step phase an instance serves (0 otherwise).
    pub step: u32,
    /// Draft decode: N, the tree's tokens (its outputs keep the N − 1 drafted nodes).
    pub draft_tokens: u32,
    /// The fc bias exists (folded into `embed_concat`).
    pub has_bias: bool,
    /// EAGLE-3: lm_head reads the final norm of the selected rows (`norm.weight`).
    pub head_norm: bool,
    /// Top-K ids go through the FR-Spec hot map.
    pub hot_map: bool,
    /// Top-K ids go through EAGLE-3's d2t: draft id d → target id d + d2t[d].
    pub id_offset: bool,
    /// The plan emits the fused top-K (`topk_probs`, `topk_ids`).
    pub out_topk: bool,
    /// The plan emits the selected rows' logits (`logits`, `[B, cols]` f32).
    pub out_logits: bool,
    /// Tensor-parallel ranks T of the plan (1: unsharded) and the plan's rank: `heads`,
    /// `kv_heads`, `intermediate` and `cols` are the rank's share, its logits columns start
    /// at `tp_rank · cols` of the full row.
    pub tp_size: u32,
    pub tp_rank: u32,
    /// Rows of the embedding table the plan holds (`vocab`, or a rank's 1/T under a
    /// vocabulary-parallel embedding) and the first one's id.
    pub embed_rows: u32,
    pub embed_start: u32,
    /// A vocabulary-parallel embedding on a rank other than 0: `embed_concat` writes zeros
    /// in the hidden half (rank 0 carries it through the fc input's all-reduce).
    pub zero_hidden: bool,
}

impl KernelFacts {
    /// The same facts for an attention instance of a layer with window `w`.
    pub fn with_window(&self, w: Option<u32>) -> KernelFacts {
        KernelFacts {
            window: w.unwrap_or(0),
            ..self.clone()
        }
    }

    /// The same facts for forward `step` of a multi-step phase.
    pub fn at_step(&self, step: u32) -> KernelFacts {
        KernelFacts { step, ..self.clone() }
    }

    /// The same facts for an instance over one row per request: the selected rows the
    /// draft-extend head's last layer computes past its K/V append (`n` = 1).
    pub fn selected_rows(&self) -> KernelFacts {
        KernelFacts { n: 1, ..self.clone() }
    }

    /// The same facts for an attention instance over the selected query row of each
    /// request (`select_from`): one row per request, chosen from the phase's `n`.
    pub fn selected_query(&self) -> KernelFacts {
        KernelFacts {
            n: 1,
            select_from: self.n,
            ..self.clone()
        }
    }

    /// Rows per request of the q an attention instance reads (`select_from`, else `n`).
    pub fn q_rows(&self) -> u32 {
        if self.select_from > 0 {
            self.select_from
        } else {
            self.n
        }
    }

    /// The top-K candidates' logits are recomputed from the fp32 stream's selected rows
    /// (the fp32 stream: an unsharded draft-extend phase): lm_head reads their rounding,
    /// which alone moves a probability by up to ~5e-3·p.
    pub fn refines_topk(&self) -> bool {
        self.stream == DType::F32
    }

    /// Candidates each top-K list keeps (sample.cu's CANDS): TOPK, and with the refinement
    /// [`TOPK_REFINE_EXTRA`] more (at most [`MAX_TOPK`]), of which the refined best TOPK are
    /// emitted.
    pub fn topk_cands(&self) -> u32 {
        if self.refines_topk() {
            (self.topk + TOPK_REFINE_EXTRA).min(MAX_TOPK).max(self.topk)
        } else {
            self.topk
        }
    }

    /// Rows of a bucket an instance over `n` rows per request covers (`batch · n`).
    pub fn rows(&self, b: &BucketFacts) -> u32 {
        b.batch * self.n
    }

    /// Rows of a bucket the output head runs on: the selected row per request
    /// (draft-extend), or every lane (draft decode).
    pub fn head_rows(&self, b: &BucketFacts) -> u32 {
        if self.lanes > 0 {
            b.rows
        } else {
            b.batch
        }
    }

    /// Draft decode: entries of the score and token lists per request ([`tree_candidates`]).
    pub fn tree_candidates(&self) -> u32 {
        tree_candidates(self.topk, self.lanes) as u32
    }

    /// Draft decode: width of `parent_list` ([`parent_width`]).
    pub fn parent_width(&self) -> u32 {
        parent_width(self.topk, self.lanes) as u32
    }

    /// GQA group: query heads per kv head.
    pub fn group(&self) -> u32 {
        self.heads / self.kv_heads.max(1)
    }

    /// Columns of the fused qkv rows (the stride of q inside them).
    pub fn qkv_cols(&self) -> u32 {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Column chunks (one CTA each) of a rank's logits row; 1 = no split. Every rank's
    /// chunks meet in one `topk_merge` warp (a lane per record), so T ranks share its 32.
    pub fn topk_chunks(&self) -> u32 {
        rank_topk_chunks(self.cols, self.tp_size)
    }

    /// Chunks a bucket of `rows` head rows launches: at most [`KernelFacts::topk_chunks`]
    /// (the records' buffers are sized for it), fewer when the rows alone fill the GPU —
    /// [`TOPK_WAVE`] CTAs are one wave, and each CTA pays a fixed cost (its first load's
    /// latency, the lists' merge) — and no coarser than [`TOPK_WIDEST_CHUNK`] columns a chunk
    /// while 32 chunks allow it. A sharded plan keeps the plan's count (its records are
    /// all-gathered at a fixed size).
    pub fn topk_chunks_for(&self, rows: u32) -> u32 {
        let most = self.topk_chunks();
        if self.tp_size > 1 || most <= 1 {
            return most;
        }
        let fewest = self.cols.div_ceil(TOPK_WIDEST_CHUNK).clamp(1, most);
        (TOPK_WAVE / rows.max(1)).clamp(fewest, most)
    }

    /// Columns of the logits the plan emits: every rank's share (a sharded plan gathers
    /// them), `cols` unsharded.
    pub fn logits_cols(&self) -> u32 {
        self.cols.saturating_mul(self.tp_size.max(1))
    }

    /// The full logits row's first column of this rank's share.
    pub fn col_offset(&self) -> u32 {
        self.tp_rank.saturating_mul(self.cols)
    }

    /// Attention tiling fixed at plan time: (KV_TILE, STAGES), or `None` when even 16-key
    /// tiles in two stages do not fit in shared memory. STAGES tiles are resident (STAGES - 1
    /// loads in flight while one is computed); the tile is the largest of 64, 32, 16 keys
    /// whose shared memory fits. Why 3 × 64: docs/perf-notes.md ("Page lookups a tile
    /// ahead ... 2–4 stages").
    pub fn attn_tiling(&self) -> Option<(u32, u32)> {
        const STAGES: u32 = 3;
        let rows = self.n * self.group();
        [(64u32, STAGES), (32, STAGES), (16, STAGES), (16, 2)]
            .into_iter()
            .find(|&(t, st)| {
                attn_smem_bytes(rows, self.head_dim, t, st, self.act.size() as u32) <= MAX_SMEM_BYTES as u64
            })
    }
}

/// CTAs per row of a row-wise kernel over `rows` rows, each `units` thread-units of work
/// for `threads`-thread CTAs: one unit per thread, at most 8 CTAs a row and no more than
/// about 256 CTAs in all (a short batch then spreads over several SMs instead of one CTA
/// waiting on each of its loads in turn; a long one keeps one CTA a row, as each part
/// repeats the row's set-up).
pub fn row_parts(rows: u32, units: u64, threads: u32) -> u32 {
    let most = 256u32.div_ceil(rows.max(1)).clamp(1, 8) as u64;
    units.div_ceil(threads.max(1) as u64).clamp(1, most) as u32
}

/// One bucket's launch facts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketFacts {
    pub batch: u32,
    /// `batch · N`.
    pub rows: u32,
    /// KV splits of the attention.
    pub splits: u32,
    /// The splits run as one thread block cluster and merge there (no `attn_merge`).
    pub attn_cluster: bool,
    /// The splits' last CTA to finish merges them (no `attn_merge`), where an instance has
    /// at most [`ATTN_LAST_CTA_ROWS`] rows a CTA.
    pub attn_last_cta: bool,
}

/// Whether a bucket's attention splits can merge in their last CTA (`attn_last_cta`): more
/// than one split, not in clusters, and one arrival counter per (request, kv head) within the
/// runtime's words. The compiler sets the flag by it and validation holds plans to it.
pub fn attn_last_cta_fits(batch: u32, kv_heads: u32, splits: u32, cluster: bool) -> bool {
    splits > 1 && !cluster && batch as u64 * kv_heads as u64 <= crate::kv::COUNTER_WORDS as u64
}

/// Column chunks of a logits row of `cols` columns; 1 = no split.
pub fn topk_chunks(cols: u32) -> u32 {
    if cols <= TOPK_SINGLE_COLS {
        return 1;
    }
    cols.div_ceil(TOPK_CHUNK_COLS).clamp(2, MAX_TOPK_CHUNKS)
}

/// Column chunks of each of `ranks` ranks' `cols`-column share of a logits row: every
/// rank's records meet in one 32-lane `topk_merge` warp. A sharded plan's count is fixed
/// for every batch (`KernelFacts::topk_chunks_for` keeps it), so it stays at 8192 columns a
/// chunk: the finer chunks are for small batches only (docs/perf-notes.md, item 18).
pub fn rank_topk_chunks(cols: u32, ranks: u32) -> u32 {
    let chunks = if ranks > 1 {
        cols.div_ceil(TOPK_SINGLE_COLS).clamp(1, MAX_TOPK_CHUNKS)
    } else {
        topk_chunks(cols)
    };
    chunks.min(MAX_TOPK_CHUNKS / ranks.max(1)).max(1)
}

/// Floats per chunk record of `topk_partial` with `cands` candidates a list
/// (`KernelFacts::topk_cands`): max, sum, the candidates' values, their columns.
pub fn topk_record_floats(cands: u32) -> u32 {
    2 + 2 * cands
}

/// Dynamic shared memory of `attn_partial` (attention.cu's header states the formula): the
/// q rows of one pass (at most 64 packed rows, padded to 16), then the larger of the K/V
/// pipeline stages and the area that aliases them after the key loop (the cross-warp merge,
/// then the cluster merge's rows), then one row of u32 key offsets (16-byte units) per stage.
pub fn attn_smem_bytes(rows_per_cta: u32, head_dim: u32, kv_tile: u32, stages: u32, act_bytes: u32) -> u64 {
    let (d, t, a, st) = (head_dim as u64, kv_tile as u64, act_bytes as u64, stages as u64);
    let rows_per_pass = (rows_per_cta as u64).div_ceil(16).clamp(1, 4) * 16;
    let warps = crate::entries::attention::ATTN_THREADS as u64 / 32;
    let tiles = st * 2 * t * d * a;
    let merge = warps * 16 * d * 4 + warps * 16 * 2 * 4;
    // A cluster's merge: the CTA's o and lse of every row of the pass, after the merge area.
    let res = rows_per_pass * d * 4 + rows_per_pass * 4;
    // Each key's offset in 16-byte units (u32) per stage.
    let slots = st * t * 4;
    rows_per_pass * d * a + tiles.max(merge + res) + slots
}

/// Draft decode: entries of a request's score and token lists, `K + (S−1)·K²` (the root's
/// K children, then K² candidates per later step), for `topk` K and `steps` S.
pub fn tree_candidates(topk: u32, steps: u32) -> u64 {
    let k = topk as u64;
    k + steps.saturating_sub(1) as u64 * k * k
}

/// Draft decode: width of `parent_list`, `(S−1)·K + 1` (the root, its K children, K lanes per
/// step below the last).
pub fn parent_width(topk: u32, steps: u32) -> u64 {
    steps.saturating_sub(1) as u64 * topk as u64 + 1
}

/// Draft decode's lane offset (kernels/cuda/common.cuh `lane_offset`, the device's copy):
/// lane `lane` of a request with prefix `l` writes forward s's K/V at position
/// `l + lane_offset(..) + s`.
pub fn lane_offset(l: u64, lane: u32, steps: u32, lanes: u32, page: u32) -> u64 {
    let (steps, page) = (steps as u64, page.max(1) as u64);
    if page == 1 || lanes == 1 {
        return lane as u64 * steps;
    }
    lane as u64 * (l % page + steps).div_ceil(page) * page
}

/// Draft decode: positions past the prefix `l` a request's lanes touch (the last lane's
/// run up to its forward S − 2): a request needs `l + decode_reach(..) ≤ max_context_len`.
pub fn decode_reach(l: u64, steps: u32, lanes: u32, page: u32) -> u64 {
    lane_offset(l, lanes.saturating_sub(1), steps, lanes, page) + steps.saturating_sub(1) as u64
}
