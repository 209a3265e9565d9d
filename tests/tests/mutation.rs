//! Mutation test of the trust boundary (ARCHITECTURE.md, "Trust"): real plans (every preset
//! and the variants `.ci/gpu build` checks, kernels included where NVRTC is available) get
//! thousands of structured mutations with a valid checksum, and each mutant is either
//! rejected by `validate` or runs on the CPU executor without a panic, with bounded memory,
//! every launch writing only inside the buffers and pools it names for writing
//! (`specplan_runtime::cpu::audit_bucket`).
//!
//! Seeded and deterministic: `SPECPLAN_MUTATIONS` (default 10,000) and `SPECPLAN_SEED`
//! (default fixed) make longer or other runs; a failure names the subject, the mutant's
//! index and what was mutated. Plans whose weights are too large for a CPU run each time
//! (the Llama-sized presets) are validated only.

mod common;
#[path = "mutation/leaves.rs"]
mod leaves;
#[path = "mutation/ops.rs"]
mod ops;

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use specplan_compiler::config::{resolve, Overrides, Source, PRESETS};
use specplan_compiler::jit::Jit;
use specplan_compiler::{compile, Target};
use specplan_format::{decode, encode, validate, Plan, PlanError, ValidatedPlan};
use specplan_runtime::cpu::{audit_bucket, synthetic_weights, Audit, AuditError, AuditLimits, WeightData};
use specplan_tests::Rng;

const DEFAULT_SEED: u64 = 0x5eed_0014;
const DEFAULT_COUNT: usize = 10_000;

struct Subject {
    label: String,
    plan: Plan,
    /// Weights for CPU runs; `None`: validated only.
    weights: Option<Vec<WeightData>>,
}

fn jit() -> Option<Jit> {
    match Jit::from_env() {
        Ok(j) => Some(j),
        Err(e) => {
            if std::env::var_os("SPECPLAN_CUDA_INCLUDE").is_some() {
                panic!("SPECPLAN_CUDA_INCLUDE is set but NVRTC is unusable: {e}");
            }
            println!("NOTE: NVRTC not available ({e}); mutating plans without kernel binaries");
            None
        }
    }
}

