//! `specbench PLAN_DIR OUT_DIR [--contiguous] [--decode-only] [--l2-prefetch SPEC] [--gemm-flip]`:
//! times every plan's draft-extend step on the GPU, beside the device's own ceilings measured
//! in the same run. `--l2-prefetch` (`off` or `MIB[xCTAS][/MAXB]`) captures the graphs with L2
//! prefetch branches (runtime/src/gpu/prefetch.rs); `AB_L2=SPEC .ci/gpu ab` alternates it with
//! off. `--gemm-flip` also times, at B 1 and 8 and L 1024, each GEMM's load-time choice
//! against the other inside the bucket's graph (`gemm_flips`).
//!
//! Per plan, bucket B and prefix length L (every request at L):
//! - host prep µs (checks, staging, copies issued), replay µs (graph only, CUDA events),
//!   full step µs (prep + copies + replay, host wall clock until the step's event
//!   completes), eager µs (the same launches without a graph);
//! - attention alone µs (its launches only) and its useful TB/s (K/V read, q read, o written);
//! - the floor: the larger of bytes / copy bandwidth and FLOPs / bf16 matmul rate, both
//!   measured here; every time is also reported as a ratio to it; and the per-op floor, the
//!   same taken op by op and summed (`floors`).
//!
//! Each number is a median of 100 runs after 10 warm-up runs. Weights are a fixed pattern
//! (timing does not depend on values). Pages are dealt in a fixed random order (scattered,
//! as a pool that has served other requests hands them out, and as the peer benchmark
//! deals them); `--contiguous` gives every request consecutive pages instead. Results are
//! rewritten after every plan, so a run cut short keeps what it measured. Prints SKIP
//! without a GPU.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use specplan_format::{load_file, LaunchKind, PhaseKind, ValidatedPlan};
use specplan_runtime::gpu::{GemmFlip, GpuError, GpuOptions, GpuRuntime, Hidden, L2Prefetch, StepRequest};
use specplan_tests::gpu::{ceilings, median, percentile, DeviceBuf, Timer, RUNS, WARMUP};
use specplan_tests::random::pattern_weights;
use specplan_tests::report::{
    Bench, BenchRow, Breakdown, Ceilings, EngineRow, GemmFlipRecord, GemmRecord, OpTime, SpanTime,
};
use specplan_tests::{json, plan_files, write_atomic, Rng};

mod decode;
mod floors;

const BATCHES: [usize; 4] = [1, 8, 32, 64];
const PREFIXES: [usize; 2] = [1024, 4096];

fn g(e: GpuError) -> String {
    e.to_string()
}

/// One markdown row (also printed as each row is measured; `report.py` reads these rows
/// from the log when the JSON is missing).
fn table_row(r: &BenchRow) -> String {
    format!(
        "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}× | {:.1} | {:.2} |",
        r.plan,
        r.batch,
        r.prefix,
        r.prep_us,
        r.replay_us,
        r.full_us,
        r.eager_us,
        r.floor_us,
        r.full_us / r.floor_us,
        r.attn_us,
        r.attn_tb_s
    )
}

