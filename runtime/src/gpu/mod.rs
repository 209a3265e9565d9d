//! The GPU runtime: loads a validated plan, owns the device memory, builds one CUDA graph
//! per bucket and replays it with host-only prep.
//!
//! Modules: `device` (RAII and errors), `launch` (kernel loading, argument packing,
//! issuing, the one capture function), `gemm` + `lt` (GEMMs), `staging` (host prep of
//! owned-memory steps), `probes` (hooks for tests and benchmarks). Admission checks live in
//! `crate::admission`, shared with the CPU path.
//!
//! Device memory is four allocations — the activation arena (the plan's largest bucket),
//! the weight region, the KV pool `[layer][K|V][page][slot][kv_head][dim]` and the page
//! table `[max_requests + 1][pages_per_request]` — and every kernel argument is one of
//! their base addresses plus a plan offset.
//!
//! Replay path invariants: no device-to-host copy, no synchronization, no allocation; host
//! work is O(b·N + b) (plus copying the caller's host hidden states, O(b·N·H), which is the
//! input itself); the page table is updated only by `set_pages` / `append_pages`.

mod device;
mod gemm;
mod launch;
mod lt;
mod probes;
mod staging;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext, CudaGraph, CudaStream};
use specplan_format::{io, DType, LaunchKind, Plan, Replay, ValidatedPlan};

