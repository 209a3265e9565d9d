//! The closed set of kernel entries and templates, and the one table that names them.
//!
//! Each entry's name appears once, in [`entries!`]; everything else (plans, validation,
//! the CPU executor, launch binding) names entries by [`Entry`], so a new entry is added
//! here and every exhaustive `match` over it points at what it still needs.

use serde::{Deserialize, Serialize};

use crate::abi::{shape_of, Abi, Kernel, LaunchShape};
use crate::entries::{attention, embed, gemm, io, io_decode, mlp, norm, rope, sample, select, tree};
use crate::facts::{BucketFacts, KernelFacts};
use crate::source::Constants;

/// A `.cu` template file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Template {
    Embed,
    Norm,
    RopeAppend,
    Attention,
    Mlp,
    Select,
    Sample,
    Tree,
    Io,
    Gemm,
}

impl Template {
    pub const ALL: &'static [Template] = &[
        Template::Embed,
        Template::Norm,
        Template::RopeAppend,
        Template::Attention,
        Template::Mlp,
        Template::Select,
        Template::Sample,
        Template::Tree,
        Template::Io,
        Template::Gemm,
    ];

    /// File name under `kernels/cuda`.
    pub fn file(self) -> &'static str {
        match self {
            Template::Embed => "embed.cu",
            Template::Norm => "norm.cu",
            Template::RopeAppend => "rope_append.cu",
            Template::Attention => "attention.cu",
            Template::Mlp => "mlp.cu",
            Template::Select => "select.cu",
            Template::Sample => "sample.cu",
            Template::Tree => "tree.cu",
            Template::Io => "io.cu",
            Template::Gemm => "gemm.cu",
        }
    }

    pub fn source(self) -> &'static str {
        match self {
            Template::Embed => include_str!("../cuda/embed.cu"),
            Template::Norm => include_str!("../cuda/norm.cu"),
            Template::RopeAppend => include_str!("../cuda/rope_append.cu"),
            Template::Attention => include_str!("../cuda/attention.cu"),
            Template::Mlp => include_str!("../cuda/mlp.cu"),
            Template::Select => include_str!("../cuda/select.cu"),
            Template::Sample => include_str!("../cuda/sample.cu"),
            Template::Tree => include_str!("../cuda/tree.cu"),
            Template::Io => include_str!("../cuda/io.cu"),
            Template::Gemm => include_str!("../cuda/gemm.cu"),
        }
    }

    /// The entries compiled from this template.
    pub fn entries(self) -> &'static [Entry] {
        match self {
            Template::Embed => &[Entry::EmbedConcat, Entry::EmbedNormConcat],
            Template::Norm => &[Entry::RmsNorm, Entry::NormConcat, Entry::CastRows, Entry::NormCast],
            Template::RopeAppend => &[Entry::RopeAppend],
            Template::Attention => &[Entry::AttnPartial, Entry::AttnMerge, Entry::AttnFused],
            Template::Mlp => &[Entry::SiluMul, Entry::SiluMulPairs],
            Template::Select => &[Entry::SelectRows, Entry::SelectNorm, Entry::SelectNormPairs],
            Template::Sample => &[
                Entry::SoftmaxTopk,
                Entry::TopkPartial,
                Entry::TopkMerge,
                Entry::LogitsGather,
                Entry::TopkFused,
            ],
            Template::Tree => &[
                Entry::TreeInit,
                Entry::TreeSelect,
                Entry::TreeFinish,
                Entry::TreeVerify,
                Entry::GatherRows,
            ],
            Template::Io => &[
                Entry::Admit,
                Entry::Emit,
                Entry::AdmitDecode,
                Entry::EmitDecode,
                Entry::Fill,
                Entry::StageIn,
                Entry::L2Prefetch,
            ],
            Template::Gemm => &[Entry::SkinnyGemm, Entry::GemmRound],
        }
    }

    /// The specialization constants of an instance, in prelude order. Every constant is a
    /// function of the facts: a plan whose constants differ from these is rejected.
    pub fn constants(self, f: &KernelFacts) -> Constants {
        match self {
            Template::Embed => embed::constants(f),
            Template::Norm => norm::constants(f),
            Template::RopeAppend => rope::constants(f),
            Template::Attention => attention::constants(f),
            Template::Mlp => mlp::constants(f),
            Template::Select => select::constants(f),
            Template::Sample => sample::constants(f),
            Template::Tree => tree::constants(f),
            Template::Io => io::constants(f),
            Template::Gemm => gemm::constants(f),
        }
    }
}

