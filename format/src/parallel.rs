//! Tensor parallelism in the plan: a plan's rank facts, the slices of the checkpoint its
//! weights hold, and its collective launches (docs/tensor-parallel.md).

use serde::{Deserialize, Serialize};

use crate::types::DType;

/// A plan's tensor-parallel facts: T ranks, this plan being rank `rank`'s. `size` 1 is the
/// unsharded plan (no collective launch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorParallel {
    pub size: u32,
    pub rank: u32,
    /// The embedding split by vocabulary like the engines' `VocabParallelEmbedding`: rank r
    /// holds rows `[r·V/T, (r+1)·V/T)`, looks up only its ids (zeros for the others), and
    /// the fc input rows are all-reduced (rank 0 carries the hidden half). `false`: every
    /// rank holds the whole table and no collective is needed (the default).
    pub vocab_embedding: bool,
}

impl TensorParallel {
    pub const SINGLE: TensorParallel = TensorParallel {
        size: 1,
        rank: 0,
        vocab_embedding: false,
    };

    /// Which of `parts` equal parts (a divisor of `size`) of a weight this rank holds: its
    /// own when `parts` = size, else the one it shares with `size / parts` ranks (kv heads
    /// replicated when T exceeds them; one part: the whole tensor).
    pub fn part_index(self, parts: u32) -> u32 {
        self.rank / (self.size / parts.max(1)).max(1)
    }

    /// Rows of the embedding table this rank holds, and the first one's id.
    pub fn embedding_rows(self, vocab: u32) -> (u32, u32) {
        if self.vocab_embedding && self.size > 1 {
            let rows = vocab / self.size;
            (rows, self.rank.saturating_mul(rows))
        } else {
            (vocab, 0)
        }
    }

    pub fn is_sharded(self) -> bool {
        self.size > 1
    }
}

/// Which slice of a full checkpoint tensor a rank's weight holds: part `index` of `parts`
/// equal parts along `axis` (0: rows, 1: columns).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shard {
    pub axis: u32,
    pub parts: u32,
    pub index: u32,
}

/// A collective over the plan's T tensor-parallel ranks, each rank's launch on its own
/// buffers at the same arena offsets (`docs/tensor-parallel.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveOp {
    /// Every rank's `count` elements become the sum over the ranks (in place: `send` =
    /// `recv`), rounded to the buffer's dtype.
    AllReduceSum,
    /// Rank r's `count` elements of `send` land at `recv[r·count ..]` on every rank.
    AllGather,
}

impl CollectiveOp {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduceSum => "all_reduce_sum",
            CollectiveOp::AllGather => "all_gather",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveDesc {
    pub op: CollectiveOp,
    /// Bucket buffers (`send` = `recv` for an in-place all-reduce).
    pub send: u32,
    pub recv: u32,
    /// Elements each rank contributes.
    pub count: u64,
    pub dtype: DType,
}
