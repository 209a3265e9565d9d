//! Owned memory: the runtime allocates the weight region (uploaded from the host), a K/V
//! pool of the plan's pages (`[layer][K|V][page][slot][kv_head][dim]`) and its own page
//! table (`[max_requests + 1][pages_per_request]` page ids, the last row the scratch slot),
//! fills the table with `set_pages` / `append_pages`, and takes a step's inputs from the
//! host (`step`), checked by `crate::admission` and staged through pinned memory.

use std::time::Instant;

use cudarc::driver::{result, sys};
use specplan_format::PhaseKind;
use specplan_format::{io, DType, Replay, ValidatedPlan};
use specplan_kernels::kv::TableMode;

use super::device::{cuda, DevMem, GpuError};
use super::memory::{KvRegistration, Memory, TableRegistration};
use super::staging::{StageRows, Staging};
use super::{meta_block, GpuOptions, GpuRuntime, Mode};
use crate::admission::{self, Admission};
use crate::bits::to_act_bytes;
use crate::cpu::WeightData;

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
    /// Empty when the plan emits no top-K (`capture.outputs`).
    pub topk_probs: Vec<f32>,
    pub topk_ids: Vec<i64>,
    /// `[b, logits_cols]`; empty when the plan emits no logits.
    pub logits: Vec<f32>,
}

/// The plan's outputs with the bytes of one request's row, in signature order (what the
/// chunk block holds, one output after another).
fn output_rows(plan: &specplan_format::Plan) -> Vec<(&'static str, usize)> {
    specplan_format::signature::bucket_io(plan, 1)
        .into_iter()
        .filter(|t| t.role == specplan_format::BufferRole::Output)
        .map(|t| (t.name, (t.shape.iter().product::<u64>() * t.dtype.size()) as usize))
        .collect()
}

pub(crate) struct OwnedState {
    pub pool_pages: u32,
    /// Host prep's staging: eager steps' copies and events, graph steps' host-mapped block.
    staging: Staging,
    /// Host mirror of how many pages each slot has (for O(b) bounds checks).
    slot_pages: Vec<u32>,
    /// Host mirror of the device page table (for the O(b·N) write-conflict check).
    table_host: Vec<i32>,
    /// Per pool page, the (slot, column) entries of the rows that list it, kept at
    /// assignment, so the aliasing rule costs a step O(b·N · sharers), never a row scan.
    page_rows: Vec<Vec<(u32, u32)>>,
    /// Per slot, `(stamp, request, prefix)` when the slot steps in the check's step.
    step_slot: Vec<(u32, u32, u32)>,
    step_stamp: u32,
    admission: Admission,
    pub last_batch: usize,
    /// Outputs of a batch run in chunks (above the largest bucket), and whether the last
    /// step was one.
    chunk_out: Option<DevMem>,
    chunked: bool,
}

impl OwnedState {
    pub(crate) fn staging(&self) -> &Staging {
        &self.staging
    }
    pub(crate) fn staging_mut(&mut self) -> &mut Staging {
        &mut self.staging
    }
}