macro_rules! entries {
    ($($variant:ident => $params:ty, $name:literal, $template:ident;)*) => {
        /// A kernel entry point (`extern "C"` function of a template).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum Entry {
            $($variant),*
        }

        impl Entry {
            pub const ALL: &'static [Entry] = &[$(Entry::$variant),*];

            /// The `extern "C"` name (the only place it is written in Rust).
            pub const fn name(self) -> &'static str {
                match self { $(Entry::$variant => $name),* }
            }

            pub fn template(self) -> Template {
                match self { $(Entry::$variant => Template::$template),* }
            }

            /// The parameter struct.
            pub fn abi(self) -> Abi {
                match self { $(Entry::$variant => Abi::of::<$params>()),* }
            }

            /// Threads per block.
            pub fn threads(self, f: &KernelFacts) -> u32 {
                match self { $(Entry::$variant => <$params as Kernel>::threads(f)),* }
            }

            /// What a launch of this entry in a bucket must look like.
            pub fn shape(self, b: &BucketFacts, f: &KernelFacts) -> LaunchShape {
                match self { $(Entry::$variant => shape_of::<$params>(b, f)),* }
            }
        }

        // Each declaration names the entry it is.
        const _: () = { $(assert!(matches!(<$params as Kernel>::ENTRY, Entry::$variant));)* };
    };
}

entries! {
    EmbedConcat => embed::EmbedConcatParams, "embed_concat", Embed;
    EmbedNormConcat => embed::EmbedNormConcatParams, "embed_norm_concat", Embed;
    RmsNorm => norm::RmsNormParams, "rmsnorm", Norm;
    NormConcat => norm::NormConcatParams, "norm_concat", Norm;
    RopeAppend => rope::RopeAppendParams, "rope_append", RopeAppend;
    AttnPartial => attention::AttnPartialParams, "attn_partial", Attention;
    AttnMerge => attention::AttnMergeParams, "attn_merge", Attention;
    SiluMul => mlp::SiluMulParams, "silu_mul", Mlp;
    SelectRows => select::SelectRowsParams, "select_rows", Select;
    SelectNorm => select::SelectNormParams, "select_norm", Select;
    SoftmaxTopk => sample::SoftmaxTopkParams, "softmax_topk", Sample;
    TopkPartial => sample::TopkPartialParams, "topk_partial", Sample;
    TopkMerge => sample::TopkMergeParams, "topk_merge", Sample;
    LogitsGather => sample::LogitsGatherParams, "logits_gather", Sample;
    TreeInit => tree::TreeInitParams, "tree_init", Tree;
    TreeSelect => tree::TreeSelectParams, "tree_select", Tree;
    TreeFinish => tree::TreeFinishParams, "tree_finish", Tree;
    TreeVerify => tree::TreeVerifyParams, "tree_verify", Tree;
    GatherRows => tree::GatherRowsParams, "gather_rows", Tree;
    Admit => io::AdmitParams, "admit", Io;
    Emit => io::EmitParams, "emit", Io;
    AdmitDecode => io_decode::AdmitDecodeParams, "admit_decode", Io;
    EmitDecode => io_decode::EmitDecodeParams, "emit_decode", Io;
    Fill => io::FillParams, "fill", Io;
    CastRows => norm::CastRowsParams, "cast_rows", Norm;
    SkinnyGemm => gemm::SkinnyGemmParams, "skinny_gemm", Gemm;
    SiluMulPairs => mlp::SiluMulPairsParams, "silu_mul_pairs", Mlp;
    SelectNormPairs => select::SelectNormPairsParams, "select_norm_pairs", Select;
    NormCast => norm::NormCastParams, "norm_cast", Norm;
    TopkFused => sample::TopkFusedParams, "topk_fused", Sample;
    StageIn => io::StageInParams, "stage_in", Io;
    L2Prefetch => io::L2PrefetchParams, "l2_prefetch", Io;
    GemmRound => gemm::GemmRoundParams, "gemm_round", Gemm;
    AttnFused => attention::AttnFusedParams, "attn_fused", Attention;
}

impl Entry {
    /// The prelude constant holding this entry's threads per block.
    pub fn threads_const(self) -> String {
        format!("{}_THREADS", self.name().to_ascii_uppercase())
    }

    /// Entries the runtime launches itself (never in a plan's launch lists; every plan
    /// carries them in its kernel table): `admit` and `emit` around an engine-memory
    /// draft-extend step, `admit_decode` and `emit_decode` around a draft-decode one, `fill`
    /// in place of a GEMM library's memset nodes in a captured graph, `skinny_gemm` in place
    /// of cuBLASLt for the GEMMs it serves faster (timed at load), `stage_in` at the head of
    /// an owned-memory draft-extend graph, `l2_prefetch` as a captured graph's side branches
    /// (when the runtime's options ask for them), `gemm_round` after a GEMM with a rounded
    /// copy that a library ran.
    pub fn runtime_launched(self) -> bool {
        matches!(
            self,
            Entry::Admit
                | Entry::Emit
                | Entry::AdmitDecode
                | Entry::EmitDecode
                | Entry::Fill
                | Entry::SkinnyGemm
                | Entry::StageIn
                | Entry::L2Prefetch
                | Entry::GemmRound
        )
    }

    pub fn from_name(name: &str) -> Option<Entry> {
        Entry::ALL.iter().copied().find(|e| e.name() == name)
    }
}

impl std::fmt::Display for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
