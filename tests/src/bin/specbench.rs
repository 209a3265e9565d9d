//! `specbench PLAN_DIR OUT_DIR`: times every plan's draft-extend step on the GPU, beside the
//! device's own ceilings measured in the same run.
//!
//! Per plan, bucket B and prefix length L (every request at L):
//! - host prep µs (checks, staging, copies issued), replay µs (graph only, CUDA events),
//!   full step µs (prep + copies + replay, host wall clock until the step's event
//!   completes), eager µs (the same launches without a graph);
//! - attention alone µs (its launches only) and its useful TB/s (K/V read, q read, o written);
//! - the floor: the larger of bytes / copy bandwidth and FLOPs / bf16 matmul rate, both
//!   measured here; every time is also reported as a ratio to it.
//!
//! Each number is a median of 100 runs after 10 warm-up runs. Weights are a fixed pattern
//! (timing does not depend on values). Pages are dealt in a fixed random order (scattered,
//! as a pool that has served other requests hands them out, and as the peer benchmark
//! deals them); `--contiguous` gives every request consecutive pages instead. Results are
//! rewritten after every plan, so a run cut short keeps what it measured. Prints SKIP
//! without a GPU.

use std::ffi::c_void;
use std::process::ExitCode;
use std::time::Instant;

use cudarc::cublas::sys as cublas;
use cudarc::driver::result::{self, event};
use cudarc::driver::sys::{CUevent, CUevent_flags, CUstream};
use specplan_format::{load_file, LaunchKind, ValidatedPlan};
use specplan_runtime::cpu::WeightData;
use specplan_runtime::gpu::{GpuOptions, GpuRuntime, Hidden, StepRequest};

const RUNS: usize = 100;
const WARMUP: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Timer {
    start: CUevent,
    end: CUevent,
    stream: CUstream,
}

impl Timer {
    fn new(stream: CUstream) -> Result<Timer, String> {
        let e = || event::create(CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("{e:?}"));
        Ok(Timer {
            start: e()?,
            end: e()?,
            stream,
        })
    }
    /// Median µs of `f` between two events on the stream.
    fn time(&self, f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        self.time_with(None, f)
    }
    /// Median µs of `f` between two events, with L2 flushed before each run (a memset of
    /// `flush` bytes at `buf`, outside the events): a B1 step's K/V fits in L2 and would
    /// otherwise be timed from cache, not from HBM as in a running engine.
    fn time_flushed(&self, flush: (u64, usize), f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        self.time_with(Some(flush), f)
    }
    fn time_with(&self, flush: Option<(u64, usize)>, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
        for _ in 0..WARMUP {
            f()?;
        }
        let mut v = Vec::with_capacity(RUNS);
        for i in 0..RUNS {
            // SAFETY: live events on a live stream; the sync is the measurement itself; the
            // flush buffer is a live allocation of at least `len` bytes.
            unsafe {
                if let Some((buf, len)) = flush {
                    result::memset_d8_async(buf, i as u8, len, self.stream).map_err(|e| format!("{e:?}"))?;
                }
                event::record(self.start, self.stream).map_err(|e| format!("{e:?}"))?;
                f()?;
                event::record(self.end, self.stream).map_err(|e| format!("{e:?}"))?;
                event::synchronize(self.end).map_err(|e| format!("{e:?}"))?;
                v.push(event::elapsed(self.start, self.end).map_err(|e| format!("{e:?}"))? as f64 * 1e3);
            }
        }
        Ok(median(v))
    }
}

