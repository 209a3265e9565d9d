//! The CPU engine's draft-decode step on engines' K/V layouts in place (SGLang's NHD and HND
//! token pools with a token-slot table, vLLM's packed NHD and HND with a page-id table),
//! against the CPU executor on a dense pool that rounds written K/V to bf16 as an engine's
//! pool does, on fresh random data (the seed is printed): the same tree bit for bit, the
//! lanes' slots holding the dense run's values, nothing else of the caller's memory changed;
//! batches above the largest bucket in chunks; a request breaking a rule (its row, its
//! prefix's reach, an id, a lane slot another request reads) refused by name, writing nothing
//! and with zero rows, the others unaffected.

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_format::{io, DType, KvKind, PhaseKind, Plan, ValidatedPlan};
use specplan_kernels::facts::{decode_reach, lane_offset, parent_width};
use specplan_kernels::kv::{DeviceRule, TableMode};
use specplan_runtime::bits::{from_act_bits, round_act, to_act_bits};
use specplan_runtime::cpu::engine::{CpuEngine, Ints};
use specplan_runtime::cpu::engine_decode::{HostDecode, HostDecodeOutputs};
use specplan_runtime::cpu::{CpuExecutor, KvStore};
use specplan_runtime::registration::{EngineMemory, TableRegistration};
use specplan_runtime::step::PageTable;
use specplan_tests::host_layouts::{host_weights, kv_registration, pools, read_back, HostWeights, Layout, Pools};
use specplan_tests::random::{deal_pages, random_topk, random_weights};
use specplan_tests::{seed, Rng};

fn plan(topk: u32, steps: &str, num_steps: u32, n: u32, page_size: u32) -> ValidatedPlan {
    plan_with(topk, steps, num_steps, n, page_size, "tree")
}

fn plan_with(topk: u32, steps: &str, num_steps: u32, n: u32, page_size: u32, outputs: &str) -> ValidatedPlan {
    let o = Overrides {
        draft_decode_outputs: Some(outputs.into()),
        topk: Some(topk),
        num_steps: Some(num_steps),
        num_draft_tokens: Some(n),
        page_size: Some(page_size),
        draft_decode_steps: Some(steps.into()),
        buckets: Some("1,2,4".into()),
        max_context_len: Some(256),
        ..Default::default()
    };
    let cfg = resolve(&Source::Preset("tiny".into()), &o).expect("config");
    compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan
}

/// A dense pool of token slots whose stores round to the activation type (an engine's pool
/// keeps bf16; the executor's own `KvPool` keeps f32).
struct RoundingKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    slots: usize,
    row: usize,
    dim: usize,
    act: DType,
}

impl KvStore for RoundingKv {
    fn slots(&self) -> u64 {
        self.slots as u64
    }
    fn fits(&self, plan: &Plan) -> bool {
        self.k.len() == plan.model.layers as usize
            && self.row == (plan.model.kv_heads * plan.model.head_dim) as usize
            && self.dim == plan.model.head_dim as usize
    }
    fn load(&self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize) -> Result<f64, String> {
        let pool = if kind == KvKind::K { &self.k } else { &self.v };
        pool.get(layer)
            .and_then(|l| l.get(slot * self.row + head * self.dim + d))
            .map(|&x| x as f64)
            .ok_or_else(|| format!("slot {slot} outside the pool"))
    }
    fn store(&mut self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize, v: f64) -> Result<(), String> {
        let (row, dim, act) = (self.row, self.dim, self.act);
        let pool = if kind == KvKind::K { &mut self.k } else { &mut self.v };
        let cell = pool
            .get_mut(layer)
            .and_then(|l| l.get_mut(slot * row + head * dim + d))
            .ok_or_else(|| format!("slot {slot} outside the pool"))?;
        *cell = round_act(v as f32, act);
        Ok(())
    }
}

/// One step's requests: prefixes, pages (each request's own), the caches' bits, the inputs.
#[derive(Clone)]
struct Case {
    b: usize,
    prefix: Vec<usize>,
    pages: Vec<Vec<i32>>,
    used_pages: usize,
    k0: Vec<u16>,
    v0: Vec<u16>,
    probs: Vec<f32>,
    ids: Vec<i64>,
    hidden: Vec<u16>,
}

