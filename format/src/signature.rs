//! Each phase's signature: the one declaration of the tensors a forward exchanges with its
//! caller — name, dtype, shape in terms of the batch, role and when it exists. Everything
//! else derives from it: validation checks a bucket's I/O buffers against it, the runtimes
//! stage inputs and copy outputs by it, admission and the run contract check the caller's
//! tensors by it, and the Python runner checks its arguments by it (`Plan.signature`). The
//! names are spelled once, in `specplan_kernels::io` (the kernels' argument declarations
//! bind to them); a tidy test keeps every other file from spelling them.

use crate::types::{BufferRole, CaptureDesc, HeadOutputs, ModelDesc, PhaseKind, Plan, SpecDesc};
use specplan_kernels::{io, DType};

/// A size in a tensor's shape, in terms of the bucket and the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    /// Requests of the step (the bucket's batch, or the caller's `b`).
    Requests,
    /// Rows of the forward: requests × the phase's rows per request.
    Rows,
    /// Width of an input hidden row (`ModelDesc::hidden_in`).
    HiddenIn,
    /// The draft model's hidden size.
    Hidden,
    /// Candidates per request (`spec.topk`).
    TopK,
    /// Columns of a logits row (`logits_cols`).
    LogitsCols,
    /// Layers of the draft model.
    Layers,
    /// Pages of the KV pool.
    PoolPages,
    /// Tokens per page.
    PageSize,
    KvHeads,
    HeadDim,
    /// Request slots of the page table (the scratch slot included).
    TableRows,
    /// Columns of the page table.
    TableCols,
    /// Draft decode: width of `parent_list`, `(S−1)·K + 1`.
    ParentWidth,
    /// Draft decode: the tree's drafted nodes, N − 1.
    TreeNodes,
    /// Draft decode: the verified tree's nodes with its root (the bonus token), N.
    TreeSize,
}

/// A tensor's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeRule {
    Exact(DType),
    /// The plan's activation type (`capture.dtype`).
    Activation,
}

/// Who owns a tensor and who writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The engine's memory, registered once and used in place (the KV pools, the page table).
    Engine,
    /// Written into the bucket's input buffer before every replay (by host prep, or by the
    /// device's `admit` from the caller's tensor).
    Staged,
    /// Read by the caller after a replay (copied out by `emit`, or read from the arena).
    Output,
}

/// When a tensor is part of the signature.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    Always,
    /// The plan emits the fused top-K (`capture.outputs` has `topk`).
    TopK,
    /// The plan emits the selected rows' logits (`capture.outputs` has `logits`).
    Logits,
    /// Draft decode emits the verify inputs (`capture.decode_verify`).
    DecodeVerify,
}

impl When {
    pub fn holds(self, c: &CaptureDesc) -> bool {
        match self {
            When::Always => true,
            When::TopK => c.outputs.topk,
            When::Logits => c.outputs.logits,
            When::DecodeVerify => c.decode_verify,
        }
    }
}

/// One declared tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    pub name: &'static str,
    pub dtype: DTypeRule,
    pub shape: &'static [Dim],
    pub role: Role,
    pub when: When,
    /// One line for people (`specplan show`, docs, Python's errors).
    pub doc: &'static str,
}

use Dim::*;

const fn decl(
    name: &'static str,
    dtype: DTypeRule,
    shape: &'static [Dim],
    role: Role,
    when: When,
    doc: &'static str,
) -> TensorDecl {
    TensorDecl {
        name,
        dtype,
        shape,
        role,
        when,
        doc,
    }
}

const I32: DTypeRule = DTypeRule::Exact(DType::I32);
const I64: DTypeRule = DTypeRule::Exact(DType::I64);
const F32: DTypeRule = DTypeRule::Exact(DType::F32);
const ACT: DTypeRule = DTypeRule::Activation;

