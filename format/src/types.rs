//! The plan data model: plain serializable records, no behaviour.
//!
//! Everything here is relocatable: memory is named by byte offsets into one of three
//! regions the runtime allocates (the activation arena, the weight region, the KV pool),
//! never by pointers. Indices (`BufferId`, `WeightId`, kernel ids) are positions in the
//! vectors of the same plan or bucket; `validate` checks every one before use.

use serde::{Deserialize, Serialize};

pub use specplan_kernels::abi::Access;
pub use specplan_kernels::{io, ConstValue, DType, Entry};

pub use crate::gemm::GemmDesc;
pub use crate::parallel::{CollectiveDesc, CollectiveOp, Shard, TensorParallel};

/// Hugging Face `rope_scaling`, as the Llama family applies it to `inv_freq`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f32,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: u32,
    },
    /// YaRN (`rope_type = "yarn"`), as SGLang 0.5.23's `YaRNScalingRotaryEmbedding` and
    /// Hugging Face compute it: each frequency blends interpolation (`1/(factor·base^(2i/d))`)
    /// and extrapolation over the dimensions between the correction bounds of `beta_fast`
    /// and `beta_slow` rotations in `original_max_position_embeddings` positions (rounded
    /// outwards with `truncate`), and the rotated q and k are scaled by the attention factor
    /// `facts::rope_attention_scale` (`mscale`/`mscale_all_dim` when both are given, else
    /// `0.1·ln(factor) + 1`), which scales every logit by its square and the cached K by it.
    Yarn {
        factor: f32,
        original_max_position_embeddings: u32,
        beta_fast: f32,
        beta_slow: f32,
        mscale: Option<f32>,
        mscale_all_dim: Option<f32>,
        truncate: bool,
    },
    /// LongRoPE (`rope_type = "longrope"`, Phi-3 / MiniCPM) with its short factors: frequency
    /// i is `1/(short_factor[i]·θ^(2i/d))`, cos and sin scaled by `short_mscale` (default
    /// `√(1 + ln(max_position_embeddings/original)/ln(original))`, 1 when that ratio is ≤ 1).
    /// SGLang 0.5.23 switches a whole batch to the long factors once any position passes
    /// `original_max_position_embeddings` (`srt/layers/rotary_embedding/rope_variant.py`):
    /// a plan is exact only below that, so validation holds `max_context_len` to
    /// `original_max_position_embeddings`.
    LongRope {
        short_factor: Vec<f32>,
        original_max_position_embeddings: u32,
        short_mscale: Option<f32>,
    },
}

/// Which EAGLE draft head a plan computes (`docs/semantics.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HeadKind {
    /// EAGLE-1/2: `fc([embed ‖ hidden])`, layers, `lm_head` (the target's).
    Eagle1,
    /// EAGLE-3: `fc` of three target layers' features, layer 0 on
    /// `[input_layernorm(embed) ‖ hidden_norm(h)]` with residual `h`, a final norm before its
    /// own `lm_head` over the draft vocabulary, ids mapped by `d2t`.
    Eagle3,
}

impl HeadKind {
    pub fn name(self) -> &'static str {
        match self {
            HeadKind::Eagle1 => "eagle1",
            HeadKind::Eagle3 => "eagle3",
        }
    }
}

/// The draft model's resolved dimensions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelDesc {
    pub head: HeadKind,
    pub hidden: u32,
    pub intermediate: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub layers: u32,
    pub vocab: u32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: u32,
    pub fc_bias: bool,
    /// EAGLE-3: the target's hidden size H_t (input rows are `3 · H_t` wide). EAGLE-1/2:
    /// equal to `hidden`.
    pub target_hidden: u32,
    /// EAGLE-3 with its own draft vocabulary: V_d, the rows of `lm_head`, whose top-K ids
    /// map to target ids through `d2t`. `None`: `lm_head` has the target vocabulary's rows.
    pub draft_vocab: Option<u32>,
}

impl ModelDesc {
    /// Width of a row of the input hidden states.
    pub fn hidden_in(&self) -> u32 {
        match self.head {
            HeadKind::Eagle1 => self.hidden,
            HeadKind::Eagle3 => self.target_hidden.saturating_mul(3),
        }
    }

