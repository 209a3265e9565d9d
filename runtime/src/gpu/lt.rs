//! The plan's GEMMs through cuBLASLt, each with an algorithm chosen by measurement when the
//! runtime loads.
//!
//! Why: a draft-extend step multiplies 4–1024 rows by the draft head's weights. For the few
//! rows of small buckets the GEMMs are weight streams (memory bound), and the algorithm
//! cuBLAS's default heuristic picks for such skinny shapes leaves bandwidth unused (too few
//! CTAs, no split-K). cuBLASLt lists several candidates per shape (split-K, tile sizes);
//! timing them on this GPU, on the plan's own pointers, and keeping the fastest is the
//! "skinny-GEMM choice" fixed before any graph is captured. Shapes come from the plan
//! (m = bucket rows, n, k from the weights), so the set is small (a few per bucket).
//!
//! Operand convention (row-major C[m,n] = A[m,k]·W[n,k]ᵀ, as in `gemm.rs`): in
//! cuBLAS's column-major terms D[n,m] = op(W)·A with W stored k×n (ld k) and op = T, A
//! stored k×m (ld k), C/D stored n×m (ld n). `accumulate` adds into C (beta = 1, C = D).

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys as lsys;
use cudarc::driver::{result, sys};

use specplan_format::DType;

use super::device::{cuda, DevMem, Event, GpuError};
use super::skinny::Skinny;

/// Candidates asked of the heuristic per shape.
const CANDIDATES: i32 = 12;
/// Timed runs per candidate (after one warm-up run); their mean is compared. Each runs with
/// the L2 cache flushed before it, as in a step, where the other GEMMs' weights (hundreds of
/// MB) have evicted this one's: timed back to back, a weight of a few tens of MB (o_proj,
/// 32 MiB) stays in the 50 MB L2 and the choice favours algorithms that stream it badly from
/// memory (docs/perf-notes.md, "GEMM candidates timed with a cold L2").
const RUNS: usize = 4;
/// Bytes written between timed runs to evict the L2 (twice the H200's 50 MB).
const FLUSH_BYTES: usize = 96 << 20;
/// What a candidate is charged per graph node beyond its one kernel, µs. Some algorithms
/// (split-K reductions, stream-K counters) add a memset or a second kernel per call; in a
/// replayed graph each node is one more launch (a dependency gap on the GPU and the driver's
/// time on the host: a memset node cost the host 1–2 µs per graph launch on the H200 before
/// `graph.rs` turned memsets into kernel nodes), which the eager timing below does not see.
const NODE_US: f32 = 1.0;
/// Rounds over the candidate list (each candidate keeps its best round's mean).
const ROUNDS: usize = 2;

/// One more round's `(mean µs, charged µs)` of a candidate into its best so far; a failed
/// round (`None`) puts the candidate out.
fn keep_best(best: &mut Option<(f32, f32)>, run: Option<(f32, f32)>) {
    *best = run.map(|(u, c)| best.map_or((u, c), |(bu, bc)| (bu.min(u), bc.min(c))));
}
/// What the skinny GEMM's eager time is multiplied by before it is compared: measured in a
/// replayed graph, it won where the eager timing had it ≥ 10% ahead (the fused fc, o_proj,
/// down at m ≤ 8) and lost 4% on one shape the eager timing had 9% ahead (qkv, n 12288 at
/// m 4; docs/perf-notes.md, "Skinny GEMM").
const SKINNY_MARGIN: f32 = 1.1;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct GemmShape {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// A's row stride in elements (≥ k; the down projection reads the SwiGLU product in
    /// place in the gate/up rows).
    pub lda: u32,
    pub accumulate: bool,
    /// The GEMM also writes C's values rounded into `GemmPtrs::r` (`GemmDesc.rounded`):
    /// the skinny GEMM in its epilogue, else `gemm_round` after the library's call, which
    /// tuning charges to the library's candidates.
    pub rounded: bool,
    pub w: DType,
    pub a: DType,
    pub c: DType,
    /// The largest power of two (at most 256) dividing every operand's address: cuBLASLt
    /// algorithms assume their operands' alignment, so a weight view (a slice of a fused
    /// tensor) needs algorithms chosen for it, and the cache keeps them apart.
    pub align: u32,
}

