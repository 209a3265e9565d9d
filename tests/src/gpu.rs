//! GPU helpers of the check and benchmark binaries: a device buffer, CUDA-event timing,
//! the device's copy and matmul ceilings, step timing. Never used where there is no GPU
//! (the binaries print SKIP first).

// `CUstream` is an opaque driver handle that Rust never dereferences; the driver checks it.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::c_void;

use cudarc::driver::result::{self, event};
use cudarc::driver::sys::{CUdeviceptr, CUevent, CUevent_flags, CUstream};

use crate::report::Ceilings;

pub const RUNS: usize = 100;
pub const WARMUP: usize = 10;

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("{e:?}")
}

/// A device allocation, freed on drop (the caller synchronizes before dropping it).
pub struct DeviceBuf {
    pub ptr: CUdeviceptr,
    pub bytes: usize,
}

impl DeviceBuf {
    pub fn new(bytes: usize) -> Result<DeviceBuf, String> {
        // SAFETY: a plain allocation, freed once on drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(err)?;
        Ok(DeviceBuf { ptr, bytes })
    }

    /// A buffer holding `data` (synchronous upload, landed before this returns).
    pub fn from_slice<T: Copy>(data: &[T]) -> Result<DeviceBuf, String> {
        let b = DeviceBuf::new(std::mem::size_of_val(data))?;
        // SAFETY: `b` holds exactly the slice's bytes.
        unsafe { result::memcpy_htod_sync(b.ptr, data) }.map_err(err)?;
        // A synchronous copy from pageable memory may return before its DMA lands, and
        // nothing orders that DMA before work on a non-blocking stream (the runtime's).
        result::ctx::synchronize().map_err(err)?;
        Ok(b)
    }

    /// Copies `self.bytes` bytes from `src` on `stream` (stream ordered, no wait).
    pub fn copy_from(&self, src: CUdeviceptr, stream: CUstream) -> Result<(), String> {
        // SAFETY: `src` holds at least `self.bytes` bytes (the caller's contract); the
        // destination is this allocation.
        unsafe { result::memcpy_dtod_async(self.ptr, src, self.bytes, stream) }.map_err(err)
    }

    /// The buffer's bytes (synchronous: waits for the device, every stream).
    pub fn to_host(&self) -> Result<Vec<u8>, String> {
        // The copy below runs on the legacy stream, which does not wait for non-blocking
        // streams such as the runtime's: without this, it can read the buffer before a copy
        // queued there (`copy_from`) has written it.
        result::ctx::synchronize().map_err(err)?;
        let mut v = vec![0u8; self.bytes];
        // SAFETY: `v` holds exactly the buffer's bytes.
        unsafe { result::memcpy_dtoh_sync(&mut v, self.ptr) }.map_err(err)?;
        Ok(v)
    }

    pub fn fill(&self, byte: u8, stream: CUstream) -> Result<(), String> {
        // SAFETY: the whole allocation.
        unsafe { result::memset_d8_async(self.ptr, byte, self.bytes, stream) }.map_err(err)
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc in `new`, freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The `q` quantile of `v` by nearest rank (`q` in (0, 1]; NaN when `v` is empty).
pub fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Two events on a stream: the median of many timed runs.
pub struct Timer {
    start: CUevent,
    end: CUevent,
    stream: CUstream,
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = event::destroy(self.start);
            let _ = event::destroy(self.end);
        }
    }
}

impl Timer {
    pub fn new(stream: CUstream) -> Result<Timer, String> {
        let e = || event::create(CUevent_flags::CU_EVENT_DEFAULT).map_err(err);
        Ok(Timer {
            start: e()?,
            end: e()?,
            stream,
        })
    }

    /// Median µs of `f` between the two events, after warm-up.
    pub fn time(&self, f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        self.time_with(None, f)
    }

    /// Median µs of `f` with L2 flushed before each run (a memset of the whole `flush`
    /// buffer, outside the events): a small step's K/V fits in L2 and would otherwise be
    /// timed from cache, not from HBM as in a running engine.
    pub fn time_flushed(&self, flush: &DeviceBuf, f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        self.time_with(Some(flush), f)
    }

    fn time_with(&self, flush: Option<&DeviceBuf>, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        for _ in 0..WARMUP {
            f()?;
        }
        let mut v = Vec::with_capacity(RUNS);
        for i in 0..RUNS {
            if let Some(buf) = flush {
                buf.fill(i as u8, self.stream)?;
            }
            // SAFETY: live events on a live stream; the sync is the measurement itself.
            unsafe {
                event::record(self.start, self.stream).map_err(err)?;
                f()?;
                event::record(self.end, self.stream).map_err(err)?;
                event::synchronize(self.end).map_err(err)?;
                v.push(event::elapsed(self.start, self.end).map_err(err)? as f64 * 1e3);
            }
        }
        Ok(median(v))
    }

    /// Waits for everything issued so far on the stream (records the end event).
    pub fn wait(&self) -> Result<(), String> {
        // SAFETY: live event and stream.
        unsafe {
            event::record(self.end, self.stream).map_err(err)?;
            event::synchronize(self.end).map_err(err)
        }
    }
}

/// Device-to-device copy bandwidth (bytes read + written per second) and dense bf16 GEMM
/// rate (FLOP/s), measured on this GPU now.
pub fn ceilings(stream: CUstream) -> Result<Ceilings, String> {
    use cudarc::cublas::sys as cublas;
    let t = Timer::new(stream)?;
    let bytes = 2usize << 30;
    let (a, b) = (DeviceBuf::new(bytes)?, DeviceBuf::new(bytes)?);
    // SAFETY: the copy stays inside both allocations.
    let copy_us = t.time(|| unsafe { result::memcpy_dtod_async(b.ptr, a.ptr, bytes, stream) }.map_err(err))?;
    let mut h = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the handle is destroyed below.
    if unsafe { cublas::cublasCreate_v2(&mut h) } != cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err("cublasCreate failed".into());
    }
    // SAFETY: live handle and stream.
    unsafe { cublas::cublasSetStream_v2(h, stream as _) };
    let n = 8192i32;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let gemm_us = t.time(|| {
        // SAFETY: 8192² bf16 operands fit in the 2 GiB buffers (a: A and B, b: C).
        let s = unsafe {
            cublas::cublasGemmEx(
                h,
                cublas::cublasOperation_t::CUBLAS_OP_T,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                n,
                n,
                n,
                &alpha as *const f32 as *const c_void,
                a.ptr as *const c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                n,
                (a.ptr + (n as u64 * n as u64 * 2)) as *const c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                n,
                &beta as *const f32 as *const c_void,
                b.ptr as *mut c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                n,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if s == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(format!("{s:?}"))
        }
    })?;
    t.wait()?;
    // SAFETY: created above; the stream is idle.
    unsafe { cublas::cublasDestroy_v2(h) };
    Ok(Ceilings {
        copy_bytes_per_s: 2.0 * bytes as f64 / (copy_us * 1e-6),
        bf16_flops_per_s: 2.0 * (n as f64).powi(3) / (gemm_us * 1e-6),
    })
}

#[cfg(test)]
mod tests {
    use super::{median, percentile};

    #[test]
    fn percentile_is_the_nearest_rank() {
        let v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        assert_eq!(percentile(v.clone(), 0.9), 9.0);
        assert_eq!(percentile(v.clone(), 1.0), 10.0);
        assert_eq!(percentile(v.clone(), 0.01), 1.0);
        assert_eq!(percentile(v.clone(), 0.5), 5.0);
        assert_eq!(median(v), 6.0);
        assert!(percentile(Vec::new(), 0.9).is_nan());
    }
}
