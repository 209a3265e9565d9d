//! The plan's GEMMs: cuBLASLt with a measured algorithm per shape when tuned (`lt.rs`),
//! else `cublasGemmEx` with its default heuristic. One fixed workspace, set before any
//! capture, so cuBLAS never allocates inside a graph.
//!
//! Convention: row-major `C[m,n] (+)= A[m,k]·W[n,k]ᵀ` is column-major `Cᵀ[n,m] = Wᵀ·Aᵀ`
//! with W and A read as k-major: op(W) = T, op(A) = N.

use std::ffi::c_void;

use cudarc::cublas::sys as cublas;
use cudarc::driver::{result, sys};
use specplan_format::DType;

use super::device::{cublas_ok, cuda, BlasHandle, DevMem, GpuError};
use super::gemm_cache::GemmCache;
use super::lt::{GemmChoice, GemmFlip, GemmPtrs, GemmShape, Lt};
use super::skinny::Skinny;

/// How the runtime picks each GEMM's algorithm at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPolicy {
    /// cublasGemmEx with its default heuristic (no measurement).
    Heuristic,
    /// cuBLASLt algorithms from the cache; shapes not in it are timed once and added.
    Cached,
    /// Every shape timed again, the cache rewritten.
    Retune,
}

/// What choosing the GEMM algorithms at load did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GemmLoad {
    /// Shapes taken from the cache and timed.
    pub cached: usize,
    pub timed: usize,
    pub ms: f64,
}

/// Workspace of cuBLAS and cuBLASLt.
const WORKSPACE_BYTES: usize = 32 << 20;

pub(crate) struct Gemms {
    /// cuBLAS, created only when a shape needs the cublasGemmEx path (its first use costs
    /// tens of milliseconds; the cuBLASLt path does not need it).
    blas: Option<BlasHandle>,
    ws: DevMem,
    lt: Option<Lt>,
    /// The plan's skinny GEMM, offered to cuBLASLt's tuning as one more candidate.
    skinny: Skinny,
    stream: sys::CUstream,
}

fn dtype_cuda(d: DType) -> cublas::cudaDataType {
    match d {
        DType::Bf16 => cublas::cudaDataType::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType::CUDA_R_16F,
        _ => cublas::cudaDataType::CUDA_R_32F,
    }
}

impl Gemms {
    /// GEMMs with the fixed workspace, eager calls on `stream`.
    pub fn new(stream: sys::CUstream, skinny: Skinny) -> Result<Gemms, GpuError> {
        Ok(Gemms {
            blas: None,
            ws: DevMem::new(WORKSPACE_BYTES)?,
            lt: None,
            skinny,
            stream,
        })
    }