impl GemmPtrs {
    /// The alignment class of these operands (see `GemmShape::align`).
    pub(crate) fn align(&self) -> u32 {
        let all = self.w | self.a | self.c | 256;
        1u32 << all.trailing_zeros().min(8)
    }
}

/// Operands of one call: device addresses of W, A and C (= D), and of C's rounded copy (0:
/// none; not part of the alignment class, which is the library's concern).
#[derive(Clone, Copy)]
pub(crate) struct GemmPtrs {
    pub w: u64,
    pub a: u64,
    pub c: u64,
    pub r: u64,
}

/// What tuning found for one shape (reported by the benchmarks).
#[derive(Clone, Copy, Debug)]
pub struct GemmChoice {
    /// Mean µs of the heuristic's first candidate and of the kept one.
    pub first_us: f32,
    pub best_us: f32,
    /// Index of the kept candidate in the list timed, and the list's length: the
    /// heuristic's candidates, then the skinny GEMM.
    pub rank: usize,
    pub candidates: usize,
    /// The plan's skinny GEMM was kept (`skinny.rs`; its rank is the list's last).
    pub ours: bool,
    /// The parts the shape's cuBLASLt algorithm splits K into (1: none), whether or not it
    /// was kept over the skinny GEMM: the heuristic's own choice (docs/perf-notes.md item
    /// 53 timed splits of 2, 4 and 8 parts of its first three candidates beside its list on
    /// an H100; none was kept).
    pub split: u32,
}

/// What [`Lt::flip_skinny`] did with a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmFlip {
    /// Switched; `to_skinny`: the skinny kernel serves the shape from now on.
    Switched { to_skinny: bool },
    /// Not switched: the skinny kernel does not serve the shape.
    NotServed,
    /// Not switched: the shape has no tuned cuBLASLt algorithm (cublasGemmEx serves it).
    NoAlgorithm,
    /// Not switched: the algorithm needs more workspace than the runtime holds.
    Workspace { need: usize, held: usize },
    /// The bucket has no GEMM of these dims.
    NoGemm,
}

struct Tuned {
    desc: lsys::cublasLtMatmulDesc_t,
    layouts: [lsys::cublasLtMatrixLayout_t; 3], // W, A, C/D
    algo: lsys::cublasLtMatmulAlgo_t,
    choice: GemmChoice,
    /// Workspace bytes the kept algorithm needs (cuBLASLt's figure for it; 0 when the
    /// skinny GEMM serves the shape, `choice.ours`).
    ws_need: usize,
    /// Workspace bytes `algo` needs, whichever of the two serves the shape.
    lt_ws: usize,
}

impl Drop for Tuned {
    fn drop(&mut self) {
        // SAFETY: created in `Lt::tune`, destroyed once here; a layout whose creation
        // failed (tune returned early) is still null and is skipped.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

pub(crate) struct Lt {
    handle: lsys::cublasLtHandle_t,
    ws: (u64, usize),
    tuned: HashMap<GemmShape, Tuned>,
    /// The buffer written to evict the L2 between timed runs, while tuning (`end_tuning`
    /// frees it; if it cannot be allocated the runs are timed back to back).
    flush: Option<DevMem>,
    /// The plan's skinny GEMM, a candidate for the shapes it serves.
    skinny: Skinny,
}

impl Drop for Lt {
    fn drop(&mut self) {
        self.tuned.clear();
        // SAFETY: created in `Lt::new`, destroyed once, after every descriptor.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn lt_ok<T>(call: &'static str, r: Result<T, lt::CublasError>) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Cublas {
        call,
        status: format!("{:?}", e.0),
    })
}

/// The parts `algo` splits K into (1: none, or not reported).
fn split_of(algo: &lsys::cublasLtMatmulAlgo_t) -> u32 {
    let (mut v, mut written) = (0u32, 0usize);
    // SAFETY: `algo` is a live plain-data struct; the buffer is 4 bytes, the attribute's
    // type (uint32), and `written` says what was filled.
    let status = unsafe {
        lsys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            lsys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            &mut v as *mut u32 as *mut c_void,
            4,
            &mut written,
        )
    };
    if status == lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && written == 4 {
        v.max(1)
    } else {
        1
    }
}

