//! The builders every phase's lowering reuses: the embedding, the head's input (`fc` for
//! EAGLE-1/2, `fc` + the two norms for EAGLE-3), one decoder layer over the paged KV cache,
//! and the output head (row select → lm_head → softmax → top-K → id map). Each takes the
//! phase's row dimension from [`Cx`] (never from `num_draft_tokens`): a phase with other
//! rows per request reuses them as they are.

use specplan_format::{io, DType, Entry, HeadKind, KvKind, Packing};

use super::{Builder, Cx, Inputs};
use crate::graph::{Dim, IdMap, OpKind, Storage, TensorId};

/// `embed_tokens[ids]` (the target's embedding in both heads).
pub(super) fn embed(g: &mut Builder, cx: &Cx, inp: &Inputs) -> TensorId {
    let (cfg, t, f) = (cx.cfg, cx.rows, Dim::fixed);
    let m = &cfg.model.desc;
    let act = cfg.capture.dtype;
    // A vocabulary-parallel embedding holds the rank's rows (`capture.tp.vocab_embedding`).
    let tp = cfg.capture.tp;
    let (rows, _) = tp.embedding_rows(m.vocab);
    let embed_w = g.weight("embed_tokens.weight", act, vec![f(rows as u64), f(m.hidden as u64)]);
    let embed_w = if tp.vocab_embedding {
        g.shard(embed_w, 0, tp, tp.size)
    } else {
        embed_w
    };
    let emb = g.act(&cx.n("embeds"), act, vec![t, f(m.hidden as u64)]);
    g.op(&cx.n("embed"), OpKind::Embed, vec![inp.ids, embed_w], vec![emb]);
    emb
}

/// EAGLE-1/2: `x = fc(embed(ids) ‖ hidden) (+ bias)`, the residual stream of layer 0.
pub(super) fn fc(g: &mut Builder, cx: &Cx, inp: &Inputs) -> TensorId {
    let (cfg, t, f) = (cx.cfg, cx.rows, Dim::fixed);
    let m = &cfg.model.desc;
    let act = cfg.capture.dtype;
    let h = m.hidden as u64;
    let emb = embed(g, cx, inp);
    let fc_in = g.act(&cx.n("fc_in"), act, vec![t, f(2 * h)]);
    g.op(&cx.n("concat"), OpKind::Concat, vec![emb, inp.hidden], vec![fc_in]);
    // A vocabulary-parallel embedding: each rank's rows hold its ids' embeddings (zeros for
    // the others) and, past rank 0, zeros for the hidden half; their sum is the input.
    let fc_in = if cfg.capture.tp.vocab_embedding {
        all_reduce(g, fc_in, &cx.n("fc_in_sum"), &cx.n("fc_in_all_reduce"), cx)
    } else {
        fc_in
    };
    let fc_w = g.weight("fc.weight", act, vec![f(h), f(2 * h)]);
    let fc_b = m.fc_bias.then(|| g.weight("fc.bias", act, vec![f(h)]));
    let x = g.act(&cx.n("x"), cx.stream, vec![t, f(h)]);
    g.linear(&cx.n("fc"), fc_in, fc_w, fc_b, x);
    x
}

/// EAGLE-3: `h = fc(hidden)` (`fc.weight [H, 3·H_t]`, no bias), the residual of layer 0,
/// and layer 0's input (`eagle3_input`). Returns `(h, input)`.
pub(super) fn fc3(g: &mut Builder, cx: &Cx, inp: &Inputs) -> (TensorId, TensorId) {
    let (cfg, t, f) = (cx.cfg, cx.rows, Dim::fixed);
    let m = &cfg.model.desc;
    let act = cfg.capture.dtype;
    let h = m.hidden as u64;
    let emb = embed(g, cx, inp);
    let fc_w = g.weight("fc.weight", act, vec![f(h), f(m.hidden_in() as u64)]);
    let x = g.act(&cx.n("x"), cx.stream, vec![t, f(h)]);
    g.linear(&cx.n("fc"), inp.hidden, fc_w, None, x);
    (x, eagle3_input(g, cx, emb, x))
}

