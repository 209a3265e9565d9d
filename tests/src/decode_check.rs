//! The GPU check of a draft-decode phase (owned memory): fresh random draft-extend outputs,
//! prefixes and pages, the bucket run as its graph and eagerly (bit-identical), and against
//! the CPU executor on the same bf16 values. The tree is a chain of discrete choices, and
//! the GPU's bf16 activations and the executor's f32 ones may order a near tie differently,
//! after which the two trees (and the lanes' later K/V) legitimately part: so trees are
//! compared per request and counted (with how many differing ones sit at a near tie of the
//! GPU's own score list; a tie inside one lane's top-K is not visible there), the caller
//! holds a phase's agreement to `TREE_AGREEMENT` over all its requests, the lanes' written
//! K/V of every equal request lie within the relative bound, and every other cache element
//! is untouched.

use serde::Serialize;
use specplan_format::{io, PhaseKind, ValidatedPlan};
use specplan_kernels::facts::{decode_reach, lane_offset, parent_width, tree_candidates};
use specplan_runtime::bits::{from_act_bits, round_act, to_act_bits};
use specplan_runtime::cpu::{CpuExecutor, KvPool, WeightData};
use specplan_runtime::gpu::GpuRuntime;
use specplan_runtime::step::PageTable;

use crate::checks::{g, REL_BOUND};
use crate::random::{deal_pages, random_topk};
use crate::tolerance::{bit_diffs, rel_rms};
use crate::Rng;

/// A selection cut whose two sides differ by less than this (relative) is a near tie: bf16
/// activations on the GPU and f32 ones on the CPU may order it differently.
pub const TREE_TIE_REL: f64 = 2e-2;

/// Least share of a phase's checked requests whose trees equal the CPU executor's: a wrong
/// slot, key set or selection makes nearly every tree differ, near ties only a few.
pub const TREE_AGREEMENT: f64 = 0.75;

const SCORE_LIST: &str = "score_list";
/// The verify inputs a plan with `decode_verify` emits.
const VERIFY: [&str; 6] = [
    io::VERIFY_TOKENS,
    io::VERIFY_POSITIONS,
    io::RETRIEVE_INDEX,
    io::RETRIEVE_NEXT_TOKEN,
    io::RETRIEVE_NEXT_SIBLING,
    io::TREE_MASK,
];
const TOKEN_LIST: &str = "token_list";

#[derive(Clone, Debug, Default, Serialize)]
pub struct DecodeReport {
    pub phase: String,
    pub b: usize,
    pub bucket: u32,
    /// Requests whose parent_list, top_scores_index and draft_tokens equal the CPU's.
    pub equal: usize,
    /// Requests whose tree differs from the CPU's.
    pub differ: usize,
    /// Of those, the ones with a near tie (`TREE_TIE_REL`) at a cut of the GPU's score list
    /// (a tie inside one lane's top-K is not visible there).
    pub near_ties: usize,
    /// (lane, forward) inputs of equal trees that parted from the CPU's at a near tie the
    /// tree does not show (their K/V is not compared).
    pub lane_ties: usize,
    pub kv_rel: f64,
    pub kv_untouched_changed: usize,
    pub graph_vs_eager_diff: usize,
    /// Wall time per graph replay over back-to-back replays, µs (GPU-bound, no events).
    pub replay_us: f64,
    pub ok: bool,
    pub failures: Vec<String>,
}