fn dtype(d: DType) -> lsys::cudaDataType {
    match d {
        DType::Bf16 => lsys::cudaDataType::CUDA_R_16BF,
        DType::F16 => lsys::cudaDataType::CUDA_R_16F,
        _ => lsys::cudaDataType::CUDA_R_32F,
    }
}

impl Lt {
    /// A cuBLASLt handle using the workspace `ws` (device address, bytes) for every call,
    /// with the plan's skinny GEMM as one more candidate.
    pub(crate) fn new(ws: (u64, usize), skinny: Skinny) -> Result<Lt, GpuError> {
        let handle = lt_ok("cublasLtCreate", lt::create_handle())?;
        Ok(Lt {
            handle,
            ws,
            tuned: HashMap::new(),
            flush: None,
            skinny,
        })
    }

    /// The skinny GEMM when it serves `s`.
    fn skinny_for(&self, s: &GemmShape) -> Option<Skinny> {
        self.skinny.serves(s).then_some(self.skinny)
    }

    /// Frees the tuning's flush buffer (the choices are made).
    pub(crate) fn end_tuning(&mut self) {
        self.flush = None;
    }

    pub(crate) fn choice(&self, s: &GemmShape) -> Option<GemmChoice> {
        self.tuned.get(s).map(|t| t.choice)
    }

    /// The descriptors of shape `s` (no algorithm yet).
    fn describe(&self, s: &GemmShape) -> Result<Tuned, GpuError> {
        let desc = lt_ok(
            "cublasLtMatmulDescCreate",
            lt::create_matmul_desc(
                lsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lsys::cudaDataType::CUDA_R_32F,
            ),
        )?;
        let (m, n, k) = (s.m as u64, s.n as u64, s.k as u64);
        let mk = |t, rows, cols, ld| {
            lt_ok(
                "cublasLtMatrixLayoutCreate",
                lt::create_matrix_layout(t, rows, cols, ld),
            )
        };
        // Build the descriptor set first so a failure below still frees what exists.
        let mut t = Tuned {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: an all-zero algo is a valid "unset" value of this plain C struct; it
            // is replaced before any use.
            algo: unsafe { std::mem::zeroed() },
            choice: GemmChoice {
                first_us: 0.0,
                best_us: 0.0,
                rank: 0,
                candidates: 0,
                ours: false,
                split: 1,
            },
            ws_need: 0,
            lt_ws: 0,
        };
        t.layouts[0] = mk(dtype(s.w), k, n, k as i64)?;
        t.layouts[1] = mk(dtype(s.a), k, m, s.lda as i64)?;
        t.layouts[2] = mk(dtype(s.c), n, m, n as i64)?;
        // cublasOperation_t values (the attribute is an int32): CUBLAS_OP_T = 1, CUBLAS_OP_N = 0.
        let (op_t, op_n) = (1i32, 0i32);
        use lsys::cublasLtMatmulDescAttributes_t::{CUBLASLT_MATMUL_DESC_TRANSA, CUBLASLT_MATMUL_DESC_TRANSB};
        for (attr, op) in [
            (CUBLASLT_MATMUL_DESC_TRANSA, &op_t),
            (CUBLASLT_MATMUL_DESC_TRANSB, &op_n),
        ] {
            // SAFETY: live descriptor; the value is the attribute's documented type (int32)
            // and size, read during the call.
            lt_ok("cublasLtMatmulDescSetAttribute", unsafe {
                lt::set_matmul_desc_attribute(t.desc, attr, op as *const i32 as *const c_void, 4)
            })?;
        }
        Ok(t)
    }

    /// Uses a known algorithm for `s` (from the cache: cuBLASLt algorithms are plain data,
    /// valid for the same library version on the same device), after cuBLASLt confirms it
    /// supports the shape. Returns false (nothing adopted) when it does not.
    pub(crate) fn adopt(&mut self, s: GemmShape, algo: [u64; 8], choice: GemmChoice) -> Result<bool, GpuError> {
        if self.tuned.contains_key(&s) {
            return Ok(true);
        }
        let mut t = self.describe(&s)?;
        t.algo = lsys::cublasLtMatmulAlgo_t { data: algo };
        // SAFETY: zeroed results are overwritten by the call.
        let mut check: lsys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: live descriptors; `algo` and `check` are valid for the call.
        let status = unsafe {
            lsys::cublasLtMatmulAlgoCheck(
                self.handle,
                t.desc,
                t.layouts[0],
                t.layouts[1],
                t.layouts[2],
                t.layouts[2],
                &t.algo,
                &mut check,
            )
        };
        if status != lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || check.workspaceSize > self.ws.1 {
            return Ok(false);
        }
        if choice.ours && self.skinny_for(&s).is_none() {
            return Ok(false); // the cached choice's kernel does not serve it here: timed again
        }
        t.choice = GemmChoice {
            split: split_of(&t.algo),
            ..choice
        };
        t.lt_ws = check.workspaceSize;
        t.ws_need = if choice.ours { 0 } else { t.lt_ws };
        self.tuned.insert(s, t);
        Ok(true)
    }

