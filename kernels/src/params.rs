//! The parameter struct of every kernel entry. The `.cu` templates use these names and do
//! not declare the structs themselves: the generated prelude does, from these definitions.

use crate::abi::{Act, DevPtr, DevPtrMut, ParamsInfo};
use specplan_macros::KernelParams;

/// `embed_concat` (embed.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct EmbedConcatParams {
    pub ids: DevPtr<i64>,
    pub table: DevPtr<Act>,
    pub hidden: DevPtr<Act>,
    /// fc bias, or null when the model has none.
    pub bias: DevPtr<Act>,
    pub out: DevPtrMut<Act>,
    /// fc output rows initialized to the bias, or null.
    pub bias_out: DevPtrMut<Act>,
    pub rows: u32,
}

/// `rmsnorm` (norm.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct RmsNormParams {
    pub x: DevPtr<Act>,
    pub weight: DevPtr<Act>,
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

/// `rope_append` (rope_append.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct RopeAppendParams {
    pub qkv: DevPtrMut<Act>,
    pub prefix_lens: DevPtr<i32>,
    pub req_slots: DevPtr<i32>,
    pub page_table: DevPtr<i32>,
    pub k_cache: DevPtrMut<Act>,
    pub v_cache: DevPtrMut<Act>,
    pub rows: u32,
}

/// `attn_partial` (attention.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct AttnPartialParams {
    pub q: DevPtr<Act>,
    pub k_cache: DevPtr<Act>,
    pub v_cache: DevPtr<Act>,
    pub req_slots: DevPtr<i32>,
    pub page_table: DevPtr<i32>,
    pub prefix_lens: DevPtr<i32>,
    /// Final output when there is one split, else null.
    pub out: DevPtrMut<Act>,
    pub part_o: DevPtrMut<f32>,
    pub part_lse: DevPtrMut<f32>,
    pub batch: u32,
    pub splits: u32,
    pub q_stride: u32,
}

/// `attn_merge` (attention.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct AttnMergeParams {
    pub part_o: DevPtr<f32>,
    pub part_lse: DevPtr<f32>,
    pub out: DevPtrMut<Act>,
    pub rows: u32,
    pub splits: u32,
}

/// `silu_mul` (mlp.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct SiluMulParams {
    pub gate_up: DevPtr<Act>,
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

/// `select_rows` (select.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct SelectRowsParams {
    pub x: DevPtr<Act>,
    pub accept_lens: DevPtr<i32>,
    pub out: DevPtrMut<Act>,
    pub batch: u32,
}

/// `softmax_topk` (sample.cu).
#[derive(KernelParams)]
#[repr(C)]
pub struct SoftmaxTopKParams {
    pub logits: DevPtr<f32>,
    /// FR-Spec hot → full id map, or null.
    pub hot_ids: DevPtr<i64>,
    pub probs: DevPtrMut<f32>,
    pub ids: DevPtrMut<i64>,
    pub batch: u32,
}

/// `topk_partial` (sample.cu): per-chunk max, sum and top-K candidates of each row.
#[derive(KernelParams)]
#[repr(C)]
pub struct TopkPartialParams {
    pub logits: DevPtr<f32>,
    pub part: DevPtrMut<f32>,
    pub batch: u32,
    pub chunks: u32,
}

/// `topk_merge` (sample.cu): the row's probabilities and ids from its chunk records.
#[derive(KernelParams)]
#[repr(C)]
pub struct TopkMergeParams {
    pub part: DevPtr<f32>,
    /// FR-Spec hot → full id map, or null.
    pub hot_ids: DevPtr<i64>,
    pub probs: DevPtrMut<f32>,
    pub ids: DevPtrMut<i64>,
    pub batch: u32,
    pub chunks: u32,
}

/// The ABI of a kernel entry point.
pub fn params_for(entry: &str) -> Option<ParamsInfo> {
    Some(match entry {
        "embed_concat" => ParamsInfo::of::<EmbedConcatParams>(),
        "rmsnorm" => ParamsInfo::of::<RmsNormParams>(),
        "rope_append" => ParamsInfo::of::<RopeAppendParams>(),
        "attn_partial" => ParamsInfo::of::<AttnPartialParams>(),
        "attn_merge" => ParamsInfo::of::<AttnMergeParams>(),
        "silu_mul" => ParamsInfo::of::<SiluMulParams>(),
        "select_rows" => ParamsInfo::of::<SelectRowsParams>(),
        "softmax_topk" => ParamsInfo::of::<SoftmaxTopKParams>(),
        "topk_partial" => ParamsInfo::of::<TopkPartialParams>(),
        "topk_merge" => ParamsInfo::of::<TopkMergeParams>(),
        _ => return None,
    })
}
