//! The GPU runtime: loads a validated plan, builds one CUDA graph per bucket and replays it
//! with host-only prep, in one of two memory modes (`memory.rs`):
//! - owned memory (`GpuRuntime::new`, `owned.rs`): the runtime allocates the weights, the
//!   K/V pool and its page table; a step's inputs come from the host (`step`);
//! - engine memory (`GpuRuntime::with_engine_memory`, `engine.rs`): the caller's K/V pool,
//!   page table and weights, registered once and used in place; a step's inputs are the
//!   caller's device tensors and it runs on the caller's stream (`step_device`).
//!
//! Modules: `device` (RAII and errors), `memory` (registrations, argument resolution),
//! `launch` (kernel loading, argument packing, issuing, the one capture function), `gemm` +
//! `lt` + `gemm_cache` (GEMMs: cuBLASLt algorithms from a cache or measured), `staging` +
//! `stage_node` (an owned step's inputs), `owned`, `engine`, `probes` (hooks for tests and
//! benchmarks). Admission checks of host inputs live in `crate::admission`, shared with the
//! CPU path.
//!
//! Replay path invariants (both modes): no device-to-host copy, no synchronization, no
//! device allocation (host allocations are a parameter block's few hundred bytes); host
//! work is O(b·N + b) (owned: plus copying the caller's host hidden states, which are the
//! input itself, and a wait for the staging block until the previous graph's first node
//! has run; engine: O(1) per bucket replayed — one parameter update, one launch and one
//! event record), never growing with the KV.

mod device;
mod engine;
mod engine_decode;
mod gemm;
mod gemm_cache;
mod graph;
mod launch;
mod lt;
mod memory;
mod nccl;
mod owned;
mod prefetch;
mod probes;
mod refusals;
mod skinny;
mod stage_node;
pub use graph::Exec;
pub use probes::GraphNodes;
pub use timeline::{OpSpan, Timeline};
mod staging;
mod timeline;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use specplan_format::{bucket_facts, kernel_facts_of, LaunchKind, Plan, Replay, ValidatedPlan};
use specplan_kernels::kv;

use device::{cuda, DevMem, Module};
pub use device::{driver_report, GpuError};
pub use engine::{step_tensors, AcceptForm, DeviceInts, DeviceOutputs, DeviceStep};
pub use engine_decode::{decode_tensors, DecodeOutputs, DeviceDecode};
use gemm::Gemms;
pub use gemm::{GemmLoad, GemmPolicy};
use launch::{gemm_call, load_kernels, Launcher};
pub use lt::{GemmChoice, GemmFlip};
use memory::Memory;
pub use memory::{DeviceTensor, EngineMemory, KvGeometry, KvRegistration, TableRegistration};
pub use nccl::{selftest as nccl_selftest, Communicator, Selftest as NcclSelftest};
pub use owned::{Hidden, HostOutputs, StepInfo, StepRequest};
pub use prefetch::{forks as l2_forks, windows as l2_windows, L2Prefetch, Window as L2Window, L2_PREFETCH_MAX_MIB};
pub use refusals::{DeviceError, StepPoll};
pub use specplan_kernels::kv::{DeviceRule, TableMode};

pub struct GpuOptions {
    /// Owned memory: pool pages, the scratch page (the last) included; default the plan's.
    pub kv_pool_pages: Option<u32>,
    /// Build the CUDA graphs at load (else only eager launches work).
    pub build_graphs: bool,
    /// How each GEMM's algorithm is chosen at load.
    pub gemms: GemmPolicy,
    /// CUDA device ordinal (its primary context, the one PyTorch uses).
    pub device: usize,
    /// A sharded plan's communicator over the ranks (`capture.tp`): its rank and size are
    /// the plan's; required exactly when the plan is sharded. One runtime per communicator:
    /// NCCL takes one call at a time on a communicator, and the runtime's steps serialize
    /// only their own.
    pub communicator: Option<Arc<Communicator>>,
    /// L2 prefetch branches in the captured graphs (`prefetch.rs`); off by default.
    pub l2_prefetch: L2Prefetch,
    /// Keep the GEMM workspace either choice of each shape needs (the skinny kernel or its
    /// cuBLASLt algorithm), so [`GpuRuntime::flip_gemm`] can switch later. Benchmarks only:
    /// off, the workspace is what the kept choices need.
    pub gemm_switchable: bool,
    /// Write each GEMM's rounded copy (`GemmDesc.rounded`) in its own `gemm_round` launch
    /// even where the skinny GEMM, which otherwise writes it in its epilogue, runs the
    /// shape: the plan's launches as they were before the `round_into_gemm` fusion, for
    /// its A/B on one plan (`specbench --split-gemm-round`). Benchmarks only: off.
    pub split_gemm_round: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            kv_pool_pages: None,
            build_graphs: true,
            gemms: GemmPolicy::Cached,
            device: 0,
            communicator: None,
            l2_prefetch: L2Prefetch::OFF,
            gemm_switchable: false,
            split_gemm_round: false,
        }
    }
}

