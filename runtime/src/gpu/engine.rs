//! Engine memory: the caller's K/V pool, page table and weights are registered once and used
//! in place (`memory.rs`); a step's inputs are the caller's device tensors and everything
//! runs on the caller's stream. Each bucket's graph is `admit` (the caller's inputs copied
//! into the bucket's input buffers and checked per request on the device), the plan's
//! launches, then `emit` (the outputs copied to the caller's tensors). Per step the host
//! sets the captured `admit` node's parameters (the step's pointers and b) and launches the
//! graph: O(1) host work, no copy through the host, no synchronization.
//!
//! A request that breaks a device rule (`kv::DeviceRule`) writes nothing — its row is
//! turned into padding before any launch reads it, and `emit` skips it — and is counted in
//! the status words, tagged with the step (so no reset races a later step), which
//! `last_error` reads after waiting on an event recorded at the end of the step (the
//! caller's stream handle is never kept). Steps share the runtime's arena and status
//! words: the caller serializes them (one stream, or its own ordering between streams).

use std::time::Instant;

use cudarc::driver::{result, sys};
use specplan_format::PhaseKind;
use specplan_format::{io, BucketFacts, KernelFacts, Plan, Replay, ValidatedPlan};
use specplan_kernels::abi::{Kernel, KernelParams};
use specplan_kernels::entries::io::{admit_smem_bytes, AdmitParams, AdmitPtrs, EmitParams, EmitPtrs};
use specplan_kernels::kv;
use specplan_kernels::Entry;

use super::device::{cuda, cuda_rc, DevMem, Event, GpuError};
use super::launch::{launch_packed, pack_slots};
use super::memory::{bind_weights, check_kv, check_table, EngineMemory, Memory, WeightBinding};
use super::{meta_block, GpuOptions, GpuRuntime, Mode, StepInfo};
use crate::registration::{Regions, StepTensor};

/// A `[b]` integer tensor of the caller: its address and whether it holds i32 (else i64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceInts {
    pub ptr: u64,
    pub i32: bool,
}

/// Where `emit` copies a step's outputs: `[b, K]` f32, `[b, K]` i64, `[b, H]` act,
/// `[b, logits_cols]` f32 (0 leaves that output in the runtime's buffers only; an output
/// the plan does not emit must be 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceOutputs {
    pub topk_p: u64,
    pub topk_index: u64,
    pub hidden_states: u64,
    pub logits: u64,
}

/// What a step's accept tensor holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AcceptForm {
    /// `A`, accepted tokens per request.
    #[default]
    Lengths,
    /// Each request's selected row `r·N + A − 1` in the whole batch (SGLang's
    /// `select_index`, vLLM's `last_token_indices`).
    SelectRows,
}

/// One engine-memory step: `b` requests whose inputs are the caller's device tensors.
#[derive(Clone, Copy, Debug)]
pub struct DeviceStep {
    pub b: usize,
    /// `[b, N]` i64 (i32 with `ids_i32`).
    pub input_ids: u64,
    pub ids_i32: bool,
    /// `[b, N, H]` in the plan's activation type.
    pub hidden_states: u64,
    /// `[b]` rows of the registered page table.
    pub req_pool_indices: DeviceInts,
    /// `[b]` tokens already cached per request (plus `prefix_bias`).
    pub prefix_lens: DeviceInts,
    /// `[b]` accepted tokens per request (or their selected rows: `accept_form`).
    pub accept_lens: DeviceInts,
    pub accept_form: AcceptForm,
    /// Added to every prefix length on the device (−N when the caller passes SGLang's
    /// `seq_lens`, which count the N new tokens).
    pub prefix_bias: i32,
    pub outputs: DeviceOutputs,
    /// The caller's stream (`CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`).
    pub stream: u64,
}