    /// Switches shape `s` between the skinny GEMM and its cuBLASLt algorithm, for calls from
    /// now on (a probe's question: is the choice timed one GEMM at a time also the faster one
    /// inside a bucket's graph?). Only where both serve the shape and the algorithm's
    /// workspace fits the one held (a load with `gemm_switchable` keeps enough). The cache
    /// is not touched.
    pub(crate) fn flip_skinny(&mut self, s: &GemmShape) -> GemmFlip {
        let (serves, held) = (self.skinny.serves(s), self.ws.1);
        let Some(t) = self.tuned.get_mut(s) else {
            return GemmFlip::NoAlgorithm;
        };
        if !serves {
            return GemmFlip::NotServed;
        }
        if t.choice.ours && t.lt_ws > held {
            return GemmFlip::Workspace { need: t.lt_ws, held };
        }
        t.choice.ours = !t.choice.ours;
        t.ws_need = if t.choice.ours { 0 } else { t.lt_ws };
        GemmFlip::Switched {
            to_skinny: t.choice.ours,
        }
    }

    /// The algorithm kept for `s`, as plain data (for the cache).
    pub(crate) fn algo(&self, s: &GemmShape) -> Option<[u64; 8]> {
        self.tuned.get(s).map(|t| t.algo.data)
    }