    /// Rows of `lm_head` (before any FR-Spec hot selection).
    pub fn lm_vocab(&self) -> u32 {
        self.draft_vocab.unwrap_or(self.vocab)
    }
}

/// EAGLE speculative parameters (SGLang's names).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecDesc {
    pub topk: u32,
    pub num_steps: u32,
    pub num_draft_tokens: u32,
}

/// Capture-time facts shared by every bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureDesc {
    pub page_size: u32,
    pub max_context_len: u32,
    /// Columns of the page table: `ceil(max_context_len / page_size)`.
    pub max_pages_per_request: u32,
    /// Pages in the KV pool, the scratch page included.
    pub kv_pool_pages: u32,
    /// Request slots (rows) of the device page table; row `max_requests` is the scratch
    /// slot whose every entry is the scratch page (padded requests point at it).
    pub max_requests: u32,
    /// A pool page no request owns: padded rows of a bucket write their K/V here. It is
    /// always the pool's last page; a runtime that sizes its pool differently (the `run`
    /// contract uses the caller's pages plus one) uses its own last page.
    pub scratch_page: u32,
    pub dtype: DType,
    /// FR-Spec: the lm_head keeps this many hot rows; ids are mapped back.
    pub hot_vocab_size: Option<u32>,
    /// What the head emits per request besides its hidden row (compile flag `outputs`).
    pub outputs: HeadOutputs,
    /// Draft-decode phases also emit the target's verify inputs for their tree (compile flag
    /// `draft_decode_outputs = "tree,verify"`): `verify_tokens`, `verify_positions`,
    /// `retrieve_*` and `tree_mask`, from the caller's `bonus_tokens`.
    pub decode_verify: bool,
    /// The tensor-parallel rank this plan computes (`docs/tensor-parallel.md`): with
    /// `size` T > 1 the model's heads, kv heads, intermediate rows and lm_head rows are the
    /// rank's share (`ModelDesc` holds the rank's), and the launches include collectives.
    pub tp: TensorParallel,
}

/// The head's per-request outputs besides `hidden_out`: the fused top-K (`topk_probs`,
/// `topk_ids`) and/or the selected row's `logits` over the lm_head's rows (the draft or hot
/// vocabulary, unmapped: what SGLang's draft-extend slot returns and samples itself); at
/// least one. The top-K ids are target ids (mapped through d2t or the FR-Spec hot map), or
/// with `draft_ids` the lm_head's own rows, for an engine that maps them itself (SGLang's
/// `draft_forward` applies `hot_token_id`), so no id is mapped twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeadOutputs {
    pub topk: bool,
    pub logits: bool,
    pub draft_ids: bool,
}

impl HeadOutputs {
    pub const TOPK: HeadOutputs = HeadOutputs {
        topk: true,
        logits: false,
        draft_ids: false,
    };
    pub const LOGITS: HeadOutputs = HeadOutputs {
        topk: false,
        logits: true,
        draft_ids: false,
    };

    /// The flag's spelling: `topk` or `topk-draft` and/or `logits`, joined by a comma.
    pub fn name(self) -> &'static str {
        match (self.topk, self.draft_ids, self.logits) {
            (true, false, false) => "topk",
            (true, true, false) => "topk-draft",
            (false, _, true) => "logits", // tidy: not a tensor name (the flag's spelling)
            (true, false, true) => "topk,logits",
            (true, true, true) => "topk-draft,logits",
            (false, _, false) => "none",
        }
    }

    /// Parses the flag's spelling: `topk`, `topk-draft` (ids unmapped), `logits`, or a top-K
    /// and `logits` joined by `,` or `+`.
    pub fn parse(s: &str) -> Option<HeadOutputs> {
        let mut o = HeadOutputs {
            topk: false,
            logits: false,
            draft_ids: false,
        };
        for part in s.split([',', '+']) {
            match part.trim() {
                "topk" if !o.topk => o.topk = true,
                "topk-draft" if !o.topk => {
                    o.topk = true;
                    o.draft_ids = true;
                }
                "logits" if !o.logits => o.logits = true, // tidy: not a tensor name
                _ => return None,
            }
        }
        (o.topk || o.logits).then_some(o)
    }

    /// Whether the top-K ids go through the plan's id map (d2t or the FR-Spec hot map).
    pub fn maps_ids(self) -> bool {
        self.topk && !self.draft_ids
    }
}