/// EAGLE-3's layer-0 input over the stream `x`: `rmsnorm(emb, input_layernorm) ‖
/// rmsnorm(x, hidden_norm)` (draft decode feeds the head's own H-wide hidden here, without
/// fc: SGLang 0.5.23 applies fc only to a wider input, `srt/models/llama_eagle3.py:238-247`).
pub(super) fn eagle3_input(g: &mut Builder, cx: &Cx, emb: TensorId, x: TensorId) -> TensorId {
    let (cfg, t, f) = (cx.cfg, cx.rows, Dim::fixed);
    let m = &cfg.model.desc;
    let act = cfg.capture.dtype;
    let h = m.hidden as u64;
    let w_in = g.weight("midlayer.input_layernorm.weight", act, vec![f(h)]);
    if cfg.capture.tp.vocab_embedding {
        // A vocabulary-parallel embedding: each rank's `embed(ids) ‖ x` (its ids' rows, zeros
        // for the others; x on rank 0 only) summed over the ranks, then both norms.
        let w_hn = g.weight("midlayer.hidden_norm.weight", act, vec![f(h)]);
        let cat = g.act(&cx.n("embeds_x"), act, vec![t, f(2 * h)]);
        g.op(&cx.n("concat"), OpKind::Concat, vec![emb, x], vec![cat]);
        let sum = all_reduce(g, cat, &cx.n("embeds_x_sum"), &cx.n("embeds_x_all_reduce"), cx);
        let a = g.act(&cx.n("l0.in"), act, vec![t, f(2 * h)]);
        g.op(
            &cx.n(Entry::NormConcat.name()),
            OpKind::NormConcat,
            vec![sum, w_in, w_hn],
            vec![a],
        );
        return a;
    }
    let en = g.act(&cx.n("embeds_norm"), act, vec![t, f(h)]);
    g.op(&cx.n("embed_norm"), OpKind::RmsNorm, vec![emb, w_in], vec![en]);
    let w_hn = g.weight("midlayer.hidden_norm.weight", act, vec![f(h)]);
    let hn = g.act(&cx.n("x_norm"), act, vec![t, f(h)]);
    g.op(&cx.n("hidden_norm"), OpKind::RmsNorm, vec![x, w_hn], vec![hn]);
    let a = g.act(&cx.n("l0.in"), act, vec![t, f(2 * h)]);
    g.op(&cx.n("concat"), OpKind::Concat, vec![en, hn], vec![a]);
    a
}

