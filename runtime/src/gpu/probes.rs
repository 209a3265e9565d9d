//! Hooks for tests and benchmarks, never on the replay path: the cache and arena buffers
//! read and written from the host, poisoning, replays without host prep, and graphs of a
//! subset of a bucket's launches. Most synchronize.

use cudarc::driver::result;

use super::device::{cuda, GpuError};
use super::graph::{self, Exec};
use super::launch::gemm_call;
use super::lt::{GemmChoice, GemmFlip, GemmShape};
use super::{GpuRuntime, Mode};
use specplan_format::{LaunchKind, PhaseKind};

impl GpuRuntime {
    /// Owned memory: uploads K/V pages `[0, pages)` (layer-major, raw act bits).
    pub fn write_kv(&mut self, k: &[u16], v: &[u16], pages: usize) -> Result<(), GpuError> {
        let pool_pages = self.owned()?.pool_pages as usize;
        let layers = self.plan.model.layers as usize;
        let per = pages * self.plan.kv_page_bytes() as usize / 2;
        if pages >= pool_pages {
            return Err(GpuError::Pool(format!(
                "{pages} cache pages do not fit a pool of {} (+1 scratch)",
                pool_pages - 1
            )));
        }
        for (name, src) in [("k", k), ("v", v)] {
            if src.len() != layers * per {
                return Err(GpuError::Size {
                    what: format!("{name}_cache"),
                    bytes: src.len() * 2,
                    expected: layers * per * 2,
                });
            }
        }
        for layer in 0..layers {
            for (which, src) in [k, v].into_iter().enumerate() {
                let dst = self.pool_base(layer, which);
                // SAFETY: `per` elements from the start of this layer's pool, which holds
                // `pool_pages > pages` pages; the source outlives the copy (the stream is
                // synchronized below).
                cuda("cuMemcpyHtoDAsync", unsafe {
                    result::memcpy_htod_async(dst, &src[layer * per..(layer + 1) * per], self.stream.cu_stream())
                })?;
            }
        }
        // On the runtime's stream, then waited for: a synchronous copy from pageable memory
        // may return before its DMA lands, unordered with the (non-blocking) stream's work.
        cuda("cuStreamSynchronize", self.stream.synchronize())
    }

    fn pool_base(&self, layer: usize, which: usize) -> u64 {
        let pools = if which == 0 { &self.mem.kv.k } else { &self.mem.kv.v };
        pools.get(layer).copied().unwrap_or(0)
    }

    /// Owned memory: reads K/V pages `[0, pages)` back (layer-major, raw act bits).
    /// Synchronizes.
    pub fn read_kv(&self, pages: usize) -> Result<(Vec<u16>, Vec<u16>), GpuError> {
        let pool_pages = self.owned()?.pool_pages as usize;
        if pages > pool_pages {
            return Err(GpuError::Pool(format!("{pages} pages exceed the pool of {pool_pages}")));
        }
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        let per = pages * self.plan.kv_page_bytes() as usize / 2;
        let layers = self.plan.model.layers as usize;
        let mut k = vec![0u16; layers * per];
        let mut v = vec![0u16; layers * per];
        for layer in 0..layers {
            for (which, dst) in [(0, &mut k), (1, &mut v)] {
                let src = self.pool_base(layer, which);
                // SAFETY: `per` elements from the start of this layer's pool.
                cuda("cuMemcpyDtoH", unsafe {
                    result::memcpy_dtoh_sync(&mut dst[layer * per..(layer + 1) * per], src)
                })?;
            }
        }
        Ok((k, v))
    }

    /// Owned memory: reads the scratch page of every layer (to check what padding wrote).
    /// Synchronizes.
    pub fn read_scratch_page(&self) -> Result<Vec<u16>, GpuError> {
        self.owned()?;
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        let page = self.plan.kv_page_bytes();
        let per = page as usize / 2;
        let mut out = vec![0u16; self.plan.model.layers as usize * 2 * per];
        for (i, chunk) in out.chunks_mut(per).enumerate() {
            let src = self.pool_base(i / 2, i % 2) + self.scratch_page() as u64 * page;
            // SAFETY: one page inside pool `i`.
            cuda("cuMemcpyDtoH", unsafe { result::memcpy_dtoh_sync(chunk, src) })?;
        }
        Ok(out)
    }

