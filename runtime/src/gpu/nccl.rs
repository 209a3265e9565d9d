//! NCCL for a sharded plan's collective launches (docs/tensor-parallel.md, "Collectives
//! inside the graphs").
//!
//! A collective launch is issued on the runtime's stream like any kernel, so stream capture
//! records it into the bucket's graph (NCCL ≥ 2.9 supports capture); its buffers are arena
//! buffers, whose addresses are fixed once the arena is allocated, so the captured graph
//! replays on them. NCCL is loaded at run time (cudarc's dynamic loading): a machine
//! without it builds and runs every unsharded plan, and a sharded one is refused by name.
//!
//! The communicator is the engine's (SGLang's and vLLM's `get_tp_group()` hold an NCCL
//! communicator; its `ncclComm_t` is handed in by address) or made here for the devices of
//! one process ([`Communicator::init_all`], what the tests use).

use cudarc::driver::sys as cu;
use cudarc::nccl::{result as nccl, sys};
use specplan_format::{CollectiveDesc, CollectiveOp, DType, TensorParallel};

use super::device::GpuError;

/// One rank's NCCL communicator.
pub struct Communicator {
    comm: sys::ncclComm_t,
    size: u32,
    rank: u32,
    /// Made here (destroyed on drop) or borrowed from the engine (left to it).
    owned: bool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the runtime
// that holds it issues its collectives from the one thread that owns the runtime.
unsafe impl Send for Communicator {}
// SAFETY: shared references only read `size` and `rank`; NCCL calls take `&self` but every
// caller is the runtime, whose `&mut self` step methods serialize them.
unsafe impl Sync for Communicator {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.rank, self.size)
    }
}

fn err(call: &'static str, e: nccl::NcclError) -> GpuError {
    GpuError::Nccl {
        call,
        status: format!("{:?}", e.0),
    }
}

impl Communicator {
    /// Whether `libnccl.so` loads on this machine.
    pub fn available() -> bool {
        // SAFETY: only probes dlopen candidates.
        unsafe { sys::is_culib_present() }
    }

