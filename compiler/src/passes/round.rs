//! The fp32 stream's rounding folded into the GEMM that writes the stream.

use specplan_format::{DType, FusionRecord};

use super::{names, nodes_where, remove, row_bytes, rows_per_request};
use crate::config::Config;
use crate::graph::{OpGraph, OpKind};

/// The fp32 stream's rounding of a GEMM's output (a `Cast` of the whole f32 tensor the GEMM
/// writes) → the GEMM writing the rounded copy as a second output (`GemmDesc.rounded`): a
/// launch and a read of the rows fewer wherever the runtime's skinny GEMM runs the shape,
/// which rounds in its epilogue (the runtime rounds after a cuBLASLt GEMM itself). On
/// EAGLE-1 heads: the fc output into layer 0's input, the down projection's selected rows
/// into `hidden_out` (where the top-K's refinement still reads them in f32). The copy is
/// what `cast_rows` wrote, bit for bit.
pub(super) fn round_into_gemm(g: &mut OpGraph, _cfg: &Config) -> Vec<FusionRecord> {
    let mut out = Vec::new();
    for c in nodes_where(g, |k| *k == OpKind::Cast) {
        let x = g.graph[c].ins[0];
        let Some(l) = g
            .producer(x)
            .filter(|&l| matches!(g.graph[l].kind, OpKind::Linear { bias: false, .. }) && g.graph[l].outs[..] == [x])
        else {
            continue;
        };
        // The f32 C must still have a reader (else the GEMM would write it for nothing, and
        // the plan's data flow refuses a write no launch reads): the head's top-K refinement
        // reads the selected rows, every layer's residual reads the stream.
        if g.tensor(x).dtype != DType::F32 || g.consumers(x).len() < 2 {
            continue;
        }
        let rounded = g.graph[c].outs[0];
        // The copy is written at the GEMM, earlier than the cast ran: only into a tensor of
        // its own (no view over another, none over it).
        let own = g.tensor(rounded).alias_of.is_none() && g.tensors.iter().all(|t| t.alias_of != Some(rounded));
        if !own {
            continue;
        }
        out.push(FusionRecord {
            rule: "round_into_gemm".into(),
            fused: names(g, &[l, c]),
            into: g.graph[l].name.clone(),
            launches_saved: 1,
            bytes_saved_per_request: row_bytes(g, x) * rows_per_request(g, x),
        });
        g.graph[l].outs.push(rounded);
        remove(g, &[c]);
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::{resolve, Overrides, Source};
    use crate::graph::{Op, OpGraph, OpKind, Tensor};
    use crate::lower::lower;
    use crate::passes::PASSES;
    use specplan_format::PhaseKind;

    fn tiny() -> (OpGraph, crate::config::Config) {
        let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("tiny resolves");
        let mut g = lower(&cfg, PhaseKind::DraftExtend).expect("lowers");
        // The passes before this one (it sees the graph it sees in the pipeline).
        for (_, pass) in PASSES.iter().take_while(|(n, _)| *n != "round_into_gemm") {
            pass(&mut g, &cfg);
            g.rebuild_edges();
        }
        (g, cfg)
    }

    fn count(g: &OpGraph, kind: &OpKind) -> usize {
        g.graph.node_weights().filter(|op| op.kind == *kind).count()
    }

    fn run(g: &mut OpGraph, cfg: &crate::config::Config) -> Vec<specplan_format::FusionRecord> {
        let r = super::round_into_gemm(g, cfg);
        g.rebuild_edges();
        r
    }

    #[test]
    fn round_into_gemm_folds_each_rounding_once() {
        // tiny (EAGLE-1, two layers, fp32 stream): fc's output into layer 0's input, and
        // the last layer's down projection into hidden_out.
        let (mut g, cfg) = tiny();
        let casts = count(&g, &OpKind::Cast);
        let r = run(&mut g, &cfg);
        assert_eq!(
            r.iter().map(|x| x.into.as_str()).collect::<Vec<_>>(),
            ["fc", "l1.down_proj"]
        );
        assert_eq!(count(&g, &OpKind::Cast), casts - 2);
        for into in ["fc", "l1.down_proj"] {
            let op = g.graph.node_weights().find(|op| op.name == into).expect(into);
            assert_eq!(op.outs.len(), 2, "{into}");
            assert_eq!(g.tensor(op.outs[0]).dtype, specplan_format::DType::F32);
            assert_eq!(g.tensor(op.outs[1]).dtype, cfg.capture.dtype);
        }
        assert!(crate::verify::graph(&g, 4).is_ok());

        // A second rounding of the same output stays a Cast (the GEMM writes one copy).
        let (mut g, cfg) = tiny();
        let cast = g
            .graph
            .node_indices()
            .find(|&n| g.graph[n].kind == OpKind::Cast)
            .expect("a cast");
        let (x, y) = (g.graph[cast].ins[0], g.graph[cast].outs[0]);
        let copy = g.add_tensor(Tensor {
            name: "second_rounding".into(),
            alias_of: None,
            ..g.tensor(y).clone()
        });
        g.add_op(Op {
            name: "second_cast".into(),
            kind: OpKind::Cast,
            ins: vec![x],
            outs: vec![copy],
            rank: 10_000,
        });
        g.rebuild_edges();
        let r = run(&mut g, &cfg);
        assert_eq!(r.len(), 2);
        assert_eq!(count(&g, &OpKind::Cast), casts - 1);
    }
}
