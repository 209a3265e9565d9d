//! Tensor-parallel plans on the GPU (docs/tensor-parallel.md).
//!
//! - [`nccl_check`]: the NCCL path on one GPU — a one-rank communicator, an all-reduce and
//!   an all-gather issued through the runtime's collective code into a captured graph,
//!   replayed, read back (`gpucheck nccl`).
//! - [`tp_check`]: T per-rank plans on T GPUs of one host, each rank's runtime on its own
//!   thread and device with its communicator from `ncclCommInitAll`, against the unsharded
//!   plan on device 0, on one weights file (the full checkpoint, each rank loading its
//!   shards) and the same inputs: every rank's outputs bitwise equal, rank 0's within bf16
//!   tolerance of the unsharded plan's (ids equal outside near ties), each rank's K/V its kv
//!   heads' slice, graph == eager bitwise per rank, and the step time of both beside each
//!   other (`gpucheck tp`, needs `nvidia-h200-x2` or larger).

use std::path::Path;

use specplan_contract::load_weights;
use specplan_format::ValidatedPlan;
use specplan_runtime::bits::from_act_bits;
use specplan_runtime::gpu::{nccl_selftest, Communicator, GemmPolicy, GpuOptions, GpuRuntime, Hidden, HostOutputs};

use crate::checks::{g, replay_us, request};
use crate::contract_files::{weight_tensors, write_safetensors};
use crate::random::{make_case, Case};
use crate::tolerance::rel_rms;
use crate::Rng;

/// Bound on rank 0's hidden rows against the unsharded plan's (relative RMS): the ranks'
/// partials are rounded to bf16 before the all-reduce sums them, one more rounding than
/// the unsharded GEMM's.
pub const TP_HIDDEN_BOUND: f64 = 1e-2;
/// Top-K probabilities within this (absolute); ids equal where neighbours differ by more.
pub const TP_PROB_BOUND: f64 = 5e-3;

/// The one-GPU NCCL check; a one-line report.
pub fn nccl_check() -> Result<String, String> {
    if !Communicator::available() {
        return Err("no libnccl.so found (LD_LIBRARY_PATH)".into());
    }
    let r = nccl_selftest(0, 1 << 16).map_err(g)?;
    if !(r.all_reduce_exact && r.all_gather_exact) {
        return Err(format!(
            "one-rank collectives in a captured graph changed their data: {r:?}"
        ));
    }
    Ok(format!(
        "NCCL {} one rank, {} elements: all-reduce (bf16, in place) and all-gather (f32) captured in a graph and replayed, data exact; {:.1} µs per replay of both",
        r.version, r.elems, r.graph_us
    ))
}

/// A case's K/V with only the kv heads `[first, first + heads)` of `full_heads`.
fn slice_heads(bits: &[u16], full_heads: usize, first: usize, heads: usize, d: usize) -> Vec<u16> {
    bits.chunks(full_heads * d)
        .flat_map(|slot| slot[first * d..(first + heads) * d].iter().copied())
        .collect()
}

/// The first kv head of rank `r` of `size` (split, or replicated when T exceeds the kv heads).
fn first_kv_head(full: usize, local: usize, size: usize, r: usize) -> usize {
    (r / (size / (full / local).max(1)).max(1)) * local
}

struct RankRun {
    graph: Vec<HostOutputs>,
    eager_diffs: usize,
    kv: Vec<(Vec<u16>, Vec<u16>)>,
    us: Vec<f64>,
    /// Per case: the in-graph time of the collective launches (the timeline's spans).
    collective_us: Vec<f64>,
}

/// What every rank's run shares: the weights file, the cases (of the unsharded plan's
/// kv heads), the seed.
struct Shared<'a> {
    weights: &'a Path,
    cases: &'a [Case],
    full_heads: usize,
    seed: u64,
}

