//! Kernels loaded from the plan, and every launch of a bucket issued on a stream — eagerly
//! or under stream capture (`graph.rs`).
//!
//! A kernel takes one parameter struct; it is packed here from the launch's argument list
//! at the offsets of the entry's declared fields (the layout `#[derive(KernelParams)]`
//! computed and the C side asserts), never from anything the plan says about layout.

use std::ffi::c_void;

use cudarc::driver::{result, sys};
use specplan_format::{ArgValue, BucketPlan, GemmDesc, LaunchKind, Plan};
use specplan_kernels::abi::{Abi, FieldKind, Slot};

use super::device::{cuda, cuda_rc, GpuError, Module};
use super::gemm::Gemms;
use super::lt::{GemmPtrs, GemmShape};
use super::memory::Memory;
use super::prefetch::{self, Branches};

/// The GEMM shape and operand addresses of a plan GEMM.
pub(crate) fn gemm_call(mem: &Memory, plan: &Plan, b: &BucketPlan, g: &GemmDesc) -> (GemmShape, GemmPtrs) {
    let dt = |id: u32| b.buffers.get(id as usize).map_or(plan.capture.dtype, |x| x.dtype);
    let off = |id: u32| b.buffers.get(id as usize).map_or(0, |x| x.offset);
    let w = plan.weights.get(g.w as usize);
    let ptrs = GemmPtrs {
        w: mem.weights.get(g.w as usize).copied().unwrap_or(0),
        a: mem.arena.ptr + off(g.a),
        c: mem.arena.ptr + off(g.c),
        r: g.rounded.map_or(0, |r| mem.arena.ptr + off(r)),
    };
    (
        GemmShape {
            m: g.m as u32,
            n: g.n as u32,
            k: g.k as u32,
            lda: g.lda as u32,
            accumulate: g.accumulate,
            rounded: g.rounded.is_some(),
            w: w.map_or(plan.capture.dtype, |x| x.dtype),
            a: dt(g.a),
            c: dt(g.c),
            align: ptrs.align(),
        },
        ptrs,
    )
}

/// Packs a parameter struct of `abi` from arguments in field order: each at its declared
/// field's offset (pointers as 8 bytes, `u32`s as 4).
pub(crate) fn pack_slots(abi: &Abi, args: &[Slot<u64>]) -> Vec<u8> {
    let mut out = vec![0u8; abi.size as usize];
    for (a, f) in args.iter().zip(abi.fields) {
        let at = f.offset as usize;
        match (f.kind, a) {
            (FieldKind::U32, Slot::U32(x)) => out[at..at + 4].copy_from_slice(&x.to_le_bytes()),
            (FieldKind::Ptr(_), Slot::Ptr(v)) => out[at..at + 8].copy_from_slice(&v.to_le_bytes()),
            // A validated plan (or a typed runtime launch) never mixes kinds.
            _ => {}
        }
    }
    out
}

/// Packs a plan launch's parameter struct, its arguments resolved against `mem`.
pub(crate) fn pack(mem: &Memory, plan: &Plan, b: &BucketPlan, kernel: u32, args: &[ArgValue]) -> Vec<u8> {
    let Some(k) = plan.kernels.get(kernel as usize) else {
        return Vec::new();
    };
    let slots: Vec<Slot<u64>> = args
        .iter()
        .map(|a| match a {
            ArgValue::U32(x) => Slot::U32(*x),
            v => Slot::Ptr(mem.arg_ptr(plan, b, v)),
        })
        .collect();
    pack_slots(&k.entry.abi(), &slots)
}

/// Launches one kernel with a packed parameter struct on `stream`.
pub(crate) fn launch_packed(
    func: sys::CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    blob: &mut [u8],
    stream: sys::CUstream,
) -> Result<(), GpuError> {
    let mut params = [blob.as_mut_ptr() as *mut c_void];
    // SAFETY: the function belongs to a loaded module; `params` points at a struct laid out
    // as the kernel declares (`pack_slots`), alive until the call returns (the driver copies
    // it); every address inside is within an allocation of this runtime or one the caller
    // registered.
    cuda("cuLaunchKernel", unsafe {
        result::launch_kernel(
            func,
            (grid[0], grid[1], grid[2]),
            (block[0], block[1], block[2]),
            smem,
            stream,
            &mut params,
        )
    })
}

/// Launches one kernel as thread block clusters of `cluster` CTAs along z (the grid's z is
/// a multiple of it: validated), with `cuLaunchKernelEx`.
fn launch_cluster(
    func: sys::CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    cluster: u32,
    blob: &mut [u8],
    stream: sys::CUstream,
) -> Result<(), GpuError> {
    let mut params = [blob.as_mut_ptr() as *mut c_void];
    let mut attr = cluster_attr(cluster);
    let config = cluster_config(grid, block, smem, stream, &mut attr);
    // SAFETY: as `launch_packed`; `config` and its one attribute live until the call returns.
    let rc = unsafe { sys::cuLaunchKernelEx(&config, func, params.as_mut_ptr(), std::ptr::null_mut()) };
    cuda_rc("cuLaunchKernelEx", rc)
}

