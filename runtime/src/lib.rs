//! specplan runtime: executes validated plans — on the CPU (the reference executor) and on
//! the GPU (CUDA graphs with host-only prep): the step API alone. The `run` contract over
//! files and the output-file rules are the `specplan-contract` crate, at the edge.
//!
//! Architecture invariant: the runtime depends on the plan format and the kernels crate's
//! declarations, never on the compiler, petgraph or NVRTC (Cargo enforces it: none is a
//! dependency).

pub mod admission;
pub mod aliasing;
pub mod bits;
pub mod cpu;
pub mod gpu;
pub mod registration;
pub mod step;

/// The plan format, re-exported for callers that use the runtime alone.
pub use specplan_format as format;