impl GpuRuntime {
    /// Loads a plan and its weights onto the device in owned memory and builds every
    /// bucket's graph.
    pub fn new(plan: ValidatedPlan, weights: &[WeightData], opts: GpuOptions) -> Result<GpuRuntime, GpuError> {
        let t0 = Instant::now();
        let core = Self::core(&plan, &opts)?;
        let pool_pages = opts.kv_pool_pages.unwrap_or(plan.capture.kv_pool_pages).max(2);
        let page_bytes = plan.kv_page_bytes();
        let layers = plan.model.layers as u64;
        let kv = DevMem::new((2 * layers * pool_pages as u64 * page_bytes) as usize)?;
        let pool_bytes = pool_pages as u64 * page_bytes;
        let rows = plan.page_table_rows();
        let cols = plan.capture.max_pages_per_request as u64;
        let table = DevMem::new((rows * cols * 4) as usize)?;
        let wmem = DevMem::new(plan.weight_bytes as usize)?;
        let mem = Memory {
            arena: DevMem::new(plan.arena_bytes() as usize)?,
            weights: plan.weights.iter().map(|w| wmem.ptr + w.offset).collect(),
            kv: KvRegistration::dense(
                (0..layers).map(|l| kv.ptr + 2 * l * pool_bytes).collect(),
                (0..layers).map(|l| kv.ptr + (2 * l + 1) * pool_bytes).collect(),
                pool_pages as u64 * plan.capture.page_size as u64,
                plan.model.kv_heads as u64 * plan.model.head_dim as u64,
                plan.model.head_dim as u64,
            ),
            table: TableRegistration {
                ptr: table.ptr,
                mode: TableMode::PageIds,
                rows,
                cols,
                stride: cols,
                page_size: plan.capture.page_size as u64,
            },
            meta: meta_block()?,
            mirror: super::device::Mapped::new(
                specplan_kernels::kv::MIRROR_WORDS * specplan_kernels::kv::MIRROR_SLOTS,
            )?,
            _owned: Vec::new(),
        };
        let max_rows = plan.buckets().last().map_or(1, |b| b.rows as usize);
        let state = OwnedState {
            pool_pages,
            staging: Staging::new(&plan)?,
            slot_pages: vec![0; rows as usize],
            table_host: Vec::new(),
            page_rows: vec![Vec::new(); pool_pages as usize],
            step_slot: vec![(0, 0, 0); rows as usize],
            step_stamp: 0,
            admission: Admission::new(rows as usize, max_rows),
            last_batch: 0,
            chunk_out: None,
            chunked: false,
        };
        upload_weights(&plan, wmem.ptr, weights)?;
        let mut mem = mem;
        mem._owned = vec![kv, table, wmem];
        let mut rt = Self::finish(plan, core, mem, Mode::Owned(state), &opts, t0)?;
        rt.reset_page_table()?;
        // Zero the pool once so padded rows never read uninitialized pages.
        let (ptr, bytes) = (rt.mem._owned[0].ptr, rt.mem._owned[0].bytes);
        // SAFETY: the pool allocation, `bytes` long.
        cuda("cuMemsetD8", unsafe {
            result::memset_d8_async(ptr, 0, bytes, rt.stream.cu_stream())
        })?;
        cuda("cuStreamSynchronize", rt.stream.synchronize())?;
        Ok(rt)
    }

    pub(crate) fn owned(&self) -> Result<&OwnedState, GpuError> {
        match &self.mode {
            Mode::Owned(s) => Ok(s),
            Mode::Engine(_) => Err(GpuError::Mode("an owned-memory operation")),
        }
    }

    fn owned_mut(&mut self) -> Result<&mut OwnedState, GpuError> {
        match &mut self.mode {
            Mode::Owned(s) => Ok(s),
            Mode::Engine(_) => Err(GpuError::Mode("an owned-memory operation")),
        }
    }

    /// Pool pages of owned memory (the scratch page included); 0 in engine memory.
    pub fn pool_pages(&self) -> u32 {
        self.owned().map_or(0, |s| s.pool_pages)
    }

    pub fn scratch_page(&self) -> i32 {
        self.pool_pages() as i32 - 1
    }

    /// Bytes of the owned K/V pool (0 in engine memory).
    pub fn kv_bytes(&self) -> usize {
        match &self.mode {
            Mode::Owned(_) => self.mem._owned.first().map_or(0, |m| m.bytes),
            Mode::Engine(_) => 0,
        }
    }

    /// Every slot row points at the scratch page until `set_pages` assigns it.
    fn reset_page_table(&mut self) -> Result<(), GpuError> {
        let n = (self.mem.table.rows * self.mem.table.cols) as usize;
        let scratch = self.scratch_page();
        let (table, stream) = (self.mem.table.ptr, self.stream.cu_stream());
        let s = self.owned_mut()?;
        s.table_host = vec![scratch; n];
        s.slot_pages.iter_mut().for_each(|p| *p = 0);
        s.page_rows.iter_mut().for_each(Vec::clear);
        // SAFETY: exactly the table's size. On the runtime's stream, as `append_pages`'s
        // copies: a synchronous copy from pageable memory may return before its DMA lands,
        // unordered with the (non-blocking) stream's first step.
        cuda("cuMemcpyHtoDAsync", unsafe {
            result::memcpy_htod_async(table, &s.table_host, stream)
        })
    }