fn make_case(plan: &ValidatedPlan, kind: PhaseKind, rng: &mut Rng, b: usize) -> Case {
    let (k, s, ps) = (plan.spec.topk, kind.steps(), plan.capture.page_size as usize);
    let ctx = plan.capture.max_context_len as usize;
    let act = plan.capture.dtype;
    let prefix: Vec<usize> = (0..b)
        .map(|_| loop {
            let l = rng.below(60);
            if l + decode_reach(l as u64, s, k, ps as u32) as usize <= ctx {
                break l;
            }
        })
        .collect();
    let need: Vec<usize> = prefix
        .iter()
        .map(|&l| (l + decode_reach(l as u64, s, k, ps as u32) as usize).div_ceil(ps))
        .collect();
    let (pages, used_pages) = deal_pages(rng, &need);
    let per = used_pages * ps * (plan.model.kv_heads * plan.model.head_dim * plan.model.layers) as usize;
    let bits = |rng: &mut Rng| to_act_bits(&(0..per).map(|_| rng.uniform()).collect::<Vec<_>>(), act);
    let (k0, v0) = (bits(rng), bits(rng));
    let (probs, ids) = random_topk(rng, b, k as usize, plan.model.vocab as usize);
    let h = plan.model.hidden as usize;
    let hidden = to_act_bits(&(0..b * h).map(|_| rng.uniform()).collect::<Vec<_>>(), act);
    Case {
        b,
        prefix,
        pages,
        used_pages,
        k0,
        v0,
        probs,
        ids,
        hidden,
    }
}

/// The case's positions' token slots (page-major: the dense pool's slot numbering).
fn token(c: &Case, ps: usize, i: usize, pos: usize) -> usize {
    c.pages[i][pos / ps] as usize * ps + pos % ps
}

/// The lanes' written positions of request `i`.
fn lane_positions(plan: &ValidatedPlan, kind: PhaseKind, l: usize) -> Vec<usize> {
    let (k, s, ps) = (plan.spec.topk, kind.steps(), plan.capture.page_size);
    (0..k)
        .flat_map(|lane| {
            let base = l + lane_offset(l as u64, lane, s, k, ps) as usize;
            (0..s as usize - 1).map(move |i| base + i)
        })
        .collect()
}

struct Tree {
    parents: Vec<i64>,
    index: Vec<i64>,
    tokens: Vec<i64>,
    /// The verify outputs (plans with them), in `HostDecodeOutputs::verify` order, then the
    /// mask.
    verify: Vec<Vec<i64>>,
}

const VERIFY: [&str; 6] = [
    io::VERIFY_TOKENS,
    io::VERIFY_POSITIONS,
    io::RETRIEVE_INDEX,
    io::RETRIEVE_NEXT_TOKEN,
    io::RETRIEVE_NEXT_SIBLING,
    io::TREE_MASK,
];

