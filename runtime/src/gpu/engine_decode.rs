//! Engine memory, draft decode: a draft-decode tier's step on the caller's device tensors,
//! on the caller's stream. Each decode bucket's graph is `admit_decode` (the caller's
//! draft-extend outputs copied into the bucket's input buffers, every request's lanes
//! checked on the device: the CPU engine's `admit_decode` rules, `kv::DeviceRule`), the
//! phase's launches, then `emit_decode` (the trees copied to the caller's tensors, zeros for
//! a refused request). Per step the host sets the two captured nodes' parameters and
//! launches the graph: O(1) host work, no copy through the host, no synchronization.
//! Refusals land in the same status words as draft-extend's, tagged with the step's epoch,
//! so `last_error` and `poll_error` report either phase.

use std::ffi::c_void;
use std::time::Instant;

use cudarc::driver::sys;
use specplan_format::{bucket_facts, io, PhaseKind, Plan, Replay};
use specplan_kernels::abi::{Kernel, KernelParams};
use specplan_kernels::entries::io::ADMIT_MAX_ROWS;
use specplan_kernels::entries::io_decode::{
    admit_decode_smem_bytes, lane_writes, AdmitDecodeParams, AdmitDecodePtrs, EmitDecodeParams, EmitDecodePtrs,
};
use specplan_kernels::facts::parent_width;
use specplan_kernels::{kv, Entry};

use super::device::{cuda_rc, GpuError};
use super::engine::{kernel_of, DeviceInts};
use super::graph::Exec;
use super::launch::{launch_packed, pack_slots};
use super::memory::Memory;
use super::{GpuRuntime, StepInfo};
use crate::registration::StepTensor;

/// Where `emit_decode` copies a step's tree (0: not copied), each `[b, ·]` i64 unless noted:
/// `parent_list [b, (S−1)·K + 1]`, `top_scores_index` and `draft_tokens [b, N−1]`; with the
/// verify inputs (`capture.decode_verify`) `verify_tokens`, `verify_positions`,
/// `retrieve_index`, `retrieve_next_token`, `retrieve_next_sibling` `[b, N]` in that order
/// and `tree_mask [b, N, N]` i32 (an output the plan does not emit must be 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOutputs {
    pub parent_list: u64,
    pub top_scores_index: u64,
    pub draft_tokens: u64,
    pub verify: [u64; 5],
    pub tree_mask: u64,
}

/// One engine-memory draft-decode step: `b` requests whose inputs are the caller's device
/// tensors (draft-extend's outputs, as SGLang's `EagleDraftInput` holds them).
#[derive(Clone, Copy, Debug)]
pub struct DeviceDecode {
    pub b: usize,
    /// `[b, K]` f32 top-K probabilities (1 for topk = 1).
    pub topk_p: u64,
    /// `[b, K]` their ids in the target vocabulary, i64 (i32 with `ids_i32`).
    pub topk_index: u64,
    pub ids_i32: bool,
    /// `[b, H]` draft-extend's hidden rows, the plan's activation type.
    pub hidden_states: u64,
    /// `[b]` rows of the registered page table.
    pub req_pool_indices: DeviceInts,
    /// `[b]` committed tokens per request (plus `prefix_bias`).
    pub prefix_lens: DeviceInts,
    pub prefix_bias: i32,
    /// `[b]` the trees' roots: required by a plan with the verify inputs, refused otherwise.
    pub bonus_tokens: Option<DeviceInts>,
    pub outputs: DecodeOutputs,
    /// The caller's stream (`CUstream`).
    pub stream: u64,
}

/// The bucket's pointers of a decode bucket that never change (resolved once at load).
struct Fixed {
    kind: PhaseKind,
    admit: AdmitDecodePtrs<u64>,
    emit: EmitDecodePtrs<u64>,
}

/// Draft decode's engine-memory state: the entries' kernel indices and, per flat bucket,
/// the fixed pointers of the decode buckets (`None` for draft-extend's).
pub(crate) struct DecodeIo {
    pub admit: u32,
    pub emit: u32,
    fixed: Vec<Option<Fixed>>,
}

/// The per-step values of one chunk.
struct ChunkArgs {
    src: [u64; 6],
    out: DecodeOutputs,
    b: u32,
    flags: u32,
    prefix_bias: i32,
    base: u32,
    epoch: u32,
}

