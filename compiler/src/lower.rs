//! Stage 2: [`Config`] → unfused [`OpGraph`] of the EAGLE draft-extend v2 forward.
//!
//! The graph states the semantics op by op, as the foundation issue writes them:
//! embed(ids) ‖ hidden → fc → layers (identity input norm on layer 0, QKV, RoPE, K/V append,
//! causal paged attention, O + residual, post norm, SiLU(gate)·up, down + residual) →
//! row select i·N + A_i − 1 → lm_head (hot rows under FR-Spec) → softmax → top-K → id map.
//! Every tensor has B·N rows (T) or B rows; nothing here is fused — `passes` does that.

use specplan_format::{io, DType, KvKind, Packing};

use crate::config::Config;
use crate::graph::{Dim, Op, OpGraph, OpKind, Storage, Tensor, TensorId};

struct Builder {
    g: OpGraph,
    rank: u32,
}

impl Builder {
    fn tensor(&mut self, name: &str, dtype: DType, shape: Vec<Dim>, storage: Storage) -> TensorId {
        self.g.add_tensor(Tensor {
            name: name.into(),
            dtype,
            shape,
            storage,
            alias_of: None,
        })
    }
    fn input(&mut self, name: &str, dtype: DType, shape: Vec<Dim>) -> TensorId {
        self.tensor(name, dtype, shape, Storage::Input)
    }
    fn act(&mut self, name: &str, dtype: DType, shape: Vec<Dim>) -> TensorId {
        self.tensor(name, dtype, shape, Storage::Activation { output: false })
    }
    fn output(&mut self, name: &str, dtype: DType, shape: Vec<Dim>) -> TensorId {
        self.tensor(name, dtype, shape, Storage::Activation { output: true })
    }
    fn weight(&mut self, name: &str, dtype: DType, shape: Vec<Dim>) -> TensorId {
        let storage = Storage::Weight {
            sources: vec![name.to_string()],
            packing: Packing::Single,
        };
        self.tensor(name, dtype, shape, storage)
    }
    fn op(&mut self, name: &str, kind: OpKind, ins: Vec<TensorId>, outs: Vec<TensorId>) {
        self.rank += 1;
        self.g.add_op(Op {
            name: name.into(),
            kind,
            ins,
            outs,
            rank: self.rank,
        });
    }
    fn linear(&mut self, name: &str, a: TensorId, w: TensorId, bias: Option<TensorId>, out: TensorId) {
        let mut ins = vec![a, w];
        ins.extend(bias);
        self.op(
            name,
            OpKind::Linear {
                bias: bias.is_some(),
                accumulate: false,
            },
            ins,
            vec![out],
        );
    }
}

