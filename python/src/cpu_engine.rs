//! `CpuEngine`: the runtime contract on the caller's CPU memory (the CPU executor on the
//! engine's tensors in place), over raw host addresses the Python runner checked.

use specplan_format::io;
use specplan_format::PhaseKind;
use std::collections::BTreeMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specplan_format::{signature, DType};
use specplan_runtime::cpu::engine::{CpuEngine as HostEngine, HostOutputs, HostStep};
use specplan_runtime::cpu::engine_decode::{HostDecode, HostDecodeOutputs};
use specplan_runtime::gpu::{
    decode_tensors, step_tensors, DecodeOutputs, DeviceDecode, DeviceInts, DeviceOutputs, DeviceStep, EngineMemory,
};
use specplan_runtime::registration::shares_with_outputs;

use crate::engine::{accept_form, graph_serves, graph_table, refusal, reg_err, registration, Refusal};
use crate::host_inputs::{HostIn, HostInts};
use crate::plan::Plan;

/// The same runtime contract on the caller's CPU memory: the CPU executor on the engine's
/// tensors in place (the K/V pool and table read and written where they are; the weights
/// read once). For tests of engine adapters on machines without a GPU.
#[pyclass(module = "specplan._native", unsendable)]
pub struct CpuEngine {
    eng: HostEngine,
    graph: Vec<(u32, bool)>,
    facts: (usize, usize, usize, usize, usize, DType),
}