pub(crate) struct EngineState {
    /// The registered memory's byte ranges (a step's tensors are checked against them).
    pub(super) regions: Regions,
    /// Kernel indices of `admit` and `emit` in the plan.
    pub admit: u32,
    pub emit: u32,
    /// Recorded on the caller's stream at the end of every step (what `last_error` waits
    /// on; the stream itself may be gone by then): an external event node at the end of
    /// each captured graph, so a replay needs no host call for it.
    pub(super) done: Event,
    /// The last step's tag in the status words (0: no step yet).
    pub(super) epoch: u32,
    /// The last step whose refusals `poll_error` has reported (0: none).
    pub(super) polled: u32,
    /// Buckets whose graph has had its admit parameters set by a step.
    armed: Vec<bool>,
    /// The plan's kernel facts (read on every step).
    facts: KernelFacts,
    /// Per bucket, `admit`'s pointers that never change (the bucket's input buffers and
    /// the runtime's words), resolved once at load: a step looks up no buffer by name.
    fixed: Vec<AdmitPtrs<u64>>,
    /// Draft decode's prologue and epilogue (`engine_decode.rs`).
    pub(super) decode: super::engine_decode::DecodeIo,
}

/// The per-step values of `admit` (the placeholders at capture time).
pub(crate) struct StepArgs {
    pub ptrs: AdmitPtrs<u64>,
    pub b: u32,
    pub flags: u32,
    pub prefix_bias: i32,
    pub base: u32,
    pub epoch: u32,
}

impl StepArgs {
    pub fn placeholder(batch: u32) -> StepArgs {
        StepArgs {
            ptrs: AdmitPtrs {
                src_ids: 0,
                src_hidden: 0,
                src_req: 0,
                src_prefix: 0,
                src_accept: 0,
                out_probs: 0,
                out_ids: 0,
                out_hidden: 0,
                out_logits: 0,
                ids: 0,
                hidden: 0,
                req_slots: 0,
                prefix_lens: 0,
                accept_lens: 0,
                page_table: 0,
                kv_layout: 0,
                status: 0,
            },
            b: batch,
            flags: 0,
            prefix_bias: 0,
            base: 0,
            epoch: 0,
        }
    }
}

pub(crate) fn kernel_of(plan: &Plan, entry: Entry) -> Result<u32, GpuError> {
    plan.kernels
        .iter()
        .position(|k| k.entry == entry)
        .map(|i| i as u32)
        .ok_or_else(|| GpuError::Registration(format!("the plan has no {entry} kernel (recompile it)")))
}

impl EngineState {
    /// The next step's tag in the status words. Tags 0 (fresh words) and u32::MAX (the
    /// initial first-refusal word) never name a step.
    pub fn next_epoch(&mut self) -> u32 {
        self.epoch = self.epoch.wrapping_add(1).max(1);
        if self.epoch == u32::MAX {
            self.epoch = 1;
        }
        self.epoch
    }

    pub fn armed(&self, bi: usize) -> bool {
        self.armed.get(bi).copied().unwrap_or(false)
    }

    /// `admit`'s packed parameters for bucket `bi` with this step's values (the bucket's
    /// input buffers and the runtime's words filled in).
    pub fn admit_blob(&self, plan: &Plan, bi: usize, a: &StepArgs) -> Vec<u8> {
        let b = &plan.buckets()[bi];
        let f = &self.fixed[bi];
        let ptrs = AdmitPtrs {
            ids: f.ids,
            hidden: f.hidden,
            req_slots: f.req_slots,
            prefix_lens: f.prefix_lens,
            accept_lens: f.accept_lens,
            page_table: f.page_table,
            kv_layout: f.kv_layout,
            status: f.status,
            ..a.ptrs.clone()
        };
        let (_, mut s) = AdmitParams::launch(&specplan_format::bucket_facts(b), &self.facts);
        s.b = a.b;
        s.flags = a.flags;
        s.prefix_bias = a.prefix_bias as u32;
        s.base = a.base;
        s.epoch = a.epoch;
        pack_slots(&Entry::Admit.abi(), &AdmitParams::assemble(ptrs, s))
    }

    /// Records the end-of-step event on `stream`: under capture as an external event node
    /// (recorded by every replay of the graph), otherwise (an eager step) directly — the
    /// external flag is invalid outside a capture.
    pub fn record_done(&self, stream: sys::CUstream) -> Result<(), GpuError> {
        let flags = if super::graph::capturing(stream)? {
            sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL
        } else {
            sys::CUevent_record_flags::CU_EVENT_RECORD_DEFAULT
        };
        // SAFETY: the runtime's live event on the caller's (or, at capture, the runtime's)
        // live stream.
        cuda_rc("cuEventRecordWithFlags", unsafe {
            sys::cuEventRecordWithFlags(self.done.0, stream, flags as u32)
        })
    }

