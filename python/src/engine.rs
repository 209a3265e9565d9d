//! `Engine` (and, in `cpu_engine.rs`, `CpuEngine`): the runtime on the caller's memory over
//! raw addresses, and the registration both build. The
//! Python runner checks the tensors and passes their addresses; the runtime checks the
//! registration again (alignment, strides, sizes, a geometry under which no two K/V
//! elements alias) and each request on the device (or, for `CpuEngine`, on the host by the
//! same rules). `Engine` takes CUDA tensors and replays graphs on the caller's stream;
//! `CpuEngine` takes CPU tensors and runs the CPU executor on them in place.

use std::collections::{BTreeMap, HashMap};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use specplan_format::{DType, Replay, ValidatedPlan};
use specplan_runtime::gpu::{
    AcceptForm, Communicator, DecodeOutputs, DeviceDecode, DeviceError, DeviceInts, DeviceOutputs, DeviceStep,
    DeviceTensor, EngineMemory, GemmPolicy, GpuError, GpuOptions, GpuRuntime, KvGeometry, KvRegistration, L2Prefetch,
    StepPoll, TableMode, TableRegistration,
};
use specplan_runtime::registration::RegError;

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

pub(crate) fn reg_err(e: RegError) -> PyErr {
    PyValueError::new_err(e.to_string())
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

/// `(count, first request, rule, other request)` of a device refusal, for Python (`other`:
/// the request writing what an alias refusal's request reads).
pub(crate) type Refusal = (u64, u64, String, Option<u64>);

pub(crate) fn refusal(e: DeviceError) -> Refusal {
    (
        e.count,
        e.request,
        e.rule
            .map_or("an unknown rule".to_string(), |r| r.describe().to_string()),
        e.other,
    )
}

/// The registration both engines take, from the Python runner's arguments.
pub(crate) struct Registration {
    pub(crate) kv: KvRegistration,
    pub(crate) table: TableRegistration,
    pub(crate) weights: HashMap<String, DeviceTensor>,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn registration(
    k: Vec<u64>,
    v: Vec<u64>,
    geom: (u64, u64, u64, u64, u64),
    table: u64,
    table_mode: &str,
    rows: u64,
    cols: u64,
    row_stride: u64,
    page_size: u64,
    weights: Vec<(String, u64, String, Vec<u64>)>,
) -> PyResult<Registration> {
    let mode = match table_mode {
        "token_slots" => TableMode::TokenSlots,
        "page_ids" => TableMode::PageIds,
        other => {
            return Err(PyValueError::new_err(format!(
                "table_mode {other:?}: expected \"token_slots\" or \"page_ids\""
            )))
        }
    };
    let mut tensors = HashMap::new();
    for (name, ptr, dt, shape) in weights {
        let dtype = dtype(&dt, &name)?;
        tensors.insert(name, DeviceTensor { ptr, dtype, shape });
    }
    let (slots, page, page_stride, slot_stride, head_stride) = geom;
    Ok(Registration {
        kv: KvRegistration {
            k,
            v,
            geom: KvGeometry {
                slots,
                page,
                page_stride,
                slot_stride,
                head_stride,
            },
        },
        table: TableRegistration {
            ptr: table,
            mode,
            rows,
            cols,
            stride: row_stride,
            page_size,
        },
        weights: tensors,
    })
}

pub(crate) fn accept_form(select: bool) -> AcceptForm {
    if select {
        AcceptForm::SelectRows
    } else {
        AcceptForm::Lengths
    }
}

/// Whether a captured graph serves a batch of `b` (the smallest bucket ≥ b, when it
/// replays as a graph).
pub(crate) fn graph_serves(graph: &[(u32, bool)], b: usize) -> bool {
    b > 0
        && graph
            .iter()
            .find(|(batch, _)| *batch as usize >= b)
            .is_some_and(|(_, g)| *g)
}

pub(crate) fn graph_table(vp: &ValidatedPlan) -> Vec<(u32, bool)> {
    vp.buckets()
        .iter()
        .map(|b| (b.batch, b.replay == Replay::Graph))
        .collect()
}

/// A loaded runtime on the caller's CUDA memory. Not shareable across threads (its CUDA
/// objects belong to the thread that drives the engine's stream).
#[pyclass(module = "specplan._native", unsendable)]
pub struct Engine {
    rt: GpuRuntime,
    graph: Vec<(u32, bool)>,
}

#[pymethods]
impl Engine {
    /// `k`, `v`: per layer, the K and V pool addresses; `geom` = `(slots, page,
    /// page_stride, slot_stride, head_stride)` in elements (`KvGeometry`). The table:
    /// `table_mode` "token_slots" (SGLang's `req_to_token`) or "page_ids" (a block table of
    /// `page_size`-token pages); `rows × cols`, `row_stride` i32 entries apart. `weights`:
    /// `(name, address, dtype, shape)`.
    #[new]
    /// `communicator`: a sharded plan's NCCL communicator, the address of the engine's
    /// `ncclComm_t` (0: none), which the Python side keeps alive with the engine.
    /// `l2_prefetch`: the graphs' L2 prefetch branches, `"off"` or `"MIB[xCTAS][/MAXB]"`
    /// (`specplan_runtime::gpu::L2Prefetch`).
    #[pyo3(signature = (plan, k, v, geom, table, table_mode, rows, cols, row_stride, page_size, weights, device=0, gemms="cached", communicator=0, l2_prefetch="off"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        plan: &Plan,
        k: Vec<u64>,
        v: Vec<u64>,
        geom: (u64, u64, u64, u64, u64),
        table: u64,
        table_mode: &str,
        rows: u64,
        cols: u64,
        row_stride: u64,
        page_size: u64,
        weights: Vec<(String, u64, String, Vec<u64>)>,
        device: usize,
        gemms: &str,
        communicator: usize,
        l2_prefetch: &str,
    ) -> PyResult<Engine> {
        let l2_prefetch =
            L2Prefetch::parse(l2_prefetch).map_err(|e| PyValueError::new_err(format!("l2_prefetch: {e}")))?;
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
        let r = registration(
            k, v, geom, table, table_mode, rows, cols, row_stride, page_size, weights,
        )?;
        let mem = EngineMemory {
            kv: r.kv,
            table: r.table,
            weights: &r.weights,
        };
        let communicator = if communicator == 0 {
            None
        } else {
            // SAFETY: the Python Engine keeps the engine's communicator object (and so its
            // ncclComm_t) alive as long as this runtime, and steps run on the engine's
            // thread, which issues nothing else on the communicator meanwhile (the engines'
            // own collectives run between draft steps, on the same stream).
            Some(std::sync::Arc::new(
                unsafe { Communicator::borrowed(communicator) }.map_err(py_err)?,
            ))
        };
        let opts = GpuOptions {
            gemms,
            device,
            communicator,
            l2_prefetch,
            ..GpuOptions::default()
        };
        let vp = plan.inner.clone();
        let graph = graph_table(&vp);
        // The runtime's CUDA handles are not Send, so the load holds the interpreter (it is
        // once per runner, off the replay path).
        let rt = GpuRuntime::with_engine_memory(vp, mem, opts).map_err(py_err)?;
        Ok(Engine { rt, graph })
    }

    /// One draft-extend step of `b` requests on the caller's stream: addresses of the
    /// inputs (`*_i32`: the tensor holds int32, else int64; `accept_select`: the accept
    /// tensor holds the selected rows r·N + A − 1) and of the outputs (0: not copied),
    /// copied to by the device. Returns once enqueued: no synchronization, no host copy.
    #[pyo3(signature = (b, input_ids, ids_i32, hidden_states, req, req_i32, prefix, prefix_i32, prefix_bias, accept, accept_i32, accept_select, out_probs, out_ids, out_hidden, out_logits, stream))]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        b: usize,
        input_ids: u64,
        ids_i32: bool,
        hidden_states: u64,
        req: u64,
        req_i32: bool,
        prefix: u64,
        prefix_i32: bool,
        prefix_bias: i32,
        accept: u64,
        accept_i32: bool,
        accept_select: bool,
        out_probs: u64,
        out_ids: u64,
        out_hidden: u64,
        out_logits: u64,
        stream: u64,
    ) -> PyResult<()> {
        let s = DeviceStep {
            b,
            input_ids,
            ids_i32,
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
            accept_form: accept_form(accept_select),
            prefix_bias,
            outputs: DeviceOutputs {
                topk_p: out_probs,
                topk_index: out_ids,
                hidden_states: out_hidden,
                logits: out_logits,
            },
            stream,
        };
        self.rt.step_device(&s).map(|_| ()).map_err(py_err)
    }

    /// One step of draft-decode phase `phase` (`draft_decode:S`) on CUDA tensors, on the
    /// caller's stream: the arguments as `CpuEngine.draft_decode`'s (device addresses).
    /// Returns once enqueued: no synchronization, no host copy; each request is checked on
    /// the device (`admit_decode`) and a refused one writes nothing (`last_error`).
    #[pyo3(signature = (phase, b, topk_p, ids, ids_i32, hidden, req, req_i32, prefix, prefix_i32, prefix_bias, out_parents, out_index, out_tokens, stream=0, bonus=0, bonus_i32=false, out_verify=[0; 5], out_mask=0))]
    #[allow(clippy::too_many_arguments)]
    fn draft_decode(
        &mut self,
        phase: &str,
        b: usize,
        topk_p: u64,
        ids: u64,
        ids_i32: bool,
        hidden: u64,
        req: u64,
        req_i32: bool,
        prefix: u64,
        prefix_i32: bool,
        prefix_bias: i32,
        out_parents: u64,
        out_index: u64,
        out_tokens: u64,
        stream: u64,
        bonus: u64,
        bonus_i32: bool,
        out_verify: [u64; 5],
        out_mask: u64,
    ) -> PyResult<()> {
        let plan = self.rt.plan();
        let kind = plan
            .phase_by_label(phase)
            .filter(|k| k.steps() > 0)
            .ok_or_else(|| PyValueError::new_err(format!("phase {phase:?}: the plan has {}", plan.phase_labels())))?;
        let s = DeviceDecode {
            b,
            topk_p,
            topk_index: ids,
            ids_i32,
            hidden_states: hidden,
            req_pool_indices: DeviceInts { ptr: req, i32: req_i32 },
            prefix_lens: DeviceInts {
                ptr: prefix,
                i32: prefix_i32,
            },
            prefix_bias,
            bonus_tokens: (bonus != 0).then_some(DeviceInts {
                ptr: bonus,
                i32: bonus_i32,
            }),
            outputs: DecodeOutputs {
                parent_list: out_parents,
                top_scores_index: out_index,
                draft_tokens: out_tokens,
                verify: out_verify,
                tree_mask: out_mask,
            },
            stream,
        };
        self.rt.step_decode_device(kind, &s).map(|_| ()).map_err(py_err)
    }

    /// What the device refused in the last step: `None`, or `(count, first request, rule
    /// description)`. Waits for the last step to finish.
    fn last_error(&self) -> PyResult<Option<Refusal>> {
        Ok(self.rt.last_error().map_err(py_err)?.map(refusal))
    }

    /// The refusals of the steps that finished since the last poll, without waiting:
    /// `(refusals, pending, lost)` — one `(count, first request, rule)` per step that
    /// refused any, whether a later step is still running, and how many unpolled steps
    /// were overwritten in the ring.
    fn poll_error(&mut self) -> PyResult<(Vec<Refusal>, bool, u32)> {
        Ok(match self.rt.poll_error().map_err(py_err)? {
            StepPoll::Idle => (Vec::new(), false, 0),
            StepPoll::Done { refused, pending, lost } => (refused.into_iter().map(refusal).collect(), pending, lost),
        })
    }

    fn can_run(&self, b: usize) -> bool {
        graph_serves(&self.graph, b)
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
