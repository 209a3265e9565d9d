//! The plan format: the API boundary between compiler and runtime.
//!
//! Architecture invariant: this module (and the runtime crate) knows nothing about the
//! compiler or petgraph. A plan is produced by the compiler, written with [`encode`], and
//! consumed only as a [`ValidatedPlan`], which [`decode`] and [`validate`] alone construct.

mod codec;
mod diff;
mod kernel_rules;
mod text;
mod types;
mod validate;

pub use codec::{decode, encode, load_file, FORMAT_VERSION, MAGIC};
pub use diff::{diff, DiffEntry, PlanDiff};
pub use text::{facts, to_text, Fact};
pub use types::*;
pub use validate::{validate, ValidatedPlan, MAX_SMEM_BYTES};

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
    #[error("plan is truncated: {what} should be {expected} bytes, found {found}")]
    Truncated {
        what: &'static str,
        expected: u64,
        found: u64,
    },
    #[error("plan checksum mismatch: the body was corrupted")]
    Checksum,
    #[error("plan body does not decode: {0}")]
    Decode(String),
    #[error("plan does not encode: {0}")]
    Encode(String),
    #[error("invalid plan: {}", .0.join("; "))]
    Invalid(Vec<String>),
}
