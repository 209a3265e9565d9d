//! Owned memory's graph steps stage their own inputs (`stage_in`, the graph's first node:
//! runtime/src/gpu/stage_node.rs) — checked on the GPU machine, since an owned runtime
//! needs a device. One random case at one bucket, its eager step the reference, then graph
//! steps that must each give the same outputs bit for bit:
//! - host hidden states (copied from the host-mapped block before the graph);
//! - the caller's device hidden states (copied by the node; its parameters set);
//! - another device buffer holding the same rows (the parameters set again);
//! - the same buffer once more (no update);
//! - three steps issued back to back without a wait (the third waits for the first's
//!   `stage_in` to consume the block), the last one read;
//! - a replay on the inputs in place (`replay_only`: the node copies nothing), then a step
//!   (its parameters restored);
//! - an eager step between two graph steps.
//!
//! Each step's outputs are poisoned first, so a stale output cannot pass.

use specplan_format::{PhaseKind, Replay, ValidatedPlan};
use specplan_runtime::gpu::{GpuRuntime, Hidden, HostOutputs};

use crate::checks::request;
use crate::gpu::DeviceBuf;
use crate::random::make_case;
use crate::Rng;

/// Runs the sequence above on `rt` (owned memory, graphs built) at the first graph bucket
/// of at least 2 requests, with one request fewer than the bucket holds (padded rows);
/// returns the checks made, or names the first step whose outputs differ.
pub fn owned_staging(plan: &ValidatedPlan, rt: &mut GpuRuntime, rng: &mut Rng) -> Result<usize, String> {
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    let Some(bucket) = plan
        .buckets()
        .iter()
        .find(|x| x.batch >= 2 && x.replay == Replay::Graph && x.batch <= plan.capture.max_requests)
    else {
        return Err("no graph bucket of at least 2 requests".into());
    };
    let b = bucket.batch as usize - 1;
    let max_prefix = (plan.capture.max_context_len - plan.rows_per_request(PhaseKind::DraftExtend)) as usize;
    let c = make_case(plan, rng, b, max_prefix.min(300));
    for (i, &s) in c.slots.iter().enumerate() {
        rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
    }
    rt.write_kv(&c.k0, &c.v0, c.used_pages).map_err(g)?;
    let dev1 = DeviceBuf::from_slice(&c.hidden_bits)?;
    let dev2 = DeviceBuf::from_slice(&c.hidden_bits)?;
    let step = |rt: &mut GpuRuntime, hidden: Hidden, eager: bool| -> Result<(), String> {
        rt.poison().map_err(g)?;
        let info = rt.step(&request(&c, hidden), eager).map_err(g)?;
        if !eager && !info.graph {
            return Err("expected a graph replay".into());
        }
        Ok(())
    };
    let host = || Hidden::Host(&c.hidden_bits);
    step(rt, host(), true)?;
    let want = rt.read_outputs().map_err(g)?;
    let mut checks = 0;
    let mut same = |what: &str, got: HostOutputs| -> Result<(), String> {
        checks += 1;
        if got == want {
            Ok(())
        } else {
            Err(format!("b={b}: {what}: outputs differ from the eager step's"))
        }
    };
    step(rt, host(), false)?;
    same("host hidden states", rt.read_outputs().map_err(g)?)?;
    step(rt, Hidden::Device(dev1.ptr), false)?;
    same("device hidden states", rt.read_outputs().map_err(g)?)?;
    step(rt, Hidden::Device(dev2.ptr), false)?;
    same("another device buffer", rt.read_outputs().map_err(g)?)?;
    step(rt, Hidden::Device(dev2.ptr), false)?;
    same("the same buffer again", rt.read_outputs().map_err(g)?)?;
    // Back to back: no read (no synchronization) between the three launches.
    for hidden in [Hidden::Device(dev1.ptr), host(), Hidden::Device(dev2.ptr)] {
        rt.step(&request(&c, hidden), false).map_err(g)?;
    }
    same("three steps without a wait", rt.read_outputs().map_err(g)?)?;
    rt.poison().map_err(g)?;
    rt.replay_only(bucket.batch, None).map_err(g)?;
    same("a replay on the inputs in place", rt.read_outputs().map_err(g)?)?;
    step(rt, Hidden::Device(dev1.ptr), false)?;
    same("a step after that replay", rt.read_outputs().map_err(g)?)?;
    step(rt, host(), true)?;
    step(rt, Hidden::Device(dev2.ptr), false)?;
    same("a graph step after an eager one", rt.read_outputs().map_err(g)?)?;
    Ok(checks)
}
