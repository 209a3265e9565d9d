//! specplan kernel templates: CUDA C sources specialized by a generated prelude.
//!
//! A kernel instance's source is `prelude + common.cuh + template`, where the prelude
//! (written by the compiler from the plan's constants) includes the fp16/bf16 headers and
//! declares `act_t` and every `constexpr` the template reads. Templates never contain
//! sizes; the compiler never formats strings inside kernel bodies.
//!
//! This crate also owns the launch-geometry facts that host code must mirror exactly
//! (block sizes, dynamic shared memory formulas), next to the sources that rely on them.

// The derive's output names `::specplan_kernels`; make that path resolve here too.
extern crate self as specplan_kernels;

pub mod abi;
pub mod params;

use sha2::{Digest, Sha256};

/// A `.cu` template and its entry points.
#[derive(Debug)]
pub struct Template {
    pub file: &'static str,
    pub source: &'static str,
    pub entries: &'static [&'static str],
}

pub const COMMON_HEADER: &str = include_str!("../cuda/common.cuh");
const INCLUDE_LINE: &str = "#include \"common.cuh\"";

pub const TEMPLATES: &[Template] = &[
    Template {
        file: "embed.cu",
        source: include_str!("../cuda/embed.cu"),
        entries: &["embed_concat"],
    },
    Template {
        file: "norm.cu",
        source: include_str!("../cuda/norm.cu"),
        entries: &["rmsnorm"],
    },
    Template {
        file: "rope_append.cu",
        source: include_str!("../cuda/rope_append.cu"),
        entries: &["rope_append"],
    },
    Template {
        file: "attention.cu",
        source: include_str!("../cuda/attention.cu"),
        entries: &["attn_partial", "attn_merge"],
    },
    Template {
        file: "mlp.cu",
        source: include_str!("../cuda/mlp.cu"),
        entries: &["silu_mul"],
    },
    Template {
        file: "select.cu",
        source: include_str!("../cuda/select.cu"),
        entries: &["select_rows"],
    },
    Template {
        file: "sample.cu",
        source: include_str!("../cuda/sample.cu"),
        entries: &["softmax_topk", "topk_partial", "topk_merge"],
    },
];

pub fn template(file: &str) -> Option<&'static Template> {
    TEMPLATES.iter().find(|t| t.file == file)
}

/// The full source NVRTC compiles: prelude, then the template with its
/// `#include "common.cuh"` line replaced by the header (so NVRTC needs no header table).
pub fn full_source(prelude: &str, template: &Template) -> String {
    let body = template.source.replacen(INCLUDE_LINE, COMMON_HEADER, 1);
    format!("{prelude}\n// ---- {} ----\n{body}", template.file)
}

/// Hex SHA-256 of a full source.
pub fn source_hash(source: &str) -> String {
    Sha256::digest(source.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Launch geometry shared by the compiler (which writes it into plans) and the kernels.
pub mod geometry {
    pub const EMBED_THREADS: u32 = 256;
    pub const NORM_THREADS: u32 = 256;
    pub const ROPE_THREADS: u32 = 128;
    pub const ATTN_THREADS: u32 = 128;
    pub const SILU_THREADS: u32 = 256;
    pub const SELECT_THREADS: u32 = 256;
    pub const TOPK_THREADS: u32 = 512;
    /// `topk_merge`: one warp per row; lane l owns chunk l's record.
    pub const TOPK_MERGE_THREADS: u32 = 32;
    /// Largest number of column chunks a row of `softmax_topk` is split into.
    pub const MAX_TOPK_CHUNKS: u32 = 32;
    /// Columns per chunk the plan aims at when splitting a row (one CTA streams about
    /// this many fp32 logits in a few microseconds).
    pub const TOPK_CHUNK_COLS: u32 = 8192;

    /// Column chunks (one CTA each) of a logits row of `cols` columns; 1 = no split.
    pub fn topk_chunks(cols: u32) -> u32 {
        cols.div_ceil(TOPK_CHUNK_COLS).clamp(1, MAX_TOPK_CHUNKS)
    }

    /// Floats per chunk record of `topk_partial`: max, sum, TOPK values, TOPK columns.
    pub fn topk_record_floats(topk: u32) -> u32 {
        2 + 2 * topk
    }
    /// Largest top-K the sampling kernel's shared memory is sized for.
    pub const MAX_TOPK: u32 = 32;

    /// Dynamic shared memory of `attn_partial` (mirrors the formula in attention.cu): the q
    /// rows of one pass (at most 64 packed rows, padded to 16), then the larger of the K/V
    /// pipeline stages and the cross-warp merge area that aliases them after the key loop.
    pub fn attn_smem_bytes(rows_per_cta: u32, head_dim: u32, kv_tile: u32, stages: u32, act_bytes: u32) -> u64 {
        let (d, t, a) = (head_dim as u64, kv_tile as u64, act_bytes as u64);
        let rows_per_pass = (rows_per_cta as u64).div_ceil(16).clamp(1, 4) * 16;
        let warps = ATTN_THREADS as u64 / 32;
        let stages = stages as u64 * 2 * t * d * a;
        let merge = warps * 16 * d * 4 + warps * 16 * 2 * 4;
        rows_per_pass * d * a + stages.max(merge)
    }

    /// Dynamic shared memory of `softmax_topk` (mirrors sample.cu).
    pub fn topk_smem_bytes(topk: u32) -> u64 {
        TOPK_THREADS as u64 * topk as u64 * 8
    }
}
