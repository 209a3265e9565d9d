//! What the compute sanitizers watch (`.ci/gpu sanitize`, `gpucheck sanitize`): a few steps
//! that run every kernel entry of a plan, and for racecheck the plan's own kernels alone.

use specplan_format::{io, LaunchKind, ValidatedPlan};
use specplan_runtime::bits::to_act_bits;
use specplan_runtime::gpu::{GemmPolicy, GpuOptions, GpuRuntime, Hidden};

use crate::checks::{g, request};
use crate::random::make_case;
use crate::Rng;

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    specplan_runtime::bits::as_bytes(v).to_vec()
}

/// A few steps that run every kernel of a plan at its smallest and largest bucket, as a
/// graph and eagerly, in owned memory, and once in engine memory: what the compute
/// sanitizers watch (`.ci/gpu sanitize`). Before each owned step it prints the arena map
/// (`map NAME START END WRITER`, addresses in hex) so a report's address can be traced to
/// the buffer and what writes it. `prefill_gemm_outputs`: every C a GEMM writes without
/// accumulating (a library's kernel may read it; a rounded copy is our kernels' own write,
/// never read) is first written from the host, and engine steps are skipped —
/// initcheck then says whether any uninitialized read was not of a GEMM's output.
/// `opts`: the owned runtime's options — the default, or the A/B switches that add
/// launches of their own (`split_gemm_round`: a `gemm_round` after every GEMM with a rounded
/// copy; `l2_prefetch`: the graphs' `l2_prefetch` branches), so those entries run under the
/// sanitizers too.
pub fn sanitize_steps(
    plan: &ValidatedPlan,
    rng: &mut Rng,
    prefill_gemm_outputs: bool,
    opts: GpuOptions,
) -> Result<(), String> {
    let weights = crate::random::random_weights(plan, rng);
    let mut rt = GpuRuntime::new(plan.clone(), &weights, opts).map_err(g)?;
    let max_b = plan.buckets().last().map_or(1, |b| b.batch as usize);
    let smallest = plan.buckets().first().map_or(1, |b| b.batch as usize);
    for b in [smallest, max_b] {
        let c = make_case(plan, rng, b, 100);
        for (i, &s) in c.slots.iter().enumerate() {
            rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
        }
        rt.write_kv(&c.k0, &c.v0, c.used_pages).map_err(g)?;
        let Some(bi) = plan.buckets().iter().position(|x| x.batch as usize == b) else {
            return Err(format!("no bucket of batch {b}"));
        };
        let bk = &plan.buckets()[bi];
        let gemm_out: Vec<u32> = bk
            .launches
            .iter()
            .filter_map(|l| match &l.kind {
                LaunchKind::Gemm(d) if !d.accumulate => Some(d.c),
                _ => None,
            })
            .collect();
        // Which launches write buffer `id` (GEMM C, or a kernel's read-write pointer).
        let writes = |l: &specplan_format::Launch, id: u32| {
            match &l.kind {
            LaunchKind::Gemm(d) => d.c == id || d.rounded == Some(id),
            LaunchKind::Collective(c) => c.recv == id,
            LaunchKind::Kernel { kernel, args, .. } => plan.kernels.get(*kernel as usize).is_some_and(|k| {
                k.entry.abi().fields.iter().zip(args).any(|(f, a)| {
                    matches!((f.kind, a), (specplan_kernels::abi::FieldKind::Ptr(pf), specplan_format::ArgValue::Buffer(b)) if *b == id && pf.access.writes())
                })
            }),
        }
        };
        for (id, x) in bk.buffers.iter().enumerate() {
            let writer: Vec<String> = bk
                .launches
                .iter()
                .filter(|l| writes(l, id as u32))
                .map(|l| match &l.kind {
                    LaunchKind::Gemm(_) => format!("gemm:{}", l.op),
                    LaunchKind::Collective(_) => format!("collective:{}", l.op),
                    LaunchKind::Kernel { .. } => format!("kernel:{}", l.op),
                })
                .collect();
            let writer = if writer.is_empty() {
                "-".to_string()
            } else {
                writer.join(",")
            };
            if let Some((p, n)) = rt.buffer_ptr(b as u32, &x.name) {
                println!("map {} {p:#x} {:#x} {writer}", x.name, p + n as u64);
            }
        }
        // Which node kinds the graph run holds (whether `fill` launches are among them).
        if let Some(n) = rt.graph_nodes(bi).map_err(g)? {
            println!("graph of bucket {b}: {n}");
        }
        for eager in [false, true] {
            if prefill_gemm_outputs {
                for &id in &gemm_out {
                    let x = &bk.buffers[id as usize];
                    rt.write_buffer(b as u32, &x.name, &vec![0u8; x.bytes as usize])
                        .map_err(g)?;
                }
            }
            rt.step(&request(&c, Hidden::Host(&c.hidden_bits)), eager).map_err(g)?;
            rt.read_outputs().map_err(g)?;
        }
    }
    if prefill_gemm_outputs {
        return Ok(());
    }
    // Token pools at page 1; paged plans run SGLang's HND pool and vLLM's packed blocks
    // (strided K/V addressing in every kernel that touches the cache).
    let layouts: &[crate::engine::Layout] = if plan.capture.page_size > 1 {
        &[crate::engine::Layout::SglangHnd, crate::engine::Layout::VllmNhd]
    } else {
        &[crate::engine::Layout::SglangNhd]
    };
    for &layout in layouts {
        for b in [smallest, max_b] {
            crate::engine::engine_once(plan, rng, layout, b)?;
        }
    }
    Ok(())
}