fn subjects(jit: Option<&Jit>) -> Vec<Subject> {
    let o = |f: &dyn Fn(&mut Overrides)| {
        let mut x = Overrides::default();
        f(&mut x);
        x
    };
    let tiny = |label: &str, f: &dyn Fn(&mut Overrides)| (label.to_string(), Source::Preset("tiny".into()), o(f));
    let wide = std::fs::read_to_string(common::corpus("valid/wide-heads-d256.json")).expect("wide-heads-d256.json");
    let eagle3 = std::fs::read_to_string(common::corpus("valid/tiny-eagle3.json")).expect("tiny-eagle3.json");
    let mut list = vec![
        tiny("tiny", &|_| {}),
        tiny("tiny-swa16-hot256", &|x| {
            x.sliding_window = Some(16);
            x.hot_vocab_size = Some(256);
        }),
        tiny("tiny-fp16-page1", &|x| {
            x.dtype = Some("fp16".into());
            x.page_size = Some(1);
        }),
        tiny("tiny-n24", &|x| x.num_draft_tokens = Some(24)),
        // A tensor-parallel rank: shards, all-reduces, the cross-rank top-K.
        tiny("tiny-tp2-rank1", &|x| {
            x.tp_size = Some(2);
            x.tp_rank = Some(1);
        }),
        tiny("tiny-n36", &|x| x.num_draft_tokens = Some(36)),
        tiny("engine-sglang (page 1)", &|x| {
            x.page_size = Some(1);
            x.max_requests = Some(16);
        }),
        tiny("engine-vllm (page 16)", &|x| {
            x.page_size = Some(16);
            x.max_requests = Some(16);
        }),
        (
            "wide-heads-d256".into(),
            Source::HfConfig {
                name: "wide-heads-d256".into(),
                text: wide,
            },
            o(&|x| {
                x.topk = Some(4);
                x.num_steps = Some(3);
                x.num_draft_tokens = Some(8);
                x.buckets = Some("1,3,8".into());
                x.max_context_len = Some(4096);
            }),
        ),
        (
            "tiny-eagle3".into(),
            Source::HfConfig {
                name: "tiny-eagle3".into(),
                text: eagle3,
            },
            o(&|x| {
                x.topk = Some(4);
                x.num_steps = Some(3);
                x.num_draft_tokens = Some(4);
                x.buckets = Some("1,2,4,8".into());
                x.max_context_len = Some(512);
            }),
        ),
        (
            "llama2-7b-eagle-80-requests".into(),
            Source::Preset("llama2-7b-eagle".into()),
            o(&|x| {
                x.buckets = Some("1,2".into());
                x.max_requests = Some(80);
            }),
        ),
        (
            "llama3-8b-eagle-swa300-hot32k".into(),
            Source::Preset("llama3-8b-eagle".into()),
            o(&|x| {
                x.sliding_window = Some(300);
                x.hot_vocab_size = Some(32768);
                x.buckets = Some("1,3,8".into());
            }),
        ),
    ];
    // Every other preset, with a short bucket list (validation time grows with it).
    for p in PRESETS.iter().filter(|p| p.name != "tiny") {
        list.push((
            p.name.to_string(),
            Source::Preset(p.name.into()),
            o(&|x| x.buckets = Some("1,3".into())),
        ));
    }
    list.into_iter()
        .map(|(label, source, over)| {
            let cfg = resolve(&source, &over).unwrap_or_else(|e| panic!("{label}: {e}"));
            let plan = compile(&cfg, &Target::default(), jit, &|_, _| {})
                .unwrap_or_else(|e| panic!("{label}: {e}"))
                .plan;
            // CPU runs where the weights are small enough to run thousands of times.
            let small = AuditLimits {
                max_weight_elems: 1 << 23,
                ..AuditLimits::default()
            };
            let weights = synthetic_weights(&plan, &small).ok();
            Subject {
                label,
                plan: plan.into_inner(),
                weights,
            }
        })
        .collect()
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// splitmix64: one independent stream per mutant, so a failure is reproducible alone.
fn stream(seed: u64, i: u64) -> Rng {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    Rng((z ^ (z >> 31)) | 1)
}

thread_local! {
    /// Where this thread last panicked (set by the quiet hook the test installs).
    static PANIC_AT: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

fn panic_text(e: &(dyn std::any::Any + Send)) -> String {
    let msg = e
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".into());
    let at = PANIC_AT.with(|p| p.borrow().clone());
    format!("{msg} (at {at})")
}

#[derive(Default)]
struct Tally {
    rejected: usize,
    ran_ok: usize,
    ran_err: usize,
    /// Accepted mutants whose executor input equals one already run.
    same_as_run: usize,
    validated_only: usize,
    too_large: usize,
    /// Mutations that left the plan as it was (a value set to itself).
    unchanged: usize,
    too_large_example: String,
    validate_time: Duration,
    run_time: Duration,
    roundtrips: usize,
    failures: Vec<String>,
    /// Accepted mutations, for the summary (what validate lets through).
    accepted: Vec<String>,
    slowest_run: Duration,
}

/// What the executor reads of an accepted mutant for one bucket (names, binaries and
/// bookkeeping cleared): equal keys run identically.
fn run_key(p: &ValidatedPlan, bucket: usize) -> u64 {
    let mut q = p.plan().clone();
    q.name.clear();
    q.compiler.clear();
    q.fusions.clear();
    q.target.nvrtc = None;
    q.weights.iter_mut().for_each(|w| {
        w.name.clear();
        w.sources.clear();
    });
    q.kernels.iter_mut().for_each(|k| {
        k.binary = None;
        k.name.clear();
        k.source_hash.clear();
    });
    q.phases[0].buckets = vec![q.phases[0].buckets.swap_remove(bucket)];
    q.phases[0].buckets[0].launches.iter_mut().for_each(|l| l.op.clear());
    let bytes = encode(&q).expect("encode");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (bucket, bytes).hash(&mut h);
    h.finish()
}

fn one(s: &Subject, i: usize, seed: u64, seen: &Mutex<HashSet<u64>>, t: &mut Tally) {
    let mut rng = stream(seed, i as u64);
    let mut m = s.plan.clone();
    let desc = ops::mutate(&mut m, &mut rng);
    let fail = |what: String| format!("{} mutant #{i} [{desc}]: {what}", s.label);
    // Every 50th mutant goes through the file format too: the same verdict with a valid
    // checksum.
    let bytes = i.is_multiple_of(50).then(|| encode(&m).expect("encode"));
    let start = Instant::now();
    let verdict = catch_unwind(AssertUnwindSafe(|| validate(m)));
    t.validate_time += start.elapsed();
    let verdict = match verdict {
        Ok(v) => v,
        Err(e) => {
            t.failures.push(fail(format!("validate panicked: {}", panic_text(&*e))));
            return;
        }
    };
    if let Some(bytes) = bytes {
        t.roundtrips += 1;
        match catch_unwind(|| decode(&bytes)) {
            Ok(d) if d.is_ok() == verdict.is_ok() && !matches!(d, Err(PlanError::Checksum)) => {}
            Ok(d) => t
                .failures
                .push(fail(format!("decode disagrees with validate: {:?}", d.err()))),
            Err(e) => t.failures.push(fail(format!("decode panicked: {}", panic_text(&*e)))),
        }
    }
    let Ok(v) = verdict else {
        t.rejected += 1;
        return;
    };
    if v.plan() == &s.plan {
        t.unchanged += 1;
        return;
    }
    t.accepted.push(format!("{}: {desc}", s.label));
    let Some(weights) = &s.weights else {
        t.validated_only += 1;
        return;
    };
    let bucket = if rng.below(2) == 0 {
        0
    } else {
        rng.below(v.phases[0].buckets.len())
    };
    if !seen.lock().expect("seen").insert(run_key(&v, bucket)) {
        t.same_as_run += 1;
        return;
    }
    let fresh;
    let weights = if v.weights == s.plan.weights {
        weights
    } else {
        match synthetic_weights(&v, &AuditLimits::default()) {
            Ok(w) => {
                fresh = w;
                &fresh
            }
            Err(e) => {
                t.failures
                    .push(fail(format!("validated plan too large for its weights: {e}")));
                return;
            }
        }
    };
    let start = Instant::now();
    let run = catch_unwind(AssertUnwindSafe(|| {
        audit_bucket(&v, weights, bucket, &AuditLimits::default())
    }));
    t.slowest_run = t.slowest_run.max(start.elapsed());
    t.run_time += start.elapsed();
    match run {
        Ok(Ok(Audit::Ran)) => t.ran_ok += 1,
        Ok(Ok(Audit::Refused(_))) => t.ran_err += 1,
        Ok(Err(AuditError::TooLarge(e))) => {
            t.too_large += 1;
            t.too_large_example = format!("{} mutant #{i} [{desc}]: {e}", s.label);
        }
        Ok(Err(e)) => t.failures.push(fail(format!("bucket {bucket}: {e}"))),
        Err(e) => t.failures.push(fail(format!(
            "the CPU executor panicked on bucket {bucket}: {}",
            panic_text(&*e)
        ))),
    }
}

#[test]
fn mutated_plans_are_rejected_or_run_safely() {
    let count: usize = env_or("SPECPLAN_MUTATIONS", DEFAULT_COUNT);
    let seed: u64 = env_or("SPECPLAN_SEED", DEFAULT_SEED);
    let t0 = Instant::now();
    let jit = jit();
    let subjects = subjects(jit.as_ref());
    let compiled = t0.elapsed();
    // The unmutated plans validate and run cleanly on every bucket.
    for s in &subjects {
        let v = validate(s.plan.clone()).unwrap_or_else(|e| panic!("{}: {e}", s.label));
        if let Some(w) = &s.weights {
            for b in 0..v.phases[0].buckets.len() {
                match audit_bucket(&v, w, b, &AuditLimits::default()) {
                    Ok(Audit::Ran) => {}
                    other => panic!("{} bucket {b}: the unmutated plan gives {other:?}", s.label),
                }
            }
        }
    }
    let t1 = Instant::now();
    // Panics are caught and reported per mutant: keep their location, skip the default
    // hook's message and backtrace.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let at = info.location().map_or(String::new(), |l| l.to_string());
        PANIC_AT.with(|p| *p.borrow_mut() = at);
    }));
    let seen = Mutex::new(HashSet::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 8);
    let tallies: Vec<Tally> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (subjects, seen) = (&subjects, &seen);
                sc.spawn(move || {
                    let mut t = Tally::default();
                    for i in (w..count).step_by(workers) {
                        let s = &subjects[i % subjects.len()];
                        // A panic outside the guarded calls is a bug of this test (a mutation
                        // op, the harness): reported like the others, not lost in a worker.
                        if let Err(e) = catch_unwind(AssertUnwindSafe(|| one(s, i, seed, seen, &mut t))) {
                            t.failures.push(format!(
                                "{} mutant #{i}: the test panicked: {}",
                                s.label,
                                panic_text(&*e)
                            ));
                        }
                    }
                    t
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker")).collect()
    });
    std::panic::set_hook(hook);
    let mut t = Tally::default();
    for x in tallies {
        t.rejected += x.rejected;
        t.ran_ok += x.ran_ok;
        t.ran_err += x.ran_err;
        t.same_as_run += x.same_as_run;
        t.validated_only += x.validated_only;
        t.too_large += x.too_large;
        t.unchanged += x.unchanged;
        if t.too_large_example.is_empty() {
            t.too_large_example = x.too_large_example;
        }
        t.roundtrips += x.roundtrips;
        t.failures.extend(x.failures);
        t.accepted.extend(x.accepted);
        t.slowest_run = t.slowest_run.max(x.slowest_run);
        t.validate_time += x.validate_time;
        t.run_time += x.run_time;
    }
    t.accepted.sort();
    println!(
        "mutation test: seed {seed:#x}, {count} mutations over {} plans (kernels: {}); compile {compiled:.1?}, unmutated runs {:.1?}, mutants {:.1?}",
        subjects.len(),
        if jit.is_some() { "yes" } else { "no, NVRTC absent" },
        t1 - t0 - compiled,
        t1.elapsed()
    );
    println!(
        "  rejected by validate {}, unchanged by the mutation {}, accepted {} = ran OK {} + ran with a returned error {} + same executor input as a run one {} + validated only (no CPU run: large weights) {} + too large to audit {}",
        t.rejected,
        t.unchanged,
        t.accepted.len(),
        t.ran_ok,
        t.ran_err,
        t.same_as_run,
        t.validated_only,
        t.too_large
    );
    println!(
        "  {} mutants also decoded from bytes; time in validate {:.1?}, in CPU runs {:.1?} (slowest {:.1?}), over {workers} threads",
        t.roundtrips, t.validate_time, t.run_time, t.slowest_run
    );
    if !t.too_large_example.is_empty() {
        println!("  too large to audit, e.g. {}", t.too_large_example);
    }
    if std::env::var_os("SPECPLAN_MUTATIONS_VERBOSE").is_some() {
        for a in &t.accepted {
            println!("  accepted: {a}");
        }
    }
    assert_eq!(
        t.rejected + t.unchanged + t.accepted.len() + t.failures.len(),
        count,
        "every mutant counted"
    );
    assert!(
        t.failures.is_empty(),
        "{} failures:\n{}",
        t.failures.len(),
        t.failures.join("\n")
    );
}