/// What the kernels were built for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetDesc {
    /// SM architecture, e.g. 90 for sm_90.
    pub sm: u32,
    /// NVRTC version that produced the binaries, when any were produced.
    pub nvrtc: Option<String>,
}

/// Per-layer attention facts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerDesc {
    /// Sliding window W: a row at position p sees keys in (p - W, p]. `None` = full causal.
    pub window: Option<u32>,
}

/// How a device weight is built from the tensors of the weights file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Packing {
    /// One file tensor, copied as is.
    Single,
    /// File tensors stacked along dim 0, in the order of `sources` (fused projections).
    ConcatRows,
    /// Rows of `sources[0]` gathered by the i64 ids of `sources[1]` (FR-Spec hot lm_head).
    GatherRows,
    /// The first `shape[0]` rows of `sources[0]`, a `[R ≥ shape[0], cols]` tensor (a tied
    /// EAGLE-3 head over a draft vocabulary: SGLang 0.5.23 uses the embedding as lm_head and
    /// keeps the logits' first V_d columns, `srt/layers/logits_processor.py:1346-1347`).
    LeadingRows,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightDesc {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub sources: Vec<String>,
    pub packing: Packing,
    /// A tensor-parallel rank's slices: empty for the whole tensors, else one per packed
    /// part — each stacked source of `ConcatRows` (q, k and v may differ: replicated kv
    /// heads), the packed tensor of the other packings (gathered hot rows, leading rows).
    pub shard: Vec<Shard>,
    /// Byte offset in the weight region.
    pub offset: u64,
    pub bytes: u64,
}

/// Compiled code of a kernel instance. Filled at plan time by NVRTC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelBinary {
    /// e.g. "sm_90".
    pub arch: String,
    /// Hex SHA-256 of the source this was compiled from (must equal the kernel's).
    pub source_hash: String,
    pub cubin: Vec<u8>,
    /// PTX for `compute_<sm>`, the fallback when the CUBIN does not load.
    pub ptx: String,
}

/// One specialized kernel: an entry of a template plus its constants. The parameter
/// struct, block size and argument rules are the entry's declaration in the kernels crate,
/// never read from the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelDesc {
    /// Stable mangled name, unique in the plan.
    pub name: String,
    pub entry: Entry,
    pub constants: Vec<(String, ConstValue)>,
    /// Hex SHA-256 of the full source NVRTC sees (prelude + template + includes).
    pub source_hash: String,
    pub binary: Option<KernelBinary>,
}

/// What the compiler fused, and what it saves per bucket row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FusionRecord {
    pub rule: String,
    pub fused: Vec<String>,
    pub into: String,
    pub launches_saved: u32,
    /// Activation bytes per request (its N rows, or its one selected row) no longer written and read back.
    pub bytes_saved_per_request: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BufferRole {
    /// Written by host prep before every replay.
    Input,
    /// Read by the caller after a replay.
    Output,
    /// Produced and consumed inside the forward.
    Scratch,
}

/// A tensor living at a fixed offset of the activation arena for one bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub bytes: u64,
    pub role: BufferRole,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvKind {
    K,
    V,
}

/// The value bound to one field of a kernel's parameter struct (in field order; names,
/// offsets and access come from the entry's declaration).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ArgValue {
    /// Device address of a bucket buffer.
    Buffer(u32),
    /// Device address of a weight.
    Weight(u32),
    /// Device address of the page table `[max_requests + 1, max_pages_per_request]` i32.
    PageTable,
    /// Device address of one layer's K or V pool.
    KvCache {
        layer: u32,
        kind: KvKind,
    },
    /// Device address of the registered K/V layout words (`specplan_kernels::kv`).
    KvLayout,
    /// Device address of the runtime's arrival counters (`specplan_kernels::kv::COUNTER_WORDS`).
    Counters,
    U32(u32),
    /// A null pointer (an operand this launch does not use).
    Null,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum LaunchKind {
    Kernel {
        kernel: u32,
        grid: [u32; 3],
        block: [u32; 3],
        smem: u32,
        /// CTAs per thread block cluster along z (1: launched without clusters).
        cluster: u32,
        args: Vec<ArgValue>,
    },
    Gemm(GemmDesc),
    Collective(CollectiveDesc),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    /// The graph node(s) this launch implements, for people and diffs.
    pub op: String,
    pub kind: LaunchKind,
}

