//! GPU correctness check: every plan in a folder, replayed on the GPU as a graph and
//! eagerly, against the CPU reference executor, on fresh random weights and inputs (the
//! checks and their bounds: `specplan_tests::checks`).
//!
//! ```text
//! gpucheck PLAN_DIR OUT_DIR [--quick]          every plan; OUT_DIR/gpucheck.json
//! gpucheck contract PLAN SPECPLAN_BIN WORK_DIR  `specplan run` on cpu, cuda graph, cuda eager
//! gpucheck sanitize PLAN... [--prefill-gemm-outputs | --kernels-only]
//!          [--split-gemm-round] [--l2-prefetch SPEC]
//!                                               every kernel at the smallest and largest bucket
//!                                               (the switches: their launches too)
//! gpucheck entries                              the kernel entry names, `|`-separated
//! gpucheck soak OUT_DIR PLAN [STEPS] [EVERY]     random steps: graph == eager, cache kept, CPU samples
//! gpucheck engine OUT_DIR SGLANG_PLAN VLLM_PLAN LOAD_PLAN
//!                                               engine memory (`specplan_tests::engine`)
//! gpucheck engine-memory OUT_DIR PLAN...         the memory a load with every bucket graphed
//!                                               adds (`.ci/gpu bench`); OUT_DIR/engine-memory.json
//! gpucheck nccl                                 NCCL on one GPU (`specplan_tests::tp_check`)
//! gpucheck tp WORK_DIR FULL_PLAN RANK_PLAN...    T ranks on T GPUs against the unsharded plan
//! gpucheck numerics PLAN...                      no GPU: each plan's storage precision against
//!                                               the exact CPU executor (`specplan_tests::numerics`)
//! ```
//!
//! Per plan and batch size b (bucket sizes and sizes in between, so padding is exercised,
//! and above the largest bucket): outputs poisoned first; graph vs CPU; graph == eager
//! bitwise; unwritten cache bit-identical. Then the attention kernels alone at long
//! prefixes, and replay latency. Prints SKIP and exits 0 where there is no CUDA driver;
//! exits 1 when any check fails.

use std::process::ExitCode;
use std::time::Instant;

use specplan_format::PhaseKind;
use specplan_format::{load_file, ValidatedPlan};
use specplan_runtime::cpu::WeightData;
use specplan_runtime::gpu::{GpuOptions, GpuRuntime};
use specplan_tests::checks::{attention_check, check_case, contract_check, replay_us, ATTN_MAX_BOUND, REL_BOUND};
use specplan_tests::decode_check::{check_decode, TREE_AGREEMENT};
use specplan_tests::numerics::{Numerics, PROB_RMS_TARGET};
use specplan_tests::random::{make_case, random_weights};
use specplan_tests::report::{AttentionReport, GraphBuild, Latency, PlanReport};
use specplan_tests::{json, plan_files, seed, write_atomic, Rng};

mod engine;

fn batches(plan: &ValidatedPlan, quick: bool) -> Vec<usize> {
    let max_b = plan.buckets().last().map_or(1, |b| b.batch as usize);
    let mut bs = vec![1, 3, max_b.min(8), max_b.min(5)];
    if !quick {
        bs.push(max_b);
        if max_b > 8 {
            bs.extend([max_b - 1, max_b + 3]);
        }
    }
    bs.sort_unstable();
    bs.dedup();
    bs.retain(|&b| b <= plan.capture.max_requests as usize);
    bs
}