/// Where a load's time went, ms.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadTimes {
    /// Context, modules, allocations, weights (upload or binding).
    pub setup_ms: f64,
    pub gemm: GemmLoad,
    pub graphs_ms: f64,
    pub total_ms: f64,
}

/// One bucket's captured graph; in engine memory, with the node of its `admit` (or
/// `admit_decode`) launch, whose parameters each step sets before the replay, and for a
/// draft-decode bucket its `emit_decode` node (the caller's output pointers).
struct Graph {
    graph: graph::Exec,
    admit: Option<sys::CUgraphNode>,
    emit: Option<sys::CUgraphNode>,
    /// Owned memory's draft-extend buckets: the `stage_in` node that copies the step's
    /// inputs in (`stage_node.rs`).
    stage: Option<stage_node::StageNode>,
}

enum Mode {
    Owned(owned::OwnedState),
    Engine(engine::EngineState),
}

pub struct GpuRuntime {
    plan: ValidatedPlan,
    /// A sharded plan's communicator (dropped after the graphs that use it: fields drop in
    /// declaration order and `Drop` clears the graphs first).
    comm: Option<Arc<Communicator>>,
    ctx: Arc<CudaContext>,
    /// The runtime's own stream: owned-memory steps, loading, capture.
    stream: Arc<CudaStream>,
    _modules: Vec<Module>,
    funcs: Vec<sys::CUfunction>,
    mem: Memory,
    gemms: Gemms,
    graphs: Vec<Option<Graph>>,
    /// Graph build time per bucket, ms (capture + instantiate + upload).
    pub graph_build_ms: Vec<f64>,
    /// Time spent choosing GEMM algorithms at load, ms (`load.gemm.ms`).
    pub gemm_tune_ms: f64,
    pub load: LoadTimes,
    mode: Mode,
    logged: HashSet<String>,
    /// The captured graphs' L2 branches (`GpuOptions::l2_prefetch`).
    l2_prefetch: L2Prefetch,
}

impl Drop for GpuRuntime {
    /// Waits for the device to finish what was issued (a step still in flight reads the
    /// arena and the modules' code), then destroys the graphs before the modules and
    /// allocations they name (fields drop in declaration order, graphs after both).
    fn drop(&mut self) {
        // Errors at teardown have no one to report to: the context may already be going.
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        self.graphs.clear();
    }
}

/// What every load does before memory is set up: context, architecture, stream, kernels.
struct Core {
    comm: Option<Arc<Communicator>>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Vec<Module>,
    funcs: Vec<sys::CUfunction>,
    gemms: Gemms,
}

impl GpuRuntime {
    /// Whether a CUDA driver and at least one device are present.
    pub fn available() -> bool {
        // SAFETY: only probes dlopen candidates.
        if !unsafe { sys::is_culib_present() } {
            return false;
        }
        CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    }

