//! Split-K variants of cuBLASLt's heuristic candidates, timed beside them at load (`lt.rs`).
//!
//! Why: for the GEMMs of large buckets (m 32–512 rows against 4096–14336 columns of K) the
//! heuristic lists few split-K configurations, and a tile grid over N alone leaves most of
//! the GPU's SMs without work (docs/perf-notes.md item 53). A variant is the same algorithm
//! (kernel, tile, stages) with its K split into 2, 4 or 8 parts. Whether it is faster is
//! only ever decided by the tuner's timing, so a variant that loses costs load time only.
//!
//! The parts are summed in fp32 whatever C's type: in the output buffer when C is fp32
//! (in place, the workspace holding only the counters that order the parts), else in the
//! workspace (the compute type) before one rounding into C. A reduction in a 16-bit output
//! type would round once per part, a numerics cost the tuner's timing cannot see, so it is
//! never offered.

use std::ffi::c_void;

use cudarc::cublaslt::sys as lsys;

type Result_ = lsys::cublasLtMatmulHeuristicResult_t;
type Algo = lsys::cublasLtMatmulAlgo_t;

const OK: lsys::cublasStatus_t = lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;

/// One `u32`-sized capability of `algo`; `None` when cuBLASLt does not report it.
fn cap(algo: &Algo, attr: lsys::cublasLtMatmulAlgoCapAttributes_t) -> Option<u32> {
    let (mut v, mut written) = (0u32, 0usize);
    // SAFETY: `algo` is a live plain-data struct; the buffer is 4 bytes, the size of the
    // capabilities read here (int32 / uint32), and `written` says what was filled.
    let status = unsafe {
        lsys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut written)
    };
    (status == OK && written == 4).then_some(v)
}

/// One `u32`-sized configuration attribute of `algo`.
fn config(algo: &Algo, attr: lsys::cublasLtMatmulAlgoConfigAttributes_t) -> Option<u32> {
    let (mut v, mut written) = (0u32, 0usize);
    // SAFETY: as in `cap`: a 4-byte buffer for a uint32 attribute.
    let status = unsafe {
        lsys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut written)
    };
    (status == OK && written == 4).then_some(v)
}

/// The parts `algo` splits K into (1: none, or not reported).
pub(crate) fn split_of(algo: &Algo) -> u32 {
    config(
        algo,
        lsys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
    )
    .map_or(1, |s| s.max(1))
}

fn set_config(algo: &mut Algo, attr: lsys::cublasLtMatmulAlgoConfigAttributes_t, v: u32) -> bool {
    // SAFETY: `algo` is a live plain-data struct; the value is the attribute's type
    // (uint32), read during the call.
    let status =
        unsafe { lsys::cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &v as *const u32 as *const c_void, 4) };
    status == OK
}

/// The reduction scheme a split of `algo` may use: fp32 parts summed in place when C is
/// fp32, else in the workspace in the compute type (fp32); `None` when `algo` supports
/// neither or no split-K at all.
fn scheme(algo: &Algo, c_f32: bool) -> Option<u32> {
    use lsys::cublasLtMatmulAlgoCapAttributes_t as Cap;
    use lsys::cublasLtReductionScheme_t as R;
    if cap(algo, Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != Some(1) {
        return None;
    }
    let mask = cap(algo, Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK)?;
    let (inplace, compute) = (
        R::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32,
        R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32,
    );
    if c_f32 && mask & inplace != 0 {
        Some(inplace)
    } else if mask & compute != 0 {
        Some(compute)
    } else {
        None
    }
}

/// The split-K variants (K in `splits` parts) of the first `bases` usable, unsplit candidates
/// in `found`, each one that cuBLASLt accepts for the shape (`check`: its
/// `cublasLtMatmulAlgoCheck` on the shape's descriptors, returning the result with the
/// workspace it needs) within `ws_max` bytes of workspace and not already listed.
pub(crate) fn variants(
    found: &[Result_],
    c_f32: bool,
    bases: usize,
    splits: &[u32],
    ws_max: usize,
    check: &dyn Fn(&Algo) -> Option<Result_>,
) -> Vec<Result_> {
    use lsys::cublasLtMatmulAlgoConfigAttributes_t as Cfg;
    let mut out: Vec<Result_> = Vec::new();
    let unsplit = found
        .iter()
        .filter(|h| h.state == OK && config(&h.algo, Cfg::CUBLASLT_ALGO_CONFIG_SPLITK_NUM).is_some_and(|s| s <= 1));
    for base in unsplit.take(bases) {
        let Some(scheme) = scheme(&base.algo, c_f32) else {
            continue;
        };
        for &split in splits {
            let mut algo = base.algo;
            if !set_config(&mut algo, Cfg::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, split)
                || !set_config(&mut algo, Cfg::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, scheme)
            {
                continue;
            }
            let listed = |r: &Result_| r.algo.data == algo.data;
            if found.iter().any(listed) || out.iter().any(listed) {
                continue;
            }
            if let Some(mut r) = check(&algo).filter(|r| r.workspaceSize <= ws_max) {
                r.algo = algo;
                r.state = OK;
                out.push(r);
            }
        }
    }
    out
}