/// The dense reference: one bucket per chunk of the phase's largest bucket, requests in
/// table rows 0.., on a rounding pool built from the case's bits.
fn dense(
    plan: &ValidatedPlan,
    hw: &[specplan_runtime::cpu::WeightData],
    kind: PhaseKind,
    c: &Case,
    bonus: Option<&[i64]>,
) -> (Tree, RoundingKv) {
    let act = plan.capture.dtype;
    let (row, dim, ps) = (
        (plan.model.kv_heads * plan.model.head_dim) as usize,
        plan.model.head_dim as usize,
        plan.capture.page_size as usize,
    );
    let per_layer = c.used_pages * ps * row;
    let layer = |bits: &[u16]| -> Vec<Vec<f32>> {
        bits.chunks_exact(per_layer)
            .map(|l| l.iter().map(|&x| from_act_bits(x, act)).collect())
            .collect()
    };
    let mut kv = RoundingKv {
        k: layer(&c.k0),
        v: layer(&c.v0),
        slots: c.used_pages * ps,
        row,
        dim,
        act,
    };
    let phase = plan.phase(kind).expect("phase");
    let max_b = phase.buckets.last().expect("a bucket").batch as usize;
    let (k, h) = (plan.spec.topk as usize, plan.model.hidden as usize);
    let exec = CpuExecutor::borrowing(plan, hw).expect("executor");
    let mut t = Tree {
        parents: Vec::new(),
        index: Vec::new(),
        tokens: Vec::new(),
        verify: vec![Vec::new(); if bonus.is_some() { VERIFY.len() } else { 0 }],
    };
    for start in (0..c.b).step_by(max_b) {
        let end = (start + max_b).min(c.b);
        let bucket = phase.bucket_for((end - start) as u32).expect("bucket");
        let bb = bucket.batch as usize;
        let cols = c.pages.iter().map(|p| p.len()).max().unwrap_or(1);
        let mut table = PageTable {
            rows: bb,
            cols,
            data: vec![-1; bb * cols],
            mode: TableMode::PageIds,
        };
        let mut named: Vec<(&str, Vec<f64>)> = vec![
            (io::TOPK_PROBS, vec![0.0; bb * k]),
            (io::TOPK_IDS, vec![0.0; bb * k]),
            (io::HIDDEN_STATES, vec![0.0; bb * h]),
            (io::PREFIX_LENS, vec![0.0; bb]),
            (io::REQ_SLOTS, vec![-1.0; bb]),
        ];
        if let Some(x) = bonus {
            named.push((
                io::BONUS_TOKENS,
                (0..bb).map(|r| x.get(start + r).map_or(0.0, |&v| v as f64)).collect(),
            ));
        }
        for i in start..end {
            let r = i - start;
            table.data[r * cols..r * cols + c.pages[i].len()].copy_from_slice(&c.pages[i]);
            for j in 0..k {
                named[0].1[r * k + j] = c.probs[i * k + j] as f64;
                named[1].1[r * k + j] = c.ids[i * k + j] as f64;
            }
            for j in 0..h {
                named[2].1[r * h + j] = from_act_bits(c.hidden[i * h + j], act) as f64;
            }
            named[3].1[r] = c.prefix[i] as f64;
            named[4].1[r] = r as f64;
        }
        let outs = exec
            .run_named_on(kind, bucket, &named, &table, &mut kv)
            .expect("dense run");
        let take = |name: &str, w: usize| -> Vec<i64> {
            let v = &outs.iter().find(|(n, _)| n == name).expect("output").1;
            v[..(end - start) * w].iter().map(|&x| x as i64).collect()
        };
        let (pw, nodes) = (
            parent_width(k as u32, kind.steps()) as usize,
            kind.draft_tokens(&plan.spec) as usize - 1,
        );
        t.parents.extend(take(io::PARENT_LIST, pw));
        t.index.extend(take(io::TOP_SCORES_INDEX, nodes));
        t.tokens.extend(take(io::DRAFT_TOKENS, nodes));
        for (dst, name) in t.verify.iter_mut().zip(VERIFY) {
            let w = if name == io::TREE_MASK {
                (nodes + 1) * (nodes + 1)
            } else {
                nodes + 1
            };
            dst.extend(take(name, w));
        }
    }
    (t, kv)
}

struct Run {
    tree: Tree,
    pools: Pools,
    error: Option<specplan_runtime::gpu::DeviceError>,
}

/// The engine's step on `layout`: SGLang's token slots with i64 ids and prefixes, or vLLM's
/// page ids with i32 ones (`req` rows as given, `rows` table rows).
/// The CPU engine registered on `layout`'s pools filled with the case's K/V, and a table of
/// the case's rows (token slots for SGLang's layouts, page ids for vLLM's; a row stride wider
/// than the columns, as SGLang's req_to_token rows are). The engine comes first, so it is
/// dropped before the memory it points at.
struct Registered {
    eng: CpuEngine,
    pools: Pools,
    _table: Vec<i32>,
}

