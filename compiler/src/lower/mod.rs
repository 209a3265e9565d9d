//! Stage 2: [`Config`] → unfused [`OpGraph`] of one phase's forward.
//!
//! The graph states the semantics op by op, as `docs/semantics.md` writes them; nothing here
//! is fused (`passes` does that). One file per phase wires the reusable builders of
//! `blocks.rs` (embedding, the head's input, decoder layers, output head) to the phase's
//! signature: `draft_extend.rs` today. Every tensor has `R·B` rows (R the phase's rows per
//! request, `PhaseKind::rows_per_request`) or `B` rows.

mod blocks;
mod draft_decode;
mod draft_extend;

use specplan_format::signature::{self, Dim as SigDim, Role};
use specplan_format::{DType, Packing, PhaseKind};

use blocks::{eagle3_input, embed, fc, fc3, hidden_out, lane_head, layer, output_head};

use crate::config::Config;
use crate::graph::{Dim, Op, OpGraph, OpKind, Storage, Tensor, TensorId};
use crate::verify::VerifyError;

/// Builds the unfused op graph of phase `kind`.
pub fn lower(cfg: &Config, kind: PhaseKind) -> Result<OpGraph, VerifyError> {
    match kind {
        PhaseKind::DraftExtend => draft_extend::lower(cfg),
        PhaseKind::DraftDecode { steps } => draft_decode::lower(cfg, steps),
    }
}

/// What every builder of one phase shares: the config and the phase's two batch dimensions.
pub(crate) struct Cx<'a> {
    pub cfg: &'a Config,
    pub kind: PhaseKind,
    /// `R·B`: one row per (request, row of the phase).
    pub rows: Dim,
    /// `B`: one row per request.
    pub requests: Dim,
    /// The forward of a multi-step phase being built (0 otherwise).
    pub step: u32,
    /// The residual stream's dtype (`specplan_format::facts::stream_dtype`, the rule the
    /// kernels' facts follow).
    pub stream: DType,
}

