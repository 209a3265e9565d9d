//! The CPU engine on engines' K/V layouts in place — SGLang's NHD and HND token pools
//! (token-slot tables), vLLM's packed `[.., 2·D]` tensors with V at K + D (NHD and HND,
//! page-id tables) — against the CPU executor on its own dense pool, on fresh random data
//! (the seed is printed): every layout gives the same outputs bit for bit, those equal the
//! dense run within bf16 rounding of the written K/V, every written element lands where
//! the geometry says, nothing else in the caller's memory changes, and a refused request
//! writes nothing and gets zero outputs.

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_format::{signature, ValidatedPlan};
use specplan_kernels::kv::{DeviceRule, TableMode};
use specplan_runtime::bits::from_act_bits;
use specplan_runtime::cpu::engine::{CpuEngine, HostOutputs, HostStep, Ints};
use specplan_runtime::gpu::AcceptForm;
use specplan_runtime::registration::{EngineMemory, TableRegistration};
use specplan_tests::host_layouts::{host_weights, kv_registration, pools, read_back, HostWeights, Layout, Pools};
use specplan_tests::random::{make_case, random_weights, Case};
use specplan_tests::reference::cpu_reference;
use specplan_tests::{seed, Rng};

fn plan(page_size: u32, outputs: &str) -> ValidatedPlan {
    windowed_plan(page_size, outputs, None)
}

/// `tiny` with every layer's sliding window `window` (`None`: the preset's, none).
fn windowed_plan(page_size: u32, outputs: &str, window: Option<u32>) -> ValidatedPlan {
    let cfg = resolve(
        &Source::Preset("tiny".into()),
        &Overrides {
            page_size: Some(page_size),
            outputs: Some(outputs.into()),
            sliding_window: window,
            ..Default::default()
        },
    )
    .expect("tiny resolves");
    compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("tiny compiles")
        .plan
}

struct Run {
    probs: Vec<f32>,
    ids: Vec<i64>,
    hidden: Vec<u16>,
    logits: Vec<f32>,
    pools: Pools,
    error: Option<specplan_runtime::gpu::DeviceError>,
}

/// A CPU engine on `c`'s pools (in `layout`) and a table of its requests' rows (returned: it
/// must outlive the engine, which reads it in place).
fn layout_engine(
    plan: &ValidatedPlan,
    w: &HostWeights,
    c: &Case,
    layout: Layout,
    pools: &mut Pools,
) -> (CpuEngine, Vec<i32>) {
    let p = plan.capture.page_size as usize;
    let token_slots = matches!(layout, Layout::SglangNhd | Layout::SglangHnd);
    // Row i of the table: request i's pages (page ids), or its positions' token slots.
    // One spare page past the widest request, as an engine's table is wider than any
    // request's context: registration refuses a table covering no more than N positions,
    // which a case whose prefixes all drew 0 would otherwise be.
    let cols = if token_slots {
        (c.step.page_cols + 1) * p
    } else {
        c.step.page_cols + 1
    };
    let mut table = vec![-1i32; c.b * cols];
    for i in 0..c.b {
        if token_slots {
            for pos in 0..c.pages[i].len() * p {
                table[i * cols + pos] = c.pages[i][pos / p] * p as i32 + (pos % p) as i32;
            }
        } else {
            table[i * cols..i * cols + c.pages[i].len()].copy_from_slice(&c.pages[i]);
        }
    }
    let mem = EngineMemory {
        kv: kv_registration(plan, pools),
        table: TableRegistration {
            ptr: table.as_ptr() as u64,
            mode: if token_slots {
                TableMode::TokenSlots
            } else {
                TableMode::PageIds
            },
            rows: c.b as u64,
            cols: cols as u64,
            stride: cols as u64,
            page_size: if token_slots { 1 } else { p as u64 },
        },
        weights: &w.tensors,
    };
    // SAFETY: every address is a live host buffer of this function sized for its
    // registration (pools for the geometry's extent past the 16-byte shift, the table for
    // b × cols, the weights for their shapes), untouched while the engine runs.
    let eng = unsafe { CpuEngine::new(plan.clone(), mem) }.expect("registers");
    (eng, table)
}