/// The CPU executor refuses a prefix outside `[0, max_context_len - N]` up front: the
/// attention's work grows with the prefix, so an unchecked one could loop for as long as an
/// i32 allows (the admission rule the kernels rely on).
#[test]
fn the_cpu_executor_refuses_prefixes_outside_the_context() {
    use specplan_runtime::cpu::{CpuExecutor, ExecError, KvPool};
    use specplan_runtime::step::{BucketInputs, PageTable};
    let plan = common::compile_preset("tiny", &Overrides::default());
    let weights = synthetic_weights(&plan, &AuditLimits::default()).expect("weights");
    let exec = CpuExecutor::borrowing(&plan, &weights).expect("executor");
    let b = &plan.phases[0].buckets[0];
    let (n, h) = (plan.spec.num_draft_tokens as usize, plan.model.hidden as usize);
    let m = &plan.model;
    let per_layer = 2 * plan.capture.page_size as usize * m.kv_heads as usize * m.head_dim as usize;
    let table = PageTable::new(&plan, 1);
    let max = (plan.capture.max_context_len - plan.spec.num_draft_tokens) as i32;
    for (prefix, ok) in [(0, true), (max, true), (max + 1, false), (-1, false), (i32::MAX, false)] {
        let inputs = BucketInputs {
            input_ids: vec![0; n],
            hidden_states: vec![0.0; n * h],
            prefix_lens: vec![prefix],
            accept_lens: vec![1],
            req_slots: vec![-1],
        };
        let mut kv = KvPool {
            pages: 2,
            k: vec![vec![0.0; per_layer]; m.layers as usize],
            v: vec![vec![0.0; per_layer]; m.layers as usize],
        };
        match exec.run(b, &inputs, &table, &mut kv) {
            Ok(_) => assert!(ok, "prefix {prefix} ran"),
            Err(ExecError::Setup(e)) if !ok => assert!(e.contains("prefix_lens[0]"), "{e}"),
            Err(e) => panic!("prefix {prefix}: {e}"),
        }
    }
}
