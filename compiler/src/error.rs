//! The compiler's error type: one variant per stage, each naming what failed and where.

use crate::config::ConfigError;
use crate::schedule::ScheduleError;
use crate::verify::VerifyError;
use specplan_format::PlanError;

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Verify(#[from] VerifyError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error("the emitted plan fails validation (a compiler bug): {0}")]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Jit(#[from] crate::jit::JitError),
    #[error("rebuilding the plan's kernels: {0}")]
    Rebuild(String),
}
