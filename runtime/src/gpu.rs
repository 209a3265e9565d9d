//! The GPU runtime: loads a validated plan, owns the device memory, builds one CUDA graph
//! per bucket and replays it with host-only prep.
//!
//! Device memory is four allocations — the activation arena (the plan's largest bucket),
//! the weight region, the KV pool `[layer][K|V][page][slot][kv_head][dim]` and the page
//! table `[max_requests + 1][pages_per_request]` — and every kernel parameter is one of
//! their base addresses plus a plan offset. Kernels take one parameter struct; it is
//! packed here from the launch's argument list in order, with C alignment (pointers 8
//! bytes, `u32` 4 bytes), which is the layout the `.cu` structs declare.
//!
//! Replay path invariants: no device-to-host copy, no synchronization, no allocation; host
//! work is O(b·N + b) (plus copying the caller's host hidden states, O(b·N·H), which is the
//! input itself); the page table is updated only by `set_pages` / `append_pages`.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::sys as cublas;
use cudarc::driver::sys;
use cudarc::driver::{result, CudaContext, CudaGraph, CudaStream};

use crate::cpu::WeightData;
use crate::format::{
    io, ArgValue, BucketPlan, DType, GemmDesc, KernelArg, KvKind, LaunchKind, Plan, Replay, ValidatedPlan,
};

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver (libcuda.so.1) on this machine")]
    NoDriver,
    #[error("CUDA call {call} failed: {message}")]
    Cuda { call: &'static str, message: String },
    #[error("cuBLAS call {call} failed with status {status}")]
    Cublas { call: &'static str, status: String },
    #[error("the plan's kernels were built for sm_{plan}, this GPU is sm_{device} ({name})")]
    Arch { plan: u32, device: u32, name: String },
    #[error("kernel {kernel} has no binary (the plan was compiled with --no-kernels)")]
    NoBinary { kernel: String },
    #[error("kernel {kernel}: neither the CUBIN nor the PTX loads: {message}")]
    Load { kernel: String, message: String },
    #[error("{0}")]
    Input(#[from] crate::step::InputError),
    #[error("weights: {0}")]
    Weights(String),
}

fn cuda<T>(call: &'static str, r: Result<T, result::DriverError>) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Cuda {
        call,
        message: format!("{e:?}"),
    })
}

fn cublas_ok(call: &'static str, s: cublas::cublasStatus_t) -> Result<(), GpuError> {
    if s == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cublas {
            call,
            status: format!("{s:?}"),
        })
    }
}

/// One raw device allocation, freed on drop.
struct DevMem {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DevMem {
    fn new(bytes: usize) -> Result<DevMem, GpuError> {
        // SAFETY: a plain allocation; the context is current (bound by the caller).
        let ptr = cuda("cuMemAlloc", unsafe { result::malloc_sync(bytes.max(256)) })?;
        Ok(DevMem { ptr, bytes })
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAlloc and is freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Page-locked host memory, freed on drop.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

impl Pinned {
    fn new(bytes: usize) -> Result<Pinned, GpuError> {
        // SAFETY: a plain page-locked allocation.
        let ptr = cuda("cuMemHostAlloc", unsafe { result::malloc_host(bytes.max(64), 0) })? as *mut u8;
        Ok(Pinned {
            ptr,
            bytes: bytes.max(64),
        })
    }
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `bytes` bytes we own exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

struct Module(sys::CUmodule);

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by cuModuleLoadData, unloaded once.
        let _ = unsafe { sys::cuModuleUnload(self.0) };
    }
}

struct BlasHandle(cublas::cublasHandle_t);

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate, destroyed once.
        let _ = unsafe { cublas::cublasDestroy_v2(self.0) };
    }
}

struct Event(sys::CUevent);

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// Where the caller's hidden states for a step are.
pub enum Hidden<'a> {
    /// `[b, N, H]` as raw bf16/f16 bits in host memory.
    Host(&'a [u16]),
    /// A device address of `[b, N, H]` activations (copied device to device).
    Device(sys::CUdeviceptr),
}

/// One step's request data (b real requests).
pub struct StepRequest<'a> {
    /// Page-table row of each request (assigned with `set_pages`).
    pub slots: &'a [i32],
    /// `[b, N]`.
    pub input_ids: &'a [i64],
    pub hidden: Hidden<'a>,
    /// `[b]`.
    pub prefix_lens: &'a [i32],
    /// `[b]`.
    pub accept_lens: &'a [i32],
}

/// What a step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepInfo {
    pub bucket: u32,
    pub graph: bool,
    /// Host time spent before the replay was issued (checks, staging, copies), µs.
    pub prep_us: f64,
}

/// Outputs of the last step, copied to the host (not on the replay path).
#[derive(Clone, Debug, PartialEq)]
pub struct HostOutputs {
    pub hidden_out: Vec<u16>,
    pub topk_probs: Vec<f32>,
    pub topk_ids: Vec<i64>,
}

pub struct GpuOptions {
    /// Pool pages, the scratch page (the last) included; default the plan's.
    pub kv_pool_pages: Option<u32>,
    /// Build the CUDA graphs at load (else only eager launches work).
    pub build_graphs: bool,
    /// Time cuBLASLt's candidate algorithms for every GEMM shape of the plan at load and
    /// keep the fastest (else cublasGemmEx with its default heuristic).
    pub tune_gemms: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            kv_pool_pages: None,
            build_graphs: true,
            tune_gemms: true,
        }
    }
}

/// Where a bucket's inputs sit in the arena, and the copies that move them. The pinned
/// staging block mirrors the arena's first bytes, so host prep writes each input at its
/// arena offset and adjacent inputs travel in one copy (the compiler places them
/// contiguously; gaps are merged only where no other buffer lives in them).
#[derive(Clone, Default)]
struct StageLayout {
    ids: usize,
    prefix: usize,
    accept: usize,
    slots: usize,
    hidden: usize,
    hidden_bytes: usize,
    /// Copy ranges (offset, bytes) for the integer inputs alone (hidden from the device).
    ints: Vec<(usize, usize)>,
    /// Copy ranges for every input (hidden from the host).
    all: Vec<(usize, usize)>,
}

