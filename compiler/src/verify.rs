//! Graph verification, separate from every transformation.
//!
//! Rules:
//! 1. The graph is acyclic (a cycle is reported at the op that closes it).
//! 2. Every tensor has at most one producer; inputs, weights and caches have none, and every
//!    activation an op reads has a producer.
//! 3. Every op has the operand arity its kind requires, and each operand the dtype and the
//!    shape (affine in B) the kind requires — the table is `check_op`.
//! 4. An in-place output has its alias's dtype and shape, except a column view: the
//!    SwiGLU product written in the gate half of its gate/up rows (`[T, I]` over
//!    `[T, 2I]`), which only a GEMM's A operand may read (the GEMM reads it with the row
//!    stride of its storage; no kernel takes a strided operand).
//!
//! Errors name the node (`n7 l0.attention`) and the operand.

use crate::graph::{Dim, OpGraph, OpKind, Storage, TensorId};
use petgraph::stable_graph::NodeIndex;
use specplan_format::DType;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("graph verification failed:\n{}", .0.join("\n"))]
pub struct VerifyError(pub Vec<String>);

pub fn graph(g: &OpGraph, n_rows: u64) -> Result<(), VerifyError> {
    let mut errs = Vec::new();
    if let Err(n) = g.topo_order() {
        errs.push(format!("n{} {}: part of a cycle", n.index(), g.graph[n].name));
        return Err(VerifyError(errs));
    }
    let mut producer: Vec<Option<NodeIndex>> = vec![None; g.tensors.len()];
    for n in g.graph.node_indices() {
        for &t in &g.graph[n].outs {
            let at = format!("n{} {}", n.index(), g.graph[n].name);
            match producer[t.0 as usize] {
                Some(p) => errs.push(format!(
                    "{at}: output %{} already produced by n{}",
                    g.tensor(t).name,
                    p.index()
                )),
                None => producer[t.0 as usize] = Some(n),
            }
            if matches!(g.tensor(t).storage, Storage::Input | Storage::Weight { .. }) {
                errs.push(format!(
                    "{at}: writes %{}, which is an input or a weight",
                    g.tensor(t).name
                ));
            }
            if let Some(a) = g.tensor(t).alias_of {
                let (x, y) = (g.tensor(t), g.tensor(a));
                // A SwiGLU product's view is checked with its op (`check_op`).
                let view = g.graph[n].kind == OpKind::SiluMul;
                if x.dtype != y.dtype || (x.shape != y.shape && !view) {
                    errs.push(format!(
                        "{at}: in-place %{} does not match %{} in dtype or shape",
                        x.name, y.name
                    ));
                }
            }
        }
    }
    for n in g.graph.node_indices() {
        let op = &g.graph[n];
        let at = format!("n{} {}", n.index(), op.name);
        for (i, &t) in op.ins.iter().enumerate() {
            let tensor = g.tensor(t);
            if matches!(tensor.storage, Storage::Activation { .. }) && producer[t.0 as usize].is_none() {
                errs.push(format!("{at}: reads %{}, which no op produces", tensor.name));
            }
            let gemm_a = i == 0 && matches!(op.kind, OpKind::Linear { .. });
            if g.is_column_view(t) && !gemm_a {
                errs.push(format!(
                    "{at}: reads %{}, a column view of its storage, as operand {i} (only a GEMM's A may)",
                    tensor.name
                ));
            }
        }
        if let Err(msg) = check_op(g, &op.kind, &op.ins, &op.outs, n_rows) {
            errs.push(format!("{at} ({}): {msg}", op.kind.mnemonic()));
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(VerifyError(errs))
    }
}

struct Ctx<'a> {
    g: &'a OpGraph,
    ins: &'a [TensorId],
    outs: &'a [TensorId],
}