impl ChunkArgs {
    fn placeholder(batch: u32) -> ChunkArgs {
        ChunkArgs {
            src: [0; 6],
            out: DecodeOutputs::default(),
            b: batch,
            flags: 0,
            prefix_bias: 0,
            base: 0,
            epoch: 0,
        }
    }
}

/// Why a decode bucket cannot run on engine memory: its write set is above what
/// `admit_decode` indexes (16-bit writers).
fn too_wide(plan: &Plan, kind: PhaseKind, batch: u32) -> Option<String> {
    let rows = batch as u64 * lane_writes(plan.spec.topk, kind.steps()) as u64;
    (rows > ADMIT_MAX_ROWS as u64).then(|| {
        format!(
            "{} bucket {batch}: batch × topk × (S − 1) = {rows} lane writes exceed the {ADMIT_MAX_ROWS} engine memory checks on the device",
            kind.label()
        )
    })
}

impl DecodeIo {
    pub fn new(plan: &Plan, mem: &Memory) -> Result<DecodeIo, GpuError> {
        let fixed = (0..plan.bucket_count())
            .map(|bi| {
                let (kind, b) = plan.flat_phase(bi)?;
                if kind == PhaseKind::DraftExtend {
                    return None;
                }
                let buf = |name: &str| b.buffer(name).map_or(0, |(_, x)| mem.arena.ptr + x.offset);
                Some(Fixed {
                    kind,
                    admit: AdmitDecodePtrs {
                        src_probs: 0,
                        src_ids: 0,
                        src_hidden: 0,
                        src_req: 0,
                        src_prefix: 0,
                        src_bonus: 0,
                        probs: buf(io::TOPK_PROBS),
                        ids: buf(io::TOPK_IDS),
                        hidden: buf(io::HIDDEN_STATES),
                        req_slots: buf(io::REQ_SLOTS),
                        prefix_lens: buf(io::PREFIX_LENS),
                        bonus: buf(io::BONUS_TOKENS),
                        page_table: mem.table.ptr,
                        kv_layout: mem.layout_ptr(),
                        status: mem.status_ptr(),
                    },
                    emit: EmitDecodePtrs {
                        req_slots: buf(io::REQ_SLOTS),
                        parent_list: buf(io::PARENT_LIST),
                        top_scores_index: buf(io::TOP_SCORES_INDEX),
                        draft_tokens: buf(io::DRAFT_TOKENS),
                        verify_tokens: buf(io::VERIFY_TOKENS),
                        verify_positions: buf(io::VERIFY_POSITIONS),
                        retrieve_index: buf(io::RETRIEVE_INDEX),
                        retrieve_next_token: buf(io::RETRIEVE_NEXT_TOKEN),
                        retrieve_next_sibling: buf(io::RETRIEVE_NEXT_SIBLING),
                        tree_mask: buf(io::TREE_MASK),
                        out_parent_list: 0,
                        out_top_scores_index: 0,
                        out_draft_tokens: 0,
                        out_verify_tokens: 0,
                        out_verify_positions: 0,
                        out_retrieve_index: 0,
                        out_retrieve_next_token: 0,
                        out_retrieve_next_sibling: 0,
                        out_tree_mask: 0,
                        status: mem.status_ptr(),
                    },
                })
            })
            .collect();
        Ok(DecodeIo {
            admit: kernel_of(plan, Entry::AdmitDecode)?,
            emit: kernel_of(plan, Entry::EmitDecode)?,
            fixed,
        })
    }

    /// Whether flat bucket `bi` is a decode bucket that engine memory serves.
    pub fn serves(&self, plan: &Plan, bi: usize) -> bool {
        match (self.fixed.get(bi).and_then(|f| f.as_ref()), plan.flat_bucket(bi)) {
            (Some(f), Some(b)) => too_wide(plan, f.kind, b.batch).is_none(),
            _ => false,
        }
    }

    /// Largest dynamic shared memory of `admit_decode` over the decode buckets.
    pub fn max_smem(&self, plan: &Plan) -> u32 {
        (0..self.fixed.len())
            .filter(|&bi| self.serves(plan, bi))
            .filter_map(|bi| {
                let (kind, b) = plan.flat_phase(bi)?;
                Some(admit_decode_smem_bytes(b.batch, plan.spec.topk, kind.steps()))
            })
            .max()
            .unwrap_or(0)
    }