fn check_plan(name: &str, plan: &ValidatedPlan, rng: &mut Rng, quick: bool) -> PlanReport {
    let mut rep = PlanReport {
        plan: name.into(),
        ..PlanReport::default()
    };
    let weights = random_weights(plan, rng);
    let t0 = Instant::now();
    let mut rt = match GpuRuntime::new(plan.clone(), &weights, GpuOptions::default()) {
        Ok(r) => r,
        Err(e) => {
            rep.errors.push(format!("runtime: {e}"));
            return rep;
        }
    };
    rep.load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let max_prefix = (plan.capture.max_context_len - plan.rows_per_request(PhaseKind::DraftExtend)) as usize;
    for b in batches(plan, quick) {
        let c = make_case(plan, rng, b, max_prefix.min(700));
        match check_case(plan, &mut rt, &weights, &c) {
            Ok(e) => {
                println!(
                    "{:<28} {:>5} {:>6} {:>10.2e} {:>9.1e} {:>9.2e} {:>8} {:>9}  {}  (targets: p rms {:.2e}, largest {:.2e}, {} p off, {} ids off{})",
                    name,
                    b,
                    e.bucket,
                    e.hidden_rel,
                    e.prob_abs,
                    e.kv_rel,
                    e.id_mismatch,
                    e.graph_vs_eager_diff,
                    if e.ok { "ok" } else { "FAIL" },
                    e.numerics.prob_rms,
                    e.numerics.prob_rel,
                    e.numerics.prob_off,
                    e.numerics.id_off,
                    if e.numerics.meets_targets() { ": all met" } else { "" }
                );
                for f in &e.failures {
                    println!("    {f}");
                }
                rep.cases.push(e);
            }
            Err(msg) => {
                println!("{name:<28} {b:>5}  ERROR {msg}");
                rep.errors.push(format!("b={b}: {msg}"));
            }
        }
    }
    // The probability target over the plan's cases (`numerics`: the pooled RMS), where the
    // draft-extend stream is fp32.
    let pooled = rep
        .cases
        .iter()
        .fold(Numerics::default(), |a, e| a.max(e.numerics.clone()));
    println!(
        "{name:<28} numerics over {} cases: hidden {:.2e}, p rms {:.2e} over {} (asserted <= {PROB_RMS_TARGET:e}), largest {:.2e}, {} p off, {} ids off{}",
        rep.cases.len(),
        pooled.hidden_rel,
        pooled.prob_rms,
        pooled.prob_count,
        pooled.prob_rel,
        pooled.prob_off,
        pooled.id_off,
        if pooled.meets_targets() { ": all met" } else { "" }
    );
    if let Some(f) = pooled.probability_failure(plan) {
        println!("    {f}");
        rep.errors.push(f);
    }
    // The attention kernels alone, at long prefixes (splits, several key tiles).
    let attn_prefix = max_prefix.min(3000);
    let max_b = plan.buckets().last().map_or(1, |b| b.batch as usize);
    for b in [1usize, 3, max_b.min(8)] {
        if b > plan.capture.max_requests as usize || plan.bucket_for(b as u32).is_none() {
            continue;
        }
        match attention_check(plan, &mut rt, rng, b, attn_prefix) {
            Ok((rel, max_rel)) => {
                let ok = rel <= REL_BOUND && max_rel <= ATTN_MAX_BOUND;
                println!(
                    "{name:<28} {b:>5} attention alone (prefix <= {attn_prefix}): rel {rel:.2e}, max abs / rms {max_rel:.2e}  {}",
                    if ok { "ok" } else { "FAIL" }
                );
                rep.attention.push(AttentionReport {
                    b,
                    rel,
                    max_abs_over_rms: max_rel,
                    ok,
                });
            }
            Err(msg) => {
                println!("{name:<28} {b:>5} attention alone: ERROR {msg}");
                rep.errors.push(format!("attention b={b}: {msg}"));
            }
        }
    }
    // Owned memory's admission of requests sharing cache pages (four steps of two requests).
    if plan.capture.max_requests >= 2 {
        match specplan_tests::owned_refusals::owned_refusals(plan, &mut rt) {
            Ok(()) => println!("{name}: shared pages in owned memory: refused and admitted as the rules say  ok"),
            Err(e) => {
                println!("{name}: shared pages in owned memory: FAIL {e}");
                rep.errors.push(format!("owned refusals: {e}"));
            }
        }
    }
    // Graph steps that stage their own inputs (`stage_in`): host and device hidden states,
    // steps without a wait between them, a replay on the inputs in place, against the
    // eager step bit for bit.
    if plan.buckets().iter().any(|x| x.batch >= 2) {
        match specplan_tests::owned_staging::owned_staging(plan, &mut rt, rng) {
            Ok(n) => println!("{name}: graph steps staging their inputs: {n} steps equal to the eager step  ok"),
            Err(e) => {
                println!("{name}: graph steps staging their inputs: FAIL {e}");
                rep.errors.push(format!("owned staging: {e}"));
            }
        }
    }
    // The graphs' L2 prefetch branches (off by default): on the small plans, whose second
    // load is cheap, the branches are where the windows say and change no output.
    if plan.weight_bytes <= 64 << 20 && plan.buckets().iter().any(|x| x.batch >= 2) {
        match specplan_tests::l2_branch::l2_branches(plan, &weights, rng) {
            Ok((n, steps)) => println!(
                "{name}: L2 prefetch branches: {n} in the graphs, {steps} graph steps equal to the eager step  ok"
            ),
            Err(e) => {
                println!("{name}: L2 prefetch branches: FAIL {e}");
                rep.errors.push(format!("l2 branches: {e}"));
            }
        }
    }
    check_decode_phases(name, plan, rng, quick, &mut rep);
    for b in [1u32, 8, 32, 64] {
        if plan.buckets().iter().any(|x| x.batch == b) {
            match replay_us(&mut rt, plan, rng, b as usize, max_prefix.min(1024)) {
                Ok((replay_us, prep_us)) => rep.latency.push(Latency {
                    bucket: b,
                    replay_us,
                    prep_us,
                }),
                Err(e) => rep.errors.push(format!("replay timing b={b}: {e}")),
            }
        }
    }
    rep.graph_build = plan
        .buckets()
        .iter()
        .zip(&rt.graph_build_ms)
        .map(|(b, &ms)| GraphBuild { bucket: b.batch, ms })
        .collect();
    rep.arena_bytes = rt.arena_bytes();
    rep.kv_bytes = rt.kv_bytes();
    let lat: Vec<String> = rep
        .latency
        .iter()
        .map(|l| format!("b{} {:.1} µs (prep {:.1})", l.bucket, l.replay_us, l.prep_us))
        .collect();
    // Memset nodes turned into fill launches across the buckets' graphs (each graph is
    // checked against its eager run, whose GEMMs issue the memsets themselves).
    let fills: usize = (0..plan.buckets().len())
        .filter_map(|bi| rt.graph_nodes(bi).ok().flatten())
        .map(|n| n.fills)
        .sum();
    println!(
        "{name}: load+build {:.1} ms, graphs {:.1} ms total ({fills} memsets as fill launches), arena {} B, kv {} B; replay {}",
        rep.load_ms,
        rt.graph_build_ms.iter().sum::<f64>(),
        rep.arena_bytes,
        rep.kv_bytes,
        lat.join(", ")
    );
    rep
}