impl Ctx<'_> {
    fn arity(&self, ins: usize, outs: usize) -> Result<(), String> {
        if self.ins.len() != ins || self.outs.len() != outs {
            return Err(format!(
                "expects {ins} inputs and {outs} outputs, has {} and {}",
                self.ins.len(),
                self.outs.len()
            ));
        }
        Ok(())
    }
    fn t(&self, out: bool, i: usize) -> &crate::graph::Tensor {
        self.g.tensor(if out { self.outs[i] } else { self.ins[i] })
    }
    fn shape(&self, out: bool, i: usize) -> &[Dim] {
        &self.t(out, i).shape
    }
    fn dtype(&self, out: bool, i: usize, want: &[DType]) -> Result<(), String> {
        let t = self.t(out, i);
        if want.contains(&t.dtype) {
            Ok(())
        } else {
            let w: Vec<&str> = want.iter().map(|d| d.name()).collect();
            Err(format!(
                "%{} is {}, expected {}",
                t.name,
                t.dtype.name(),
                w.join(" or ")
            ))
        }
    }
    fn rank2(&self, out: bool, i: usize) -> Result<(Dim, Dim), String> {
        match self.shape(out, i) {
            [a, b] => Ok((*a, *b)),
            s => Err(format!("%{} has rank {}, expected 2", self.t(out, i).name, s.len())),
        }
    }
    fn same(&self, a: (bool, usize), b: (bool, usize)) -> Result<(), String> {
        if self.shape(a.0, a.1) != self.shape(b.0, b.1) {
            return Err(format!(
                "%{} {} and %{} {} differ in shape",
                self.t(a.0, a.1).name,
                fmt(self.shape(a.0, a.1)),
                self.t(b.0, b.1).name,
                fmt(self.shape(b.0, b.1))
            ));
        }
        Ok(())
    }
}

fn fmt(s: &[Dim]) -> String {
    format!("[{}]", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","))
}

fn want(ok: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(msg())
    }
}

const ACT: [DType; 2] = [DType::Bf16, DType::F16];

/// The element-wise ops: operands and output of one shape (the cast from the fp32 stream to
/// the activation type).
fn check_elementwise(c: &Ctx, kind: &OpKind) -> Result<(), String> {
    match kind {
        OpKind::Add | OpKind::Mul => {
            c.arity(2, 1)?;
            c.same((false, 0), (false, 1))?;
        }
        OpKind::Cast => {
            c.arity(1, 1)?;
            c.dtype(false, 0, &[DType::F32])?;
            c.dtype(true, 0, &ACT)?;
        }
        _ => c.arity(1, 1)?,
    }
    c.same((false, 0), (true, 0))
}

/// Top-K (and the fused softmax + top-K): probabilities or logits in, values and ids out;
/// the id map and the refinement's inputs (`OpKind::TopK`) after the first.
fn check_topk(c: &Ctx, kind: &OpKind, ins: &[TensorId]) -> Result<(), String> {
    let (OpKind::TopK { k, refine } | OpKind::SoftmaxTopK { k, refine, .. }) = kind else {
        return Err("not a top-K".into());
    };
    let hot = matches!(kind, OpKind::SoftmaxTopK { map: Some(_), .. });
    let base = 1 + hot as usize;
    // The refinement's x, lm_w (, norm_w): x [B,H] f32, lm_w [V,H].
    if *refine {
        want(ins.len() == base + 2 || ins.len() == base + 3, || {
            format!(
                "{} inputs, expected {} or {} with the refinement",
                ins.len(),
                base + 2,
                base + 3
            )
        })?;
        c.arity(ins.len(), 2)?;
        c.dtype(false, base, &[DType::F32])?;
        c.dtype(false, base + 1, &ACT)?;
        let (rows, v) = c.rank2(false, 0)?;
        let (xr, h) = c.rank2(false, base)?;
        want(xr == rows, || format!("x must have the logits' {rows} rows"))?;
        want(c.shape(false, base + 1) == [v, h], || {
            format!("lm_w must be [{v}, {h}]")
        })?;
        if ins.len() == base + 3 {
            want(c.shape(false, base + 2) == [h], || format!("norm_w must be [{h}]"))?;
        }
    } else {
        c.arity(base, 2)?;
    }
    c.dtype(false, 0, &[DType::F32])?;
    let (b, v) = c.rank2(false, 0)?;
    want(v.fixed >= *k as u64, || {
        format!("top-{k} over only {} columns", v.fixed)
    })?;
    want(
        c.shape(true, 0) == [b, Dim::fixed(*k as u64)] && c.shape(true, 1) == [b, Dim::fixed(*k as u64)],
        || "outputs must be [B, K]".into(),
    )?;
    c.dtype(true, 0, &[DType::F32])?;
    c.dtype(true, 1, &[DType::I64])?;
    if hot {
        want(c.shape(false, 1) == [v], || format!("hot map must be [{v}]"))?;
    }
    Ok(())
}

