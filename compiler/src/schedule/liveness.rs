//! Step 1 of scheduling: live ranges over the op order, per arena tensor and workspace.

use std::collections::BTreeMap;

use petgraph::stable_graph::NodeIndex;
use specplan_format::{BufferRole, DType};

use super::{attn_cluster, Shared};
use crate::graph::{OpKind, Storage, TensorId};

/// A buffer to place: what it holds and when it is live (op positions, 1-based; 0 and
/// `ops + 1` stand for host prep before the step and the caller after it).
pub(super) struct Item {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub role: BufferRole,
    pub first: usize,
    pub last: usize,
}

impl Item {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size()
    }
}

/// The workspaces of one op (indices into `items`).
#[derive(Clone, Copy)]
pub(super) enum Workspace {
    /// Split-KV partials of an attention: (part_o, part_lse).
    Attention(u32, u32),
    /// Per-chunk records of a split top-K.
    TopK(u32),
}

pub(super) struct Live {
    pub items: Vec<Item>,
    /// Buffer index of each arena tensor (by alias root).
    pub buf_of: BTreeMap<TensorId, u32>,
    pub workspace: BTreeMap<NodeIndex, Workspace>,
}

pub(super) fn live_ranges(sh: &Shared, batch: u32, splits: u32) -> Live {
    let g = sh.g;
    let bb = batch as u64;
    let steps = sh.order.len();
    let mut range: BTreeMap<TensorId, (usize, usize)> = BTreeMap::new();
    for (s, &node) in sh.order.iter().enumerate() {
        let op = &g.graph[node];
        for &t in op.ins.iter().chain(op.outs.iter()) {
            let r = g.root(t);
            if matches!(g.tensor(r).storage, Storage::Input | Storage::Activation { .. }) {
                let e = range.entry(r).or_insert((s + 1, s + 1));
                e.0 = e.0.min(s + 1);
                e.1 = e.1.max(s + 1);
            }
        }
    }
    // A scratch alias class holding an output is that output's buffer (its name and role):
    // the head's hidden_out is accumulated in place over the selected rows. (An input's
    // class stays the input.)
    let mut output_of: BTreeMap<TensorId, TensorId> = BTreeMap::new();
    for i in 0..g.tensors.len() as u32 {
        let t = TensorId(i);
        let r = g.root(t);
        let scratch = g.tensor(r).storage == (Storage::Activation { output: false });
        if scratch && g.tensor(t).storage == (Storage::Activation { output: true }) {
            output_of.insert(r, t);
        }
    }
    // In tensor-id order, for stable buffer ids.
    let mut items = Vec::new();
    let mut buf_of = BTreeMap::new();
    for (&t, &(first, last)) in &range {
        let tensor = g.tensor(output_of.get(&t).copied().unwrap_or(t));
        let role = match tensor.storage {
            Storage::Input => BufferRole::Input,
            Storage::Activation { output: true } => BufferRole::Output,
            _ => BufferRole::Scratch,
        };
        // Inputs stay reserved for the whole step: host prep for the next step may copy
        // into them while the caller still holds this step's outputs on the device.
        let (first, last) = match role {
            BufferRole::Input => (0, steps + 1),
            BufferRole::Output => (first, steps + 1),
            BufferRole::Scratch => (first, last),
        };
        buf_of.insert(t, items.len() as u32);
        items.push(Item {
            name: tensor.name.clone(),
            dtype: tensor.dtype,
            shape: tensor.shape.iter().map(|d| d.at(bb)).collect(),
            role,
            first,
            last,
        });
    }
    let workspace = workspaces(sh, &mut items, batch, splits);
    Live {
        items,
        buf_of,
        workspace,
    }
}

/// Workspaces live only during their op: split-KV partials of each attention (when the
/// bucket splits) and per-chunk records of a split top-K.
fn workspaces(sh: &Shared, items: &mut Vec<Item>, batch: u32, splits: u32) -> BTreeMap<NodeIndex, Workspace> {
    let (f, bb) = (sh.facts, batch as u64);
    let rows = bb * f.n as u64;
    // The head's rows: one per request, or every lane of a draft-decode forward.
    let head_rows = if f.lanes > 0 { rows } else { bb };
    let chunks = f.topk_chunks_for(head_rows as u32);
    // Splits merged in their cluster need no partials (`attn_cluster`).
    let partials = splits > 1 && !attn_cluster(sh, splits);
    let mut ws = BTreeMap::new();
    let scratch = |items: &mut Vec<Item>, name: String, shape: Vec<u64>, s: usize| {
        items.push(Item {
            name,
            dtype: DType::F32,
            shape,
            role: BufferRole::Scratch,
            first: s + 1,
            last: s + 1,
        });
        items.len() as u32 - 1
    };
    for (s, &node) in sh.order.iter().enumerate() {
        let op = &sh.g.graph[node];
        // Named after the op (`l0.`, or a multi-step phase's `s1.l0.`).
        match op.kind {
            OpKind::Attention { .. } if partials => {
                let hd = (f.heads * f.head_dim) as u64;
                // The instance's query rows: its output's (one a request over the selected
                // queries).
                let rows = sh.g.tensor(op.outs[0]).shape[0].at(bb);
                let o = scratch(
                    items,
                    op.renamed("attention", "attn_part_o"),
                    vec![splits as u64, rows, hd],
                    s,
                );
                let l = scratch(
                    items,
                    op.renamed("attention", "attn_part_lse"),
                    vec![splits as u64, rows, f.heads as u64],
                    s,
                );
                ws.insert(node, Workspace::Attention(o, l));
            }
            OpKind::SoftmaxTopK { .. } if chunks > 1 => {
                let rec = specplan_kernels::facts::topk_record_floats(f.topk_cands()) as u64;
                let name = op.renamed(specplan_format::Entry::SoftmaxTopk.name(), "topk_part");
                let p = scratch(items, name, vec![head_rows, chunks as u64, rec], s);
                ws.insert(node, Workspace::TopK(p));
            }
            _ => {}
        }
    }
    ws
}
