//! The draft-decode phase at S steps: SGLang 0.5.23's `draft_forward`
//! (`srt/speculative/eagle_worker_v2.py:742-923`) in one graph. The root's K children come
//! from draft-extend's top-K (`tree_init`); then S − 1 forwards of the draft model over K
//! lanes per request — lane k's token, and as its hidden the output row of the lane it
//! descends from (`gather_rows`), at position L + step, its K/V in the lane's own slot,
//! attending the prefix and its lane's slots — each followed by the per-lane top-K (target
//! ids) and the selection of the next K lanes among the K² path scores (`tree_select`);
//! finally the N − 1 best nodes (`tree_finish`). EAGLE-1: `fc(embed ‖ hidden)` every
//! forward. EAGLE-3: no fc (its input is the head's own H-wide hidden), layer 0 on
//! `rmsnorm(embed) ‖ rmsnorm(hidden)` with residual hidden, the final norm before lm_head,
//! the pre-norm row fed back.

use specplan_format::{io, DType, Entry, HeadKind, PhaseKind};

use super::{eagle3_input, embed, fc, lane_head, layer, staged, staged_inputs, Builder, Cx, Inputs};
use crate::config::Config;
use crate::graph::{Dim, OpGraph, OpKind, TensorId};
use crate::verify::VerifyError;

