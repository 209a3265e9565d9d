//! The selected rows and their norm in one kernel (the draft-extend head's last layer).

use petgraph::stable_graph::NodeIndex;
use specplan_format::FusionRecord;

use super::{names, nodes_where, remove, row_bytes, SELECT_NORM};
use crate::config::Config;
use crate::graph::{Op, OpGraph, OpKind};

/// The selected rows and an RMSNorm of them → one kernel (`select_norm`) writing both: in
/// the draft-extend head's last layer the rows past the attention and their post-attention
/// norm (the MLP's input; the pre-norm rows are its residual). Other readers of the
/// selected rows read them after the fused kernel wrote them.
pub(super) fn select_norm(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for s in nodes_where(g, |k| *k == OpKind::SelectRows) {
        let sel = g.graph[s].outs[0];
        let norms: Vec<NodeIndex> = g
            .consumers(sel)
            .into_iter()
            .filter(|&n| g.graph[n].kind == OpKind::RmsNorm && g.graph[n].ins[0] == sel)
            .collect();
        let [n] = norms[..] else {
            continue;
        };
        let op = Op {
            name: SELECT_NORM.into(),
            kind: OpKind::SelectNorm,
            ins: vec![g.graph[s].ins[0], g.graph[s].ins[1], g.graph[n].ins[1]],
            outs: vec![sel, g.graph[n].outs[0]],
            rank: g.graph[s].rank,
        };
        out.push(FusionRecord {
            rule: SELECT_NORM.into(),
            fused: names(g, &[s, n]),
            into: op.name.clone(),
            launches_saved: 1,
            bytes_saved_per_request: row_bytes(g, sel),
        });
        remove(g, &[s, n]);
        g.add_op(op);
    }
    out
}
