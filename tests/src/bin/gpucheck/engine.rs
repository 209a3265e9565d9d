//! `gpucheck engine`, `engine-memory` and `engine-decode`: the checks on an engine's own memory
//! (`specplan_tests::engine`), the load time onto it, and the device memory a runner adds.

use std::process::ExitCode;

use specplan_format::load_file;
use specplan_tests::engine::ENGINE_MEMORY_BOUND;
use specplan_tests::{json, seed, write_atomic, Rng};

/// Draft decode on engine memory: every tier of each plan in the four engine layouts, against
/// the tier's owned-memory graph (`specplan_tests::engine::engine_decode_check`).
pub(crate) fn engine_decode(plans: &[String]) -> ExitCode {
    use specplan_tests::engine::Layout;
    let mut rng = Rng(seed());
    let mut ok = true;
    for path in plans {
        for layout in Layout::ALL {
            match load_file(std::path::Path::new(path))
                .map_err(|e| e.to_string())
                .and_then(|p| specplan_tests::engine::engine_decode_check(&p, &mut rng, layout))
            {
                Ok(reports) => {
                    for r in &reports {
                        let verdict = if r.failures.is_empty() { "ok" } else { "FAIL" };
                        println!("{path}: {}  {verdict}", r.line);
                        for f in &r.failures {
                            println!("    {f}");
                        }
                        ok &= r.failures.is_empty();
                    }
                }
                Err(e) => {
                    println!("engine-decode {path} {}: ERROR {e}", layout.name());
                    ok = false;
                }
            }
        }
    }
    println!("engine-decode: {}", if ok { "all checks passed" } else { "FAILED" });
    ExitCode::from(if ok { 0 } else { 1 })
}

/// The engine-memory checks and the load time onto caller memory; a load that adds more
/// than `ENGINE_MEMORY_BOUND` fails.
pub(crate) fn engine(out: &str, sglang: &str, vllm: &str, loads: &[String]) -> ExitCode {
    let mut rng = Rng(seed());
    let mut ok = true;
    let mut all = Vec::new();
    use specplan_tests::engine::Layout;
    // SGLang's token pool at page 1; at page 16 SGLang's HND pool and vLLM 0.33's packed
    // tensors (NHD and HND), K/V strided in place.
    let runs = [
        (sglang, Layout::SglangNhd),
        (vllm, Layout::SglangHnd),
        (vllm, Layout::VllmNhd),
        (vllm, Layout::VllmHnd),
    ];
    for (path, layout) in runs {
        match load_file(std::path::Path::new(path))
            .map_err(|e| e.to_string())
            .and_then(|p| specplan_tests::engine::engine_check(&p, &mut rng, layout))
        {
            Ok(reports) => {
                for r in &reports {
                    let verdict = if r.failures.is_empty() { "ok" } else { "FAIL" };
                    let how = if r.weight_views {
                        format!(
                            "weight views: outputs within tolerance ({} off, hidden rel {:.1e})",
                            r.output_diffs, r.hidden_rel
                        )
                    } else {
                        format!(
                            "{}outputs == owned ({} diffs)",
                            if r.eager { "eager (no graphs): " } else { "" },
                            r.output_diffs
                        )
                    };
                    println!(
                        "engine {:<20} b {:>3} x{} steps: {how}, written K/V == owned ({} diffs), refused rows written {}, other pool values changed {}, table changed {}, step returned in {:.1} µs with the stream busy: {}{}  {verdict}",
                        r.layout,
                        r.b,
                        r.steps,
                        r.kv_written_diffs,
                        r.refused_rows_written,
                        r.kv_unwritten_changed,
                        r.table_changed,
                        r.host_us,
                        r.pending_after_step,
                        r.refused.first().map(|x| format!("; {x}")).unwrap_or_default()
                    );
                    for f in &r.failures {
                        println!("    {f}");
                    }
                    ok &= r.failures.is_empty();
                }
                all.extend(reports);
            }
            Err(e) => {
                println!("engine {path}: ERROR {e}");
                ok = false;
            }
        }
    }
    let (loads_ok, load_ms) = engine_loads(loads);
    ok &= loads_ok;
    let report = serde_json::json!({"cases": all, "load": load_ms});
    let path = std::path::Path::new(out).join("engine.json");
    if let Err(e) = std::fs::create_dir_all(out)
        .map_err(|e| e.to_string())
        .and_then(|_| write_atomic(&path, &json(&report)))
    {
        eprintln!("cannot write the report: {e}");
    }
    println!("engine: {}", if ok { "all checks passed" } else { "FAILED" });
    ExitCode::from(if ok { 0 } else { 1 })
}

