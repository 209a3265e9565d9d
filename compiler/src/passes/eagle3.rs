//! The EAGLE-3 head's fusion: its layer-0 input (two RMSNorms and a concat around the
//! embedding).

use specplan_format::FusionRecord;

use super::{names, nodes_where, remove, row_bytes, sole_consumer, EMBED_NORM_CONCAT};
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
