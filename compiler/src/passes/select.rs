//! The selected rows, their residual add and its norm in one kernel (the draft-extend head's
//! last layer), the selected rows' MLP over hi/lo pairs, and the head's two readers of the
//! rows in one kernel.

use petgraph::stable_graph::NodeIndex;
use specplan_format::{DType, Entry, FusionRecord};

use super::{names, nodes_where, plain_linear, remove, row_bytes, sole_consumer, NORM_CAST, SELECT_NORM};
use crate::config::Config;
use crate::graph::{Dim, Op, OpGraph, OpKind, TensorId};

/// The RMSNorm ops that normalize `t` itself (`t` their first operand).
fn norms_of(g: &OpGraph, t: TensorId) -> Vec<NodeIndex> {
    g.consumers(t)
        .into_iter()
        .filter(|&n| g.graph[n].kind == OpKind::RmsNorm && g.graph[n].ins[0] == t)
        .collect()
}

/// The selected rows, the residual add over them and the RMSNorm of the sum → one kernel
/// (`select_norm`) writing the sum and its norm: in the draft-extend head's last layer the
/// stream's selected rows plus the o projection of their attention (the MLP's residual)
/// and the post-attention norm (the MLP's input). Other readers of the sum read it after
/// the fused kernel wrote it.
pub(super) fn select_norm(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for s in nodes_where(g, |k| *k == OpKind::SelectRows) {
        let sel = g.graph[s].outs[0];
        let Some(a) = sole_consumer(g, sel).filter(|&a| g.graph[a].kind == OpKind::Add && g.graph[a].ins[0] == sel)
        else {
            continue;
        };
        let sum = g.graph[a].outs[0];
        let [n] = norms_of(g, sum)[..] else {
            continue;
        };
        let op = Op {
            name: SELECT_NORM.into(),
            kind: OpKind::SelectNorm,
            ins: vec![
                g.graph[s].ins[0],
                g.graph[s].ins[1],
                g.graph[n].ins[1],
                g.graph[a].ins[1],
            ],
            outs: vec![sum, g.graph[n].outs[0]],
            rank: g.graph[s].rank,
        };
        out.push(FusionRecord {
            rule: SELECT_NORM.into(),
            fused: names(g, &[s, a, n]),
            into: op.name.clone(),
            launches_saved: 2,
            bytes_saved_per_request: 3 * row_bytes(g, sel),
        });
        remove(g, &[s, a, n]);
        g.add_op(op);
    }
    out
}

/// The selected rows' MLP over exact inputs (docs/semantics.md, "MLP pairs"): where the
/// stream is fp32 and unsharded, `select_norm` writes its norm as hi/lo row pairs, the
/// gate/up GEMM runs over the 2B rows into fp32 and `silu_mul` sums each pair before the
/// activation (`select_norm_pairs`, `silu_mul_pairs`). The MLP's input then reaches the
/// GEMM to ~2^-16 instead of bf16's 2^-9 and its output unrounded: on EAGLE-3 heads those
/// two roundings were most of the top-K probabilities' error (docs/perf-notes.md item 29).
/// A precision rewrite, not a fusion: no launch saved, the GEMM's rows and output bytes
/// grow (2B rows of fp32 for B of bf16), which is why only the selected rows take it.
pub(super) fn mlp_pairs(g: &mut OpGraph, cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    if cfg.capture.tp.size != 1 {
        return out;
    }
    for s in nodes_where(g, |k| *k == OpKind::SelectNorm) {
        let [sel, normed] = g.graph[s].outs[..] else {
            continue;
        };
        if g.tensor(sel).dtype != DType::F32 || g.tensor(normed).shape[0] != Dim::batch(1) {
            continue;
        }
        let Some(gemm) = plain_linear(g, sole_consumer(g, normed)) else {
            continue;
        };
        let gu = g.graph[gemm].outs[0];
        let Some(sm) = sole_consumer(g, gu).filter(|&n| g.graph[n].kind == OpKind::SiluMul) else {
            continue;
        };
        let mid = g.graph[sm].outs[0];
        let fused = names(g, &[s, gemm, sm]);
        g.tensors[normed.0 as usize].shape[0] = Dim::batch(2);
        let t = &mut g.tensors[gu.0 as usize];
        t.shape[0] = Dim::batch(2);
        t.dtype = DType::F32;
        g.tensors[mid.0 as usize].alias_of = None;
        g.graph[s].kind = OpKind::SelectNormPairs;
        g.graph[s].name = Entry::SelectNormPairs.name().into();
        g.graph[sm].kind = OpKind::SiluMulPairs;
        out.push(FusionRecord {
            rule: "mlp_pairs".into(),
            fused,
            into: format!("{} + {} + {}", g.graph[s].name, g.graph[gemm].name, g.graph[sm].name),
            launches_saved: 0,
            bytes_saved_per_request: 0,
        });
    }
    out
}

