//! Captured graphs: what a closure issues on the runtime's stream, captured, with the memset
//! nodes a GEMM library left in it replaced by the plan's `fill` kernel, then instantiated
//! and uploaded. One capture function serves whole buckets and filtered subsets.
//!
//! Why replace memsets: cuBLASLt algorithms that split K or stream tiles zero a workspace
//! (or the output) with a memset before their kernel, so a captured GEMM can bring a memset
//! node. The driver's `cuGraphLaunch` costs the host about 1–2 µs more per memset node than
//! per kernel node (specbench's engine rows on the H200: graphs of 16–20 kernels launch in
//! 2.1–3.3 µs, 4.5 µs with one memset, 5.7–6.4 µs with two), and the graph launch is most of
//! a step's host time. The same memset as a kernel node is a short launch like the others.
//! Memsets whose region does not fit `fill`'s 32-bit sizes stay memsets.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};
use specplan_kernels::abi::KernelParams;
use specplan_kernels::entries::io::{FillParams, FillPtrs, FillScalars, IO_THREADS};
use specplan_kernels::Entry;

use super::device::{cuda, cuda_rc, GpuError};
use super::launch::pack_slots;

/// An instantiated, uploaded graph and the graph it came from (whose node handles address
/// the exec's nodes, e.g. for `cuGraphExecKernelNodeSetParams`).
pub struct Exec {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// The stream it was captured on (keeps its context alive; `launch` replays there).
    stream: Arc<CudaStream>,
    /// Memset nodes replaced by `fill` launches.
    fills: usize,
}

// SAFETY: the handles are plain driver handles, used from one thread at a time through
// `&self`/`&mut self` (the driver's graph calls are thread safe for distinct execs).
unsafe impl Send for Exec {}

impl Exec {
    pub fn cu_graph(&self) -> sys::CUgraph {
        self.graph
    }

    pub fn cu_graph_exec(&self) -> sys::CUgraphExec {
        self.exec
    }

    /// Memset nodes of the capture that became `fill` kernel nodes.
    pub fn fills(&self) -> usize {
        self.fills
    }

    /// Replays the graph on the stream it was captured on.
    pub fn launch(&self) -> Result<(), GpuError> {
        // SAFETY: a live exec on the live stream it was built for.
        cuda_rc("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(self.exec, self.stream.cu_stream())
        })
    }
}

impl Drop for Exec {
    fn drop(&mut self) {
        // SAFETY: created in `capture`, destroyed once here; the context is alive (the
        // stream holds it). Errors at teardown have no one to report to.
        unsafe {
            let _ = self.stream.context().bind_to_thread();
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// A captured graph owned until it is instantiated (destroyed on every early return).
struct Owned(sys::CUgraph);

impl Drop for Owned {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: a graph from cuStreamEndCapture, not yet handed to an `Exec`.
            let _ = unsafe { sys::cuGraphDestroy(self.0) };
        }
    }
}

/// Captures what `issue` puts on `stream` into an uploaded graph; with `fill` (the plan's
/// `fill` kernel), memset nodes become `fill` kernel nodes first.
pub(crate) fn capture(
    stream: &Arc<CudaStream>,
    fill: Option<sys::CUfunction>,
    issue: impl FnOnce() -> Result<(), GpuError>,
) -> Result<Exec, GpuError> {
    cuda(
        "cuStreamBeginCapture",
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
    )?;
    let issued = issue();
    // Capture always ends (even when issuing failed), so the stream is usable again.
    let mut raw: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above on the same live stream; out-pointer to a local.
    let ended = cuda_rc("cuStreamEndCapture", unsafe {
        sys::cuStreamEndCapture(stream.cu_stream(), &mut raw)
    });
    let mut graph = Owned(raw);
    // The issue's own error first: a failed issue often invalidates the capture too, and
    // that error would hide the cause.
    issued?;
    ended?;
    if graph.0.is_null() {
        return Err(GpuError::Cuda {
            call: "cuStreamEndCapture",
            message: "nothing was captured".into(),
        });
    }
    let fills = match fill {
        Some(f) => memsets_to_fill(graph.0, f)?,
        None => 0,
    };
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a live graph; out-pointer to a local.
    cuda_rc("cuGraphInstantiate", unsafe {
        sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0)
    })?;
    let exec = Exec {
        // The exec owns the graph from here.
        graph: std::mem::replace(&mut graph.0, std::ptr::null_mut()),
        exec,
        stream: stream.clone(),
        fills,
    };
    // SAFETY: a live exec on its live stream.
    cuda_rc("cuGraphUpload", unsafe {
        sys::cuGraphUpload(exec.exec, stream.cu_stream())
    })?;
    Ok(exec)
}