pub(super) fn lower(cfg: &Config, steps: u32) -> Result<OpGraph, VerifyError> {
    let kind = PhaseKind::DraftDecode { steps };
    let mut cx = Cx::new(cfg, kind);
    let mut g = Builder::new();
    let list = staged_inputs(&mut g, &cx);
    let get = |name: &str| staged(&list, kind, name);
    let (probs_in, ids_in, hidden_in) = (get(io::TOPK_PROBS)?, get(io::TOPK_IDS)?, get(io::HIDDEN_STATES)?);
    let (prefix, slots, pages) = (get(io::PREFIX_LENS)?, get(io::REQ_SLOTS)?, get(io::PAGE_TABLE)?);
    let (b, t, f) = (cx.requests, cx.rows, Dim::fixed);
    let m = &cfg.model.desc;
    let k = cfg.spec.topk as u64;
    let cands = specplan_kernels::facts::tree_candidates(cfg.spec.topk, steps);
    let parents = specplan_kernels::facts::parent_width(cfg.spec.topk, steps);
    let nodes = kind.draft_tokens(&cfg.spec) as u64 - 1;
    let lanes = k > 1;

    // The root's children.
    let scores = g.act("s0.scores", DType::F32, vec![b, f(k)]);
    let ids = g.act("s0.input_ids", DType::I64, vec![t]);
    let mut score_list = g.act("score_list", DType::F32, vec![b, f(cands)]);
    let mut token_list = g.act("token_list", DType::I64, vec![b, f(cands)]);
    let mut parent_list = g.output(io::PARENT_LIST, DType::I64, vec![b, f(parents)]);
    // Step 0's rows gather the request's hidden row, with one lane too: the residual stream
    // then lives in the arena (an EAGLE-3 head's residual is that row itself).
    let src = g.act("s0.src", DType::I32, vec![t]);
    let outs = vec![scores, ids, score_list, token_list, parent_list, src];
    g.op(Entry::TreeInit.name(), OpKind::TreeInit, vec![probs_in, ids_in], outs);
    let (mut scores, mut ids) = (scores, ids);
    let mut hidden = gather(&mut g, &cx, 0, hidden_in, src);

    for step in 0..steps - 1 {
        cx.step = step;
        let inp = Inputs {
            ids,
            hidden,
            prefix,
            slots,
            pages,
        };
        let (mut x, mut first_in) = match m.head {
            HeadKind::Eagle1 => (fc(&mut g, &cx, &inp), None),
            HeadKind::Eagle3 => {
                let emb = embed(&mut g, &cx, &inp);
                (hidden, Some(eagle3_input(&mut g, &cx, emb, hidden)))
            }
        };
        for l in 0..m.layers {
            x = layer(&mut g, &cx, &inp, l, x, first_in.take(), None);
        }
        let (top_p, top_i) = lane_head(&mut g, &cx, x);

        // Selection i = step + 1 (the last one only fills the lists).
        let i = step + 1;
        let last = i == steps - 1;
        let ins = vec![scores, top_p, top_i, score_list, token_list, parent_list];
        let sl2 = alias(&mut g, score_list, &format!("s{i}.score_list"));
        let tl2 = alias(&mut g, token_list, &format!("s{i}.token_list"));
        let mut outs = vec![sl2, tl2];
        (score_list, token_list) = (sl2, tl2);
        if !last {
            let pl2 = alias(&mut g, parent_list, &format!("s{i}.parent_list"));
            parent_list = pl2;
            scores = g.act(&format!("s{i}.scores"), DType::F32, vec![b, f(k)]);
            ids = g.act(&format!("s{i}.input_ids"), DType::I64, vec![t]);
            outs.extend([pl2, scores, ids]);
        }
        let src = (lanes && !last).then(|| g.act(&format!("s{i}.src"), DType::I32, vec![t]));
        outs.extend(src);
        g.op(
            &format!("s{i}.{}", Entry::TreeSelect.name()),
            OpKind::TreeSelect { step: i },
            ins,
            outs,
        );
        if !last {
            hidden = match src {
                Some(s) => gather(&mut g, &cx, i, x, s),
                None => x,
            };
        }
    }

    let top = g.output(io::TOP_SCORES_INDEX, DType::I64, vec![b, f(nodes)]);
    let tokens = g.output(io::DRAFT_TOKENS, DType::I64, vec![b, f(nodes)]);
    g.op(
        Entry::TreeFinish.name(),
        OpKind::TreeFinish,
        vec![score_list, token_list],
        vec![top, tokens],
    );
    if cfg.capture.decode_verify {
        // The target's verify inputs from the tree (SGLang's build_tree_kernel_efficient).
        let bonus = get(io::BONUS_TOKENS)?;
        let n = f(nodes + 1);
        let mut outs: Vec<TensorId> = [
            io::VERIFY_TOKENS,
            io::VERIFY_POSITIONS,
            io::RETRIEVE_INDEX,
            io::RETRIEVE_NEXT_TOKEN,
            io::RETRIEVE_NEXT_SIBLING,
        ]
        .into_iter()
        .map(|name| g.output(name, DType::I64, vec![b, n]))
        .collect();
        outs.push(g.output(io::TREE_MASK, DType::I32, vec![b, n, n]));
        g.op(
            Entry::TreeVerify.name(),
            OpKind::TreeVerify,
            vec![parent_list, top, tokens, bonus, prefix],
            outs,
        );
    }
    g.g.rebuild_edges();
    Ok(g.g)
}

/// `x[src]` for forward `step` (`x`: the draft-extend hidden rows at step 0, the previous
/// forward's output rows after).
fn gather(g: &mut Builder, cx: &Cx, step: u32, x: TensorId, src: TensorId) -> TensorId {
    let xt = g.g.tensor(x).clone();
    let out = g.act(&format!("s{step}.hidden"), xt.dtype, vec![cx.rows, xt.shape[1]]);
    g.op(
        &format!("s{step}.{}", Entry::GatherRows.name()),
        OpKind::GatherRows { step },
        vec![x, src],
        vec![out],
    );
    out
}

/// A tensor written in place over `t` (the tree's lists, filled block by block).
fn alias(g: &mut Builder, t: TensorId, name: &str) -> TensorId {
    let tt = g.g.tensor(t).clone();
    let a = g.act(name, tt.dtype, tt.shape.clone());
    g.g.tensors[a.0 as usize].alias_of = Some(t);
    a
}