    fn core(plan: &Plan, opts: &GpuOptions) -> Result<Core, GpuError> {
        // Checked before any device work: a sharded plan's collectives need the ranks'
        // communicator, of the plan's rank and size; an unsharded plan takes none.
        let tp = plan.capture.tp;
        let comm = match (&opts.communicator, tp.is_sharded()) {
            (Some(c), true) => {
                c.check(tp)?;
                Some(c.clone())
            }
            (None, true) => {
                return Err(GpuError::NoCommunicator {
                    size: tp.size,
                    rank: tp.rank,
                })
            }
            (Some(c), false) => {
                return Err(GpuError::CommunicatorMismatch {
                    comm: format!("rank {} of {}", c.rank(), c.size()),
                    plan: "unsharded (tp size 1)".into(),
                })
            }
            (None, false) => None,
        };
        if !Self::available() {
            return Err(GpuError::NoDriver);
        }
        let ctx = cuda("cuCtx", CudaContext::new(opts.device))?;
        let (maj, min) = cuda("cuDeviceGetAttribute", ctx.compute_capability())?;
        let sm = (maj * 10 + min) as u32;
        if sm != plan.target.sm {
            let name = ctx.name().unwrap_or_default();
            return Err(GpuError::Arch {
                plan: plan.target.sm,
                device: sm,
                name,
            });
        }
        // SAFETY: we never use cudarc's own slices across streams; event tracking would
        // insert waits that break stream capture.
        unsafe { ctx.disable_event_tracking() };
        let stream = cuda("cuStreamCreate", ctx.new_stream())?;
        let (modules, funcs) = load_kernels(plan)?;
        // The plan's skinny GEMM and gemm_round (validation: every plan carries exactly one
        // of each).
        let skinny = skinny::Skinny {
            func: funcs[engine::kernel_of(plan, specplan_kernels::Entry::SkinnyGemm)? as usize],
            round: funcs[engine::kernel_of(plan, specplan_kernels::Entry::GemmRound)? as usize],
            act: plan.capture.dtype,
            split_round: opts.split_gemm_round,
        };
        let gemms = Gemms::new(stream.cu_stream(), skinny)?;
        Ok(Core {
            comm,
            ctx,
            stream,
            modules,
            funcs,
            gemms,
        })
    }

    /// The runtime around set-up memory: layout and status words written, GEMM algorithms
    /// chosen, graphs captured.
    fn finish(
        plan: ValidatedPlan,
        core: Core,
        mem: Memory,
        mode: Mode,
        opts: &GpuOptions,
        t0: Instant,
    ) -> Result<GpuRuntime, GpuError> {
        // One graph slot per bucket of every phase (flat indices, `Plan::flat_bucket`).
        let nb = plan.bucket_count();
        let mut rt = GpuRuntime {
            plan,
            comm: core.comm,
            ctx: core.ctx,
            stream: core.stream,
            _modules: core.modules,
            funcs: core.funcs,
            mem,
            gemms: core.gemms,
            graphs: (0..nb).map(|_| None).collect(),
            graph_build_ms: vec![0.0; nb],
            gemm_tune_ms: 0.0,
            load: LoadTimes::default(),
            mode,
            logged: HashSet::new(),
            l2_prefetch: opts.l2_prefetch,
        };
        // The counters (u32, two a word) are zero, as every launch that counts leaves them.
        let mut words = vec![0i64; META_WORDS];
        words[..kv::KV_WORDS].copy_from_slice(&memory::layout_words(&rt.mem.kv, &rt.mem.table));
        words[kv::KV_WORDS + kv::STATUS_ERR_FIRST] = -1; // u64::MAX: no error yet
        words[kv::KV_WORDS + kv::STATUS_MIRROR] = rt.mem.mirror.dev as i64;
        // Tag 0 names no step: every slot starts empty.
        for w in 0..kv::MIRROR_WORDS * kv::MIRROR_SLOTS {
            rt.mem.mirror.write(w, 0);
        }
        // SAFETY: `meta` holds META_WORDS i64 words: the layout, status and counter words.
        cuda("cuMemcpyHtoD", unsafe {
            result::memcpy_htod_sync(rt.mem.meta.ptr, &words[..])
        })?;
        // A copy from pageable memory may return before its DMA lands, and the runtime's
        // stream does not wait on the legacy stream: the first launch must see these words
        // (the counters above all: a nonzero one would merge a row early).
        cuda("cuCtxSynchronize", rt.ctx.synchronize())?;
        rt.load.setup_ms = t0.elapsed().as_secs_f64() * 1e3;
        rt.choose_gemms(opts.gemms, opts.gemm_switchable)?;
        if opts.build_graphs {
            let t = Instant::now();
            rt.build_graphs()?;
            rt.load.graphs_ms = t.elapsed().as_secs_f64() * 1e3;
        }
        cuda("cuStreamSynchronize", rt.stream.synchronize())?;
        rt.load.total_ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok(rt)
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Bytes of the GEMM workspace the runtime holds (after load: what the chosen
    /// algorithms need).
    pub fn workspace_bytes(&self) -> usize {
        self.gemms.workspace_bytes()
    }

    pub fn arena_bytes(&self) -> usize {
        self.mem.arena.bytes
    }

    fn launcher(&self, stream: sys::CUstream) -> Launcher<'_> {
        Launcher {
            plan: &self.plan,
            mem: &self.mem,
            funcs: &self.funcs,
            gemms: &self.gemms,
            comm: self.comm.as_deref(),
            stream,
            branches: None,
        }
    }

    /// The launcher a bucket is issued with: for a graph capture (`capture`), with L2
    /// branches when the options ask for them and the plan carries `l2_prefetch` (format 21
    /// and later all do).
    fn bucket_launcher(&self, stream: sys::CUstream, capture: bool) -> Launcher<'_> {
        let func = self.entry_func(specplan_kernels::Entry::L2Prefetch);
        Launcher {
            branches: func
                .filter(|_| capture && self.l2_prefetch.is_on())
                .map(|func| prefetch::Branches {
                    func,
                    opts: self.l2_prefetch,
                }),
            ..self.launcher(stream)
        }
    }