    /// Sets a request slot's pages from column 0 (a new request). Not on the replay path.
    pub fn set_pages(&mut self, slot: usize, pages: &[i32]) -> Result<(), GpuError> {
        let cols = self.plan.capture.max_pages_per_request as usize;
        let s = self.owned_mut()?;
        if let Some(&have) = s.slot_pages.get(slot) {
            // The old row's pages are released first (the new row may list them again).
            for &pg in &s.table_host[slot * cols..slot * cols + have as usize] {
                if let Some(r) = s.page_rows.get_mut(pg as usize) {
                    r.retain(|&(sl, _)| sl as usize != slot);
                }
            }
            s.slot_pages[slot] = 0;
        }
        self.append_pages(slot, pages)
    }

    /// Appends pages to a slot's row (a growing request): copies only the new entries.
    pub fn append_pages(&mut self, slot: usize, pages: &[i32]) -> Result<(), GpuError> {
        let cols = self.plan.capture.max_pages_per_request as usize;
        let max_req = self.plan.capture.max_requests as usize;
        let scratch = self.scratch_page() as usize;
        let (table, stream) = (self.mem.table.ptr, self.stream.cu_stream());
        let bad = |msg: String| GpuError::Input(crate::step::input_error(io::PAGE_TABLE, format!("[{slot}]"), msg));
        if slot >= max_req {
            return Err(bad(format!("slot {slot} is outside [0, {max_req})")));
        }
        let s = self.owned_mut()?;
        let have = s.slot_pages[slot] as usize;
        if have + pages.len() > cols {
            return Err(bad(format!(
                "{} pages exceed the {cols} columns of a row",
                have + pages.len()
            )));
        }
        admission::check_page_ids(io::PAGE_TABLE, slot, pages, scratch)?;
        if pages.is_empty() {
            return Ok(());
        }
        // The aliasing rule's own half: a row names each page once (two positions on one
        // page slot would read what the other writes). O(row), at assignment.
        let row = &s.table_host[slot * cols..slot * cols + have];
        for (c, &pg) in pages.iter().enumerate() {
            if row.contains(&pg) || pages[..c].contains(&pg) {
                return Err(bad(format!(
                    "page {pg} is listed twice in the row (a row may not name one cache slot twice)"
                )));
            }
        }
        for (c, &pg) in pages.iter().enumerate() {
            s.page_rows[pg as usize].push((slot as u32, (have + c) as u32));
        }
        let first = slot * cols + have;
        s.table_host[first..first + pages.len()].copy_from_slice(pages);
        let at = table + (first * 4) as u64;
        // SAFETY: [at, at + 4·len) lies inside row `slot` (checked above). The source is
        // pageable host memory, which the driver stages before the call returns, so no
        // synchronization is needed; the copy is stream-ordered after earlier replays, so
        // a running step never sees a half-updated row.
        cuda("cuMemcpyHtoDAsync", unsafe {
            result::memcpy_htod_async(at, &s.table_host[first..first + pages.len()], stream)
        })?;
        s.slot_pages[slot] += pages.len() as u32;
        Ok(())
    }

