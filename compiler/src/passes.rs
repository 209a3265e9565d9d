//! Stage 3: fusion passes over the op graph, run in the order [`run`] lists them.
//!
//! Each pass is a plain function that rewrites ops and tensors where its pattern matches
//! exactly (sole consumers, same inputs, no bias where a packed weight could not carry
//! one) and returns what it fused. A pattern that does not match is left as it is: the
//! unfused op is still correct, only slower. The graph is re-verified after the passes.

use petgraph::algo::has_path_connecting;
use petgraph::stable_graph::NodeIndex;
use specplan_format::{Entry, FusionRecord, Packing};

use crate::config::Config;
use crate::graph::{Op, OpGraph, OpKind, Storage, Tensor, TensorId};

mod eagle3;
mod round;
mod select;
mod topk;
mod tp;

type Pass = fn(&mut OpGraph, &Config) -> Vec<FusionRecord>;

/// Rules named after the one kernel they fuse into.
const EMBED_CONCAT: &str = Entry::EmbedConcat.name();
const EMBED_NORM_CONCAT: &str = Entry::EmbedNormConcat.name();
const SELECT_NORM: &str = Entry::SelectNorm.name();
const NORM_CAST: &str = Entry::NormCast.name();
const SOFTMAX_TOPK: &str = Entry::SoftmaxTopk.name();

/// The fusion pipeline, in order.
pub const PASSES: &[(&str, Pass)] = &[
    (EMBED_CONCAT, embed_concat),
    ("fc_bias_into_embed", fc_bias_into_embed),
    (EMBED_NORM_CONCAT, eagle3::embed_norm_concat),
    (SELECT_NORM, select::select_norm),
    ("qkv_rope_append", qkv_rope_append),
    ("gate_up_silu_mul", gate_up_silu_mul),
    ("residual_into_gemm", residual_into_gemm),
    ("residual_into_all_reduce", tp::residual_into_all_reduce),
    ("mlp_pairs", select::mlp_pairs),
    (NORM_CAST, select::norm_cast),
    ("round_into_gemm", round::round_into_gemm),
    (SOFTMAX_TOPK, topk::softmax_topk),
];

pub fn run(g: &mut OpGraph, cfg: &Config) -> Vec<FusionRecord> {
    let mut records = Vec::new();
    for (_, pass) in PASSES {
        records.extend(pass(g, cfg));
        g.rebuild_edges();
    }
    records
}

fn nodes_where(g: &OpGraph, pred: impl Fn(&OpKind) -> bool) -> Vec<NodeIndex> {
    let mut v: Vec<NodeIndex> = g.graph.node_indices().filter(|&n| pred(&g.graph[n].kind)).collect();
    v.sort_by_key(|&n| g.graph[n].rank);
    v
}

