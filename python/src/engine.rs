//! `Engine`: the runtime in engine memory over raw device addresses. The Python runner
//! checks the tensors and passes their addresses; the runtime checks the registration
//! again (alignment, strides, sizes) and each request on the device.

use std::collections::{BTreeMap, HashMap};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use specplan_format::{DType, Replay};
use specplan_runtime::gpu::{
    DeviceInts, DeviceOutputs, DeviceStep, DeviceTensor, EngineMemory, GemmPolicy, GpuError, GpuOptions, GpuRuntime,
    KvRegistration, TableMode, TableRegistration,
};

use crate::plan::Plan;

/// Registration and step errors are the caller's (ValueError); the rest are the device's.
fn py_err(e: GpuError) -> PyErr {
    match e {
        GpuError::Registration(_)
        | GpuError::Weights(_)
        | GpuError::Step(_)
        | GpuError::Input(_)
        | GpuError::NoBucket { .. }
        | GpuError::Mode(_) => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn dtype(name: &str, what: &str) -> PyResult<DType> {
    match name {
        "bf16" => Ok(DType::Bf16),
        "fp16" => Ok(DType::F16),
        "f32" => Ok(DType::F32),
        "i64" => Ok(DType::I64),
        "i32" => Ok(DType::I32),
        other => Err(PyValueError::new_err(format!(
            "{what}: dtype {other} is not one of bf16, fp16, f32, i64, i32"
        ))),
    }
}

/// A loaded runtime on the caller's memory. Not shareable across threads (its CUDA
/// objects belong to the thread that drives the engine's stream).
#[pyclass(module = "specplan._native", unsendable)]
pub struct Engine {
    rt: GpuRuntime,
    graph: Vec<(u32, bool)>,
}

#[pymethods]
impl Engine {
    /// `k`, `v`: per layer, the K and V pool addresses (`slots` token slots, `stride`
    /// elements apart). The table: `table_mode` "token_slots" (SGLang's `req_to_token`) or
    /// "page_ids" (a block table of `page_size`-token pages); `rows × cols`, `row_stride`
    /// i32 entries apart. `weights`: `(name, address, dtype, shape)`.
    #[new]
    #[pyo3(signature = (plan, k, v, slots, stride, table, table_mode, rows, cols, row_stride, page_size, weights, device=0, gemms="cached"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        plan: &Plan,
        k: Vec<u64>,
        v: Vec<u64>,
        slots: u64,
        stride: u64,
        table: u64,
        table_mode: &str,
        rows: u64,
        cols: u64,
        row_stride: u64,
        page_size: u64,
        weights: Vec<(String, u64, String, Vec<u64>)>,
        device: usize,
        gemms: &str,
    ) -> PyResult<Engine> {
        let mode = match table_mode {
            "token_slots" => TableMode::TokenSlots,
            "page_ids" => TableMode::PageIds,
            other => {
                return Err(PyValueError::new_err(format!(
                    "table_mode {other:?}: expected \"token_slots\" or \"page_ids\""
                )))
            }
        };
        let gemms = match gemms {
            "cached" => GemmPolicy::Cached,
            "heuristic" => GemmPolicy::Heuristic,
            "retune" => GemmPolicy::Retune,
            other => {
                return Err(PyValueError::new_err(format!(
                    "gemms {other:?}: expected \"cached\", \"heuristic\" or \"retune\""
                )))
            }
        };
        let mut tensors = HashMap::new();
        for (name, ptr, dt, shape) in weights {
            let dtype = dtype(&dt, &name)?;
            tensors.insert(name, DeviceTensor { ptr, dtype, shape });
        }
        let mem = EngineMemory {
            kv: KvRegistration { k, v, slots, stride },
            table: TableRegistration {
                ptr: table,
                mode,
                rows,
                cols,
                stride: row_stride,
                page_size,
            },
            weights: &tensors,
        };
        let opts = GpuOptions {
            gemms,
            device,
            ..GpuOptions::default()
        };
        let vp = plan.inner.clone();
        let graph = vp
            .buckets
            .iter()
            .map(|b| (b.batch, b.replay == Replay::Graph))
            .collect();
        // The runtime's CUDA handles are not Send, so the load holds the interpreter (it is
        // once per runner, off the replay path).
        let rt = GpuRuntime::with_engine_memory(vp, mem, opts).map_err(py_err)?;
        Ok(Engine { rt, graph })
    }

    /// One draft-extend step of `b` requests on the caller's stream: addresses of the
    /// inputs (`*_i32`: the tensor holds int32, else int64) and of the outputs, copied to
    /// by the device. Returns once enqueued: no synchronization, no host copy.
    #[pyo3(signature = (b, input_ids, hidden_states, req, req_i32, prefix, prefix_i32, prefix_bias, accept, accept_i32, out_probs, out_ids, out_hidden, stream))]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        b: usize,
        input_ids: u64,
        hidden_states: u64,
        req: u64,
        req_i32: bool,
        prefix: u64,
        prefix_i32: bool,
        prefix_bias: i32,
        accept: u64,
        accept_i32: bool,
        out_probs: u64,
        out_ids: u64,
        out_hidden: u64,
        stream: u64,
    ) -> PyResult<()> {
        let s = DeviceStep {
            b,
            input_ids,
            hidden_states,
            req_pool_indices: DeviceInts { ptr: req, i32: req_i32 },
            prefix_lens: DeviceInts {
                ptr: prefix,
                i32: prefix_i32,
            },
            accept_lens: DeviceInts {
                ptr: accept,
                i32: accept_i32,
            },
            prefix_bias,
            outputs: DeviceOutputs {
                topk_p: out_probs,
                topk_index: out_ids,
                hidden_states: out_hidden,
            },
            stream,
        };
        self.rt.step_device(&s).map(|_| ()).map_err(py_err)
    }

    /// What the device refused in the last step: `None`, or `(count, first request, rule
    /// description)`. Waits for the last step to finish.
    fn last_error(&self) -> PyResult<Option<(u64, u64, String)>> {
        Ok(self.rt.last_error().map_err(py_err)?.map(|e| {
            (
                e.count,
                e.request,
                e.rule
                    .map_or("an unknown rule".to_string(), |r| r.describe().to_string()),
            )
        }))
    }

    /// Whether a captured graph serves a batch of `b` (the smallest bucket ≥ b, when it
    /// replays as a graph).
    fn can_run(&self, b: usize) -> bool {
        b > 0
            && self
                .graph
                .iter()
                .find(|(batch, _)| *batch as usize >= b)
                .is_some_and(|(_, g)| *g)
    }

    /// Load times in milliseconds (setup, GEMM choice, graph capture, total).
    fn load_times(&self) -> BTreeMap<&'static str, f64> {
        let t = &self.rt.load;
        BTreeMap::from([
            ("setup_ms", t.setup_ms),
            ("gemm_ms", t.gemm.ms),
            ("graphs_ms", t.graphs_ms),
            ("total_ms", t.total_ms),
        ])
    }
}

/// The CUDA driver and GPUs, for `specplan.doctor()` (no context is created).
#[pyfunction]
pub fn driver_report() -> BTreeMap<String, String> {
    specplan_runtime::gpu::driver_report()
}
