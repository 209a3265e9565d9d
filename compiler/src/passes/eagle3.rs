//! The EAGLE-3 head's fusions: its layer-0 input (two RMSNorms and a concat around the
//! embedding) and its output (the selected rows and their final norm).

use specplan_format::FusionRecord;

use super::{names, nodes_where, remove, row_bytes, sole_consumer, EMBED_NORM_CONCAT, SELECT_NORM};
use crate::config::Config;
use crate::graph::{Op, OpGraph, OpKind};

/// EAGLE-3: `concat(rmsnorm(embed(ids)), rmsnorm(h))` → one kernel (`embed_norm_concat`)
/// reading the embedding row and the fc output row and writing the layer's 2H-wide input.
pub(super) fn embed_norm_concat(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for e in nodes_where(g, |k| *k == OpKind::Embed) {
        let emb = g.graph[e].outs[0];
        let Some(ne) = sole_consumer(g, emb).filter(|&n| g.graph[n].kind == OpKind::RmsNorm) else {
            continue;
        };
        let en = g.graph[ne].outs[0];
        let Some(c) = sole_consumer(g, en).filter(|&c| g.graph[c].kind == OpKind::Concat && g.graph[c].ins[0] == en)
        else {
            continue;
        };
        let hn = g.graph[c].ins[1];
        let Some(nh) = g
            .producer(hn)
            .filter(|&n| g.graph[n].kind == OpKind::RmsNorm && sole_consumer(g, hn) == Some(c))
        else {
            continue;
        };
        let op = Op {
            name: g.graph[e].renamed("embed", EMBED_NORM_CONCAT),
            kind: OpKind::EmbedNormConcat,
            ins: vec![
                g.graph[e].ins[0],
                g.graph[e].ins[1],
                g.graph[ne].ins[1],
                g.graph[nh].ins[0],
                g.graph[nh].ins[1],
            ],
            outs: g.graph[c].outs.clone(),
            rank: g.graph[e].rank,
        };
        let rows = super::rows_per_request(g, emb);
        out.push(FusionRecord {
            rule: EMBED_NORM_CONCAT.into(),
            fused: names(g, &[e, ne, nh, c]),
            into: op.name.clone(),
            launches_saved: 3,
            bytes_saved_per_request: 6 * row_bytes(g, emb) * rows,
        });
        remove(g, &[e, ne, nh, c]);
        g.add_op(op);
    }
    out
}

/// EAGLE-3: the selected rows and their final RMSNorm → one kernel (`select_norm`) writing
/// both (the pre-norm row leaves the head; the normed one feeds lm_head).
pub(super) fn select_norm(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for s in nodes_where(g, |k| *k == OpKind::SelectRows) {
        let sel = g.graph[s].outs[0];
        let Some(n) = sole_consumer(g, sel).filter(|&n| g.graph[n].kind == OpKind::RmsNorm) else {
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
