//! Owned memory's graph steps stage their own inputs (`stage_in`, the graph's first node:
//! runtime/src/gpu/stage_node.rs) — checked on the GPU machine, since an owned runtime
//! needs a device. Two cases A and B on the same requests and pages (their ids, accept
//! lengths and hidden states differ; a step's outputs depend only on its own inputs and the
//! prefix cache, which no step writes), their eager steps the references. Graph steps,
//! each of whose outputs is copied aside on the stream right after it, must equal them bit
//! for bit:
//! - host hidden states (copied from the host-mapped block before the graph);
//! - device hidden states from one buffer, then from another holding the other case (the
//!   node's source set each time), then the first again, and once more unchanged;
//! - four steps issued back to back without a wait, alternating the cases and the hidden
//!   sources (each waits for the previous graph's `stage_in` before rewriting the block);
//! - a replay on the inputs in place (`replay_only`: the node copies nothing), then a step;
//! - a graph step after an eager one.
//!
//! Outputs are poisoned before each synchronous step (before the replay, the outputs only:
//! the inputs are what it replays on).

use specplan_format::{signature, BufferRole, PhaseKind, Replay, ValidatedPlan};
use specplan_runtime::gpu::{GpuRuntime, Hidden};

use crate::checks::request;
use crate::gpu::DeviceBuf;
use crate::random::{make_case, Case};
use crate::Rng;

/// Which case a step runs and where its hidden states come from.
#[derive(Clone, Copy)]
enum From {
    Host,
    /// Device buffer 1 or 2 (buffer 1 holds A's rows, buffer 2 B's).
    Dev(usize),
}