/// A driver list query: `call(null, &mut n)` reports the count, `call(array, &mut n)` fills
/// it. Zero entries skip the second call (the driver refuses an array for none).
fn list(
    name: &'static str,
    call: impl Fn(*mut sys::CUgraphNode, &mut usize) -> sys::CUresult,
) -> Result<Vec<sys::CUgraphNode>, GpuError> {
    let mut n = 0usize;
    cuda_rc(name, call(std::ptr::null_mut(), &mut n))?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut v = vec![std::ptr::null_mut(); n];
    cuda_rc(name, call(v.as_mut_ptr(), &mut n))?;
    v.truncate(n);
    Ok(v)
}

/// Every node of `graph`.
pub(crate) fn nodes(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>, GpuError> {
    // SAFETY: a live graph; the array is null (count only) or holds `*n` entries.
    list("cuGraphGetNodes", |out, n| unsafe {
        sys::cuGraphGetNodes(graph, out, n)
    })
}

/// The nodes of `graph` without dependencies.
pub(crate) fn roots(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>, GpuError> {
    // SAFETY: a live graph; the array is null (count only) or holds `*n` entries.
    list("cuGraphGetRootNodes", |out, n| unsafe {
        sys::cuGraphGetRootNodes(graph, out, n)
    })
}

/// Whether `stream` is being captured (any capture status but none).
pub(crate) fn capturing(stream: sys::CUstream) -> Result<bool, GpuError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream handle (or a null/legacy/per-thread one); out-pointer to a local.
    cuda_rc("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(stream, &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

pub(crate) fn node_type(node: sys::CUgraphNode) -> Result<sys::CUgraphNodeType, GpuError> {
    let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: a node of a live graph; out-pointer to a local.
    cuda_rc("cuGraphNodeGetType", unsafe { sys::cuGraphNodeGetType(node, &mut ty) })?;
    Ok(ty)
}

/// The function of a kernel node (`None` when the driver reports none: a node made from a
/// library kernel handle).
pub(crate) fn kernel_func(node: sys::CUgraphNode) -> Result<Option<sys::CUfunction>, GpuError> {
    // SAFETY: zeroed plain C struct, filled by the call.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a kernel node of a live graph; out-pointer to a local.
    cuda_rc("cuGraphKernelNodeGetParams", unsafe {
        sys::cuGraphKernelNodeGetParams_v2(node, &mut p)
    })?;
    Ok((!p.func.is_null()).then_some(p.func))
}

/// How many nodes depend on `node`.
pub(crate) fn dependents(node: sys::CUgraphNode) -> Result<usize, GpuError> {
    Ok(edges(node, false)?.len())
}

/// A node's neighbours: its dependencies (`up`) or its dependents.
fn edges(node: sys::CUgraphNode, up: bool) -> Result<Vec<sys::CUgraphNode>, GpuError> {
    // SAFETY: a node of a live graph; the array is null (count only) or holds `*n`
    // entries. A null edge-data array is allowed for a captured graph's default edges.
    if up {
        list("cuGraphNodeGetDependencies", |out, n| unsafe {
            sys::cuGraphNodeGetDependencies_v2(node, out, std::ptr::null_mut(), n)
        })
    } else {
        list("cuGraphNodeGetDependentNodes", |out, n| unsafe {
            sys::cuGraphNodeGetDependentNodes_v2(node, out, std::ptr::null_mut(), n)
        })
    }
}

/// `fill`'s scalars for a memset node, or `None` when the region does not fit them.
pub(crate) fn fill_scalars(m: &sys::CUDA_MEMSET_NODE_PARAMS) -> Option<FillScalars> {
    let elem = m.elementSize;
    if !matches!(elem, 1 | 2 | 4) {
        return None;
    }
    Some(FillScalars {
        value: m.value,
        elem_bytes: elem,
        width: u32::try_from(m.width).ok()?,
        height: u32::try_from(m.height).ok()?,
        pitch: u32::try_from(if m.height <= 1 { 0 } else { m.pitch }).ok()?,
    })
}

/// Replaces each memset node of `graph` by a `fill` kernel node with the same edges.
/// Returns how many it replaced.
fn memsets_to_fill(graph: sys::CUgraph, fill: sys::CUfunction) -> Result<usize, GpuError> {
    let mut replaced = 0;
    for node in nodes(graph)? {
        if node_type(node)? != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET {
            continue;
        }
        // SAFETY: zeroed plain C struct, filled by the call.
        let mut m: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
        // SAFETY: a memset node of the live graph; out-pointer to a local.
        cuda_rc("cuGraphMemsetNodeGetParams", unsafe {
            sys::cuGraphMemsetNodeGetParams(node, &mut m)
        })?;
        let Some(s) = fill_scalars(&m) else { continue };
        let (up, down) = (edges(node, true)?, edges(node, false)?);
        let grid = FillParams::grid(&s);
        let mut blob = pack_slots(&Entry::Fill.abi(), &FillParams::assemble(FillPtrs { dst: m.dst }, s));
        let mut args = [blob.as_mut_ptr() as *mut c_void];
        // SAFETY: zeroed plain C struct; every field the call reads is set below.
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
        p.func = fill;
        (p.gridDimX, p.gridDimY, p.gridDimZ) = (grid[0], grid[1], grid[2]);
        (p.blockDimX, p.blockDimY, p.blockDimZ) = (IO_THREADS, 1, 1);
        p.kernelParams = args.as_mut_ptr();
        let mut k: sys::CUgraphNode = std::ptr::null_mut();
        // SAFETY: the live graph and nodes of it (null with a count of 0 for a root); the
        // parameters point at a struct laid out as `fill` declares, copied by the call.
        cuda_rc("cuGraphAddKernelNode", unsafe {
            let deps = if up.is_empty() { std::ptr::null() } else { up.as_ptr() };
            sys::cuGraphAddKernelNode_v2(&mut k, graph, deps, up.len(), &p)
        })?;
        for d in &down {
            // SAFETY: two nodes of the live graph; a default edge (null edge data).
            cuda_rc("cuGraphAddDependencies", unsafe {
                sys::cuGraphAddDependencies_v2(graph, &k, d, std::ptr::null(), 1)
            })?;
        }
        // SAFETY: the memset node, now bypassed; destroying it removes its edges.
        cuda_rc("cuGraphDestroyNode", unsafe { sys::cuGraphDestroyNode(node) })?;
        replaced += 1;
    }
    Ok(replaced)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memset(elem: u32, width: usize, height: usize, pitch: usize) -> sys::CUDA_MEMSET_NODE_PARAMS {
        sys::CUDA_MEMSET_NODE_PARAMS {
            dst: 0x1000,
            pitch,
            value: 7,
            elementSize: elem,
            width,
            height,
        }
    }

    #[test]
    fn memsets_map_to_fill_or_stay() {
        let s = fill_scalars(&memset(4, 1000, 1, 0)).expect("a 1-D memset");
        assert_eq!((s.value, s.elem_bytes, s.width, s.height, s.pitch), (7, 4, 1000, 1, 0));
        // A 1-row memset's pitch is not used (the driver may leave anything there).
        assert_eq!(fill_scalars(&memset(1, 16, 1, 1 << 40)).map(|s| s.pitch), Some(0));
        let s = fill_scalars(&memset(2, 8, 3, 64)).expect("a 2-D memset");
        assert_eq!((s.width, s.height, s.pitch), (8, 3, 64));
        assert!(fill_scalars(&memset(8, 8, 1, 0)).is_none(), "no 8-byte elements");
        assert!(fill_scalars(&memset(4, 1 << 33, 1, 0)).is_none(), "width past u32");
        assert!(fill_scalars(&memset(4, 8, 2, 1 << 33)).is_none(), "pitch past u32");
        // The grid covers the region with at most FILL_MAX_CTAS CTAs.
        let g = FillParams::grid(&fill_scalars(&memset(4, 1 << 30, 1, 0)).expect("big"));
        assert_eq!(g, [specplan_kernels::entries::io::FILL_MAX_CTAS, 1, 1]);
        assert_eq!(
            FillParams::grid(&fill_scalars(&memset(4, 1, 1, 0)).expect("one")),
            [1, 1, 1]
        );
    }
}