/// Every draft-decode phase of the plan on its own runtime, whose lm_head is 4× the random
/// one (peaked distributions: fewer near ties between the GPU's and the CPU's trees).
fn check_decode_phases(name: &str, plan: &ValidatedPlan, rng: &mut Rng, quick: bool, rep: &mut PlanReport) {
    let kinds: Vec<PhaseKind> = plan.phases.iter().map(|p| p.kind).filter(|k| k.steps() > 0).collect();
    if kinds.is_empty() {
        return;
    }
    let mut weights = random_weights(plan, rng);
    for (w, d) in plan.weights.iter().zip(weights.iter_mut()) {
        if let (true, WeightData::F32(v)) = (w.name.starts_with("lm_head"), d) {
            v.iter_mut().for_each(|x| *x *= 4.0);
        }
    }
    let mut rt = match GpuRuntime::new(plan.clone(), &weights, GpuOptions::default()) {
        Ok(r) => r,
        Err(e) => {
            rep.errors.push(format!("draft-decode runtime: {e}"));
            return;
        }
    };
    for kind in kinds {
        let Some(ph) = plan.phase(kind) else { continue };
        let max_b = ph
            .buckets
            .last()
            .map_or(1, |b| b.batch as usize)
            .min(plan.capture.max_requests as usize);
        let mut batches = vec![1, 3.min(max_b), max_b];
        if quick {
            batches.truncate(2);
        }
        batches.dedup();
        let (mut equal, mut ties, mut total) = (0, 0, 0);
        for b in batches {
            match check_decode(plan, &mut rt, &weights, kind, rng, b) {
                Ok(d) => {
                    println!(
                        "{name:<28} {b:>5} {} bucket {}: trees equal {}/{b} ({} differ, {} at a near tie; {} lane inputs parted at a hidden tie), lane K/V rel {:.2e}, graph != eager {}, other K/V changed {}, replay {:.1} µs  {}",
                        d.phase,
                        d.bucket,
                        d.equal,
                        d.differ,
                        d.near_ties,
                        d.lane_ties,
                        d.kv_rel,
                        d.graph_vs_eager_diff,
                        d.kv_untouched_changed,
                        d.replay_us,
                        if d.ok { "ok" } else { "FAIL" }
                    );
                    for f in &d.failures {
                        println!("    {f}");
                    }
                    // A tree that parts at a near tie is not held against the phase.
                    (equal, ties, total) = (equal + d.equal, ties + d.near_ties, total + b);
                    rep.decode.push(d);
                }
                Err(msg) => {
                    println!("{name:<28} {b:>5} {}: ERROR {msg}", kind.label());
                    rep.errors.push(format!("{} b={b}: {msg}", kind.label()));
                }
            }
        }
        let share = (equal + ties) as f64 / total.max(1) as f64;
        let ok = share >= TREE_AGREEMENT;
        println!(
            "{name:<28} {}: trees equal to the CPU executor's in {equal}/{total} requests, {ties} more parted at a near tie (at least {:.0}% together)  {}",
            kind.label(),
            TREE_AGREEMENT * 100.0,
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            rep.errors.push(format!(
                "{}: trees equal in only {equal}/{total} requests",
                kind.label()
            ));
        }
    }
}