/// Device-to-device copy bandwidth (bytes read + written per second) and dense bf16 GEMM
/// rate (FLOP/s), measured on this GPU now.
fn ceilings(stream: CUstream) -> Result<(f64, f64), String> {
    let t = Timer::new(stream)?;
    let bytes = 2usize << 30;
    // SAFETY: plain allocations freed below; the copy stays inside both.
    let (a, b) = unsafe { (result::malloc_sync(bytes), result::malloc_sync(bytes)) };
    let (a, b) = (a.map_err(|e| format!("{e:?}"))?, b.map_err(|e| format!("{e:?}"))?);
    // SAFETY: as above.
    let copy_us = t.time(|| unsafe { result::memcpy_dtod_async(b, a, bytes, stream) }.map_err(|e| format!("{e:?}")))?;
    let bw = 2.0 * bytes as f64 / (copy_us * 1e-6);
    let mut h = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the handle is destroyed below.
    unsafe { cublas::cublasCreate_v2(&mut h) };
    // SAFETY: live handle and stream.
    unsafe { cublas::cublasSetStream_v2(h, stream as _) };
    let n = 8192i32;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let gemm_us = t.time(|| {
        // SAFETY: 8192² bf16 operands fit in the 2 GiB buffers (a: A and B share, b: C).
        let s = unsafe {
            cublas::cublasGemmEx(
                h,
                cublas::cublasOperation_t::CUBLAS_OP_T,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                n,
                n,
                n,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                n,
                (a + (n as u64 * n as u64 * 2)) as *const c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                n,
                &beta as *const f32 as *const c_void,
                b as *mut c_void,
                cublas::cudaDataType::CUDA_R_16BF,
                n,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if s == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(format!("{s:?}"))
        }
    })?;
    let rate = 2.0 * (n as f64).powi(3) / (gemm_us * 1e-6);
    // SAFETY: allocated above, the stream is idle after the timed runs.
    unsafe {
        cublas::cublasDestroy_v2(h);
        let _ = result::free_sync(a);
        let _ = result::free_sync(b);
    }
    Ok((bw, rate))
}

fn pattern_weights(plan: &ValidatedPlan) -> Vec<WeightData> {
    plan.weights
        .iter()
        .map(|w| {
            let n = w.shape.iter().product::<u64>() as usize;
            if w.name == "hot_token_ids" {
                WeightData::I64((0..n as i64).collect())
            } else {
                let scale = 1.0 / (*w.shape.last().unwrap_or(&1) as f32).sqrt();
                WeightData::F32(
                    (0..n)
                        .map(|i| ((i * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
                        .map(|x| x * scale)
                        .collect(),
                )
            }
        })
        .collect()
}

/// Bytes a step must move and FLOPs it must do (B requests at prefix L), from the plan.
fn work(plan: &ValidatedPlan, b: u64, l: u64) -> (f64, f64, f64) {
    let m = &plan.model;
    let n = plan.spec.num_draft_tokens as u64;
    let (hq, hkv, d, layers) = (m.heads as u64, m.kv_heads as u64, m.head_dim as u64, m.layers as u64);
    let act = plan.capture.dtype.size();
    let bucket = plan.buckets.iter().find(|x| x.batch as u64 == b);
    let (mut wbytes, mut flops) = (0f64, 0f64);
    if let Some(bk) = bucket {
        for l in &bk.launches {
            if let LaunchKind::Gemm(g) = &l.kind {
                wbytes += (g.n * g.k * act) as f64;
                flops += 2.0 * (g.m * g.n * g.k) as f64;
            }
        }
    }
    // Embedding rows gathered, not the table.
    wbytes += (b * n * m.hidden as u64 * act) as f64;
    let kv_read = (b * (l + n) * hkv * d * act * 2 * layers) as f64;
    let kv_write = (b * n * hkv * d * act * 2 * layers) as f64;
    flops += (4 * b * n * (l + n) * hq * d * layers) as f64;
    let attn_useful = kv_read + (2 * b * n * hq * d * act * layers) as f64;
    (wbytes + kv_read + kv_write, flops, attn_useful)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 || args[3..].iter().any(|a| a != "--contiguous") {
        eprintln!("usage: specbench PLAN_DIR OUT_DIR [--contiguous]");
        return ExitCode::from(2);
    }
    let contiguous = args[3..].iter().any(|a| a == "--contiguous");
    if !GpuRuntime::available() {
        println!("SKIP: no CUDA driver or device on this machine");
        return ExitCode::SUCCESS;
    }
    match run(&args[1], &args[2], contiguous) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("specbench: FAILED: {e}");
            ExitCode::from(1)
        }
    }
}

/// Writes a file through a temporary one renamed into place, so a run killed mid-write
/// (`.ci/gpu-bench` runs specbench under `timeout`) leaves the previous complete file, never
/// a truncated JSON the report cannot parse.
fn write_atomic(path: &str, text: &str) -> Result<(), String> {
    let tmp = format!("{path}.partial");
    std::fs::write(&tmp, text).map_err(|e| format!("{tmp}: {e}"))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{path}: {e}"))
}

/// Writes the markdown table and the JSON of the rows so far.
fn write_results(
    out: &str,
    rows: &[String],
    json: &[String],
    ops: &[String],
    gemms: &[String],
) -> Result<String, String> {
    let table = format!(
        "| plan | B | L | prep µs | replay µs | step µs | eager µs | floor µs | step/floor | attn µs | attn TB/s |\n|---|---|---|---|---|---|---|---|---|---|---|\n{}\n",
        rows.join("\n")
    );
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    write_atomic(&format!("{out}/specbench.md"), &table)?;
    write_atomic(
        &format!("{out}/specbench.json"),
        &format!("[\n{}\n]\n", json.join(",\n")),
    )?;
    write_atomic(
        &format!("{out}/specbench-ops.json"),
        &format!("[\n{}\n]\n", ops.join(",\n")),
    )?;
    write_atomic(
        &format!("{out}/specbench-gemm.json"),
        &format!("[\n{}\n]\n", gemms.join(",\n")),
    )?;
    Ok(table)
}

fn run(dir: &str, out: &str, contiguous: bool) -> Result<(), String> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "plan"))
        .collect();
    files.sort();
    let mut rows = Vec::new();
    let mut breakdown: Vec<String> = Vec::new();
    let mut gemms: Vec<String> = Vec::new();
    let mut json = Vec::new();
    let mut ceil: Option<(f64, f64)> = None;
    for f in files {
        let name = f
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let plan = load_file(&f).map_err(|e| format!("{name}: {e}"))?;
        let weights = pattern_weights(&plan);
        let t0 = Instant::now();
        let mut rt =
            GpuRuntime::new(plan.clone(), &weights, GpuOptions::default()).map_err(|e| format!("{name}: {e}"))?;
        let load_ms = t0.elapsed().as_secs_f64() * 1e3;
        let stream = rt.stream().cu_stream();
        let (bw, rate) = match ceil {
            Some(c) => c,
            None => {
                let c = ceilings(stream)?;
                println!(
                    "ceilings: copy {:.2} TB/s, bf16 matmul {:.0} TFLOP/s",
                    c.0 / 1e12,
                    c.1 / 1e12
                );
                json.push(format!(
                    "{{\"copy_bytes_per_s\":{:e},\"bf16_flops_per_s\":{:e}}}",
                    c.0, c.1
                ));
                ceil = Some(c);
                c
            }
        };
        let timer = Timer::new(stream)?;
        // L2 flush buffer (256 MiB, several times the H200's L2), freed after this plan.
        let flush_len = 256usize << 20;
        // SAFETY: a plain allocation, freed at the end of this plan's measurements.
        let flush = (
            unsafe { result::malloc_sync(flush_len) }.map_err(|e| format!("{e:?}"))?,
            flush_len,
        );
        let n = plan.spec.num_draft_tokens as usize;
        let h = plan.model.hidden as usize;
        let ps = plan.capture.page_size as usize;
        let max_l = plan.capture.max_context_len as usize - n;
        let builds: f64 = rt.graph_build_ms.iter().sum();
        // GEMM algorithm choice at load: the heuristic's first cuBLASLt candidate against the
        // fastest measured one, per shape of the benchmarked buckets.
        let mut tuned = Vec::new();
        for (m, gn, k, c) in rt.gemm_choices() {
            if [1u64, 8, 32, 64].iter().any(|&b| m == b * n as u64) || m <= 64 {
                tuned.push(format!(
                    "m{m} n{gn} k{k}: {:.1} -> {:.1} µs (#{} of {})",
                    c.first_us, c.best_us, c.rank, c.candidates
                ));
                gemms.push(format!(
                    "{{\"plan\":\"{name}\",\"m\":{m},\"n\":{gn},\"k\":{k},\"first_us\":{:.2},\"best_us\":{:.2},\"rank\":{},\"candidates\":{}}}",
                    c.first_us, c.best_us, c.rank, c.candidates
                ));
            }
        }
        println!("{name}: GEMM tuning {:.0} ms; {}", rt.gemm_tune_ms, tuned.join("; "));
        for &b in &[1usize, 8, 32, 64] {
            if !plan.buckets.iter().any(|x| x.batch as usize == b) {
                continue;
            }
            for &l in &[1024usize, 4096] {
                if l > max_l {
                    continue;
                }
                let per = (l + n).div_ceil(ps);
                if b * per + 1 > rt.pool_pages() as usize {
                    continue;
                }
                let slots: Vec<i32> = (0..b as i32).collect();
                let order: Vec<usize> = if contiguous {
                    (0..b * per).collect()
                } else {
                    specplan_tests::Rng(0x5eed_0000 + (b * per) as u64).permutation(b * per)
                };
                for i in 0..b {
                    let pages: Vec<i32> = order[i * per..(i + 1) * per].iter().map(|&p| p as i32).collect();
                    rt.set_pages(i, &pages).map_err(|e| e.to_string())?;
                }
                let ids: Vec<i64> = (0..b * n).map(|i| (i % 1000) as i64).collect();
                let bytes = b * n * h * 2;
                // SAFETY: freed at the end of this iteration; holds b·N·H activations.
                let dev = unsafe { result::malloc_sync(bytes) }.map_err(|e| format!("{e:?}"))?;
                // SAFETY: as above.
                unsafe { result::memset_d8_async(dev, 0x3c, bytes, stream) }.map_err(|e| format!("{e:?}"))?;
                let prefix = vec![l as i32; b];
                let accept = vec![n as i32; b];
                let req = StepRequest {
                    slots: &slots,
                    input_ids: &ids,
                    hidden: Hidden::Device(dev),
                    prefix_lens: &prefix,
                    accept_lens: &accept,
                };
                let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
                // Full step: host wall clock from prep to completion.
                let mut preps = Vec::new();
                let mut walls = Vec::new();
                for i in 0..WARMUP + RUNS {
                    let w0 = Instant::now();
                    let info = rt.step(&req, false).map_err(g)?;
                    // SAFETY: live event and stream.
                    unsafe {
                        event::record(timer.end, stream).map_err(|e| format!("{e:?}"))?;
                        event::synchronize(timer.end).map_err(|e| format!("{e:?}"))?;
                    }
                    if i >= WARMUP {
                        walls.push(w0.elapsed().as_secs_f64() * 1e6);
                        preps.push(info.prep_us);
                    }
                }
                let replay = timer.time_flushed(flush, || rt.replay_only(b as u32, None).map_err(g))?;
                let eager = timer.time(|| rt.step(&req, true).map(|_| ()).map_err(g))?;
                // Attention alone: its launches captured as a graph of their own, L2 flushed.
                let attn_graph = rt.capture_where(b as u32, "attention").map_err(g)?;
                let attn = timer.time_flushed(flush, || {
                    attn_graph
                        .launch()
                        .map_err(|e| format!("attention graph launch: {e:?}"))
                })?;
                drop(attn_graph);
                // Where the replay goes: each op's launches alone (own graph, L2 flushed),
                // at L 1024 for the smallest and largest bucket.
                if l == 1024 && (b == 1 || b == 64) {
                    let bk = plan.buckets.iter().find(|x| x.batch == b as u32).ok_or("bucket")?;
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
                        breakdown.push(format!(
                            "{{\"plan\":\"{name}\",\"batch\":{b},\"prefix\":{l},\"op\":\"{op}\",\"us\":{us:.2}}}"
                        ));
                    }
                    println!("  ops ({name}, B {b}, L {l}, µs): {}", parts.join(", "));
                }
                // SAFETY: the stream is idle after the timed runs.
                unsafe {
                    let _ = result::stream::synchronize(stream);
                    let _ = result::free_sync(dev);
                }
                let (prep, full) = (median(preps), median(walls));
                let (wbytes, flops, attn_bytes) = work(&plan, b as u64, l as u64);
                let floor = (wbytes / bw).max(flops / rate) * 1e6;
                let attn_tbs = attn_bytes / (attn * 1e-6) / 1e12;
                let row = format!(
                    "| {name} | {b} | {l} | {prep:.1} | {replay:.1} | {full:.1} | {eager:.1} | {floor:.1} | {:.2}× | {attn:.1} | {attn_tbs:.2} |",
                    full / floor
                );
                println!("{row}");
                rows.push(row);
                json.push(format!(
                    "{{\"plan\":\"{name}\",\"batch\":{b},\"prefix\":{l},\"pages\":\"{}\",\"prep_us\":{prep:.2},\"replay_us\":{replay:.1},\"full_us\":{full:.1},\"eager_us\":{eager:.1},\"floor_us\":{floor:.1},\"attn_us\":{attn:.1},\"attn_tb_s\":{attn_tbs:.3},\"graph_build_ms_all\":{builds:.1},\"gemm_tune_ms\":{:.0},\"load_ms\":{load_ms:.0},\"arena_bytes\":{},\"kv_bytes\":{}}}",
                    if contiguous { "contiguous" } else { "scattered" },
                    rt.gemm_tune_ms,
                    rt.arena_bytes(),
                    rt.kv_bytes()
                ));
            }
        }
        println!(
            "{name}: plan+weights load {load_ms:.0} ms, graphs {builds:.1} ms for {} buckets, arena {} B, kv {} B",
            plan.buckets.len(),
            rt.arena_bytes(),
            rt.kv_bytes()
        );
        // SAFETY: the stream is idle (every measurement synchronized); allocated above.
        unsafe {
            let _ = result::free_sync(flush.0);
        }
        write_results(out, &rows, &json, &breakdown, &gemms)?;
    }
    let table = write_results(out, &rows, &json, &breakdown, &gemms)?;
    println!("\n{table}");
    Ok(())
}
