//! specplan's kernels: CUDA C templates specialized by a generated prelude, and the one
//! Rust declaration of every kernel entry.
//!
//! A kernel instance's source is `prelude + common.cuh + template` ([`source`]). For each
//! entry ([`Entry`]) this crate declares, once: the parameter struct (`entries/`, with
//! `#[derive(KernelParams)]`, which also emits the C declaration and a typed argument
//! builder), the threads per block, the dynamic shared memory, the grid and `u32`
//! arguments of a launch in a bucket, and the elements each pointer argument touches
//! ([`abi::Kernel`]); and for each template the specialization constants as functions of
//! the plan facts ([`facts::KernelFacts`]). The compiler binds launches from these, the
//! validator checks plans against them, the runtime packs arguments by the field table.
//!
//! Dependencies: serde (the plan names entries and constants), sha2 (source hashes), the
//! derive. No CUDA, no compiler: the runtime and the plan format may depend on this crate.

// The derive's output names `::specplan_kernels`; make that path resolve here too.
extern crate self as specplan_kernels;

pub mod abi;
mod dtype;
pub mod entries;
mod entry;
pub mod facts;
pub mod io;
pub mod kv;
pub mod source;

pub use dtype::DType;
pub use entry::{Entry, Template};
pub use source::{ConstValue, Constants};