/// One rank (or the unsharded plan) on `device`: each case as a graph and eagerly, its K/V
/// the slice of kv heads from `first`, and its replay time.
fn run_rank(
    plan: &ValidatedPlan,
    device: usize,
    comm: Option<std::sync::Arc<Communicator>>,
    first: usize,
    sh: &Shared,
) -> Result<RankRun, String> {
    let (weights_path, cases, full_heads, seed) = (sh.weights, sh.cases, sh.full_heads, sh.seed);
    let weights = load_weights(plan, weights_path).map_err(|e| e.to_string())?;
    let opts = GpuOptions {
        gemms: GemmPolicy::Heuristic,
        device,
        communicator: comm,
        ..GpuOptions::default()
    };
    let mut rt = GpuRuntime::new(plan.clone(), &weights, opts).map_err(g)?;
    let (heads, d) = (plan.model.kv_heads as usize, plan.model.head_dim as usize);
    let mut out = RankRun {
        graph: Vec::new(),
        eager_diffs: 0,
        kv: Vec::new(),
        us: Vec::new(),
        collective_us: Vec::new(),
    };
    let collectives: std::collections::HashSet<String> = plan
        .all_buckets()
        .flat_map(|(_, b)| &b.launches)
        .filter(|l| matches!(l.kind, specplan_format::LaunchKind::Collective(_)))
        .map(|l| l.op.clone())
        .collect();
    let mut rng = Rng(seed);
    for c in cases {
        for (i, &s) in c.slots.iter().enumerate() {
            rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
        }
        let (k0, v0) = (
            slice_heads(&c.k0, full_heads, first, heads, d),
            slice_heads(&c.v0, full_heads, first, heads, d),
        );
        let req = request(c, Hidden::Host(&c.hidden_bits));
        let mut run = |eager: bool| -> Result<(HostOutputs, Vec<u16>, Vec<u16>), String> {
            rt.write_kv(&k0, &v0, c.used_pages).map_err(g)?;
            rt.poison().map_err(g)?;
            rt.step(&req, eager).map_err(g)?;
            let o = rt.read_outputs().map_err(g)?;
            let (k, v) = rt.read_kv(c.used_pages).map_err(g)?;
            Ok((o, k, v))
        };
        let (og, kg, vg) = run(false)?;
        let (oe, ke, ve) = run(true)?;
        out.eager_diffs += (og != oe) as usize + (kg != ke) as usize + (vg != ve) as usize;
        out.graph.push(og);
        out.kv.push((kg, vg));
        let prefix = c.step.prefix_lens.iter().copied().max().unwrap_or(0).max(0) as usize;
        out.us.push(replay_us(&mut rt, plan, &mut rng, c.b, prefix)?.0);
        let bucket = plan.bucket_for(c.b as u32).map_or(1, |x| x.batch);
        let tl = rt.timeline(bucket, 20).map_err(g)?;
        out.collective_us.push(
            tl.ops
                .iter()
                .filter(|o| collectives.contains(&o.op))
                .map(|o| o.us)
                .sum(),
        );
    }
    Ok(out)
}