/// The per-kind operand rules.
fn check_op(g: &OpGraph, kind: &OpKind, ins: &[TensorId], outs: &[TensorId], n_rows: u64) -> Result<(), String> {
    let c = Ctx { g, ins, outs };
    let rows = Dim::batch(n_rows);
    let batch = Dim::batch(1);
    match kind {
        OpKind::Embed => {
            c.arity(2, 1)?;
            c.dtype(false, 0, &[DType::I64])?;
            let (_, h) = c.rank2(false, 1)?;
            want(c.shape(true, 0) == [c.shape(false, 0)[0], h], || {
                "output must be [T, hidden]".into()
            })
        }
        OpKind::Concat => {
            c.arity(2, 1)?;
            let (ra, a) = c.rank2(false, 0)?;
            let (rb, b) = c.rank2(false, 1)?;
            want(
                ra == rb && c.shape(true, 0) == [ra, Dim::fixed(a.fixed + b.fixed)],
                || "output must be [T, X+Y]".into(),
            )
        }
        OpKind::Linear { bias, accumulate } => {
            // A second output: the first, f32, rounded to the activation type
            // (`round_into_gemm`).
            let rounded = outs.len() == 2;
            c.arity(2 + *bias as usize + *accumulate as usize, 1 + rounded as usize)?;
            if rounded {
                c.dtype(true, 0, &[DType::F32])?;
                c.dtype(true, 1, &ACT)?;
                c.same((true, 0), (true, 1))?;
            }
            let (m, k) = c.rank2(false, 0)?;
            let (n, k2) = c.rank2(false, 1)?;
            want(k == k2, || {
                format!("in-features {} of the weight do not match the input's {}", k2, k)
            })?;
            want(c.shape(true, 0) == [m, n], || {
                format!("output must be [{m}, {n}], is {}", fmt(c.shape(true, 0)))
            })?;
            if *bias {
                want(c.shape(false, 2) == [n], || format!("bias must be [{n}]"))?;
            }
            if *accumulate {
                let acc = ins.len() - 1;
                c.same((false, acc), (true, 0))?;
                want(g.tensor(outs[0]).alias_of == Some(ins[acc]), || {
                    "accumulating output must be in place over its addend".into()
                })?;
            }
            c.dtype(false, 0, &ACT)
        }
        OpKind::RmsNorm => {
            c.arity(2, 1)?;
            let (_, h) = c.rank2(false, 0)?;
            want(c.shape(false, 1) == [h], || format!("weight must be [{h}]"))?;
            c.same((false, 0), (true, 0))
        }
        OpKind::NormCast => {
            // The fp32 stream's rows: their norm (the weight's type) and their rounding
            // (the activation type), each of the rows' shape.
            c.arity(2, 2)?;
            c.dtype(false, 0, &[DType::F32])?;
            let (_, h) = c.rank2(false, 0)?;
            want(c.shape(false, 1) == [h], || format!("weight must be [{h}]"))?;
            // The kernel writes both outputs as the activation type: the weight's type must be it.
            c.dtype(false, 1, &ACT)?;
            c.dtype(true, 1, &ACT)?;
            c.dtype(true, 0, &[g.tensor(outs[1]).dtype])?;
            c.same((false, 0), (true, 0))?;
            c.same((false, 0), (true, 1))
        }
        OpKind::Add | OpKind::Mul | OpKind::Silu | OpKind::Cast => check_elementwise(&c, kind),
        OpKind::Rope { .. } => {
            c.arity(2, 1)?;
            c.dtype(false, 1, &[DType::I32])?;
            want(c.shape(false, 0)[0] == rows, || format!("rows must be {rows}"))?;
            c.same((false, 0), (true, 0))
        }
        OpKind::KvAppend { .. } => {
            c.arity(7, 2)?;
            for i in 2..5 {
                c.dtype(false, i, &[DType::I32])?;
            }
            c.same((false, 0), (false, 1))?;
            c.same((false, 5), (true, 0))?;
            c.same((false, 6), (true, 1))
        }
        OpKind::RopeAppend { .. } => {
            c.arity(6, 3)?;
            for i in 1..4 {
                c.dtype(false, i, &[DType::I32])?;
            }
            c.same((false, 0), (true, 0))?;
            c.same((false, 4), (true, 1))?;
            c.same((false, 5), (true, 2))
        }
        OpKind::Attention { select, .. } => {
            // Over the selected query rows: accept_lens too, and one output row a request.
            let (arity, out_rows) = if *select { (7, batch) } else { (6, rows) };
            c.arity(arity, 1)?;
            let (r, qcols) = c.rank2(false, 0)?;
            let (ro, ocols) = c.rank2(true, 0)?;
            want(r == rows && ro == out_rows, || {
                format!("query rows must be {rows}, output rows {out_rows}")
            })?;
            want(qcols.fixed >= ocols.fixed, || "queries narrower than the output".into())?;
            for i in 3..arity {
                c.dtype(false, i, &[DType::I32])?;
            }
            Ok(())
        }
        OpKind::SiluMul | OpKind::SiluMulPairs | OpKind::SelectNorm | OpKind::SelectNormPairs => {
            check_mlp_rows(&c, kind, rows)
        }
        OpKind::EmbedConcat { bias } => {
            c.arity(3 + *bias as usize, 1 + *bias as usize)?;
            c.dtype(false, 0, &[DType::I64])?;
            let (_, h) = c.rank2(false, 1)?;
            want(c.shape(false, 2) == [rows, h], || {
                format!("hidden must be [{rows}, {h}]")
            })?;
            want(c.shape(true, 0) == [rows, Dim::fixed(2 * h.fixed)], || {
                "output must be [T, 2H]".into()
            })?;
            if *bias {
                let (_, hb) = c.rank2(true, 1)?;
                want(c.shape(false, 3) == [hb], || format!("bias must be [{hb}]"))?;
            }
            Ok(())
        }
        OpKind::SelectRows => {
            c.arity(2, 1)?;
            let (r, h) = c.rank2(false, 0)?;
            want(r == rows, || format!("input rows must be {rows}"))?;
            c.dtype(false, 1, &[DType::I32])?;
            c.dtype(true, 0, &[g.tensor(ins[0]).dtype])?;
            want(c.shape(true, 0) == [batch, h], || format!("output must be [B, {h}]"))
        }
        OpKind::Softmax => {
            c.arity(1, 1)?;
            c.dtype(false, 0, &[DType::F32])?;
            c.same((false, 0), (true, 0))
        }
        OpKind::TopK { .. } | OpKind::SoftmaxTopK { .. } => check_topk(&c, kind, ins),
        OpKind::AllReduce
        | OpKind::TopKRecords { .. }
        | OpKind::AllGather { .. }
        | OpKind::TopKMerge { .. }
        | OpKind::LogitsGather { .. }
        | OpKind::NormConcat => check_tp_op(&c, kind),
        OpKind::MapIds { .. } => {
            c.arity(2, 1)?;
            c.dtype(false, 0, &[DType::I64])?;
            c.dtype(false, 1, &[DType::I64])?;
            c.same((false, 0), (true, 0))
        }
        OpKind::EmbedNormConcat => {
            c.arity(5, 1)?;
            c.dtype(false, 0, &[DType::I64])?;
            let (_, h) = c.rank2(false, 1)?;
            for (i, what) in [(2, "w_embed"), (4, "w_hidden")] {
                want(c.shape(false, i) == [h], || format!("{what} must be [{h}]"))?;
            }
            want(c.shape(false, 3) == [rows, h], || format!("h must be [{rows}, {h}]"))?;
            want(c.shape(true, 0) == [rows, Dim::fixed(2 * h.fixed)], || {
                "output must be [T, 2H]".into()
            })
        }
        OpKind::TreeInit
        | OpKind::TreeSelect { .. }
        | OpKind::TreeFinish
        | OpKind::TreeVerify
        | OpKind::GatherRows { .. } => check_tree_op(&c, kind, rows),
    }
}