pub struct GpuRuntime {
    plan: ValidatedPlan,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _modules: Vec<Module>,
    funcs: Vec<sys::CUfunction>,
    arena: DevMem,
    weights: DevMem,
    kv: DevMem,
    table: DevMem,
    blas: BlasHandle,
    /// cuBLASLt with a measured algorithm per GEMM shape (None: not tuned).
    lt: Option<crate::lt::Lt>,
    _blas_ws: DevMem,
    pool_pages: u32,
    /// Time spent choosing GEMM algorithms at load, ms.
    pub gemm_tune_ms: f64,
    graphs: Vec<Option<CudaGraph>>,
    /// Graph build time per bucket, ms (capture + instantiate + upload).
    pub graph_build_ms: Vec<f64>,
    staging: [Pinned; 2],
    staging_done: [Event; 2],
    stage_layouts: Vec<StageLayout>,
    next_stage: usize,
    /// Host mirror of how many pages each slot has (for O(b) bounds checks).
    slot_pages: Vec<u32>,
    logged: HashSet<String>,
    last_batch: usize,
    slot_seen: Vec<u32>,
    stamp: u32,
    /// Host mirror of the device page table (for the O(b·N) write-conflict check).
    table_host: Vec<i32>,
    /// The cache slots (page·page_size + offset) the current step writes, as a stamped
    /// open-addressing set sized for the largest bucket's rows. A per-slot table of the
    /// whole pool (2 MiB for llama3's) cost one host cache miss per row, 30–40 µs at
    /// B 64, N 16; this set stays in L1.
    write_seen: Vec<(u64, u32)>,
    /// Outputs of a batch run in chunks (above the largest bucket), and whether the last
    /// step was one.
    chunk_out: Option<DevMem>,
    chunked: bool,
}