    /// The two entries' packed parameters for flat bucket `bi` with one chunk's values.
    fn blobs(&self, plan: &Plan, bi: usize, a: &ChunkArgs) -> Result<(Vec<u8>, Vec<u8>), GpuError> {
        let f = self
            .fixed
            .get(bi)
            .and_then(|f| f.as_ref())
            .ok_or(GpuError::Mode("a draft-decode bucket"))?;
        let b = plan.flat_bucket(bi).ok_or(GpuError::Mode("a draft-decode bucket"))?;
        let facts = specplan_format::kernel_facts_of(plan);
        let bf = bucket_facts(b);
        let steps = f.kind.steps();
        let (_, mut s) = AdmitDecodeParams::launch(&bf, &facts);
        (s.b, s.flags, s.prefix_bias, s.base, s.epoch, s.steps) =
            (a.b, a.flags, a.prefix_bias as u32, a.base, a.epoch, steps);
        let [src_probs, src_ids, src_hidden, src_req, src_prefix, src_bonus] = a.src;
        let admit = AdmitDecodePtrs {
            src_probs,
            src_ids,
            src_hidden,
            src_req,
            src_prefix,
            src_bonus,
            ..f.admit.clone()
        };
        let (_, mut e) = EmitDecodeParams::launch(&bf, &facts);
        e.pw = parent_width(plan.spec.topk, steps) as u32;
        e.nodes = f.kind.draft_tokens(&plan.spec).saturating_sub(1);
        let o = &a.out;
        let emit = EmitDecodePtrs {
            out_parent_list: o.parent_list,
            out_top_scores_index: o.top_scores_index,
            out_draft_tokens: o.draft_tokens,
            out_verify_tokens: o.verify[0],
            out_verify_positions: o.verify[1],
            out_retrieve_index: o.verify[2],
            out_retrieve_next_token: o.verify[3],
            out_retrieve_next_sibling: o.verify[4],
            out_tree_mask: o.tree_mask,
            ..f.emit.clone()
        };
        Ok((
            pack_slots(&Entry::AdmitDecode.abi(), &AdmitDecodeParams::assemble(admit, s)),
            pack_slots(&Entry::EmitDecode.abi(), &EmitDecodeParams::assemble(emit, e)),
        ))
    }

    /// Launch geometry of the two entries for flat bucket `bi`: (grid, block, shared memory)
    /// each.
    fn shapes(&self, plan: &Plan, bi: usize) -> Option<[([u32; 3], u32, u32); 2]> {
        let (kind, b) = plan.flat_phase(bi)?;
        let t = specplan_kernels::entries::io::IO_THREADS;
        Some([
            (
                [b.batch, 1, 1],
                t,
                admit_decode_smem_bytes(b.batch, plan.spec.topk, kind.steps()),
            ),
            ([b.batch, 1, 1], t, 0),
        ])
    }
}

/// Sets a captured kernel node's parameters in an instantiated graph.
pub(crate) fn set_node(
    exec: &Exec,
    node: sys::CUgraphNode,
    func: sys::CUfunction,
    (grid, block, smem): ([u32; 3], u32, u32),
    blob: &mut [u8],
) -> Result<(), GpuError> {
    let mut params = [blob.as_mut_ptr() as *mut c_void];
    // SAFETY: zeroed plain C struct; every field the call reads is set below.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    p.func = func;
    (p.gridDimX, p.gridDimY, p.gridDimZ) = (grid[0], grid[1], grid[2]);
    (p.blockDimX, p.blockDimY, p.blockDimZ) = (block, 1, 1);
    p.sharedMemBytes = smem;
    p.kernelParams = params.as_mut_ptr();
    // SAFETY: `node` is a kernel node of this exec's graph running `func`; the parameters
    // point at a struct laid out as the entry declares, read during the call (the driver
    // copies them). The update affects later launches of the exec only.
    cuda_rc("cuGraphExecKernelNodeSetParams", unsafe {
        sys::cuGraphExecKernelNodeSetParams_v2(exec.cu_graph_exec(), node, &p)
    })
}