    /// The arrival counters (`kv::COUNTER_WORDS`) that are not zero: every launch must leave
    /// them zero (a nonzero word would make the next launch's merge early). Synchronizes the
    /// context (engine-memory steps run on the caller's stream).
    pub fn counters_left(&self) -> Result<usize, GpuError> {
        cuda("cuCtxSynchronize", self.ctx.synchronize())?;
        let mut words = vec![0u32; specplan_kernels::kv::COUNTER_WORDS];
        // SAFETY: the counter words after the layout and status words of `meta`
        // (`meta_block` sizes it for them).
        cuda("cuMemcpyDtoH", unsafe {
            result::memcpy_dtoh_sync(&mut words[..], self.mem.counters_ptr())
        })?;
        Ok(words.iter().filter(|&&w| w != 0).count())
    }

    /// Fills the arena with 0xFF bytes (NaN in every float type), so a check sees any
    /// output a step failed to write.
    pub fn poison(&self) -> Result<(), GpuError> {
        // SAFETY: the whole arena allocation.
        cuda("cuMemsetD8", unsafe {
            result::memset_d8_async(self.mem.arena.ptr, 0xff, self.mem.arena.bytes, self.stream.cu_stream())
        })
    }

    /// Blocks until the stream is idle.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        cuda("cuStreamSynchronize", self.stream.synchronize())
    }

    /// Index of the draft-extend bucket of exactly `batch` requests.
    pub(super) fn bucket_index(&self, batch: u32) -> Result<usize, GpuError> {
        self.phase_bucket(PhaseKind::DraftExtend, batch)
    }

    /// Flat index (`Plan::flat_bucket`) of phase `kind`'s bucket of exactly `batch` requests.
    fn phase_bucket(&self, kind: PhaseKind, batch: u32) -> Result<usize, GpuError> {
        self.plan
            .flat_index(kind, batch)
            .ok_or_else(|| self.no_bucket(batch as usize))
    }

    /// Owned memory: runs phase `kind`'s bucket of exactly `batch` requests on the inputs
    /// already in its buffers (`write_phase_buffer`) — its graph, or its launches eagerly.
    /// For checks of phases the step API does not serve yet (draft decode).
    pub fn run_phase(&self, kind: PhaseKind, batch: u32, eager: bool) -> Result<(), GpuError> {
        if matches!(self.mode, Mode::Engine(_)) && kind != PhaseKind::DraftExtend {
            return Err(GpuError::Step(format!(
                "{} runs on owned memory only (engine memory serves draft_extend)",
                kind.label()
            )));
        }
        let bi = self.phase_bucket(kind, batch)?;
        match (eager, &self.graphs[bi]) {
            (false, Some(g)) => {
                self.quiet_stage(kind, bi)?;
                g.graph.launch()
            }
            (false, None) => Err(GpuError::Step(format!("{} bucket {batch} has no graph", kind.label()))),
            (true, _) => self.launcher(self.stream.cu_stream()).issue(bi, &|_| true),
        }
    }

    /// Replays a bucket's graph on the runtime's stream with the inputs already in place (no
    /// host prep; in engine memory the parameters of the bucket's last step, so a step must
    /// have run in it), or issues the plan launches whose op name contains `filter` eagerly.
    pub fn replay_only(&self, batch: u32, filter: Option<&str>) -> Result<(), GpuError> {
        let bi = self.bucket_index(batch)?;
        let stream = self.stream.cu_stream();
        if let (Mode::Engine(e), None) = (&self.mode, filter) {
            if !e.armed(bi) {
                return Err(GpuError::Step(format!("bucket {batch} has not run a step yet")));
            }
        }
        match (filter, &self.graphs[bi]) {
            (None, Some(g)) => {
                self.quiet_stage(PhaseKind::DraftExtend, bi)?;
                g.graph.launch()
            }
            (None, None) => self.launcher(stream).issue(bi, &|_| true),
            (Some(f), _) => self.launcher(stream).issue(bi, &|op| op.contains(f)),
        }
    }

    /// The address and size of a named arena buffer of the bucket `batch` (exact bucket
    /// size). The arena is shared by every bucket and packed by liveness, so after a step
    /// a buffer holds its value only until a later op reuses it.
    pub fn buffer_ptr(&self, batch: u32, name: &str) -> Option<(u64, usize)> {
        self.phase_buffer_ptr(PhaseKind::DraftExtend, batch, name)
    }

    /// [`GpuRuntime::buffer_ptr`] in phase `kind`'s bucket.
    pub fn phase_buffer_ptr(&self, kind: PhaseKind, batch: u32, name: &str) -> Option<(u64, usize)> {
        let bk = self.plan.flat_bucket(self.plan.flat_index(kind, batch)?)?;
        let (_, x) = bk.buffer(name)?;
        Some((self.mem.arena.ptr + x.offset, x.bytes as usize))
    }

    fn named_buffer(&self, kind: PhaseKind, batch: u32, name: &str) -> Result<(u64, usize), GpuError> {
        self.phase_buffer_ptr(kind, batch, name)
            .ok_or_else(|| GpuError::NoBuffer {
                batch,
                name: name.into(),
            })
    }

    /// Overwrites a named arena buffer of bucket `batch` (synchronously).
    pub fn write_buffer(&self, batch: u32, name: &str, bytes: &[u8]) -> Result<(), GpuError> {
        self.write_phase_buffer(PhaseKind::DraftExtend, batch, name, bytes)
    }

    /// Copies a named arena buffer of bucket `batch` to the host (synchronizes).
    pub fn read_buffer(&self, batch: u32, name: &str) -> Result<Vec<u8>, GpuError> {
        self.read_phase_buffer(PhaseKind::DraftExtend, batch, name)
    }

    /// [`GpuRuntime::write_buffer`] in phase `kind`'s bucket.
    pub fn write_phase_buffer(&self, kind: PhaseKind, batch: u32, name: &str, bytes: &[u8]) -> Result<(), GpuError> {
        let (ptr, len) = self.named_buffer(kind, batch, name)?;
        if bytes.len() != len {
            return Err(GpuError::Size {
                what: format!("buffer {name}"),
                bytes: bytes.len(),
                expected: len,
            });
        }
        // SAFETY: the destination range lies inside the arena allocation (the plan was
        // validated against the arena size) and its length equals the source's; the copy is
        // ordered after the stream's work, and the source outlives it (synchronized below).
        unsafe {
            cuda(
                "cuMemcpyHtoDAsync",
                result::memcpy_htod_async(ptr, bytes, self.stream.cu_stream()),
            )?
        };
        cuda("cuStreamSynchronize", self.stream.synchronize())
    }

    /// [`GpuRuntime::read_buffer`] in phase `kind`'s bucket.
    pub fn read_phase_buffer(&self, kind: PhaseKind, batch: u32, name: &str) -> Result<Vec<u8>, GpuError> {
        let (ptr, len) = self.named_buffer(kind, batch, name)?;
        let mut out = vec![0u8; len];
        cuda("cuStreamSynchronize", self.stream.synchronize())?;
        // SAFETY: the source range lies inside the arena allocation; the destination has
        // exactly `len` bytes; the stream is synchronized.
        unsafe { cuda("cuMemcpyDtoH", result::memcpy_dtoh_sync(&mut out, ptr))? };
        Ok(out)
    }

    /// Captures the launches of bucket `batch` whose op name contains `filter` as a graph
    /// of their own (e.g. the attention launches, timed without the host launch overhead
    /// that dominates eager issue of microsecond kernels).
    pub fn capture_where(&self, batch: u32, filter: &str) -> Result<Exec, GpuError> {
        let bi = self.bucket_index(batch)?;
        let stream = self.stream.cu_stream();
        graph::capture(&self.stream, self.fill_func(), || {
            self.launcher(stream).issue(bi, &|op| op.contains(filter))
        })
    }

    /// Switches the GEMMs of dims (m, n, k) in draft-extend bucket `batch` between the
    /// skinny kernel and their cuBLASLt algorithm, for the launches issued and graphs captured
    /// from now on (the graphs built at load keep their choice; [`GpuRuntime::capture_where`]
    /// sees the switch; a shape other buckets share switches there too). specbench's
    /// `--gemm-flip` asks with it whether the load-time choice, timed one GEMM at a time,
    /// also wins inside the bucket's launches; called twice it restores the choice. All of
    /// the bucket's shapes of these dims switch, or none (the first refusal is returned).
    pub fn flip_gemm(&mut self, batch: u32, m: u64, n: u64, k: u64) -> Result<GemmFlip, GpuError> {
        let shapes = self.bucket_gemms(batch, m, n, k)?;
        let mut done = Vec::new();
        for s in &shapes {
            match self.gemms.flip_skinny(s) {
                GemmFlip::Switched { .. } => done.push(*s),
                refused => {
                    for d in &done {
                        self.gemms.flip_skinny(d);
                    }
                    return Ok(refused);
                }
            }
        }
        Ok(shapes.first().map_or(GemmFlip::NoGemm, |s| GemmFlip::Switched {
            to_skinny: self.gemms.choice(s).is_some_and(|c| c.ours),
        }))
    }

    /// The current choice of the first GEMM of dims (m, n, k) in draft-extend bucket `batch`.
    pub fn gemm_choice(&self, batch: u32, m: u64, n: u64, k: u64) -> Result<Option<GemmChoice>, GpuError> {
        Ok(self
            .bucket_gemms(batch, m, n, k)?
            .first()
            .and_then(|s| self.gemms.choice(s)))
    }

    /// The distinct GEMM shapes of dims (m, n, k) in draft-extend bucket `batch`.
    fn bucket_gemms(&self, batch: u32, m: u64, n: u64, k: u64) -> Result<Vec<GemmShape>, GpuError> {
        let bi = self.bucket_index(batch)?;
        let b = self
            .plan
            .flat_bucket(bi)
            .ok_or_else(|| self.no_bucket(batch as usize))?;
        let mut shapes = Vec::new();
        for l in &b.launches {
            if let LaunchKind::Gemm(g) = &l.kind {
                let shape = gemm_call(&self.mem, &self.plan, b, g).0;
                if (g.m, g.n, g.k) == (m, n, k) && !shapes.contains(&shape) {
                    shapes.push(shape);
                }
            }
        }
        Ok(shapes)
    }

    /// Whether a bucket has a built graph.
    pub fn has_graph(&self, batch: u32) -> bool {
        self.bucket_index(batch).is_ok_and(|i| self.graphs[i].is_some())
    }
}