    /// Chooses an algorithm for every GEMM shape of the plan (`GemmPolicy`). Runs at load,
    /// before any graph exists and before any step has put data in the arena (timed calls
    /// overwrite their outputs).
    fn choose_gemms(&mut self, policy: GemmPolicy, switchable: bool) -> Result<(), GpuError> {
        let t0 = Instant::now();
        if policy == GemmPolicy::Heuristic {
            return self.gemms.prepare_heuristic();
        }
        let mut shapes = Vec::new();
        for (_, b) in self.plan.all_buckets() {
            for l in &b.launches {
                if let LaunchKind::Gemm(g) = &l.kind {
                    shapes.push(gemm_call(&self.mem, &self.plan, b, g));
                }
            }
        }
        let mut cache = self.gemm_cache()?;
        let load = self.gemms.prepare(
            &shapes,
            &mut cache,
            policy == GemmPolicy::Retune,
            switchable,
            self.stream.cu_stream(),
        )?;
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        if let Err(e) = cache.save() {
            self.log_once(format!(
                "GEMM algorithm cache not written ({e}); the next load times them again"
            ));
        }
        self.load.gemm = GemmLoad {
            ms: t0.elapsed().as_secs_f64() * 1e3,
            ..load
        };
        self.gemm_tune_ms = self.load.gemm.ms;
        Ok(())
    }