fn dtype_cuda(d: DType) -> cublas::cudaDataType {
    match d {
        DType::Bf16 => cublas::cudaDataType::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType::CUDA_R_16F,
        _ => cublas::cudaDataType::CUDA_R_32F,
    }
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

    /// Loads a plan and its weights onto device 0 and builds every bucket's graph.
    pub fn new(plan: ValidatedPlan, weights: &[WeightData], opts: GpuOptions) -> Result<GpuRuntime, GpuError> {
        if !Self::available() {
            return Err(GpuError::NoDriver);
        }
        let ctx = cuda("cuCtx", CudaContext::new(0))?;
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
        let (modules, funcs) = load_kernels(&plan)?;

        let pool_pages = opts.kv_pool_pages.unwrap_or(plan.capture.kv_pool_pages).max(2);
        let kv_bytes = 2 * plan.model.layers as usize * pool_pages as usize * plan.kv_page_bytes() as usize;
        let arena = DevMem::new(plan.arena_bytes() as usize)?;
        let wmem = DevMem::new(plan.weight_bytes as usize)?;
        let kv = DevMem::new(kv_bytes)?;
        let table_bytes = plan.page_table_rows() as usize * plan.capture.max_pages_per_request as usize * 4;
        let table = DevMem::new(table_bytes)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        cublas_ok("cublasCreate", unsafe { cublas::cublasCreate_v2(&mut handle) })?;
        let blas = BlasHandle(handle);
        // A fixed workspace set before capture: cuBLAS then never allocates in a graph.
        let ws = DevMem::new(32 << 20)?;
        // SAFETY: handle and workspace are live for the runtime's lifetime.
        unsafe {
            cublas_ok(
                "cublasSetStream",
                cublas::cublasSetStream_v2(blas.0, stream.cu_stream() as _),
            )?;
            cublas_ok(
                "cublasSetWorkspace",
                cublas::cublasSetWorkspace_v2(blas.0, ws.ptr as *mut c_void, ws.bytes),
            )?;
        }
        let stage_layouts: Vec<StageLayout> = plan.buckets.iter().map(stage_layout).collect();
        let stage_bytes = stage_layouts
            .iter()
            .map(|l| l.hidden + l.hidden_bytes)
            .max()
            .unwrap_or(0);
        let staging = [Pinned::new(stage_bytes)?, Pinned::new(stage_bytes)?];
        let ev = || -> Result<Event, GpuError> {
            Ok(Event(cuda(
                "cuEventCreate",
                result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
            )?))
        };
        let staging_done = [ev()?, ev()?];
        let nb = plan.buckets.len();
        let rows = plan.page_table_rows() as usize;
        let plan_rows_max = plan.buckets.last().map_or(1, |b| b.batch as usize) * plan.spec.num_draft_tokens as usize;
        let mut rt = GpuRuntime {
            plan,
            ctx,
            stream,
            _modules: modules,
            funcs,
            arena,
            weights: wmem,
            kv,
            table,
            blas,
            lt: None,
            _blas_ws: ws,
            gemm_tune_ms: 0.0,
            pool_pages,
            graphs: (0..nb).map(|_| None).collect(),
            graph_build_ms: vec![0.0; nb],
            staging,
            staging_done,
            stage_layouts,
            next_stage: 0,
            slot_pages: vec![0; rows],
            logged: HashSet::new(),
            last_batch: 0,
            slot_seen: vec![0; rows],
            stamp: 0,
            table_host: Vec::new(),
            write_seen: vec![(0, 0); write_set_capacity(plan_rows_max)],
            chunk_out: None,
            chunked: false,
        };
        rt.upload_weights(weights)?;
        rt.reset_page_table()?;
        // Zero the pool once so padded rows never read uninitialized pages.
        // SAFETY: the allocation is kv.bytes long.
        cuda("cuMemsetD8", unsafe {
            result::memset_d8_async(rt.kv.ptr, 0, rt.kv.bytes, rt.stream.cu_stream())
        })?;
        if opts.tune_gemms {
            rt.tune_gemms()?;
        }
        if opts.build_graphs {
            rt.build_graphs()?;
        }
        cuda("cuStreamSynchronize", rt.stream.synchronize())?;
        Ok(rt)
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn pool_pages(&self) -> u32 {
        self.pool_pages
    }

    pub fn scratch_page(&self) -> i32 {
        self.pool_pages as i32 - 1
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes
    }

    pub fn arena_bytes(&self) -> usize {
        self.arena.bytes
    }

    fn upload_weights(&mut self, weights: &[WeightData]) -> Result<(), GpuError> {
        if weights.len() != self.plan.weights.len() {
            return Err(GpuError::Weights(format!(
                "{} weights, the plan has {}",
                weights.len(),
                self.plan.weights.len()
            )));
        }
        let act = self.plan.capture.dtype;
        for (w, d) in self.plan.weights.iter().zip(weights) {
            let bytes: Vec<u8> = match (d, w.dtype) {
                (WeightData::I64(v), DType::I64) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                (WeightData::F32(v), DType::Bf16 | DType::F16) => to_act_bytes(v, act),
                _ => {
                    return Err(GpuError::Weights(format!(
                        "{}: data does not match dtype {}",
                        w.name,
                        w.dtype.name()
                    )))
                }
            };
            if bytes.len() as u64 != w.bytes {
                return Err(GpuError::Weights(format!(
                    "{}: {} bytes, expected {}",
                    w.name,
                    bytes.len(),
                    w.bytes
                )));
            }
            // SAFETY: destination range [offset, offset + bytes) is inside the weight
            // region (validated plan); the copy is synchronous on the source.
            cuda("cuMemcpyHtoD", unsafe {
                result::memcpy_htod_sync(self.weights.ptr + w.offset, &bytes)
            })?;
        }
        Ok(())
    }

    /// Every slot row points at the scratch page until `set_pages` assigns it.
    fn reset_page_table(&mut self) -> Result<(), GpuError> {
        let n = self.table.bytes / 4;
        let scratch = self.scratch_page();
        self.table_host = vec![scratch; n];
        // SAFETY: exactly the table's size.
        cuda("cuMemcpyHtoD", unsafe {
            result::memcpy_htod_sync(self.table.ptr, &self.table_host)
        })?;
        self.slot_pages.iter_mut().for_each(|p| *p = 0);
        Ok(())
    }

    /// Sets a request slot's pages from column 0 (a new request). Not on the replay path.
    pub fn set_pages(&mut self, slot: usize, pages: &[i32]) -> Result<(), GpuError> {
        if let Some(p) = self.slot_pages.get_mut(slot) {
            *p = 0;
        }
        self.append_pages(slot, pages)
    }

    /// Appends pages to a slot's row (a growing request): copies only the new entries.
    pub fn append_pages(&mut self, slot: usize, pages: &[i32]) -> Result<(), GpuError> {
        let cols = self.plan.capture.max_pages_per_request as usize;
        let max_req = self.plan.capture.max_requests as usize;
        let bad = |msg: String| GpuError::Input(crate::step::input_error("page_table", format!("[{slot}]"), msg));
        if slot >= max_req {
            return Err(bad(format!("slot {slot} is outside [0, {max_req})")));
        }
        let have = self.slot_pages[slot] as usize;
        if have + pages.len() > cols {
            return Err(bad(format!(
                "{} pages exceed the {cols} columns of a row",
                have + pages.len()
            )));
        }
        if let Some(p) = pages.iter().find(|&&p| p < 0 || p >= self.scratch_page()) {
            return Err(bad(format!(
                "page {p} is outside the request pages [0, {})",
                self.scratch_page()
            )));
        }
        if pages.is_empty() {
            return Ok(());
        }
        let first = slot * cols + have;
        self.table_host[first..first + pages.len()].copy_from_slice(pages);
        let at = self.table.ptr + (first * 4) as u64;
        // SAFETY: [at, at + 4·len) lies inside row `slot` (checked above). The source is
        // pageable host memory, which the driver stages before the call returns, so no
        // synchronization is needed; the copy is stream-ordered after earlier replays, so
        // a running step never sees a half-updated row.
        cuda("cuMemcpyHtoDAsync", unsafe {
            result::memcpy_htod_async(
                at,
                &self.table_host[first..first + pages.len()],
                self.stream.cu_stream(),
            )
        })?;
        self.slot_pages[slot] += pages.len() as u32;
        Ok(())
    }

    fn arg_ptr(&self, b: &BucketPlan, v: &ArgValue) -> u64 {
        match v {
            ArgValue::Buffer { id, .. } => self.arena.ptr + b.buffers[*id as usize].offset,
            ArgValue::Weight { id } => self.weights.ptr + self.plan.weights[*id as usize].offset,
            ArgValue::KvCache { layer, kind, .. } => {
                let which = *layer as u64 * 2 + (*kind == KvKind::V) as u64;
                self.kv.ptr + which * self.pool_pages as u64 * self.plan.kv_page_bytes()
            }
            ArgValue::PageTable => self.table.ptr,
            ArgValue::Null | ArgValue::U32(_) => 0,
        }
    }

    /// Packs a kernel's parameter struct: each argument at its field's offset (the plan
    /// carries the layout the kernels crate's `#[derive(KernelParams)]` computed, which the
    /// C side asserts with `static_assert`s).
    fn pack(&self, b: &BucketPlan, k: &crate::format::KernelDesc, args: &[KernelArg]) -> Vec<u8> {
        let mut out = vec![0u8; k.params_size as usize];
        for (a, f) in args.iter().zip(&k.params) {
            let at = f.offset as usize;
            match &a.value {
                ArgValue::U32(x) => out[at..at + 4].copy_from_slice(&x.to_le_bytes()),
                v => out[at..at + 8].copy_from_slice(&self.arg_ptr(b, v).to_le_bytes()),
            }
        }
        out
    }

    fn gemm_shape(&self, b: &BucketPlan, g: &GemmDesc) -> (crate::lt::GemmShape, crate::lt::GemmPtrs) {
        let (a, c, w) = (
            &b.buffers[g.a as usize],
            &b.buffers[g.c as usize],
            &self.plan.weights[g.w as usize],
        );
        (
            crate::lt::GemmShape {
                m: g.m as u32,
                n: g.n as u32,
                k: g.k as u32,
                accumulate: g.accumulate,
                w: w.dtype,
                a: a.dtype,
                c: c.dtype,
            },
            crate::lt::GemmPtrs {
                w: self.weights.ptr + w.offset,
                a: self.arena.ptr + a.offset,
                c: self.arena.ptr + c.offset,
            },
        )
    }

    /// Chooses a cuBLASLt algorithm for every GEMM shape of the plan by timing the
    /// candidates (see `lt.rs`). Runs at load, before any graph exists and before any step
    /// has put data in the arena (the timed calls overwrite their outputs).
    fn tune_gemms(&mut self) -> Result<(), GpuError> {
        let t0 = Instant::now();
        let mut lt = crate::lt::Lt::new((self._blas_ws.ptr, self._blas_ws.bytes))?;
        for b in &self.plan.buckets {
            for l in &b.launches {
                if let LaunchKind::Gemm(g) = &l.kind {
                    let (shape, ptrs) = self.gemm_shape(b, g);
                    lt.tune(shape, ptrs, self.stream.cu_stream())?;
                }
            }
        }
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        self.lt = Some(lt);
        self.gemm_tune_ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// What GEMM tuning chose, per (m, n, k) of each bucket's GEMMs (benchmark reports).
    pub fn gemm_choices(&self) -> Vec<(u64, u64, u64, crate::lt::GemmChoice)> {
        let mut v = Vec::new();
        let Some(lt) = &self.lt else { return v };
        for b in &self.plan.buckets {
            for l in &b.launches {
                if let LaunchKind::Gemm(g) = &l.kind {
                    if let Some(c) = lt.choice(&self.gemm_shape(b, g).0) {
                        if !v
                            .iter()
                            .any(|x: &(u64, u64, u64, _)| (x.0, x.1, x.2) == (g.m, g.n, g.k))
                        {
                            v.push((g.m, g.n, g.k, c));
                        }
                    }
                }
            }
        }
        v
    }

    fn gemm(&self, b: &BucketPlan, g: &GemmDesc) -> Result<(), GpuError> {
        if let Some(lt) = &self.lt {
            let (shape, ptrs) = self.gemm_shape(b, g);
            if let Some(r) = lt.run(&shape, ptrs, self.stream.cu_stream()) {
                return r;
            }
        }
        let a = &b.buffers[g.a as usize];
        let c = &b.buffers[g.c as usize];
        let w = &self.plan.weights[g.w as usize];
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0f32 });
        // Row-major C[m,n] = A[m,k]·W[n,k]ᵀ is column-major Cᵀ[n,m] = Wᵀ·Aᵀ with W and A
        // read as k-major: op(W) = T, op(A) = N.
        // SAFETY: all three operands lie inside their regions (validated plan: shapes match
        // m, n, k); alpha/beta are host scalars read at call (or capture) time.
        let s = unsafe {
            cublas::cublasGemmEx(
                self.blas.0,
                cublas::cublasOperation_t::CUBLAS_OP_T,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                (self.weights.ptr + w.offset) as *const c_void,
                dtype_cuda(w.dtype),
                g.k as i32,
                (self.arena.ptr + a.offset) as *const c_void,
                dtype_cuda(a.dtype),
                g.k as i32,
                &beta as *const f32 as *const c_void,
                (self.arena.ptr + c.offset) as *mut c_void,
                dtype_cuda(c.dtype),
                g.n as i32,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        cublas_ok("cublasGemmEx", s)
    }

    /// Issues every launch of a bucket on the stream (used eagerly and under capture).
    fn issue(&self, bi: usize) -> Result<(), GpuError> {
        self.issue_where(bi, &|_| true)
    }

    /// Issues the launches of a bucket whose op name passes `keep`, eagerly.
    fn issue_where(&self, bi: usize, keep: &dyn Fn(&str) -> bool) -> Result<(), GpuError> {
        let b = &self.plan.buckets[bi];
        for l in b.launches.iter().filter(|l| keep(&l.op)) {
            match &l.kind {
                LaunchKind::Gemm(g) => self.gemm(b, g)?,
                LaunchKind::Kernel {
                    kernel,
                    grid,
                    block,
                    smem,
                    args,
                } => {
                    let mut blob = self.pack(b, &self.plan.kernels[*kernel as usize], args);
                    let mut params = [blob.as_mut_ptr() as *mut c_void];
                    // SAFETY: the function belongs to a loaded module; `params` points at a
                    // struct laid out as the kernel declares (see `pack`), alive until the
                    // call returns (the driver copies it); every address inside is within
                    // an allocation of this runtime.
                    cuda("cuLaunchKernel", unsafe {
                        result::launch_kernel(
                            self.funcs[*kernel as usize],
                            (grid[0], grid[1], grid[2]),
                            (block[0], block[1], block[2]),
                            *smem,
                            self.stream.cu_stream(),
                            &mut params,
                        )
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Captures every replayable bucket into a graph, largest first.
    pub fn build_graphs(&mut self) -> Result<(), GpuError> {
        for bi in (0..self.plan.buckets.len()).rev() {
            if self.plan.buckets[bi].replay != Replay::Graph {
                continue;
            }
            let t0 = Instant::now();
            cuda(
                "cuStreamBeginCapture",
                self.stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            )?;
            let issued = self.issue(bi);
            let graph = cuda(
                "cuStreamEndCapture",
                self.stream.end_capture(sys::CUgraphInstantiate_flags_enum(0)), // UPLOAD needs cuGraphInstantiateWithParams; uploaded below
            )?;
            issued?;
            let graph = graph.ok_or(GpuError::Cuda {
                call: "cuStreamEndCapture",
                message: "empty graph".into(),
            })?;
            cuda("cuGraphUpload", graph.upload())?;
            self.graph_build_ms[bi] = t0.elapsed().as_secs_f64() * 1e3;
            self.graphs[bi] = Some(graph);
        }
        Ok(())
    }

    fn log_once(&mut self, msg: String) {
        if self.logged.insert(msg.clone()) {
            eprintln!("specplan: {msg}");
        }
    }

    /// One draft-extend step. Batches above the largest bucket run as several eager chunks.
    pub fn step(&mut self, req: &StepRequest, eager: bool) -> Result<StepInfo, GpuError> {
        let t0 = Instant::now(); // host prep is timed from here: the checks are part of it
        let b = req.slots.len();
        let max_b = self.plan.buckets.last().map_or(0, |x| x.batch as usize);
        // Every step is checked whole before anything is staged or launched. For a batch
        // above the largest bucket this also means a bad request in a later chunk cannot
        // leave the earlier chunks' K/V written, and two requests in different chunks
        // cannot write one cache slot.
        self.check(req)?;
        if b > max_b {
            self.log_once(format!(
                "batch {b} exceeds the largest bucket {max_b}: running in eager chunks"
            ));
            let n = self.plan.spec.num_draft_tokens as usize;
            let h = self.plan.model.hidden as usize;
            let mut info = StepInfo {
                bucket: max_b as u32,
                graph: false,
                prep_us: 0.0,
            };
            for start in (0..b).step_by(max_b) {
                let end = (start + max_b).min(b);
                let hidden = match req.hidden {
                    Hidden::Host(v) => Hidden::Host(&v[start * n * h..end * n * h]),
                    Hidden::Device(p) => Hidden::Device(p + (start * n * h * 2) as u64),
                };
                let chunk = StepRequest {
                    slots: &req.slots[start..end],
                    input_ids: &req.input_ids[start * n..end * n],
                    hidden,
                    prefix_lens: &req.prefix_lens[start..end],
                    accept_lens: &req.accept_lens[start..end],
                };
                // The first chunk's prep includes the whole batch's checks.
                let from = if start == 0 { t0 } else { Instant::now() };
                let i = self.step_one(&chunk, true, from)?;
                info.prep_us += i.prep_us;
                self.gather_chunk_outputs(start, end, b)?;
            }
            self.last_batch = b;
            self.chunked = true;
            return Ok(info);
        }
        self.chunked = false;
        self.step_one(req, eager, t0)
    }

    /// Chunks share the arena, so each chunk's outputs move (device to device, stream
    /// ordered) into a runtime-owned block holding the whole batch's outputs.
    fn gather_chunk_outputs(&mut self, start: usize, end: usize, total: usize) -> Result<(), GpuError> {
        let (h, k) = (self.plan.model.hidden as usize, self.plan.spec.topk as usize);
        let act = self.plan.capture.dtype.size() as usize;
        let per = [h * act, k * 4, k * 8];
        let need: usize = per.iter().map(|p| p * total).sum();
        if self.chunk_out.as_ref().is_none_or(|m| m.bytes < need) {
            cuda("cuStreamSynchronize", self.stream.synchronize())?;
            self.chunk_out = Some(DevMem::new(need)?);
        }
        let Some(dst) = self.chunk_out.as_ref().map(|m| m.ptr) else {
            return Ok(());
        };
        let mut base = 0u64;
        for (name, row) in [
            (io::HIDDEN_OUT, per[0]),
            (io::TOPK_PROBS, per[1]),
            (io::TOPK_IDS, per[2]),
        ] {
            let src = self.bucket_output_ptr(name, end - start)?;
            // SAFETY: source rows [0, end - start) exist in the chunk's bucket; destination
            // rows [start, end) lie inside a block sized for `total` rows.
            cuda("cuMemcpyDtoDAsync", unsafe {
                result::memcpy_dtod_async(
                    dst + base + (start * row) as u64,
                    src,
                    (end - start) * row,
                    self.stream.cu_stream(),
                )
            })?;
            base += (total * row) as u64;
        }
        Ok(())
    }

    fn bucket_output_ptr(&self, name: &str, b: usize) -> Result<u64, GpuError> {
        self.plan
            .buckets
            .iter()
            .find(|x| x.batch as usize >= b)
            .and_then(|bk| bk.buffer(name))
            .map(|(_, x)| self.arena.ptr + x.offset)
            .ok_or(GpuError::Cuda {
                call: "outputs",
                message: format!("no buffer {name}"),
            })
    }

    /// The shapes of a request's slices (before anything is sliced by them).
    fn check_lengths(&self, req: &StepRequest) -> Result<(), GpuError> {
        let p = &self.plan;
        let (b, n, h) = (
            req.slots.len(),
            p.spec.num_draft_tokens as usize,
            p.model.hidden as usize,
        );
        let e = |t: &str, m: String| GpuError::Input(crate::step::input_error(t, String::new(), m));
        if b == 0 {
            return Err(e("req_slots", "a step needs at least one request".into()));
        }
        if req.input_ids.len() != b * n {
            return Err(e(
                "input_ids",
                format!("{} values, expected [{b}, {n}]", req.input_ids.len()),
            ));
        }
        if req.prefix_lens.len() != b || req.accept_lens.len() != b {
            return Err(e(
                "prefix_lens",
                format!("prefix_lens and accept_lens need {b} values each"),
            ));
        }
        if let Hidden::Host(v) = req.hidden {
            if v.len() != b * n * h {
                return Err(e(
                    "hidden_states",
                    format!("{} values, expected [{b}, {n}, {h}]", v.len()),
                ));
            }
        }
        Ok(())
    }

    fn check(&mut self, req: &StepRequest) -> Result<(), GpuError> {
        let p = &self.plan;
        let (b, n) = (req.slots.len(), p.spec.num_draft_tokens as usize);
        let e = |t: &str, i: String, m: String| GpuError::Input(crate::step::input_error(t, i, m));
        self.check_lengths(req)?;
        let vocab = p.model.vocab as i64;
        if let Some(r) = req.input_ids.iter().position(|&x| x < 0 || x >= vocab) {
            return Err(e(
                "input_ids",
                format!("[{}][{}]", r / n, r % n),
                format!("{} is outside [0, {vocab})", req.input_ids[r]),
            ));
        }
        let ps = p.capture.page_size as i64;
        // The write set is sized for the largest bucket; a batch run in chunks is checked
        // whole, so grow it then (off the replay path: such batches run eagerly anyway).
        let need = write_set_capacity(b * n);
        if self.write_seen.len() < need {
            self.write_seen = vec![(0, 0); need];
        }
        // Slots must be distinct: two rows of one step writing one slot's pages would race.
        // A stamped table (no allocation, no clearing) keeps this O(b).
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.slot_seen.iter_mut().for_each(|x| *x = 0);
            self.write_seen.iter_mut().for_each(|x| *x = (0, 0));
            self.stamp = 1;
        }
        for i in 0..b {
            let s = req.slots[i];
            if s < 0 || s as u32 >= p.capture.max_requests {
                return Err(e(
                    "req_slots",
                    format!("[{i}]"),
                    format!("{s} is outside [0, {})", p.capture.max_requests),
                ));
            }
            if std::mem::replace(&mut self.slot_seen[s as usize], self.stamp) == self.stamp {
                return Err(e(
                    "req_slots",
                    format!("[{i}]"),
                    format!("slot {s} appears twice in one step"),
                ));
            }
            crate::step::check_lengths_of(p, i, req.prefix_lens[i], req.accept_lens[i])?;
            let l = req.prefix_lens[i] as i64;
            let need = (l + n as i64 + ps - 1) / ps;
            if need > self.slot_pages[s as usize] as i64 {
                return Err(e(
                    "prefix_lens",
                    format!("[{i}]"),
                    format!(
                        "positions up to {} need {need} pages, slot {s} has {}",
                        l + n as i64 - 1,
                        self.slot_pages[s as usize]
                    ),
                ));
            }
            // No two requests of a step may write one cache slot (their K/V writes would race).
            let row = s as usize * self.plan.capture.max_pages_per_request as usize;
            for j in 0..n as i64 {
                let pos = l + j;
                let page = self.table_host[row + (pos / ps) as usize] as i64;
                let key = (page * ps + pos % ps) as u64;
                if !insert_write(&mut self.write_seen, self.stamp, key) {
                    return Err(e(
                        "page_table",
                        format!("[{i}]"),
                        format!(
                            "request {i} writes page {page} slot {}, which another request of this step also writes",
                            pos % ps
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// One bucket's step on a request `step` has checked (the whole batch, for chunks);
    /// `t0` is when its host prep began.
    fn step_one(&mut self, req: &StepRequest, eager: bool, t0: Instant) -> Result<StepInfo, GpuError> {
        let b = req.slots.len();
        let bi = self
            .plan
            .buckets
            .iter()
            .position(|x| x.batch as usize >= b)
            .unwrap_or(0);
        let bucket = &self.plan.buckets[bi];
        let (bb, n) = (bucket.batch as usize, self.plan.spec.num_draft_tokens as usize);
        let h = self.plan.model.hidden as usize;
        let act = self.plan.capture.dtype.size() as usize;
        let lay = &self.stage_layouts[bi];
        let k = self.next_stage;
        self.next_stage ^= 1;
        // The staging block we are about to overwrite was last read by the copies of the
        // step before the previous one; those are long done, so this query normally
        // returns at once and never waits on the GPU's compute.
        // SAFETY: the event is live.
        if unsafe { result::event::query(self.staging_done[k].0) }.is_err() {
            // SAFETY: as above.
            cuda("cuEventSynchronize", unsafe {
                result::event::synchronize(self.staging_done[k].0)
            })?;
        }
        let scratch_slot = self.plan.capture.max_requests as i32;
        {
            let s = self.staging[k].as_mut();
            let put = |s: &mut [u8], at: usize, bytes: &[u8]| s[at..at + bytes.len()].copy_from_slice(bytes);
            put(s, lay.ids, as_bytes(req.input_ids));
            s[lay.ids + b * n * 8..lay.ids + bb * n * 8].fill(0);
            for i in 0..bb {
                let (l, a, slot) = if i < b {
                    (req.prefix_lens[i], req.accept_lens[i], req.slots[i])
                } else {
                    (0, n as i32, scratch_slot)
                };
                put(s, lay.prefix + i * 4, &l.to_le_bytes());
                put(s, lay.accept + i * 4, &a.to_le_bytes());
                put(s, lay.slots + i * 4, &slot.to_le_bytes());
            }
            // Padded rows keep whatever the staging held (an earlier step's rows, or
            // uninitialized pinned memory): rows never mix, so those values cannot reach a
            // real request, whatever they are.
            if let Hidden::Host(v) = req.hidden {
                put(s, lay.hidden, as_bytes(v));
            }
        }
        let base = self.staging[k].ptr;
        let stream = self.stream.cu_stream();
        let ranges = match req.hidden {
            Hidden::Host(_) => &lay.all,
            Hidden::Device(_) => &lay.ints,
        };
        for &(off, len) in ranges {
            // SAFETY: the staging block mirrors the arena's first bytes and [off, off + len)
            // lies inside both (ranges come from this bucket's input buffers, merged only
            // across gaps no other buffer occupies).
            cuda("cuMemcpyHtoDAsync", unsafe {
                let src = std::slice::from_raw_parts(base.add(off), len);
                result::memcpy_htod_async(self.arena.ptr + off as u64, src, stream)
            })?;
        }
        if let Hidden::Device(p) = req.hidden {
            // SAFETY: the caller's pointer holds b·N·H activations; the arena buffer holds
            // B·N·H ≥ that. Padded rows keep stale (finite) values.
            cuda("cuMemcpyDtoDAsync", unsafe {
                result::memcpy_dtod_async(self.arena.ptr + lay.hidden as u64, p, b * n * h * act, stream)
            })?;
        }
        // SAFETY: event and stream are live.
        cuda("cuEventRecord", unsafe {
            result::event::record(self.staging_done[k].0, stream)
        })?;
        let prep_us = t0.elapsed().as_secs_f64() * 1e6;
        let graph = !eager && self.graphs[bi].is_some();
        if graph {
            if let Some(g) = &self.graphs[bi] {
                cuda("cuGraphLaunch", g.launch())?;
            }
        } else {
            if !eager {
                if let Replay::Eager(reason) = &self.plan.buckets[bi].replay {
                    let msg = format!("bucket {} runs eagerly: {reason:?}", self.plan.buckets[bi].batch);
                    self.log_once(msg);
                }
            }
            self.issue(bi)?;
        }
        self.last_batch = b;
        Ok(StepInfo {
            bucket: self.plan.buckets[bi].batch,
            graph,
            prep_us,
        })
    }

    /// Device address of an output buffer of the last step's bucket (stays valid until the
    /// next step).
    pub fn output_ptr(&self, name: &str) -> Option<u64> {
        if self.chunked {
            let (h, k) = (self.plan.model.hidden as u64, self.plan.spec.topk as u64);
            let (b, act) = (self.last_batch as u64, self.plan.capture.dtype.size());
            let base = self.chunk_out.as_ref()?.ptr;
            return match name {
                io::HIDDEN_OUT => Some(base),
                io::TOPK_PROBS => Some(base + b * h * act),
                io::TOPK_IDS => Some(base + b * h * act + b * k * 4),
                _ => None,
            };
        }
        self.bucket_output_ptr(name, self.last_batch).ok()
    }

    /// Copies the last step's outputs to the host (synchronizes; not on the replay path).
    pub fn read_outputs(&self) -> Result<HostOutputs, GpuError> {
        let b = self.last_batch;
        let (h, k) = (self.plan.model.hidden as usize, self.plan.spec.topk as usize);
        let mut out = HostOutputs {
            hidden_out: vec![0; b * h],
            topk_probs: vec![0.0; b * k],
            topk_ids: vec![0; b * k],
        };
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        let ptr = |n: &str| {
            self.output_ptr(n).ok_or(GpuError::Cuda {
                call: "outputs",
                message: format!("no buffer {n}"),
            })
        };
        // SAFETY: each source buffer holds at least b rows (bucket ≥ b); destinations are
        // sized exactly; the stream is synchronized.
        unsafe {
            cuda(
                "cuMemcpyDtoH",
                result::memcpy_dtoh_sync(&mut out.hidden_out, ptr(io::HIDDEN_OUT)?),
            )?;
            cuda(
                "cuMemcpyDtoH",
                result::memcpy_dtoh_sync(&mut out.topk_probs, ptr(io::TOPK_PROBS)?),
            )?;
            cuda(
                "cuMemcpyDtoH",
                result::memcpy_dtoh_sync(&mut out.topk_ids, ptr(io::TOPK_IDS)?),
            )?;
        }
        Ok(out)
    }

    /// Uploads K/V pages for the caller's pages `[0, pages)` (layer-major, raw act bits).
    pub fn write_kv(&mut self, k: &[u16], v: &[u16], pages: usize) -> Result<(), GpuError> {
        self.kv_copy(pages, |dst, layer, which| {
            let src = if which == 0 { k } else { v };
            let per = src.len() / self.plan.model.layers as usize;
            // SAFETY: dst is inside the pool (pages ≤ pool pages checked by the caller).
            cuda("cuMemcpyHtoD", unsafe {
                result::memcpy_htod_sync(dst, &src[layer * per..(layer + 1) * per])
            })
        })
    }

    /// Reads K/V pages `[0, pages)` back (layer-major, raw act bits). Synchronizes.
    pub fn read_kv(&self, pages: usize) -> Result<(Vec<u16>, Vec<u16>), GpuError> {
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        let per = pages * self.plan.kv_page_bytes() as usize / 2;
        let layers = self.plan.model.layers as usize;
        let mut k = vec![0u16; layers * per];
        let mut v = vec![0u16; layers * per];
        for layer in 0..layers {
            for which in 0..2 {
                let src =
                    self.kv.ptr + ((layer * 2 + which) as u64) * self.pool_pages as u64 * self.plan.kv_page_bytes();
                let dst = if which == 0 {
                    &mut k[layer * per..(layer + 1) * per]
                } else {
                    &mut v[layer * per..(layer + 1) * per]
                };
                // SAFETY: `per` elements from the start of this layer's pool.
                cuda("cuMemcpyDtoH", unsafe { result::memcpy_dtoh_sync(dst, src) })?;
            }
        }
        Ok((k, v))
    }

    /// Reads the scratch page of every layer (to check what padding wrote). Synchronizes.
    pub fn read_scratch_page(&self) -> Result<Vec<u16>, GpuError> {
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        let per = self.plan.kv_page_bytes() as usize / 2;
        let mut out = vec![0u16; self.plan.model.layers as usize * 2 * per];
        for (i, chunk) in out.chunks_mut(per).enumerate() {
            let src = self.kv.ptr
                + i as u64 * self.pool_pages as u64 * self.plan.kv_page_bytes()
                + self.scratch_page() as u64 * self.plan.kv_page_bytes();
            // SAFETY: one page inside pool `i`.
            cuda("cuMemcpyDtoH", unsafe { result::memcpy_dtoh_sync(chunk, src) })?;
        }
        Ok(out)
    }

    fn kv_copy(
        &self,
        pages: usize,
        mut f: impl FnMut(u64, usize, usize) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        if pages >= self.pool_pages as usize {
            return Err(GpuError::Weights(format!(
                "{pages} cache pages do not fit a pool of {} (+1 scratch)",
                self.pool_pages - 1
            )));
        }
        for layer in 0..self.plan.model.layers as usize {
            for which in 0..2 {
                let dst =
                    self.kv.ptr + ((layer * 2 + which) as u64) * self.pool_pages as u64 * self.plan.kv_page_bytes();
                f(dst, layer, which)?;
            }
        }
        Ok(())
    }

    /// Fills the arena with 0xFF bytes (NaN in every float type), so a check sees any
    /// output a step failed to write. Tests only.
    pub fn poison(&self) -> Result<(), GpuError> {
        // SAFETY: the whole arena allocation.
        cuda("cuMemsetD8", unsafe {
            result::memset_d8_async(self.arena.ptr, 0xff, self.arena.bytes, self.stream.cu_stream())
        })
    }

    /// Blocks until the stream is idle (benchmarks and tests only).
    pub fn synchronize(&self) -> Result<(), GpuError> {
        cuda("cuStreamSynchronize", self.stream.synchronize())
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Index of the bucket of exactly `batch` rows (benchmark and test entry points).
    fn bucket_index(&self, batch: u32, call: &'static str) -> Result<usize, GpuError> {
        self.plan
            .buckets
            .iter()
            .position(|b| b.batch == batch)
            .ok_or(GpuError::Cuda {
                call,
                message: format!("no bucket {batch}"),
            })
    }

    /// Benchmarks: replays a bucket's graph on the inputs already in the arena (no host
    /// prep, no copies), or issues the launches whose op name contains `filter` eagerly.
    pub fn replay_only(&self, batch: u32, filter: Option<&str>) -> Result<(), GpuError> {
        let bi = self.bucket_index(batch, "replay_only")?;
        match (filter, &self.graphs[bi]) {
            (None, Some(g)) => cuda("cuGraphLaunch", g.launch()),
            (None, None) => self.issue(bi),
            (Some(f), _) => self.issue_where(bi, &|op| op.contains(f)),
        }
    }

    /// Kernel tests and debugging: the address and size of a named arena buffer of the
    /// bucket `batch` (exact bucket size). The arena is shared by every bucket and packed by
    /// liveness, so after a step a buffer holds its value only until a later op reuses it.
    pub fn buffer_ptr(&self, batch: u32, name: &str) -> Option<(u64, usize)> {
        let bk = self.plan.buckets.iter().find(|b| b.batch == batch)?;
        let (_, x) = bk.buffer(name)?;
        Some((self.arena.ptr + x.offset, x.bytes as usize))
    }

    /// Kernel tests: overwrites a named arena buffer of bucket `batch` (synchronously).
    pub fn write_buffer(&self, batch: u32, name: &str, bytes: &[u8]) -> Result<(), GpuError> {
        let (ptr, len) = self.buffer_ptr(batch, name).ok_or(GpuError::Cuda {
            call: "write_buffer",
            message: format!("bucket {batch} has no buffer {name}"),
        })?;
        if bytes.len() != len {
            return Err(GpuError::Cuda {
                call: "write_buffer",
                message: format!("{name} holds {len} bytes, got {}", bytes.len()),
            });
        }
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        // SAFETY: the destination range lies inside the arena allocation (the plan was
        // validated against the arena size) and its length equals the source's; the
        // stream is idle, so no kernel reads it concurrently.
        unsafe { cuda("cuMemcpyHtoD", result::memcpy_htod_sync(ptr, bytes)) }
    }

    /// Kernel tests: copies a named arena buffer of bucket `batch` to the host (synchronizes).
    pub fn read_buffer(&self, batch: u32, name: &str) -> Result<Vec<u8>, GpuError> {
        let (ptr, len) = self.buffer_ptr(batch, name).ok_or(GpuError::Cuda {
            call: "read_buffer",
            message: format!("bucket {batch} has no buffer {name}"),
        })?;
        let mut out = vec![0u8; len];
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        // SAFETY: the source range lies inside the arena allocation; the destination has
        // exactly `len` bytes; the stream is synchronized.
        unsafe { cuda("cuMemcpyDtoH", result::memcpy_dtoh_sync(&mut out, ptr))? };
        Ok(out)
    }

    /// Benchmarks: captures the launches of bucket `batch` whose op name contains `filter`
    /// as a graph of their own (e.g. the attention launches, timed without the host
    /// launch overhead that dominates eager issue of microsecond kernels).
    pub fn capture_where(&self, batch: u32, filter: &str) -> Result<CudaGraph, GpuError> {
        let bi = self.bucket_index(batch, "capture_where")?;
        cuda(
            "cuStreamBeginCapture",
            self.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        )?;
        let issued = self.issue_where(bi, &|op| op.contains(filter));
        let graph = cuda(
            "cuStreamEndCapture",
            self.stream.end_capture(sys::CUgraphInstantiate_flags_enum(0)),
        )?;
        issued?;
        let graph = graph.ok_or(GpuError::Cuda {
            call: "cuStreamEndCapture",
            message: format!("no launch of bucket {batch} matches {filter}"),
        })?;
        cuda("cuGraphUpload", graph.upload())?;
        Ok(graph)
    }

    /// Whether a bucket has a built graph.
    pub fn has_graph(&self, batch: u32) -> bool {
        self.plan
            .buckets
            .iter()
            .position(|b| b.batch == batch)
            .is_some_and(|i| self.graphs[i].is_some())
    }
}

/// Slots of the write set: a power of two at least 4× the rows a step can have.
fn write_set_capacity(max_rows: usize) -> usize {
    (4 * max_rows.max(16)).next_power_of_two()
}

/// Inserts `key` into the stamped open-addressing set (linear probing; entries with an
/// older stamp are free). Returns false when the key is already there for this stamp.
/// The set holds at most a quarter of its slots per step, so probing always ends.
fn insert_write(set: &mut [(u64, u32)], stamp: u32, key: u64) -> bool {
    let mask = set.len() - 1;
    let mut at = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask;
    loop {
        let e = &mut set[at];
        if e.1 != stamp {
            *e = (key, stamp);
            return true;
        }
        if e.0 == key {
            return false;
        }
        at = (at + 1) & mask;
    }
}

/// The bytes of a slice of plain integers, as the device reads them (little-endian hosts).
fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    const _: () = assert!(
        cfg!(target_endian = "little"),
        "the staging copies assume a little-endian host"
    );
    // SAFETY: T is a plain integer type here (i64, i32, u16): every byte is initialized and
    // any alignment is valid for u8; the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn stage_layout(b: &BucketPlan) -> StageLayout {
    let find = |name: &str| b.buffer(name).map(|(_, x)| (x.offset as usize, x.bytes as usize));
    let (mut l, mut ranges) = (StageLayout::default(), Vec::new());
    for (name, slot) in [
        (io::INPUT_IDS, &mut l.ids),
        (io::PREFIX_LENS, &mut l.prefix),
        (io::ACCEPT_LENS, &mut l.accept),
        (io::REQ_SLOTS, &mut l.slots),
    ] {
        if let Some((off, len)) = find(name) {
            *slot = off;
            ranges.push((off, len));
        }
    }
    if let Some((off, len)) = find(io::HIDDEN_STATES) {
        l.hidden = off;
        l.hidden_bytes = len;
    }
    // Merge sorted ranges across gaps that no non-input buffer touches.
    let free = |lo: usize, hi: usize| {
        b.buffers.iter().all(|x| {
            x.role == crate::format::BufferRole::Input || x.offset as usize >= hi || (x.offset + x.bytes) as usize <= lo
        })
    };
    let merge = |mut v: Vec<(usize, usize)>| -> Vec<(usize, usize)> {
        v.sort_unstable();
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (off, len) in v {
            match out.last_mut() {
                Some((o, l)) if *o + *l <= off && free(*o + *l, off) => *l = off + len - *o,
                _ => out.push((off, len)),
            }
        }
        out
    };
    l.ints = merge(ranges.clone());
    ranges.push((l.hidden, l.hidden_bytes));
    l.all = merge(ranges);
    l
}

/// f32 values as the activation type's raw bits (round to nearest).
pub fn to_act_bits(v: &[f32], act: DType) -> Vec<u16> {
    match act {
        DType::F16 => v.iter().map(|x| half::f16::from_f32(*x).to_bits()).collect(),
        _ => v.iter().map(|x| half::bf16::from_f32(*x).to_bits()).collect(),
    }
}

/// One activation value's raw bits as f32 (exact).
pub fn from_act_bits(u: u16, act: DType) -> f32 {
    match act {
        DType::F16 => half::f16::from_bits(u).to_f32(),
        _ => half::bf16::from_bits(u).to_f32(),
    }
}

fn to_act_bytes(v: &[f32], act: DType) -> Vec<u8> {
    to_act_bits(v, act).iter().flat_map(|u| u.to_le_bytes()).collect()
}

/// Loads every kernel: the CUBIN, or the PTX when the CUBIN does not load.
fn load_kernels(plan: &Plan) -> Result<(Vec<Module>, Vec<sys::CUfunction>), GpuError> {
    let mut modules = Vec::new();
    let mut funcs = Vec::new();
    for k in &plan.kernels {
        let bin = k
            .binary
            .as_ref()
            .ok_or_else(|| GpuError::NoBinary { kernel: k.name.clone() })?;
        // SAFETY: the CUBIN is an ELF image produced by NVRTC for this arch; the driver
        // validates it and returns an error (not UB) on a bad image.
        let loaded = unsafe { result::module::load_data(bin.cubin.as_ptr() as *const c_void) };
        let module = match loaded {
            Ok(m) => m,
            Err(e1) => {
                let mut ptx = bin.ptx.clone().into_bytes();
                ptx.push(0);
                // SAFETY: a NUL-terminated PTX string.
                unsafe { result::module::load_data(ptx.as_ptr() as *const c_void) }.map_err(|e2| GpuError::Load {
                    kernel: k.name.clone(),
                    message: format!("CUBIN: {e1:?}; PTX: {e2:?}"),
                })?
            }
        };
        modules.push(Module(module));
        let name = std::ffi::CString::new(k.entry.clone()).map_err(|e| GpuError::Load {
            kernel: k.name.clone(),
            message: e.to_string(),
        })?;
        // SAFETY: the module is loaded; the name is NUL-terminated.
        let f = cuda("cuModuleGetFunction", unsafe {
            result::module::get_function(module, name)
        })?;
        funcs.push(f);
    }
    // Kernels whose dynamic shared memory exceeds the 48 KiB default opt in to more.
    for b in &plan.buckets {
        for l in &b.launches {
            if let LaunchKind::Kernel { kernel, smem, .. } = &l.kind {
                if *smem > 48 * 1024 {
                    // SAFETY: a loaded function; the value is ≤ the validated 227 KiB limit.
                    let r = unsafe {
                        sys::cuFuncSetAttribute(
                            funcs[*kernel as usize],
                            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            *smem as i32,
                        )
                    };
                    if r != sys::CUresult::CUDA_SUCCESS {
                        return Err(GpuError::Cuda {
                            call: "cuFuncSetAttribute",
                            message: format!("{r:?}"),
                        });
                    }
                }
            }
        }
    }
    Ok((modules, funcs))
}

#[cfg(test)]
mod tests {
    use super::{insert_write, write_set_capacity};

    #[test]
    fn write_set_finds_duplicates_within_a_step_only() {
        let cap = write_set_capacity(64 * 16);
        assert!(cap.is_power_of_two() && cap >= 4 * 64 * 16);
        let mut set = vec![(0u64, 0u32); cap];
        // Keys that collide in the low bits probe past each other.
        let keys: Vec<u64> = (0..1024u64).map(|i| i * cap as u64).collect();
        for &k in &keys {
            assert!(insert_write(&mut set, 1, k), "first insert of {k}");
        }
        for &k in &keys {
            assert!(!insert_write(&mut set, 1, k), "second insert of {k} in one step");
        }
        // A new stamp frees every entry.
        for &k in &keys {
            assert!(insert_write(&mut set, 2, k), "{k} in the next step");
        }
        assert!(!insert_write(&mut set, 2, keys[17]));
    }
}