/// The fp32 stream's selected rows, read twice by EAGLE-3's head — rounded into
/// `hidden_out` (`cast_rows`) and normed into lm_head's input (`rmsnorm`) — → one kernel
/// writing both (`norm_cast`): a launch and a read of the rows fewer. Where the rows have
/// another norm reader, or none, the ops stay as they are.
pub(super) fn norm_cast(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for c in nodes_where(g, |k| *k == OpKind::Cast) {
        let x = g.graph[c].ins[0];
        let [n] = norms_of(g, x)[..] else {
            continue;
        };
        let op = Op {
            name: g.graph[n].renamed("final_norm", NORM_CAST),
            kind: OpKind::NormCast,
            ins: vec![x, g.graph[n].ins[1]],
            outs: vec![g.graph[n].outs[0], g.graph[c].outs[0]],
            rank: g.graph[c].rank.min(g.graph[n].rank),
        };
        out.push(FusionRecord {
            rule: NORM_CAST.into(),
            fused: names(g, &[c, n]),
            into: op.name.clone(),
            launches_saved: 1,
            bytes_saved_per_request: row_bytes(g, x),
        });
        remove(g, &[c, n]);
        g.add_op(op);
    }
    out
}

#[cfg(test)]
mod tests {
    //! The draft-extend head's last layer past its K/V append: selected rows, the norm fused
    //! with the select, the SwiGLU product in place; draft decode keeps every lane's row.

    use crate::config::{resolve, Overrides, Source};
    use crate::graph::{Dim, OpGraph, OpKind, TensorId};
    use crate::lower::lower;
    use crate::verify;
    use specplan_format::{Entry, PhaseKind};

    fn fused(kind: PhaseKind, o: &Overrides) -> OpGraph {
        let cfg = resolve(&Source::Preset("tiny".into()), o).expect("tiny resolves");
        let mut g = lower(&cfg, kind).expect("lowers");
        crate::passes::run(&mut g, &cfg);
        g
    }

    fn rows_of(g: &OpGraph, name: &str) -> Dim {
        let op = g.graph.node_weights().find(|op| op.name == name).expect(name);
        g.tensor(op.outs[0]).shape[0]
    }

    #[test]
    fn the_last_layers_mlp_runs_on_the_selected_rows() {
        let g = fused(PhaseKind::DraftExtend, &Overrides::default());
        // tiny: two layers, N = 4. Layer 0 keeps every row; layer 1's attention runs over
        // the selected query rows, so its o_proj too has one row per request.
        assert_eq!(rows_of(&g, "l0.gate_up_proj"), Dim::batch(4));
        assert_eq!(rows_of(&g, "l0.down_proj"), Dim::batch(4));
        assert_eq!(rows_of(&g, "l0.o_proj"), Dim::batch(4));
        assert_eq!(rows_of(&g, "l0.attention"), Dim::batch(4));
        assert_eq!(rows_of(&g, "l1.attention"), Dim::batch(1));
        assert_eq!(rows_of(&g, "l1.o_proj"), Dim::batch(1));
        let attn = |name: &str| {
            let op = g.graph.node_weights().find(|op| op.name == name).expect(name);
            match op.kind {
                OpKind::Attention { select, .. } => (select, op.ins.len()),
                _ => panic!("{name} is not an attention"),
            }
        };
        assert_eq!(attn("l0.attention"), (false, 6));
        assert_eq!(attn("l1.attention"), (true, 7));
        let silu = format!("l1.{}", Entry::SiluMul.name());
        for op in [&silu, "l1.down_proj", Entry::SelectNormPairs.name()] {
            assert_eq!(rows_of(&g, op), Dim::batch(1), "{op}");
        }
        // The fp32 stream's selected rows: the norm as hi/lo pairs, gate/up over the 2B
        // rows into fp32, the product summed from the pairs into its own buffer.
        assert_eq!(rows_of(&g, "l1.gate_up_proj"), Dim::batch(2));
        let op = |name: &str| g.graph.node_weights().find(|op| op.name == name).expect(name);
        let sn = op(Entry::SelectNormPairs.name());
        assert_eq!(sn.kind, OpKind::SelectNormPairs);
        // Its addend is layer 1's o projection, a plain GEMM over the selected rows (the
        // residual add is the select kernel's, not the GEMM's epilogue).
        let o_proj = op("l1.o_proj");
        assert_eq!(sn.ins[3], o_proj.outs[0]);
        assert!(matches!(o_proj.kind, OpKind::Linear { accumulate: false, .. }));
        assert_eq!(g.tensor(sn.outs[1]).shape[0], Dim::batch(2));
        let gu = op("l1.gate_up_proj").outs[0];
        assert_eq!(g.tensor(gu).dtype, specplan_format::DType::F32);
        let sm = op(&silu);
        assert_eq!(sm.kind, OpKind::SiluMulPairs);
        assert!(g.tensor(sm.outs[0]).alias_of.is_none());
        // Layer 0 (every row) keeps the in-place bf16 SwiGLU.
        assert_eq!(op("l0.silu_mul").kind, OpKind::SiluMul);
        // The head reads the down projection's output in place (the fp32 stream's selected
        // rows, rounded once into hidden_out): no select after it.
        assert_eq!(
            g.graph
                .node_weights()
                .filter(|op| op.kind == OpKind::SelectRows)
                .count(),
            0
        );
        let down = g
            .graph
            .node_weights()
            .find(|op| op.name == "l1.down_proj")
            .expect("down");
        let sel = down.outs[0];
        assert_eq!(g.tensor(sel).dtype, specplan_format::DType::F32);
        // The stream's rounding into hidden_out is the GEMM's second output
        // (`round_into_gemm`).
        assert_eq!(down.outs.len(), 2);
        assert_eq!(g.tensor(down.outs[1]).name, specplan_format::io::HIDDEN_OUT);
    }

