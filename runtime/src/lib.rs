//! specplan runtime: owns the plan format and executes plans.
//!
//! Architecture invariant: nothing here depends on the compiler or on petgraph.

pub mod contract;
pub mod cpu;
pub mod format;
pub mod gpu;
pub mod lt;
pub mod step;