/// Builds the unfused op graph.
pub fn lower(cfg: &Config) -> OpGraph {
    let m = &cfg.model.desc;
    let n = cfg.spec.num_draft_tokens as u64;
    let act = cfg.capture.dtype;
    let (h, inter, d) = (m.hidden as u64, m.intermediate as u64, m.head_dim as u64);
    let (hq, hkv) = (m.heads as u64, m.kv_heads as u64);
    let t = Dim::batch(n);
    let b = Dim::batch(1);
    let f = Dim::fixed;
    let mut g = Builder {
        g: OpGraph::default(),
        rank: 0,
    };

    let ids = g.input(io::INPUT_IDS, DType::I64, vec![t]);
    let hidden_in = g.input(io::HIDDEN_STATES, act, vec![t, f(h)]);
    let prefix = g.input(io::PREFIX_LENS, DType::I32, vec![b]);
    let accept = g.input(io::ACCEPT_LENS, DType::I32, vec![b]);
    let slots = g.input(io::REQ_SLOTS, DType::I32, vec![b]);
    let table_rows = cfg.capture.max_requests as u64 + 1;
    let pages = g.tensor(
        "page_table",
        DType::I32,
        vec![f(table_rows), f(cfg.capture.pages_per_request() as u64)],
        Storage::PageTable,
    );

    let embed_w = g.weight("embed_tokens.weight", act, vec![f(m.vocab as u64), f(h)]);
    let emb = g.act("embeds", act, vec![t, f(h)]);
    g.op("embed", OpKind::Embed, vec![ids, embed_w], vec![emb]);
    let fc_in = g.act("fc_in", act, vec![t, f(2 * h)]);
    g.op("concat", OpKind::Concat, vec![emb, hidden_in], vec![fc_in]);
    let fc_w = g.weight("fc.weight", act, vec![f(h), f(2 * h)]);
    let fc_b = m.fc_bias.then(|| g.weight("fc.bias", act, vec![f(h)]));
    let mut x = g.act("x", act, vec![t, f(h)]);
    g.linear("fc", fc_in, fc_w, fc_b, x);

    let cache_shape = vec![
        f(cfg.capture.kv_pool_pages as u64),
        f(cfg.capture.page_size as u64),
        f(hkv),
        f(d),
    ];
    for l in 0..m.layers {
        let p = format!("layers.{l}");
        let w = |g: &mut Builder, name: &str, shape: Vec<Dim>| g.weight(&format!("{p}.{name}.weight"), act, shape);
        // EAGLE heads replace layer 0's input norm by the identity.
        let hn = if l == 0 {
            x
        } else {
            let nw = w(&mut g, "input_layernorm", vec![f(h)]);
            let hn = g.act(&format!("l{l}.h"), act, vec![t, f(h)]);
            g.op(&format!("l{l}.input_norm"), OpKind::RmsNorm, vec![x, nw], vec![hn]);
            hn
        };
        let wq = w(&mut g, "self_attn.q_proj", vec![f(hq * d), f(h)]);
        let wk = w(&mut g, "self_attn.k_proj", vec![f(hkv * d), f(h)]);
        let wv = w(&mut g, "self_attn.v_proj", vec![f(hkv * d), f(h)]);
        let q = g.act(&format!("l{l}.q"), act, vec![t, f(hq * d)]);
        let k = g.act(&format!("l{l}.k"), act, vec![t, f(hkv * d)]);
        let v = g.act(&format!("l{l}.v"), act, vec![t, f(hkv * d)]);
        g.linear(&format!("l{l}.q_proj"), hn, wq, None, q);
        g.linear(&format!("l{l}.k_proj"), hn, wk, None, k);
        g.linear(&format!("l{l}.v_proj"), hn, wv, None, v);
        let q_rot = g.act(&format!("l{l}.q_rot"), act, vec![t, f(hq * d)]);
        let k_rot = g.act(&format!("l{l}.k_rot"), act, vec![t, f(hkv * d)]);
        g.op(
            &format!("l{l}.rope_q"),
            OpKind::Rope { heads: m.heads },
            vec![q, prefix],
            vec![q_rot],
        );
        g.op(
            &format!("l{l}.rope_k"),
            OpKind::Rope { heads: m.kv_heads },
            vec![k, prefix],
            vec![k_rot],
        );
        let kc = g.tensor(
            &format!("k_cache[{l}]"),
            act,
            cache_shape.clone(),
            Storage::KvCache {
                layer: l,
                kind: KvKind::K,
            },
        );
        let vc = g.tensor(
            &format!("v_cache[{l}]"),
            act,
            cache_shape.clone(),
            Storage::KvCache {
                layer: l,
                kind: KvKind::V,
            },
        );
        let kc2 = g.tensor(
            &format!("k_cache[{l}]'"),
            act,
            cache_shape.clone(),
            Storage::KvCache {
                layer: l,
                kind: KvKind::K,
            },
        );
        let vc2 = g.tensor(
            &format!("v_cache[{l}]'"),
            act,
            cache_shape.clone(),
            Storage::KvCache {
                layer: l,
                kind: KvKind::V,
            },
        );
        g.g.tensors[kc2.0 as usize].alias_of = Some(kc);
        g.g.tensors[vc2.0 as usize].alias_of = Some(vc);
        g.op(
            &format!("l{l}.kv_append"),
            OpKind::KvAppend { layer: l },
            vec![k_rot, v, prefix, slots, pages, kc, vc],
            vec![kc2, vc2],
        );
        let attn = g.act(&format!("l{l}.attn"), act, vec![t, f(hq * d)]);
        let window = cfg.model.windows.get(l as usize).copied().flatten();
        g.op(
            &format!("l{l}.attention"),
            OpKind::Attention { layer: l, window },
            vec![q_rot, kc2, vc2, slots, pages, prefix],
            vec![attn],
        );
        let wo = w(&mut g, "self_attn.o_proj", vec![f(h), f(hq * d)]);
        let o = g.act(&format!("l{l}.o"), act, vec![t, f(h)]);
        g.linear(&format!("l{l}.o_proj"), attn, wo, None, o);
        let x_attn = g.act(&format!("l{l}.x_attn"), act, vec![t, f(h)]);
        g.op(&format!("l{l}.residual_attn"), OpKind::Add, vec![x, o], vec![x_attn]);
        let pw = w(&mut g, "post_attention_layernorm", vec![f(h)]);
        let h2 = g.act(&format!("l{l}.h_mlp"), act, vec![t, f(h)]);
        g.op(&format!("l{l}.post_norm"), OpKind::RmsNorm, vec![x_attn, pw], vec![h2]);
        let wg = w(&mut g, "mlp.gate_proj", vec![f(inter), f(h)]);
        let wu = w(&mut g, "mlp.up_proj", vec![f(inter), f(h)]);
        let gate = g.act(&format!("l{l}.gate"), act, vec![t, f(inter)]);
        let up = g.act(&format!("l{l}.up"), act, vec![t, f(inter)]);
        g.linear(&format!("l{l}.gate_proj"), h2, wg, None, gate);
        g.linear(&format!("l{l}.up_proj"), h2, wu, None, up);
        let ga = g.act(&format!("l{l}.gate_act"), act, vec![t, f(inter)]);
        g.op(&format!("l{l}.silu"), OpKind::Silu, vec![gate], vec![ga]);
        let mid = g.act(&format!("l{l}.mlp_mid"), act, vec![t, f(inter)]);
        g.op(&format!("l{l}.mul"), OpKind::Mul, vec![ga, up], vec![mid]);
        let wd = w(&mut g, "mlp.down_proj", vec![f(h), f(inter)]);
        let down = g.act(&format!("l{l}.down"), act, vec![t, f(h)]);
        g.linear(&format!("l{l}.down_proj"), mid, wd, None, down);
        let x_out = g.act(&format!("l{l}.x_out"), act, vec![t, f(h)]);
        g.op(
            &format!("l{l}.residual_mlp"),
            OpKind::Add,
            vec![x_attn, down],
            vec![x_out],
        );
        x = x_out;
    }

    let hidden_out = g.output(io::HIDDEN_OUT, act, vec![b, f(h)]);
    g.op("select_rows", OpKind::SelectRows, vec![x, accept], vec![hidden_out]);
    let k = cfg.spec.topk as u64;
    let (lm_w, vh) = match cfg.capture.hot_vocab_size {
        None => (
            g.weight("lm_head.weight", act, vec![f(m.vocab as u64), f(h)]),
            m.vocab as u64,
        ),
        Some(vh) => {
            let storage = Storage::Weight {
                sources: vec!["lm_head.weight".into(), "hot_token_ids".into()],
                packing: Packing::GatherRows,
            };
            (
                g.tensor("lm_head.hot", act, vec![f(vh as u64), f(h)], storage),
                vh as u64,
            )
        }
    };
    let logits = g.act("logits", DType::F32, vec![b, f(vh)]);
    g.linear("lm_head", hidden_out, lm_w, None, logits);
    let probs = g.act("probs", DType::F32, vec![b, f(vh)]);
    g.op("softmax", OpKind::Softmax, vec![logits], vec![probs]);
    let top_p = g.output(io::TOPK_PROBS, DType::F32, vec![b, f(k)]);
    match cfg.capture.hot_vocab_size {
        None => {
            let top_i = g.output(io::TOPK_IDS, DType::I64, vec![b, f(k)]);
            g.op("topk", OpKind::TopK { k: k as u32 }, vec![probs], vec![top_p, top_i]);
        }
        Some(vh) => {
            let hot_idx = g.act("topk_hot_ids", DType::I64, vec![b, f(k)]);
            g.op("topk", OpKind::TopK { k: k as u32 }, vec![probs], vec![top_p, hot_idx]);
            let map = g.weight("hot_token_ids", DType::I64, vec![f(vh as u64)]);
            let top_i = g.output(io::TOPK_IDS, DType::I64, vec![b, f(k)]);
            g.op("map_ids", OpKind::MapIds, vec![hot_idx, map], vec![top_i]);
        }
    }
    g.g.rebuild_edges();
    g.g
}