fn register(plan: &ValidatedPlan, hw: &HostWeights, c: &Case, layout: Layout) -> Registered {
    let mut pools = pools(plan, c.used_pages, &c.k0, &c.v0, layout);
    let ps = plan.capture.page_size as usize;
    let token_slots = matches!(layout, Layout::SglangNhd | Layout::SglangHnd);
    // One spare page: registration refuses a table covering no more than N positions.
    let pcols = c.pages.iter().map(|p| p.len()).max().unwrap_or(1) + 1;
    let cols = if token_slots { pcols * ps } else { pcols };
    let stride = cols + 3;
    let mut table = vec![-1i32; c.b * stride];
    for i in 0..c.b {
        if token_slots {
            for pos in 0..c.pages[i].len() * ps {
                table[i * stride + pos] = token(c, ps, i, pos) as i32;
            }
        } else {
            table[i * stride..i * stride + c.pages[i].len()].copy_from_slice(&c.pages[i]);
        }
    }
    let mem = EngineMemory {
        kv: kv_registration(plan, &mut pools),
        table: TableRegistration {
            ptr: table.as_ptr() as u64,
            mode: if token_slots {
                TableMode::TokenSlots
            } else {
                TableMode::PageIds
            },
            rows: c.b as u64,
            cols: cols as u64,
            stride: stride as u64,
            page_size: if token_slots { 1 } else { ps as u64 },
        },
        weights: &hw.tensors,
    };
    // SAFETY: every address is a heap buffer that `Registered` keeps alive and unmoved for the
    // engine's life (the pools for the geometry's extent, the table for b × stride; the
    // weights are the caller's `hw`, which outlives it), untouched while the engine runs.
    let eng = unsafe { CpuEngine::new(plan.clone(), mem) }.expect("registers");
    Registered {
        eng,
        pools,
        _table: table,
    }
}

fn run_layout(plan: &ValidatedPlan, hw: &HostWeights, kind: PhaseKind, c: &Case, layout: Layout, req: &[i64]) -> Run {
    let Registered { mut eng, pools, _table } = register(plan, hw, c, layout);
    let token_slots = matches!(layout, Layout::SglangNhd | Layout::SglangHnd);
    let k = plan.spec.topk as usize;
    let (pw, nodes) = (
        parent_width(k as u32, kind.steps()) as usize,
        kind.draft_tokens(&plan.spec) as usize - 1,
    );
    let mut tree = Tree {
        parents: vec![-7; c.b * pw],
        index: vec![-7; c.b * nodes],
        tokens: vec![-7; c.b * nodes],
        verify: Vec::new(),
    };
    let vllm = !token_slots;
    let ids32: Vec<i32> = c.ids.iter().map(|&x| x as i32).collect();
    let pre64: Vec<i64> = c.prefix.iter().map(|&x| x as i64).collect();
    // vLLM-style: prefixes given as seq_lens + 1 with a bias of −1.
    let seq32: Vec<i32> = c.prefix.iter().map(|&x| x as i32 + 1).collect();
    let x = HostDecode {
        topk_p: &c.probs,
        topk_index: if vllm { Ints::I32(&ids32) } else { Ints::I64(&c.ids) },
        hidden: &c.hidden,
        req: Ints::I64(req),
        prefix: if vllm { Ints::I32(&seq32) } else { Ints::I64(&pre64) },
        prefix_bias: if vllm { -1 } else { 0 },
        bonus_tokens: None,
    };
    let mut o = HostDecodeOutputs {
        parent_list: Some(&mut tree.parents),
        top_scores_index: Some(&mut tree.index),
        draft_tokens: Some(&mut tree.tokens),
        ..Default::default()
    };
    eng.draft_decode(kind, &x, &mut o).expect("steps");
    let error = eng.last_error();
    drop(eng);
    Run { tree, pools, error }
}