/// `full`: the unsharded plan; `ranks`: rank 0..T's plans of the same config. Runs on
/// devices 0..T; a one-paragraph report, or the failures.
pub fn tp_check(full: &ValidatedPlan, ranks: &[ValidatedPlan], work: &Path, seed: u64) -> Result<String, String> {
    let t = ranks.len();
    for (r, p) in ranks.iter().enumerate() {
        let tp = p.capture.tp;
        if tp.size as usize != t || tp.rank as usize != r {
            return Err(format!(
                "plan {r} is rank {} of {}, expected rank {r} of {t}",
                tp.rank, tp.size
            ));
        }
    }
    let devices = cudarc::driver::CudaContext::device_count().map_err(|e| format!("{e:?}"))? as usize;
    if devices < t {
        return Err(format!("tp {t} needs {t} GPUs, this machine has {devices}"));
    }
    std::fs::create_dir_all(work).map_err(|e| e.to_string())?;
    let wpath = work.join("weights.safetensors");
    write_safetensors(&wpath, &weight_tensors(full, seed)?)?;
    let mut rng = Rng(seed);
    let max_b = full.buckets().last().map_or(1, |b| b.batch as usize);
    let cases: Vec<Case> = [1, 3.min(max_b), max_b]
        .iter()
        .map(|&b| make_case(full, &mut rng, b, 900.min(full.capture.max_context_len as usize / 2)))
        .collect();
    let full_heads = full.model.kv_heads as usize;
    let sh = Shared {
        weights: &wpath,
        cases: &cases,
        full_heads,
        seed,
    };
    let want = run_rank(full, 0, None, 0, &sh)?;
    let devs: Vec<i32> = (0..t as i32).collect();
    let comms: Vec<std::sync::Arc<Communicator>> = Communicator::init_all(&devs)
        .map_err(g)?
        .into_iter()
        .map(std::sync::Arc::new)
        .collect();
    let got: Vec<Result<RankRun, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, p)| {
                let (comm, sh) = (comms[r].clone(), &sh);
                s.spawn(move || {
                    let first = first_kv_head(full_heads, p.model.kv_heads as usize, t, r);
                    run_rank(p, r, Some(comm), first, sh)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank's thread panicked".into())))
            .collect()
    });
    let got: Vec<RankRun> = got.into_iter().collect::<Result<_, _>>()?;
    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    let act = full.capture.dtype;
    let (h, k) = (full.model.hidden as usize, full.spec.topk as usize);
    for (ci, c) in cases.iter().enumerate() {
        for (r, run) in got.iter().enumerate() {
            if run.graph[ci] != got[0].graph[ci] {
                failures.push(format!("b={}: rank {r}'s outputs differ from rank 0's", c.b));
            }
        }
        let (w, o) = (&want.graph[ci], &got[0].graph[ci]);
        for i in 0..c.b {
            let f = |x: &[u16]| -> Vec<f64> {
                x[i * h..(i + 1) * h]
                    .iter()
                    .map(|&u| from_act_bits(u, act) as f64)
                    .collect()
            };
            let rel = rel_rms(&f(&o.hidden_out), &f(&w.hidden_out));
            worst = worst.max(rel);
            if rel.is_nan() || rel > TP_HIDDEN_BOUND {
                failures.push(format!(
                    "b={} req {i}: hidden relative error {rel:.3e} > {TP_HIDDEN_BOUND}",
                    c.b
                ));
            }
            for j in 0..k.min(w.topk_probs.len() / c.b.max(1)) {
                let at = i * k + j;
                let (pw, po) = (w.topk_probs[at] as f64, o.topk_probs[at] as f64);
                if (pw - po).abs() > TP_PROB_BOUND {
                    failures.push(format!("b={} req {i} top-{j}: probability {po} vs {pw}", c.b));
                }
                let near = |x: usize| x < k && (w.topk_probs[i * k + x] as f64 - pw).abs() <= 1e-3;
                if w.topk_ids[at] != o.topk_ids[at] && !((j > 0 && near(j - 1)) || near(j + 1)) {
                    failures.push(format!(
                        "b={} req {i} top-{j}: id {} vs {} (not a near tie)",
                        c.b, o.topk_ids[at], w.topk_ids[at]
                    ));
                }
            }
        }
        for (r, run) in got.iter().enumerate() {
            let p = &ranks[r];
            let first = first_kv_head(full_heads, p.model.kv_heads as usize, t, r);
            let d = p.model.head_dim as usize;
            let (wk, wv) = &want.kv[ci];
            let sk = slice_heads(wk, full_heads, first, p.model.kv_heads as usize, d);
            let sv = slice_heads(wv, full_heads, first, p.model.kv_heads as usize, d);
            let to = |x: &[u16]| -> Vec<f64> { x.iter().map(|&u| from_act_bits(u, act) as f64).collect() };
            let rel = rel_rms(&to(&run.kv[ci].0), &to(&sk)).max(rel_rms(&to(&run.kv[ci].1), &to(&sv)));
            if rel.is_nan() || rel > TP_HIDDEN_BOUND {
                failures.push(format!(
                    "b={}: rank {r}'s K/V differ from its kv heads' slice by {rel:.3e}",
                    c.b
                ));
            }
        }
    }
    for (r, run) in got.iter().enumerate() {
        if run.eager_diffs > 0 {
            failures.push(format!(
                "rank {r}: graph and eager differ in {} outputs",
                run.eager_diffs
            ));
        }
    }
    if !failures.is_empty() {
        return Err(failures.join("; "));
    }
    let times: Vec<String> = cases
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let tp = got.iter().map(|x| x.us[ci]).fold(0.0, f64::max);
            format!(
                "b={} {:.1} µs (T=1 {:.1} µs, {:.2}×)",
                c.b,
                tp,
                want.us[ci],
                tp / want.us[ci]
            )
        })
        .collect();
    Ok(format!(
        "tp {t}: every rank's outputs equal, rank 0 within {worst:.2e} of the unsharded plan (bound {TP_HIDDEN_BOUND}), K/V slices and graph == eager per rank; replay {}",
        times.join(", ")
    ))
}
