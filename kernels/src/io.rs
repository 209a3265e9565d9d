//! The spelling of every tensor name a phase's signature declares (the declaration itself —
//! dtype, shape, role — is `specplan_format::signature`; the kernels' argument declarations
//! bind their `input = ...` fields to these names, which is why they live this low).

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
/// Draft decode's outputs, as SGLang 0.5.23's draft-decode slot returns them: each node's
/// parent block (`[b, (S−1)·K + 1]`), the N − 1 chosen score indices ascending, and their
/// target-vocabulary tokens.
pub const PARENT_LIST: &str = "parent_list";
pub const TOP_SCORES_INDEX: &str = "top_scores_index";
pub const DRAFT_TOKENS: &str = "draft_tokens";
/// Draft decode with the verify inputs (`draft_decode_outputs = "tree,verify"`): the bonus
/// token given, and what SGLang's `build_tree_kernel_efficient` builds from the tree for the
/// target's verify (its QLEN_ONLY mask as one `[N, N]` block per request).
pub const BONUS_TOKENS: &str = "bonus_tokens";
pub const VERIFY_TOKENS: &str = "verify_tokens";
pub const VERIFY_POSITIONS: &str = "verify_positions";
pub const RETRIEVE_INDEX: &str = "retrieve_index";
pub const RETRIEVE_NEXT_TOKEN: &str = "retrieve_next_token";
pub const RETRIEVE_NEXT_SIBLING: &str = "retrieve_next_sibling";
pub const TREE_MASK: &str = "tree_mask";
/// The engine-owned tensors: every layer's K and V pools, and the page table.
pub const K_CACHE: &str = "k_cache";
pub const V_CACHE: &str = "v_cache";
pub const PAGE_TABLE: &str = "page_table";