/// One decoder layer over the residual stream `x`; returns the layer's output stream.
/// `input`: the attention's input when it is not the (normed) stream (EAGLE-3's layer 0).
/// `select`: the accept lengths when only the selected row of each request leaves the
/// layer (the draft-extend head's last layer): past the K/V append every op is row-wise, so
/// the attention runs over the query rows `i·R + A_i − 1` alone, the stream's rows are
/// selected for its residual, and o_proj and the MLP run on B rows instead of B·R; the
/// layer then returns those B rows of the stream (`[B, H]`: the head's `hidden_out` output
/// itself when the stream has the activation type, else the fp32 rows `hidden_out`
/// rounds).
pub(super) fn layer(
    g: &mut Builder,
    cx: &Cx,
    inp: &Inputs,
    l: u32,
    x: TensorId,
    input: Option<TensorId>,
    select: Option<TensorId>,
) -> TensorId {
    let (cfg, t, f) = (cx.cfg, cx.rows, Dim::fixed);
    let m = &cfg.model.desc;
    let act = cfg.capture.dtype;
    let (h, inter, d) = (m.hidden as u64, m.intermediate as u64, m.head_dim as u64);
    let (hq, hkv) = (m.heads as u64, m.kv_heads as u64);
    let cache_shape = vec![
        f(cfg.capture.kv_pool_pages as u64),
        f(cfg.capture.page_size as u64),
        f(hkv),
        f(d),
    ];
    // Checkpoint names: EAGLE-3's one layer is `midlayer`.
    let p = match m.head {
        HeadKind::Eagle1 => format!("layers.{l}"),
        HeadKind::Eagle3 => "midlayer".to_string(),
    };
    let w = |g: &mut Builder, name: &str, shape: Vec<Dim>| g.weight(&format!("{p}.{name}.weight"), act, shape);
    let hn = match input {
        Some(a) => a,
        None => layer_input(g, cx, &p, l, x),
    };
    let kin = g.g.tensor(hn).shape[1].fixed;
    // Tensor parallel: q/k/v and gate/up split by rows (column-parallel), o and down by
    // columns (row-parallel, an all-reduce after each); kv heads replicated when T > Hkv.
    let tp = cfg.capture.tp;
    let kvp = cfg.capture.kv_parts;
    let wq = w(g, "self_attn.q_proj", vec![f(hq * d), f(kin)]);
    let wq = g.shard(wq, 0, tp, tp.size);
    let wk = w(g, "self_attn.k_proj", vec![f(hkv * d), f(kin)]);
    // One kv head (T > Hkv = 1): one part, every rank holds k and v whole.
    let wk = g.shard(wk, 0, tp, kvp);
    let wv = w(g, "self_attn.v_proj", vec![f(hkv * d), f(kin)]);
    let wv = g.shard(wv, 0, tp, kvp);
    let q = g.act(&format!("{}l{l}.q", cx.pfx()), act, vec![t, f(hq * d)]);
    let k = g.act(&format!("{}l{l}.k", cx.pfx()), act, vec![t, f(hkv * d)]);
    let v = g.act(&format!("{}l{l}.v", cx.pfx()), act, vec![t, f(hkv * d)]);
    g.linear(&format!("{}l{l}.q_proj", cx.pfx()), hn, wq, None, q);
    g.linear(&format!("{}l{l}.k_proj", cx.pfx()), hn, wk, None, k);
    g.linear(&format!("{}l{l}.v_proj", cx.pfx()), hn, wv, None, v);
    let q_rot = g.act(&format!("{}l{l}.q_rot", cx.pfx()), act, vec![t, f(hq * d)]);
    let k_rot = g.act(&format!("{}l{l}.k_rot", cx.pfx()), act, vec![t, f(hkv * d)]);
    g.op(
        &format!("{}l{l}.rope_q", cx.pfx()),
        OpKind::Rope {
            heads: m.heads,
            step: cx.step,
        },
        vec![q, inp.prefix],
        vec![q_rot],
    );
    g.op(
        &format!("{}l{l}.rope_k", cx.pfx()),
        OpKind::Rope {
            heads: m.kv_heads,
            step: cx.step,
        },
        vec![k, inp.prefix],
        vec![k_rot],
    );
    let cache = |g: &mut Builder, name: String, kind: KvKind| {
        g.tensor(&name, act, cache_shape.clone(), Storage::KvCache { layer: l, kind })
    };
    // The pools as the previous forward of the phase left them (each append is in place
    // over the last, so the forwards' order is in the graph), or as the step found them.
    let (kc, vc) = match g.kv.get(&l) {
        Some(&pair) => pair,
        None => (
            cache(g, format!("{}[{l}]", io::K_CACHE), KvKind::K),
            cache(g, format!("{}[{l}]", io::V_CACHE), KvKind::V),
        ),
    };
    let pfx = cx.pfx();
    let kc2 = cache(g, format!("{pfx}{}[{l}]'", io::K_CACHE), KvKind::K);
    let vc2 = cache(g, format!("{pfx}{}[{l}]'", io::V_CACHE), KvKind::V);
    g.g.tensors[kc2.0 as usize].alias_of = Some(kc);
    g.g.tensors[vc2.0 as usize].alias_of = Some(vc);
    g.kv.insert(l, (kc2, vc2));
    g.op(
        &format!("{}l{l}.kv_append", cx.pfx()),
        OpKind::KvAppend {
            layer: l,
            step: cx.step,
        },
        vec![k_rot, v, inp.prefix, inp.slots, inp.pages, kc, vc],
        vec![kc2, vc2],
    );
    // Past the K/V append every op of a selecting layer is row-wise, so its attention
    // computes the selected query rows only and o_proj, the residual and the MLP run on B
    // rows; every other layer keeps all of its rows.
    let (t, attn_ins) = match select {
        Some(accept) => (
            cx.requests,
            vec![q_rot, kc2, vc2, inp.slots, inp.pages, inp.prefix, accept],
        ),
        None => (t, vec![q_rot, kc2, vc2, inp.slots, inp.pages, inp.prefix]),
    };
    let attn = g.act(&format!("{}l{l}.attn", cx.pfx()), act, vec![t, f(hq * d)]);
    let window = cfg.model.windows.get(l as usize).copied().flatten();
    g.op(
        &format!("{}l{l}.attention", cx.pfx()),
        OpKind::Attention {
            layer: l,
            window,
            step: cx.step,
            select: select.is_some(),
        },
        attn_ins,
        vec![attn],
    );
    let wo = w(g, "self_attn.o_proj", vec![f(h), f(hq * d)]);
    let wo = g.shard(wo, 1, tp, tp.size);
    // The stream's adds accumulate in its dtype: o_proj and down write it.
    let o = g.act(&format!("{}l{l}.o", cx.pfx()), cx.stream, vec![t, f(h)]);
    g.linear(&format!("{}l{l}.o_proj", cx.pfx()), attn, wo, None, o);
    let o = all_reduce(
        g,
        o,
        &format!("{}l{l}.o_sum", cx.pfx()),
        &format!("{}l{l}.o_all_reduce", cx.pfx()),
        cx,
    );
    // The residual's rows: every row, or the selected one per request.
    let x = match select {
        Some(accept) => {
            let sel = g.act(&format!("{}l{l}.x_sel", cx.pfx()), cx.stream, vec![t, f(h)]);
            g.op(Entry::SelectRows.name(), OpKind::SelectRows, vec![x, accept], vec![sel]);
            sel
        }
        None => x,
    };
    let x_attn = g.act(&format!("{}l{l}.x_attn", cx.pfx()), cx.stream, vec![t, f(h)]);
    g.op(
        &format!("{}l{l}.residual_attn", cx.pfx()),
        OpKind::Add,
        vec![x, o],
        vec![x_attn],
    );
    let pw = w(g, "post_attention_layernorm", vec![f(h)]);
    let h2 = g.act(&format!("{}l{l}.h_mlp", cx.pfx()), act, vec![t, f(h)]);
    g.op(
        &format!("{}l{l}.post_norm", cx.pfx()),
        OpKind::RmsNorm,
        vec![x_attn, pw],
        vec![h2],
    );
    let wg = w(g, "mlp.gate_proj", vec![f(inter), f(h)]);
    let wg = g.shard(wg, 0, tp, tp.size);
    let wu = w(g, "mlp.up_proj", vec![f(inter), f(h)]);
    let wu = g.shard(wu, 0, tp, tp.size);
    let gate = g.act(&format!("{}l{l}.gate", cx.pfx()), act, vec![t, f(inter)]);
    let up = g.act(&format!("{}l{l}.up", cx.pfx()), act, vec![t, f(inter)]);
    g.linear(&format!("{}l{l}.gate_proj", cx.pfx()), h2, wg, None, gate);
    g.linear(&format!("{}l{l}.up_proj", cx.pfx()), h2, wu, None, up);
    let ga = g.act(&format!("{}l{l}.gate_act", cx.pfx()), act, vec![t, f(inter)]);
    g.op(&format!("{}l{l}.silu", cx.pfx()), OpKind::Silu, vec![gate], vec![ga]);
    let mid = g.act(&format!("{}l{l}.mlp_mid", cx.pfx()), act, vec![t, f(inter)]);
    g.op(&format!("{}l{l}.mul", cx.pfx()), OpKind::Mul, vec![ga, up], vec![mid]);
    let wd = w(g, "mlp.down_proj", vec![f(h), f(inter)]);
    let wd = g.shard(wd, 1, tp, tp.size);
    let down = g.act(&format!("{}l{l}.down", cx.pfx()), cx.stream, vec![t, f(h)]);
    g.linear(&format!("{}l{l}.down_proj", cx.pfx()), mid, wd, None, down);
    let down = all_reduce(
        g,
        down,
        &format!("{}l{l}.down_sum", cx.pfx()),
        &format!("{}l{l}.down_all_reduce", cx.pfx()),
        cx,
    );
    // An activation-typed stream ends in hidden_out itself; the fp32 one is rounded into it
    // after the layer (`hidden_out`).
    let x_out = match select {
        Some(_) if cx.stream == act => g.output(io::HIDDEN_OUT, act, vec![t, f(h)]),
        _ => g.act(&format!("{}l{l}.x_out", cx.pfx()), cx.stream, vec![t, f(h)]),
    };
    g.op(
        &format!("{}l{l}.residual_mlp", cx.pfx()),
        OpKind::Add,
        vec![x_attn, down],
        vec![x_out],
    );
    x_out
}