/// The selected rows' addend (the o projection of their attention): `[B, h]` in the
/// stream's dtype.
fn check_addend(c: &Ctx, g: &OpGraph, ins: &[TensorId], batch: Dim, h: Dim) -> Result<(), String> {
    c.dtype(false, 3, &[g.tensor(ins[0]).dtype])?;
    want(c.shape(false, 3) == [batch, h], || {
        format!("the addend must be [B, {h}]")
    })
}

/// The SwiGLU product and the selected rows' norm, each as in place or as hi/lo pairs.
fn check_mlp_rows(c: &Ctx, kind: &OpKind, rows: Dim) -> Result<(), String> {
    let (g, ins, outs) = (c.g, c.ins, c.outs);
    let batch = Dim::batch(1);
    match kind {
        OpKind::SiluMul => {
            c.arity(1, 1)?;
            let (r, cols) = c.rank2(false, 0)?;
            want(
                c.shape(true, 0) == [r, Dim::fixed(cols.fixed / 2)] && cols.fixed % 2 == 0,
                || "output must be [T, I] for input [T, 2I]".into(),
            )?;
            want(g.tensor(outs[0]).alias_of == Some(ins[0]), || {
                "the product is written in place over the gate half of its input".into()
            })
        }
        OpKind::SelectNorm => {
            // The selected rows, then their norm; the norm alone on a tensor-parallel rank
            // other than 0 (`residual_into_all_reduce`).
            let n_out = if outs.len() == 1 { 1 } else { 2 };
            c.arity(4, n_out)?;
            let (r, h) = c.rank2(false, 0)?;
            want(r == rows, || format!("input rows must be {rows}"))?;
            c.dtype(false, 1, &[DType::I32])?;
            want(c.shape(false, 2) == [h], || format!("weight must be [{h}]"))?;
            check_addend(c, g, ins, batch, h)?;
            // The selected rows keep the stream's dtype; the norm is the GEMM's input.
            if n_out == 2 {
                c.dtype(true, 0, &[g.tensor(ins[0]).dtype])?;
            }
            want((0..n_out).all(|i| c.shape(true, i) == [batch, h]), || {
                format!("outputs must be [B, {h}]")
            })
        }
        OpKind::SelectNormPairs => {
            c.arity(4, 2)?;
            let (r, h) = c.rank2(false, 0)?;
            want(r == rows, || format!("input rows must be {rows}"))?;
            c.dtype(false, 1, &[DType::I32])?;
            want(c.shape(false, 2) == [h], || format!("weight must be [{h}]"))?;
            check_addend(c, g, ins, batch, h)?;
            c.dtype(true, 0, &[g.tensor(ins[0]).dtype])?;
            c.dtype(true, 1, &[g.tensor(ins[2]).dtype])?;
            want(c.shape(true, 0) == [batch, h], || {
                format!("the selected rows must be [B, {h}]")
            })?;
            want(c.shape(true, 1) == [Dim::batch(2), h], || {
                format!("the norm's hi/lo pairs must be [2B, {h}]")
            })
        }
        OpKind::SiluMulPairs => {
            c.arity(1, 1)?;
            c.dtype(false, 0, &[DType::F32])?;
            let (r, cols) = c.rank2(false, 0)?;
            want(r == Dim::batch(2) && cols.fixed % 2 == 0, || {
                format!("input must be the pairs' [2B, 2I] f32, is [{r}, {cols}]")
            })?;
            want(c.shape(true, 0) == [batch, Dim::fixed(cols.fixed / 2)], || {
                "output must be [B, I] for input [2B, 2I]".into()
            })?;
            want(g.tensor(outs[0]).alias_of.is_none(), || {
                "the product has its own buffer (its type differs from the input's)".into()
            })
        }
        _ => Err(format!("{} is not an MLP-row op", kind.mnemonic())),
    }
}