/// The soak (`specplan_tests::soak`): STEPS random steps (default 10,000), every
/// SAMPLE_EVERY-th (default 100) against the CPU executor.
fn soak(out: &str, plan: &str, rest: &[String]) -> ExitCode {
    let num = |i: usize, d: usize| rest.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (steps, every) = (num(0, 10_000), num(1, 100));
    let mut rng = Rng(seed());
    let r = load_file(std::path::Path::new(plan))
        .map_err(|e| e.to_string())
        .and_then(|p| specplan_tests::soak::soak(&p, &mut rng, steps, every));
    match r {
        Ok(rep) => {
            let verdict = if rep.failures.is_empty() { "ok" } else { "FAIL" };
            println!(
                "soak {}: {} steps in {:.1} s ({} graph, {} chunked, {} against the CPU executor, worst hidden rel {:.2e}); graph vs eager differing values {}, cache values outside the written slots changed {}; free device memory {} -> {} bytes  {verdict}",
                rep.plan,
                rep.steps,
                rep.seconds,
                rep.graph_steps,
                rep.chunked_steps,
                rep.sampled,
                rep.worst_hidden_rel,
                rep.graph_vs_eager_diffs,
                rep.untouched_changed,
                rep.free_bytes_after_warmup,
                rep.free_bytes_at_end
            );
            for f in &rep.failures {
                println!("    {f}");
            }
            let path = std::path::Path::new(out).join(format!("soak-{}.json", rep.plan));
            if let Err(e) = std::fs::create_dir_all(out)
                .map_err(|e| e.to_string())
                .and_then(|_| write_atomic(&path, &json(&rep)))
            {
                eprintln!("soak: {e}");
            }
            ExitCode::from(!rep.failures.is_empty() as u8)
        }
        Err(e) => {
            println!("soak {plan}: ERROR {e}");
            ExitCode::from(1)
        }
    }
}

