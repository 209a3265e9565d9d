//! The draft-extend phase: the draft model over the N rows per request that target
//! verification produced (EAGLE draft-extend v2). EAGLE-1/2: embed(ids) ‖ hidden → fc →
//! layers (identity input norm on layer 0, QKV, RoPE, K/V append, causal paged attention,
//! O + residual; in the last layer the row select i·N + A_i − 1 here, so its MLP runs on
//! the selected rows only; post norm, SiLU(gate)·up, down + residual) →
//! lm_head (hot rows under FR-Spec) → softmax → top-K → id map. EAGLE-3: h = fc(hidden
//! [3·H_t]); layer 0 reads rmsnorm(embed(ids)) ‖ rmsnorm(h) (2H wide) with residual h; the
//! selected row (pre-norm, the head's hidden output) → final norm → its own lm_head over
//! V_d → softmax → top-K → id + d2t[id].

use specplan_format::{io, HeadKind, PhaseKind};

use super::{fc, fc3, hidden_out, layer, output_head, staged, staged_inputs, Builder, Cx, Inputs};
use crate::config::Config;
use crate::graph::OpGraph;
use crate::verify::VerifyError;

pub(super) fn lower(cfg: &Config) -> Result<OpGraph, VerifyError> {
    let cx = Cx::new(cfg, PhaseKind::DraftExtend);
    let mut g = Builder::new();
    let staged_list = staged_inputs(&mut g, &cx);
    let kind = PhaseKind::DraftExtend;
    let get = |name: &str| staged(&staged_list, kind, name);
    let inp = Inputs {
        ids: get(io::INPUT_IDS)?,
        hidden: get(io::HIDDEN_STATES)?,
        prefix: get(io::PREFIX_LENS)?,
        slots: get(io::REQ_SLOTS)?,
        pages: get(io::PAGE_TABLE)?,
    };
    let accept = get(io::ACCEPT_LENS)?;
    let (mut x, mut first_in) = match cfg.model.desc.head {
        HeadKind::Eagle1 => (fc(&mut g, &cx, &inp), None),
        HeadKind::Eagle3 => {
            let (h, a) = fc3(&mut g, &cx, &inp);
            (h, Some(a))
        }
    };
    let layers = cfg.model.desc.layers;
    for l in 0..layers {
        // Only the selected rows leave the last layer (its attention, o_proj and MLP run on B rows).
        let select = (l + 1 == layers).then_some(accept);
        x = layer(&mut g, &cx, &inp, l, x, first_in.take(), select);
    }
    let out = hidden_out(&mut g, &cx, x);
    output_head(&mut g, &cx, x, out);
    g.g.rebuild_edges();
    Ok(g.g)
}