fn write_results(out: &str, bench: &Bench) -> Result<String, String> {
    let rows: Vec<String> = bench.rows.iter().map(table_row).collect();
    let table = format!(
        "| plan | B | L | prep µs | replay µs | step µs | eager µs | floor µs | step/floor | attn µs | attn TB/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n{}\n",
        rows.join("\n")
    );
    let mut table = table;
    if !bench.decode.is_empty() {
        table.push_str(
            "\n| plan | phase | B | L | replay µs | floor µs | replay/floor |\n|---|---|---|---|---|---|---|\n",
        );
        for r in &bench.decode {
            table.push_str(&format!(
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.2}× |\n",
                r.plan,
                r.phase,
                r.batch,
                r.prefix,
                r.replay_us,
                r.floor_us,
                r.replay_us / r.floor_us
            ));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    write_atomic(&Path::new(out).join("specbench.md"), &table)?;
    write_atomic(&Path::new(out).join("specbench.json"), &json(bench))?;
    Ok(table)
}

/// The command line's options.
#[derive(Clone, Copy, Default)]
struct Opts {
    /// Every request on consecutive pages (else a fixed random order).
    contiguous: bool,
    /// The draft-decode tiers alone.
    decode_only: bool,
    /// The graphs' L2 prefetch branches.
    l2_prefetch: L2Prefetch,
    /// Each GEMM's load-time choice against the other inside the graph (`gemm_flips`).
    gemm_flip: bool,
    /// Each GEMM's rounded copy in its own launch (`GpuOptions::split_gemm_round`).
    split_gemm_round: bool,
}

/// Times one plan at every benchmarked (B, L) it holds.
fn bench_plan(
    name: &str,
    plan: &ValidatedPlan,
    ceil: &mut Option<Ceilings>,
    o: Opts,
    bench: &mut Bench,
) -> Result<(), String> {
    let t0 = Instant::now();
    let opts = GpuOptions {
        l2_prefetch: o.l2_prefetch,
        // `--gemm-flip` switches choices after load: the workspace either choice needs.
        gemm_switchable: o.gemm_flip,
        split_gemm_round: o.split_gemm_round,
        ..GpuOptions::default()
    };
    let mut rt = GpuRuntime::new(plan.clone(), &pattern_weights(plan), opts).map_err(|e| format!("{name}: {e}"))?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let stream = rt.stream().cu_stream();
    let c = match ceil {
        Some(c) => *c,
        None => {
            let c = ceilings(stream)?;
            println!(
                "ceilings: copy {:.2} TB/s, bf16 matmul {:.0} TFLOP/s",
                c.copy_bytes_per_s / 1e12,
                c.bf16_flops_per_s / 1e12
            );
            *ceil = Some(c);
            bench.ceilings = Some(c);
            c
        }
    };
    let timer = Timer::new(stream)?;
    // L2 flush buffer (256 MiB, several times the H200's L2).
    let flush = DeviceBuf::new(256 << 20)?;
    if o.decode_only {
        // The draft-decode tiers alone (`--decode-only`).
        return decode::bench(
            name,
            plan,
            &mut rt,
            &timer,
            &flush,
            c.copy_bytes_per_s,
            c.bf16_flops_per_s,
            &BATCHES,
            &PREFIXES,
            &mut bench.decode,
        );
    }
    // Input rows: hidden_in wide (3·H_t for an EAGLE-3 head).
    let (n, h, ps) = (
        plan.rows_per_request(PhaseKind::DraftExtend) as usize,
        plan.model.hidden_in() as usize,
        plan.capture.page_size as usize,
    );
    let max_l = (plan.capture.max_context_len as usize).saturating_sub(n);
    let builds: f64 = rt.graph_build_ms.iter().sum();
    let (arena, kv_bytes) = (rt.arena_bytes(), rt.kv_bytes());
    record_gemms(name, &rt, n, bench);
    for b in BATCHES
        .into_iter()
        .filter(|&b| plan.buckets().iter().any(|x| x.batch as usize == b))
    {
        for l in PREFIXES.into_iter().filter(|&l| l <= max_l) {
            let per = (l + n).div_ceil(ps);
            if b * per + 1 > rt.pool_pages() as usize {
                continue;
            }
            let order: Vec<usize> = if o.contiguous {
                (0..b * per).collect()
            } else {
                Rng(0x5eed_0000 + (b * per) as u64).permutation(b * per)
            };
            for i in 0..b {
                let pages: Vec<i32> = order[i * per..(i + 1) * per].iter().map(|&p| p as i32).collect();
                rt.set_pages(i, &pages).map_err(g)?;
            }
            let slots: Vec<i32> = (0..b as i32).collect();
            let ids: Vec<i64> = (0..b * n).map(|i| (i % 1000) as i64).collect();
            let dev = DeviceBuf::new(b * n * h * 2)?;
            dev.fill(0x3c, stream)?;
            let (prefix, accept) = (vec![l as i32; b], vec![n as i32; b]);
            let req = StepRequest {
                slots: &slots,
                input_ids: &ids,
                hidden: Hidden::Device(dev.ptr),
                prefix_lens: &prefix,
                accept_lens: &accept,
            };
            // Full step: host wall clock from prep to completion.
            let (mut preps, mut walls) = (Vec::new(), Vec::new());
            for i in 0..WARMUP + RUNS {
                let w0 = Instant::now();
                let info = rt.step(&req, false).map_err(g)?;
                timer.wait()?;
                if i >= WARMUP {
                    walls.push(w0.elapsed().as_secs_f64() * 1e6);
                    preps.push(info.prep_us);
                }
            }
            let replay = timer.time_flushed(&flush, || rt.replay_only(b as u32, None).map_err(g))?;
            let eager = timer.time(|| rt.step(&req, true).map(|_| ()).map_err(g))?;
            // Attention alone: its launches captured as a graph of their own, L2 flushed.
            let attn_graph = rt.capture_where(b as u32, "attention").map_err(g)?;
            let attn = timer.time_flushed(&flush, || {
                attn_graph.launch().map_err(|e| format!("attention graph: {e:?}"))
            })?;
            drop(attn_graph);
            // Where the replay goes: each op's launches alone, at L 1024, smallest and largest B.
            let work = floors::Work::of(plan, b as u64, l as u64);
            if l == 1024 && (b == 1 || b == 64) {
                breakdown(name, plan, &rt, &timer, &flush, (b, l), replay, &work, bench)?;
            }
            if o.gemm_flip && l == 1024 && (b == 1 || b == 8) {
                gemm_flips(name, plan, &mut rt, &timer, &flush, (b, l), bench)?;
            }
            rt.synchronize().map_err(g)?;
            let row = BenchRow {
                plan: name.into(),
                batch: b,
                prefix: l,
                pages: if o.contiguous { "contiguous" } else { "scattered" },
                prep_us: median(preps),
                replay_us: replay,
                full_us: median(walls),
                eager_us: eager,
                floor_us: work.floor_us(&c),
                op_floor_us: work.op_floor_us(&c),
                attn_us: attn,
                attn_tb_s: work.attn_bytes() / (attn * 1e-6) / 1e12,
                graph_build_ms_all: builds,
                gemm_tune_ms: rt.gemm_tune_ms,
                load_ms,
                arena_bytes: rt.arena_bytes(),
                kv_bytes: rt.kv_bytes(),
            };
            println!("{}", table_row(&row));
            bench.rows.push(row);
        }
    }
    decode::bench(
        name,
        plan,
        &mut rt,
        &timer,
        &flush,
        c.copy_bytes_per_s,
        c.bf16_flops_per_s,
        &BATCHES,
        &PREFIXES,
        &mut bench.decode,
    )?;
    drop(rt);
    bench_engine(name, plan, &flush, o, bench)?;
    println!(
        "{name}: plan+weights load {load_ms:.0} ms, graphs {builds:.1} ms for {} buckets, arena {} B, kv {} B",
        plan.buckets().len(),
        arena,
        kv_bytes
    );
    Ok(())
}

/// The tuner's choice for each GEMM of the benchmarked buckets (and every m ≤ 64), printed and
/// kept in specbench.json.
fn record_gemms(name: &str, rt: &GpuRuntime, n: usize, bench: &mut Bench) {
    let mut tuned = Vec::new();
    for (m, gn, k, ch) in rt.gemm_choices() {
        if BATCHES.iter().any(|&b| m == (b * n) as u64) || m <= 64 {
            tuned.push(format!(
                "m{m} n{gn} k{k}: {:.1} -> {:.1} µs (#{} of {}{})",
                ch.first_us,
                ch.best_us,
                ch.rank,
                ch.candidates,
                match (ch.ours, ch.split) {
                    (true, _) => ": skinny_gemm".to_string(),
                    (false, 1) => String::new(),
                    (false, s) => format!(": split-K {s}"),
                }
            ));
            bench.gemms.push(GemmRecord {
                plan: name.into(),
                m,
                n: gn,
                k,
                first_us: ch.first_us,
                best_us: ch.best_us,
                rank: ch.rank,
                candidates: ch.candidates,
                skinny: ch.ours,
                split: ch.split,
            });
        }
    }
    println!("{name}: GEMM tuning {:.0} ms; {}", rt.gemm_tune_ms, tuned.join("; "));
}

/// Where one (B, L)'s replay goes: each op's launches alone as a graph of their own (L2
/// flushed before each run), then the same ops as the whole graph runs them (spans between
/// event nodes, not flushed).
#[allow(clippy::too_many_arguments)]
fn breakdown(
    name: &str,
    plan: &ValidatedPlan,
    rt: &GpuRuntime,
    timer: &Timer,
    flush: &DeviceBuf,
    (b, l): (usize, usize),
    replay: f64,
    work: &floors::Work,
    bench: &mut Bench,
) -> Result<(), String> {
    let bk = plan.buckets().iter().find(|x| x.batch == b as u32).ok_or("bucket")?;
    let mut ops: Vec<&str> = Vec::new();
    for launch in &bk.launches {
        if !ops.contains(&launch.op.as_str()) {
            ops.push(&launch.op);
        }
    }
    let mut parts = Vec::new();
    for op in ops {
        let graph = rt.capture_where(b as u32, op).map_err(g)?;
        let us = timer.time_flushed(flush, || graph.launch().map_err(|e| format!("{op}: {e:?}")))?;
        parts.push(format!("{op} {us:.1}"));
        bench.ops.push(OpTime {
            plan: name.into(),
            batch: b,
            prefix: l,
            op: op.into(),
            us,
        });
    }
    println!("  ops ({name}, B {b}, L {l}, µs): {}", parts.join(", "));
    // The same ops as the whole graph runs them: spans between event nodes.
    let t = rt.timeline(b as u32, 50).map_err(g)?;
    let mut sum = [0.0f64; 3];
    let mut line = Vec::new();
    for s in &t.ops {
        let (class, i) = if s.gemm {
            ("gemm", 0)
        } else if s.op.contains("attention") {
            ("attention", 1)
        } else {
            ("kernel", 2)
        };
        sum[i] += s.us;
        line.push(format!("{} {:.1}", s.op, s.us));
        bench.spans.push(SpanTime {
            plan: name.into(),
            batch: b,
            prefix: l,
            op: s.op.clone(),
            class,
            us: s.us,
        });
    }
    println!(
        "  timeline ({name}, B {b}, L {l}, µs): gemm {:.1}, attention {:.1}, small kernels {:.1}; instrumented {:.1} vs replay {replay:.1} (L2 flushed); {}",
        sum[0],
        sum[1],
        sum[2],
        t.total_us,
        line.join(", ")
    );
    let (gemm_weight_bytes, gemm_flops) = work.gemm_totals();
    bench.breakdown.push(Breakdown {
        plan: name.into(),
        batch: b,
        prefix: l,
        gemm_us: sum[0],
        attention_us: sum[1],
        kernel_us: sum[2],
        timeline_us: t.total_us,
        replay_us: replay,
        gemm_weight_bytes,
        gemm_flops,
    });
    Ok(())
}

/// Alternations of the two choices per GEMM in `gemm_flips`.
const FLIP_ROUNDS: usize = 3;

/// Each GEMM of bucket `b` with its load-time choice against the other (skinny kernel or
/// cuBLASLt), inside the bucket's plan launches captured as one graph (no admit or emit, no
/// L2 branches): the GEMM choice is timed one GEMM at a time after an L2 flush, and
/// perf-notes items 24 and 34 saw GEMMs behave otherwise in a chain. Captured afresh each
/// way, alternated `FLIP_ROUNDS` times (which goes first alternates too), L2 flushed before
/// each replay; the load-time choice is restored after each. The runtime must be loaded
/// with `gemm_switchable`.
fn gemm_flips(
    name: &str,
    plan: &ValidatedPlan,
    rt: &mut GpuRuntime,
    timer: &Timer,
    flush: &DeviceBuf,
    (b, l): (usize, usize),
    bench: &mut Bench,
) -> Result<(), String> {
    let bk = plan.buckets().iter().find(|x| x.batch == b as u32).ok_or("bucket")?;
    let mut dims: Vec<(u64, u64, u64)> = Vec::new();
    for launch in &bk.launches {
        if let LaunchKind::Gemm(gd) = &launch.kind {
            if !dims.contains(&(gd.m, gd.n, gd.k)) {
                dims.push((gd.m, gd.n, gd.k));
            }
        }
    }
    let batch = b as u32;
    let time = |rt: &GpuRuntime| -> Result<f64, String> {
        let graph = rt.capture_where(batch, "").map_err(g)?;
        timer.time_flushed(flush, || graph.launch().map_err(|e| format!("bucket graph: {e:?}")))
    };
    // The other choice's graph, the load-time choice restored before any error is passed on.
    let flipped = |rt: &mut GpuRuntime, (m, n, k): (u64, u64, u64)| -> Result<Result<f64, String>, String> {
        match rt.flip_gemm(batch, m, n, k).map_err(g)? {
            GemmFlip::Switched { .. } => {}
            refused => return Ok(Err(format!("{refused:?}"))),
        }
        let t = time(rt);
        rt.flip_gemm(batch, m, n, k).map_err(g)?;
        Ok(Ok(t?))
    };
    let mut line = Vec::new();
    for (m, n, k) in dims {
        let tuned_skinny = rt.gemm_choice(batch, m, n, k).map_err(g)?.is_some_and(|c| c.ours);
        let (mut tuned, mut other, mut refused) = (Vec::new(), Vec::new(), None);
        for round in 0..FLIP_ROUNDS {
            if round % 2 == 1 && refused.is_none() {
                match flipped(rt, (m, n, k))? {
                    Ok(us) => other.push(us),
                    Err(why) => refused = Some(why),
                }
            }
            tuned.push(time(rt)?);
            if round % 2 == 0 && refused.is_none() {
                match flipped(rt, (m, n, k))? {
                    Ok(us) => other.push(us),
                    Err(why) => refused = Some(why),
                }
            }
        }
        let (tuned_us, flipped_us) = (median(tuned), (!other.is_empty()).then(|| median(other)));
        let label = if tuned_skinny { "skinny" } else { "cublasLt" };
        line.push(match (flipped_us, &refused) {
            (Some(f), _) => format!(
                "m{m} n{n} k{k} {label} {tuned_us:.1}, other {f:.1} ({:.3}x)",
                f / tuned_us
            ),
            (None, why) => format!("m{m} n{n} k{k} {label} {tuned_us:.1}, other not timed: {why:?}"),
        });
        bench.gemm_flips.push(GemmFlipRecord {
            plan: name.into(),
            batch: b,
            prefix: l,
            m,
            n,
            k,
            tuned_skinny,
            tuned_us,
            flipped_us,
            refused,
            rounds: FLIP_ROUNDS,
        });
    }
    println!(
        "  gemm flip ({name}, B {b}, L {l}; the bucket's graph, µs, with the load-time choice and with the other, other/load-time): {}",
        line.join("; ")
    );
    Ok(())
}

/// Steady-state host timing of `step_device`: bursts × calls per burst.
const HOST_BURSTS: usize = 40;
const HOST_BURST_LEN: usize = 8;

/// The same steps in engine memory (caller's pool, table, weights, inputs and stream), at
/// L 1024: host time of the call and the step's time on the stream, beside the owned replay.
fn bench_engine(name: &str, plan: &ValidatedPlan, flush: &DeviceBuf, o: Opts, bench: &mut Bench) -> Result<(), String> {
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let l = 1024usize;
    if l + n > plan.capture.max_context_len as usize {
        return Ok(());
    }
    for b in BATCHES
        .into_iter()
        .filter(|&b| plan.buckets().iter().any(|x| x.batch as usize == b))
    {
        let t0 = Instant::now();
        let opts = GpuOptions {
            l2_prefetch: o.l2_prefetch,
            split_gemm_round: o.split_gemm_round,
            ..GpuOptions::default()
        };
        let mut f = specplan_tests::engine::bench_fixture(plan, b, l, opts)?;
        let load_ms = t0.elapsed().as_secs_f64() * 1e3;
        let timer = Timer::new(f.stream.cu_stream())?;
        let step = f.step;
        let step_us = timer.time_flushed(flush, || f.runtime.step_device(&step).map(|_| ()).map_err(g))?;
        // Host time in steady state: bursts of calls issued back to back, each while the
        // earlier steps still run (the GPU step takes far longer than the call), with a
        // wait between bursts so the launch queue never fills.
        let (mut hosts, mut preps) = (Vec::new(), Vec::new());
        for _ in 0..HOST_BURSTS {
            for _ in 0..HOST_BURST_LEN {
                let h0 = Instant::now();
                let info = f.runtime.step_device(&step).map_err(g)?;
                hosts.push(h0.elapsed().as_secs_f64() * 1e6);
                preps.push(info.prep_us);
            }
            timer.wait()?;
        }
        let host_p90_us = percentile(hosts.clone(), 0.9);
        // The same call with one step ahead of it: an untimed call after the wait, then the
        // timed one (the queue holds one step, the thread is already awake).
        let mut ahead1 = Vec::new();
        for _ in 0..HOST_BURSTS * HOST_BURST_LEN {
            f.runtime.step_device(&step).map_err(g)?;
            let h0 = Instant::now();
            f.runtime.step_device(&step).map_err(g)?;
            ahead1.push(h0.elapsed().as_secs_f64() * 1e6);
            timer.wait()?;
        }
        let host_ahead1_p90_us = percentile(ahead1.clone(), 0.9);
        let bi = plan.buckets().iter().position(|x| x.batch as usize >= b).unwrap_or(0);
        let nodes = f.runtime.graph_nodes(bi).map_err(g)?;
        if let Some(e) = f.runtime.last_error().map_err(g)? {
            return Err(format!("{name} engine b={b}: {e}"));
        }
        let owned_replay_us = bench
            .rows
            .iter()
            .find(|r| r.plan == name && r.batch == b && r.prefix == l)
            .map_or(f64::NAN, |r| r.replay_us);
        let row = EngineRow {
            plan: name.into(),
            batch: b,
            prefix: l,
            host_us: median(hosts),
            host_p90_us,
            host_ahead1_us: median(ahead1),
            host_ahead1_p90_us,
            prep_us: median(preps),
            step_us,
            owned_replay_us,
            load_ms,
        };
        println!(
            "  engine memory ({name}, B {b}, L {l}): host {:.2} µs per step call (p90 {:.2}, {:.2} before the graph launch; one step ahead: {:.2}, p90 {:.2}; graph: {}), step {:.1} µs on the stream (owned replay {:.1} µs)",
            row.host_us,
            row.host_p90_us,
            row.prep_us,
            row.host_ahead1_us,
            row.host_ahead1_p90_us,
            nodes.map_or("none".to_string(), |n| n.to_string()),
            row.step_us,
            row.owned_replay_us
        );
        bench.engine.push(row);
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    const USAGE: &str =
        "usage: specbench PLAN_DIR OUT_DIR [--contiguous] [--decode-only] [--l2-prefetch off|MIB[xCTAS][/MAXB]] [--gemm-flip] [--split-gemm-round]";
    let [_, dir, out, rest @ ..] = args.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let mut o = Opts::default();
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--contiguous" => o.contiguous = true,
            "--decode-only" => o.decode_only = true,
            "--gemm-flip" => o.gemm_flip = true,
            "--split-gemm-round" => o.split_gemm_round = true,
            "--l2-prefetch" => match specplan_tests::l2_branch::parse_arg(it.next()) {
                Ok(p) => o.l2_prefetch = p,
                Err(e) => {
                    eprintln!("specbench: {e}\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            other => {
                eprintln!("specbench: unknown argument `{other}`\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    if o.gemm_flip && o.decode_only {
        eprintln!("specbench: --gemm-flip times draft-extend buckets; --decode-only has none\n{USAGE}");
        return ExitCode::from(2);
    }
    if !GpuRuntime::available() {
        println!("SKIP: no CUDA driver or device on this machine");
        return ExitCode::SUCCESS;
    }
    let run = || -> Result<String, String> {
        let mut bench = Bench {
            l2_prefetch: o.l2_prefetch.to_string(),
            split_gemm_round: o.split_gemm_round,
            ..Bench::default()
        };
        let mut ceil = None;
        for f in plan_files(dir)? {
            let name = f
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let plan = load_file(&f).map_err(|e| format!("{name}: {e}"))?;
            bench_plan(&name, &plan, &mut ceil, o, &mut bench)?;
            write_results(out, &bench)?;
        }
        write_results(out, &bench)
    };
    match run() {
        Ok(table) => {
            println!("\n{table}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("specbench: FAILED: {e}");
            ExitCode::from(1)
        }
    }
}