/// A sharded plan's ops: the collectives and the cross-rank top-K.
fn check_tp_op(c: &Ctx, kind: &OpKind) -> Result<(), String> {
    let (g, ins, outs) = (c.g, c.ins, c.outs);
    match kind {
        OpKind::AllReduce => {
            c.arity(1, 1)?;
            c.same((false, 0), (true, 0))?;
            want(g.tensor(outs[0]).alias_of == Some(ins[0]), || {
                "an all-reduce is in place over its input".into()
            })
        }
        OpKind::TopKRecords { k } => {
            c.arity(1, 1)?;
            c.dtype(false, 0, &[DType::F32])?;
            c.dtype(true, 0, &[DType::F32])?;
            let (m, v) = c.rank2(false, 0)?;
            let (m2, _) = c.rank2(true, 0)?;
            want(m == m2, || "records must have the logits' rows".into())?;
            want(v.fixed >= 1 && *k >= 1, || "no columns or k = 0".into())
        }
        OpKind::AllGather { ranks } => {
            c.arity(1, 1)?;
            let x = c.shape(false, 0);
            let mut want_shape = vec![Dim::fixed(*ranks as u64)];
            want_shape.extend(x.iter().copied());
            c.dtype(true, 0, &[g.tensor(ins[0]).dtype])?;
            want(c.shape(true, 0) == want_shape.as_slice(), || {
                format!("output must be [{ranks}, {}]", fmt(x))
            })
        }
        OpKind::TopKMerge { k, map } => {
            c.arity(1 + map.is_some() as usize, 2)?;
            c.dtype(false, 0, &[DType::F32])?;
            let rec = c.shape(false, 0);
            want(rec.len() == 3, || "records must be [ranks, M, X]".into())?;
            let b = rec[1];
            let kd = Dim::fixed(*k as u64);
            want(c.shape(true, 0) == [b, kd] && c.shape(true, 1) == [b, kd], || {
                "outputs must be [M, K]".into()
            })?;
            c.dtype(true, 0, &[DType::F32])?;
            c.dtype(true, 1, &[DType::I64])?;
            if map.is_some() {
                c.dtype(false, 1, &[DType::I64])?;
            }
            Ok(())
        }
        OpKind::NormConcat => {
            c.arity(3, 1)?;
            let (_, w2) = c.rank2(false, 0)?;
            let h = Dim::fixed(w2.fixed / 2);
            want(c.shape(false, 1) == [h] && c.shape(false, 2) == [h], || {
                format!("weights must be [{h}]")
            })?;
            c.same((false, 0), (true, 0))
        }
        OpKind::LogitsGather { ranks } => {
            c.arity(1, 1)?;
            c.dtype(false, 0, &[DType::F32])?;
            c.dtype(true, 0, &[DType::F32])?;
            let x = c.shape(false, 0);
            want(x.len() == 3 && x[0] == Dim::fixed(*ranks as u64), || {
                format!("input must be [{ranks}, M, C]")
            })?;
            let (m, cols) = (x[1], x[2].fixed);
            want(c.shape(true, 0) == [m, Dim::fixed(cols * *ranks as u64)], || {
                format!("output must be [M, {ranks}·C]")
            })
        }
        _ => Ok(()),
    }
}