/// What a bucket's captured graph holds: node counts by type (for benchmarks: the driver's
/// launch time grows with the nodes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphNodes {
    /// Kernel nodes, `fills` included.
    pub kernels: usize,
    /// Kernel nodes that replaced a GEMM library's memset (`graph.rs`).
    pub fills: usize,
    /// Kernel nodes of `l2_prefetch`: the graph's L2 branches (`prefetch.rs`).
    pub l2_branches: usize,
    /// Of those, the ones no node depends on (every branch should be one).
    pub l2_leaves: usize,
    pub memsets: usize,
    pub memcpys: usize,
    pub events: usize,
    pub other: usize,
}

impl std::fmt::Display for GraphNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} kernels ({} fills, {} L2 branches), {} memsets, {} copies, {} events, {} other",
            self.kernels, self.fills, self.l2_branches, self.memsets, self.memcpys, self.events, self.other
        )
    }
}

impl GpuRuntime {
    /// Node counts of bucket `bi`'s graph (`None`: the bucket has no graph).
    pub fn graph_nodes(&self, bi: usize) -> Result<Option<GraphNodes>, GpuError> {
        use cudarc::driver::sys::CUgraphNodeType as T;
        let Some(g) = self.graphs.get(bi).and_then(|g| g.as_ref()) else {
            return Ok(None);
        };
        let mut c = GraphNodes {
            fills: g.graph.fills(),
            ..GraphNodes::default()
        };
        let l2 = self.entry_func(specplan_kernels::Entry::L2Prefetch);
        for node in graph::nodes(g.graph.cu_graph())? {
            match graph::node_type(node)? {
                T::CU_GRAPH_NODE_TYPE_KERNEL => {
                    c.kernels += 1;
                    if l2.is_some() && graph::kernel_func(node)? == l2 {
                        c.l2_branches += 1;
                        c.l2_leaves += usize::from(graph::dependents(node)? == 0);
                    }
                }
                T::CU_GRAPH_NODE_TYPE_MEMSET => c.memsets += 1,
                T::CU_GRAPH_NODE_TYPE_MEMCPY => c.memcpys += 1,
                T::CU_GRAPH_NODE_TYPE_EVENT_RECORD | T::CU_GRAPH_NODE_TYPE_WAIT_EVENT => c.events += 1,
                _ => c.other += 1,
            }
        }
        Ok(Some(c))
    }
}