/// The kernel node of `func`, entry `what`'s, in a captured graph (`emit_decode`,
/// `stage_in`: one per graph).
pub(crate) fn kernel_node(
    g: &Exec,
    func: sys::CUfunction,
    what: specplan_kernels::Entry,
) -> Result<sys::CUgraphNode, GpuError> {
    for node in super::graph::nodes(g.cu_graph())? {
        if super::graph::node_type(node)? != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            continue;
        }
        // SAFETY: zeroed plain C struct, filled by the call.
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        // SAFETY: a kernel node; out-pointer to a local.
        cuda_rc("cuGraphKernelNodeGetParams", unsafe {
            sys::cuGraphKernelNodeGetParams_v2(node, &mut p)
        })?;
        if p.func == func {
            return Ok(node);
        }
    }
    Err(GpuError::Cuda {
        call: "cuGraphKernelNodeGetParams",
        message: format!("the captured graph has no {what} node"),
    })
}

impl GpuRuntime {
    fn decode_io(&self) -> Result<&DecodeIo, GpuError> {
        Ok(&self.engine()?.decode)
    }

    /// Issues decode bucket `bi` on `stream` in engine memory: `admit_decode`, the phase's
    /// launches, `emit_decode`, the end-of-step event (the capture-time placeholders when
    /// `blobs` is `None`). `capture`: for a graph (with its L2 branches, if on).
    pub(super) fn issue_decode(
        &self,
        bi: usize,
        stream: sys::CUstream,
        blobs: Option<(&mut [u8], &mut [u8])>,
        capture: bool,
    ) -> Result<(), GpuError> {
        let e = self.engine()?;
        let d = &e.decode;
        let batch = self.plan.flat_bucket(bi).map_or(0, |b| b.batch);
        let mut placeholder;
        let (admit, emit) = match blobs {
            Some(b) => b,
            None => {
                placeholder = d.blobs(&self.plan, bi, &ChunkArgs::placeholder(batch))?;
                (&mut placeholder.0[..], &mut placeholder.1[..])
            }
        };
        let [a, m] = d
            .shapes(&self.plan, bi)
            .ok_or(GpuError::Mode("a draft-decode bucket"))?;
        launch_packed(self.funcs[d.admit as usize], a.0, [a.1, 1, 1], a.2, admit, stream)?;
        self.bucket_launcher(stream, capture).issue(bi, &|_| true)?;
        launch_packed(self.funcs[d.emit as usize], m.0, [m.1, 1, 1], m.2, emit, stream)?;
        e.record_done(stream)
    }