/// Layer `l`'s attention input from the stream `x`: EAGLE heads replace layer 0's input norm
/// by the identity (EAGLE-1/2; over the fp32 stream, its rounding) — EAGLE-3's layer 0 has
/// its own input (`eagle3_input`) —, every later layer normalizes x. `p`: the layer's
/// checkpoint prefix.
fn layer_input(g: &mut Builder, cx: &Cx, p: &str, l: u32, x: TensorId) -> TensorId {
    let act = cx.cfg.capture.dtype;
    let (t, h) = (cx.rows, Dim::fixed(cx.cfg.model.desc.hidden as u64));
    if l == 0 && cx.stream == act {
        return x;
    }
    if l == 0 {
        let xin = g.act(&format!("{}l0.x_in", cx.pfx()), act, vec![t, h]);
        g.op(&format!("{}l0.x_cast", cx.pfx()), OpKind::Cast, vec![x], vec![xin]);
        return xin;
    }
    let nw = g.weight(&format!("{p}.input_layernorm.weight"), act, vec![h]);
    let hn = g.act(&format!("{}l{l}.h", cx.pfx()), act, vec![t, h]);
    g.op(
        &format!("{}l{l}.input_norm", cx.pfx()),
        OpKind::RmsNorm,
        vec![x, nw],
        vec![hn],
    );
    hn
}

