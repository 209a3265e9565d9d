//! Stage 2 IR: the op graph, a petgraph DAG of a closed op enum over typed tensors.
//!
//! Ops name their input and output tensors by `TensorId`; the petgraph edges (producer →
//! consumer, one per tensor use) are derived from those lists by [`OpGraph::rebuild_edges`]
//! after every transformation, so passes edit ops and tensors and never edges by hand.
//! Shapes are affine in the bucket size B (`Dim { per_batch, fixed }`), which is what makes
//! every bucket a static instance of one graph.
//!
//! Invariants (checked by `verify::graph`): the graph is acyclic; every tensor has at most
//! one producer; graph inputs, weights and KV caches have none; every op's operand arity,
//! dtypes and shapes match its kind.

mod print;

use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use specplan_format::{DType, Entry, KvKind};

pub use print::{print_graph, to_dot};

/// A dimension `per_batch · B + fixed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dim {
    pub per_batch: u64,
    pub fixed: u64,
}

impl Dim {
    pub const fn fixed(n: u64) -> Dim {
        Dim { per_batch: 0, fixed: n }
    }
    pub const fn batch(per: u64) -> Dim {
        Dim {
            per_batch: per,
            fixed: 0,
        }
    }
    pub fn at(self, b: u64) -> u64 {
        self.per_batch * b + self.fixed
    }
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.per_batch, self.fixed) {
            (0, n) => write!(f, "{n}"),
            (1, 0) => write!(f, "B"),
            (p, 0) => write!(f, "{p}B"),
            (1, n) => write!(f, "B+{n}"),
            (p, n) => write!(f, "{p}B+{n}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u32);

impl std::fmt::Display for TensorId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// Where a tensor's storage lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Storage {
    /// Written by host prep (a graph input), in the arena.
    Input,
    /// Produced by an op, in the arena; `output` ones are read by the caller.
    Activation { output: bool },
    /// Read-only parameter in the weight region; `sources` name the file tensors it is
    /// packed from.
    Weight {
        sources: Vec<String>,
        packing: specplan_format::Packing,
        /// A tensor-parallel rank's slices, one per packed part (`WeightDesc::shard`;
        /// empty: whole).
        shard: Vec<specplan_format::Shard>,
    },
    /// One layer's K or V pool (outside the arena).
    KvCache { layer: u32, kind: KvKind },
    /// The device page table `[max_requests + 1, pages_per_request]`, indexed by request
    /// slot (outside the arena; the runtime updates it incrementally).
    PageTable,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<Dim>,
    pub storage: Storage,
    /// Produced in place over this tensor's storage (e.g. a GEMM accumulating into the
    /// residual stream, RoPE rotating q inside qkv, K/V appended into the cache). Same
    /// dtype and shape, except a column view (`OpGraph::is_column_view`): the first
    /// columns of each of its storage's rows, read with that storage's row stride.
    pub alias_of: Option<TensorId>,
}

impl Tensor {
    pub fn bytes_at(&self, b: u64) -> u64 {
        self.shape.iter().map(|d| d.at(b)).product::<u64>() * self.dtype.size()
    }
}

/// The closed set of ops. Unfused ops come from lowering; fused ones from `passes`.
#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    // --- Unfused (lowering) ---
    /// ins: ids [T] i64, table [V,H] → out [T,H].
    Embed,
    /// ins: a [T,X], b [T,Y] → out [T,X+Y].
    Concat,
    /// ins: a [M,K], w [N,K], (bias [N]) (, c_in [M,N] when accumulating) → out [M,N]
    /// (, out rounded to act [M,N] when out is f32: `round_into_gemm`'s second output).
    Linear { bias: bool, accumulate: bool },
    /// ins: x [M,H], w [H] → out [M,H]. fp32 math: x·rsqrt(mean(x²)+eps)·w.
    RmsNorm,
    /// ins: a, b (same shape) → out.
    Add,
    /// ins: x [M,H] of the fp32 stream → out [M,H] of the activation type: the stream's
    /// one rounding (`cast_rows`).
    Cast,
    /// ins: x [T, heads·D], prefix_lens [B] → out. Position of row r = prefix_lens[r/N] + r%N
    /// (draft decode: prefix_lens[r/K] + step, every lane).
    Rope { heads: u32, step: u32 },
    /// ins: k [T,Hkv·D], v [T,Hkv·D], prefix_lens, req_slots, page_table, k_cache, v_cache → out: k_cache', v_cache'.
    /// Draft decode: row r writes the slot of its lane (docs/semantics.md).
    KvAppend { layer: u32, step: u32 },
    /// ins: q [T,Hq·D] (row stride q_stride), k_cache, v_cache, req_slots, page_table, prefix_lens → out [T,Hq·D].
    /// Draft decode: the prefix and the row's own lane's slots of steps 0..=step.
    /// `select`: one more input, accept_lens [B], and out [B,Hq·D]: only the query row
    /// i·N + A_i − 1 of each request, at position prefix_lens[i] + A_i − 1 (the draft-extend
    /// head's last layer, whose other rows' outputs nothing reads).
    Attention {
        layer: u32,
        window: Option<u32>,
        step: u32,
        select: bool,
    },
    /// ins: x → out: x·sigmoid(x).
    Silu,
    /// ins: a, b → out: a·b.
    Mul,
    /// ins: x [T,H], accept_lens [B] → out [B,H], row i·N + A_i − 1.
    SelectRows,
    /// ins: logits [B,V] f32 → out [B,V] f32.
    Softmax,
    /// ins: probs [B,V] f32 (, with `refine`: x [B,H] the fp32 stream's rows, lm_w [V,H] (,
    /// norm_w [H])) → out: values [B,K] f32, indices [B,K] i64 (ties to the lower index).
    /// `refine`: the K candidates' logits recomputed from x (normed by norm_w when given)
    /// through lm_w, the probabilities with them (docs/semantics.md, "Precision").
    TopK { k: u32, refine: bool },
    /// ins: ids [B,K] i64, map [C] i64 → out [B,K] i64: FR-Spec's hot → full vocabulary
    /// (`map[id]`) or EAGLE-3's draft → target (`id + map[id]`, the d2t offsets).
    MapIds { map: IdMap },
    /// Draft decode's root: ins topk_probs [B,K] f32, topk_ids [B,K] i64 → out scores [B,K]
    /// f32, ids [T] i64, (src [T] i32 with K > 1,) score_list [B,C] f32, token_list [B,C]
    /// i64, parent_list [B,PW] i64 (`tree_init`).
    TreeInit,
    /// Draft decode's selection after forward `step − 1`: ins scores [B,K], probs [T,K],
    /// ids [T,K], score_list, token_list, parent_list → out score_list', token_list'
    /// (, parent_list', scores' [B,K], next ids [T] (, src [T] with K > 1) below the last
    /// step) (`tree_select`).
    TreeSelect { step: u32 },
    /// Draft decode's result: ins score_list, token_list → out top_scores_index [B,N−1],
    /// draft_tokens [B,N−1] (`tree_finish`).
    TreeFinish,
    /// The verify inputs of the tree (`capture.decode_verify`): ins parent_list,
    /// top_scores_index, draft_tokens, bonus_tokens [B], prefix_lens [B] → out tokens,
    /// positions, retrieve_index, next_token, next_sibling [B,N] i64, mask [B,N,N] i32
    /// (`tree_verify`).
    TreeVerify,
    /// ins x [M,H], src [T] i32 → out [T,H] = x[src] (`gather_rows`; step 0: M = B).
    GatherRows { step: u32 },
    // --- Tensor parallel (lowering of a sharded plan; docs/tensor-parallel.md) ---
    /// ins x → out x' in place: the sum of every rank's x (after a row-parallel GEMM).
    AllReduce,
    /// A rank's share of a logits row → its softmax/top-K chunk records: ins logits [M,C]
    /// f32 (columns `rank·C ..` of the full row) → out records [M, chunks·R] f32
    /// (`topk_partial`, full-row columns).
    TopKRecords { k: u32 },
    /// ins x [M,X] → out [ranks, M, X]: every rank's x, rank-major.
    AllGather { ranks: u32 },
    /// Every rank's records → the global top-K: ins records [ranks, M, chunks·R] f32
    /// (, map) → out probs [M,K] f32, ids [M,K] i64 (`topk_merge`).
    TopKMerge { k: u32, map: Option<IdMap> },
    /// Every rank's gathered logits `[ranks, M, C]` → full rows `[M, ranks·C]` f32 (the
    /// sharded plan's `logits` output, `logits_gather`).
    LogitsGather { ranks: u32 },
    /// EAGLE-3's layer-0 input from the all-reduced `embed(ids) ‖ h` of a vocabulary-parallel
    /// embedding: ins x [T,2H], w_embed [H], w_hidden [H] → out [T,2H] (`norm_concat`).
    NormConcat,
    // --- Fused (passes) ---
    /// Embed ‖ hidden: ins ids, table, hidden [T,H] (, fc bias [H]) → out [T,2H]
    /// (, the fc output [T,H] initialized to the bias, which the fc GEMM accumulates onto).
    EmbedConcat { bias: bool },
    /// RoPE on q and k inside qkv (in place) + K/V append. ins: qkv, prefix_lens,
    /// req_slots, page_table, k_cache, v_cache → out: qkv', k_cache', v_cache'.
    RopeAppend { layer: u32, step: u32 },
    /// ins: gate_up [T,2I] → out [T,I]: silu(gate)·up, written in place over the gate
    /// half (a column view of gate_up, row stride 2I, which the down GEMM reads as A).
    SiluMul,
    /// Softmax + top-K (+ id map). ins: logits (, map) (, x, lm_w (, norm_w) with `refine`,
    /// as TopK's) → out: probs [B,K], ids [B,K].
    SoftmaxTopK { k: u32, map: Option<IdMap>, refine: bool },
    /// EAGLE-3's layer-0 input: ins ids, table [V,H], w_embed [H], h [T,H], w_hidden [H] →
    /// out [T,2H] = rmsnorm(embed(ids), w_embed) ‖ rmsnorm(h, w_hidden).
    EmbedNormConcat,
    /// Row select + residual add + RMSNorm (the last layer's post-attention norm): ins
    /// x [T,H], accept_lens [B], w [H], o [B,H] → out: the selected rows plus o [B,H],
    /// their norm [B,H].
    SelectNorm,
    /// The selected rows' MLP over exact inputs (`mlp_pairs`, docs/semantics.md "MLP
    /// pairs"): as SelectNorm, the norm as hi/lo row pairs: out the selected rows plus o
    /// [B,H], their norm [2B,H] (rows 2i, 2i+1).
    SelectNormPairs,
    /// ins: gate_up [2B,2I] f32 (the GEMM over SelectNormPairs' rows) → out [B,I]:
    /// silu(g)·u of the pairs' sums, its own buffer.
    SiluMulPairs,
    /// The two readers of the fp32 stream's selected rows in EAGLE-3's head: ins x [R,H] f32,
    /// w [H] → out: rmsnorm(x, w) [R,H] (lm_head's input), round(x) [R,H] (hidden_out).
    NormCast,
}