    /// One step of draft-decode tier `kind` on the caller's device tensors, on the caller's
    /// stream: returns once the work is enqueued (no synchronization, no copy through the
    /// host). The trees land in `s.outputs` (and the runtime's buffers, valid until the next
    /// step); the lanes' K/V in the registered pool. A request the device rules refuse
    /// writes nothing and its rows are zeros; `last_error` reports it. Batches above the
    /// tier's largest bucket run as consecutive replays of it.
    pub fn step_decode_device(&mut self, kind: PhaseKind, s: &DeviceDecode) -> Result<StepInfo, GpuError> {
        let t0 = Instant::now();
        let batches: Vec<u32> = self
            .plan
            .phase(kind)
            .ok_or_else(|| GpuError::Step(format!("the plan has no {} phase", kind.label())))?
            .buckets
            .iter()
            .map(|b| b.batch)
            .collect();
        let max_b = batches.last().map_or(0, |&x| x as usize).max(1);
        if s.b == 0 {
            return Err(GpuError::Step(
                "req_pool_indices: a step needs at least one request".into(),
            ));
        }
        for (name, p) in [
            (io::TOPK_PROBS, s.topk_p),
            (io::TOPK_IDS, s.topk_index),
            (io::HIDDEN_STATES, s.hidden_states),
            ("req_pool_indices", s.req_pool_indices.ptr),
            (io::PREFIX_LENS, s.prefix_lens.ptr),
        ] {
            if p == 0 {
                return Err(GpuError::Step(format!("{name} is a null pointer")));
            }
        }
        let verify = self.plan.capture.decode_verify;
        match (s.bonus_tokens, verify) {
            (Some(t), true) if t.ptr == 0 => {
                return Err(GpuError::Step(format!("{} is a null pointer", io::BONUS_TOKENS)))
            }
            (None, true) => {
                return Err(GpuError::Step(format!(
                    "{}: the plan emits the verify inputs (draft_decode_outputs tree,verify) and needs the tree roots",
                    io::BONUS_TOKENS
                )))
            }
            (Some(_), false) => {
                return Err(GpuError::Step(format!(
                    "{}: the plan emits no verify inputs (compile it with draft_decode_outputs tree,verify)",
                    io::BONUS_TOKENS
                )))
            }
            _ => {}
        }
        let names = [
            io::VERIFY_TOKENS,
            io::VERIFY_POSITIONS,
            io::RETRIEVE_INDEX,
            io::RETRIEVE_NEXT_TOKEN,
            io::RETRIEVE_NEXT_SIBLING,
            io::TREE_MASK,
        ];
        let o = s.outputs;
        for (name, p) in names.iter().zip(o.verify.iter().chain([&o.tree_mask])) {
            if *p != 0 && !verify {
                return Err(GpuError::Step(format!(
                    "outputs.{name}: the plan does not emit it (draft_decode_outputs tree); pass 0"
                )));
            }
        }
        let (k, h) = (self.plan.spec.topk as u64, self.plan.model.hidden as u64);
        let act = self.plan.capture.dtype.size();
        let steps = kind.steps();
        let (pw, nodes) = (
            parent_width(k as u32, steps),
            kind.draft_tokens(&self.plan.spec).saturating_sub(1) as u64,
        );
        let n = nodes + 1;
        let width = |d: DeviceInts| if d.i32 { 4 } else { 8 };
        let bonus = s.bonus_tokens.unwrap_or(DeviceInts { ptr: 0, i32: false });
        // The step's tensors against the registered memory and each other (before the step
        // takes its tag: a refused call leaves no trace).
        let tensors = decode_tensors(&self.plan, kind, s);
        self.engine()?
            .regions
            .check_step(&tensors, s.b as u64, max_b as u64)
            .map_err(GpuError::Step)?;
        let stream = s.stream as sys::CUstream;
        let epoch = self.begin_engine_step(stream)?;
        let flags = s.req_pool_indices.i32 as u32
            | (s.prefix_lens.i32 as u32) << 1
            | (bonus.i32 as u32) << 2
            | if s.ids_i32 { kv::ADMIT_FLAG_IDS_I32 } else { 0 };
        let last_start = (s.b - 1) / max_b * max_b;
        let mut info = StepInfo {
            bucket: 0,
            graph: true,
            prep_us: 0.0,
        };
        for start in (0..s.b).step_by(max_b) {
            let end = (start + max_b).min(s.b);
            let st = start as u64;
            let at = |p: u64, per: u64| if p == 0 { 0 } else { p + st * per };
            let args = ChunkArgs {
                src: [
                    at(s.topk_p, k * 4),
                    at(s.topk_index, k * if s.ids_i32 { 4 } else { 8 }),
                    at(s.hidden_states, h * act),
                    at(s.req_pool_indices.ptr, width(s.req_pool_indices)),
                    at(s.prefix_lens.ptr, width(s.prefix_lens)),
                    at(bonus.ptr, width(bonus)),
                ],
                out: DecodeOutputs {
                    parent_list: at(o.parent_list, pw * 8),
                    top_scores_index: at(o.top_scores_index, nodes * 8),
                    draft_tokens: at(o.draft_tokens, nodes * 8),
                    verify: o.verify.map(|p| at(p, n * 8)),
                    tree_mask: at(o.tree_mask, n * n * 4),
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
            let batch = *batches
                .iter()
                .find(|&&x| x as usize >= end - start)
                .ok_or_else(|| self.no_bucket(end - start))?;
            if let Some(why) = too_wide(&self.plan, kind, batch) {
                return Err(GpuError::Step(why));
            }
            let bi = self
                .plan
                .flat_index(kind, batch)
                .ok_or_else(|| self.no_bucket(end - start))?;
            let t = if start == 0 { t0 } else { Instant::now() };
            info.graph &= self.replay_decode(bi, &args, stream, t, &mut info)?;
            info.bucket = batch;
        }
        Ok(info)
    }

    /// Sets decode bucket `bi`'s two node parameters and launches its graph on `stream` (or
    /// issues it eagerly when the bucket has no graph). Returns whether a graph ran.
    fn replay_decode(
        &mut self,
        bi: usize,
        a: &ChunkArgs,
        stream: sys::CUstream,
        t0: Instant,
        info: &mut StepInfo,
    ) -> Result<bool, GpuError> {
        let d = self.decode_io()?;
        let (mut admit, mut emit) = d.blobs(&self.plan, bi, a)?;
        let [sa, se] = d
            .shapes(&self.plan, bi)
            .ok_or(GpuError::Mode("a draft-decode bucket"))?;
        let (fa, fe) = (self.funcs[d.admit as usize], self.funcs[d.emit as usize]);
        match self.graphs[bi].as_ref() {
            Some(g) => {
                let (na, ne) = match (g.admit, g.emit) {
                    (Some(na), Some(ne)) => (na, ne),
                    _ => return Err(GpuError::Mode("an engine-memory draft-decode step")),
                };
                set_node(&g.graph, na, fa, sa, &mut admit)?;
                set_node(&g.graph, ne, fe, se, &mut emit)?;
                info.prep_us += t0.elapsed().as_secs_f64() * 1e6;
                // SAFETY: a live exec on the caller's stream, in this runtime's context.
                cuda_rc("cuGraphLaunch", unsafe {
                    sys::cuGraphLaunch(g.graph.cu_graph_exec(), stream)
                })?;
                Ok(true)
            }
            None => {
                if let Some(Replay::Eager(reason)) = self.plan.flat_bucket(bi).map(|b| &b.replay) {
                    let msg = format!("draft-decode bucket {bi} runs eagerly: {reason:?}");
                    self.log_once(msg);
                }
                self.gemms.set_stream(stream)?;
                info.prep_us += t0.elapsed().as_secs_f64() * 1e6;
                let issued = self.issue_decode(bi, stream, Some((&mut admit, &mut emit)), false);
                self.gemms.set_stream(self.stream.cu_stream())?;
                issued.map(|_| false)
            }
        }
    }
}

/// A draft-decode step's tensors with their bytes per request (the caller's `[b, ...]`
/// shapes), for `Regions::check_step`: the GPU step's and the CPU engine bindings' one list.
pub fn decode_tensors(plan: &Plan, kind: PhaseKind, s: &DeviceDecode) -> [StepTensor<'static>; 15] {
    let (k, h) = (plan.spec.topk as u64, plan.model.hidden as u64);
    let act = plan.capture.dtype.size();
    let pw = parent_width(k as u32, kind.steps());
    let nodes = kind.draft_tokens(&plan.spec).saturating_sub(1) as u64;
    let n = nodes + 1;
    let width = |d: DeviceInts| if d.i32 { 4 } else { 8 };
    let bonus = s.bonus_tokens.unwrap_or(DeviceInts { ptr: 0, i32: false });
    let o = s.outputs;
    let t = |name, ptr, row, written| StepTensor {
        name,
        ptr,
        row,
        written,
    };
    let v = o.verify;
    [
        t(io::TOPK_PROBS, s.topk_p, k * 4, false),
        t(io::TOPK_IDS, s.topk_index, k * if s.ids_i32 { 4 } else { 8 }, false),
        t(io::HIDDEN_STATES, s.hidden_states, h * act, false),
        t(
            "req_pool_indices",
            s.req_pool_indices.ptr,
            width(s.req_pool_indices),
            false,
        ),
        t(io::PREFIX_LENS, s.prefix_lens.ptr, width(s.prefix_lens), false),
        t(io::BONUS_TOKENS, bonus.ptr, width(bonus), false),
        t("outputs.parent_list", o.parent_list, pw * 8, true),
        t("outputs.top_scores_index", o.top_scores_index, nodes * 8, true),
        t("outputs.draft_tokens", o.draft_tokens, nodes * 8, true),
        t("outputs.tree_mask", o.tree_mask, n * n * 4, true),
        t("outputs.verify_tokens", v[0], n * 8, true),
        t("outputs.verify_positions", v[1], n * 8, true),
        t("outputs.retrieve_index", v[2], n * 8, true),
        t("outputs.retrieve_next_token", v[3], n * 8, true),
        t("outputs.retrieve_next_sibling", v[4], n * 8, true),
    ]
}