/// Each plan loaded onto caller memory with every bucket graphed: its load times and the
/// device memory it adds, printed and as JSON objects (`{plan, buckets, first_ms, second_ms,
/// added_memory}`). False when a load fails or adds more than `ENGINE_MEMORY_BOUND`.
fn engine_loads(loads: &[String]) -> (bool, Vec<serde_json::Value>) {
    let mut ok = true;
    let mut out = Vec::new();
    for load in loads {
        let one = load_file(std::path::Path::new(load))
            .map_err(|e| e.to_string())
            .and_then(|p| {
                let r = specplan_tests::engine::engine_load_ms(&p);
                if let Ok((first, second, t, m)) = &r {
                    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
                    println!(
                        "engine load of {} ({} buckets) onto caller memory: first {first:.1} ms, then {second:.1} ms (setup {:.1}, GEMM choice {:.1} ms: {} cached / {} timed, graphs {:.1} ms); device memory added {:.1} MiB (arena {:.1}, GEMM workspace {:.1}, the rest {:.1}: graphs, modules, libraries)",
                        p.name,
                        p.buckets().len(),
                        t.setup_ms,
                        t.gemm.ms,
                        t.gemm.cached,
                        t.gemm.timed,
                        t.graphs_ms,
                        mib(m.measured_bytes),
                        mib(m.arena_bytes),
                        mib(m.workspace_bytes),
                        mib(m.measured_bytes.saturating_sub(m.arena_bytes + m.workspace_bytes)),
                    );
                }
                r.map(|r| (p.name.clone(), p.buckets().len(), r))
            });
        out.push(match one {
            Ok((name, buckets, (first, second, _, m))) => {
                if m.measured_bytes > ENGINE_MEMORY_BOUND {
                    println!(
                        "engine load of {load}: FAILED: it adds {} bytes of device memory, over the bound of {ENGINE_MEMORY_BOUND} (64 MiB)",
                        m.measured_bytes
                    );
                    ok = false;
                }
                specplan_tests::engine::load_record(load, &name, buckets, first, second, &m)
            }
            Err(e) => {
                println!("engine load of {load}: ERROR {e}");
                ok = false;
                serde_json::Value::Null
            }
        });
    }
    (ok, out)
}

/// `gpucheck engine-memory OUT_DIR PLAN...`: the engine-memory figure alone (what `.ci/gpu
/// bench` reports and judges): each plan loaded onto caller memory, every bucket graphed;
/// OUT_DIR/engine-memory.json holds the bound and each load. Exit 1 when a load fails or
/// adds more than the bound.
pub(crate) fn engine_memory(out: &str, plans: &[String]) -> ExitCode {
    let (ok, loads) = engine_loads(plans);
    let report = specplan_tests::engine::memory_file(loads);
    let path = std::path::Path::new(out).join("engine-memory.json");
    let written = std::fs::create_dir_all(out)
        .map_err(|e| e.to_string())
        .and_then(|_| write_atomic(&path, &json(&report)));
    if let Err(e) = &written {
        eprintln!("cannot write {}: {e}", path.display());
    }
    println!(
        "engine-memory: {}",
        if ok { "every load within the bound" } else { "FAILED" }
    );
    ExitCode::from(if ok && written.is_ok() { 0 } else { 1 })
}