fn run_layout(plan: &ValidatedPlan, w: &HostWeights, c: &Case, layout: Layout, accept: &[i32]) -> Run {
    let mut pools = pools(plan, c.used_pages, &c.k0, &c.v0, layout);
    let (mut eng, _table) = layout_engine(plan, w, c, layout, &mut pools);
    let (k, h) = (plan.spec.topk as usize, plan.model.hidden as usize);
    let cols_l = signature::logits_cols(plan) as usize;
    let outs = plan.capture.outputs;
    let mut run = Run {
        probs: vec![f32::NAN; if outs.topk { c.b * k } else { 0 }],
        ids: vec![-7; if outs.topk { c.b * k } else { 0 }],
        hidden: vec![0xffff; c.b * h],
        logits: vec![f32::NAN; if outs.logits { c.b * cols_l } else { 0 }],
        pools: Pools {
            k: Vec::new(),
            v: Vec::new(),
            geom: pools.geom,
            packed: pools.packed,
        },
        error: None,
    };
    let req: Vec<i64> = (0..c.b as i64).collect();
    let n = plan.spec.num_draft_tokens as i64;
    // vLLM's integers for its layouts: i32 ids, i32 seq_lens (prefix + N), the selected rows
    // r·N + A − 1; SGLang's otherwise: i64 ids, i32 prefixes, accept lengths.
    let vllm = matches!(layout, Layout::VllmNhd | Layout::VllmHnd);
    let ids32: Vec<i32> = c.step.input_ids.iter().map(|&x| x as i32).collect();
    let seq: Vec<i32> = c.step.prefix_lens.iter().map(|&l| l + n as i32).collect();
    let sel: Vec<i64> = accept
        .iter()
        .enumerate()
        .map(|(i, &a)| i as i64 * n + a as i64 - 1)
        .collect();
    let step = if vllm {
        HostStep {
            input_ids: Ints::I32(&ids32),
            hidden: &c.hidden_bits,
            req: Ints::I64(&req),
            prefix: Ints::I32(&seq),
            accept: Ints::I64(&sel),
            accept_form: AcceptForm::SelectRows,
            prefix_bias: -(n as i32),
        }
    } else {
        HostStep {
            input_ids: Ints::I64(&c.step.input_ids),
            hidden: &c.hidden_bits,
            req: Ints::I64(&req),
            prefix: Ints::I32(&c.step.prefix_lens),
            accept: Ints::I32(accept),
            accept_form: AcceptForm::Lengths,
            prefix_bias: 0,
        }
    };
    let mut o = HostOutputs {
        topk_p: outs.topk.then_some(&mut run.probs[..]),
        topk_index: outs.topk.then_some(&mut run.ids[..]),
        hidden: Some(&mut run.hidden[..]),
        logits: outs.logits.then_some(&mut run.logits[..]),
    };
    eng.step(&step, &mut o).expect("steps");
    run.error = eng.last_error();
    drop(eng);
    run.pools = pools;
    run
}

