//! The draft-extend step's signature: every buffer a bucket exposes to host prep (its
//! inputs) and to the caller (its outputs), with dtype and shape for the bucket's batch.
//! Validation checks a bucket's I/O buffers against it; the runtimes and the run contract
//! read the output set from it.

use crate::types::{BufferRole, HeadOutputs, Plan};
use specplan_kernels::{io, DType};

/// One tensor of the signature for a bucket of `batch` requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoTensor {
    pub name: &'static str,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub role: BufferRole,
}

/// The bucket's inputs, then its outputs (those `plan.capture.outputs` selects).
pub fn bucket_io(p: &Plan, batch: u32) -> Vec<IoTensor> {
    let (bb, rows) = (batch as u64, batch as u64 * p.spec.num_draft_tokens as u64);
    let act = p.capture.dtype;
    let t = |name, dtype, shape, role| IoTensor {
        name,
        dtype,
        shape,
        role,
    };
    let mut v = vec![
        t(io::INPUT_IDS, DType::I64, vec![rows], BufferRole::Input),
        t(
            io::HIDDEN_STATES,
            act,
            vec![rows, p.model.hidden_in() as u64],
            BufferRole::Input,
        ),
        t(io::PREFIX_LENS, DType::I32, vec![bb], BufferRole::Input),
        t(io::ACCEPT_LENS, DType::I32, vec![bb], BufferRole::Input),
        t(io::REQ_SLOTS, DType::I32, vec![bb], BufferRole::Input),
        t(io::HIDDEN_OUT, act, vec![bb, p.model.hidden as u64], BufferRole::Output),
    ];
    let k = p.spec.topk as u64;
    if p.capture.outputs.topk {
        v.push(t(io::TOPK_PROBS, DType::F32, vec![bb, k], BufferRole::Output));
        v.push(t(io::TOPK_IDS, DType::I64, vec![bb, k], BufferRole::Output));
    }
    if p.capture.outputs.logits {
        v.push(t(
            io::LOGITS,
            DType::F32,
            vec![bb, logits_cols(p) as u64],
            BufferRole::Output,
        ));
    }
    v
}

/// Columns of the `logits` output: the lm_head's rows (the hot vocabulary under FR-Spec,
/// else the draft vocabulary of an EAGLE-3 head, else the vocabulary).
pub fn logits_cols(p: &Plan) -> u32 {
    p.capture.hot_vocab_size.unwrap_or(p.model.lm_vocab())
}

/// Whether `name` is an output of a plan with these head outputs.
pub fn is_output(outputs: HeadOutputs, name: &str) -> bool {
    match name {
        io::HIDDEN_OUT => true,
        io::TOPK_PROBS | io::TOPK_IDS => outputs.topk,
        io::LOGITS => outputs.logits,
        _ => false,
    }
}
