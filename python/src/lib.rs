//! `specplan._native`: the Rust side of the Python package. Plans (load, compile, facts) and
//! the engine-memory runtime over raw device addresses. The Python side (`specplan/`) turns
//! PyTorch tensors into those addresses after checking dtype, shape, device and strides;
//! this module never sees a tensor and does not link libtorch.

mod cpu_engine;
mod engine;
mod host_inputs;
mod plan;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<plan::Plan>()?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<cpu_engine::CpuEngine>()?;
    m.add_function(wrap_pyfunction!(plan::nvrtc_report, m)?)?;
    m.add_function(wrap_pyfunction!(engine::driver_report, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