    /// One draft-extend step on host inputs. Batches above the largest bucket run as
    /// several eager chunks.
    pub fn step(&mut self, req: &StepRequest, eager: bool) -> Result<StepInfo, GpuError> {
        let t0 = Instant::now(); // host prep is timed from here: the checks are part of it
        let b = req.slots.len();
        let max_b = self.plan.buckets().last().map_or(0, |x| x.batch as usize);
        // Every step is checked whole before anything is staged or launched. For a batch
        // above the largest bucket this also means a bad request in a later chunk cannot
        // leave the earlier chunks' K/V written, and two requests in different chunks
        // cannot write one cache slot.
        self.check(req)?;
        if b <= max_b {
            self.owned_mut()?.chunked = false;
            return self.step_one(req, eager, t0);
        }
        self.log_once(format!(
            "batch {b} exceeds the largest bucket {max_b}: running in eager chunks"
        ));
        // Input rows are hidden_in wide (3·H_t for an EAGLE-3 head).
        let (n, h) = (
            self.plan.rows_per_request(PhaseKind::DraftExtend) as usize,
            self.plan.model.hidden_in() as usize,
        );
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
            info.prep_us += self.step_one(&chunk, true, from)?.prep_us;
            self.gather_chunk_outputs(start, end, b)?;
        }
        let s = self.owned_mut()?;
        s.last_batch = b;
        s.chunked = true;
        Ok(info)
    }

    /// The admission rules (`crate::admission`) over a whole step.
    fn check(&mut self, req: &StepRequest) -> Result<(), GpuError> {
        let p = &self.plan;
        let (b, n) = (req.slots.len(), p.rows_per_request(PhaseKind::DraftExtend) as usize);
        admission::check_batch(b, None)?;
        admission::check_staged(p, PhaseKind::DraftExtend, io::INPUT_IDS, req.input_ids.len(), b)?;
        admission::check_staged(p, PhaseKind::DraftExtend, io::PREFIX_LENS, req.prefix_lens.len(), b)?;
        admission::check_staged(p, PhaseKind::DraftExtend, io::ACCEPT_LENS, req.accept_lens.len(), b)?;
        if let Hidden::Host(v) = req.hidden {
            admission::check_staged(p, PhaseKind::DraftExtend, io::HIDDEN_STATES, v.len(), b)?;
        }
        admission::check_ids(req.input_ids, p.model.vocab, n)?;
        let (ps, cols) = (p.capture.page_size as usize, p.capture.max_pages_per_request as usize);
        let max_requests = p.capture.max_requests;
        let Mode::Owned(s) = &mut self.mode else {
            return Err(GpuError::Mode("step with host inputs"));
        };
        s.admission.begin(b * n);
        for i in 0..b {
            let slot = req.slots[i];
            s.admission.slot(i, slot, max_requests)?;
            admission::check_lengths(p, i, req.prefix_lens[i], req.accept_lens[i])?;
            let l = req.prefix_lens[i] as usize;
            let have = s.slot_pages[slot as usize] as usize;
            // The slot's pages were checked against the pool when they were assigned.
            admission::check_row_len(i, l, n, ps, have)?;
            let row = &s.table_host[slot as usize * cols..slot as usize * cols + have];
            // Rule 7 can fail only on a page another row also lists (a row names a page once,
            // refused at assignment): the others stay out of the write set. Exact, and at
            // B 64 N 16 it took the check from 6.75 to 4.09 µs on the development host
            // (docs/perf-notes.md item 40).
            let page_rows = &s.page_rows;
            s.admission.writes(i, (l, n, ps), row, |pg| {
                page_rows.get(pg as usize).is_none_or(|r| r.len() > 1)
            })?;
        }
        // The aliasing rule (crate::aliasing): no request of the step reads a slot another
        // writes. Rows naming a page twice were refused at assignment, so only other
        // stepping slots whose rows list a written page can read it.
        s.step_stamp = s.step_stamp.wrapping_add(1);
        if s.step_stamp == 0 {
            s.step_slot.iter_mut().for_each(|e| *e = (0, 0, 0));
            s.step_stamp = 1;
        }
        let stamp = s.step_stamp;
        for i in 0..b {
            s.step_slot[req.slots[i] as usize] = (stamp, i as u32, req.prefix_lens[i] as u32);
        }
        for i in 0..b {
            let slot = req.slots[i] as usize;
            let l = req.prefix_lens[i] as usize;
            let row = &s.table_host[slot * cols..slot * cols + s.slot_pages[slot] as usize];
            for (pi, &pg) in row.iter().enumerate().take((l + n).div_ceil(ps)).skip(l / ps) {
                let sharers = &s.page_rows[pg as usize];
                if sharers.len() <= 1 {
                    continue; // only this row lists the page: no other request reads it
                }
                // Offsets [lo, hi) of the page this request writes.
                let lo = l.max(pi * ps) - pi * ps;
                for &(other, col) in sharers {
                    let (st, j, lj) = s.step_slot[other as usize];
                    if other as usize == slot || st != stamp {
                        continue;
                    }
                    // The other request reads offsets [0, reads) of its entry `col`.
                    let reads = (lj as usize + n).saturating_sub(col as usize * ps).min(ps);
                    if lo < reads {
                        return Err(GpuError::Input(crate::step::input_error(
                            io::PAGE_TABLE,
                            format!("[{j}][{col}]"),
                            format!(
                                "request {j} reads page {pg} slot {lo}, which request {i} writes in this step (their K/V would race; a page two requests share is read-only while both run)"
                            ),
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Chunks share the arena, so each chunk's outputs move (device to device, stream
    /// ordered) into a runtime-owned block holding the whole batch's outputs.
    fn gather_chunk_outputs(&mut self, start: usize, end: usize, total: usize) -> Result<(), GpuError> {
        let rows = output_rows(&self.plan);
        let need: usize = rows.iter().map(|(_, p)| p * total).sum();
        let srcs: Vec<_> = rows
            .iter()
            .map(|(name, _)| self.bucket_output_ptr(name, end - start))
            .collect();
        let stream = self.stream.cu_stream();
        let s = self.owned_mut()?;
        if s.chunk_out.as_ref().is_none_or(|m| m.bytes < need) {
            // SAFETY: the runtime's stream; waiting here is off the replay path (batches
            // above the largest bucket run eagerly anyway).
            cuda("cuStreamSynchronize", unsafe { result::stream::synchronize(stream) })?;
            s.chunk_out = Some(DevMem::new(need)?);
        }
        let Some(dst) = s.chunk_out.as_ref().map(|m| m.ptr) else {
            return Ok(());
        };
        let mut base = 0u64;
        for (src, (_, row)) in srcs.into_iter().zip(rows) {
            let src = src?;
            // SAFETY: source rows [0, end - start) exist in the chunk's bucket; destination
            // rows [start, end) lie inside a block sized for `total` rows.
            cuda("cuMemcpyDtoDAsync", unsafe {
                result::memcpy_dtod_async(dst + base + (start * row) as u64, src, (end - start) * row, stream)
            })?;
            base += (total * row) as u64;
        }
        Ok(())
    }

    pub(crate) fn bucket_output_ptr(&self, name: &str, b: usize) -> Result<u64, GpuError> {
        let bk = self
            .bucket_for(b)
            .map(|i| &self.plan.buckets()[i])
            .ok_or_else(|| self.no_bucket(b))?;
        bk.buffer(name)
            .map(|(_, x)| self.mem.arena.ptr + x.offset)
            .ok_or_else(|| GpuError::NoBuffer {
                batch: bk.batch,
                name: name.into(),
            })
    }

    /// One bucket's step on a request `step` has checked (the whole batch, for chunks);
    /// `t0` is when its host prep began.
    fn step_one(&mut self, req: &StepRequest, eager: bool, t0: Instant) -> Result<StepInfo, GpuError> {
        let b = req.slots.len();
        let bi = self.bucket_for(b).ok_or_else(|| self.no_bucket(b))?;
        let (n, h) = (
            self.plan.rows_per_request(PhaseKind::DraftExtend) as usize,
            self.plan.model.hidden_in() as usize,
        );
        let act = self.plan.capture.dtype.size() as usize;
        let (stream, arena) = (self.stream.cu_stream(), self.mem.arena.ptr);
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
        if !eager && self.stages_in_graph(bi) {
            return self.step_staged(req, (bi, &rows), t0);
        }
        let Mode::Owned(s) = &mut self.mode else {
            return Err(GpuError::Mode("step with host inputs"));
        };
        s.staging.stage(&self.plan, bi, &rows, arena, stream)?;
        if let Hidden::Device(p) = req.hidden {
            let at = arena + s.staging.layout(bi).hidden as u64;
            // SAFETY: the caller's pointer holds b·N·H activations; the arena buffer holds
            // B·N·H ≥ that. Padded rows keep stale (finite) values.
            cuda("cuMemcpyDtoDAsync", unsafe {
                result::memcpy_dtod_async(at, p, b * n * h * act, stream)
            })?;
        }
        s.staging.fence(stream)?;
        s.last_batch = b;
        let prep_us = t0.elapsed().as_secs_f64() * 1e6;
        let graph = !eager && self.graphs[bi].is_some();
        if let (true, Some(g)) = (graph, &self.graphs[bi]) {
            g.graph.launch()?;
        } else {
            if !eager {
                if let Replay::Eager(reason) = &self.plan.buckets()[bi].replay {
                    let msg = format!("bucket {} runs eagerly: {reason:?}", self.plan.buckets()[bi].batch);
                    self.log_once(msg);
                }
            }
            self.launcher(stream).issue(bi, &|_| true)?;
        }
        Ok(StepInfo {
            bucket: self.plan.buckets()[bi].batch,
            graph,
            prep_us,
        })
    }

    /// Device address of an output buffer of the last owned-memory step's bucket (stays
    /// valid until the next step).
    pub fn output_ptr(&self, name: &str) -> Option<u64> {
        let s = self.owned().ok()?;
        if s.chunked {
            let mut at = s.chunk_out.as_ref()?.ptr;
            for (out, row) in output_rows(&self.plan) {
                if out == name {
                    return Some(at);
                }
                at += (s.last_batch * row) as u64;
            }
            return None;
        }
        self.bucket_output_ptr(name, s.last_batch).ok()
    }

    /// Copies the last owned-memory step's outputs to the host (synchronizes; not on the
    /// replay path).
    pub fn read_outputs(&self) -> Result<HostOutputs, GpuError> {
        let b = self.owned()?.last_batch;
        let (h, k) = (self.plan.model.hidden as usize, self.plan.spec.topk as usize);
        let outs = self.plan.capture.outputs;
        let (kk, lc) = (
            if outs.topk { k } else { 0 },
            if outs.logits {
                specplan_format::signature::logits_cols(&self.plan) as usize
            } else {
                0
            },
        );
        let mut out = HostOutputs {
            hidden_out: vec![0; b * h],
            topk_probs: vec![0.0; b * kk],
            topk_ids: vec![0; b * kk],
            logits: vec![0.0; b * lc],
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
            if outs.topk {
                cuda(
                    "cuMemcpyDtoH",
                    result::memcpy_dtoh_sync(&mut out.topk_probs, ptr(io::TOPK_PROBS)?),
                )?;
                cuda(
                    "cuMemcpyDtoH",
                    result::memcpy_dtoh_sync(&mut out.topk_ids, ptr(io::TOPK_IDS)?),
                )?;
            }
            if outs.logits {
                cuda(
                    "cuMemcpyDtoH",
                    result::memcpy_dtoh_sync(&mut out.logits, ptr(io::LOGITS)?),
                )?;
            }
        }
        Ok(out)
    }
}

/// Uploads host weights into the weight region at `base` (offsets from the plan).
fn upload_weights(plan: &ValidatedPlan, base: u64, weights: &[WeightData]) -> Result<(), GpuError> {
    if weights.len() != plan.weights.len() {
        return Err(GpuError::Weights(format!(
            "{} weights, the plan has {}",
            weights.len(),
            plan.weights.len()
        )));
    }
    let act = plan.capture.dtype;
    for (w, d) in plan.weights.iter().zip(weights) {
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
        // SAFETY: destination range [offset, offset + bytes) is inside the weight region
        // (validated plan); the copy is synchronous on the source.
        cuda("cuMemcpyHtoD", unsafe {
            result::memcpy_htod_sync(base + w.offset, &bytes)
        })?;
    }
    Ok(())
}
