//! embed.cu: the embedding lookup concatenated with the target's hidden states.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel, Stream};
use crate::facts::{row_parts, BucketFacts, KernelFacts};
use crate::source::{ConstValue, Constants};
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, stream, u};

/// `embed_concat`: `out[r] = embed(ids[r]) ‖ hidden[r]`, and the fc output rows set to the
/// bias when the model has one (the fc GEMM then accumulates onto them).
#[derive(KernelParams)]
#[repr(C)]
pub struct EmbedConcatParams {
    /// The staged `input_ids` (draft-extend) or a forward's lane ids (draft decode).
    #[arg(buffer)]
    pub ids: DevPtr<i64>,
    #[arg(weight)]
    pub table: DevPtr<Act>,
    /// The staged `hidden_states`, or a forward's lane rows.
    #[arg(buffer)]
    pub hidden: DevPtr<Act>,
    /// fc bias, or null when the model has none.
    #[arg(weight)]
    pub bias: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    /// fc output rows (the residual stream) initialized to the bias, or null.
    #[arg(buffer)]
    pub bias_out: DevPtrMut<Stream>,
    pub rows: u32,
}

/// `embed_norm_concat` (EAGLE-3's layer-0 input): `out[r] = rmsnorm(embed(ids[r]), w_embed) ‖
/// rmsnorm(h[r], w_hidden)`.
#[derive(KernelParams)]
#[repr(C)]
pub struct EmbedNormConcatParams {
    /// The staged `input_ids`, or a forward's lane ids.
    #[arg(buffer)]
    pub ids: DevPtr<i64>,
    #[arg(weight)]
    pub table: DevPtr<Act>,
    /// `input_layernorm` of the embedding.
    #[arg(weight)]
    pub w_embed: DevPtr<Act>,
    /// `fc` of the target features: the layer's residual (the stream).
    #[arg(buffer)]
    pub h: DevPtr<Stream>,
    /// `hidden_norm`.
    #[arg(weight)]
    pub w_hidden: DevPtr<Act>,
    #[arg(buffer)]
    pub out: DevPtrMut<Act>,
    pub rows: u32,
}

pub const EMBED_THREADS: u32 = 256;

impl Kernel for EmbedNormConcatParams {
    const ENTRY: Entry = Entry::EmbedNormConcat;
    fn threads(_: &KernelFacts) -> u32 {
        EMBED_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], EmbedNormConcatScalars) {
        // One CTA per half: the two norms run side by side.
        ([b.rows, 2, 1], EmbedNormConcatScalars { rows: b.rows })
    }
    fn extents(s: &EmbedNormConcatScalars, f: &KernelFacts) -> EmbedNormConcatPtrs<Extent> {
        let (rows, h) = (s.rows as u64, f.hidden as u64);
        EmbedNormConcatPtrs {
            ids: Extent::Elems(rows),
            table: Extent::Elems(f.vocab as u64 * h),
            w_embed: Extent::Elems(h),
            h: Extent::Elems(rows * h),
            w_hidden: Extent::Elems(h),
            out: Extent::Elems(rows * 2 * h),
        }
    }
}

impl Kernel for EmbedConcatParams {
    const ENTRY: Entry = Entry::EmbedConcat;
    fn threads(_: &KernelFacts) -> u32 {
        EMBED_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], EmbedConcatScalars) {
        let parts = row_parts(b.rows, (f.hidden as u64).div_ceil(8), EMBED_THREADS);
        ([b.rows, parts, 1], EmbedConcatScalars { rows: b.rows })
    }
    fn extents(s: &EmbedConcatScalars, f: &KernelFacts) -> EmbedConcatPtrs<Extent> {
        let (rows, h) = (s.rows as u64, f.hidden as u64);
        let bias = |n: u64| if f.has_bias { Extent::Elems(n) } else { Extent::Unused };
        EmbedConcatPtrs {
            ids: Extent::Elems(rows),
            table: Extent::Elems(f.embed_rows as u64 * h),
            hidden: Extent::Elems(rows * h),
            bias: bias(h),
            out: Extent::Elems(rows * 2 * h),
            bias_out: bias(rows * h),
        }
    }
}

pub fn constants(f: &KernelFacts) -> Constants {
    vec![
        act(f),
        stream(f),
        u("HIDDEN", f.hidden),
        u("VOCAB", f.vocab),
        ("HAS_BIAS".into(), ConstValue::Bool(f.has_bias)),
        ("EPS".into(), ConstValue::F32(f.eps)),
        u("EMBED_ROWS", f.embed_rows),
        u("EMBED_START", f.embed_start),
        ("ZERO_HIDDEN".into(), ConstValue::Bool(f.zero_hidden)),
    ]
}