/// The head's `hidden_out` output from the last layer's selected stream rows `x`: `x` itself
/// when the stream has the activation type, else its one rounding (`cast_rows`).
pub(super) fn hidden_out(g: &mut Builder, cx: &Cx, x: TensorId) -> TensorId {
    let act = cx.cfg.capture.dtype;
    if g.g.tensor(x).dtype == act {
        return x;
    }
    let shape = g.g.tensor(x).shape.clone();
    let out = g.output(io::HIDDEN_OUT, act, shape);
    g.op(&cx.n("hidden_out_cast"), OpKind::Cast, vec![x], vec![out]);
    out
}

/// A sharded plan's sum of every rank's `partial` (a row-parallel GEMM's output), in place;
/// `partial` itself when the plan is unsharded.
fn all_reduce(g: &mut Builder, partial: TensorId, name: &str, op: &str, cx: &Cx) -> TensorId {
    if !cx.cfg.capture.tp.is_sharded() {
        return partial;
    }
    let p = g.g.tensor(partial).clone();
    let sum = g.act(name, p.dtype, p.shape.clone());
    g.g.tensors[sum.0 as usize].alias_of = Some(partial);
    g.op(op, OpKind::AllReduce, vec![partial], vec![sum]);
    sum
}

/// The selected rows (row `i·R + A_i − 1` of each request, selected inside the last layer:
/// `stream` the residual stream's, `hidden_out` their rounding, the same tensor when the
/// stream has the activation type) → lm_head (hot rows under FR-Spec) → softmax → top-K →
/// id map; the logits are an output instead of (or besides) the top-K when
/// `capture.outputs` says so.
pub(super) fn output_head(g: &mut Builder, cx: &Cx, stream: TensorId, hidden_out: TensorId) {
    let (cfg, b, f) = (cx.cfg, cx.requests, Dim::fixed);
    // EAGLE-3: the final norm of the selected rows (read from the stream, unrounded) feeds
    // lm_head; the rows themselves (pre-norm) leave the head. EAGLE-1: lm_head reads
    // hidden_out.
    let lm_in = match cfg.model.desc.head {
        HeadKind::Eagle1 => hidden_out,
        HeadKind::Eagle3 => final_norm(g, cx, stream, b),
    };
    let (lm_w, vh) = lm_head_weight(g, cx);
    // The logits leave the head when the plan emits them (`capture.outputs`); the fused
    // top-K reads the same buffer.
    let outputs = cfg.capture.outputs;
    let tp = cfg.capture.tp;
    let logits = if outputs.logits && tp.is_sharded() {
        // Every rank's share gathered into full rows (the top-K reads the rank's own).
        let local = g.act(&cx.n("logits_local"), DType::F32, vec![b, f(vh)]);
        let t = tp.size as u64;
        let all = g.act(&cx.n("logits_all"), DType::F32, vec![f(t), b, f(vh)]);
        let full = g.output(io::LOGITS, DType::F32, vec![b, f(vh * t)]);
        g.linear(&cx.n("lm_head"), lm_in, lm_w, None, local);
        g.op(
            &cx.n("logits_all_gather"),
            OpKind::AllGather { ranks: tp.size },
            vec![local],
            vec![all],
        );
        g.op(
            &cx.n(Entry::LogitsGather.name()),
            OpKind::LogitsGather { ranks: tp.size },
            vec![all],
            vec![full],
        );
        local
    } else {
        let logits = if outputs.logits {
            g.output(io::LOGITS, DType::F32, vec![b, f(vh)])
        } else {
            g.act(io::LOGITS, DType::F32, vec![b, f(vh)])
        };
        g.linear(&cx.n("lm_head"), lm_in, lm_w, None, logits);
        logits
    };
    if !outputs.topk {
        return;
    }
    let k = cfg.spec.topk as u64;
    let top_p = g.output(io::TOPK_PROBS, DType::F32, vec![b, f(k)]);
    let top_i = g.output(io::TOPK_IDS, DType::I64, vec![b, f(k)]);
    // Ids left unmapped (`topk-draft`): the lm_head's row indices, for an engine that maps
    // them itself.
    // The fp32 stream: the candidates' logits are recomputed from its selected rows.
    let refine: Vec<TensorId> = if cx.stream == DType::F32 {
        let mut ins = vec![stream, lm_w];
        if cfg.model.desc.head == HeadKind::Eagle3 {
            let h = Dim::fixed(cfg.model.desc.hidden as u64);
            ins.push(g.weight("norm.weight", cfg.capture.dtype, vec![h]));
        }
        ins
    } else {
        Vec::new()
    };
    topk(g, cx, logits, b, !outputs.draft_ids, top_p, top_i, &refine);
}