/// The launch attribute of clusters of `cluster` CTAs along z.
fn cluster_attr(cluster: u32) -> sys::CUlaunchAttribute {
    // SAFETY: a zeroed attribute is a plain C value; its id and value are set before use.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: 1, y: 1, z: cluster };
    attr
}

/// A launch configuration with the one attribute `attr` (which must outlive its use).
fn cluster_config(
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    stream: sys::CUstream,
    attr: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid[0],
        gridDimY: grid[1],
        gridDimZ: grid[2],
        blockDimX: block[0],
        blockDimY: block[1],
        blockDimZ: block[2],
        sharedMemBytes: smem,
        hStream: stream,
        attrs: attr,
        numAttrs: 1,
    }
}

/// What issuing needs: the plan, its memory, its functions and GEMMs.
pub(crate) struct Launcher<'a> {
    pub plan: &'a Plan,
    pub mem: &'a Memory,
    pub funcs: &'a [sys::CUfunction],
    pub gemms: &'a Gemms,
    /// A sharded plan's communicator (`GpuRuntime::core` holds one exactly then).
    pub comm: Option<&'a super::Communicator>,
    pub stream: sys::CUstream,
    /// While a graph is captured with L2 branches on: the branches to add (`prefetch.rs`).
    pub branches: Option<Branches>,
}