use crate::admission::{self, Admission};
use crate::bits::to_act_bytes;
use crate::cpu::WeightData;
pub use device::GpuError;
use device::{cuda, DevMem, Module};
use gemm::Gemms;
use launch::{capture, load_kernels, Launcher, Regions};
pub use lt::GemmChoice;
use staging::{StageRows, Staging};

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
    gemms: Gemms,
    pool_pages: u32,
    /// Time spent choosing GEMM algorithms at load, ms.
    pub gemm_tune_ms: f64,
    graphs: Vec<Option<CudaGraph>>,
    /// Graph build time per bucket, ms (capture + instantiate + upload).
    pub graph_build_ms: Vec<f64>,
    staging: Staging,
    /// Host mirror of how many pages each slot has (for O(b) bounds checks).
    slot_pages: Vec<u32>,
    /// Host mirror of the device page table (for the O(b·N) write-conflict check).
    table_host: Vec<i32>,
    admission: Admission,
    logged: HashSet<String>,
    last_batch: usize,
    /// Outputs of a batch run in chunks (above the largest bucket), and whether the last
    /// step was one.
    chunk_out: Option<DevMem>,
    chunked: bool,
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
        let gemms = Gemms::new(stream.cu_stream())?;
        let staging = Staging::new(&plan)?;
        let nb = plan.buckets.len();
        let rows = plan.page_table_rows() as usize;
        let max_rows = plan.buckets.last().map_or(1, |b| b.rows as usize);
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
            gemms,
            gemm_tune_ms: 0.0,
            pool_pages,
            graphs: (0..nb).map(|_| None).collect(),
            graph_build_ms: vec![0.0; nb],
            staging,
            slot_pages: vec![0; rows],
            table_host: Vec::new(),
            admission: Admission::new(rows, max_rows),
            logged: HashSet::new(),
            last_batch: 0,
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

    fn regions(&self) -> Regions {
        Regions {
            arena: self.arena.ptr,
            weights: self.weights.ptr,
            kv: self.kv.ptr,
            kv_pool_bytes: self.pool_pages as u64 * self.plan.kv_page_bytes(),
            table: self.table.ptr,
        }
    }

    fn launcher(&self) -> Launcher<'_> {
        Launcher {
            plan: &self.plan,
            regions: self.regions(),
            funcs: &self.funcs,
            gemms: &self.gemms,
            stream: self.stream.cu_stream(),
        }
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
                return Err(GpuError::Size {
                    what: format!("weight {}", w.name),
                    bytes: bytes.len(),
                    expected: w.bytes as usize,
                });
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
        self.table_host = vec![self.scratch_page(); n];
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
        admission::check_page_ids("page_table", slot, pages, self.scratch_page() as usize)?;
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

    /// Chooses a cuBLASLt algorithm for every GEMM shape of the plan by timing the
    /// candidates (see `lt.rs`). Runs at load, before any graph exists and before any step
    /// has put data in the arena (the timed calls overwrite their outputs).
    fn tune_gemms(&mut self) -> Result<(), GpuError> {
        let t0 = Instant::now();
        let regions = self.regions();
        let mut shapes = Vec::new();
        for b in &self.plan.buckets {
            for l in &b.launches {
                if let LaunchKind::Gemm(g) = &l.kind {
                    shapes.push(regions.gemm(&self.plan, b, g));
                }
            }
        }
        self.gemms.tune(&shapes, self.stream.cu_stream())?;
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        self.gemm_tune_ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// What GEMM tuning chose, per (m, n, k) of each bucket's GEMMs (benchmark reports).
    pub fn gemm_choices(&self) -> Vec<(u64, u64, u64, GemmChoice)> {
        let mut v: Vec<(u64, u64, u64, GemmChoice)> = Vec::new();
        let regions = self.regions();
        for b in &self.plan.buckets {
            for l in &b.launches {
                if let LaunchKind::Gemm(g) = &l.kind {
                    if let Some(c) = self.gemms.choice(&regions.gemm(&self.plan, b, g).0) {
                        if !v.iter().any(|x| (x.0, x.1, x.2) == (g.m, g.n, g.k)) {
                            v.push((g.m, g.n, g.k, c));
                        }
                    }
                }
            }
        }
        v
    }

    /// Captures every replayable bucket into a graph, largest first.
    pub fn build_graphs(&mut self) -> Result<(), GpuError> {
        for bi in (0..self.plan.buckets.len()).rev() {
            if self.plan.buckets[bi].replay != Replay::Graph {
                continue;
            }
            let t0 = Instant::now();
            let graph = capture(&self.stream, || self.launcher().issue(bi, &|_| true))?;
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

    /// Index of the smallest bucket that holds `b` requests.
    fn bucket_for(&self, b: usize) -> Option<usize> {
        self.plan.buckets.iter().position(|x| x.batch as usize >= b)
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
        if b <= max_b {
            self.chunked = false;
            return self.step_one(req, eager, t0);
        }
        self.log_once(format!(
            "batch {b} exceeds the largest bucket {max_b}: running in eager chunks"
        ));
        let n = self.plan.spec.num_draft_tokens as usize;
        let h = self.plan.model.hidden as usize;
        let act = self.plan.capture.dtype.size() as usize;
        let mut info = StepInfo {
            bucket: max_b as u32,
            graph: false,
            prep_us: 0.0,
        };
        for start in (0..b).step_by(max_b) {
            let end = (start + max_b).min(b);
            let hidden = match req.hidden {
                Hidden::Host(v) => Hidden::Host(&v[start * n * h..end * n * h]),
                Hidden::Device(p) => Hidden::Device(p + (start * n * h * act) as u64),
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
        Ok(info)
    }

    /// The admission rules (`crate::admission`) over a whole step.
    fn check(&mut self, req: &StepRequest) -> Result<(), GpuError> {
        let p = &self.plan;
        let (b, n, h) = (
            req.slots.len(),
            p.spec.num_draft_tokens as usize,
            p.model.hidden as usize,
        );
        admission::check_batch(b, None)?;
        admission::check_shape("input_ids", req.input_ids.len(), b * n, &format!("[{b}, {n}]"))?;
        admission::check_shape("prefix_lens", req.prefix_lens.len(), b, &format!("[{b}]"))?;
        admission::check_shape("accept_lens", req.accept_lens.len(), b, &format!("[{b}]"))?;
        if let Hidden::Host(v) = req.hidden {
            admission::check_shape("hidden_states", v.len(), b * n * h, &format!("[{b}, {n}, {h}]"))?;
        }
        admission::check_ids(req.input_ids, p.model.vocab, n)?;
        let (ps, cols) = (p.capture.page_size as usize, p.capture.max_pages_per_request as usize);
        self.admission.begin(b * n);
        for i in 0..b {
            let s = req.slots[i];
            self.admission.slot(i, s, p.capture.max_requests)?;
            admission::check_lengths(p, i, req.prefix_lens[i], req.accept_lens[i])?;
            let l = req.prefix_lens[i] as usize;
            let have = self.slot_pages[s as usize] as usize;
            // The slot's pages were checked against the pool when they were assigned.
            admission::check_row_len(i, l, n, ps, have)?;
            let row = &self.table_host[s as usize * cols..s as usize * cols + have];
            self.admission.writes(i, l, n, ps, row)?;
        }
        Ok(())
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
        let bk = self
            .bucket_for(b)
            .map(|i| &self.plan.buckets[i])
            .ok_or_else(|| GpuError::NoBucket {
                batch: b as u32,
                buckets: self.bucket_list(),
            })?;
        bk.buffer(name)
            .map(|(_, x)| self.arena.ptr + x.offset)
            .ok_or_else(|| GpuError::NoBuffer {
                batch: bk.batch,
                name: name.into(),
            })
    }

    fn bucket_list(&self) -> String {
        let v: Vec<String> = self.plan.buckets.iter().map(|b| b.batch.to_string()).collect();
        v.join(",")
    }

    /// One bucket's step on a request `step` has checked (the whole batch, for chunks);
    /// `t0` is when its host prep began.
    fn step_one(&mut self, req: &StepRequest, eager: bool, t0: Instant) -> Result<StepInfo, GpuError> {
        let b = req.slots.len();
        let bi = self.bucket_for(b).ok_or_else(|| GpuError::NoBucket {
            batch: b as u32,
            buckets: self.bucket_list(),
        })?;
        let n = self.plan.spec.num_draft_tokens as usize;
        let h = self.plan.model.hidden as usize;
        let act = self.plan.capture.dtype.size() as usize;
        let stream = self.stream.cu_stream();
        let rows = StageRows {
            slots: req.slots,
            input_ids: req.input_ids,
            prefix_lens: req.prefix_lens,
            accept_lens: req.accept_lens,
            hidden: match req.hidden {
                Hidden::Host(v) => Some(v),
                Hidden::Device(_) => None,
            },
        };
        self.staging.stage(&self.plan, bi, &rows, self.arena.ptr, stream)?;
        if let Hidden::Device(p) = req.hidden {
            let at = self.arena.ptr + self.staging.layout(bi).hidden as u64;
            // SAFETY: the caller's pointer holds b·N·H activations; the arena buffer holds
            // B·N·H ≥ that. Padded rows keep stale (finite) values.
            cuda("cuMemcpyDtoDAsync", unsafe {
                result::memcpy_dtod_async(at, p, b * n * h * act, stream)
            })?;
        }
        self.staging.fence(stream)?;
        let prep_us = t0.elapsed().as_secs_f64() * 1e6;
        let graph = !eager && self.graphs[bi].is_some();
        if let (true, Some(g)) = (graph, &self.graphs[bi]) {
            cuda("cuGraphLaunch", g.launch())?;
        } else {
            if !eager {
                if let Replay::Eager(reason) = &self.plan.buckets[bi].replay {
                    let msg = format!("bucket {} runs eagerly: {reason:?}", self.plan.buckets[bi].batch);
                    self.log_once(msg);
                }
            }
            self.launcher().issue(bi, &|_| true)?;
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
        let ptr = |name: &str| {
            self.output_ptr(name).ok_or_else(|| GpuError::NoBuffer {
                batch: b as u32,
                name: name.into(),
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

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}