    pub fn issue_admit(
        &self,
        funcs: &[sys::CUfunction],
        b: &BucketFacts,
        f: &KernelFacts,
        blob: &mut [u8],
        stream: sys::CUstream,
    ) -> Result<(), GpuError> {
        let (grid, _) = AdmitParams::launch(b, f);
        let block = [AdmitParams::threads(f), 1, 1];
        let smem = admit_smem_bytes(b.batch, f.n);
        launch_packed(funcs[self.admit as usize], grid, block, smem, blob, stream)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn issue_emit(
        &self,
        plan: &Plan,
        mem: &Memory,
        funcs: &[sys::CUfunction],
        bi: usize,
        b: &BucketFacts,
        f: &KernelFacts,
        stream: sys::CUstream,
    ) -> Result<(), GpuError> {
        let bk = &plan.buckets()[bi];
        // An output the plan does not emit has no buffer: its pointer is null.
        let buf = |name: &str| bk.buffer(name).map_or(0, |(_, x)| mem.arena.ptr + x.offset);
        let ptrs = EmitPtrs {
            req_slots: buf(io::REQ_SLOTS),
            probs: buf(io::TOPK_PROBS),
            ids: buf(io::TOPK_IDS),
            hidden: buf(io::HIDDEN_OUT),
            logits: buf(io::LOGITS),
            status: mem.status_ptr(),
        };
        let (grid, s) = EmitParams::launch(b, f);
        let mut blob = pack_slots(&Entry::Emit.abi(), &EmitParams::assemble(ptrs, s));
        launch_packed(
            funcs[self.emit as usize],
            grid,
            [EmitParams::threads(f), 1, 1],
            0,
            &mut blob,
            stream,
        )
    }
}

/// `admit`'s pointers of bucket `bi` that are fixed for the runtime's life (the per-step
/// ones are left 0).
fn admit_fixed(plan: &Plan, mem: &Memory, bi: usize) -> AdmitPtrs<u64> {
    let b = &plan.buckets()[bi];
    let buf = |name: &str| b.buffer(name).map_or(0, |(_, x)| mem.arena.ptr + x.offset);
    AdmitPtrs {
        ids: buf(io::INPUT_IDS),
        hidden: buf(io::HIDDEN_STATES),
        req_slots: buf(io::REQ_SLOTS),
        prefix_lens: buf(io::PREFIX_LENS),
        accept_lens: buf(io::ACCEPT_LENS),
        page_table: mem.table.ptr,
        kv_layout: mem.layout_ptr(),
        status: mem.status_ptr(),
        ..StepArgs::placeholder(0).ptrs
    }
}

/// The node of the `admit` launch in a captured graph: the graph's root (it was captured
/// first, so everything else depends on it), a kernel node of `func`.
pub(crate) fn find_node(g: &super::graph::Exec, func: sys::CUfunction) -> Result<sys::CUgraphNode, GpuError> {
    let none = |why: &str| GpuError::Cuda {
        call: "cuGraphGetRootNodes",
        message: format!("the captured graph's admit node: {why}"),
    };
    let roots = super::graph::roots(g.cu_graph())?;
    let [node] = roots[..] else {
        return Err(none(&format!(
            "{} root nodes, expected the admit launch alone",
            roots.len()
        )));
    };
    if super::graph::node_type(node)? != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Err(none("the root is not a kernel node"));
    }
    // SAFETY: zeroed plain C struct, filled by the call.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a kernel node; out-pointer to a local.
    cuda_rc("cuGraphKernelNodeGetParams", unsafe {
        sys::cuGraphKernelNodeGetParams_v2(node, &mut p)
    })?;
    if !p.func.is_null() && p.func != func {
        return Err(none("the root kernel is not admit"));
    }
    Ok(node)
}

