//! Device-side RAII and the error type of the GPU runtime, shared by every GPU module
//! (allocations, pinned host memory, modules, events, the cuBLAS handle).

use std::ffi::c_void;

use cudarc::cublas::sys as cublas;
use cudarc::driver::{result, sys};

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver (libcuda.so.1) or no GPU on this machine")]
    NoDriver,
    #[error("capture.tp: the plan is rank {rank} of tp size {size}; its collective launches need the ranks' NCCL communicator (GpuOptions::communicator), and none was given")]
    NoCommunicator { size: u32, rank: u32 },
    #[error("capture.tp: the communicator is {comm}, the plan is {plan}")]
    CommunicatorMismatch { comm: String, plan: String },
    #[error("no NCCL (libnccl.so) on this machine: a sharded plan's collectives need it")]
    NoNccl,
    #[error("NCCL call {call} failed with {status}")]
    Nccl { call: &'static str, status: String },
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
    #[error("the plan has no bucket of batch {batch} (buckets: {buckets})")]
    NoBucket { batch: u32, buckets: String },
    #[error("bucket {batch} has no buffer {name}")]
    NoBuffer { batch: u32, name: String },
    #[error("{what}: {bytes} bytes, expected {expected}")]
    Size {
        what: String,
        bytes: usize,
        expected: usize,
    },
    #[error("KV cache: {0}")]
    Pool(String),
    #[error("registration: {0}")]
    Registration(String),
    #[error("engine-memory step: {0}")]
    Step(String),
    #[error("{0} is not available in this runtime's memory mode")]
    Mode(&'static str),
}

pub(crate) fn cuda<T>(call: &'static str, r: Result<T, result::DriverError>) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Cuda {
        call,
        message: format!("{e:?}"),
    })
}

pub(crate) fn cuda_rc(call: &'static str, rc: sys::CUresult) -> Result<(), GpuError> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            call,
            message: format!("{rc:?}"),
        })
    }
}