/// `gpucheck numerics`: the CPU-only prediction of each plan's numerics (b 1 and 5, prefixes
/// up to 256), one line per plan; exit 1 when a plan misses a target.
fn numerics(paths: &[String]) -> ExitCode {
    use specplan_tests::numerics::emulate;
    let mut ok = true;
    for path in paths {
        let r = load_file(std::path::Path::new(path))
            .map_err(|e| e.to_string())
            .and_then(|plan| {
                let mut rng = Rng(seed());
                let weights = random_weights(&plan, &mut rng);
                let mut worst = Numerics::default();
                for b in [1usize, 5] {
                    let b = b.min(plan.capture.max_requests as usize);
                    let c = make_case(&plan, &mut rng, b, 256);
                    worst = worst.max(emulate(&plan, &weights, &c)?);
                }
                Ok(worst)
            });
        match r {
            Ok(n) => {
                ok &= n.meets_targets();
                println!(
                    "numerics {path}: hidden rel {:.2e}, prob rms {:.2e} (largest {:.2e}, {} off), ids off {}: {}",
                    n.hidden_rel,
                    n.prob_rms,
                    n.prob_rel,
                    n.prob_off,
                    n.id_off,
                    if n.meets_targets() {
                        "meets the targets"
                    } else {
                        "MISSES a target"
                    }
                );
            }
            Err(e) => {
                ok = false;
                println!("numerics {path}: FAILED: {e}");
            }
        }
    }
    ExitCode::from(if ok { 0 } else { 1 })
}