impl GpuRuntime {
    /// Loads a plan onto the caller's memory (engine mode): the registrations are checked,
    /// weights given under a plan weight's own name are used in place (others are packed
    /// once from their sources into runtime memory), and every bucket's graph is captured
    /// against these addresses. The runtime allocates only its arena, its graphs and a few
    /// words. The caller keeps every registered tensor alive and in place for the runtime's
    /// life.
    pub fn with_engine_memory(plan: ValidatedPlan, m: EngineMemory, opts: GpuOptions) -> Result<GpuRuntime, GpuError> {
        let t0 = Instant::now();
        check_kv(&plan, &m.kv)?;
        check_table(&plan, &m.table)?;
        let regions = Regions::of(&plan, &m)?;
        // A gathered weight (FR-Spec's hot rows) names its ids tensor among the sources:
        // given on the device, it is read once here (load time; never on the replay path).
        let ids_of = |name: &str| -> Option<Vec<i64>> {
            let t = m.weights.get(name)?;
            if t.dtype != specplan_format::DType::I64 || t.shape.len() != 1 || t.ptr == 0 || t.ptr % 8 != 0 {
                return None;
            }
            let mut v = vec![0i64; usize::try_from(t.shape[0]).ok()?];
            // The caller may have written it on a non-blocking stream, which the legacy
            // stream's copy below does not wait for: every stream of the context first.
            result::ctx::synchronize().ok()?;
            // SAFETY: the caller's i64 tensor of shape [n] (its registration says so);
            // synchronous copy at load.
            unsafe { result::memcpy_dtoh_sync(&mut v, t.ptr) }.ok()?;
            Some(v)
        };
        let bindings = bind_weights(&plan, m.weights, &ids_of)?;
        // EAGLE-3's d2t is used in place; its ids leave the runtime as target ids, so it is
        // read once here and checked against the target vocabulary.
        crate::registration::check_d2t(&plan, ids_of("d2t").as_deref())?;
        // FR-Spec's hot ids likewise (the top-K emits them), however lm_head.hot was given.
        crate::registration::check_hot_ids(&plan, ids_of("hot_token_ids").as_deref())?;
        let (admit, emit) = (kernel_of(&plan, Entry::Admit)?, kernel_of(&plan, Entry::Emit)?);
        let core = Self::core(&plan, &opts)?;
        // admit's write set grows with the bucket: above 48 KiB of shared memory a kernel
        // must opt in to it.
        let n = plan.rows_per_request(PhaseKind::DraftExtend);
        let smem = plan
            .buckets()
            .iter()
            .map(|b| admit_smem_bytes(b.batch, n))
            .max()
            .unwrap_or(0);
        if smem > 48 * 1024 {
            // SAFETY: a function of the runtime's loaded module; the attribute is a size
            // validation bounds (bucket rows ≤ ADMIT_MAX_ROWS keeps it under 227 KiB).
            cuda_rc("cuFuncSetAttribute", unsafe {
                sys::cuFuncSetAttribute(
                    core.funcs[admit as usize],
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            })?;
        }
        let (weights, owned) = place_weights(&plan, &bindings)?;
        let decode_smem_of = |mem: &Memory| -> Result<_, GpuError> {
            let d = super::engine_decode::DecodeIo::new(&plan, mem)?;
            let smem = d.max_smem(&plan);
            Ok((d, smem))
        };
        let mem = Memory {
            arena: DevMem::new(plan.arena_bytes() as usize)?,
            weights,
            kv: m.kv,
            table: m.table,
            meta: meta_block()?,
            mirror: super::device::Mapped::new(kv::MIRROR_WORDS * kv::MIRROR_SLOTS)?,
            _owned: owned,
        };
        let (decode, decode_smem) = decode_smem_of(&mem)?;
        if decode_smem > 48 * 1024 {
            // SAFETY: as admit's above (a decode bucket's lane writes ≤ ADMIT_MAX_ROWS, else
            // engine memory does not serve it).
            cuda_rc("cuFuncSetAttribute", unsafe {
                sys::cuFuncSetAttribute(
                    core.funcs[decode.admit as usize],
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    decode_smem as i32,
                )
            })?;
        }
        let state = EngineState {
            regions,
            decode,
            admit,
            emit,
            done: Event::new(false)?,
            epoch: 0,
            polled: 0,
            armed: vec![false; plan.buckets().len()],
            facts: specplan_format::kernel_facts_of(&plan),
            fixed: (0..plan.buckets().len())
                .map(|bi| admit_fixed(&plan, &mem, bi))
                .collect(),
        };
        Self::finish(plan, core, mem, Mode::Engine(state), &opts, t0)
    }

    pub(super) fn engine(&self) -> Result<&EngineState, GpuError> {
        match &self.mode {
            Mode::Engine(e) => Ok(e),
            Mode::Owned(_) => Err(GpuError::Mode("an engine-memory step")),
        }
    }

    /// What every engine-memory step does before its chunks: binds the runtime's context,
    /// refuses a stream under capture (the step sets graph parameters on the host, which a
    /// capture would not record) and returns the step's tag in the status words.
    pub(super) fn begin_engine_step(&mut self, stream: sys::CUstream) -> Result<u32, GpuError> {
        // The null, legacy and per-thread stream handles mean the current context's.
        cuda("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
        if super::graph::capturing(stream)? {
            return Err(GpuError::Step(
                "the stream is being captured: a step sets its graph's parameters on the host, which a capture would not record; run it outside the capture".into(),
            ));
        }
        match &mut self.mode {
            Mode::Engine(e) => Ok(e.next_epoch()),
            Mode::Owned(_) => Err(GpuError::Mode("an engine-memory step")),
        }
    }

    /// One draft-extend step on the caller's device tensors, on the caller's stream:
    /// returns once the work is enqueued (no synchronization, no copy through the host).
    /// Outputs land in `s.outputs` (and in the runtime's buffers, valid until the next
    /// step). Requests the device rules refuse write nothing; `last_error` reports them.
    /// Batches above the largest bucket run as consecutive replays of the largest bucket.
    pub fn step_device(&mut self, s: &DeviceStep) -> Result<StepInfo, GpuError> {
        let t0 = Instant::now();
        let n = self.plan.rows_per_request(PhaseKind::DraftExtend) as u64;
        let (h, k) = (self.plan.model.hidden as u64, self.plan.spec.topk as u64);
        let cols = specplan_format::signature::logits_cols(&self.plan) as u64;
        let hin = self.plan.model.hidden_in() as u64;
        let act = self.plan.capture.dtype.size();
        if s.b == 0 {
            return Err(GpuError::Step("a step needs at least one request".into()));
        }
        let outs = self.plan.capture.outputs;
        for (name, p, emitted) in [
            ("topk_p", s.outputs.topk_p, outs.topk),
            ("topk_index", s.outputs.topk_index, outs.topk),
            (io::LOGITS, s.outputs.logits, outs.logits),
        ] {
            if p != 0 && !emitted {
                return Err(GpuError::Step(format!(
                    "outputs.{name}: the plan does not emit it (capture.outputs = {}); pass 0",
                    outs.name()
                )));
            }
        }
        for (name, p) in [
            (io::INPUT_IDS, s.input_ids),
            (io::HIDDEN_STATES, s.hidden_states),
            ("req_pool_indices", s.req_pool_indices.ptr),
            (io::PREFIX_LENS, s.prefix_lens.ptr),
            (io::ACCEPT_LENS, s.accept_lens.ptr),
        ] {
            if p == 0 {
                return Err(GpuError::Step(format!("{name} is a null pointer")));
            }
        }
        let max_b = self.plan.buckets().last().map_or(0, |x| x.batch as usize);
        self.engine()?
            .regions
            .check_step(&step_tensors(&self.plan, s), s.b as u64, max_b.max(1) as u64)
            .map_err(GpuError::Step)?;
        let stream = s.stream as sys::CUstream;
        let epoch = self.begin_engine_step(stream)?;
        let flags = s.req_pool_indices.i32 as u32
            | (s.prefix_lens.i32 as u32) << 1
            | (s.accept_lens.i32 as u32) << 2
            | if s.ids_i32 { kv::ADMIT_FLAG_IDS_I32 } else { 0 }
            | if s.accept_form == AcceptForm::SelectRows {
                kv::ADMIT_FLAG_SELECT
            } else {
                0
            };
        let last_start = (s.b - 1) / max_b.max(1) * max_b.max(1);
        let width = |d: DeviceInts| if d.i32 { 4 } else { 8 };
        let mut info = StepInfo {
            bucket: 0,
            graph: true,
            prep_us: 0.0,
        };
        for start in (0..s.b).step_by(max_b.max(1)) {
            let end = (start + max_b).min(s.b);
            let st = start as u64;
            let at = |p: u64, per: u64| if p == 0 { 0 } else { p + st * per };
            let args = StepArgs {
                ptrs: AdmitPtrs {
                    src_ids: at(s.input_ids, n * if s.ids_i32 { 4 } else { 8 }),
                    src_hidden: at(s.hidden_states, n * hin * act),
                    src_req: at(s.req_pool_indices.ptr, width(s.req_pool_indices)),
                    src_prefix: at(s.prefix_lens.ptr, width(s.prefix_lens)),
                    src_accept: at(s.accept_lens.ptr, width(s.accept_lens)),
                    out_probs: at(s.outputs.topk_p, k * 4),
                    out_ids: at(s.outputs.topk_index, k * 8),
                    out_hidden: at(s.outputs.hidden_states, h * act),
                    out_logits: at(s.outputs.logits, cols * 4),
                    ..StepArgs::placeholder(0).ptrs
                },
                b: (end - start) as u32,
                flags: if start == last_start {
                    flags | kv::ADMIT_FLAG_LAST
                } else {
                    flags
                },
                prefix_bias: s.prefix_bias,
                base: start as u32,
                epoch,
            };
            let bi = self
                .bucket_for(end - start)
                .ok_or_else(|| self.no_bucket(end - start))?;
            // Host preparation of this chunk (the first chunk's includes the checks above).
            let t = if start == 0 { t0 } else { Instant::now() };
            let graph = self.replay_engine(bi, &args, stream, t, &mut info)?;
            info.graph &= graph;
            info.bucket = self.plan.buckets()[bi].batch;
        }
        // The end-of-step event was recorded by the last replay (its graph's event node, or
        // the eager issue).
        Ok(info)
    }

    /// Sets bucket `bi`'s admit parameters and launches its graph on `stream` (or issues the
    /// launches eagerly when the bucket has no graph). Returns whether a graph ran.
    fn replay_engine(
        &mut self,
        bi: usize,
        a: &StepArgs,
        stream: sys::CUstream,
        t0: Instant,
        info: &mut StepInfo,
    ) -> Result<bool, GpuError> {
        let e = self.engine()?;
        let mut blob = e.admit_blob(&self.plan, bi, a);
        match self.graphs[bi].as_ref() {
            Some(g) => {
                let node = g.admit.ok_or(GpuError::Mode("an engine-memory step"))?;
                let f = &e.facts;
                let b = specplan_format::bucket_facts(&self.plan.buckets()[bi]);
                let (grid, _) = AdmitParams::launch(&b, f);
                let shape = (grid, AdmitParams::threads(f), admit_smem_bytes(b.batch, f.n));
                super::engine_decode::set_node(&g.graph, node, self.funcs[e.admit as usize], shape, &mut blob)?;
                info.prep_us += t0.elapsed().as_secs_f64() * 1e6;
                // SAFETY: a live exec on the caller's stream, in this runtime's context.
                cuda_rc("cuGraphLaunch", unsafe {
                    sys::cuGraphLaunch(g.graph.cu_graph_exec(), stream)
                })?;
                if let Mode::Engine(e) = &mut self.mode {
                    e.armed[bi] = true;
                }
                Ok(true)
            }
            None => {
                if let Replay::Eager(reason) = &self.plan.buckets()[bi].replay {
                    let msg = format!("bucket {} runs eagerly: {reason:?}", self.plan.buckets()[bi].batch);
                    self.log_once(msg);
                }
                self.gemms.set_stream(stream)?;
                info.prep_us += t0.elapsed().as_secs_f64() * 1e6;
                let issued = self.issue_bucket(bi, stream, Some(&mut blob), false);
                self.gemms.set_stream(self.stream.cu_stream())?;
                issued.map(|_| false)
            }
        }
    }

    /// Device addresses of the runtime's output buffers for a step of `b` requests (valid
    /// until the next step): `(topk_probs, topk_ids, hidden_out)`; 0 for an output the
    /// plan does not emit.
    pub fn output_ptrs(&self, b: usize) -> Result<(u64, u64, u64), GpuError> {
        let or0 = |name: &str| match self.bucket_output_ptr(name, b) {
            Err(GpuError::NoBuffer { .. }) => Ok(0),
            r => r,
        };
        Ok((
            or0(io::TOPK_PROBS)?,
            or0(io::TOPK_IDS)?,
            self.bucket_output_ptr(io::HIDDEN_OUT, b)?,
        ))
    }
}

/// Device addresses of every plan weight: in place, or packed into one runtime allocation
/// (concatenated or gathered rows, device-to-device copies at load).
fn place_weights(plan: &Plan, bindings: &[WeightBinding]) -> Result<(Vec<u64>, Vec<DevMem>), GpuError> {
    // The caller may have written its weights on a non-blocking stream, which the legacy
    // stream's copies below do not wait for: every stream of the context first.
    cuda("cuCtxSynchronize", result::ctx::synchronize())?;
    let packed: u64 = plan
        .weights
        .iter()
        .zip(bindings)
        .filter(|(_, b)| !matches!(b, WeightBinding::InPlace(_)))
        .map(|(w, _)| w.bytes.div_ceil(256) * 256)
        .sum();
    let region = DevMem::new(packed as usize)?;
    let mut at = region.ptr;
    let mut ptrs = Vec::with_capacity(bindings.len());
    for (w, b) in plan.weights.iter().zip(bindings) {
        let copy = |dst: u64, src: u64, bytes: u64| {
            // SAFETY: `dst` lies in `region` (sized for every packed weight), `src` in a
            // caller tensor whose shape was checked; synchronous device copy at load.
            cuda("cuMemcpyDtoD", unsafe {
                result::memcpy_dtod_sync(dst, src, bytes as usize)
            })
        };
        match b {
            WeightBinding::InPlace(p) => ptrs.push(*p),
            WeightBinding::Concat(parts) => {
                let mut off = at;
                for &(src, bytes) in parts {
                    copy(off, src, bytes)?;
                    off += bytes;
                }
                ptrs.push(at);
                at += w.bytes.div_ceil(256) * 256;
            }
            WeightBinding::Gather { table, row_bytes, ids } => {
                for (r, &id) in ids.iter().enumerate() {
                    copy(at + r as u64 * row_bytes, table + id as u64 * row_bytes, *row_bytes)?;
                }
                ptrs.push(at);
                at += w.bytes.div_ceil(256) * 256;
            }
        }
    }
    Ok((ptrs, vec![region]))
}

/// A draft-extend step's tensors with their bytes per request (the caller's `[b, ...]`
/// shapes), for `Regions::check_step`: the GPU step's and the CPU engine bindings' one list.
pub fn step_tensors(plan: &Plan, s: &DeviceStep) -> [StepTensor<'static>; 9] {
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as u64;
    let (h, k) = (plan.model.hidden as u64, plan.spec.topk as u64);
    let (hin, act) = (plan.model.hidden_in() as u64, plan.capture.dtype.size());
    let cols = specplan_format::signature::logits_cols(plan) as u64;
    let ints = |d: DeviceInts| if d.i32 { 4 } else { 8 };
    let t = |name, ptr, row, written| StepTensor {
        name,
        ptr,
        row,
        written,
    };
    [
        t(io::INPUT_IDS, s.input_ids, n * if s.ids_i32 { 4 } else { 8 }, false),
        t(io::HIDDEN_STATES, s.hidden_states, n * hin * act, false),
        t(
            "req_pool_indices",
            s.req_pool_indices.ptr,
            ints(s.req_pool_indices),
            false,
        ),
        t(io::PREFIX_LENS, s.prefix_lens.ptr, ints(s.prefix_lens), false),
        t(io::ACCEPT_LENS, s.accept_lens.ptr, ints(s.accept_lens), false),
        t("outputs.topk_p", s.outputs.topk_p, k * 4, true),
        t("outputs.topk_index", s.outputs.topk_index, k * 8, true),
        t("outputs.hidden_states", s.outputs.hidden_states, h * act, true),
        t("outputs.logits", s.outputs.logits, cols * 4, true),
    ]
}