/// Draft decode's head over every lane: (EAGLE-3's final norm →) lm_head → softmax →
/// top-K → target ids (always mapped: the tree holds target ids). Returns `(probs, ids)`,
/// `[T, K]` each.
pub(super) fn lane_head(g: &mut Builder, cx: &Cx, x: TensorId) -> (TensorId, TensorId) {
    let (t, f) = (cx.rows, Dim::fixed);
    let lm_in = final_norm(g, cx, x, t);
    let (lm_w, vh) = lm_head_weight(g, cx);
    let logits = g.act(&cx.n(io::LOGITS), DType::F32, vec![t, f(vh)]);
    g.linear(&cx.n("lm_head"), lm_in, lm_w, None, logits);
    let k = cx.cfg.spec.topk as u64;
    let top_p = g.act(&cx.n("topk_p"), DType::F32, vec![t, f(k)]);
    let top_i = g.act(&cx.n("topk_index"), DType::I64, vec![t, f(k)]);
    topk(g, cx, logits, t, true, top_p, top_i, &[]);
    (top_p, top_i)
}

/// EAGLE-3's final norm of `x` (`rows` rows) before lm_head; EAGLE-1 reads `x` itself.
fn final_norm(g: &mut Builder, cx: &Cx, x: TensorId, rows: Dim) -> TensorId {
    let m = &cx.cfg.model.desc;
    match m.head {
        HeadKind::Eagle1 => x,
        HeadKind::Eagle3 => {
            let act = cx.cfg.capture.dtype;
            let h = Dim::fixed(m.hidden as u64);
            let nw = g.weight("norm.weight", act, vec![h]);
            let normed = g.act(&cx.n("hidden_normed"), act, vec![rows, h]);
            g.op(&cx.n("final_norm"), OpKind::RmsNorm, vec![x, nw], vec![normed]);
            normed
        }
    }
}