    /// One communicator per device of this process, rank i on `devices[i]`
    /// (`ncclCommInitAll`).
    pub fn init_all(devices: &[i32]) -> Result<Vec<Communicator>, GpuError> {
        if !Self::available() {
            return Err(GpuError::NoNccl);
        }
        let n = devices.len();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for one communicator per device of `devices`.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, devices.as_ptr()) }
            .map_err(|e| err("ncclCommInitAll", e))?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| Communicator {
                comm,
                size: n as u32,
                rank: r as u32,
                owned: true,
            })
            .collect())
    }

    /// An engine's communicator by address (its `ncclComm_t`), used in place and never
    /// destroyed here.
    ///
    /// # Safety
    /// SAFETY: `addr` is a live `ncclComm_t` of this process that outlives the returned
    /// value and every runtime built with it, and no other thread issues on it while the
    /// runtime does.
    pub unsafe fn borrowed(addr: usize) -> Result<Communicator, GpuError> {
        if !Self::available() {
            return Err(GpuError::NoNccl);
        }
        if addr == 0 {
            return Err(GpuError::Input(crate::step::input_error(
                "communicator",
                String::new(),
                "is a null ncclComm_t".into(),
            )));
        }
        let comm = addr as sys::ncclComm_t;
        // SAFETY: the caller guarantees `comm` is a live communicator.
        let size = unsafe { nccl::comm_count(comm) }.map_err(|e| err("ncclCommCount", e))?;
        // SAFETY: as above.
        let rank = unsafe { nccl::comm_user_rank(comm) }.map_err(|e| err("ncclCommUserRank", e))?;
        Ok(Communicator {
            comm,
            size: size as u32,
            rank: rank as u32,
            owned: false,
        })
    }

    pub fn size(&self) -> u32 {
        self.size
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The communicator's rank and size are the plan's.
    pub(crate) fn check(&self, tp: TensorParallel) -> Result<(), GpuError> {
        if self.size != tp.size || self.rank != tp.rank {
            return Err(GpuError::CommunicatorMismatch {
                comm: format!("rank {} of {}", self.rank, self.size),
                plan: format!("rank {} of {}", tp.rank, tp.size),
            });
        }
        Ok(())
    }

    /// Issues collective `c` on `stream` over device addresses `send` and `recv` (arena
    /// buffers the validator sized: `count` elements, `size·count` for a gather's `recv`).
    pub(crate) fn issue(&self, c: &CollectiveDesc, send: u64, recv: u64, stream: cu::CUstream) -> Result<(), GpuError> {
        let dtype = match c.dtype {
            DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
            DType::F16 => sys::ncclDataType_t::ncclFloat16,
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            other => {
                return Err(GpuError::Step(format!(
                    "a {} of {} (collectives move activations or f32)",
                    c.op.name(),
                    other.name()
                )))
            }
        };
        let stream = stream as sys::cudaStream_t;
        let (s, r) = (send as *const std::ffi::c_void, recv as *mut std::ffi::c_void);
        let count = c.count as usize;
        match c.op {
            // SAFETY: `send` and `recv` are arena buffers of `count` elements (validated),
            // the communicator is live, and `stream` is the runtime's.
            CollectiveOp::AllReduceSum => {
                unsafe { nccl::all_reduce(s, r, count, dtype, sys::ncclRedOp_t::ncclSum, self.comm, stream) }
                    .map_err(|e| err("ncclAllReduce", e))?
            }
            // SAFETY: as above; `recv` holds `size · count` elements.
            CollectiveOp::AllGather => unsafe { nccl::all_gather(s, r, count, dtype, self.comm, stream) }
                .map_err(|e| err("ncclAllGather", e))?,
        };
        Ok(())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: a communicator made by `init_all`, destroyed once; an error at
            // teardown has no one to report to.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}

/// What [`selftest`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Selftest {
    /// `ncclGetVersion` (e.g. 22703 for 2.27.3).
    pub version: i32,
    /// Elements of each collective.
    pub elems: usize,
    /// The in-place bf16 all-reduce left its buffer as it was (a one-rank sum).
    pub all_reduce_exact: bool,
    /// The f32 all-gather's output equals its input (every poisoned element overwritten).
    pub all_gather_exact: bool,
    /// Mean time of one replay of the captured graph of both collectives, µs.
    pub graph_us: f64,
}

/// The NCCL path of a sharded plan on one GPU: a one-rank communicator on `device`
/// (`init_all`), an in-place bf16 all-reduce and an f32 all-gather of `elems` elements
/// issued through [`Communicator::issue`] into a captured graph, replayed, and the results
/// read back. Synchronizes; for tests (`gpucheck nccl`), never on a replay path.
pub fn selftest(device: usize, elems: usize) -> Result<Selftest, GpuError> {
    use super::device::{cuda, cuda_rc, DevMem, Event};
    use cudarc::driver::{result, CudaContext};
    let ctx = cuda("cuCtx", CudaContext::new(device))?;
    let stream = cuda("cuStreamCreate", ctx.new_stream())?;
    let version = nccl::get_nccl_version().map_err(|e| err("ncclGetVersion", e))?;
    let comms = Communicator::init_all(&[device as i32])?;
    let comm = comms.first().ok_or(GpuError::NoNccl)?;
    let (x, y, g) = (
        DevMem::new(elems * 2)?,
        DevMem::new(elems * 4)?,
        DevMem::new(elems * 4)?,
    );
    let xs: Vec<u16> = (0..elems)
        .map(|i| half::bf16::from_f32((i % 251) as f32 - 125.0).to_bits())
        .collect();
    let ys: Vec<f32> = (0..elems).map(|i| i as f32 * 0.5 - 7.0).collect();
    let nan = vec![f32::NAN; elems];
    // SAFETY: each buffer holds `elems` elements of its type.
    unsafe {
        cuda("cuMemcpyHtoD", result::memcpy_htod_sync(x.ptr, &xs))?;
        cuda("cuMemcpyHtoD", result::memcpy_htod_sync(y.ptr, &ys))?;
        cuda("cuMemcpyHtoD", result::memcpy_htod_sync(g.ptr, &nan))?;
    }
    // The collectives run on `stream`, which is non-blocking: it does not wait for the legacy
    // stream's uploads above (a pageable-memory upload may return before it lands).
    cuda("cuCtxSynchronize", result::ctx::synchronize())?;
    let reduce = CollectiveDesc {
        op: CollectiveOp::AllReduceSum,
        send: 0,
        recv: 0,
        count: elems as u64,
        dtype: DType::Bf16,
    };
    let gather = CollectiveDesc {
        op: CollectiveOp::AllGather,
        send: 1,
        recv: 2,
        count: elems as u64,
        dtype: DType::F32,
    };
    let s = stream.cu_stream();
    let exec = super::graph::capture(&stream, None, || {
        comm.issue(&reduce, x.ptr, x.ptr, s)?;
        comm.issue(&gather, y.ptr, g.ptr, s)
    })?;
    exec.launch()?;
    let (e0, e1) = (Event::new(true)?, Event::new(true)?);
    const REPLAYS: usize = 100;
    // SAFETY: live events recorded on the live stream.
    cuda_rc("cuEventRecord", unsafe { cudarc::driver::sys::cuEventRecord(e0.0, s) })?;
    for _ in 0..REPLAYS {
        exec.launch()?;
    }
    // SAFETY: as above.
    cuda_rc("cuEventRecord", unsafe { cudarc::driver::sys::cuEventRecord(e1.0, s) })?;
    cuda("cuStreamSynchronize", stream.synchronize())?;
    // SAFETY: both events completed (the stream is synchronized).
    let ms = cuda("cuEventElapsedTime", unsafe { result::event::elapsed(e0.0, e1.0) })?;
    let (mut xb, mut gb) = (vec![0u16; elems], vec![0f32; elems]);
    // SAFETY: as the uploads.
    unsafe {
        cuda("cuMemcpyDtoH", result::memcpy_dtoh_sync(&mut xb, x.ptr))?;
        cuda("cuMemcpyDtoH", result::memcpy_dtoh_sync(&mut gb, g.ptr))?;
    }
    Ok(Selftest {
        version,
        elems,
        all_reduce_exact: xb == xs,
        all_gather_exact: gb.iter().zip(&ys).all(|(a, b)| a.to_bits() == b.to_bits()),
        graph_us: ms as f64 * 1e3 / REPLAYS as f64,
    })
}