#[test]
fn engine_layouts_match_the_dense_executor() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s);
    for (page, outputs) in [(4u32, "topk,logits"), (1, "topk"), (4, "logits")] {
        let plan = plan(page, outputs);
        let w = random_weights(&plan, &mut rng);
        let hw = host_weights(&plan, &w);
        let c = make_case(&plan, &mut rng, 3, 9);
        let (want, pool) = cpu_reference(&plan, &w, &c).expect("reference");
        let layouts: &[Layout] = if page == 1 {
            &[Layout::SglangNhd, Layout::VllmNhd]
        } else {
            &[Layout::SglangNhd, Layout::SglangHnd, Layout::VllmNhd, Layout::VllmHnd]
        };
        let runs: Vec<Run> = layouts
            .iter()
            .map(|&l| run_layout(&plan, &hw, &c, l, &c.step.accept_lens))
            .collect();
        let act = plan.capture.dtype;
        for (l, r) in layouts.iter().zip(&runs) {
            let tag = format!("page {page}, outputs {outputs}, {l:?}");
            assert!(r.error.is_none(), "{tag}: {:?}", r.error);
            // Every layout runs the same math on the same values: equal bit for bit.
            assert_eq!(r.hidden, runs[0].hidden, "{tag}: hidden differs from {:?}", layouts[0]);
            assert_eq!(r.ids, runs[0].ids, "{tag}");
            assert_eq!(
                r.probs.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                runs[0].probs.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{tag}"
            );
            assert_eq!(
                r.logits.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                runs[0].logits.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{tag}"
            );
            // Against the dense executor (which keeps written K/V in f32): within bf16's
            // rounding of what this step wrote and read back.
            for (i, (&a, &b)) in r.hidden.iter().zip(&want.hidden_out).enumerate() {
                let a = from_act_bits(a, act);
                assert!((a - b).abs() <= 3e-2 * (1.0 + b.abs()), "{tag}: hidden[{i}] {a} vs {b}");
            }
            for (i, (&a, &b)) in r.logits.iter().zip(&want.logits).enumerate() {
                assert!((a - b).abs() <= 3e-2 * (1.0 + b.abs()), "{tag}: logits[{i}] {a} vs {b}");
            }
            for (i, (&a, &b)) in r.probs.iter().zip(&want.topk_probs).enumerate() {
                assert!((a - b).abs() <= 2e-2, "{tag}: topk_p[{i}] {a} vs {b}");
            }
            // Written K/V: each request's N new positions hold the dense run's values
            // (rounded); every other element is the case's original or the filler.
            let (hh, d, p) = (plan.model.kv_heads as u64, plan.model.head_dim as u64, page as u64);
            let n = plan.spec.num_draft_tokens as usize;
            let per_layer = c.used_pages * (p * hh * d) as usize;
            let mut written = std::collections::HashSet::new();
            for i in 0..c.b {
                for j in 0..n {
                    let pos = c.step.prefix_lens[i] as usize + j;
                    let t = c.pages[i][pos / page as usize] as u64 * p + (pos % page as usize) as u64;
                    written.insert(t);
                }
            }
            for layer in 0..plan.model.layers as usize {
                for t in 0..c.used_pages as u64 * p {
                    for g in 0..hh {
                        for e in 0..d {
                            let dense = ((t * hh + g) * d + e) as usize;
                            for (v, orig, dense_pool) in [(false, &c.k0, &pool.k), (true, &c.v0, &pool.v)] {
                                let got = read_back(&plan, &r.pools, layer, v, t, g, e);
                                if written.contains(&t) {
                                    let want = dense_pool[layer][dense];
                                    let want_r = specplan_runtime::bits::round_act(want, act);
                                    let what = if v { "V" } else { "K" };
                                    // Layer 0's K/V do not depend on this step's rounded
                                    // cache reads: exact. Later layers read them back.
                                    if layer == 0 {
                                        assert_eq!(got, want_r, "{tag}: layer 0 {what} slot {t} head {g} [{e}]");
                                    } else {
                                        assert!(
                                            (got - want).abs() <= 3e-2 * (1.0 + want.abs()),
                                            "{tag}: layer {layer} {what} slot {t} head {g} [{e}]: {got} vs {want}"
                                        );
                                    }
                                } else {
                                    let o = from_act_bits(orig[layer * per_layer + dense], act);
                                    assert_eq!(got.to_bits(), o.to_bits(), "{tag}: unwritten slot {t} changed");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_refused_request_writes_nothing_and_has_zero_outputs() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s ^ 0x5a5a);
    let plan = plan(4, "topk,logits");
    let w = random_weights(&plan, &mut rng);
    let hw = host_weights(&plan, &w);
    let c = make_case(&plan, &mut rng, 3, 9);
    let good = run_layout(&plan, &hw, &c, Layout::VllmNhd, &c.step.accept_lens);
    let mut accept = c.step.accept_lens.clone();
    accept[1] = plan.spec.num_draft_tokens as i32 + 1;
    let bad = run_layout(&plan, &hw, &c, Layout::VllmNhd, &accept);
    let e = bad.error.as_ref().expect("request 1 is refused");
    assert_eq!((e.count, e.request, e.rule), (1, 1, Some(DeviceRule::Accept)));
    let (k, h) = (plan.spec.topk as usize, plan.model.hidden as usize);
    let cols = signature::logits_cols(&plan) as usize;
    // Request 1's rows are zeros; the others equal the run without the refusal.
    assert!(bad.hidden[h..2 * h]
        .iter()
        .all(|&x| from_act_bits(x, plan.capture.dtype) == 0.0));
    assert!(bad.logits[cols..2 * cols].iter().all(|&x| x == 0.0));
    assert!(bad.probs[k..2 * k].iter().all(|&x| x == 0.0) && bad.ids[k..2 * k].iter().all(|&x| x == 0));
    for i in [0usize, 2] {
        assert_eq!(bad.hidden[i * h..(i + 1) * h], good.hidden[i * h..(i + 1) * h]);
        assert_eq!(bad.ids[i * k..(i + 1) * k], good.ids[i * k..(i + 1) * k]);
    }
    // Request 1's new positions keep the case's values.
    let (hh, d, p) = (plan.model.kv_heads as u64, plan.model.head_dim as u64, 4u64);
    let per_layer = c.used_pages * (p * hh * d) as usize;
    for j in 0..plan.spec.num_draft_tokens as usize {
        let pos = c.step.prefix_lens[1] as usize + j;
        let t = c.pages[1][pos / 4] as u64 * p + (pos % 4) as u64;
        for layer in 0..plan.model.layers as usize {
            let got = read_back(&plan, &bad.pools, layer, false, t, 0, 0);
            let o = from_act_bits(c.k0[layer * per_layer + (t * hh * d) as usize], plan.capture.dtype);
            assert_eq!(got.to_bits(), o.to_bits(), "refused request 1 wrote slot {t}");
        }
    }
}

/// Prefixes and select indices near the i64 limits are refused (prefix, accept), never an
/// overflow: the engine reads what a caller passes as plain i64s.
#[test]
fn integers_near_the_i64_limits_are_refused_not_overflowed() {
    let mut rng = Rng(seed() ^ 0x7e57);
    let plan = plan(4, "topk");
    let w = random_weights(&plan, &mut rng);
    let hw = host_weights(&plan, &w);
    let c = make_case(&plan, &mut rng, 3, 9);
    let mut pools = pools(&plan, c.used_pages, &c.k0, &c.v0, Layout::VllmNhd);
    let (mut eng, _table) = layout_engine(&plan, &hw, &c, Layout::VllmNhd, &mut pools);
    let (k, h, n) = (
        plan.spec.topk as usize,
        plan.model.hidden as usize,
        plan.spec.num_draft_tokens as i64,
    );
    let req: Vec<i64> = (0..3).collect();
    let good_sel: Vec<i64> = (0..3).map(|i| i * n).collect();
    let prefix: Vec<i64> = c.step.prefix_lens.iter().map(|&l| l as i64 + n).collect();
    let cases = [
        (
            "prefix i64::MAX",
            vec![prefix[0], i64::MAX, prefix[2]],
            good_sel.clone(),
            -(n as i32),
            DeviceRule::Prefix,
        ),
        (
            "prefix i64::MIN, bias -N",
            vec![prefix[0], i64::MIN, prefix[2]],
            good_sel.clone(),
            -(n as i32),
            DeviceRule::Prefix,
        ),
        (
            "prefix i64::MAX, bias +1",
            vec![prefix[0] - n - 1, i64::MAX, prefix[2] - n - 1],
            good_sel.clone(),
            1,
            DeviceRule::Prefix,
        ),
        (
            "prefix i64::MAX - 1, bias 0 (its sum with N wraps)",
            vec![prefix[0] - n, i64::MAX - 1, prefix[2] - n],
            good_sel.clone(),
            0,
            DeviceRule::Prefix,
        ),
        (
            "select index i64::MIN",
            prefix.clone(),
            vec![0, i64::MIN, 2 * n],
            -(n as i32),
            DeviceRule::Accept,
        ),
    ];
    for (what, pre, sel, bias, rule) in cases {
        let (mut probs, mut ids, mut hidden) = (vec![0f32; 3 * k], vec![0i64; 3 * k], vec![0u16; 3 * h]);
        let step = HostStep {
            input_ids: Ints::I64(&c.step.input_ids),
            hidden: &c.hidden_bits,
            req: Ints::I64(&req),
            prefix: Ints::I64(&pre),
            accept: Ints::I64(&sel),
            accept_form: AcceptForm::SelectRows,
            prefix_bias: bias,
        };
        let mut o = HostOutputs {
            topk_p: Some(&mut probs[..]),
            topk_index: Some(&mut ids[..]),
            hidden: Some(&mut hidden[..]),
            logits: None,
        };
        eng.step(&step, &mut o).unwrap_or_else(|e| panic!("{what}: {e}"));
        let e = eng.last_error().unwrap_or_else(|| panic!("{what}: not refused"));
        assert_eq!((e.request, e.rule), (1, Some(rule)), "{what}: {e}");
    }
}

/// The aliasing rule and the non-finite flag in the CPU engine (the device's `admit` and
/// `emit` twins): a request whose prefix page is a page another request writes is refused
/// naming that request; one whose row names its own write page twice names itself; one
/// whose finite inputs overflow in the forward is flagged, its outputs left as computed.
/// Both table kinds (token slots, page ids).
#[test]
fn aliasing_and_non_finite_outputs_are_reported_by_request() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s ^ 0xa11a5);
    let plan = plan(4, "topk,logits");
    let w = random_weights(&plan, &mut rng);
    let hw = host_weights(&plan, &w);
    let n = plan.spec.num_draft_tokens as usize;
    // Request 1 needs a whole prefix page (entry 0 of its row is then only read) and a
    // second page to write in.
    let c = (0..256)
        .map(|_| make_case(&plan, &mut rng, 3, 12))
        .find(|c| c.step.prefix_lens[1] >= 4 && c.pages[1].len() >= 2)
        .expect("a case whose request 1 has a full prefix page");
    for layout in [Layout::SglangNhd, Layout::VllmNhd] {
        let clean = run_layout(&plan, &hw, &c, layout, &c.step.accept_lens);
        assert_eq!(clean.error, None, "{layout:?}: a case without aliasing");
        // Another request's write page as request 1's first (prefix) page.
        let mut x = c.clone();
        let l0 = x.step.prefix_lens[0] as usize;
        x.pages[1][0] = x.pages[0][l0 / 4];
        let r = run_layout(&plan, &hw, &x, layout, &x.step.accept_lens);
        let e = r.error.as_ref().expect("request 1 reads request 0's new slot");
        assert_eq!(
            (e.count, e.request, e.rule, e.other),
            (1, 1, Some(DeviceRule::Alias), Some(0)),
            "{layout:?}: {e}"
        );
        assert!(e.to_string().contains("with request 0"), "{e}");
        let h = plan.model.hidden as usize;
        assert!(
            r.hidden[h..2 * h].iter().all(|&b| b == 0),
            "a refused request's outputs are zeros"
        );
        // Its own write page as its first page: two positions share a slot.
        let mut x = c.clone();
        let l1 = x.step.prefix_lens[1] as usize;
        x.pages[1][0] = x.pages[1][(l1 + n - 1) / 4];
        let r = run_layout(&plan, &hw, &x, layout, &x.step.accept_lens);
        let e = r.error.as_ref().expect("request 1 reads its own new slot");
        assert_eq!(
            (e.request, e.rule, e.other),
            (1, Some(DeviceRule::Alias), Some(1)),
            "{e}"
        );
        // Finite hidden states at 90% of bf16's largest value overflow in the forward.
        let mut x = c.clone();
        let per = n * plan.model.hidden_in() as usize;
        let big = specplan_runtime::bits::to_act_bits(&[0.9 * half::bf16::MAX.to_f32()], plan.capture.dtype)[0];
        x.hidden_bits[2 * per..3 * per].iter_mut().for_each(|b| *b = big);
        let r = run_layout(&plan, &hw, &x, layout, &x.step.accept_lens);
        let e = r.error.as_ref().expect("request 2's outputs are not finite");
        assert_eq!(
            (e.count, e.request, e.rule),
            (1, 2, Some(DeviceRule::NonFinite)),
            "{layout:?}: {e}"
        );
        assert_eq!(
            r.hidden[..2 * h],
            clean.hidden[..2 * h],
            "the other requests are unaffected"
        );
    }
}

/// A prefix position the attention reads whose table entry names no slot of the pool (a
/// page past it) is refused by rule `Slot`, which `admit` finds in its aliasing walk: the
/// attention would read that key as zeros and the outputs would be silently wrong. With a
/// sliding window only the positions some layer reads are checked: the same hole before
/// the window is admitted.
#[test]
fn a_prefix_entry_outside_the_pool_is_refused_where_a_layer_reads_it() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s ^ 0x401e);
    for (w, layout) in [
        (None, Layout::SglangNhd),
        (None, Layout::VllmNhd),
        (Some(6), Layout::VllmHnd),
    ] {
        let plan = windowed_plan(4, "topk", w);
        let wts = random_weights(&plan, &mut rng);
        let hw = host_weights(&plan, &wts);
        // Request 1 needs a prefix of 9 or more: page 0 then lies before a 6-token window
        // (L − 6 + 1 > 3) and its last whole prefix page, ⌊L/4⌋ − 1 ≥ 1, inside it.
        let c = (0..512)
            .map(|_| make_case(&plan, &mut rng, 3, 24))
            .find(|c| c.step.prefix_lens[1] >= 9)
            .expect("a case whose request 1 has two full prefix pages");
        let clean = run_layout(&plan, &hw, &c, layout, &c.step.accept_lens);
        assert_eq!(clean.error, None, "{layout:?}: a case without holes");
        let past_pool = c.used_pages as i32 + 3;
        let l1 = c.step.prefix_lens[1] as usize;
        // Its last whole prefix page (no new position in it: rules 1-6 pass): every layer
        // reads it.
        let mut x = c.clone();
        x.pages[1][l1 / 4 - 1] = past_pool;
        let r = run_layout(&plan, &hw, &x, layout, &x.step.accept_lens);
        let e = r.error.as_ref().expect("request 1 reads a key outside the pool");
        assert_eq!(
            (e.count, e.request, e.rule),
            (1, 1, Some(DeviceRule::Slot)),
            "{layout:?} window {w:?}: {e}"
        );
        let h = plan.model.hidden as usize;
        assert!(
            r.hidden[h..2 * h].iter().all(|&b| b == 0),
            "a refused request's outputs are zeros"
        );
        assert_eq!(r.hidden[..h], clean.hidden[..h], "request 0 is unaffected");
        // Page 0: read without a window, not with one.
        let mut x = c.clone();
        x.pages[1][0] = past_pool;
        let r = run_layout(&plan, &hw, &x, layout, &x.step.accept_lens);
        match w {
            None => {
                let e = r.error.as_ref().expect("request 1 reads position 0");
                assert_eq!((e.request, e.rule), (1, Some(DeviceRule::Slot)), "{layout:?}: {e}");
            }
            Some(_) => {
                assert_eq!(r.error, None, "{layout:?}: a hole no layer reads is admitted");
                assert_eq!(r.hidden, clean.hidden, "and changes no output");
            }
        }
    }
}
