//! The graphs' L2 prefetch branches (runtime/src/gpu/prefetch.rs), checked on the GPU
//! machine: a runtime loaded with them on holds, in each bucket's graph, exactly the
//! `l2_prefetch` nodes `l2_windows` lists, each a leaf (nothing waits on it), and its graph
//! steps equal its eager steps bit for
//! bit through `owned_staging`'s sequence (host and device hidden states, steps without a
//! wait, a replay on the inputs in place). A prefetch writes nothing, so any difference is a
//! branch that broke the graph's order.

use specplan_format::ValidatedPlan;
use specplan_runtime::cpu::WeightData;
use specplan_runtime::gpu::{l2_windows, GpuOptions, GpuRuntime, L2Prefetch};

use crate::Rng;

/// Small enough that the small plans' GEMMs get branches too (any weight of ≥ 4 KiB), from
/// few CTAs (the kernel's grid-stride loop runs more than once). The engine-memory check
/// (`engine::engine_check`) loads its engine runtimes with it too, against an owned runtime
/// without branches.
pub const CHECKED: L2Prefetch = L2Prefetch {
    cap_bytes: 1 << 20,
    ctas: 4,
    max_batch: u32::MAX,
};

/// The value after a binary's `--l2-prefetch` option (`off` or `MIB[xCTAS][/MAXB]`,
/// `L2Prefetch::parse`), or why it is missing or wrong.
pub fn parse_arg(value: Option<&String>) -> Result<L2Prefetch, String> {
    L2Prefetch::parse(value.ok_or("--l2-prefetch needs a value")?)
}

/// Loads `plan` with branches on and runs the checks above; returns the branches found and
/// the graph steps compared.
pub fn l2_branches(plan: &ValidatedPlan, weights: &[WeightData], rng: &mut Rng) -> Result<(usize, usize), String> {
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    let opts = GpuOptions {
        l2_prefetch: CHECKED,
        ..GpuOptions::default()
    };
    let mut rt = GpuRuntime::new(plan.clone(), weights, opts).map_err(g)?;
    let mut branches = 0;
    for bi in 0..plan.bucket_count() {
        let (Some(nodes), Some(b)) = (rt.graph_nodes(bi).map_err(g)?, plan.flat_bucket(bi)) else {
            continue;
        };
        let want = l2_windows(plan, b, CHECKED).len();
        if nodes.l2_branches != want || nodes.l2_leaves != want {
            return Err(format!(
                "bucket {bi} (batch {}): {} l2_prefetch nodes in its graph ({} of them leaves), {want} windows listed",
                b.batch, nodes.l2_branches, nodes.l2_leaves
            ));
        }
        branches += want;
    }
    if branches == 0 {
        return Err("no graph holds a branch: nothing was checked".into());
    }
    let steps = crate::owned_staging::owned_staging(plan, &mut rt, rng)?;
    Ok((branches, steps))
}