/// One step's inputs: pages, the caller's cache bits, the staged inputs (padded to the
/// bucket) as raw bytes and as the CPU executor's values.
struct DecodeCase {
    bucket: u32,
    prefix: Vec<usize>,
    slots: Vec<i32>,
    pages: Vec<Vec<i32>>,
    used_pages: usize,
    k0: Vec<u16>,
    v0: Vec<u16>,
    /// (name, bytes, CPU values) per staged input.
    inputs: Vec<(&'static str, Vec<u8>, Vec<f64>)>,
}

fn make_case(plan: &ValidatedPlan, kind: PhaseKind, rng: &mut Rng, b: usize) -> Result<DecodeCase, String> {
    let (k, steps) = (plan.spec.topk, kind.steps());
    let ps = plan.capture.page_size;
    let ctx = plan.capture.max_context_len as usize;
    let act = plan.capture.dtype;
    let h = plan.model.hidden as usize;
    let bucket = plan
        .phase(kind)
        .and_then(|ph| ph.bucket_for(b as u32))
        .ok_or("no bucket")?
        .batch as usize;
    // Every request's pages fit the owned pool (its last page is the scratch page).
    let budget = (plan.capture.kv_pool_pages as usize - 1) / b * ps as usize;
    let reach_max = decode_reach(ps as u64 - 1, steps, k, ps) as usize + ps as usize;
    let max_l = ctx.min(1200).min(budget.saturating_sub(reach_max)).max(1);
    let prefix: Vec<usize> = (0..b)
        .map(|_| loop {
            let l = rng.below(max_l);
            if l + decode_reach(l as u64, steps, k, ps) as usize <= ctx {
                break l;
            }
        })
        .collect();
    let need: Vec<usize> = prefix
        .iter()
        .map(|&l| (l + decode_reach(l as u64, steps, k, ps) as usize).div_ceil(ps as usize))
        .collect();
    let (pages, used_pages) = deal_pages(rng, &need);
    let slots: Vec<i32> = rng.permutation(plan.capture.max_requests as usize)[..b]
        .iter()
        .map(|&s| s as i32)
        .collect();
    let per = used_pages * plan.kv_page_bytes() as usize / 2 * plan.model.layers as usize;
    let bits = |rng: &mut Rng| to_act_bits(&(0..per).map(|_| rng.uniform()).collect::<Vec<_>>(), act);
    let (k0, v0) = (bits(rng), bits(rng));
    // The padded rows repeat request 0's inputs in the scratch slot with prefix 0.
    let ku = k as usize;
    let (probs, ids) = random_topk(rng, b, ku, plan.model.vocab as usize);
    let hidden: Vec<f32> = (0..b * h).map(|_| round_act(rng.uniform(), act)).collect();
    let pad = |i: usize, w: usize| if i < b * w { i } else { i % w };
    let probs: Vec<f32> = (0..bucket * ku).map(|i| probs[pad(i, ku)]).collect();
    let ids: Vec<i64> = (0..bucket * ku).map(|i| ids[pad(i, ku)]).collect();
    let hidden: Vec<f32> = (0..bucket * h).map(|i| hidden[pad(i, h)]).collect();
    let scratch_slot = plan.capture.max_requests as i32;
    let lens: Vec<i32> = (0..bucket).map(|i| if i < b { prefix[i] as i32 } else { 0 }).collect();
    let rows: Vec<i32> = (0..bucket)
        .map(|i| if i < b { slots[i] } else { scratch_slot })
        .collect();
    let hidden_bits = to_act_bits(&hidden, act);
    let mut inputs = vec![
        (
            io::TOPK_PROBS,
            probs.iter().flat_map(|x| x.to_le_bytes()).collect(),
            probs.iter().map(|&x| x as f64).collect(),
        ),
        (
            io::TOPK_IDS,
            ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ids.iter().map(|&x| x as f64).collect(),
        ),
        (
            io::HIDDEN_STATES,
            hidden_bits.iter().flat_map(|x| x.to_le_bytes()).collect(),
            hidden.iter().map(|&x| x as f64).collect(),
        ),
        (
            io::PREFIX_LENS,
            lens.iter().flat_map(|x| x.to_le_bytes()).collect(),
            lens.iter().map(|&x| x as f64).collect(),
        ),
        (
            io::REQ_SLOTS,
            rows.iter().flat_map(|x| x.to_le_bytes()).collect(),
            rows.iter().map(|&x| x as f64).collect(),
        ),
    ];
    if plan.capture.decode_verify {
        // The trees' roots (any target ids; padded rows repeat request 0's).
        let roots: Vec<i64> = (0..b).map(|_| rng.below(plan.model.vocab as usize) as i64).collect();
        let roots: Vec<i64> = (0..bucket).map(|i| roots[if i < b { i } else { 0 }]).collect();
        inputs.push((
            io::BONUS_TOKENS,
            roots.iter().flat_map(|x| x.to_le_bytes()).collect(),
            roots.iter().map(|&x| x as f64).collect(),
        ));
    }
    Ok(DecodeCase {
        bucket: bucket as u32,
        prefix,
        slots,
        pages,
        used_pages,
        k0,
        v0,
        inputs,
    })
}

fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4])))
        .collect()
}