impl<'a> Cx<'a> {
    pub fn new(cfg: &'a Config, kind: PhaseKind) -> Cx<'a> {
        Cx {
            cfg,
            kind,
            rows: Dim::batch(kind.rows_per_request(&cfg.spec) as u64),
            requests: Dim::batch(1),
            step: 0,
            stream: specplan_format::stream_dtype(kind, cfg.capture.dtype, cfg.capture.tp),
        }
    }

    /// The prefix of the names of forward `step`'s ops and tensors: none for a one-forward
    /// phase, `s1.` for a multi-step phase's second forward.
    pub fn pfx(&self) -> String {
        if matches!(self.kind, PhaseKind::DraftDecode { .. }) {
            format!("s{}.", self.step)
        } else {
            String::new()
        }
    }

    /// `name` with [`Cx::pfx`].
    pub fn n(&self, name: &str) -> String {
        format!("{}{name}", self.pfx())
    }

    /// A signature dimension as a graph dimension (per-batch for requests and rows, else
    /// fixed at the plan's size).
    fn dim(&self, d: SigDim, fixed: u64) -> Dim {
        match d {
            SigDim::Requests => self.requests,
            SigDim::Rows => self.rows,
            _ => Dim::fixed(fixed),
        }
    }
}

/// One forward's token ids and hidden rows, and the tensors outside the arena every layer
/// uses.
pub(crate) struct Inputs {
    pub ids: TensorId,
    pub hidden: TensorId,
    pub prefix: TensorId,
    pub slots: TensorId,
    pub pages: TensorId,
}

/// The staged input `name` of a phase's graph inputs.
fn staged(staged: &[(&'static str, TensorId)], kind: PhaseKind, name: &str) -> Result<TensorId, VerifyError> {
    staged.iter().find(|(n, _)| *n == name).map(|x| x.1).ok_or_else(|| {
        VerifyError(vec![format!(
            "the {} signature declares no input {name} (a compiler bug)",
            kind.name()
        )])
    })
}

/// The phase signature's staged inputs as graph inputs, by name (shapes and dtypes are the
/// signature's, resolved for the config), plus the page table.
fn staged_inputs(g: &mut Builder, cx: &Cx) -> Vec<(&'static str, TensorId)> {
    let d = crate::descs(cx.cfg);
    let facts = signature::Facts {
        model: &d.model,
        spec: &d.spec,
        capture: &d.capture,
    };
    let resolved = facts.resolve(cx.kind, 1);
    // Staged inputs first, then the page table (the order tensors are made in is the order
    // the scheduler meets them).
    let staged = resolved.iter().filter(|r| r.decl.role == Role::Staged);
    let table = resolved
        .iter()
        .filter(|r| r.decl.role == Role::Engine && r.decl.name == specplan_format::io::PAGE_TABLE);
    let mut out = Vec::new();
    for r in staged.chain(table) {
        let shape: Vec<Dim> = r.decl.shape.iter().zip(&r.shape).map(|(d, &n)| cx.dim(*d, n)).collect();
        let storage = match r.decl.role {
            Role::Staged => Storage::Input,
            _ => Storage::PageTable,
        };
        out.push((r.decl.name, g.tensor(r.decl.name, r.dtype, shape, storage)));
    }
    out
}

pub(crate) struct Builder {
    pub g: OpGraph,
    rank: u32,
    /// Each layer's K and V pools as the last append left them.
    pub kv: std::collections::BTreeMap<u32, (TensorId, TensorId)>,
}

impl Builder {
    pub(crate) fn new() -> Builder {
        Builder {
            g: OpGraph::default(),
            rank: 0,
            kv: Default::default(),
        }
    }
    pub(crate) fn tensor(&mut self, name: &str, dtype: DType, shape: Vec<Dim>, storage: Storage) -> TensorId {
        // A weight is one tensor however many forwards of the phase read it.
        if matches!(storage, Storage::Weight { .. }) {
            if let Some(i) = self
                .g
                .tensors
                .iter()
                .position(|t| t.name == name && t.storage == storage)
            {
                return TensorId(i as u32);
            }
        }
        self.g.add_tensor(Tensor {
            name: name.into(),
            dtype,
            shape,
            storage,
            alias_of: None,
        })
    }
    pub(crate) fn act(&mut self, name: &str, dtype: DType, shape: Vec<Dim>) -> TensorId {
        self.tensor(name, dtype, shape, Storage::Activation { output: false })
    }
    pub(crate) fn output(&mut self, name: &str, dtype: DType, shape: Vec<Dim>) -> TensorId {
        self.tensor(name, dtype, shape, Storage::Activation { output: true })
    }
    /// A weight named `name` in the plan, read from the file tensor `source` (whole, or
    /// its first rows with `Packing::LeadingRows`).
    pub(crate) fn weight_from(
        &mut self,
        name: &str,
        source: &str,
        packing: Packing,
        dtype: DType,
        shape: Vec<Dim>,
    ) -> TensorId {
        let storage = Storage::Weight {
            sources: vec![source.to_string()],
            packing,
            shard: Vec::new(),
        };
        self.tensor(name, dtype, shape, storage)
    }
    pub(crate) fn weight(&mut self, name: &str, dtype: DType, shape: Vec<Dim>) -> TensorId {
        let storage = Storage::Weight {
            sources: vec![name.to_string()],
            packing: Packing::Single,
            shard: Vec::new(),
        };
        self.tensor(name, dtype, shape, storage)
    }
    /// Makes weight `t` the rank's part of `parts` equal parts along `axis` of its full
    /// tensors (`TensorParallel::part_index`; one part: whole on every rank). Nothing in an
    /// unsharded plan, which names no shard.
    pub(crate) fn shard(
        &mut self,
        t: TensorId,
        axis: u32,
        tp: specplan_format::TensorParallel,
        parts: u32,
    ) -> TensorId {
        if tp.is_sharded() {
            if let Storage::Weight { shard, .. } = &mut self.g.tensors[t.0 as usize].storage {
                *shard = vec![specplan_format::Shard {
                    axis,
                    parts,
                    index: tp.part_index(parts),
                }];
            }
        }
        t
    }
    pub(crate) fn op(&mut self, name: &str, kind: OpKind, ins: Vec<TensorId>, outs: Vec<TensorId>) {
        self.rank += 1;
        self.g.add_op(Op {
            name: name.into(),
            kind,
            ins,
            outs,
            rank: self.rank,
        });
    }
    pub(crate) fn linear(&mut self, name: &str, a: TensorId, w: TensorId, bias: Option<TensorId>, out: TensorId) {
        let mut ins = vec![a, w];
        ins.extend(bias);
        self.op(
            name,
            OpKind::Linear {
                bias: bias.is_some(),
                accumulate: false,
            },
            ins,
            vec![out],
        );
    }
}
