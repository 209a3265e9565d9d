//! Kernels loaded from the plan, and every launch of a bucket issued on a stream — eagerly
//! or under stream capture (one capture function for whole buckets and filtered subsets).
//!
//! A kernel takes one parameter struct; it is packed here from the launch's argument list
//! at the offsets of the entry's declared fields (the layout `#[derive(KernelParams)]`
//! computed and the C side asserts), never from anything the plan says about layout.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaGraph, CudaStream};
use specplan_format::{ArgValue, BucketPlan, GemmDesc, KvKind, LaunchKind, Plan};
use specplan_kernels::abi::FieldKind;

use super::device::{cuda, cuda_rc, GpuError, Module};
use super::gemm::Gemms;
use super::lt::{GemmPtrs, GemmShape};

/// Base addresses of the runtime's device regions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Regions {
    pub arena: u64,
    pub weights: u64,
    /// K/V pools: layer-major, K then V, `pool_pages` pages each.
    pub kv: u64,
    pub kv_pool_bytes: u64,
    pub table: u64,
}

impl Regions {
    /// The device address an argument names (0 for null and `u32`s).
    pub fn arg_ptr(&self, plan: &Plan, b: &BucketPlan, v: &ArgValue) -> u64 {
        match v {
            ArgValue::Buffer(id) => self.arena + b.buffers.get(*id as usize).map_or(0, |x| x.offset),
            ArgValue::Weight(id) => self.weights + plan.weights.get(*id as usize).map_or(0, |x| x.offset),
            ArgValue::KvCache { layer, kind } => {
                let which = *layer as u64 * 2 + (*kind == KvKind::V) as u64;
                self.kv + which * self.kv_pool_bytes
            }
            ArgValue::PageTable => self.table,
            ArgValue::Null | ArgValue::U32(_) => 0,
        }
    }

    pub fn gemm(&self, plan: &Plan, b: &BucketPlan, g: &GemmDesc) -> (GemmShape, GemmPtrs) {
        let dt = |id: u32| b.buffers.get(id as usize).map_or(plan.capture.dtype, |x| x.dtype);
        let off = |id: u32| b.buffers.get(id as usize).map_or(0, |x| x.offset);
        let w = plan.weights.get(g.w as usize);
        (
            GemmShape {
                m: g.m as u32,
                n: g.n as u32,
                k: g.k as u32,
                accumulate: g.accumulate,
                w: w.map_or(plan.capture.dtype, |x| x.dtype),
                a: dt(g.a),
                c: dt(g.c),
            },
            GemmPtrs {
                w: self.weights + w.map_or(0, |x| x.offset),
                a: self.arena + off(g.a),
                c: self.arena + off(g.c),
            },
        )
    }
}

/// Packs a kernel's parameter struct: each argument at its declared field's offset.
pub(crate) fn pack(regions: &Regions, plan: &Plan, b: &BucketPlan, kernel: u32, args: &[ArgValue]) -> Vec<u8> {
    let Some(k) = plan.kernels.get(kernel as usize) else {
        return Vec::new();
    };
    let abi = k.entry.abi();
    let mut out = vec![0u8; abi.size as usize];
    for (a, f) in args.iter().zip(abi.fields) {
        let at = f.offset as usize;
        match (f.kind, a) {
            (FieldKind::U32, ArgValue::U32(x)) => out[at..at + 4].copy_from_slice(&x.to_le_bytes()),
            (FieldKind::Ptr(_), v) => out[at..at + 8].copy_from_slice(&regions.arg_ptr(plan, b, v).to_le_bytes()),
            // A validated plan never mixes kinds; a zero is what a mismatch would read.
            (FieldKind::U32, _) => {}
        }
    }
    out
}

/// What issuing needs: the plan, where its regions are, its functions and GEMMs.
pub(crate) struct Launcher<'a> {
    pub plan: &'a Plan,
    pub regions: Regions,
    pub funcs: &'a [sys::CUfunction],
    pub gemms: &'a Gemms,
    pub stream: sys::CUstream,
}

impl Launcher<'_> {
    /// Issues the launches of bucket `bi` whose op name passes `keep`, in order.
    pub fn issue(&self, bi: usize, keep: &dyn Fn(&str) -> bool) -> Result<(), GpuError> {
        let b = &self.plan.buckets[bi];
        for l in b.launches.iter().filter(|l| keep(&l.op)) {
            match &l.kind {
                LaunchKind::Gemm(g) => {
                    let (shape, ptrs) = self.regions.gemm(self.plan, b, g);
                    self.gemms.run(&shape, ptrs, self.stream)?
                }
                LaunchKind::Kernel {
                    kernel,
                    grid,
                    block,
                    smem,
                    args,
                } => {
                    let mut blob = pack(&self.regions, self.plan, b, *kernel, args);
                    let mut params = [blob.as_mut_ptr() as *mut c_void];
                    // SAFETY: the function belongs to a loaded module; `params` points at a
                    // struct laid out as the kernel declares (see `pack`), alive until the
                    // call returns (the driver copies it); every address inside is within
                    // an allocation of this runtime.
                    cuda("cuLaunchKernel", unsafe {
                        result::launch_kernel(
                            self.funcs[*kernel as usize],
                            (grid[0], grid[1], grid[2]),
                            (block[0], block[1], block[2]),
                            *smem,
                            self.stream,
                            &mut params,
                        )
                    })?;
                }
            }
        }
        Ok(())
    }
}

/// Captures what `issue` puts on `stream` into an uploaded graph.
pub(crate) fn capture(
    stream: &Arc<CudaStream>,
    issue: impl FnOnce() -> Result<(), GpuError>,
) -> Result<CudaGraph, GpuError> {
    cuda(
        "cuStreamBeginCapture",
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
    )?;
    let issued = issue();
    // Capture always ends (even when issuing failed), so the stream is usable again.
    let graph = cuda(
        "cuStreamEndCapture",
        stream.end_capture(sys::CUgraphInstantiate_flags_enum(0)),
    )?;
    issued?;
    let graph = graph.ok_or(GpuError::Cuda {
        call: "cuStreamEndCapture",
        message: "nothing was captured".into(),
    })?;
    cuda("cuGraphUpload", graph.upload())?;
    Ok(graph)
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
    for b in &plan.buckets {
        for l in &b.launches {
            if let LaunchKind::Kernel { kernel, smem, .. } = &l.kind {
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
            }
        }
    }
    Ok((modules, funcs))
}