#[pymethods]
impl CpuEngine {
    /// As `Engine`, with host addresses (CPU tensors).
    #[new]
    #[pyo3(signature = (plan, k, v, geom, table, table_mode, rows, cols, row_stride, page_size, weights))]
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
    ) -> PyResult<CpuEngine> {
        let r = registration(
            k, v, geom, table, table_mode, rows, cols, row_stride, page_size, weights,
        )?;
        let mem = EngineMemory {
            kv: r.kv,
            table: r.table,
            weights: &r.weights,
        };
        let vp = plan.inner.clone();
        let graph = graph_table(&vp);
        let p = &vp;
        let facts = (
            p.rows_per_request(PhaseKind::DraftExtend) as usize,
            p.model.hidden_in() as usize,
            p.model.hidden as usize,
            p.spec.topk as usize,
            signature::logits_cols(p) as usize,
            p.capture.dtype,
        );
        // SAFETY: the Python runner passes the addresses of live CPU tensors it checked
        // (dtype, shape, strides: the pools span the geometry, the table rows × row_stride
        // int32, each weight its shape) and keeps references to them for the engine's life;
        // the interpreter serializes every use of this object (unsendable).
        let eng = unsafe { HostEngine::new(vp, mem) }.map_err(reg_err)?;
        Ok(CpuEngine { eng, graph, facts })
    }

    /// As `Engine.step`, on host addresses (runs to completion; `stream` is ignored).
    #[pyo3(signature = (b, input_ids, ids_i32, hidden_states, req, req_i32, prefix, prefix_i32, prefix_bias, accept, accept_i32, accept_select, out_probs, out_ids, out_hidden, out_logits, stream=0))]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        py: Python<'_>,
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
        let _ = stream;
        let (n, hin, h, k, cols, _) = self.facts;
        non_null(&[
            (io::INPUT_IDS, input_ids),
            (io::HIDDEN_STATES, hidden_states),
            ("req_pool_indices", req),
            (io::PREFIX_LENS, prefix),
            (io::ACCEPT_LENS, accept),
        ])?;
        // The outputs may overlap no input of a later chunk, no other output and none of the
        // registered memory (checked before any slice is made); an input that shares memory
        // with an output is read through a copy.
        let bb = b as u64;
        let ints = |ptr, i32| DeviceInts { ptr, i32 };
        let tensors = step_tensors(
            self.eng.plan(),
            &DeviceStep {
                b,
                input_ids,
                ids_i32,
                hidden_states,
                req_pool_indices: ints(req, req_i32),
                prefix_lens: ints(prefix, prefix_i32),
                accept_lens: ints(accept, accept_i32),
                accept_form: accept_form(accept_select),
                prefix_bias,
                outputs: DeviceOutputs {
                    topk_p: out_probs,
                    topk_index: out_ids,
                    hidden_states: out_hidden,
                    logits: out_logits,
                },
                stream: 0,
            },
        );
        self.eng
            .check_step_memory(&tensors, bb)
            .map_err(PyValueError::new_err)?;
        let copy = |i: usize| shares_with_outputs(&tensors[i], &tensors, bb);
        // SAFETY: (every input and output below) the Python runner checked each tensor's
        // dtype, shape [b, ...] and contiguity on the CPU before passing its address, and
        // holds it for the call; outputs are the runner's own tensors of the plan's shapes
        // or the caller's, checked above to share no byte with each other or with the
        // registered pool, table and weights; no input shares a byte with the pool (the step
        // writes K/V through raw pointers), and an input that shares memory with an output is
        // copied before any output slice exists.
        let (ids, hid, reqs, prefixes, accepts) = unsafe {
            (
                HostInts::new(input_ids, ids_i32, b * n, copy(0)),
                HostIn::<u16>::new(hidden_states, b * n * hin, copy(1)),
                HostInts::new(req, req_i32, b, copy(2)),
                HostInts::new(prefix, prefix_i32, b, copy(3)),
                HostInts::new(accept, accept_i32, b, copy(4)),
            )
        };
        let x = HostStep {
            input_ids: ids.ints(),
            hidden: hid.get(),
            req: reqs.ints(),
            prefix: prefixes.ints(),
            accept: accepts.ints(),
            accept_form: accept_form(accept_select),
            prefix_bias,
        };
        // SAFETY: as above; a null address leaves that output uncopied.
        let mut out = unsafe {
            HostOutputs {
                topk_p: (out_probs != 0).then(|| std::slice::from_raw_parts_mut(out_probs as *mut f32, b * k)),
                topk_index: (out_ids != 0).then(|| std::slice::from_raw_parts_mut(out_ids as *mut i64, b * k)),
                hidden: (out_hidden != 0).then(|| std::slice::from_raw_parts_mut(out_hidden as *mut u16, b * h)),
                logits: (out_logits != 0).then(|| std::slice::from_raw_parts_mut(out_logits as *mut f32, b * cols)),
            }
        };
        let _ = py;
        self.eng.step(&x, &mut out).map_err(PyValueError::new_err)
    }

    /// One step of draft-decode phase `phase` (`draft_decode:S`) on host addresses: inputs
    /// `topk_p` f32 [b, K], `ids` [b, K] (target ids; int32 with `ids_i32`), `hidden`
    /// [b, H] in the plan's dtype, `req` / `prefix` [b]; outputs (0: not copied)
    /// parent_list [b, (S−1)K+1], top_scores_index and draft_tokens [b, N−1], int64. A plan
    /// with the verify inputs also takes `bonus` [b] (0: none; int32 with `bonus_i32`) and
    /// writes `out_verify` (verify_tokens, verify_positions, retrieve_index,
    /// retrieve_next_token, retrieve_next_sibling: [b, N] int64 each; 0: not copied) and
    /// `out_mask` [b, N, N] int32.
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
        let _ = stream;
        let plan = self.eng.plan();
        let kind = plan
            .phase_by_label(phase)
            .filter(|k| k.steps() > 0)
            .ok_or_else(|| PyValueError::new_err(format!("phase {phase:?}: the plan has {}", plan.phase_labels())))?;
        let k = plan.spec.topk as usize;
        let h = plan.model.hidden as usize;
        // The outputs' widths from the phase's signature.
        let sig = signature::resolve(plan, kind, 1);
        let width = |name: &str| {
            sig.iter()
                .find(|r| r.decl.name == name)
                .and_then(|r| r.shape.get(1).copied())
                .unwrap_or(0) as usize
        };
        let (pw, nodes) = (width(io::PARENT_LIST), width(io::TOP_SCORES_INDEX));
        let n = nodes + 1;
        non_null(&[
            (io::TOPK_PROBS, topk_p),
            (io::TOPK_IDS, ids),
            (io::HIDDEN_STATES, hidden),
            ("req_pool_indices", req),
            (io::PREFIX_LENS, prefix),
        ])?;
        // As `step`: outputs checked against everything, inputs that share memory with an
        // output read through a copy.
        let bb = b as u64;
        let ints = |ptr, i32| DeviceInts { ptr, i32 };
        let tensors = decode_tensors(
            plan,
            kind,
            &DeviceDecode {
                b,
                topk_p,
                topk_index: ids,
                ids_i32,
                hidden_states: hidden,
                req_pool_indices: ints(req, req_i32),
                prefix_lens: ints(prefix, prefix_i32),
                prefix_bias,
                bonus_tokens: (bonus != 0).then(|| ints(bonus, bonus_i32)),
                outputs: DecodeOutputs {
                    parent_list: out_parents,
                    top_scores_index: out_index,
                    draft_tokens: out_tokens,
                    verify: out_verify,
                    tree_mask: out_mask,
                },
                stream: 0,
            },
        );
        self.eng
            .check_step_memory(&tensors, bb)
            .map_err(PyValueError::new_err)?;
        let copy = |i: usize| shares_with_outputs(&tensors[i], &tensors, bb);
        // SAFETY: (every input and output below) as `step`'s: the runner checked each
        // tensor's dtype, shape [b, ...] and contiguity and holds it for the call; outputs
        // share no byte with each other or the registered memory, no input shares one with
        // the pool, and an input that shares memory with an output is copied before any
        // output slice exists.
        let (probs, ids_in, hid, reqs, prefixes, bonuses) = unsafe {
            (
                HostIn::<f32>::new(topk_p, b * k, copy(0)),
                HostInts::new(ids, ids_i32, b * k, copy(1)),
                HostIn::<u16>::new(hidden, b * h, copy(2)),
                HostInts::new(req, req_i32, b, copy(3)),
                HostInts::new(prefix, prefix_i32, b, copy(4)),
                (bonus != 0).then(|| HostInts::new(bonus, bonus_i32, b, copy(5))),
            )
        };
        let x = HostDecode {
            topk_p: probs.get(),
            topk_index: ids_in.ints(),
            hidden: hid.get(),
            req: reqs.ints(),
            prefix: prefixes.ints(),
            prefix_bias,
            bonus_tokens: bonuses.as_ref().map(|x| x.ints()),
        };
        // SAFETY: as above; a null address leaves that output uncopied.
        let mut out = unsafe {
            HostDecodeOutputs {
                parent_list: (out_parents != 0)
                    .then(|| std::slice::from_raw_parts_mut(out_parents as *mut i64, b * pw)),
                top_scores_index: (out_index != 0)
                    .then(|| std::slice::from_raw_parts_mut(out_index as *mut i64, b * nodes)),
                draft_tokens: (out_tokens != 0)
                    .then(|| std::slice::from_raw_parts_mut(out_tokens as *mut i64, b * nodes)),
                verify: out_verify.map(|p| (p != 0).then(|| std::slice::from_raw_parts_mut(p as *mut i64, b * n))),
                tree_mask: (out_mask != 0).then(|| std::slice::from_raw_parts_mut(out_mask as *mut i32, b * n * n)),
            }
        };
        self.eng.draft_decode(kind, &x, &mut out).map_err(PyValueError::new_err)
    }

    fn last_error(&self) -> Option<Refusal> {
        self.eng.last_error().map(refusal)
    }

    /// As `Engine.poll_error` (a CPU step has finished when `step` returns).
    fn poll_error(&mut self) -> (Vec<Refusal>, bool, u32) {
        (self.eng.take_unpolled().into_iter().map(refusal).collect(), false, 0)
    }

    fn can_run(&self, b: usize) -> bool {
        graph_serves(&self.graph, b)
    }

    fn load_times(&self) -> BTreeMap<&'static str, f64> {
        BTreeMap::new()
    }
}

/// A clear error naming the first input whose host address is 0 (the bindings read them as
/// slices, which a null pointer may never back).
fn non_null(inputs: &[(&str, u64)]) -> PyResult<()> {
    match inputs.iter().find(|(_, p)| *p == 0) {
        Some((name, _)) => Err(PyValueError::new_err(format!("{name} is a null pointer"))),
        None => Ok(()),
    }
}