impl Launcher<'_> {
    /// Bucket `bi` of the plan's flat bucket list (`Plan::flat_bucket`: every phase's).
    fn bucket(&self, bi: usize) -> Result<&specplan_format::BucketPlan, GpuError> {
        self.plan
            .flat_bucket(bi)
            .ok_or_else(|| GpuError::Step(format!("no bucket {bi} in the plan's {}", self.plan.bucket_count())))
    }

    /// Issues the launches of bucket `bi` whose op name passes `keep`, in order.
    pub fn issue(&self, bi: usize, keep: &dyn Fn(&str) -> bool) -> Result<(), GpuError> {
        let n = self.bucket(bi)?.launches.len();
        self.issue_range(bi, 0..n, keep)
    }

    /// Issues launches `range` of bucket `bi` whose op name passes `keep`, in order.
    pub fn issue_range(
        &self,
        bi: usize,
        range: std::ops::Range<usize>,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<(), GpuError> {
        // L2 branches (capture only): where each forks among the launches issued here.
        let forks = self.forks(bi, range.clone(), keep)?;
        self.issue_forking(bi, range, keep, &forks)
    }

    /// Issues launches `span` of bucket `bi`, one part of the whole list `whole` that a
    /// caller issues in several calls with nodes of its own between them (the timeline's
    /// event records): the L2 branches fork where they would in `whole` issued at once.
    pub fn issue_span(
        &self,
        bi: usize,
        span: std::ops::Range<usize>,
        whole: std::ops::Range<usize>,
    ) -> Result<(), GpuError> {
        let forks = self.forks(bi, whole, &|_| true)?;
        self.issue_forking(bi, span, &|_| true, &forks)
    }

    /// The L2 branches' forks when launches `range` of bucket `bi` passing `keep` are issued
    /// (none unless capturing with branches).
    fn forks(
        &self,
        bi: usize,
        range: std::ops::Range<usize>,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<(usize, prefetch::Window)>, GpuError> {
        let b = self.bucket(bi)?;
        Ok(match self.branches {
            Some(br) => prefetch::forks(self.plan, b, br.opts, range, keep),
            None => Vec::new(),
        })
    }

    /// Issues launches `range` of bucket `bi` passing `keep`, each preceded by the branches
    /// of `forks` that fork at it.
    fn issue_forking(
        &self,
        bi: usize,
        range: std::ops::Range<usize>,
        keep: &dyn Fn(&str) -> bool,
        forks: &[(usize, prefetch::Window)],
    ) -> Result<(), GpuError> {
        let b = self.bucket(bi)?;
        let first = range.start;
        let launches = b.launches.get(range).unwrap_or(&[]);
        for (i, l) in launches.iter().enumerate().filter(|(_, l)| keep(&l.op)) {
            if let Some(br) = self.branches {
                for (_, w) in forks.iter().filter(|(at, _)| *at == first + i) {
                    // A weight the runtime does not hold gets no branch (never address 0).
                    if let Some(&ptr) = self.mem.weights.get(w.weight as usize).filter(|&&p| p != 0) {
                        br.add(self.stream, w, ptr)?;
                    }
                }
            }
            match &l.kind {
                LaunchKind::Gemm(g) => {
                    let (shape, ptrs) = gemm_call(self.mem, self.plan, b, g);
                    self.gemms.run(&shape, ptrs, self.stream)?
                }
                LaunchKind::Collective(c) => {
                    let tp = self.plan.capture.tp;
                    let comm = self.comm.ok_or(GpuError::NoCommunicator {
                        size: tp.size,
                        rank: tp.rank,
                    })?;
                    let at = |id: u32| self.mem.arena.ptr + b.buffers.get(id as usize).map_or(0, |x| x.offset);
                    comm.issue(c, at(c.send), at(c.recv), self.stream)?;
                }
                LaunchKind::Kernel {
                    kernel,
                    grid,
                    block,
                    smem,
                    cluster,
                    args,
                } => {
                    let mut blob = pack(self.mem, self.plan, b, *kernel, args);
                    let f = self.funcs[*kernel as usize];
                    if *cluster > 1 {
                        launch_cluster(f, *grid, *block, *smem, *cluster, &mut blob, self.stream)?;
                    } else {
                        launch_packed(f, *grid, *block, *smem, &mut blob, self.stream)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Loads every kernel: the CUBIN, or the PTX when the CUBIN does not load. Kernels whose
/// dynamic shared memory exceeds the 48 KiB default opt in to more.
pub(crate) fn load_kernels(plan: &Plan) -> Result<(Vec<Module>, Vec<sys::CUfunction>), GpuError> {
    let mut modules = Vec::new();
    let mut funcs = Vec::new();
    for k in &plan.kernels {
        let bin = k
            .binary
            .as_ref()
            .ok_or_else(|| GpuError::NoBinary { kernel: k.name.clone() })?;
        // SAFETY: the CUBIN is an ELF image whose header tables lie inside it (validated);
        // the driver checks the rest and returns an error (not UB) on a bad image.
        let loaded = unsafe { result::module::load_data(bin.cubin.as_ptr() as *const c_void) };
        let module = match loaded {
            Ok(m) => m,
            Err(e1) => {
                let mut ptx = bin.ptx.clone().into_bytes();
                ptx.push(0);
                // SAFETY: a NUL-terminated PTX string (validated NUL-free before the end).
                unsafe { result::module::load_data(ptx.as_ptr() as *const c_void) }.map_err(|e2| GpuError::Load {
                    kernel: k.name.clone(),
                    message: format!("CUBIN: {e1:?}; PTX: {e2:?}"),
                })?
            }
        };
        modules.push(Module(module));
        let name = std::ffi::CString::new(k.entry.name()).map_err(|e| GpuError::Load {
            kernel: k.name.clone(),
            message: e.to_string(),
        })?;
        // SAFETY: the module is loaded; the name is NUL-terminated.
        let f = cuda("cuModuleGetFunction", unsafe {
            result::module::get_function(module, name)
        })?;
        funcs.push(f);
    }
    for (_, b) in plan.all_buckets() {
        for l in &b.launches {
            if let LaunchKind::Kernel {
                kernel,
                cluster,
                grid,
                block,
                smem,
                ..
            } = &l.kind
            {
                if *smem > 48 * 1024 {
                    // SAFETY: a loaded function; the value is ≤ the validated 227 KiB limit.
                    let rc = unsafe {
                        sys::cuFuncSetAttribute(
                            funcs[*kernel as usize],
                            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            *smem as i32,
                        )
                    };
                    cuda_rc("cuFuncSetAttribute", rc)?;
                }
                if *cluster > 8 {
                    // Clusters above 8 CTAs (at most 16: validated) are non-portable: the
                    // function opts in, and the GPU must be able to co-schedule one.
                    // SAFETY: a loaded function; the attribute is a boolean.
                    let rc = unsafe {
                        sys::cuFuncSetAttribute(
                            funcs[*kernel as usize],
                            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                            1,
                        )
                    };
                    cuda_rc("cuFuncSetAttribute", rc)?;
                }
                if *cluster > 1 {
                    cluster_fits(funcs[*kernel as usize], *grid, *block, *smem, *cluster, &l.op)?;
                }
            }
        }
    }
    Ok((modules, funcs))
}

/// Refuses a clustered launch the GPU cannot run (no cluster of that many CTAs, with this
/// shared memory, fits on it), naming the launch, before any graph is built.
fn cluster_fits(
    func: sys::CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    cluster: u32,
    op: &str,
) -> Result<(), GpuError> {
    let mut attr = cluster_attr(cluster);
    let config = cluster_config(grid, block, smem, std::ptr::null_mut(), &mut attr);
    let mut n = 0i32;
    // SAFETY: a loaded function; `config` and `n` are valid for the call.
    let rc = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func, &config) };
    cuda_rc("cuOccupancyMaxActiveClusters", rc)?;
    if n < 1 {
        return Err(GpuError::Load {
            kernel: op.to_string(),
            message: format!("this GPU cannot run clusters of {cluster} CTAs with {smem} bytes of shared memory each"),
        });
    }
    Ok(())
}