fn sole_consumer(g: &OpGraph, t: TensorId) -> Option<NodeIndex> {
    match g.consumers(t).as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

fn plain_linear(g: &OpGraph, n: Option<NodeIndex>) -> Option<NodeIndex> {
    n.filter(|&n| {
        matches!(
            g.graph[n].kind,
            OpKind::Linear {
                bias: false,
                accumulate: false
            }
        )
    })
}

/// Rows a request owns in tensor `t` (the phase's rows per request for a per-row tensor, 1
/// for a per-request one): read from the graph, where lowering put the phase's fact.
pub(crate) fn rows_per_request(g: &OpGraph, t: TensorId) -> u64 {
    g.tensor(t).shape.first().map_or(1, |d| d.per_batch.max(1))
}

pub(crate) fn row_bytes(g: &OpGraph, t: TensorId) -> u64 {
    let tensor = g.tensor(t);
    tensor.shape.iter().skip(1).map(|d| d.fixed).product::<u64>() * tensor.dtype.size()
}

fn weight_sources(g: &OpGraph, t: TensorId) -> Vec<String> {
    match &g.tensor(t).storage {
        Storage::Weight { sources, .. } => sources.clone(),
        _ => Vec::new(),
    }
}

/// A weight stacking `parts` along dim 0.
fn packed_weight(g: &mut OpGraph, name: String, parts: &[TensorId]) -> TensorId {
    // One tensor per weight: a multi-step phase packs each layer's weights once.
    if let Some(i) = g
        .tensors
        .iter()
        .position(|t| t.name == name && matches!(t.storage, Storage::Weight { .. }))
    {
        return TensorId(i as u32);
    }
    let first = g.tensor(parts[0]).clone();
    let rows: u64 = parts.iter().map(|&p| g.tensor(p).shape[0].fixed).sum();
    let sources = parts.iter().flat_map(|&p| weight_sources(g, p)).collect();
    // A sharded part keeps its slice; the parts of one packed weight are all sharded or none.
    let shard = parts
        .iter()
        .flat_map(|&p| match &g.tensor(p).storage {
            Storage::Weight { shard, .. } => shard.clone(),
            _ => Vec::new(),
        })
        .collect();
    let mut shape = first.shape.clone();
    shape[0] = crate::graph::Dim::fixed(rows);
    g.add_tensor(Tensor {
        name,
        dtype: first.dtype,
        shape,
        storage: Storage::Weight {
            sources,
            packing: Packing::ConcatRows,
            shard,
        },
        alias_of: None,
    })
}

fn names(g: &OpGraph, ns: &[NodeIndex]) -> Vec<String> {
    ns.iter().map(|&n| g.graph[n].name.clone()).collect()
}

fn remove(g: &mut OpGraph, ns: &[NodeIndex]) {
    for &n in ns {
        g.graph.remove_node(n);
    }
}

/// embed(ids) and concat(·, hidden) → one kernel writing the fc input directly.
fn embed_concat(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for e in nodes_where(g, |k| *k == OpKind::Embed) {
        let emb = g.graph[e].outs[0];
        let Some(c) = sole_consumer(g, emb).filter(|&c| g.graph[c].kind == OpKind::Concat && g.graph[c].ins[0] == emb)
        else {
            continue;
        };
        let (ids, table) = (g.graph[e].ins[0], g.graph[e].ins[1]);
        let op = Op {
            name: g.graph[e].renamed("embed", EMBED_CONCAT),
            kind: OpKind::EmbedConcat { bias: false },
            ins: vec![ids, table, g.graph[c].ins[1]],
            outs: g.graph[c].outs.clone(),
            rank: g.graph[e].rank,
        };
        out.push(FusionRecord {
            rule: EMBED_CONCAT.into(),
            fused: names(g, &[e, c]),
            into: op.name.clone(),
            launches_saved: 1,
            bytes_saved_per_request: 2 * row_bytes(g, emb) * rows_per_request(g, emb),
        });
        remove(g, &[e, c]);
        g.add_op(op);
    }
    out
}

/// The fc bias: embed_concat also writes the fc output rows as the bias, and the fc GEMM
/// accumulates onto them (beta = 1), so the bias costs no launch of its own and cuBLAS
/// needs no epilogue.
fn fc_bias_into_embed(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for e in nodes_where(g, |k| *k == OpKind::EmbedConcat { bias: false }) {
        let mut fc_in = g.graph[e].outs[0];
        // A vocabulary-parallel embedding's fc input is all-reduced first.
        if let Some(r) = sole_consumer(g, fc_in).filter(|&r| g.graph[r].kind == OpKind::AllReduce) {
            fc_in = g.graph[r].outs[0];
        }
        let Some(l) = sole_consumer(g, fc_in).filter(|&l| {
            matches!(
                g.graph[l].kind,
                OpKind::Linear {
                    bias: true,
                    accumulate: false
                }
            )
        }) else {
            continue;
        };
        let (bias, y) = (g.graph[l].ins[2], g.graph[l].outs[0]);
        let yt = g.tensor(y).clone();
        // The buffer is named by its root, so the initialized tensor keeps the fc output's name.
        let init = g.add_tensor(Tensor {
            alias_of: None,
            ..yt.clone()
        });
        g.tensors[y.0 as usize].alias_of = Some(init);
        g.tensors[y.0 as usize].name = format!("{}.fc", yt.name);
        out.push(FusionRecord {
            rule: "fc_bias_into_embed".into(),
            fused: vec![format!("{} bias", g.graph[l].name)],
            into: g.graph[e].name.clone(),
            launches_saved: 1,
            bytes_saved_per_request: 2 * row_bytes(g, y) * rows_per_request(g, y),
        });
        let emb = &mut g.graph[e];
        emb.kind = OpKind::EmbedConcat { bias: true };
        emb.ins.push(bias);
        emb.outs.push(init);
        let lin = &mut g.graph[l];
        lin.kind = OpKind::Linear {
            bias: false,
            accumulate: true,
        };
        lin.ins = vec![lin.ins[0], lin.ins[1], init];
    }
    out
}

/// q/k/v projections → one GEMM over a packed weight; RoPE(q), RoPE(k) and the K/V append
/// → one kernel that rotates q in place and writes rotated k and v into the pages.
fn qkv_rope_append(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for a in nodes_where(g, |k| matches!(k, OpKind::KvAppend { .. })) {
        let OpKind::KvAppend { layer, step } = g.graph[a].kind else {
            continue;
        };
        let ins = g.graph[a].ins.clone();
        let (k_rot, v, prefix, slots, pages, kc, vc) = (ins[0], ins[1], ins[2], ins[3], ins[4], ins[5], ins[6]);
        let rk = g
            .producer(k_rot)
            .filter(|&n| matches!(g.graph[n].kind, OpKind::Rope { .. }));
        let Some(rk) = rk.filter(|_| sole_consumer(g, k_rot) == Some(a)) else {
            continue;
        };
        let k = g.graph[rk].ins[0];
        let Some(lk) = plain_linear(g, g.producer(k)).filter(|_| sole_consumer(g, k) == Some(rk)) else {
            continue;
        };
        let Some(lv) = plain_linear(g, g.producer(v)).filter(|_| sole_consumer(g, v) == Some(a)) else {
            continue;
        };
        let cache_k2 = g.graph[a].outs[0];
        let Some(at) = g
            .consumers(cache_k2)
            .into_iter()
            .find(|&n| matches!(g.graph[n].kind, OpKind::Attention { .. }))
        else {
            continue;
        };
        let q_rot = g.graph[at].ins[0];
        let rq = g
            .producer(q_rot)
            .filter(|&n| matches!(g.graph[n].kind, OpKind::Rope { .. }));
        let Some(rq) = rq.filter(|_| sole_consumer(g, q_rot) == Some(at)) else {
            continue;
        };
        let q = g.graph[rq].ins[0];
        let Some(lq) = plain_linear(g, g.producer(q)).filter(|_| sole_consumer(g, q) == Some(rq)) else {
            continue;
        };
        let h = g.graph[lq].ins[0];
        if g.graph[lk].ins[0] != h || g.graph[lv].ins[0] != h {
            continue;
        }
        let (wq, wk, wv) = (g.graph[lq].ins[1], g.graph[lk].ins[1], g.graph[lv].ins[1]);
        let wname = g.tensor(wq).name.replace("q_proj", "qkv_proj");
        let w = packed_weight(g, wname, &[wq, wk, wv]);
        let qt = g.tensor(q).clone();
        let cols = g.tensor(w).shape[0];
        let append = g.graph[a].clone();
        let named = |into: &str| append.renamed("kv_append", into);
        let qkv = g.add_tensor(Tensor {
            name: named("qkv"),
            shape: vec![qt.shape[0], cols],
            alias_of: None,
            ..qt.clone()
        });
        let qkv_rot = g.add_tensor(Tensor {
            name: named("qkv_rot"),
            shape: vec![qt.shape[0], cols],
            alias_of: Some(qkv),
            ..qt
        });
        let fused = names(g, &[lq, lk, lv, rq, rk, a]);
        let saved = (row_bytes(g, q_rot) + row_bytes(g, k_rot)) * 2 * rows_per_request(g, q_rot);
        let gemm = Op {
            name: named("qkv_proj"),
            kind: OpKind::Linear {
                bias: false,
                accumulate: false,
            },
            ins: vec![h, w],
            outs: vec![qkv],
            rank: g.graph[lq].rank,
        };
        let ra = Op {
            name: named(Entry::RopeAppend.name()),
            kind: OpKind::RopeAppend { layer, step },
            ins: vec![qkv, prefix, slots, pages, kc, vc],
            outs: vec![qkv_rot, cache_k2, g.graph[a].outs[1]],
            rank: g.graph[rq].rank,
        };
        g.graph[at].ins[0] = qkv_rot;
        out.push(FusionRecord {
            rule: "qkv_rope_append".into(),
            fused,
            into: format!("{} + {}", gemm.name, ra.name),
            launches_saved: 4,
            bytes_saved_per_request: saved,
        });
        remove(g, &[lq, lk, lv, rq, rk, a]);
        g.add_op(gemm);
        g.add_op(ra);
    }
    out
}

/// gate and up projections → one GEMM over a packed weight; silu and mul → one kernel.
fn gate_up_silu_mul(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for s in nodes_where(g, |k| *k == OpKind::Silu) {
        let gate = g.graph[s].ins[0];
        let ga = g.graph[s].outs[0];
        let Some(lg) = plain_linear(g, g.producer(gate)).filter(|_| sole_consumer(g, gate) == Some(s)) else {
            continue;
        };
        let Some(mul) = sole_consumer(g, ga).filter(|&m| g.graph[m].kind == OpKind::Mul && g.graph[m].ins[0] == ga)
        else {
            continue;
        };
        let up = g.graph[mul].ins[1];
        let Some(lu) = plain_linear(g, g.producer(up)).filter(|_| sole_consumer(g, up) == Some(mul)) else {
            continue;
        };
        let h = g.graph[lg].ins[0];
        if g.graph[lu].ins[0] != h {
            continue;
        }
        let (wg, wu) = (g.graph[lg].ins[1], g.graph[lu].ins[1]);
        let w = packed_weight(g, g.tensor(wg).name.replace("gate_proj", "gate_up_proj"), &[wg, wu]);
        let gt = g.tensor(gate).clone();
        let prefix = g.graph[lg].name.trim_end_matches(".gate_proj").to_string();
        let gu = g.add_tensor(Tensor {
            name: format!("{prefix}.gate_up"),
            shape: vec![gt.shape[0], g.tensor(w).shape[0]],
            ..gt
        });
        let fused = names(g, &[lg, lu, s, mul]);
        let gemm = Op {
            name: format!("{prefix}.gate_up_proj"),
            kind: OpKind::Linear {
                bias: false,
                accumulate: false,
            },
            ins: vec![h, w],
            outs: vec![gu],
            rank: g.graph[lg].rank,
        };
        let sm = Op {
            name: format!("{prefix}.silu_mul"),
            kind: OpKind::SiluMul,
            ins: vec![gu],
            outs: g.graph[mul].outs.clone(),
            rank: g.graph[s].rank,
        };
        out.push(FusionRecord {
            rule: "gate_up_silu_mul".into(),
            fused,
            into: format!("{} + {}", gemm.name, sm.name),
            launches_saved: 2,
            bytes_saved_per_request: 2 * row_bytes(g, ga) * rows_per_request(g, ga),
        });
        // The product overwrites the gate half of the gate/up rows (each element is read
        // and written by one thread), so no separate [T, I] buffer is live beside them.
        g.tensors[g.graph[mul].outs[0].0 as usize].alias_of = Some(gu);
        remove(g, &[lg, lu, s, mul]);
        g.add_op(gemm);
        g.add_op(sm);
    }
    out
}

/// `x + linear(y)` → the GEMM accumulates into x in place (beta = 1), when every other
/// reader of x runs before the GEMM (so overwriting x is unobservable).
fn residual_into_gemm(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for a in nodes_where(g, |k| *k == OpKind::Add) {
        let (x, y) = (g.graph[a].ins[0], g.graph[a].ins[1]);
        let Some(l) = plain_linear(g, g.producer(y)).filter(|_| sole_consumer(g, y) == Some(a)) else {
            continue;
        };
        if !residual_in_place(g, a, x, y, l) {
            continue;
        }
        let sum = g.graph[a].outs[0];
        g.tensors[sum.0 as usize].alias_of = Some(x);
        let bytes = 2 * row_bytes(g, y) * rows_per_request(g, y);
        out.push(FusionRecord {
            rule: "residual_into_gemm".into(),
            fused: names(g, &[l, a]),
            into: g.graph[l].name.clone(),
            launches_saved: 1,
            bytes_saved_per_request: bytes,
        });
        let op = &mut g.graph[l];
        op.kind = OpKind::Linear {
            bias: false,
            accumulate: true,
        };
        op.ins.push(x);
        op.outs = vec![sum];
        remove(g, &[a]);
    }
    out
}

/// Whether the GEMM `l` may write the residual add `a = x + y` in place over x: x is a
/// scratch activation of y's dtype and every other reader of x runs before `l` (so
/// overwriting x is unobservable).
pub(crate) fn residual_in_place(g: &OpGraph, a: NodeIndex, x: TensorId, y: TensorId, l: NodeIndex) -> bool {
    let x_t = g.tensor(x);
    matches!(x_t.storage, Storage::Activation { output: false })
        && x_t.dtype == g.tensor(y).dtype
        && g.consumers(x)
            .into_iter()
            .filter(|&c| c != a)
            .all(|c| c != l && has_path_connecting(&g.graph, c, l, None))
}

#[cfg(test)]
mod tests {
    //! Each pass on the lowered `tiny` graph (it matches), and on the same graph with its
    //! pattern broken in one place (it leaves the graph as it was).

    use super::*;
    use crate::config::{resolve, Overrides, Source};
    use crate::graph::Tensor;
    use crate::lower::lower;
    use specplan_format::PhaseKind;

    fn tiny(o: &Overrides) -> (OpGraph, Config) {
        let cfg = resolve(&Source::Preset("tiny".into()), o).expect("tiny resolves");
        (lower(&cfg, PhaseKind::DraftExtend).expect("lowers"), cfg)
    }

    fn kinds(g: &OpGraph) -> Vec<&'static str> {
        let mut v: Vec<(u32, &'static str)> = g.graph.node_weights().map(|op| (op.rank, op.kind.mnemonic())).collect();
        v.sort();
        v.into_iter().map(|x| x.1).collect()
    }

    fn count(g: &OpGraph, pred: impl Fn(&OpKind) -> bool) -> usize {
        g.graph.node_weights().filter(|op| pred(&op.kind)).count()
    }

    /// Runs the passes before `name` (so `name` sees the graph it sees in the pipeline).
    fn upto(g: &mut OpGraph, cfg: &Config, name: &str) {
        for (n, pass) in PASSES {
            if *n == name {
                return;
            }
            pass(g, cfg);
            g.rebuild_edges();
        }
    }

    fn run_one(g: &mut OpGraph, cfg: &Config, name: &str) -> Vec<FusionRecord> {
        let pass = PASSES.iter().find(|(n, _)| *n == name).expect("pass").1;
        let r = pass(g, cfg);
        g.rebuild_edges();
        r
    }

    /// Adds an op that also reads `t` (a second consumer breaks "sole consumer" patterns).
    fn extra_reader(g: &mut OpGraph, t: TensorId) {
        let tensor = g.tensor(t).clone();
        let out = g.add_tensor(Tensor {
            name: format!("{}.extra", tensor.name),
            alias_of: None,
            ..tensor
        });
        g.add_op(Op {
            name: "extra".into(),
            kind: OpKind::Silu,
            ins: vec![t],
            outs: vec![out],
            rank: 10_000,
        });
        g.rebuild_edges();
    }

    fn first_out(g: &OpGraph, kind: &OpKind) -> TensorId {
        g.graph.node_weights().find(|op| op.kind == *kind).expect("op").outs[0]
    }

    #[test]
    fn embed_concat_matches_and_respects_other_readers() {
        let (mut g, cfg) = tiny(&Overrides::default());
        let r = run_one(&mut g, &cfg, EMBED_CONCAT);
        assert_eq!(r.len(), 1);
        assert_eq!(count(&g, |k| *k == OpKind::EmbedConcat { bias: false }), 1);
        assert_eq!(count(&g, |k| *k == OpKind::Embed || *k == OpKind::Concat), 0);

        let (mut g, cfg) = tiny(&Overrides::default());
        let emb = first_out(&g, &OpKind::Embed);
        extra_reader(&mut g, emb);
        let before = kinds(&g);
        assert!(run_one(&mut g, &cfg, EMBED_CONCAT).is_empty());
        assert_eq!(kinds(&g), before);
    }

    #[test]
    fn fc_bias_folds_only_when_there_is_a_bias() {
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, "fc_bias_into_embed");
        assert_eq!(run_one(&mut g, &cfg, "fc_bias_into_embed").len(), 1);
        assert_eq!(count(&g, |k| *k == OpKind::EmbedConcat { bias: true }), 1);
        assert_eq!(count(&g, |k| matches!(k, OpKind::Linear { bias: true, .. })), 0);

        // No bias in the model: the fc is a plain GEMM and nothing folds.
        let (_, mut cfg) = tiny(&Overrides::default());
        cfg.model.desc.fc_bias = false;
        let mut g2 = lower(&cfg, PhaseKind::DraftExtend).expect("lowers");
        upto(&mut g2, &cfg, "fc_bias_into_embed");
        let before = kinds(&g2);
        assert!(run_one(&mut g2, &cfg, "fc_bias_into_embed").is_empty());
        assert_eq!(kinds(&g2), before);
    }

    #[test]
    fn qkv_rope_append_matches_per_layer_and_needs_one_input() {
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, "qkv_rope_append");
        assert_eq!(run_one(&mut g, &cfg, "qkv_rope_append").len(), 2, "two layers");
        assert_eq!(count(&g, |k| matches!(k, OpKind::RopeAppend { .. })), 2);
        assert_eq!(
            count(&g, |k| matches!(k, OpKind::Rope { .. } | OpKind::KvAppend { .. })),
            0
        );

        // Layer 0's rotated k also read elsewhere: layer 0 stays unfused, layer 1 fuses.
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, "qkv_rope_append");
        let k_rot = g
            .graph
            .node_weights()
            .find(|op| op.name == "l0.rope_k")
            .expect("l0.rope_k")
            .outs[0];
        extra_reader(&mut g, k_rot);
        assert_eq!(run_one(&mut g, &cfg, "qkv_rope_append").len(), 1);
        assert_eq!(count(&g, |k| matches!(k, OpKind::KvAppend { layer: 0, .. })), 1);
    }

    #[test]
    fn gate_up_silu_mul_matches_and_needs_shared_input() {
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, "gate_up_silu_mul");
        assert_eq!(run_one(&mut g, &cfg, "gate_up_silu_mul").len(), 2);
        assert_eq!(count(&g, |k| *k == OpKind::SiluMul), 2);

        // The silu output read twice: nothing fuses in that layer.
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, "gate_up_silu_mul");
        let ga = g
            .graph
            .node_weights()
            .find(|op| op.name == "l1.silu")
            .expect("l1.silu")
            .outs[0];
        extra_reader(&mut g, ga);
        assert_eq!(run_one(&mut g, &cfg, "gate_up_silu_mul").len(), 1);
        assert_eq!(count(&g, |k| *k == OpKind::Mul), 1);
    }

    #[test]
    fn residual_folds_only_when_no_later_reader_sees_the_overwrite() {
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, "residual_into_gemm");
        // Both of layer 0's residuals and layer 1's MLP residual: layer 1's attention
        // residual (over the selected rows) is select_norm's.
        assert_eq!(run_one(&mut g, &cfg, "residual_into_gemm").len(), 3);
        assert_eq!(count(&g, |k| *k == OpKind::Add), 0);

        // The residual x also read after the GEMM would be overwritten under it: no fold.
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, "residual_into_gemm");
        let add = g
            .graph
            .node_weights()
            .find(|op| op.name == "l1.residual_mlp")
            .expect("l1.residual_mlp")
            .clone();
        extra_reader(&mut g, add.ins[0]);
        let r = run_one(&mut g, &cfg, "residual_into_gemm");
        assert_eq!(r.len(), 2);
        assert!(r.iter().all(|x| !x.fused.contains(&"l1.residual_mlp".to_string())));
    }

    #[test]
    fn softmax_topk_matches_with_and_without_the_hot_map() {
        for hot in [None, Some(256)] {
            let o = Overrides {
                hot_vocab_size: hot,
                ..Overrides::default()
            };
            let (mut g, cfg) = tiny(&o);
            upto(&mut g, &cfg, SOFTMAX_TOPK);
            let r = run_one(&mut g, &cfg, SOFTMAX_TOPK);
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].fused.len(), if hot.is_some() { 3 } else { 2 });
            assert_eq!(
                count(
                    &g,
                    |k| matches!(k, OpKind::SoftmaxTopK { map, .. } if map.is_some() == hot.is_some())
                ),
                1
            );
        }
        // Probabilities read elsewhere: the softmax stays.
        let (mut g, cfg) = tiny(&Overrides::default());
        upto(&mut g, &cfg, SOFTMAX_TOPK);
        let probs = first_out(&g, &OpKind::Softmax);
        extra_reader(&mut g, probs);
        let before = kinds(&g);
        assert!(run_one(&mut g, &cfg, SOFTMAX_TOPK).is_empty());
        assert_eq!(kinds(&g), before);
    }

    #[test]
    fn the_pipeline_leaves_only_fused_or_gemm_ops() {
        let (mut g, cfg) = tiny(&Overrides::default());
        run(&mut g, &cfg);
        for op in g.graph.node_weights() {
            assert!(
                matches!(
                    op.kind,
                    OpKind::Linear { bias: false, .. }
                        | OpKind::EmbedConcat { .. }
                        | OpKind::RmsNorm
                        | OpKind::RopeAppend { .. }
                        | OpKind::Attention { .. }
                        | OpKind::SiluMul
                        | OpKind::SelectRows
                        | OpKind::SelectNorm
                        | OpKind::SelectNormPairs
                        | OpKind::SiluMulPairs
                        | OpKind::NormCast
                        | OpKind::SoftmaxTopK { .. }
                        | OpKind::Cast
                ),
                "{} ({}) left unfused",
                op.name,
                op.kind.mnemonic()
            );
        }
    }
}