/// How top-K columns become token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdMap {
    /// FR-Spec: `hot_token_ids[column]`.
    Hot,
    /// EAGLE-3: `column + d2t[column]`.
    Offset,
}

impl IdMap {
    pub fn name(self) -> &'static str {
        match self {
            IdMap::Hot => "hot",
            IdMap::Offset => "d2t",
        }
    }
}

impl OpKind {
    /// The op's name in printed graphs (a fused op that is one kernel is named after it).
    pub fn mnemonic(&self) -> &'static str {
        match self {
            OpKind::Embed => "embed",
            OpKind::Concat => "concat",
            OpKind::Linear { .. } => "linear",
            OpKind::RmsNorm => Entry::RmsNorm.name(),
            OpKind::Add => "add",
            OpKind::Cast => Entry::CastRows.name(),
            OpKind::Rope { .. } => "rope",
            OpKind::KvAppend { .. } => "kv_append",
            OpKind::Attention { .. } => "attention",
            OpKind::Silu => "silu",
            OpKind::Mul => "mul",
            OpKind::SelectRows => Entry::SelectRows.name(),
            OpKind::Softmax => "softmax",
            OpKind::TopK { .. } => "topk",
            OpKind::MapIds { .. } => "map_ids",
            OpKind::EmbedConcat { .. } => Entry::EmbedConcat.name(),
            OpKind::RopeAppend { .. } => Entry::RopeAppend.name(),
            OpKind::SiluMul => Entry::SiluMul.name(),
            OpKind::SoftmaxTopK { .. } => Entry::SoftmaxTopk.name(),
            OpKind::EmbedNormConcat => Entry::EmbedNormConcat.name(),
            OpKind::SelectNorm => Entry::SelectNorm.name(),
            OpKind::SelectNormPairs => Entry::SelectNormPairs.name(),
            OpKind::SiluMulPairs => Entry::SiluMulPairs.name(),
            OpKind::NormCast => Entry::NormCast.name(),
            OpKind::TreeInit => Entry::TreeInit.name(),
            OpKind::TreeSelect { .. } => Entry::TreeSelect.name(),
            OpKind::TreeFinish => Entry::TreeFinish.name(),
            OpKind::TreeVerify => Entry::TreeVerify.name(),
            OpKind::GatherRows { .. } => Entry::GatherRows.name(),
            OpKind::AllReduce => "all_reduce",
            OpKind::TopKRecords { .. } => Entry::TopkPartial.name(),
            OpKind::AllGather { .. } => "all_gather",
            OpKind::TopKMerge { .. } => Entry::TopkMerge.name(),
            OpKind::LogitsGather { .. } => Entry::LogitsGather.name(),
            OpKind::NormConcat => Entry::NormConcat.name(),
        }
    }

    /// Whether executing the op needs a host round trip or a data-dependent allocation.
    /// None of ours does (the layouts are static and every length is read on the
    /// device); the replay analysis still asks, so a new op has to answer.
    pub fn needs_host_sync(&self) -> bool {
        match self {
            OpKind::Embed
            | OpKind::Concat
            | OpKind::Linear { .. }
            | OpKind::RmsNorm
            | OpKind::Add
            | OpKind::Cast
            | OpKind::Rope { .. }
            | OpKind::KvAppend { .. }
            | OpKind::Attention { .. }
            | OpKind::Silu
            | OpKind::Mul
            | OpKind::SelectRows
            | OpKind::Softmax
            | OpKind::TopK { .. }
            | OpKind::MapIds { .. }
            | OpKind::EmbedNormConcat
            | OpKind::SelectNorm
            | OpKind::SelectNormPairs
            | OpKind::SiluMulPairs
            | OpKind::NormCast
            | OpKind::EmbedConcat { .. }
            | OpKind::RopeAppend { .. }
            | OpKind::SiluMul
            | OpKind::SoftmaxTopK { .. }
            | OpKind::TreeInit
            | OpKind::TreeSelect { .. }
            | OpKind::TreeFinish
            | OpKind::TreeVerify
            | OpKind::GatherRows { .. }
            | OpKind::AllReduce
            | OpKind::TopKRecords { .. }
            | OpKind::AllGather { .. }
            | OpKind::TopKMerge { .. }
            | OpKind::LogitsGather { .. }
            | OpKind::NormConcat => false,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    pub name: String,
    pub kind: OpKind,
    pub ins: Vec<TensorId>,
    pub outs: Vec<TensorId>,
    /// Program order from lowering; a fused op takes the first rank of what it replaced.
    /// Ties in the topological order are broken by it, so the order is deterministic.
    pub rank: u32,
}

impl Op {
    /// A name derived from this op's, whose name ends in `suffix`: `into` behind the same
    /// prefix (`l0.`, a multi-step phase's `s1.l0.`, or none).
    pub fn renamed(&self, suffix: &str, into: &str) -> String {
        format!("{}{into}", self.name.strip_suffix(suffix).unwrap_or(""))
    }
}

/// The op graph. Nodes are ops; an edge carries the tensor flowing producer → consumer.
#[derive(Clone, Debug, Default)]
pub struct OpGraph {
    pub graph: StableDiGraph<Op, TensorId>,
    pub tensors: Vec<Tensor>,
}

impl OpGraph {
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.0 as usize]
    }

    /// The tensor whose storage `t` lives in (itself unless produced in place).
    pub fn root(&self, mut t: TensorId) -> TensorId {
        while let Some(a) = self.tensor(t).alias_of {
            t = a;
        }
        t
    }

    /// Whether `t` lives in place over a tensor of another shape: the first columns of
    /// each of its storage's rows (the SwiGLU product inside the gate/up rows).
    pub fn is_column_view(&self, t: TensorId) -> bool {
        let r = self.root(t);
        r != t && self.tensor(r).shape != self.tensor(t).shape
    }

    pub fn add_tensor(&mut self, t: Tensor) -> TensorId {
        self.tensors.push(t);
        TensorId(self.tensors.len() as u32 - 1)
    }

    pub fn add_op(&mut self, op: Op) -> NodeIndex {
        self.graph.add_node(op)
    }

    /// The op producing each tensor (`None` for inputs, weights, untouched caches).
    pub fn producers(&self) -> Vec<Option<NodeIndex>> {
        let mut p = vec![None; self.tensors.len()];
        for n in self.graph.node_indices() {
            for &t in &self.graph[n].outs {
                p[t.0 as usize] = Some(n);
            }
        }
        p
    }

    /// Recomputes the edges from the ops' operand lists.
    pub fn rebuild_edges(&mut self) {
        self.graph.clear_edges();
        let producers = self.producers();
        let nodes: Vec<NodeIndex> = self.graph.node_indices().collect();
        for n in nodes {
            let ins = self.graph[n].ins.clone();
            for t in ins {
                if let Some(p) = producers[t.0 as usize] {
                    self.graph.add_edge(p, n, t);
                }
            }
        }
    }

    /// Deterministic topological order: Kahn's algorithm, ready ops taken by (rank, index).
    /// Returns the node that closes a cycle when there is one.
    pub fn topo_order(&self) -> Result<Vec<NodeIndex>, NodeIndex> {
        use std::cmp::Reverse;
        use std::collections::{BinaryHeap, HashMap};
        let mut indeg: HashMap<NodeIndex, usize> = HashMap::new();
        for n in self.graph.node_indices() {
            indeg.insert(n, self.graph.edges_directed(n, petgraph::Incoming).count());
        }
        let key = |n: NodeIndex| Reverse((self.graph[n].rank, n.index()));
        let mut ready: BinaryHeap<(Reverse<(u32, usize)>, NodeIndex)> = indeg
            .iter()
            .filter(|(_, &d)| d == 0)
            .map(|(&n, _)| (key(n), n))
            .collect();
        let mut order = Vec::with_capacity(indeg.len());
        while let Some((_, n)) = ready.pop() {
            order.push(n);
            for e in self.graph.edges_directed(n, petgraph::Outgoing) {
                let m = e.target();
                if let Some(d) = indeg.get_mut(&m) {
                    *d -= 1;
                    if *d == 0 {
                        ready.push((key(m), m));
                    }
                }
            }
        }
        if order.len() == indeg.len() {
            Ok(order)
        } else {
            let stuck = indeg
                .iter()
                .filter(|(_, &d)| d > 0)
                .map(|(&n, _)| n)
                .min_by_key(|n| n.index())
                .unwrap_or_else(|| NodeIndex::new(0));
            Err(stuck)
        }
    }

    /// Ops consuming tensor `t`.
    pub fn consumers(&self, t: TensorId) -> Vec<NodeIndex> {
        self.graph
            .node_indices()
            .filter(|&n| self.graph[n].ins.contains(&t))
            .collect()
    }

    /// The single op that produces `t`, if any.
    pub fn producer(&self, t: TensorId) -> Option<NodeIndex> {
        self.graph.node_indices().find(|&n| self.graph[n].outs.contains(&t))
    }
}