/// Why a bucket cannot be replayed as a CUDA graph (it then runs eagerly).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplayBlocker {
    /// A full bucket needs more pool pages than exist (one scratch page included).
    PoolTooSmall { need_pages: u64, pool_pages: u64 },
    /// An index the kernels compute in 32 bits could overflow.
    IndexOverflow { what: String, value: u64, limit: u64 },
    /// An op needs a host round trip or a data-dependent allocation.
    HostSync { op: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Replay {
    Graph,
    Eager(ReplayBlocker),
}

/// Which forward of the draft model a phase is. Each kind has one signature
/// (`signature.rs`), one lowering (`compiler/src/lower/<kind>.rs`) and one runner; a plan
/// holds at most one phase of each kind (draft decode: one per step-count tier).
/// ARCHITECTURE.md, "How to add a phase", lists what a new kind touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PhaseKind {
    /// The draft model over the N rows per request that target verification produced:
    /// K/V appended at positions L .. L+N−1, the accepted row's outputs emitted.
    DraftExtend,
    /// SGLang 0.5.23's multi-step draft decode at `steps` = S (a tier): S − 1 forwards of
    /// K lanes per request (`topk`), each at position L + step with its K/V in the lane's
    /// own slots, the top-K tree grown between them, the N − 1 best nodes emitted
    /// (`docs/semantics.md`, "Draft decode").
    DraftDecode { steps: u32 },
}

impl PhaseKind {
    /// The kinds' names (a draft-decode phase of any tier is `draft_decode`).
    pub const NAMES: [&'static str; 2] = ["draft_extend", "draft_decode"];

    pub fn name(self) -> &'static str {
        match self {
            PhaseKind::DraftExtend => Self::NAMES[0],
            PhaseKind::DraftDecode { .. } => Self::NAMES[1],
        }
    }

    /// The name with its tier: `draft_extend`, `draft_decode:3` (what `show`, `diff` and
    /// errors print, and what `Plan.signature` accepts).
    pub fn label(self) -> String {
        match self {
            PhaseKind::DraftExtend => self.name().to_string(),
            PhaseKind::DraftDecode { steps } => format!("{}:{steps}", self.name()),
        }
    }

    /// Rows each request contributes to one forward of this phase: the one definition every
    /// stage reads (through [`Phase::rows_per_request`], which validation checks against it).
    pub fn rows_per_request(self, spec: &SpecDesc) -> u32 {
        match self {
            PhaseKind::DraftExtend => spec.num_draft_tokens,
            PhaseKind::DraftDecode { .. } => spec.topk,
        }
    }

    /// Forwards of the draft model one replay runs.
    pub fn forwards(self) -> u32 {
        match self {
            PhaseKind::DraftExtend => 1,
            PhaseKind::DraftDecode { steps } => steps.saturating_sub(1),
        }
    }

    /// Launches of one replay that append to each layer's K and V pools (one per forward).
    pub fn kv_appends_per_layer(self) -> u32 {
        self.forwards()
    }

    /// Draft decode: N, the tree's tokens, root included (its outputs keep N − 1 nodes):
    /// the configured `num_draft_tokens` at the configured step count, `steps + 1` on the
    /// other tiers (which need topk = 1, where SGLang forces N = S + 1). Draft-extend: its N.
    pub fn draft_tokens(self, spec: &SpecDesc) -> u32 {
        match self {
            PhaseKind::DraftDecode { steps } if steps != spec.num_steps => steps + 1,
            _ => spec.num_draft_tokens,
        }
    }

    /// Draft decode: S (0 for draft-extend, whose rows are causal).
    pub fn steps(self) -> u32 {
        match self {
            PhaseKind::DraftExtend => 0,
            PhaseKind::DraftDecode { steps } => steps,
        }
    }