/// The draft-extend forward: inputs in staging order, then outputs in emit order.
pub const DRAFT_EXTEND: &[TensorDecl] = &[
    decl(
        io::K_CACHE,
        ACT,
        &[Layers, PoolPages, PageSize, KvHeads, HeadDim],
        Role::Engine,
        When::Always,
        "K pool of every layer (any registered layout)",
    ),
    decl(
        io::V_CACHE,
        ACT,
        &[Layers, PoolPages, PageSize, KvHeads, HeadDim],
        Role::Engine,
        When::Always,
        "V pool of every layer (any registered layout)",
    ),
    decl(
        io::PAGE_TABLE,
        I32,
        &[TableRows, TableCols],
        Role::Engine,
        When::Always,
        "request slot -> page (or token slot) per position",
    ),
    decl(
        io::INPUT_IDS,
        I64,
        &[Rows],
        Role::Staged,
        When::Always,
        "the N verified token ids per request (int32 accepted from engines)",
    ),
    decl(
        io::HIDDEN_STATES,
        ACT,
        &[Rows, HiddenIn],
        Role::Staged,
        When::Always,
        "the target's hidden states of those rows (EAGLE-3: three layers concatenated)",
    ),
    decl(
        io::PREFIX_LENS,
        I32,
        &[Requests],
        Role::Staged,
        When::Always,
        "L: tokens cached before this step's rows",
    ),
    decl(
        io::ACCEPT_LENS,
        I32,
        &[Requests],
        Role::Staged,
        When::Always,
        "A in [1, N]: the row whose outputs are emitted is L + A - 1",
    ),
    decl(
        io::REQ_SLOTS,
        I32,
        &[Requests],
        Role::Staged,
        When::Always,
        "the request's row of the page table",
    ),
    decl(
        io::HIDDEN_OUT,
        ACT,
        &[Requests, Hidden],
        Role::Output,
        When::Always,
        "the selected row's hidden state (EAGLE-3: before the final norm)",
    ),
    decl(
        io::TOPK_PROBS,
        F32,
        &[Requests, TopK],
        Role::Output,
        When::TopK,
        "softmax probabilities of the top-K, descending",
    ),
    decl(
        io::TOPK_IDS,
        I64,
        &[Requests, TopK],
        Role::Output,
        When::TopK,
        "their ids (target ids, or lm_head rows with topk-draft)",
    ),
    decl(
        io::LOGITS,
        F32,
        &[Requests, LogitsCols],
        Role::Output,
        When::Logits,
        "the selected row's logits over the lm_head's rows, unmapped",
    ),
];

/// The draft-decode forwards (SGLang 0.5.23's draft-decode slot): the draft-extend step's
/// top-K and hidden row in, the tree out.
pub const DRAFT_DECODE: &[TensorDecl] = &[
    DRAFT_EXTEND[0],
    DRAFT_EXTEND[1],
    DRAFT_EXTEND[2],
    decl(
        io::TOPK_PROBS,
        F32,
        &[Requests, TopK],
        Role::Staged,
        When::Always,
        "draft-extend's top-K probabilities, descending (the root's children's scores)",
    ),
    decl(
        io::TOPK_IDS,
        I64,
        &[Requests, TopK],
        Role::Staged,
        When::Always,
        "their ids in the target vocabulary (mapped once, before this phase)",
    ),
    decl(
        io::HIDDEN_STATES,
        ACT,
        &[Requests, Hidden],
        Role::Staged,
        When::Always,
        "draft-extend's hidden row (EAGLE-3: before the final norm)",
    ),
    decl(
        io::PREFIX_LENS,
        I32,
        &[Requests],
        Role::Staged,
        When::Always,
        "L: committed tokens; forward i runs at position L + i",
    ),
    decl(
        io::REQ_SLOTS,
        I32,
        &[Requests],
        Role::Staged,
        When::Always,
        "the request's row of the page table",
    ),
    decl(
        io::BONUS_TOKENS,
        I64,
        &[Requests],
        Role::Staged,
        When::DecodeVerify,
        "the verified bonus token at position L: the tree's root",
    ),
    decl(
        io::PARENT_LIST,
        I64,
        &[Requests, ParentWidth],
        Role::Output,
        When::Always,
        "score index of each node block's parent (-1: the root), as SGLang's",
    ),
    decl(
        io::TOP_SCORES_INDEX,
        I64,
        &[Requests, TreeNodes],
        Role::Output,
        When::Always,
        "the N-1 best path scores' indices, ascending",
    ),
    decl(
        io::DRAFT_TOKENS,
        I64,
        &[Requests, TreeNodes],
        Role::Output,
        When::Always,
        "their tokens, target ids",
    ),
    decl(
        io::VERIFY_TOKENS,
        I64,
        &[Requests, TreeSize],
        Role::Output,
        When::DecodeVerify,
        "the tree's nodes for the target's verify: the bonus root, then draft_tokens",
    ),
    decl(
        io::VERIFY_POSITIONS,
        I64,
        &[Requests, TreeSize],
        Role::Output,
        When::DecodeVerify,
        "each node's position, L + its depth",
    ),
    decl(
        io::RETRIEVE_INDEX,
        I64,
        &[Requests, TreeSize],
        Role::Output,
        When::DecodeVerify,
        "each node's row in the flattened verify batch, r*N + j",
    ),
    decl(
        io::RETRIEVE_NEXT_TOKEN,
        I64,
        &[Requests, TreeSize],
        Role::Output,
        When::DecodeVerify,
        "each node's first child (the lowest node index), -1: a leaf",
    ),
    decl(
        io::RETRIEVE_NEXT_SIBLING,
        I64,
        &[Requests, TreeSize],
        Role::Output,
        When::DecodeVerify,
        "each node's next sibling (the next higher node index), -1: the last",
    ),
    decl(
        io::TREE_MASK,
        I32,
        &[Requests, TreeSize, TreeSize],
        Role::Output,
        When::DecodeVerify,
        "1 where node j (row) attends node j' (column): itself and its ancestors",
    ),
];