pub(crate) fn cublas_ok(call: &'static str, s: cublas::cublasStatus_t) -> Result<(), GpuError> {
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
pub(crate) struct DevMem {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

impl From<crate::registration::RegError> for GpuError {
    fn from(e: crate::registration::RegError) -> GpuError {
        match e {
            crate::registration::RegError::Registration(m) => GpuError::Registration(m),
            crate::registration::RegError::Weights(m) => GpuError::Weights(m),
        }
    }
}

impl DevMem {
    pub fn new(bytes: usize) -> Result<DevMem, GpuError> {
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
pub(crate) struct Pinned {
    pub ptr: *mut u8,
    pub bytes: usize,
}

impl Pinned {
    pub fn new(bytes: usize) -> Result<Pinned, GpuError> {
        // SAFETY: a plain page-locked allocation.
        let ptr = cuda("cuMemHostAlloc", unsafe { result::malloc_host(bytes.max(64), 0) })? as *mut u8;
        Ok(Pinned {
            ptr,
            bytes: bytes.max(64),
        })
    }
    pub fn as_mut(&mut self) -> &mut [u8] {
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

/// Page-locked host memory mapped into the device's address space (`dev` is its device
/// address): the device writes it with plain stores, the host reads it once the writer has
/// completed (an event), with no copy call and no wait. Freed on drop.
pub(crate) struct Mapped {
    ptr: *mut u64,
    words: usize,
    pub dev: u64,
}

impl Mapped {
    pub fn new(words: usize) -> Result<Mapped, GpuError> {
        let bytes = (words * 8).max(64);
        // SAFETY: a page-locked allocation mapped into the current context's device.
        let ptr = cuda("cuMemHostAlloc", unsafe {
            result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        })? as *mut u64;
        // Owned from here: an error below frees it (once, through Drop).
        let mut mapped = Mapped { ptr, words, dev: 0 };
        // SAFETY: `ptr` is a mapped allocation of this context; out-pointer to a field.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mapped.dev, ptr as *mut c_void, 0) };
        cuda_rc("cuMemHostGetDevicePointer", rc)?;
        Ok(mapped)
    }

    /// Word `i` (volatile: the device writes it); 0 past the end.
    pub fn read(&self, i: usize) -> u64 {
        if i >= self.words {
            return 0;
        }
        // SAFETY: `i` is inside the allocation; a volatile read of memory the device may
        // have written (the caller waited for the writer's completion event).
        unsafe { std::ptr::read_volatile(self.ptr.add(i)) }
    }

    /// Bytes `[0, len)` (at most the allocation) for the host to write. The caller makes
    /// sure no device work reads or writes them meanwhile (`GraphStaging`: the kernel that
    /// read them has marked them consumed; its control words lie past `len`).
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        let len = len.min(self.words * 8);
        // SAFETY: `len` bytes inside the allocation, borrowed mutably through `&mut self`;
        // no device access to them overlaps the borrow (the caller's contract above).
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, len) }
    }

    /// The allocation's host address (for a copy that reads it).
    pub fn host_ptr(&self) -> *const u8 {
        self.ptr as *const u8
    }

    /// Sets word `i` (ignored past the end).
    pub fn write(&self, i: usize, v: u64) {
        if i >= self.words {
            return;
        }
        // SAFETY: `i` is inside the allocation; no kernel writes it before the first step.
        unsafe { std::ptr::write_volatile(self.ptr.add(i), v) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

pub(crate) struct Module(pub sys::CUmodule);

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by cuModuleLoadData, unloaded once.
        let _ = unsafe { sys::cuModuleUnload(self.0) };
    }
}

pub(crate) struct BlasHandle(pub cublas::cublasHandle_t);

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created by cublasCreate, destroyed once.
        let _ = unsafe { cublas::cublasDestroy_v2(self.0) };
    }
}

/// An event, destroyed on drop (also when the code that made it returns early).
pub(crate) struct Event(pub sys::CUevent);

impl Event {
    /// `timing`: an event for elapsed-time measurement; else the cheaper kind.
    pub fn new(timing: bool) -> Result<Event, GpuError> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        Ok(Event(cuda("cuEventCreate", result::event::create(flags))?))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// The CUDA driver and its GPUs, for diagnostics (`specplan doctor`): driver version,
/// device count, and per device its name, compute capability and memory. Creates no
/// context; an absent driver is reported, not an error.
pub fn driver_report() -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    // SAFETY: probing dlopen candidates has no preconditions; it only loads libraries.
    if !unsafe { sys::is_culib_present() } {
        out.insert("driver".into(), "no CUDA driver (libcuda.so.1) on this machine".into());
        return out;
    }
    if let Err(e) = result::init() {
        out.insert("driver".into(), format!("libcuda loads, but cuInit failed: {e:?}"));
        return out;
    }
    let mut version = 0;
    // SAFETY: out-pointer to a local.
    if unsafe { sys::cuDriverGetVersion(&mut version) } == sys::CUresult::CUDA_SUCCESS {
        out.insert(
            "driver".into(),
            format!("CUDA {}.{}", version / 1000, (version % 1000) / 10),
        );
    }
    let count = result::device::get_count().unwrap_or(0);
    out.insert("gpus".into(), count.to_string());
    for i in 0..count {
        let Ok(dev) = result::device::get(i) else { continue };
        let name = result::device::get_name(dev).unwrap_or_else(|_| "?".into());
        let attr = |a| {
            // SAFETY: a valid device handle and a documented attribute.
            unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0)
        };
        use sys::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJ, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MIN,
        };
        // SAFETY: a valid device handle.
        let mem = unsafe { result::device::total_mem(dev) }.unwrap_or(0);
        out.insert(
            format!("gpu{i}"),
            format!(
                "{name}, sm_{}{}, {:.1} GiB",
                attr(MAJ),
                attr(MIN),
                mem as f64 / (1u64 << 30) as f64
            ),
        );
    }
    out
}