    /// Parses a label (`draft_extend`, `draft_decode:3`); `draft_decode` alone is the tier
    /// `default_steps`.
    pub fn parse(s: &str, default_steps: Option<u32>) -> Option<PhaseKind> {
        match s.split_once(':') {
            None if s == Self::NAMES[0] => Some(PhaseKind::DraftExtend),
            None if s == Self::NAMES[1] => default_steps.map(|steps| PhaseKind::DraftDecode { steps }),
            Some((n, t)) if n == Self::NAMES[1] => t.parse().ok().map(|steps| PhaseKind::DraftDecode { steps }),
            _ => None,
        }
    }
}

/// One forward of the draft model, compiled for every batch bucket: its rows per request,
/// its buckets (layouts, buffers, launches) and, through its kind, its signature. Weights,
/// the KV layout, the kernels and the arena belong to the plan and are shared by every phase.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub kind: PhaseKind,
    /// Rows per request of every bucket (`kind.rows_per_request(spec)`).
    pub rows_per_request: u32,
    pub buckets: Vec<BucketPlan>,
}

impl Phase {
    /// The bucket a raw batch of `b` requests replays in (the smallest that fits).
    pub fn bucket_for(&self, b: u32) -> Option<&BucketPlan> {
        self.buckets.iter().find(|x| x.batch >= b)
    }

    /// Largest arena of the phase's buckets: the phase's share of the runtime's one arena.
    pub fn arena_bytes(&self) -> u64 {
        self.buckets.iter().map(|b| b.arena_bytes).max().unwrap_or(0)
    }

    /// The most positions past a request's prefix that one step of the phase writes K/V to
    /// (or, with page-aligned lane runs, reserves): what the engine must have allocated in
    /// each request's table row beyond its prefix. Draft-extend: N. Draft decode: the last
    /// lane's reach, largest at a prefix one short of a page boundary.
    pub fn positions_per_request(&self, spec: &SpecDesc, page_size: u32) -> u64 {
        match self.kind {
            PhaseKind::DraftExtend => spec.num_draft_tokens as u64,
            PhaseKind::DraftDecode { steps } => (0..page_size.max(1) as u64)
                .map(|l| specplan_kernels::facts::decode_reach(l, steps, spec.topk, page_size))
                .max()
                .unwrap_or(0),
        }
    }
}

/// Everything one batch bucket needs to replay: layouts, buffers, launches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketPlan {
    pub batch: u32,
    /// `batch * rows_per_request` of its phase.
    pub rows: u32,
    pub arena_bytes: u64,
    /// Constant qo layout: request i owns rows `qo_indptr[i]..qo_indptr[i+1]` (= i·R..(i+1)·R,
    /// R the phase's rows per request).
    pub qo_indptr: Vec<u32>,
    /// KV splits of the attention (fixed per bucket from the static row count).
    pub attn_splits: u32,
    /// The splits run as one thread block cluster per (request, kv head) and merge there
    /// (sm_90+, more than one split): no `attn_merge` launch, no partials.
    pub attn_cluster: bool,
    /// The splits' partials are merged by the last CTA of each (request, kv head) to finish,
    /// found by the runtime's arrival counters (more than one split, no cluster): no
    /// `attn_merge` launch for an instance of at most `ATTN_LAST_CTA_ROWS` rows a CTA.
    pub attn_last_cta: bool,
    pub buffers: Vec<BufferDesc>,
    pub launches: Vec<Launch>,
    pub replay: Replay,
}

/// The whole artifact.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub name: String,
    pub compiler: String,
    pub model: ModelDesc,
    pub spec: SpecDesc,
    pub capture: CaptureDesc,
    pub target: TargetDesc,
    /// RoPE inverse frequencies after scaling, `[head_dim / 2]`, shared by kernels and CPU.
    pub rope_inv_freq: Vec<f32>,
    pub layers: Vec<LayerDesc>,
    pub weights: Vec<WeightDesc>,
    pub weight_bytes: u64,
    pub kernels: Vec<KernelDesc>,
    pub fusions: Vec<FusionRecord>,
    /// The forwards this plan compiles, ascending by kind, one per kind.
    pub phases: Vec<Phase>,
}

impl Plan {
    /// Bytes of one pool page for one layer and one of K/V.
    pub fn kv_page_bytes(&self) -> u64 {
        self.capture.page_size as u64
            * self.model.kv_heads as u64
            * self.model.head_dim as u64
            * self.capture.dtype.size()
    }