fn passed(r: &PlanReport) -> bool {
    r.errors.is_empty()
        && r.cases.iter().all(|c| c.ok)
        && r.attention.iter().all(|a| a.ok)
        && r.decode.iter().all(|d| d.ok)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("numerics") {
        return numerics(&args[2..]);
    }
    if !GpuRuntime::available() {
        println!("SKIP: no CUDA driver or device on this machine");
        return ExitCode::SUCCESS;
    }
    if args.get(1).map(String::as_str) == Some("contract-decode") {
        let [_, _, plan, bin, dir, ..] = args.as_slice() else {
            eprintln!("usage: gpucheck contract-decode PLAN SPECPLAN_BIN WORK_DIR");
            return ExitCode::from(2);
        };
        return match specplan_tests::decode_contract::decode_contract_check(plan, bin, dir, seed()) {
            Ok(r) => {
                println!(
                    "contract-decode (specplan run --phase draft_decode, cpu vs cuda graph vs cuda eager): ok: {r}"
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("contract-decode: FAILED: {e}");
                ExitCode::from(1)
            }
        };
    }
    if args.get(1).map(String::as_str) == Some("contract") {
        let [_, _, plan, bin, dir, ..] = args.as_slice() else {
            eprintln!("usage: gpucheck contract PLAN SPECPLAN_BIN WORK_DIR");
            return ExitCode::from(2);
        };
        return match contract_check(plan, bin, dir, seed()) {
            Ok(r) => {
                println!("contract (specplan run, cpu vs cuda graph vs cuda eager): ok: {r}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("contract: FAILED: {e}");
                ExitCode::from(1)
            }
        };
    }
    if args.get(1).map(String::as_str) == Some("nccl") {
        return match specplan_tests::tp_check::nccl_check() {
            Ok(r) => {
                println!("nccl: ok: {r}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("nccl: FAILED: {e}");
                ExitCode::from(1)
            }
        };
    }
    if args.get(1).map(String::as_str) == Some("tp") {
        let [_, _, work, full, ranks @ ..] = args.as_slice() else {
            eprintln!("usage: gpucheck tp WORK_DIR FULL_PLAN RANK_PLAN...");
            return ExitCode::from(2);
        };
        let load = |p: &String| load_file(std::path::Path::new(p)).map_err(|e| format!("{p}: {e}"));
        let r = load(full).and_then(|f| {
            let rs = ranks.iter().map(load).collect::<Result<Vec<_>, _>>()?;
            specplan_tests::tp_check::tp_check(&f, &rs, std::path::Path::new(work), seed())
        });
        return match r {
            Ok(r) => {
                println!("tp: ok: {r}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("tp: FAILED: {e}");
                ExitCode::from(1)
            }
        };
    }
    if args.get(1).map(String::as_str) == Some("entries") {
        // The kernel names, for the sanitizers' --kernel-name filter.
        let names: Vec<&str> = specplan_format::Entry::ALL.iter().map(|e| e.name()).collect();
        println!("{}", names.join("|"));
        return ExitCode::SUCCESS;
    }
    if args.get(1).map(String::as_str) == Some("sanitize") {
        return sanitize(&args[2..]);
    }
    if args.get(1).map(String::as_str) == Some("soak") {
        let [_, _, out, plan, rest @ ..] = args.as_slice() else {
            eprintln!("usage: gpucheck soak OUT_DIR PLAN [STEPS] [SAMPLE_EVERY]");
            return ExitCode::from(2);
        };
        return soak(out, plan, rest);
    }
    if args.get(1).map(String::as_str) == Some("engine-decode") {
        let [_, _, plans @ ..] = args.as_slice() else {
            return ExitCode::from(2);
        };
        if plans.is_empty() {
            eprintln!("usage: gpucheck engine-decode PLAN [PLAN ...]");
            return ExitCode::from(2);
        }
        return engine::engine_decode(plans);
    }
    if args.get(1).map(String::as_str) == Some("engine-memory") {
        let [_, _, out, plans @ ..] = args.as_slice() else {
            eprintln!("usage: gpucheck engine-memory OUT_DIR PLAN [PLAN ...]");
            return ExitCode::from(2);
        };
        if plans.is_empty() {
            eprintln!("usage: gpucheck engine-memory OUT_DIR PLAN [PLAN ...]");
            return ExitCode::from(2);
        }
        return engine::engine_memory(out, plans);
    }
    if args.get(1).map(String::as_str) == Some("engine") {
        let [_, _, out, sglang, vllm, loads @ ..] = args.as_slice() else {
            eprintln!("usage: gpucheck engine OUT_DIR SGLANG_PLAN VLLM_PLAN LOAD_PLAN [LOAD_PLAN ...]");
            return ExitCode::from(2);
        };
        if loads.is_empty() {
            eprintln!("usage: gpucheck engine OUT_DIR SGLANG_PLAN VLLM_PLAN LOAD_PLAN [LOAD_PLAN ...]");
            return ExitCode::from(2);
        }
        return engine::engine(out, sglang, vllm, loads);
    }
    let [_, dir, out, rest @ ..] = args.as_slice() else {
        eprintln!("usage: gpucheck PLAN_DIR OUT_DIR [--quick]");
        return ExitCode::from(2);
    };
    let quick = rest.iter().any(|a| a == "--quick");
    let files = match plan_files(dir) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut rng = Rng(seed());
    let mut reports = Vec::new();
    println!(
        "{:<28} {:>5} {:>6} {:>10} {:>9} {:>9} {:>8} {:>9}  verdict",
        "plan", "b", "bucket", "hidden_rel", "prob_abs", "kv_rel", "ids_bad", "g!=eager"
    );
    for f in files {
        let name = f
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let rep = match load_file(&f) {
            Ok(plan) => check_plan(&name, &plan, &mut rng, quick),
            Err(e) => PlanReport {
                plan: name.clone(),
                errors: vec![format!("cannot load: {e}")],
                ..PlanReport::default()
            },
        };
        for e in &rep.errors {
            println!("{name}: ERROR {e}");
        }
        reports.push(rep);
        let path = std::path::Path::new(out).join("gpucheck.json");
        if let Err(e) = std::fs::create_dir_all(out)
            .map_err(|e| e.to_string())
            .and_then(|_| write_atomic(&path, &json(&reports)))
        {
            eprintln!("cannot write the report: {e}");
        }
    }
    if reports.iter().all(passed) {
        println!("gpucheck: all checks passed");
        ExitCode::SUCCESS
    } else {
        println!("gpucheck: FAILED");
        ExitCode::from(1)
    }
}

/// `gpucheck sanitize PLAN... [--prefill-gemm-outputs | --kernels-only] [--split-gemm-round]
/// [--l2-prefetch SPEC]`: the steps the compute sanitizers watch (`specplan_tests::sanitize`).
fn sanitize(args: &[String]) -> ExitCode {
    const USAGE: &str = "usage: gpucheck sanitize PLAN... [--prefill-gemm-outputs | --kernels-only] \
                         [--split-gemm-round] [--l2-prefetch off|MIB[xCTAS][/MAXB]]";
    let mut prefill = false;
    let mut kernels_only = false;
    let mut split_gemm_round = false;
    let mut l2_prefetch = specplan_runtime::gpu::L2Prefetch::OFF;
    let mut paths = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--prefill-gemm-outputs" => prefill = true,
            "--kernels-only" => kernels_only = true,
            "--split-gemm-round" => split_gemm_round = true,
            "--l2-prefetch" => match specplan_tests::l2_branch::parse_arg(it.next()) {
                Ok(p) => l2_prefetch = p,
                Err(e) => {
                    eprintln!("gpucheck sanitize: {e}\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            s if s.starts_with("--") => {
                eprintln!("gpucheck sanitize: unknown option `{s}`\n{USAGE}");
                return ExitCode::from(2);
            }
            _ => paths.push(a),
        }
    }
    // The kernels-only steps run no graph and no library GEMM: neither switch has a launch there.
    if paths.is_empty() || (kernels_only && (prefill || split_gemm_round || l2_prefetch.is_on())) {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    }
    let mut rng = Rng(seed());
    let mut failed = false;
    for path in paths {
        let r = load_file(std::path::Path::new(path))
            .map_err(|e| e.to_string())
            .and_then(|p| {
                if kernels_only {
                    specplan_tests::sanitize::kernel_steps(&p, &mut rng)
                } else {
                    // initcheck's run (`--prefill-gemm-outputs`) with a switch takes the
                    // heuristic's GEMMs, timed by no one: a split load times its candidates
                    // afresh (it keeps out of the GEMM cache), and the tuner's `gemm_round`
                    // reads scratch a cuBLAS candidate wrote, whose stores initcheck cannot
                    // see (2,000 false reports before the first step, H100, 2026-12-05).
                    // memcheck's and synccheck's runs keep the tuner, so the split path's
                    // skinny GEMM (and its `gemm_round`) runs there, in the tuning and in
                    // the steps.
                    let switched = prefill && (split_gemm_round || l2_prefetch.is_on());
                    let opts = specplan_runtime::gpu::GpuOptions {
                        split_gemm_round,
                        l2_prefetch,
                        gemms: if switched {
                            specplan_runtime::gpu::GemmPolicy::Heuristic
                        } else {
                            specplan_runtime::gpu::GemmPolicy::Cached
                        },
                        ..Default::default()
                    };
                    specplan_tests::sanitize::sanitize_steps(&p, &mut rng, prefill, opts)
                }
            });
        match r {
            Ok(()) => println!("sanitize {path}: steps ran"),
            Err(e) => {
                println!("sanitize {path}: ERROR {e}");
                failed = true;
            }
        }
    }
    ExitCode::from(failed as u8)
}