    /// Times the heuristic's candidates for `s` on `p` and keeps the fastest. Leaves the
    /// shape untuned (the caller falls back to cublasGemmEx) when cuBLASLt has no
    /// candidate. Overwrites C (and reads it when accumulating): call before the arena
    /// holds anything a step needs.
    pub(crate) fn tune(&mut self, s: GemmShape, p: GemmPtrs, stream: sys::CUstream) -> Result<(), GpuError> {
        if self.tuned.contains_key(&s) {
            return Ok(());
        }
        let mut t = self.describe(&s)?;
        let pref = lt_ok("cublasLtMatmulPreferenceCreate", lt::create_matmul_pref())?;
        let ws_bytes = self.ws.1 as u64;
        // SAFETY: live preference; the attribute is a u64 byte count.
        let mut set = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws_bytes as *const u64 as *const c_void,
                8,
            )
        };
        // Candidates must accept the operands' real alignment (the default assumes 256 bytes).
        let align = s.align;
        use lsys::cublasLtMatmulPreferenceAttributes_t as P;
        for attr in [
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ] {
            if set.is_ok() {
                // SAFETY: live preference; the attribute is a u32 byte count.
                set = unsafe { lt::set_matmul_pref_attribute(pref, attr, &align as *const u32 as *const c_void, 4) };
            }
        }
        // SAFETY: zeroed results are overwritten by the call for the returned count.
        let mut found: Vec<lsys::cublasLtMatmulHeuristicResult_t> =
            (0..CANDIDATES).map(|_| unsafe { std::mem::zeroed() }).collect();
        let mut count = 0i32;
        // SAFETY: all descriptors are live; the results array holds CANDIDATES entries.
        let status = unsafe {
            lsys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                t.desc,
                t.layouts[0],
                t.layouts[1],
                t.layouts[2],
                t.layouts[2],
                pref,
                CANDIDATES,
                found.as_mut_ptr(),
                &mut count,
            )
        };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        lt_ok("cublasLtMatmulPreferenceSetAttribute", set)?;
        if status != lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || count <= 0 {
            return Ok(()); // no candidate: cublasGemmEx serves this shape
        }
        found.truncate(count as usize);
        if self.flush.is_none() {
            self.flush = DevMem::new(FLUSH_BYTES).ok();
        }
        // Per candidate: (mean µs, µs charged with its extra graph nodes); None when it
        // cannot run or be captured alone (then it could not be captured in a bucket's graph
        // either). Every candidate, the skinny GEMM last, is timed in each of ROUNDS rounds
        // and keeps its best round: the GPU's clocks settle during the first candidates of
        // a round, which a single round charged to whichever came first.
        let skinny = self.skinny_for(&s);
        let n = found.len() + skinny.is_some() as usize;
        let mut timed: Vec<Option<(f32, f32)>> = vec![None; n];
        let mut extra = vec![None; found.len()];
        for round in 0..ROUNDS {
            for (i, h) in found.iter().enumerate() {
                let usable = h.state == lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && h.workspaceSize <= self.ws.1;
                if !usable || (round > 0 && timed[i].is_none()) {
                    continue; // unusable, or out since an earlier round
                }
                let mut ok = true;
                // With a rounded copy, the library's call and the `gemm_round` after it (one
                // more node), as a step would issue them.
                let us = self.time(stream, &mut || {
                    ok &= self.call(&t, &h.algo, s.accumulate, p, stream).is_ok()
                        && self.skinny.round_after(&s, p, stream).is_ok()
                })?;
                if round == 0 && ok {
                    extra[i] = self
                        .extra_nodes(&t, &h.algo, s.accumulate, p, stream)
                        .ok()
                        .map(|x| x + s.rounded as usize);
                }
                let run = extra[i].filter(|_| ok).map(|x| (us, us + NODE_US * x as f32));
                keep_best(&mut timed[i], run);
            }
            // The skinny GEMM (one kernel node, the rounded copy in its epilogue: nothing to
            // add; with `split_round`, its `gemm_round` is timed and one more node charged),
            // charged SKINNY_MARGIN.
            if let Some(k) = skinny.filter(|_| round == 0 || timed[n - 1].is_some()) {
                let mut ok = true;
                let us = self.time(stream, &mut || ok &= k.run(&s, p, stream).is_ok())?;
                let node = NODE_US * (s.rounded && k.split_round) as u8 as f32;
                keep_best(&mut timed[n - 1], ok.then_some((us, us * SKINNY_MARGIN + node)));
            }
        }
        let ranked = || timed.iter().enumerate().filter_map(|(i, x)| x.map(|(u, c)| (i, u, c)));
        let Some((rank, best_us, _)) = ranked().min_by(|a, b| a.2.total_cmp(&b.2)) else {
            return Ok(());
        };
        let ours = rank == found.len();
        // The best cuBLASLt candidate stays the shape's algorithm either way (the cache
        // keeps it; a plan whose kernel cannot serve the shape falls back to it).
        let lt_best = ranked()
            .filter(|x| x.0 < found.len())
            .min_by(|a, b| a.2.total_cmp(&b.2));
        let Some((lt_rank, _, _)) = lt_best else {
            // No cuBLASLt candidate ran: cublasGemmEx serves this shape, even where the skinny
            // GEMM ran (a shape cuBLASLt cannot serve is unusual enough to keep the library's
            // path, and the cache has no algorithm to record for it).
            return Ok(());
        };
        t.algo = found[lt_rank].algo;
        t.lt_ws = found[lt_rank].workspaceSize;
        t.ws_need = if ours { 0 } else { t.lt_ws };
        t.choice = GemmChoice {
            first_us: timed.first().copied().flatten().map_or(f32::NAN, |x| x.0),
            best_us,
            rank,
            candidates: n,
            ours,
            split: split_of(&found[lt_rank].algo),
        };
        self.tuned.insert(s, t);
        Ok(())
    }

    /// Mean µs of RUNS calls of `run` on `stream`, each after the L2 is flushed, after one
    /// warm-up call.
    fn time(&self, stream: sys::CUstream, run: &mut dyn FnMut()) -> Result<f32, GpuError> {
        let (ev0, ev1) = (Event::new(true)?, Event::new(true)?);
        let (e0, e1) = (ev0.0, ev1.0);
        let flush = self.flush.as_ref().map(|f| (f.ptr, f.bytes));
        run();
        let mut total_ms = 0.0f32;
        for _ in 0..RUNS {
            // SAFETY: the flush buffer is this tuner's live allocation of `bytes`; live
            // events on a live stream; synchronizing is the measurement.
            total_ms += unsafe {
                if let Some((ptr, bytes)) = flush {
                    cuda("cuMemsetD8Async", result::memset_d8_async(ptr, 0x5a, bytes, stream))?;
                }
                cuda("cuEventRecord", result::event::record(e0, stream))?;
                run();
                cuda("cuEventRecord", result::event::record(e1, stream))?;
                cuda("cuEventSynchronize", result::event::synchronize(e1))?;
                cuda("cuEventElapsedTime", result::event::elapsed(e0, e1))?
            };
        }
        // The events are destroyed here; the stream was synchronized on the last of them.
        drop((ev0, ev1));
        Ok(total_ms * 1e3 / RUNS as f32)
    }

    /// Graph nodes one call of `algo` adds beyond its kernel: the call captured alone on
    /// `stream` (which must not be capturing), its nodes counted, the graph destroyed.
    fn extra_nodes(
        &self,
        t: &Tuned,
        algo: &lsys::cublasLtMatmulAlgo_t,
        accumulate: bool,
        p: GemmPtrs,
        stream: sys::CUstream,
    ) -> Result<usize, GpuError> {
        // SAFETY: the runtime's stream, idle of captures (tuning runs before any graph is
        // captured); capture ends below whatever the call returned.
        cuda("cuStreamBeginCapture", unsafe {
            result::stream::begin_capture(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        })?;
        let called = self.call(t, algo, accumulate, p, stream);
        // SAFETY: ends the capture begun above on the same stream.
        let ended = cuda("cuStreamEndCapture", unsafe { result::stream::end_capture(stream) });
        // The call's own error first (a failed call may invalidate the capture as well).
        called?;
        let graph = ended?;
        let counted = if graph.is_null() {
            Ok(0)
        } else {
            let n = super::graph::nodes(graph).map(|v| v.len());
            // SAFETY: created by the capture above, destroyed once.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            n
        };
        Ok(counted?.saturating_sub(1))
    }

    fn call(
        &self,
        t: &Tuned,
        algo: &lsys::cublasLtMatmulAlgo_t,
        accumulate: bool,
        p: GemmPtrs,
        stream: sys::CUstream,
    ) -> Result<(), GpuError> {
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0f32 });
        // SAFETY: descriptors are live; the operands lie inside the runtime's allocations
        // (validated plan shapes); alpha/beta are host scalars read at call (or capture)
        // time; the workspace is the runtime's, sized as the preference said.
        lt_ok("cublasLtMatmul", unsafe {
            lt::matmul(
                self.handle,
                t.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                p.w as *const c_void,
                t.layouts[0],
                p.a as *const c_void,
                t.layouts[1],
                p.c as *const c_void,
                t.layouts[2],
                p.c as *mut c_void,
                t.layouts[2],
                algo as *const _,
                self.ws.0 as *mut c_void,
                self.ws.1,
                stream as lsys::cudaStream_t,
            )
        })
    }

    /// The largest workspace a kept algorithm needs (`either`: the kept one or the shape's
    /// other choice, for `flip_skinny`).
    pub(crate) fn ws_need(&self, either: bool) -> usize {
        let need = |t: &Tuned| if either { t.ws_need.max(t.lt_ws) } else { t.ws_need };
        self.tuned.values().map(need).max().unwrap_or(0)
    }

    /// Points every later call at workspace `ws` (address, bytes), which must hold
    /// [`Lt::ws_need`] bytes.
    pub(crate) fn set_workspace(&mut self, ws: (u64, usize)) {
        self.ws = ws;
    }

    /// Runs a tuned shape; `None` when `s` was not tuned (the caller uses cublasGemmEx).
    pub(crate) fn run(&self, s: &GemmShape, p: GemmPtrs, stream: sys::CUstream) -> Option<Result<(), GpuError>> {
        let t = self.tuned.get(s)?;
        if t.choice.ours {
            // Kept only where `skinny_for` found the kernel serving the shape.
            return Some(self.skinny.run(s, p, stream));
        }
        Some(
            self.call(t, &t.algo, s.accumulate, p, stream)
                .and_then(|()| self.skinny.round_after(s, p, stream)),
        )
    }
}