    /// Bytes of the whole KV pool (K and V, every layer).
    pub fn kv_pool_bytes(&self) -> u64 {
        2 * self.model.layers as u64 * self.capture.kv_pool_pages as u64 * self.kv_page_bytes()
    }

    /// Rows of the device page table: one per request slot plus the scratch slot.
    pub fn page_table_rows(&self) -> u64 {
        self.capture.max_requests as u64 + 1
    }

    /// Largest arena over every phase's buckets: what the runtime allocates (phases run one
    /// at a time on the stream, so they share it).
    pub fn arena_bytes(&self) -> u64 {
        self.phases
            .iter()
            .flat_map(|ph| &ph.buckets)
            .map(|b| b.arena_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Rows per request of phase `kind` (`PhaseKind::rows_per_request`, which validation
    /// holds every phase's `rows_per_request` to): what the runtimes size a step's rows by.
    pub fn rows_per_request(&self, kind: PhaseKind) -> u32 {
        kind.rows_per_request(&self.spec)
    }

    /// The plan's phase a label names (`PhaseKind::parse`; `draft_decode` alone names the
    /// plan's draft-decode tier when it has exactly one).
    pub fn phase_by_label(&self, label: &str) -> Option<PhaseKind> {
        let mut tiers = self.phases.iter().map(|p| p.kind.steps()).filter(|&s| s > 0);
        let one = match (tiers.next(), tiers.next()) {
            (Some(s), None) => Some(s),
            _ => None,
        };
        PhaseKind::parse(label, one).filter(|k| self.phase(*k).is_some())
    }

    /// The plan's phases' labels, joined by `, ` (for errors).
    pub fn phase_labels(&self) -> String {
        self.phases
            .iter()
            .map(|p| p.kind.label())
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn phase(&self, kind: PhaseKind) -> Option<&Phase> {
        self.phases.iter().find(|p| p.kind == kind)
    }

    /// The draft-extend phase's buckets (empty when the plan has none; a validated plan
    /// always has it).
    pub fn buckets(&self) -> &[BucketPlan] {
        self.phase(PhaseKind::DraftExtend).map_or(&[], |p| &p.buckets[..])
    }

    /// The draft-extend bucket a raw batch of `b` requests replays in.
    pub fn bucket_for(&self, b: u32) -> Option<&BucketPlan> {
        self.phase(PhaseKind::DraftExtend)?.bucket_for(b)
    }

    /// Every phase's buckets counted together (the runtimes' flat bucket indices).
    pub fn bucket_count(&self) -> usize {
        self.phases.iter().map(|p| p.buckets.len()).sum()
    }

    /// Bucket `i` of every phase's buckets in phase order: draft-extend's come first, so
    /// they keep their indices in `buckets()`. O(phases).
    pub fn flat_bucket(&self, i: usize) -> Option<&BucketPlan> {
        self.flat_phase(i).map(|(_, b)| b)
    }

    /// Flat bucket `i` with the kind of its phase. O(phases).
    pub fn flat_phase(&self, mut i: usize) -> Option<(PhaseKind, &BucketPlan)> {
        for ph in &self.phases {
            match ph.buckets.get(i) {
                Some(b) => return Some((ph.kind, b)),
                None => i -= ph.buckets.len(),
            }
        }
        None
    }

    /// The flat index ([`Plan::flat_bucket`]) of phase `kind`'s bucket of exactly `batch`
    /// requests.
    pub fn flat_index(&self, kind: PhaseKind, batch: u32) -> Option<usize> {
        let mut base = 0;
        for ph in &self.phases {
            if ph.kind == kind {
                return ph.buckets.iter().position(|b| b.batch == batch).map(|i| base + i);
            }
            base += ph.buckets.len();
        }
        None
    }

    /// Every phase's buckets, with the phase.
    pub fn all_buckets(&self) -> impl Iterator<Item = (&Phase, &BucketPlan)> {
        self.phases
            .iter()
            .flat_map(|ph| ph.buckets.iter().map(move |b| (ph, b)))
    }
}

impl BucketPlan {
    pub fn buffer(&self, name: &str) -> Option<(u32, &BufferDesc)> {
        self.buffers
            .iter()
            .enumerate()
            .find(|(_, b)| b.name == name)
            .map(|(i, b)| (i as u32, b))
    }
}
