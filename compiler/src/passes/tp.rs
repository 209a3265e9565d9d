//! Tensor-parallel fusion: the residual add folded into the row-parallel GEMM and its
//! all-reduce (docs/tensor-parallel.md).

use specplan_format::FusionRecord;

use super::{names, plain_linear, remove, row_bytes, rows_per_request, sole_consumer};
use crate::config::Config;
use crate::graph::{OpGraph, OpKind};

/// `x + all_reduce(linear(y))` → rank 0's GEMM accumulates into x (β = 1), every other
/// rank's GEMM overwrites its copy of x (β = 0), and the all-reduce sums them in place:
/// `x + Σ_r y_r·W_rᵀ` on every rank (the ranks' x are equal: each is the previous
/// all-reduce's result or replicated math), with no add launch and no partial buffer.
/// Matches under the conditions of `residual_into_gemm`: every other reader of x runs
/// before the GEMM, so overwriting x is unobservable.
pub(super) fn residual_into_all_reduce(g: &mut OpGraph, cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    let tp = cfg.capture.tp;
    for a in super::nodes_where(g, |k| *k == OpKind::Add) {
        let (x, y) = (g.graph[a].ins[0], g.graph[a].ins[1]);
        let Some(r) = g
            .producer(y)
            .filter(|&n| g.graph[n].kind == OpKind::AllReduce && sole_consumer(g, y) == Some(a))
        else {
            continue;
        };
        let p = g.graph[r].ins[0];
        let Some(l) = plain_linear(g, g.producer(p)).filter(|_| sole_consumer(g, p) == Some(r)) else {
            continue;
        };
        if !super::residual_in_place(g, a, x, p, l) {
            continue;
        }
        let sum = g.graph[a].outs[0];
        g.tensors[p.0 as usize].alias_of = Some(x);
        g.tensors[sum.0 as usize].alias_of = Some(p);
        let bytes = 2 * row_bytes(g, y) * rows_per_request(g, y);
        out.push(FusionRecord {
            rule: "residual_into_all_reduce".into(),
            fused: names(g, &[l, r, a]),
            into: format!("{} + {}", g.graph[l].name, g.graph[r].name),
            launches_saved: 1,
            bytes_saved_per_request: bytes,
        });
        let accumulate = tp.rank == 0;
        // Rank > 0 does not read x: where nothing else does, its producer (the last layer's
        // select_norm) stops writing it.
        if !accumulate && g.consumers(x).len() == 1 {
            if let Some(s) = g.producer(x).filter(|&s| g.graph[s].kind == OpKind::SelectNorm) {
                g.graph[s].outs.retain(|&t| t != x);
            }
        }
        let op = &mut g.graph[l];
        op.kind = OpKind::Linear {
            bias: false,
            accumulate,
        };
        if accumulate {
            op.ins.push(x);
        }
        g.graph[r].outs = vec![sum];
        remove(g, &[a]);
    }
    out
}
