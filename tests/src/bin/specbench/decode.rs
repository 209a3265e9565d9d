//! specbench's draft-decode rows: every draft-decode tier of a plan at each benchmarked
//! (B, L) its buckets and pool hold, on owned memory — the phase's graph replayed alone
//! (`GpuRuntime::run_phase`), L2 flushed before each run, median of `RUNS` after `WARMUP` —
//! beside the floor of its S − 1 forwards: the bytes they must move over the copy ceiling, or
//! their matmul FLOPs over the bf16 ceiling, whichever is longer (as draft-extend's floor).

use specplan_format::{io, LaunchKind, PhaseKind, ValidatedPlan};
use specplan_kernels::facts::decode_reach;
use specplan_runtime::bits::to_act_bits;
use specplan_runtime::gpu::GpuRuntime;
use specplan_tests::gpu::{DeviceBuf, Timer};
use specplan_tests::report::DecodeRow;
use specplan_tests::Rng;

/// Bytes and FLOPs of tier `kind` at B requests of prefix L. Bytes: every forward's GEMM
/// weights (each forward reads them), embedding rows, the prefix K/V once per request and
/// layer per forward (the K lanes share it), each lane's own earlier slots, and the K/V
/// written. FLOPs: every GEMM's 2·m·n·k and attention's 4·rows·context·heads·head_dim.
fn work(plan: &ValidatedPlan, kind: PhaseKind, b: u64, l: u64) -> (f64, f64) {
    let m = &plan.model;
    let act = plan.capture.dtype.size();
    let (k, s) = (plan.spec.topk as u64, kind.steps() as u64);
    let kv_row = (m.kv_heads * m.head_dim) as u64 * act * 2 * m.layers as u64;
    let (mut w, mut flops) = (0f64, 0f64);
    if let Some(bk) = plan
        .phase(kind)
        .and_then(|p| p.buckets.iter().find(|x| x.batch as u64 == b))
    {
        for ln in &bk.launches {
            if let LaunchKind::Gemm(g) = &ln.kind {
                w += (g.n * g.k * act) as f64;
                flops += 2.0 * (g.m * g.n * g.k) as f64;
            }
        }
    }
    let mut kv = 0f64;
    for i in 0..s.saturating_sub(1) {
        kv += (b * (l + k * (i + 1)) * kv_row) as f64; // read: the prefix, each lane's slots
        kv += (b * k * kv_row) as f64; // written
        kv += (b * k * m.hidden as u64 * act) as f64; // embedding rows
        flops += (4 * b * k * (l + i + 1) * (m.heads * m.head_dim) as u64 * m.layers as u64) as f64;
    }
    (w + kv, flops)
}

#[allow(clippy::too_many_arguments)]
pub fn bench(
    name: &str,
    plan: &ValidatedPlan,
    rt: &mut GpuRuntime,
    timer: &Timer,
    flush: &DeviceBuf,
    copy_bytes_per_s: f64,
    flops_per_s: f64,
    batches: &[usize],
    prefixes: &[usize],
    out: &mut Vec<DecodeRow>,
) -> Result<(), String> {
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    let kinds: Vec<PhaseKind> = plan.phases.iter().map(|p| p.kind).filter(|k| k.steps() > 0).collect();
    let (k, ps) = (plan.spec.topk, plan.capture.page_size);
    let act = plan.capture.dtype;
    let h = plan.model.hidden as usize;
    for kind in kinds {
        let Some(phase) = plan.phase(kind) else { continue };
        let s = kind.steps();
        for &b in batches
            .iter()
            .filter(|&&b| phase.buckets.iter().any(|x| x.batch as usize == b))
        {
            for &l in prefixes {
                let reach = decode_reach(l as u64, s, k, ps) as usize;
                if l + reach > plan.capture.max_context_len as usize {
                    continue;
                }
                let per = (l + reach).div_ceil(ps as usize);
                if b * per + 1 > rt.pool_pages() as usize {
                    continue;
                }
                let order = Rng(0xdec0_0000 + (b * per) as u64).permutation(b * per);
                for i in 0..b {
                    let pages: Vec<i32> = order[i * per..(i + 1) * per].iter().map(|&p| p as i32).collect();
                    rt.set_pages(i, &pages).map_err(g)?;
                }
                let ku = k as usize;
                let mut rng = Rng(0x5eed ^ (b * 31 + l) as u64);
                let probs: Vec<u8> = (0..b * ku)
                    .flat_map(|i| (0.9f32 / (1 + i % ku) as f32).to_le_bytes())
                    .collect();
                let ids: Vec<u8> = (0..b * ku)
                    .flat_map(|_| (rng.below(plan.model.vocab as usize) as i64).to_le_bytes())
                    .collect();
                let hidden: Vec<f32> = (0..b * h).map(|_| rng.uniform()).collect();
                let hidden: Vec<u8> = to_act_bits(&hidden, act).iter().flat_map(|x| x.to_le_bytes()).collect();
                let lens: Vec<u8> = (0..b).flat_map(|_| (l as i32).to_le_bytes()).collect();
                let slots: Vec<u8> = (0..b as i32).flat_map(|x| x.to_le_bytes()).collect();
                let bb = b as u32;
                let mut inputs = vec![
                    (io::TOPK_PROBS, probs),
                    (io::TOPK_IDS, ids),
                    (io::HIDDEN_STATES, hidden),
                    (io::PREFIX_LENS, lens),
                    (io::REQ_SLOTS, slots),
                ];
                if plan.capture.decode_verify {
                    inputs.push((io::BONUS_TOKENS, (0..b).flat_map(|_| 7i64.to_le_bytes()).collect()));
                }
                for (n, bytes) in &inputs {
                    rt.write_phase_buffer(kind, bb, n, bytes).map_err(g)?;
                }
                let replay = timer.time_flushed(flush, || rt.run_phase(kind, bb, false).map_err(g))?;
                let (by, flops) = work(plan, kind, b as u64, l as u64);
                let row = DecodeRow {
                    plan: name.into(),
                    phase: kind.label(),
                    batch: b,
                    prefix: l,
                    topk: k,
                    steps: s,
                    draft_tokens: kind.draft_tokens(&plan.spec),
                    replay_us: replay,
                    floor_us: (by / copy_bytes_per_s).max(flops / flops_per_s) * 1e6,
                    bytes: by,
                    flops,
                };
                println!(
                    "{name} {} B {b} L {l}: replay {:.1} µs, floor {:.1} µs ({:.2}×)",
                    row.phase,
                    row.replay_us,
                    row.floor_us,
                    row.replay_us / row.floor_us
                );
                out.push(row);
            }
        }
    }
    Ok(())
}