/// The plan's kernels without any vendor kernel (for racecheck, which cannot follow
/// cuBLAS's Hopper GEMMs: it fails with an internal error whichever kernels it watches).
/// Per bucket (smallest and largest): inputs and cache written from the host, then the
/// launches in plan order, each GEMM replaced by writing random finite values into its
/// output from the host — so every kernel reads what it would in a step, shaped as in a
/// step, with no cuBLAS launch (GEMMs take the heuristic's choice, no timing; no graphs).
pub fn kernel_steps(plan: &ValidatedPlan, rng: &mut Rng) -> Result<(), String> {
    let weights = crate::random::random_weights(plan, rng);
    let opts = GpuOptions {
        gemms: GemmPolicy::Heuristic,
        build_graphs: false,
        ..GpuOptions::default()
    };
    let mut rt = GpuRuntime::new(plan.clone(), &weights, opts).map_err(g)?;
    let act = plan.capture.dtype;
    let smallest = plan.buckets().first().map_or(1, |b| b.batch);
    let largest = plan.buckets().last().map_or(1, |b| b.batch);
    for batch in [smallest, largest] {
        let Some(bk) = plan.buckets().iter().find(|x| x.batch == batch) else {
            return Err(format!("no bucket of batch {batch}"));
        };
        let c = make_case(plan, rng, batch as usize, 100);
        for (i, &s) in c.slots.iter().enumerate() {
            rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
        }
        rt.write_kv(&c.k0, &c.v0, c.used_pages).map_err(g)?;
        rt.write_buffer(batch, io::INPUT_IDS, &bytes_of(&c.step.input_ids))
            .map_err(g)?;
        rt.write_buffer(batch, io::HIDDEN_STATES, &bytes_of(&c.hidden_bits))
            .map_err(g)?;
        rt.write_buffer(batch, io::REQ_SLOTS, &bytes_of(&c.slots)).map_err(g)?;
        rt.write_buffer(batch, io::PREFIX_LENS, &bytes_of(&c.step.prefix_lens))
            .map_err(g)?;
        rt.write_buffer(batch, io::ACCEPT_LENS, &bytes_of(&c.step.accept_lens))
            .map_err(g)?;
        for l in &bk.launches {
            match &l.kind {
                LaunchKind::Gemm(d) => {
                    let Some(x) = bk.buffers.get(d.c as usize) else {
                        return Err(format!("{}: no buffer {}", l.op, d.c));
                    };
                    let n = (x.bytes / x.dtype.size()) as usize;
                    let v: Vec<f32> = (0..n).map(|_| rng.uniform() * 0.5).collect();
                    let data = if x.dtype == act {
                        bytes_of(&to_act_bits(&v, act))
                    } else {
                        bytes_of(&v)
                    };
                    rt.synchronize().map_err(g)?;
                    rt.write_buffer(batch, &x.name, &data).map_err(g)?;
                    // The GEMM's rounded copy (`GemmDesc.rounded`): C's values rounded.
                    if let Some(r) = d.rounded.and_then(|r| bk.buffers.get(r as usize)) {
                        rt.write_buffer(batch, &r.name, &bytes_of(&to_act_bits(&v, act)))
                            .map_err(g)?;
                    }
                }
                LaunchKind::Kernel { .. } => rt.replay_only(batch, Some(&l.op)).map_err(g)?,
                LaunchKind::Collective(_) => {
                    return Err(format!("{}: a sharded plan (the GPU runtime refuses it)", l.op))
                }
            }
        }
        rt.synchronize().map_err(g)?;
    }
    Ok(())
}