/// The smallest relative gap at any cut the tree makes for one request, in its score list:
/// the K-th and (K+1)-th of each step's K² candidates, the (N−1)-th and N-th overall.
fn min_cut_gap(scores: &[f32], k: usize, steps: usize, nodes: usize) -> f64 {
    let gap_at = |v: &[f32], n: usize| -> f64 {
        if n >= v.len() {
            return f64::INFINITY;
        }
        let mut s: Vec<f64> = v.iter().map(|&x| x as f64).collect();
        s.sort_by(|a, b| b.total_cmp(a));
        (s[n - 1] - s[n]).abs() / s[n - 1].abs().max(1e-30)
    };
    let mut m = gap_at(scores, nodes);
    for i in 1..steps {
        let block = &scores[k + (i - 1) * k * k..k + i * k * k];
        m = m.min(gap_at(block, k));
    }
    m
}

/// Whether the earliest forward whose candidate tokens differ between the GPU's token list
/// and the CPU's (blocks of the list: the K roots, then K² per forward) has, at every
/// differing candidate, scores within `TREE_TIE_REL` of each other: both sides chose nearly
/// equally likely tokens there, and everything after descends from that choice.
fn first_token_tie(gpu: &[i64], cpu: &[i64], sg: &[f32], sc: &[f64], k: usize) -> bool {
    let n = gpu.len().min(cpu.len()).min(sg.len()).min(sc.len());
    let mut start = 0;
    let mut size = k;
    while start < n {
        let end = (start + size).min(n);
        let differ: Vec<usize> = (start..end).filter(|&c| gpu[c] != cpu[c]).collect();
        if !differ.is_empty() {
            return differ.iter().all(|&c| {
                let (a, b) = (sg[c] as f64, sc[c]);
                (a - b).abs() <= TREE_TIE_REL * b.abs().max(a.abs()).max(1e-30)
            });
        }
        start = end;
        size = k * k;
    }
    false
}

/// Per forward `i` (0..S−1) and lane: whether the lane's input parted from the CPU's (its
/// token differs, or it descends from a lane that parted), and the candidate it came from
/// (none at forward 0, whose inputs are the caller's). `parents` is one request's
/// parent_list (equal on both sides), `gpu`/`cpu` its token lists.
fn parted_lanes(parents: &[i64], gpu: &[i64], cpu: &[i64], k: usize, steps: usize) -> Vec<Vec<(bool, Option<usize>)>> {
    let mut out = vec![vec![(false, None); k]];
    for i in 1..steps - 1 {
        // parent_list: −1, the K roots, then per selection i the chosen candidates' indices
        // in the score list (block i starts at K + K²(i−1)).
        let start = k + k * k * (i - 1);
        let lanes = (0..k)
            .map(|j| {
                let Some(c) = parents
                    .get(1 + k + (i - 1) * k + j)
                    .and_then(|&c| usize::try_from(c).ok())
                else {
                    return (true, None);
                };
                let from = c.checked_sub(start).map(|x| x / k).filter(|&p| p < k);
                let inherited = from.is_none_or(|p| out[i - 1][p].0);
                (gpu.get(c) != cpu.get(c) || inherited, Some(c))
            })
            .collect();
        out.push(lanes);
    }
    out
}

/// The requests of a run (`b`) and the lengths of each one's tree outputs: the parent list,
/// the N − 1 nodes, the candidates of the score and token lists.
#[derive(Clone, Copy)]
struct Sizes {
    b: usize,
    pw: usize,
    nodes: usize,
    cands: usize,
}

/// One GPU run of a case, the real requests' rows only.
struct GpuRun {
    /// parent_list, top_scores_index, draft_tokens.
    outs: (Vec<i64>, Vec<i64>, Vec<i64>),
    scores: Vec<f32>,
    tokens: Vec<i64>,
    /// The verify inputs (as i64 values; the mask is i32), when the plan emits them.
    verify: Vec<Vec<i64>>,
    k: Vec<u16>,
    v: Vec<u16>,
}

impl GpuRun {
    /// Values that differ from `other`'s, bit for bit, over every output and the cache.
    fn bit_diffs(&self, other: &GpuRun) -> usize {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        bit_diffs(&self.outs.0, &other.outs.0)
            + bit_diffs(&self.outs.1, &other.outs.1)
            + bit_diffs(&self.outs.2, &other.outs.2)
            + bit_diffs(&bits(&self.scores), &bits(&other.scores))
            + bit_diffs(&self.tokens, &other.tokens)
            + self
                .verify
                .iter()
                .zip(&other.verify)
                .map(|(a, e)| bit_diffs(a, e))
                .sum::<usize>()
            + bit_diffs(&self.k, &other.k)
            + bit_diffs(&self.v, &other.v)
    }
}