/// The declaration of a phase kind.
pub fn declared(kind: PhaseKind) -> &'static [TensorDecl] {
    match kind {
        PhaseKind::DraftExtend => DRAFT_EXTEND,
        PhaseKind::DraftDecode { .. } => DRAFT_DECODE,
    }
}

/// Every tensor name any phase declares.
pub fn all_names() -> impl Iterator<Item = &'static str> {
    [DRAFT_EXTEND, DRAFT_DECODE]
        .into_iter()
        .flat_map(|d| d.iter().map(|d| d.name))
}

/// One tensor of the signature resolved for a plan and a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoTensor {
    pub name: &'static str,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub role: BufferRole,
}

/// A declared tensor resolved for a plan, a phase and `batch` requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub decl: TensorDecl,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

/// The plan facts a signature resolves against (the compiler has them before it has a plan).
#[derive(Clone, Copy, Debug)]
pub struct Facts<'a> {
    pub model: &'a ModelDesc,
    pub spec: &'a SpecDesc,
    pub capture: &'a CaptureDesc,
}

impl<'a> Facts<'a> {
    pub fn of(p: &'a Plan) -> Facts<'a> {
        Facts {
            model: &p.model,
            spec: &p.spec,
            capture: &p.capture,
        }
    }

    /// The size `d` stands for at `batch` requests of phase `kind`.
    pub fn dim(&self, kind: PhaseKind, batch: u32, d: Dim) -> u64 {
        let (m, c) = (self.model, self.capture);
        match d {
            Requests => batch as u64,
            Rows => batch as u64 * kind.rows_per_request(self.spec) as u64,
            ParentWidth => specplan_kernels::facts::parent_width(self.spec.topk, kind.steps()),
            TreeNodes => kind.draft_tokens(self.spec).saturating_sub(1) as u64,
            TreeSize => kind.draft_tokens(self.spec) as u64,
            HiddenIn => m.hidden_in() as u64,
            Hidden => m.hidden as u64,
            TopK => self.spec.topk as u64,
            LogitsCols => c.hot_vocab_size.unwrap_or(m.lm_vocab()) as u64,
            Layers => m.layers as u64,
            PoolPages => c.kv_pool_pages as u64,
            PageSize => c.page_size as u64,
            KvHeads => m.kv_heads as u64,
            HeadDim => m.head_dim as u64,
            TableRows => c.max_requests as u64 + 1,
            TableCols => c.max_pages_per_request as u64,
        }
    }

    /// The tensors of phase `kind` that exist under these facts (by `capture.outputs`),
    /// resolved at `batch` requests, in declaration order.
    pub fn resolve(&self, kind: PhaseKind, batch: u32) -> Vec<Resolved> {
        declared(kind)
            .iter()
            .filter(|d| d.when.holds(self.capture))
            .map(|d| Resolved {
                decl: *d,
                dtype: match d.dtype {
                    DTypeRule::Exact(t) => t,
                    DTypeRule::Activation => self.capture.dtype,
                },
                shape: d.shape.iter().map(|&x| self.dim(kind, batch, x)).collect(),
            })
            .collect()
    }
}

/// [`Facts::resolve`] for a plan.
pub fn resolve(p: &Plan, kind: PhaseKind, batch: u32) -> Vec<Resolved> {
    Facts::of(p).resolve(kind, batch)
}

/// The bucket buffers of phase `kind` at `batch` (its staged inputs, then its outputs).
pub fn phase_io(p: &Plan, kind: PhaseKind, batch: u32) -> Vec<IoTensor> {
    resolve(p, kind, batch)
        .into_iter()
        .filter_map(|r| {
            let role = match r.decl.role {
                Role::Engine => return None,
                Role::Staged => BufferRole::Input,
                Role::Output => BufferRole::Output,
            };
            Some(IoTensor {
                name: r.decl.name,
                dtype: r.dtype,
                shape: r.shape,
                role,
            })
        })
        .collect()
}

/// The draft-extend bucket's buffers at `batch`.
pub fn bucket_io(p: &Plan, batch: u32) -> Vec<IoTensor> {
    phase_io(p, PhaseKind::DraftExtend, batch)
}

/// Columns of the `logits` output: the lm_head's rows (the hot vocabulary under FR-Spec,
/// else the draft vocabulary of an EAGLE-3 head, else the vocabulary).
pub fn logits_cols(p: &Plan) -> u32 {
    p.capture.hot_vocab_size.unwrap_or(p.model.lm_vocab())
}

/// Whether `name` is an output of a draft-extend plan with these head outputs.
pub fn is_output(outputs: HeadOutputs, name: &str) -> bool {
    DRAFT_EXTEND.iter().any(|d| {
        d.name == name
            && d.role == Role::Output
            && match d.when {
                When::Always => true,
                When::TopK => outputs.topk,
                When::Logits => outputs.logits,
                When::DecodeVerify => false,
            }
    })
}

/// The declared output names of the draft-extend phase, in emit order (all of them; see
/// [`is_output`] for a plan's).
pub fn output_names() -> impl Iterator<Item = &'static str> {
    DRAFT_EXTEND.iter().filter(|d| d.role == Role::Output).map(|d| d.name)
}

