//! Names of the buffers every bucket exposes to host prep and to the caller.

pub const INPUT_IDS: &str = "input_ids";
pub const HIDDEN_STATES: &str = "hidden_states";
pub const PREFIX_LENS: &str = "prefix_lens";
pub const ACCEPT_LENS: &str = "accept_lens";
pub const REQ_SLOTS: &str = "req_slots";
pub const HIDDEN_OUT: &str = "hidden_out";
pub const TOPK_PROBS: &str = "topk_probs";
pub const TOPK_IDS: &str = "topk_ids";
/// The selected row's logits over the lm_head's rows (a plan compiled with `outputs`
/// including `logits`).
pub const LOGITS: &str = "logits";
pub const INPUTS: [&str; 5] = [INPUT_IDS, HIDDEN_STATES, PREFIX_LENS, ACCEPT_LENS, REQ_SLOTS];
/// Every name an output may have; which of them a plan has is its `capture.outputs`
/// (`specplan_format::signature`).
pub const OUTPUTS: [&str; 4] = [HIDDEN_OUT, TOPK_PROBS, TOPK_IDS, LOGITS];