    fn gemm_cache(&self) -> Result<gemm_cache::GemmCache, GpuError> {
        let name = self.ctx.name().unwrap_or_else(|_| "gpu".into());
        let (maj, min) = cuda("cuDeviceGetAttribute", self.ctx.compute_capability())?;
        let mut driver = 0i32;
        // SAFETY: out-pointer to a local.
        device::cuda_rc("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut driver) })?;
        // SAFETY: no preconditions.
        let lt_version = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        let skinny = &self.plan.kernels[engine::kernel_of(&self.plan, specplan_kernels::Entry::SkinnyGemm)? as usize];
        Ok(gemm_cache::GemmCache::open(
            &format!("{name}-sm{maj}{min}"),
            driver,
            lt_version,
            &skinny.source_hash,
        ))
    }

    /// What the GEMM choice picked, per (m, n, k) of each bucket's GEMMs (benchmark reports).
    pub fn gemm_choices(&self) -> Vec<(u64, u64, u64, GemmChoice)> {
        let mut v: Vec<(u64, u64, u64, GemmChoice)> = Vec::new();
        for (_, b) in self.plan.all_buckets() {
            for l in &b.launches {
                if let LaunchKind::Gemm(g) = &l.kind {
                    if let Some(c) = self.gemms.choice(&gemm_call(&self.mem, &self.plan, b, g).0) {
                        if !v.iter().any(|x| (x.0, x.1, x.2) == (g.m, g.n, g.k)) {
                            v.push((g.m, g.n, g.k, c));
                        }
                    }
                }
            }
        }
        v
    }

    /// Captures every replayable bucket of every phase into a graph, largest first (in
    /// engine memory with the prologue and epilogue around the plan's launches: `admit` and
    /// `emit` for draft-extend's buckets, `admit_decode` and `emit_decode` for draft
    /// decode's).
    fn build_graphs(&mut self) -> Result<(), GpuError> {
        let extend_buckets = self.plan.buckets().len();
        for bi in (0..self.plan.bucket_count()).rev() {
            let replayable = self.plan.flat_bucket(bi).is_some_and(|b| b.replay == Replay::Graph);
            let served = match &self.mode {
                Mode::Engine(e) => bi < extend_buckets || e.decode.serves(&self.plan, bi),
                Mode::Owned(_) => true,
            };
            if !replayable || !served {
                continue;
            }
            let t0 = Instant::now();
            let stream = self.stream.cu_stream();
            let graph = graph::capture(&self.stream, self.fill_func(), || {
                self.issue_bucket(bi, stream, None, true)
            })?;
            let (admit, emit, stage) = match &self.mode {
                Mode::Engine(e) if bi < extend_buckets => (
                    Some(engine::find_node(&graph, self.funcs[e.admit as usize])?),
                    None,
                    None,
                ),
                Mode::Engine(e) => (
                    Some(engine::find_node(&graph, self.funcs[e.decode.admit as usize])?),
                    Some(engine_decode::kernel_node(
                        &graph,
                        self.funcs[e.decode.emit as usize],
                        specplan_kernels::Entry::EmitDecode,
                    )?),
                    None,
                ),
                Mode::Owned(_) if self.can_stage(bi) => (None, None, Some(self.stage_node(bi, &graph)?)),
                Mode::Owned(_) => (None, None, None),
            };
            self.graph_build_ms[bi] = t0.elapsed().as_secs_f64() * 1e3;
            self.graphs[bi] = Some(Graph {
                graph,
                admit,
                emit,
                stage,
            });
        }
        Ok(())
    }

    /// Issues bucket `bi` on `stream`: the plan's launches, and in engine memory the `admit`
    /// and `emit` launches around them (`admit` with the step's packed parameters, or the
    /// capture-time placeholders). `capture`: for a graph (with its L2 branches, if on).
    fn issue_bucket(
        &self,
        bi: usize,
        stream: sys::CUstream,
        admit: Option<&mut [u8]>,
        capture: bool,
    ) -> Result<(), GpuError> {
        let l = self.bucket_launcher(stream, capture);
        match &self.mode {
            Mode::Owned(_) => {
                if self.can_stage(bi) {
                    self.issue_stage_in(bi, stream)?;
                }
                l.issue(bi, &|_| true)
            }
            Mode::Engine(_) if bi >= self.plan.buckets().len() => self.issue_decode(bi, stream, None, capture),
            Mode::Engine(e) => {
                let b = bucket_facts(&self.plan.buckets()[bi]);
                let f = kernel_facts_of(&self.plan);
                let mut placeholder;
                let blob = match admit {
                    Some(blob) => blob,
                    None => {
                        placeholder = e.admit_blob(&self.plan, bi, &engine::StepArgs::placeholder(b.batch));
                        &mut placeholder[..]
                    }
                };
                e.issue_admit(&self.funcs, &b, &f, blob, stream)?;
                l.issue(bi, &|_| true)?;
                e.issue_emit(&self.plan, &self.mem, &self.funcs, bi, &b, &f, stream)?;
                e.record_done(stream)
            }
        }
    }

    fn log_once(&mut self, msg: String) {
        if self.logged.insert(msg.clone()) {
            eprintln!("specplan: {msg}");
        }
    }

    /// The plan's `fill` kernel (memset nodes of captured graphs become its launches), if
    /// the plan carries one.
    fn fill_func(&self) -> Option<sys::CUfunction> {
        self.entry_func(specplan_kernels::Entry::Fill)
    }

    /// The loaded function of the plan's (one) kernel of a runtime-launched `entry`.
    fn entry_func(&self, entry: specplan_kernels::Entry) -> Option<sys::CUfunction> {
        let i = self.plan.kernels.iter().position(|k| k.entry == entry)?;
        self.funcs.get(i).copied()
    }

    /// Index of the smallest bucket that holds `b` requests.
    fn bucket_for(&self, b: usize) -> Option<usize> {
        self.plan.buckets().iter().position(|x| x.batch as usize >= b)
    }

    fn bucket_list(&self) -> String {
        let v: Vec<String> = self.plan.buckets().iter().map(|b| b.batch.to_string()).collect();
        v.join(",")
    }

    fn no_bucket(&self, b: usize) -> GpuError {
        GpuError::NoBucket {
            batch: b as u32,
            buckets: self.bucket_list(),
        }
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// i64 words of the runtime's `meta` block: the layout words, the status words, and the
/// arrival counters (`kv::COUNTER_WORDS` u32s).
const META_WORDS: usize = kv::KV_WORDS + kv::STATUS_WORDS + kv::COUNTER_WORDS.div_ceil(2);

/// Allocates the layout, status and counter block (written in full at load).
fn meta_block() -> Result<DevMem, GpuError> {
    DevMem::new(META_WORDS * 8)
}