/// Runs the case's bucket once (as its graph, or eagerly) from the case's cache and inputs,
/// outputs poisoned first, and reads back what `check_decode` compares.
fn gpu_run(rt: &mut GpuRuntime, c: &DecodeCase, kind: PhaseKind, n: Sizes, eager: bool) -> Result<GpuRun, String> {
    let Sizes { b, pw, nodes, cands } = n;
    rt.write_kv(&c.k0, &c.v0, c.used_pages).map_err(g)?;
    rt.poison().map_err(g)?;
    for (name, bytes, _) in &c.inputs {
        rt.write_phase_buffer(kind, c.bucket, name, bytes).map_err(g)?;
    }
    rt.run_phase(kind, c.bucket, eager).map_err(g)?;
    let read = |name: &str| rt.read_phase_buffer(kind, c.bucket, name).map_err(g);
    // The real requests' rows only: padded rows share the scratch slot, so their lanes
    // race on the scratch page's slots (their outputs are discarded, as in draft-extend).
    // The score list stays live to the last launch, so it still holds the tree.
    let outs = (
        i64s(&read(io::PARENT_LIST)?)[..b * pw].to_vec(),
        i64s(&read(io::TOP_SCORES_INDEX)?)[..b * nodes].to_vec(),
        i64s(&read(io::DRAFT_TOKENS)?)[..b * nodes].to_vec(),
    );
    let scores = f32s(&read(SCORE_LIST)?)[..b * cands].to_vec();
    let tokens = i64s(&read(TOKEN_LIST)?)[..b * cands].to_vec();
    let mut verify = Vec::new();
    if rt.plan().capture.decode_verify {
        for name in VERIFY {
            let bytes = read(name)?;
            let v: Vec<i64> = if name == io::TREE_MASK {
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64)
                    .collect()
            } else {
                i64s(&bytes)
            };
            let w = v.len() / c.bucket as usize;
            verify.push(v[..b * w].to_vec());
        }
    }
    let (k, v) = rt.read_kv(c.used_pages).map_err(g)?;
    Ok(GpuRun {
        outs,
        scores,
        tokens,
        verify,
        k,
        v,
    })
}

/// The CPU executor's run of a case: its cache afterwards and the tree's lists.
struct CpuTree {
    pool: KvPool,
    parents: Vec<i64>,
    top: Vec<i64>,
    drafts: Vec<i64>,
    tokens: Vec<i64>,
    scores: Vec<f64>,
    verify: Vec<Vec<i64>>,
}

/// Runs the case on the CPU executor, on the same values: the case's pages plus a scratch page.
fn cpu_tree(plan: &ValidatedPlan, weights: &[WeightData], kind: PhaseKind, c: &DecodeCase) -> Result<CpuTree, String> {
    let act = plan.capture.dtype;
    let page = plan.kv_page_bytes() as usize / 2;
    let per_layer = c.used_pages * page;
    let to_pool = |bits: &[u16]| -> Vec<Vec<f32>> {
        bits.chunks_exact(per_layer.max(1))
            .map(|l| {
                let mut v: Vec<f32> = l.iter().map(|&x| from_act_bits(x, act)).collect();
                v.extend(std::iter::repeat_n(0.0, page));
                v
            })
            .collect()
    };
    let mut pool = KvPool {
        pages: c.used_pages + 1,
        k: to_pool(&c.k0),
        v: to_pool(&c.v0),
    };
    let mut table = PageTable::new(plan, c.used_pages as i32);
    for (i, &s) in c.slots.iter().enumerate() {
        table.set_row(s as usize, &c.pages[i]).map_err(|x| x.to_string())?;
    }
    let bucket = plan
        .phase(kind)
        .and_then(|ph| ph.bucket_for(c.bucket))
        .ok_or("no bucket")?;
    let named: Vec<(&str, Vec<f64>)> = c.inputs.iter().map(|(n, _, v)| (*n, v.clone())).collect();
    let exec = CpuExecutor::borrowing(plan, weights).map_err(|x| x.to_string())?;
    let outs = exec
        .run_named_reading(kind, bucket, &named, &table, &mut pool, &[SCORE_LIST, TOKEN_LIST])
        .map_err(|x| x.to_string())?;
    let find = |name: &str| outs.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let get = |name: &str| -> Vec<i64> { find(name).map_or_else(Vec::new, |v| v.iter().map(|&x| x as i64).collect()) };
    let verify = if plan.capture.decode_verify {
        VERIFY.iter().map(|name| get(name)).collect()
    } else {
        Vec::new()
    };
    Ok(CpuTree {
        parents: get(io::PARENT_LIST),
        top: get(io::TOP_SCORES_INDEX),
        drafts: get(io::DRAFT_TOKENS),
        tokens: get(TOKEN_LIST),
        scores: find(SCORE_LIST).cloned().unwrap_or_default(),
        verify,
        pool,
    })
}

