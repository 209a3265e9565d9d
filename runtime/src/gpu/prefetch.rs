//! L2 prefetch branches in captured graphs (perf-notes item 46; off unless the options ask).
//!
//! Between two GEMMs a step runs small launches (casts, norms, RoPE and the K/V append, the
//! attention at small batches, SiLU·mul) that leave DRAM mostly idle, and then the GEMM
//! streams its whole weight from DRAM. With branches on, the graph forks where those small
//! launches begin: an `l2_prefetch` node, depending on what the first small launch depends
//! on, asks L2 for the first bytes of the next GEMM's weight, so they stream in while the
//! small launches run. No node waits on a branch (each is a leaf; a graph launch completes
//! when all its nodes have), so a prefetch that is late costs only DRAM time the GEMM would
//! have spent on the same bytes, and no value changes: a prefetch writes nothing.
//!
//! Only GEMMs of the same step are prefetched, never the next step's first: between two
//! draft-extend steps an engine runs the target model, which leaves nothing of ours in L2,
//! and specbench flushes L2 before each timed run for the same reason.

use std::ffi::c_void;

use cudarc::driver::sys;
use specplan_format::{BucketPlan, LaunchKind, Plan};
use specplan_kernels::abi::KernelParams;
use specplan_kernels::entries::io::{
    L2PrefetchParams, L2PrefetchPtrs, L2PrefetchScalars, L2_PREFETCH_CHUNK, L2_PREFETCH_THREADS,
};
use specplan_kernels::Entry;

use super::device::{cuda_rc, GpuError};
use super::launch::pack_slots;

/// How a captured graph's L2 branches are sized: each prefetches at most `cap_bytes` of its
/// GEMM's weight from `ctas` CTAs, in the buckets of at most `max_batch` requests (the
/// small buckets, where the small launches leave DRAM idle; the large ones' GEMMs are
/// compute-bound and their attention keeps DRAM busy). `cap_bytes` 0: no branches (the
/// default until the branch is measured in the step: `AB_L2=SPEC .ci/gpu ab`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L2Prefetch {
    pub cap_bytes: u64,
    pub ctas: u32,
    pub max_batch: u32,
}

impl Default for L2Prefetch {
    fn default() -> Self {
        L2Prefetch::OFF
    }
}

/// The largest prefetch a branch may ask for: the H100's and H200's L2 is 50 MiB, and a
/// prefetch larger than it evicts its own first bytes.
pub const L2_PREFETCH_MAX_MIB: u64 = 48;

impl L2Prefetch {
    pub const OFF: L2Prefetch = L2Prefetch {
        cap_bytes: 0,
        ctas: 0,
        max_batch: 0,
    };
    /// CTAs of a branch when the option names none (the probes' smaller choice: few SMs
    /// busy beside the small launches).
    pub const DEFAULT_CTAS: u32 = 32;

    pub fn is_on(&self) -> bool {
        self.cap_bytes >= L2_PREFETCH_CHUNK && self.ctas > 0
    }

    /// `off`, or `MIB[xCTAS][/MAXB]` (e.g. `32`, `32x132`, `32/8`): MiB 1 to
    /// [`L2_PREFETCH_MAX_MIB`], CTAs 1 to 1024 (default [`Self::DEFAULT_CTAS`]), branches in
    /// the buckets of at most MAXB requests (default every bucket).
    pub fn parse(s: &str) -> Result<L2Prefetch, String> {
        if s == "off" || s == "0" {
            return Ok(L2Prefetch::OFF);
        }
        let (s_size, max_batch) = match s.split_once('/') {
            Some((a, b)) => (
                a,
                b.parse().ok().filter(|&m| m >= 1).ok_or_else(|| {
                    format!("l2 prefetch `{s}`: the largest bucket after `/` must be a positive integer")
                })?,
            ),
            None => (s, u32::MAX),
        };
        let (mib, ctas) = match s_size.split_once('x') {
            Some((m, c)) => (m, Some(c)),
            None => (s_size, None),
        };
        let mib: u64 = mib
            .parse()
            .ok()
            .filter(|m| (1..=L2_PREFETCH_MAX_MIB).contains(m))
            .ok_or_else(|| format!("l2 prefetch `{s}`: MiB must be 1 to {L2_PREFETCH_MAX_MIB}, or `off`"))?;
        let ctas = match ctas {
            None => Self::DEFAULT_CTAS,
            Some(c) => c
                .parse()
                .ok()
                .filter(|c| (1..=1024).contains(c))
                .ok_or_else(|| format!("l2 prefetch `{s}`: CTAs must be 1 to 1024"))?,
        };
        Ok(L2Prefetch {
            cap_bytes: mib << 20,
            ctas,
            max_batch,
        })
    }
}