/// Draft decode's tree ops.
fn check_tree_op(c: &Ctx, kind: &OpKind, rows: Dim) -> Result<(), String> {
    let (g, ins, outs) = (c.g, c.ins, c.outs);
    match kind {
        OpKind::TreeInit => {
            want(ins.len() == 2 && (outs.len() == 5 || outs.len() == 6), || {
                format!(
                    "expected 2 inputs and 5 or 6 outputs, got {} and {}",
                    ins.len(),
                    outs.len()
                )
            })?;
            let (b, k) = c.rank2(false, 0)?;
            want(c.shape(false, 1) == [b, k], || format!("topk_ids must be [{b}, {k}]"))?;
            c.dtype(false, 0, &[DType::F32])?;
            c.dtype(false, 1, &[DType::I64])?;
            want(c.shape(true, 0) == [b, k], || format!("scores must be [{b}, {k}]"))?;
            want(c.shape(true, 1) == [rows], || format!("ids must be [{rows}]"))?;
            for (i, t) in [
                (0, DType::F32),
                (1, DType::I64),
                (2, DType::F32),
                (3, DType::I64),
                (4, DType::I64),
            ] {
                c.dtype(true, i, &[t])?;
            }
            if outs.len() == 6 {
                c.dtype(true, 5, &[DType::I32])?;
                want(c.shape(true, 5) == [rows], || format!("src must be [{rows}]"))?;
            }
            Ok(())
        }
        OpKind::TreeSelect { .. } => {
            want(ins.len() == 6 && [2, 5, 6].contains(&outs.len()), || {
                format!(
                    "expected 6 inputs and 2, 5 or 6 outputs, got {} and {}",
                    ins.len(),
                    outs.len()
                )
            })?;
            let (b, k) = c.rank2(false, 0)?;
            want(c.shape(false, 1) == [rows, k] && c.shape(false, 2) == [rows, k], || {
                format!("probs and ids must be [{rows}, {k}]")
            })?;
            c.dtype(false, 1, &[DType::F32])?;
            c.dtype(false, 2, &[DType::I64])?;
            for (o, i) in [(0, 3), (1, 4)] {
                want(g.tensor(outs[o]).alias_of == Some(ins[i]), || {
                    "the lists are written in place".into()
                })?;
            }
            if outs.len() >= 5 {
                want(g.tensor(outs[2]).alias_of == Some(ins[5]), || {
                    "parent_list is written in place".into()
                })?;
                want(c.shape(true, 3) == [b, k] && c.shape(true, 4) == [rows], || {
                    format!("scores must be [{b}, {k}] and ids [{rows}]")
                })?;
            }
            Ok(())
        }
        OpKind::TreeVerify => {
            c.arity(5, 6)?;
            let (b, _) = c.rank2(false, 0)?;
            let (bo, nodes) = c.rank2(false, 1)?;
            want(bo == b && c.shape(false, 2) == [b, nodes], || {
                format!("top_scores_index and draft_tokens must be [{b}, N-1]")
            })?;
            want(c.shape(false, 3) == [b] && c.shape(false, 4) == [b], || {
                format!("bonus_tokens and prefix_lens must be [{b}]")
            })?;
            let n = Dim::fixed(nodes.fixed + 1);
            for o in 0..5 {
                want(c.shape(true, o) == [b, n], || format!("output {o} must be [{b}, N]"))?;
                c.dtype(true, o, &[DType::I64])?;
            }
            want(c.shape(true, 5) == [b, n, n], || {
                format!("the mask must be [{b}, N, N]")
            })?;
            for i in 0..4 {
                c.dtype(false, i, &[DType::I64])?;
            }
            c.dtype(false, 4, &[DType::I32])?;
            c.dtype(true, 5, &[DType::I32])
        }
        OpKind::TreeFinish => {
            c.arity(2, 2)?;
            let (b, cands) = c.rank2(false, 0)?;
            want(c.shape(false, 1) == [b, cands], || {
                "the lists must have one shape".into()
            })?;
            let (bo, nodes) = c.rank2(true, 0)?;
            want(
                bo == b && nodes.fixed <= cands.fixed && c.shape(true, 1) == [b, nodes],
                || format!("outputs must be [{b}, at most {}]", cands.fixed),
            )?;
            c.dtype(true, 0, &[DType::I64])?;
            c.dtype(true, 1, &[DType::I64])
        }
        OpKind::GatherRows { .. } => {
            c.arity(2, 1)?;
            let (_, h) = c.rank2(false, 0)?;
            c.dtype(false, 1, &[DType::I32])?;
            want(c.shape(false, 1) == [rows] && c.shape(true, 0) == [rows, h], || {
                format!("src must be [{rows}] and the output [{rows}, {h}]")
            })
        }
        _ => Ok(()),
    }
}