/// Runs the sequence above on `rt` (owned memory, graphs built) at a graph bucket of at
/// least 2 requests, with padded rows where the plan's buckets allow; returns the number of
/// steps compared, or names the first that differs.
pub fn owned_staging(plan: &ValidatedPlan, rt: &mut GpuRuntime, rng: &mut Rng) -> Result<usize, String> {
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    // b = B - 1 where no smaller bucket holds it (rows padded), else B itself.
    let graph = |b: usize| plan.bucket_for(b as u32).filter(|x| x.replay == Replay::Graph);
    let fits = |b: usize| b >= 1 && b <= plan.capture.max_requests as usize;
    let Some(b) = plan
        .buckets()
        .iter()
        .map(|x| x.batch as usize)
        .filter(|&bb| bb >= 2 && fits(bb) && graph(bb).is_some())
        .map(|bb| {
            if graph(bb - 1).is_some_and(|x| x.batch as usize == bb) {
                bb - 1
            } else {
                bb
            }
        })
        .next()
    else {
        return Err("no graph bucket of at least 2 requests".into());
    };
    let batch = graph(b).map(|x| x.batch).ok_or("bucket")?;
    let max_prefix = (plan.capture.max_context_len - plan.rows_per_request(PhaseKind::DraftExtend)) as usize;
    let a = make_case(plan, rng, b, max_prefix.min(300));
    let other = make_case(plan, rng, b, max_prefix.min(300));
    let mut bc = a.clone();
    bc.step.input_ids = other.step.input_ids.clone();
    bc.hidden_bits = other.hidden_bits.clone();
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as i32;
    bc.step.accept_lens = a.step.accept_lens.iter().map(|&x| 1 + x % n).collect();
    let cases: [&Case; 2] = [&a, &bc];
    for (i, &s) in a.slots.iter().enumerate() {
        rt.set_pages(s as usize, &a.pages[i]).map_err(g)?;
    }
    rt.write_kv(&a.k0, &a.v0, a.used_pages).map_err(g)?;
    let devs = [
        DeviceBuf::from_slice(&a.hidden_bits)?,
        DeviceBuf::from_slice(&bc.hidden_bits)?,
    ];
    let outputs: Vec<(&str, usize)> = signature::bucket_io(plan, b as u32)
        .into_iter()
        .filter(|t| t.role == BufferRole::Output)
        .map(|t| (t.name, (t.shape.iter().product::<u64>() * t.dtype.size()) as usize))
        .collect();
    let stream = rt.stream().cu_stream();
    // Buffers for a step's outputs (allocated ahead: an allocation may wait for the device),
    // and the last step's outputs copied into them on the stream (no wait).
    let alloc =
        || -> Result<Vec<DeviceBuf>, String> { outputs.iter().map(|&(_, bytes)| DeviceBuf::new(bytes)).collect() };
    let copy_aside = |rt: &GpuRuntime, bufs: &[DeviceBuf]| -> Result<(), String> {
        for (&(name, _), buf) in outputs.iter().zip(bufs) {
            buf.copy_from(rt.output_ptr(name).ok_or(name)?, stream)?;
        }
        Ok(())
    };
    let aside = |rt: &GpuRuntime| -> Result<Vec<DeviceBuf>, String> {
        let bufs = alloc()?;
        copy_aside(rt, &bufs)?;
        Ok(bufs)
    };
    let host = |bufs: &[DeviceBuf]| -> Result<Vec<Vec<u8>>, String> { bufs.iter().map(|x| x.to_host()).collect() };
    // The poison fills each output's whole arena buffer, which holds the bucket's rows
    // (`outputs` above are the `b` rows a step returns, fewer where b < bucket).
    let bucket_outputs: Vec<(&str, usize)> = signature::bucket_io(plan, batch)
        .into_iter()
        .filter(|t| t.role == BufferRole::Output)
        .map(|t| (t.name, (t.shape.iter().product::<u64>() * t.dtype.size()) as usize))
        .collect();
    let poison_outputs = |rt: &GpuRuntime| -> Result<(), String> {
        for &(name, bytes) in &bucket_outputs {
            rt.write_buffer(batch, name, &vec![0xff; bytes]).map_err(g)?;
        }
        Ok(())
    };
    let step = |rt: &mut GpuRuntime, case: usize, from: From, eager: bool| -> Result<(), String> {
        let c = cases[case];
        let hidden = match from {
            From::Host => Hidden::Host(&c.hidden_bits),
            From::Dev(d) => Hidden::Device(devs[d - 1].ptr),
        };
        let info = rt.step(&request(c, hidden), eager).map_err(g)?;
        if !eager && !info.graph {
            return Err("expected a graph replay".into());
        }
        Ok(())
    };
    let mut want = Vec::new();
    for case in 0..2 {
        rt.poison().map_err(g)?;
        step(rt, case, From::Host, true)?;
        want.push(host(&aside(rt)?)?);
    }
    let mut checks = 0;
    let mut same = |what: &str, case: usize, got: Vec<Vec<u8>>| -> Result<(), String> {
        checks += 1;
        if got == want[case] {
            Ok(())
        } else {
            let name = ["A", "B"][case];
            Err(format!(
                "b={b} (bucket {batch}): {what}: outputs differ from case {name}'s eager step ({})",
                describe(&outputs, &got, &want[case], &want[1 - case])
            ))
        }
    };
    // One step at a time, outputs poisoned first.
    for (what, case, from) in [
        ("host hidden states", 0, From::Host),
        ("device hidden states", 0, From::Dev(1)),
        ("another device buffer (the other case)", 1, From::Dev(2)),
        ("the first buffer again", 0, From::Dev(1)),
        ("the same buffer, unchanged", 0, From::Dev(1)),
    ] {
        rt.poison().map_err(g)?;
        step(rt, case, from, false)?;
        same(what, case, host(&aside(rt)?)?)?;
    }
    // Back to back: each step's outputs copied aside on the stream, read after the last.
    let run = [(0, From::Dev(1)), (1, From::Host), (0, From::Host), (1, From::Dev(2))];
    let asides: Vec<Vec<DeviceBuf>> = run.iter().map(|_| alloc()).collect::<Result<_, _>>()?;
    for (&(case, from), bufs) in run.iter().zip(&asides) {
        step(rt, case, from, false)?;
        copy_aside(rt, bufs)?;
    }
    for (i, (&(case, _), bufs)) in run.iter().zip(&asides).enumerate() {
        same(
            &format!("step {} of {} without a wait", i + 1, run.len()),
            case,
            host(bufs)?,
        )?;
    }
    poison_outputs(rt)?;
    rt.replay_only(batch, None).map_err(g)?;
    same("a replay on the inputs in place", 1, host(&aside(rt)?)?)?;
    rt.poison().map_err(g)?;
    step(rt, 0, From::Dev(1), false)?;
    same("a step after that replay", 0, host(&aside(rt)?)?)?;
    step(rt, 1, From::Host, true)?;
    rt.poison().map_err(g)?;
    step(rt, 0, From::Dev(1), false)?;
    same("a graph step after an eager one", 0, host(&aside(rt)?)?)?;
    Ok(checks)
}

/// Which outputs differ and how, for a failure message: per output the bytes that differ,
/// the first of them, and whether the step left the poison (0xFF) or the other case's
/// eager outputs there.
fn describe(outputs: &[(&str, usize)], got: &[Vec<u8>], want: &[Vec<u8>], other: &[Vec<u8>]) -> String {
    let mut parts = Vec::new();
    for (((&(name, _), g), w), o) in outputs.iter().zip(got).zip(want).zip(other) {
        let diff: Vec<usize> = g
            .iter()
            .zip(w)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, _)| i)
            .collect();
        let Some(&first) = diff.first() else { continue };
        let poison = diff.iter().all(|&i| g[i] == 0xff);
        let stale = diff.iter().all(|&i| o.get(i) == Some(&g[i]));
        parts.push(format!(
            "{name}: {} of {} bytes, first at byte {first} (got {:#04x}, want {:#04x}){}{}",
            diff.len(),
            g.len(),
            g[first],
            w[first],
            if poison { ", all poison" } else { "" },
            if stale { ", all as the other case's" } else { "" }
        ));
    }
    parts.join("; ")
}