impl std::fmt::Display for L2Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_on() {
            write!(f, "{}x{}", self.cap_bytes >> 20, self.ctas)?;
            if self.max_batch != u32::MAX {
                write!(f, "/{}", self.max_batch)?;
            }
            Ok(())
        } else {
            f.write_str("off")
        }
    }
}

/// One branch of a bucket's graph: forked just before launch `at` (the first of the small
/// launches before GEMM launch `gemm`), prefetching the first `bytes` of that GEMM's weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub at: usize,
    pub gemm: usize,
    pub weight: u32,
    pub bytes: u64,
}

/// The branches of bucket `b`'s launch list under `opts` (none in a bucket above
/// `opts.max_batch`): one per GEMM that at least one
/// non-GEMM launch precedes since the previous GEMM (or since the step's start), of
/// `min(cap, the weight's bytes)` rounded down to whole chunks. A GEMM right after another
/// gets none: the one before it is already streaming from DRAM.
pub fn windows(plan: &Plan, b: &BucketPlan, opts: L2Prefetch) -> Vec<Window> {
    if !opts.is_on() || b.batch > opts.max_batch {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut start = None;
    for (i, l) in b.launches.iter().enumerate() {
        match &l.kind {
            LaunchKind::Gemm(g) => {
                let Some(at) = start.take() else { continue };
                let Some(w) = plan.weights.get(g.w as usize) else {
                    continue;
                };
                let weight_bytes = g.n.saturating_mul(g.k).saturating_mul(w.dtype.size());
                let bytes = weight_bytes.min(opts.cap_bytes) / L2_PREFETCH_CHUNK * L2_PREFETCH_CHUNK;
                if bytes > 0 {
                    out.push(Window {
                        at,
                        gemm: i,
                        weight: g.w,
                        bytes,
                    });
                }
            }
            _ => {
                start.get_or_insert(i);
            }
        }
    }
    out
}

/// Where the branches of bucket `b` fork when only launches `range` passing `keep` are
/// issued: `(launch index, window)`, each window at the first issued launch in
/// `[at, gemm)`, and only when its GEMM is issued too (a partial or filtered list gets the
/// branches of the GEMMs it runs). The whole list gives `windows` at their own `at`.
pub fn forks(
    plan: &Plan,
    b: &BucketPlan,
    opts: L2Prefetch,
    range: std::ops::Range<usize>,
    keep: &dyn Fn(&str) -> bool,
) -> Vec<(usize, Window)> {
    let issued = |i: usize| range.contains(&i) && b.launches.get(i).is_some_and(|l| keep(&l.op));
    windows(plan, b, opts)
        .into_iter()
        .filter(|w| issued(w.gemm))
        .filter_map(|w| (w.at..w.gemm).find(|&i| issued(i)).map(|i| (i, w)))
        .collect()
}

/// What issuing a bucket under capture needs to add its branches.
#[derive(Clone, Copy)]
pub(crate) struct Branches {
    pub func: sys::CUfunction,
    pub opts: L2Prefetch,
}

impl Branches {
    /// Adds one branch for `w` to the graph `stream` is capturing: an `l2_prefetch` node on
    /// the stream's current dependencies, which the stream does not come to depend on.
    pub fn add(&self, stream: sys::CUstream, w: &Window, weight_ptr: u64) -> Result<(), GpuError> {
        let chunks =
            u32::try_from(w.bytes / L2_PREFETCH_CHUNK).map_err(|_| GpuError::Step("l2 prefetch size".into()))?;
        let threads = L2_PREFETCH_THREADS as u64;
        let ctas = (chunks as u64).div_ceil(threads).clamp(1, self.opts.ctas as u64) as u32;
        let slots = L2PrefetchParams::assemble(L2PrefetchPtrs { src: weight_ptr }, L2PrefetchScalars { chunks });
        let mut blob = pack_slots(&Entry::L2Prefetch.abi(), &slots);
        add_branch(stream, self.func, [ctas, 1, 1], [L2_PREFETCH_THREADS, 1, 1], &mut blob)
    }
}

/// Adds a kernel node to the graph `stream` is capturing, on the dependencies the stream's
/// next launch would have, without adding it to them: a side branch that nothing waits on.
fn add_branch(
    stream: sys::CUstream,
    func: sys::CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    blob: &mut [u8],
) -> Result<(), GpuError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n = 0usize;
    // SAFETY: a live stream; out-pointers to locals. The edge data is asked for (a null
    // pointer would make the driver refuse the query when a dependency carries a
    // programmatic edge, say from a library's launch) and not used: the branch depends on
    // those nodes through default edges, i.e. on their completion, which is what it wants.
    cuda_rc("cuStreamGetCaptureInfo", unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            std::ptr::null_mut(),
            &mut graph,
            &mut deps,
            &mut edges,
            &mut n,
        )
    })?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
        return Err(GpuError::Step(
            "an L2 branch is added only while a graph is captured".into(),
        ));
    }
    // The driver's array stays valid only until the next call that operates on the stream:
    // copied now, so no later edit can read it after one.
    let deps: Vec<sys::CUgraphNode> = if n == 0 || deps.is_null() {
        Vec::new()
    } else {
        // SAFETY: the query succeeded with an active capture: `deps` holds `n` nodes.
        unsafe { std::slice::from_raw_parts(deps, n) }.to_vec()
    };
    let mut args = [blob.as_mut_ptr() as *mut c_void];
    // SAFETY: zeroed plain C struct; every field the call reads is set below.
    let mut p: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    p.func = func;
    (p.gridDimX, p.gridDimY, p.gridDimZ) = (grid[0], grid[1], grid[2]);
    (p.blockDimX, p.blockDimY, p.blockDimZ) = (block[0], block[1], block[2]);
    p.kernelParams = args.as_mut_ptr();
    let mut node: sys::CUgraphNode = std::ptr::null_mut();
    // SAFETY: the capture's live graph and its current dependency nodes (copied above); the
    // parameters point at a struct laid out as `l2_prefetch` declares, copied by the call.
    cuda_rc("cuGraphAddKernelNode", unsafe {
        let d = if deps.is_empty() {
            std::ptr::null()
        } else {
            deps.as_ptr()
        };
        sys::cuGraphAddKernelNode_v2(&mut node, graph, d, deps.len(), &p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_print() {
        assert_eq!(L2Prefetch::parse("off"), Ok(L2Prefetch::OFF));
        assert_eq!(L2Prefetch::parse("0"), Ok(L2Prefetch::OFF));
        let p = L2Prefetch::parse("32").expect("32 MiB");
        assert_eq!((p.cap_bytes, p.ctas), (32 << 20, L2Prefetch::DEFAULT_CTAS));
        assert_eq!(p.to_string(), "32x32");
        let p = L2Prefetch::parse("16x132").expect("16 MiB from 132 CTAs");
        assert_eq!((p.cap_bytes, p.ctas, p.max_batch), (16 << 20, 132, u32::MAX));
        let p = L2Prefetch::parse("16x132/8").expect("up to bucket 8");
        assert_eq!((p.cap_bytes, p.ctas, p.max_batch), (16 << 20, 132, 8));
        assert_eq!(p.to_string(), "16x132/8");
        assert_eq!(L2Prefetch::parse("8/1").map(|p| p.to_string()), Ok("8x32/1".into()));
        for bad in ["32/0", "32/", "32/x", "/8"] {
            let e = L2Prefetch::parse(bad).expect_err(bad);
            assert!(e.contains("bucket") || e.contains("MiB"), "{bad}: {e}");
        }
        for bad in ["", "x", "49", "-1", "1.5", "32x0", "32x2000", "32x", "ax4"] {
            let e = L2Prefetch::parse(bad).expect_err(bad);
            assert!(e.contains("MiB") || e.contains("CTAs"), "{bad}: {e}");
        }
        assert!(!L2Prefetch::OFF.is_on());
        assert_eq!(L2Prefetch::OFF.to_string(), "off");
    }
}