/// Cache elements of a GPU run that changed from the case's and lie outside every lane's
/// slots (`written`, one layer's elements).
fn changed_outside(run: &GpuRun, c: &DecodeCase, written: &[bool]) -> usize {
    let mut n = 0;
    for (got, init) in [(&run.k, &c.k0), (&run.v, &c.v0)] {
        for (idx, (&gv, &iv)) in got.iter().zip(init.iter()).enumerate() {
            if !written[idx % written.len().max(1)] && gv != iv {
                n += 1;
            }
        }
    }
    n
}

/// Wall time per graph replay over 100 back-to-back replays of a bucket (the inputs stay in
/// place), µs.
fn replay_us(rt: &mut GpuRuntime, kind: PhaseKind, bucket: u32) -> Result<f64, String> {
    let reps = 100;
    rt.run_phase(kind, bucket, false).map_err(g)?;
    rt.synchronize().map_err(g)?;
    let t0 = std::time::Instant::now();
    for _ in 0..reps {
        rt.run_phase(kind, bucket, false).map_err(g)?;
    }
    rt.synchronize().map_err(g)?;
    Ok(t0.elapsed().as_secs_f64() * 1e6 / reps as f64)
}

/// Runs phase `kind` for `b` requests on the GPU (graph and eager) and on the CPU executor.
pub fn check_decode(
    plan: &ValidatedPlan,
    rt: &mut GpuRuntime,
    weights: &[WeightData],
    kind: PhaseKind,
    rng: &mut Rng,
    b: usize,
) -> Result<DecodeReport, String> {
    let c = make_case(plan, kind, rng, b)?;
    let (k, steps) = (plan.spec.topk as usize, kind.steps() as usize);
    let nodes = kind.draft_tokens(&plan.spec) as usize - 1;
    let (pw, cands) = (
        parent_width(k as u32, steps as u32) as usize,
        tree_candidates(k as u32, steps as u32) as usize,
    );
    let act = plan.capture.dtype;
    for (i, &s) in c.slots.iter().enumerate() {
        rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
    }
    let sizes = Sizes { b, pw, nodes, cands };
    let graph = gpu_run(rt, &c, kind, sizes, false)?;
    let eager = gpu_run(rt, &c, kind, sizes, true)?;
    let GpuRun {
        outs: og,
        scores: sg,
        tokens: tg,
        verify: vfg,
        k: kg,
        v: vg,
    } = &graph;
    let replay_us = replay_us(rt, kind, c.bucket)?;
    let mut e = DecodeReport {
        phase: kind.label(),
        b,
        bucket: c.bucket,
        replay_us,
        ..DecodeReport::default()
    };
    e.graph_vs_eager_diff = graph.bit_diffs(&eager);

    // The CPU executor on the same values: the case's pages plus a scratch page.
    let per_layer = c.used_pages * plan.kv_page_bytes() as usize / 2;
    let CpuTree {
        pool,
        parents: cp,
        top: ct,
        drafts: cd,
        tokens: ctl,
        scores: csl,
        verify: cpu_verify,
    } = cpu_tree(plan, weights, kind, &c)?;
    if ctl.len() < b * cands || csl.len() < b * cands {
        return Err("the CPU executor did not return the tree's score and token lists".into());
    }

    // Per request: the tree, then (when it is the CPU's) the lanes' K/V.
    let (ps, row) = (
        plan.capture.page_size as usize,
        plan.model.kv_heads as usize * plan.model.head_dim as usize,
    );
    let mut written = vec![false; per_layer];
    for r in 0..b {
        let l = c.prefix[r];
        for lane in 0..k {
            for i in 0..steps - 1 {
                let pos = l + lane_offset(l as u64, lane as u32, steps as u32, k as u32, ps as u32) as usize + i;
                let pg = c.pages[r][pos / ps] as usize;
                let at = (pg * ps + pos % ps) * row;
                written[at..at + row].iter_mut().for_each(|w| *w = true);
            }
        }
        let same = og.0[r * pw..(r + 1) * pw] == cp[r * pw..(r + 1) * pw]
            && og.1[r * nodes..(r + 1) * nodes] == ct[r * nodes..(r + 1) * nodes]
            && og.2[r * nodes..(r + 1) * nodes] == cd[r * nodes..(r + 1) * nodes];
        if !same {
            e.differ += 1;
            let gap = min_cut_gap(&sg[r * cands..(r + 1) * cands], k, steps, nodes);
            // Or the trees first part at a candidate token both sides chose at nearly the
            // same score (a near tie inside a lane's distribution, which the score list
            // alone cannot show: with topk 1 the runner-up is in neither list).
            let first = first_token_tie(
                &tg[r * cands..(r + 1) * cands],
                &ctl[r * cands..(r + 1) * cands],
                &sg[r * cands..(r + 1) * cands],
                &csl[r * cands..(r + 1) * cands],
                k,
            );
            e.near_ties += (gap < TREE_TIE_REL || first) as usize;
            continue;
        }
        e.equal += 1;
        // The verify inputs follow from the tree and the inputs: equal bit for bit.
        for ((gv, cv), name) in vfg.iter().zip(&cpu_verify).zip(VERIFY) {
            let w = gv.len() / b.max(1);
            if gv[r * w..(r + 1) * w] != cv[r * w..(r + 1) * w] {
                e.failures
                    .push(format!("b={b} req {r}: {name} differs from the CPU executor's"));
            }
        }
        // The lanes whose input parted from the CPU's: an equal tree can still hide a token
        // that differs at a candidate fed to a lane but not chosen among the N − 1 nodes (a
        // near tie inside the parent lane's top-K, or at its K-th child), and that lane's
        // later K/V then legitimately differs. Such a candidate must score nearly the same on
        // both sides (`TREE_TIE_REL`); anything else is a failure.
        let (tree_g, tree_c) = (&tg[r * cands..(r + 1) * cands], &ctl[r * cands..(r + 1) * cands]);
        let parted = parted_lanes(&og.0[r * pw..(r + 1) * pw], tree_g, tree_c, k, steps);
        for (i, lanes) in parted.iter().enumerate() {
            for (lane, &(p, cand)) in lanes.iter().enumerate() {
                // A lane that only descends from a parted one is skipped, not judged.
                let Some(cand) = cand.filter(|&c| p && tree_g.get(c) != tree_c.get(c)) else {
                    continue;
                };
                let (sgv, scv) = (
                    sg.get(r * cands + cand).map_or(f64::NAN, |&x| x as f64),
                    csl.get(r * cands + cand).copied().unwrap_or(f64::NAN),
                );
                let rel = (sgv - scv).abs() / scv.abs().max(1e-30);
                e.lane_ties += 1;
                if rel.is_nan() || rel > TREE_TIE_REL {
                    e.failures.push(format!(
                        "b={b} req {r} lane {lane} step {i}: input token {:?} on the GPU, {:?} on the CPU (candidate {cand}), scores {sgv:.4e} against {scv:.4e} (not a near tie)",
                        tree_g.get(cand), tree_c.get(cand)
                    ));
                }
            }
        }
        for (which, got, refp) in [("k", &kg, &pool.k), ("v", &vg, &pool.v)] {
            for (layer, refl) in refp.iter().enumerate() {
                let (mut gw, mut ww, mut at_slot) = (Vec::new(), Vec::new(), Vec::new());
                for lane in 0..k {
                    for (i, lanes) in parted.iter().enumerate() {
                        if lanes[lane].0 {
                            continue;
                        }
                        at_slot.push((lane, i));
                        let pos =
                            l + lane_offset(l as u64, lane as u32, steps as u32, k as u32, ps as u32) as usize + i;
                        let pg = c.pages[r][pos / ps] as usize;
                        let at = (pg * ps + pos % ps) * row;
                        for x in at..at + row {
                            gw.push(from_act_bits(got[layer * per_layer + x], act) as f64);
                            ww.push(refl[x] as f64);
                        }
                    }
                }
                let rel = rel_rms(&gw, &ww);
                e.kv_rel = e.kv_rel.max(rel);
                if rel.is_nan() || rel > REL_BOUND {
                    // The worst slot: where it is, and whether either side left it as it was.
                    let init = if which == "k" { &c.k0 } else { &c.v0 };
                    let mut worst = (0.0f64, String::new());
                    for (si, (gs, ws)) in gw.chunks(row).zip(ww.chunks(row)).enumerate() {
                        let r2 = rel_rms(gs, ws);
                        if r2 > worst.0 {
                            let (lane, i) = at_slot[si];
                            let pos =
                                l + lane_offset(l as u64, lane as u32, steps as u32, k as u32, ps as u32) as usize + i;
                            let pg = c.pages[r][pos / ps] as usize;
                            let at = layer * per_layer + (pg * ps + pos % ps) * row;
                            let gpu_kept = got[at..at + row] == init[at..at + row];
                            let cpu_kept =
                                (0..row).all(|x| refl[at - layer * per_layer + x] == from_act_bits(init[at + x], act));
                            worst = (
                                r2,
                                format!("lane {lane} step {i} position {pos} (prefix {l}, page {pg}): rel {r2:.2e}, GPU kept the old value {gpu_kept}, CPU kept it {cpu_kept}"),
                            );
                        }
                    }
                    e.failures.push(format!(
                        "b={b} req {r} {which}_cache layer {layer}: lane slots relative error {rel:.3e}; worst {}",
                        worst.1
                    ));
                }
            }
        }
    }
    e.kv_untouched_changed = changed_outside(&graph, &c, &written);
    if e.kv_untouched_changed > 0 {
        e.failures.push(format!(
            "b={b}: {} cache elements outside the lanes' slots changed",
            e.kv_untouched_changed
        ));
    }
    if e.graph_vs_eager_diff > 0 {
        e.failures.push(format!(
            "b={b}: graph and eager differ in {} values",
            e.graph_vs_eager_diff
        ));
    }
    e.failures.truncate(12);
    e.ok = e.failures.is_empty();
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::{first_token_tie, parted_lanes};

    #[test]
    fn trees_that_part_at_nearly_equal_scores_are_near_ties() {
        // K 1 (a chain), three forwards: candidates 0 (root), 1, 2.
        let cpu = [7i64, 11, 13];
        let sc = [1.0f64, 0.40, 0.20];
        // Forward 1 took another token at nearly the CPU's score: a near tie (what follows
        // descends from it and is not judged).
        assert!(first_token_tie(&[7, 12, 99], &cpu, &[1.0, 0.401, 0.9], &sc, 1));
        // ... at a clearly different score: not one.
        assert!(!first_token_tie(&[7, 12, 13], &cpu, &[1.0, 0.30, 0.20], &sc, 1));
        // Equal token lists part nowhere.
        assert!(!first_token_tie(&cpu, &cpu, &[1.0, 0.40, 0.20], &sc, 1));
    }

    #[test]
    fn a_lane_parts_where_its_candidate_token_differs_and_its_children_follow() {
        // K 2, S 4: forwards 0..2; candidates: 2 roots, then 4 per selection.
        let (k, steps) = (2, 4);
        // parent_list: −1, roots 0 1, selection 1 picks candidates 2 and 5 (from lanes 0
        // and 1 of forward 0), selection 2 picks 6 and 9 (children of forward-1 lanes 0, 1).
        let parents = [-1, 0, 1, 2, 5, 6, 9];
        let cpu: Vec<i64> = (0..2 + 4 + 4).collect();
        let mut gpu = cpu.clone();
        gpu[5] = 99; // forward 1's lane 1 took another token at candidate 5
        let p = parted_lanes(&parents, &gpu, &cpu, k, steps);
        assert_eq!(p[0], vec![(false, None), (false, None)]);
        assert_eq!(p[1], vec![(false, Some(2)), (true, Some(5))]);
        // Candidate 9 is a child of forward 1's lane 1 (block 6..10, (9 − 6) / 2 = 1).
        assert_eq!(p[2], vec![(false, Some(6)), (true, Some(9))]);
        // Nothing parts when the lists agree.
        let q = parted_lanes(&parents, &cpu, &cpu, k, steps);
        assert!(q.iter().flatten().all(|x| !x.0));
    }
}