/// The declared staged input names of the draft-extend phase, in staging order.
pub fn input_names() -> impl Iterator<Item = &'static str> {
    DRAFT_EXTEND.iter().filter(|d| d.role == Role::Staged).map(|d| d.name)
}

/// `name dtype[dims] role` for people: `specplan show`, docs and error messages.
pub fn describe(p: &Plan, kind: PhaseKind) -> Vec<String> {
    resolve(p, kind, 1)
        .into_iter()
        .map(|r| {
            let dims: Vec<String> = r.decl.shape.iter().map(|d| dim_name(*d).to_string()).collect();
            format!(
                "{}:{}[{}]:{}",
                r.decl.name,
                r.dtype.name(),
                dims.join(","),
                match r.decl.role {
                    Role::Engine => "engine",
                    Role::Staged => "staged",
                    Role::Output => "output",
                }
            )
        })
        .collect()
}

/// The symbol of a dimension in [`describe`]'s text.
pub fn dim_name(d: Dim) -> &'static str {
    match d {
        Requests => "b",
        Rows => "rows",
        HiddenIn => "hidden_in",
        Hidden => "hidden",
        TopK => "topk",
        LogitsCols => "cols",
        Layers => "layers",
        PoolPages => "pages",
        PageSize => "page",
        KvHeads => "kv_heads",
        HeadDim => "head_dim",
        TableRows => "table_rows",
        TableCols => "table_cols",
        ParentWidth => "parents",
        TreeNodes => "nodes",
        TreeSize => "tree",
    }
}