    #[test]
    fn eagle3s_head_reads_the_selected_rows_once() {
        let cfg = resolve(&Source::Preset("llama3.1-8b-eagle3".into()), &Overrides::default()).expect("resolves");
        let mut g = lower(&cfg, PhaseKind::DraftExtend).expect("lowers");
        let records = crate::passes::run(&mut g, &cfg);
        let r = records
            .iter()
            .find(|r| r.rule == Entry::NormCast.name())
            .expect("a norm_cast record");
        assert_eq!(r.fused, ["hidden_out_cast", "final_norm"]);
        assert_eq!(r.launches_saved, 1);
        let ops: Vec<_> = g
            .graph
            .node_weights()
            .filter(|op| op.kind == OpKind::NormCast)
            .collect();
        let [nc] = ops[..] else {
            panic!("one norm_cast op, found {}", ops.len());
        };
        // The fp32 stream's selected rows in; lm_head's input and hidden_out out.
        assert_eq!(g.tensor(nc.ins[0]).dtype, specplan_format::DType::F32);
        assert_eq!(g.tensor(nc.outs[0]).name, "hidden_normed");
        assert_eq!(g.tensor(nc.outs[1]).name, specplan_format::io::HIDDEN_OUT);
        assert!(g.graph.node_weights().all(|op| op.kind != OpKind::Cast));
        assert!(verify::graph(&g, 8).is_ok());
        // lm_head reads the norm the fused op writes.
        let lm = g.graph.node_weights().find(|op| op.name == "lm_head").expect("lm_head");
        assert_eq!(lm.ins[0], nc.outs[0]);
        // The kernel writes both outputs as the activation type: a norm output of another
        // type is refused, naming the op.
        let (normed, name) = (nc.outs[0], nc.name.clone());
        g.tensors[normed.0 as usize].dtype = specplan_format::DType::F32;
        let err = verify::graph(&g, 8).expect_err("an f32 norm output");
        assert!(err.to_string().contains(&name), "{err}");
    }

    #[test]
    fn a_rounding_without_a_norm_reader_stays() {
        // EAGLE-1 (tiny): lm_head reads hidden_out itself, no norm reads the rows.
        let g = fused(PhaseKind::DraftExtend, &Overrides::default());
        assert!(g.graph.node_weights().all(|op| op.kind != OpKind::NormCast));
        // (`round_into_gemm` then folds the rounding into the down projection.)
        let down = g
            .graph
            .node_weights()
            .find(|op| op.name == "l1.down_proj")
            .expect("down");
        assert_eq!(g.tensor(down.outs[1]).name, specplan_format::io::HIDDEN_OUT);
    }

    #[test]
    fn draft_decode_keeps_every_lane() {
        let o = Overrides {
            draft_decode_steps: Some("auto".into()),
            ..Overrides::default()
        };
        let g = fused(PhaseKind::DraftDecode { steps: 3 }, &o);
        let mlp: Vec<Dim> = g
            .graph
            .node_weights()
            .filter(|op| op.kind == OpKind::SiluMul)
            .map(|op| g.tensor(op.outs[0]).shape[0])
            .collect();
        assert!(!mlp.is_empty());
        assert!(mlp.iter().all(|&d| d == Dim::batch(4)), "{mlp:?}");
    }

    #[test]
    fn a_column_view_is_read_only_by_a_gemm() {
        let mut g = fused(PhaseKind::DraftExtend, &Overrides::default());
        let view: TensorId = g
            .graph
            .node_weights()
            .find(|op| op.kind == OpKind::SiluMul)
            .map(|op| op.outs[0])
            .expect("a SwiGLU op");
        assert!(g.is_column_view(view));
        assert!(verify::graph(&g, 4).is_ok());
        // A kernel op reading the strided product is refused.
        let out = g.add_tensor(crate::graph::Tensor {
            name: "bad".into(),
            alias_of: None,
            ..g.tensor(view).clone()
        });
        g.add_op(crate::graph::Op {
            name: "bad_reader".into(),
            kind: OpKind::Silu,
            ins: vec![view],
            outs: vec![out],
            rank: 10_000,
        });
        g.rebuild_edges();
        let err = verify::graph(&g, 4).expect_err("refused").to_string();
        assert!(err.contains("bad_reader") && err.contains("column view"), "{err}");
    }
}