/// The lm_head weight and its rows (the hot rows under FR-Spec, the draft vocabulary of an
/// EAGLE-3 head, or the vocabulary).
fn lm_head_weight(g: &mut Builder, cx: &Cx) -> (TensorId, u64) {
    let (w, rows) = lm_head_full(g, cx);
    // Vocabulary parallel: rank r holds rows [r·V/T, (r+1)·V/T) (config::tp checked T
    // divides them).
    let tp = cx.cfg.capture.tp;
    if !tp.is_sharded() {
        return (w, rows);
    }
    let local = rows / tp.size as u64;
    g.g.tensors[w.0 as usize].shape[0] = Dim::fixed(local);
    (g.shard(w, 0, tp, tp.size), local)
}

/// The unsharded lm_head weight and its rows.
fn lm_head_full(g: &mut Builder, cx: &Cx) -> (TensorId, u64) {
    let (cfg, f) = (cx.cfg, Dim::fixed);
    let m = &cfg.model.desc;
    let act = cfg.capture.dtype;
    let h = m.hidden as u64;
    match cfg.capture.hot_vocab_size {
        // A tied EAGLE-3 head reads its lm_head rows from the embedding (one source, bound
        // twice: in place in engine memory, packed twice when the runtime owns the weights):
        // all of it, or its first V_d rows under a draft vocabulary, as SGLang computes it.
        None if cfg.model.tied_lm_head => {
            let packing = if m.lm_vocab() < m.vocab {
                Packing::LeadingRows
            } else {
                Packing::Single
            };
            let shape = vec![f(m.lm_vocab() as u64), f(h)];
            (
                g.weight_from("lm_head.weight", "embed_tokens.weight", packing, act, shape),
                m.lm_vocab() as u64,
            )
        }
        None => (
            g.weight("lm_head.weight", act, vec![f(m.lm_vocab() as u64), f(h)]),
            m.lm_vocab() as u64,
        ),
        Some(vh) => {
            let storage = Storage::Weight {
                sources: vec!["lm_head.weight".into(), "hot_token_ids".into()],
                packing: Packing::GatherRows,
                shard: Vec::new(),
            };
            (
                g.tensor("lm_head.hot", act, vec![f(vh as u64), f(h)], storage),
                vh as u64,
            )
        }
    }
}

