//! The plan's GEMMs: cuBLASLt with a measured algorithm per shape when tuned (`lt.rs`),
//! else `cublasGemmEx` with its default heuristic. One fixed workspace, set before any
//! capture, so cuBLAS never allocates inside a graph.
//!
//! Convention: row-major `C[m,n] (+)= A[m,k]·W[n,k]ᵀ` is column-major `Cᵀ[n,m] = Wᵀ·Aᵀ`
//! with W and A read as k-major: op(W) = T, op(A) = N.

use std::ffi::c_void;

use cudarc::cublas::sys as cublas;
use cudarc::driver::sys;
use specplan_format::DType;

use super::device::{cublas_ok, BlasHandle, DevMem, GpuError};
use super::lt::{GemmChoice, GemmPtrs, GemmShape, Lt};

/// Workspace of cuBLAS and cuBLASLt.
const WORKSPACE_BYTES: usize = 32 << 20;

pub(crate) struct Gemms {
    blas: BlasHandle,
    ws: DevMem,
    lt: Option<Lt>,
}

fn dtype_cuda(d: DType) -> cublas::cudaDataType {
    match d {
        DType::Bf16 => cublas::cudaDataType::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType::CUDA_R_16F,
        _ => cublas::cudaDataType::CUDA_R_32F,
    }
}

impl Gemms {
    /// A cuBLAS handle bound to `stream` with the fixed workspace.
    pub fn new(stream: sys::CUstream) -> Result<Gemms, GpuError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        cublas_ok("cublasCreate", unsafe { cublas::cublasCreate_v2(&mut handle) })?;
        let blas = BlasHandle(handle);
        let ws = DevMem::new(WORKSPACE_BYTES)?;
        // SAFETY: handle and workspace live as long as `Gemms`.
        unsafe {
            cublas_ok("cublasSetStream", cublas::cublasSetStream_v2(blas.0, stream as _))?;
            cublas_ok(
                "cublasSetWorkspace",
                cublas::cublasSetWorkspace_v2(blas.0, ws.ptr as *mut c_void, ws.bytes),
            )?;
        }
        Ok(Gemms { blas, ws, lt: None })
    }

    /// Times cuBLASLt's candidates for every shape (on its pointers; overwrites C) and keeps
    /// the fastest. Call before the arena holds anything a step needs and before capture.
    pub fn tune(&mut self, shapes: &[(GemmShape, GemmPtrs)], stream: sys::CUstream) -> Result<(), GpuError> {
        let mut lt = Lt::new((self.ws.ptr, self.ws.bytes))?;
        for &(shape, ptrs) in shapes {
            lt.tune(shape, ptrs, stream)?;
        }
        self.lt = Some(lt);
        Ok(())
    }

    pub fn choice(&self, s: &GemmShape) -> Option<GemmChoice> {
        self.lt.as_ref().and_then(|lt| lt.choice(s))
    }

    /// Issues one GEMM on `stream` (eagerly or under capture).
    pub fn run(&self, s: &GemmShape, p: GemmPtrs, stream: sys::CUstream) -> Result<(), GpuError> {
        if let Some(r) = self.lt.as_ref().and_then(|lt| lt.run(s, p, stream)) {
            return r;
        }
        let (alpha, beta) = (1.0f32, if s.accumulate { 1.0f32 } else { 0.0f32 });
        // SAFETY: all three operands lie inside the runtime's regions (validated plan:
        // shapes match m, n, k); alpha/beta are host scalars read at call (or capture) time.
        let st = unsafe {
            cublas::cublasGemmEx(
                self.blas.0,
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
                s.k as i32,
                &beta as *const f32 as *const c_void,
                p.c as *mut c_void,
                dtype_cuda(s.c),
                s.n as i32,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        cublas_ok("cublasGemmEx", st)
    }
}