/// Every slot of the case: written lanes hold `want`'s values (when given), the rest the
/// case's bits.
fn check_cache(
    plan: &ValidatedPlan,
    kind: PhaseKind,
    c: &Case,
    r: &Run,
    want: Option<&RoundingKv>,
    writers: &[usize],
    tag: &str,
) {
    let act = plan.capture.dtype;
    let (hh, d, ps) = (
        plan.model.kv_heads as u64,
        plan.model.head_dim as u64,
        plan.capture.page_size as usize,
    );
    let mut written = std::collections::HashSet::new();
    for &i in writers {
        for pos in lane_positions(plan, kind, c.prefix[i]) {
            written.insert(token(c, ps, i, pos) as u64);
        }
    }
    let per_layer = c.used_pages * ps * (hh * d) as usize;
    for layer in 0..plan.model.layers as usize {
        for t in 0..(c.used_pages * ps) as u64 {
            for g in 0..hh {
                for e in 0..d {
                    let at = ((t * hh + g) * d + e) as usize;
                    for (v, orig) in [(false, &c.k0), (true, &c.v0)] {
                        let got = read_back(plan, &r.pools, layer, v, t, g, e);
                        let what = if v { "V" } else { "K" };
                        match want {
                            Some(w) if written.contains(&t) => {
                                let x = if v { w.v[layer][at] } else { w.k[layer][at] };
                                assert_eq!(
                                    got.to_bits(),
                                    x.to_bits(),
                                    "{tag}: layer {layer} {what} slot {t} [{g}][{e}]"
                                );
                            }
                            _ if written.contains(&t) => {}
                            _ => {
                                let o = from_act_bits(orig[layer * per_layer + at], act);
                                assert_eq!(got.to_bits(), o.to_bits(), "{tag}: unwritten {what} slot {t} changed");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn engine_layouts_run_the_phase_as_the_dense_executor() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s);
    // A tree with pages (page-aligned lane runs), and a chain with tiers 2, 3, 5.
    for (topk, tiers, num_steps, n, ps) in [(4u32, "3", 3u32, 8u32, 4u32), (1, "2,3,5", 3, 4, 1)] {
        let plan = plan(topk, tiers, num_steps, n, ps);
        let w = random_weights(&plan, &mut rng);
        let hw = host_weights(&plan, &w);
        for kind in plan.phases.iter().map(|p| p.kind).filter(|k| k.steps() > 0) {
            // 6 requests: above the largest bucket (4), so the step runs as two chunks.
            let c = make_case(&plan, kind, &mut rng, 6);
            let (want, kv) = dense(&plan, &w, kind, &c, None);
            let layouts: &[Layout] = if ps == 1 {
                &[Layout::SglangNhd, Layout::VllmNhd]
            } else {
                &[Layout::SglangNhd, Layout::SglangHnd, Layout::VllmNhd, Layout::VllmHnd]
            };
            let req: Vec<i64> = (0..c.b as i64).collect();
            for &layout in layouts {
                let tag = format!("topk {topk} {} page {ps} {layout:?}", kind.label());
                let r = run_layout(&plan, &hw, kind, &c, layout, &req);
                assert!(r.error.is_none(), "{tag}: {:?}", r.error);
                assert_eq!(r.tree.parents, want.parents, "{tag}: parent_list");
                assert_eq!(r.tree.index, want.index, "{tag}: top_scores_index");
                assert_eq!(r.tree.tokens, want.tokens, "{tag}: draft_tokens");
                let all: Vec<usize> = (0..c.b).collect();
                check_cache(&plan, kind, &c, &r, Some(&kv), &all, &tag);
            }
        }
    }
}

/// (what, the case, the rows given, the refused request, its rule, the other request).
type Refusal = (&'static str, Case, Vec<i64>, usize, DeviceRule, Option<u64>);

#[test]
fn refused_requests_write_nothing_and_have_zero_rows() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s ^ 0xdec0de);
    let plan = plan(4, "3", 3, 8, 4);
    let kind = PhaseKind::DraftDecode { steps: 3 };
    let w = random_weights(&plan, &mut rng);
    let hw = host_weights(&plan, &w);
    let c = (0..256)
        .map(|_| make_case(&plan, kind, &mut rng, 4))
        .find(|c| c.prefix[0] >= 4)
        .expect("a case whose request 0 has a whole prefix page");
    let req: Vec<i64> = (0..c.b as i64).collect();
    let good = run_layout(&plan, &hw, kind, &c, Layout::VllmNhd, &req);
    assert!(good.error.is_none(), "{:?}", good.error);
    let (pw, nodes) = (parent_width(4, 3) as usize, 7);
    let rows_equal = |a: &Run, i: usize| {
        a.tree.parents[i * pw..(i + 1) * pw] == good.tree.parents[i * pw..(i + 1) * pw]
            && a.tree.tokens[i * nodes..(i + 1) * nodes] == good.tree.tokens[i * nodes..(i + 1) * nodes]
    };
    let zero = |a: &Run, i: usize| {
        a.tree.parents[i * pw..(i + 1) * pw].iter().all(|&x| x == 0)
            && a.tree.index[i * nodes..(i + 1) * nodes].iter().all(|&x| x == 0)
            && a.tree.tokens[i * nodes..(i + 1) * nodes].iter().all(|&x| x == 0)
    };
    let cases: Vec<Refusal> = vec![
        (
            "a row outside the table",
            c.clone(),
            vec![0, 9, 2, 3],
            1,
            DeviceRule::Request,
            None,
        ),
        (
            "a prefix whose lanes pass max_context_len",
            {
                let mut x = c.clone();
                x.prefix[2] = plan.capture.max_context_len as usize - 2;
                x
            },
            req.clone(),
            2,
            DeviceRule::Prefix,
            None,
        ),
        (
            "an id outside the vocabulary",
            {
                let mut x = c.clone();
                x.ids[3 * 4 + 1] = plan.model.vocab as i64;
                x
            },
            req.clone(),
            3,
            DeviceRule::Id,
            None,
        ),
        (
            "a prefix page that request 1's lanes write",
            {
                // Request 0 reads its first page; request 1's first lane page becomes it.
                let mut x = c.clone();
                let at = x.prefix[1] / 4;
                x.pages[1][at] = x.pages[0][0];
                x
            },
            req.clone(),
            0,
            DeviceRule::Alias,
            Some(1),
        ),
        (
            "a whole prefix page outside the pool (found in the aliasing walk)",
            {
                let mut x = c.clone();
                let last_whole = x.prefix[0] / 4 - 1;
                x.pages[0][last_whole] = 1 << 20;
                x
            },
            req.clone(),
            0,
            DeviceRule::Slot,
            None,
        ),
    ];
    for (what, x, rq, who, rule, other) in cases {
        let r = run_layout(&plan, &hw, kind, &x, Layout::VllmNhd, &rq);
        let e = r.error.as_ref().unwrap_or_else(|| panic!("{what}: not refused"));
        assert_eq!((e.request, e.rule), (who as u64, Some(rule)), "{what}: {e}");
        if other.is_some() {
            assert_eq!(e.other, other, "{what}: {e}");
        }
        assert!(zero(&r, who), "{what}: the refused request's rows are zeros");
        for i in (0..c.b).filter(|&i| i != who && (rule != DeviceRule::Alias || i != 1)) {
            assert!(rows_equal(&r, i), "{what}: request {i} changed");
        }
        // The refused request's lane slots keep the case's values (the others' are written).
        let writers: Vec<usize> = (0..c.b).filter(|&i| i != who).collect();
        check_cache(&plan, kind, &x, &r, None, &writers, what);
    }
}

#[test]
fn bad_shapes_are_named_and_nothing_runs() {
    let mut rng = Rng(seed() ^ 0x5a);
    let plan = plan(4, "3", 3, 8, 4);
    let kind = PhaseKind::DraftDecode { steps: 3 };
    let w = random_weights(&plan, &mut rng);
    let hw = host_weights(&plan, &w);
    let mut c = make_case(&plan, kind, &mut rng, 2);
    c.probs.pop();
    let Registered { mut eng, pools, _table } = register(&plan, &hw, &c, Layout::SglangNhd);
    let req = [0i64, 1];
    let pre: Vec<i64> = c.prefix.iter().map(|&x| x as i64).collect();
    let x = HostDecode {
        topk_p: &c.probs,
        topk_index: Ints::I64(&c.ids),
        hidden: &c.hidden,
        req: Ints::I64(&req),
        prefix: Ints::I64(&pre),
        prefix_bias: 0,
        bonus_tokens: None,
    };
    let e = eng
        .draft_decode(kind, &x, &mut HostDecodeOutputs::default())
        .expect_err("short topk_probs");
    assert!(e.contains("topk_probs") && e.contains("expected 8"), "{e}");
    let mut short = vec![0i64; 3];
    let x = HostDecode {
        topk_p: &c.probs[..0],
        ..x
    };
    let e = eng
        .draft_decode(
            PhaseKind::DraftDecode { steps: 5 },
            &x,
            &mut HostDecodeOutputs {
                draft_tokens: Some(&mut short),
                ..Default::default()
            },
        )
        .expect_err("no such phase");
    assert!(e.contains("draft_decode:5"), "{e}");
    drop(eng);
    let unchanged = Run {
        tree: Tree {
            parents: Vec::new(),
            index: Vec::new(),
            tokens: Vec::new(),
            verify: Vec::new(),
        },
        pools,
        error: None,
    };
    check_cache(&plan, kind, &c, &unchanged, None, &[], "nothing ran");
}

/// A plan with the verify inputs on engine memory: `bonus_tokens` staged, the six verify
/// tensors equal to the dense executor's bit for bit, a refused request's rows zeros, and a
/// missing `bonus_tokens` refused by name.
#[test]
fn verify_inputs_on_engine_memory_are_the_executors() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s ^ 0x7e7);
    let plan = plan_with(4, "3", 3, 8, 4, "tree,verify");
    let kind = PhaseKind::DraftDecode { steps: 3 };
    let w = random_weights(&plan, &mut rng);
    let hw = host_weights(&plan, &w);
    let c = make_case(&plan, kind, &mut rng, 6);
    let bonus: Vec<i64> = (0..c.b).map(|_| rng.below(plan.model.vocab as usize) as i64).collect();
    let (want, _) = dense(&plan, &w, kind, &c, Some(&bonus));
    let Registered {
        mut eng,
        pools: _pools,
        _table,
    } = register(&plan, &hw, &c, Layout::SglangNhd);
    let n = 8usize;
    let mut v: Vec<Vec<i64>> = (0..5).map(|_| vec![-7; c.b * n]).collect();
    let mut mask = vec![-7i32; c.b * n * n];
    let req: Vec<i64> = (0..c.b as i64).collect();
    let pre: Vec<i64> = c.prefix.iter().map(|&x| x as i64).collect();
    let mut bad = bonus.clone();
    bad[4] = -1;
    for (given, refused) in [(&bonus, None), (&bad, Some(4usize))] {
        let x = HostDecode {
            topk_p: &c.probs,
            topk_index: Ints::I64(&c.ids),
            hidden: &c.hidden,
            req: Ints::I64(&req),
            prefix: Ints::I64(&pre),
            prefix_bias: 0,
            bonus_tokens: Some(Ints::I64(given)),
        };
        {
            let mut it = v.iter_mut();
            let mut next = || it.next().map(|x| &mut x[..]);
            let verify = [next(), next(), next(), next(), next()];
            let mut o = HostDecodeOutputs {
                verify,
                tree_mask: Some(&mut mask),
                ..Default::default()
            };
            eng.draft_decode(kind, &x, &mut o).expect("steps");
        }
        match refused {
            None => {
                assert!(eng.last_error().is_none());
                for (got, (w_, name)) in v.iter().zip(want.verify.iter().zip(VERIFY)) {
                    assert_eq!(got, w_, "{name}");
                }
                let m: Vec<i64> = mask.iter().map(|&x| x as i64).collect();
                assert_eq!(m, want.verify[5], "tree_mask");
            }
            Some(r) => {
                let e = eng.last_error().expect("refused");
                assert_eq!((e.request, e.rule), (r as u64, Some(DeviceRule::Id)), "{e}");
                assert!(v.iter().all(|x| x[r * n..(r + 1) * n].iter().all(|&t| t == 0)));
                assert!(mask[r * n * n..(r + 1) * n * n].iter().all(|&t| t == 0));
            }
        }
    }
    let x = HostDecode {
        topk_p: &c.probs,
        topk_index: Ints::I64(&c.ids),
        hidden: &c.hidden,
        req: Ints::I64(&req),
        prefix: Ints::I64(&pre),
        prefix_bias: 0,
        bonus_tokens: None,
    };
    let e = eng
        .draft_decode(kind, &x, &mut HostDecodeOutputs::default())
        .expect_err("no bonus");
    assert!(e.contains(io::BONUS_TOKENS), "{e}");
    drop(eng);
}