/// softmax → top-K of `logits` (`rows` rows) into `top_p`, `top_i`, the ids mapped to target
/// ids (d2t or the FR-Spec hot map) when `map`; `refine_ins`: the refinement's inputs (the
/// fp32 stream's rows, the lm_head weight (, EAGLE-3's final norm weight)), or none.
#[allow(clippy::too_many_arguments)] // the head's tensors, each from output_head or lane_head
fn topk(
    g: &mut Builder,
    cx: &Cx,
    logits: TensorId,
    rows: Dim,
    map: bool,
    top_p: TensorId,
    top_i: TensorId,
    refine_ins: &[TensorId],
) {
    let (cfg, f) = (cx.cfg, Dim::fixed);
    let refine = !refine_ins.is_empty();
    let m = &cfg.model.desc;
    let k = cfg.spec.topk as u64;
    let vh = g.g.tensor(logits).shape[1].fixed;
    let map = if map {
        (cfg.capture.hot_vocab_size, m.draft_vocab)
    } else {
        (None, None)
    };
    if cfg.capture.tp.is_sharded() {
        return rank_topk(g, cx, logits, rows, map, top_p, top_i);
    }
    let probs = g.act(&cx.n("probs"), DType::F32, vec![rows, f(vh)]);
    g.op(&cx.n("softmax"), OpKind::Softmax, vec![logits], vec![probs]);
    let topk_ins: Vec<TensorId> = std::iter::once(probs).chain(refine_ins.iter().copied()).collect();
    match map {
        (None, Some(vd)) => {
            let draft_idx = g.act(&cx.n("topk_draft_ids"), DType::I64, vec![rows, f(k)]);
            g.op(
                &cx.n("topk"),
                OpKind::TopK { k: k as u32, refine },
                topk_ins.clone(),
                vec![top_p, draft_idx],
            );
            let d2t = g.weight("d2t", DType::I64, vec![f(vd as u64)]);
            g.op(
                &cx.n("map_ids"),
                OpKind::MapIds { map: IdMap::Offset },
                vec![draft_idx, d2t],
                vec![top_i],
            );
        }
        (None, None) => {
            g.op(
                &cx.n("topk"),
                OpKind::TopK { k: k as u32, refine },
                topk_ins.clone(),
                vec![top_p, top_i],
            );
        }
        (Some(vh), _) => {
            let hot_idx = g.act(&cx.n("topk_hot_ids"), DType::I64, vec![rows, f(k)]);
            g.op(
                &cx.n("topk"),
                OpKind::TopK { k: k as u32, refine },
                topk_ins.clone(),
                vec![top_p, hot_idx],
            );
            let map = g.weight("hot_token_ids", DType::I64, vec![f(vh as u64)]);
            g.op(
                &cx.n("map_ids"),
                OpKind::MapIds { map: IdMap::Hot },
                vec![hot_idx, map],
                vec![top_i],
            );
        }
    }
}

/// A sharded plan's top-K: this rank's records over its logits columns, every rank's
/// records gathered (2 + 2K floats per chunk and row, never the logits), the global top-K
/// merged from them (ids mapped to target ids by `map`: the hot rows or d2t, both full).
fn rank_topk(
    g: &mut Builder,
    cx: &Cx,
    logits: TensorId,
    rows: Dim,
    map: (Option<u32>, Option<u32>),
    top_p: TensorId,
    top_i: TensorId,
) {
    let (cfg, f) = (cx.cfg, Dim::fixed);
    let tp = cfg.capture.tp;
    let k = cfg.spec.topk;
    let cols = g.g.tensor(logits).shape[1].fixed as u32;
    let chunks = specplan_kernels::facts::rank_topk_chunks(cols, tp.size) as u64;
    // A sharded plan's stream is act: no refinement, so a list holds TOPK candidates.
    let rec = chunks * specplan_kernels::facts::topk_record_floats(k) as u64;
    let records = g.act(&cx.n("topk_records"), DType::F32, vec![rows, f(rec)]);
    g.op(
        &cx.n("topk_records"),
        OpKind::TopKRecords { k },
        vec![logits],
        vec![records],
    );
    let all = g.act(
        &cx.n("topk_records_all"),
        DType::F32,
        vec![f(tp.size as u64), rows, f(rec)],
    );
    g.op(
        &cx.n("topk_all_gather"),
        OpKind::AllGather { ranks: tp.size },
        vec![records],
        vec![all],
    );
    let (ins, id_map) = match map {
        (Some(vh), _) => (
            vec![all, g.weight("hot_token_ids", DType::I64, vec![f(vh as u64)])],
            Some(IdMap::Hot),
        ),
        (None, Some(vd)) => (
            vec![all, g.weight("d2t", DType::I64, vec![f(vd as u64)])],
            Some(IdMap::Offset),
        ),
        (None, None) => (vec![all], None),
    };
    g.op(
        &cx.n(Entry::TopkMerge.name()),
        OpKind::TopKMerge { k, map: id_map },
        ins,
        vec![top_p, top_i],
    );
}
