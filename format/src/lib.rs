//! The plan format: the API boundary between compiler and runtime.
//!
//! Architecture invariant: this crate depends on serde, postcard, sha2, thiserror and the
//! kernels crate (the entry declarations) only; Cargo enforces that neither the compiler
//! nor the runtime is reachable from here. A plan is produced by the compiler, written with
//! [`encode`], and consumed only as a [`ValidatedPlan`], which [`decode`] and [`validate`]
//! alone construct.

mod codec;
mod diff;
mod facts;
mod gemm;
pub mod limits;
mod location;
mod parallel;
pub mod signature;
mod text;
mod types;
mod validate;

pub use codec::{
    decode, encode, load_file, read_capped, read_config, ReadError, FORMAT_VERSION, MAGIC, MAX_CONFIG_BYTES,
    MAX_PLAN_BYTES,
};
pub use diff::{diff, DiffEntry, PlanDiff};
pub use facts::{
    bucket_facts, io_facts, kernel_facts, kernel_facts_of, phase_facts, phase_facts_of, read_window,
    rope_attention_scale, rope_inv_freq, stream_dtype,
};
pub use location::{Location, Violation};
pub use specplan_kernels::facts::{BucketFacts, KernelFacts, MAX_SMEM_BYTES};
pub use text::{escape, facts, to_text, Fact};
pub use types::*;
pub use validate::{kernel_source, validate, ValidatedPlan};

/// Errors of loading or validating a plan. Each names what is wrong and where.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("cannot read plan {path}: {message}")]
    Io { path: String, message: String },
    #[error("not a specplan plan (bad magic; expected \"SPECPLAN\")")]
    BadMagic,
    #[error(
        "plan format version {found} is not supported (this runtime reads version {supported}); recompile the plan"
    )]
    Version { found: u32, supported: u32 },
    #[error("plan header: reserved word is {found:#x}, must be 0")]
    Reserved { found: u32 },
    #[error("plan is truncated: {what} should be {expected} bytes, found {found}")]
    Truncated {
        what: &'static str,
        expected: u64,
        found: u64,
    },
    #[error("plan has trailing bytes: its body should be {expected} bytes, found {found}")]
    Trailing { expected: u64, found: u64 },
    #[error("plan is too large: {bytes} bytes exceed the limit of {limit}")]
    TooLarge { bytes: u64, limit: u64 },
    #[error("plan checksum mismatch: the body was corrupted")]
    Checksum,
    #[error("plan body does not decode: {0}")]
    Decode(String),
    #[error("plan does not encode: {0}")]
    Encode(String),
    #[error("invalid plan: {}", .0.iter().map(|v| v.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<Violation>),
}
