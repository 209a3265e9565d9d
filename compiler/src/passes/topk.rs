//! softmax → top-K (→ id map) fused into the one kernel per request row (or the split
//! kernels: `schedule` picks by the row's length), the refinement's inputs carried along.

use specplan_format::FusionRecord;

use super::{names, nodes_where, remove, row_bytes, sole_consumer, SOFTMAX_TOPK};
use crate::config::Config;
use crate::graph::{Op, OpGraph, OpKind};

/// softmax → top-K (→ hot→full id map) → one kernel per request row.
pub(super) fn softmax_topk(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for s in nodes_where(g, |k| *k == OpKind::Softmax) {
        let probs = g.graph[s].outs[0];
        let Some(t) = sole_consumer(g, probs).filter(|&t| matches!(g.graph[t].kind, OpKind::TopK { .. })) else {
            continue;
        };
        let OpKind::TopK { k, refine } = g.graph[t].kind else {
            continue;
        };
        let idx = g.graph[t].outs[1];
        let map = sole_consumer(g, idx).filter(|&m| matches!(g.graph[m].kind, OpKind::MapIds { .. }));
        let id_map = map.and_then(|m| match g.graph[m].kind {
            OpKind::MapIds { map } => Some(map),
            _ => None,
        });
        let mut ins = vec![g.graph[s].ins[0]];
        let mut outs = vec![g.graph[t].outs[0]];
        let mut fused = vec![s, t];
        match map {
            Some(m) => {
                ins.push(g.graph[m].ins[1]);
                outs.push(g.graph[m].outs[0]);
                fused.push(m);
            }
            None => outs.push(idx),
        }
        // The refinement's inputs follow.
        ins.extend_from_slice(&g.graph[t].ins[1..]);
        let op = Op {
            name: g.graph[s].renamed("softmax", SOFTMAX_TOPK),
            kind: OpKind::SoftmaxTopK { k, map: id_map, refine },
            ins,
            outs,
            rank: g.graph[s].rank,
        };
        out.push(FusionRecord {
            rule: SOFTMAX_TOPK.into(),
            fused: names(g, &fused),
            into: op.name.clone(),
            launches_saved: fused.len() as u32 - 1,
            bytes_saved_per_request: 2 * row_bytes(g, probs),
        });
        remove(g, &fused);
        g.add_op(op);
    }
    out
}