    /// Creates the cuBLAS handle (bound to the current stream and the workspace) if no
    /// handle exists yet.
    fn ensure_blas(&mut self) -> Result<(), GpuError> {
        if self.blas.is_some() {
            return Ok(());
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        cublas_ok("cublasCreate", unsafe { cublas::cublasCreate_v2(&mut handle) })?;
        let blas = BlasHandle(handle);
        // SAFETY: handle and workspace live as long as `Gemms`.
        unsafe {
            cublas_ok("cublasSetStream", cublas::cublasSetStream_v2(blas.0, self.stream as _))?;
            cublas_ok(
                "cublasSetWorkspace",
                cublas::cublasSetWorkspace_v2(blas.0, self.ws.ptr as *mut c_void, self.ws.bytes),
            )?;
        }
        self.blas = Some(blas);
        Ok(())
    }

    /// Readies `cublasGemmEx` for every shape (the heuristic policy).
    pub fn prepare_heuristic(&mut self) -> Result<(), GpuError> {
        self.ensure_blas()
    }

    /// Chooses a cuBLASLt algorithm for every shape: from `cache` when it holds one cuBLASLt
    /// accepts, else by timing the candidates on the shape's pointers (overwrites C: call
    /// before the arena holds anything a step needs, and before capture). `switchable`
    /// keeps the workspace either choice of a shape needs (`flip_skinny`).
    pub fn prepare(
        &mut self,
        shapes: &[(GemmShape, GemmPtrs)],
        cache: &mut GemmCache,
        retune: bool,
        switchable: bool,
        stream: sys::CUstream,
    ) -> Result<GemmLoad, GpuError> {
        if self.ws.bytes < WORKSPACE_BYTES {
            // A second preparation chooses among candidates with the full workspace again.
            self.ws = DevMem::new(WORKSPACE_BYTES)?;
        }
        let mut lt = Lt::new((self.ws.ptr, self.ws.bytes), self.skinny)?;
        let mut load = GemmLoad::default();
        // `split_gemm_round` (an A/B switch) times the rounded shapes' choices under other
        // costs: such a load neither reads nor writes the cache, so each side of the A/B
        // chooses for itself and leaves the other's choices alone.
        let use_cache = !self.skinny.split_round;
        for &(shape, ptrs) in shapes {
            if lt.algo(&shape).is_some() {
                continue;
            }
            if let Some((algo, choice)) = cache.get(&shape).filter(|_| !retune && use_cache) {
                if lt.adopt(shape, algo, choice)? {
                    load.cached += 1;
                    continue;
                }
            }
            lt.tune(shape, ptrs, stream)?;
            load.timed += 1;
            match (lt.algo(&shape), lt.choice(&shape)) {
                (Some(algo), Some(choice)) if use_cache => cache.put(&shape, algo, choice),
                (Some(_), Some(_)) => {}
                // No cuBLASLt candidate: this shape takes the cublasGemmEx path.
                _ => self.ensure_blas()?,
            }
        }
        lt.end_tuning();
        // The chosen algorithms' largest workspace is all a step needs: the candidates were
        // timed with the full one, the runtime keeps only that much (cuBLASLt's figures; with
        // the cublasGemmEx path in use, whose needs are not known, the full one stays).
        let need = lt.ws_need(switchable).div_ceil(256) * 256;
        if self.blas.is_none() && need < self.ws.bytes {
            // SAFETY: the runtime's live stream; the timing runs on it are finished before
            // their workspace is freed.
            cuda("cuStreamSynchronize", unsafe { result::stream::synchronize(stream) })?;
            let ws = DevMem::new(need.max(256))?;
            lt.set_workspace((ws.ptr, ws.bytes));
            self.ws = ws;
        }
        self.lt = Some(lt);
        Ok(load)
    }

    /// Bytes of the GEMM workspace the runtime holds.
    pub fn workspace_bytes(&self) -> usize {
        self.ws.bytes
    }

    /// Sets the stream eager GEMMs go on (the Lt path takes the stream per call).
    pub fn set_stream(&mut self, stream: sys::CUstream) -> Result<(), GpuError> {
        self.stream = stream;
        if let Some(b) = &self.blas {
            // SAFETY: a live handle; the stream is valid for the calls that follow.
            cublas_ok("cublasSetStream", unsafe {
                cublas::cublasSetStream_v2(b.0, stream as _)
            })?;
        }
        Ok(())
    }

    /// [`Lt::flip_skinny`] (`NoAlgorithm` without tuned algorithms).
    pub fn flip_skinny(&mut self, s: &GemmShape) -> GemmFlip {
        self.lt.as_mut().map_or(GemmFlip::NoAlgorithm, |lt| lt.flip_skinny(s))
    }

    pub fn choice(&self, s: &GemmShape) -> Option<GemmChoice> {
        self.lt.as_ref().and_then(|lt| lt.choice(s))
    }

    /// Issues one GEMM on `stream` (eagerly or under capture).
    pub fn run(&self, s: &GemmShape, p: GemmPtrs, stream: sys::CUstream) -> Result<(), GpuError> {
        if let Some(r) = self.lt.as_ref().and_then(|lt| lt.run(s, p, stream)) {
            return r;
        }
        let Some(blas) = &self.blas else {
            return Err(GpuError::Cublas {
                call: "cublasGemmEx",
                status: format!("no algorithm prepared for m{} n{} k{}", s.m, s.n, s.k),
            });
        };
        let (alpha, beta) = (1.0f32, if s.accumulate { 1.0f32 } else { 0.0f32 });
        // SAFETY: all three operands lie inside the runtime's regions (validated plan:
        // shapes match m, n, k); alpha/beta are host scalars read at call (or capture) time.
        let st = unsafe {
            cublas::cublasGemmEx(
                blas.0,
                cublas::cublasOperation_t::CUBLAS_OP_T,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                s.n as i32,
                s.m as i32,
                s.k as i32,
                &alpha as *const f32 as *const c_void,
                p.w as *const c_void,
                dtype_cuda(s.w),
                s.k as i32,
                p.a as *const c_void,
                dtype_cuda(s.a),
                s.lda as i32,
                &beta as *const f32 as *const c_void,
                p.c as *mut c_void,
                dtype_cuda(s.c),
                s.n as i32,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        cublas_ok("cublasGemmEx", st)?;
        self.skinny.round_after(s, p, stream)
    }
}
