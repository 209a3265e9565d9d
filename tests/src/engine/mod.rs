//! The engine-memory check: an engine-like pool, page table and weights allocated here in
//! each layout the engines use ([`Layout`]: SGLang's NHD and HND token pools with a
//! token-slot `req_to_token`, vLLM 0.33's packed `[.., 2·D]` layer tensors, NHD and HND,
//! with a block table), rows in scattered order, device inputs, a stream of its own. A step
//! in engine memory must equal the same step in owned memory bit for bit (the logits too,
//! for a plan that emits them), change exactly the N new slots of each real request (no
//! other byte of the caller's allocations), leave the table alone, not synchronize, and
//! refuse a bad request (writing nothing for it: no K/V; its output rows zeros) while
//! computing the others.
//! Each case replays its runtime three times with fresh input and output tensors and both
//! integer conventions (the replay path after the first launch), and checks that a good
//! step after a bad one reports nothing. Weight views at 16-byte offsets (a slice of a
//! fused tensor) take GEMM algorithms chosen for that alignment.

use std::time::Instant;

use cudarc::driver::result;
use specplan_format::PhaseKind;
use specplan_format::ValidatedPlan;
use specplan_runtime::cpu::WeightData;
use specplan_runtime::gpu::{
    AcceptForm, DeviceInts, DeviceOutputs, DeviceRule, DeviceStep, EngineMemory, GemmPolicy, GpuOptions, GpuRuntime,
    Hidden, StepRequest,
};
use specplan_runtime::step::StepInputs;

use crate::gpu::DeviceBuf;
use crate::random::{make_case, Case};
use crate::tolerance::{bit_diffs, f32_bit_diffs};
use crate::Rng;

mod bench;
mod decode;
mod fixture;

pub use bench::{
    bench_fixture, engine_load_ms, engine_once, load_record, memory_file, AddedMemory, BenchFixture,
    ENGINE_MEMORY_BOUND,
};
pub use decode::{engine_decode_check, DecodeEngineReport};
pub use fixture::Layout;
use fixture::{download, err, fixture, Fixture};

/// What one engine step produced, read back.
pub(crate) struct Outputs {
    probs: Vec<f32>,
    ids: Vec<i64>,
    hidden: Vec<u16>,
    logits: Vec<f32>,
}

/// How a step passes its integer inputs. `Sglang`: i64 ids, i64 request rows, i64
/// `seq_lens` (prefix + N) with bias −N, i32 accept lengths; `Plain`: i64 ids, i32 rows, i32
/// prefix lengths with bias 0, i64 accept lengths; `Vllm`: i32 ids, i64 rows (`idx_mapping`),
/// i32 `seq_lens` with bias −N, and the selected rows `r·N + A − 1` (`last_token_indices`,
/// i64) instead of accept lengths; `Wide`: every integer i64 (ids, rows, prefix lengths with
/// bias 0, accept lengths), one request's prefix replaced where it holds one (a value the
/// narrower forms cannot pass: near the i64 limits).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ints {
    Sglang,
    Plain,
    Vllm,
    Wide(Option<(usize, i64)>),
}

/// The table entry (page or token) of a request with prefix `l` that holds prefix positions
/// only, the last whole one, when some layer may read it (`format::read_window`): a hole
/// there passes rules 1-6 (no new position or lane shares it) and is found by admission's
/// aliasing walk.
pub(crate) fn read_hole(plan: &ValidatedPlan, l: usize, blocks: bool) -> Option<usize> {
    let ps = plan.capture.page_size as usize;
    let whole = if blocks { l / ps } else { l };
    let end = if blocks { whole * ps } else { whole };
    let window = specplan_format::read_window(plan.layers.iter().map(|x| x.window)) as usize;
    let read_from = if window > 0 { (l + 1).saturating_sub(window) } else { 0 };
    (whole >= 1 && end > read_from).then(|| whole - 1)
}

/// One engine step on fresh device copies of `x`'s inputs (outputs filled with 0xff first).
/// Returns the outputs, the host time of `step_device` and whether the stream was still
/// busy when it returned (with `busy`, a long memset queued ahead of the step).
pub(crate) fn engine_step(
    rt: &mut GpuRuntime,
    x: &StepInputs,
    hidden: &[u16],
    rows: &[i64],
    ints: Ints,
    stream: u64,
    busy: Option<&DeviceBuf>,
) -> Result<(Outputs, f64, bool), String> {
    let plan = rt.plan().clone();
    let (n, k, h) = (
        plan.rows_per_request(PhaseKind::DraftExtend) as i64,
        plan.spec.topk as usize,
        plan.model.hidden as usize,
    );
    let b = x.batch;
    let outs_of = plan.capture.outputs;
    let k = if outs_of.topk { k } else { 0 };
    let cols = if outs_of.logits {
        specplan_format::signature::logits_cols(&plan) as usize
    } else {
        0
    };
    let ins = match ints {
        Ints::Sglang => {
            let seq: Vec<i64> = x.prefix_lens.iter().map(|&l| l as i64 + n).collect();
            [
                DeviceBuf::from_slice(rows)?,
                DeviceBuf::from_slice(&seq)?,
                DeviceBuf::from_slice(&x.accept_lens)?,
            ]
        }
        Ints::Plain => {
            let rows32: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            let acc64: Vec<i64> = x.accept_lens.iter().map(|&a| a as i64).collect();
            [
                DeviceBuf::from_slice(&rows32)?,
                DeviceBuf::from_slice(&x.prefix_lens)?,
                DeviceBuf::from_slice(&acc64)?,
            ]
        }
        Ints::Wide(bad_prefix) => {
            let mut pre: Vec<i64> = x.prefix_lens.iter().map(|&l| l as i64).collect();
            if let Some((at, v)) = bad_prefix {
                *pre.get_mut(at).ok_or("the replaced prefix is past the batch")? = v;
            }
            let acc64: Vec<i64> = x.accept_lens.iter().map(|&a| a as i64).collect();
            [
                DeviceBuf::from_slice(rows)?,
                DeviceBuf::from_slice(&pre)?,
                DeviceBuf::from_slice(&acc64)?,
            ]
        }
        Ints::Vllm => {
            let seq: Vec<i32> = x.prefix_lens.iter().map(|&l| l + n as i32).collect();
            let sel: Vec<i64> = x
                .accept_lens
                .iter()
                .enumerate()
                .map(|(i, &a)| i as i64 * n + a as i64 - 1)
                .collect();
            [
                DeviceBuf::from_slice(rows)?,
                DeviceBuf::from_slice(&seq)?,
                DeviceBuf::from_slice(&sel)?,
            ]
        }
    };
    let ids = if ints == Ints::Vllm {
        let ids32: Vec<i32> = x.input_ids.iter().map(|&t| t as i32).collect();
        DeviceBuf::from_slice(&ids32)?
    } else {
        DeviceBuf::from_slice(&x.input_ids)?
    };
    let hid = DeviceBuf::from_slice(hidden)?;
    let sized = |bytes: usize| DeviceBuf::new(bytes.max(16));
    let outs = [
        sized(b * k * 4)?,
        sized(b * k * 8)?,
        sized(b * h * 2)?,
        sized(b * cols * 4)?,
    ];
    for o in &outs {
        o.fill(0xff, std::ptr::null_mut())?;
    }
    let sglang = ints == Ints::Sglang;
    let step = DeviceStep {
        b,
        input_ids: ids.ptr,
        ids_i32: ints == Ints::Vllm,
        hidden_states: hid.ptr,
        req_pool_indices: DeviceInts {
            ptr: ins[0].ptr,
            i32: ints == Ints::Plain,
        },
        prefix_lens: DeviceInts {
            ptr: ins[1].ptr,
            i32: matches!(ints, Ints::Plain | Ints::Vllm),
        },
        accept_lens: DeviceInts {
            ptr: ins[2].ptr,
            i32: sglang,
        },
        accept_form: if ints == Ints::Vllm {
            AcceptForm::SelectRows
        } else {
            AcceptForm::Lengths
        },
        prefix_bias: if matches!(ints, Ints::Plain | Ints::Wide(_)) {
            0
        } else {
            -(n as i32)
        },
        outputs: DeviceOutputs {
            topk_p: if k > 0 { outs[0].ptr } else { 0 },
            topk_index: if k > 0 { outs[1].ptr } else { 0 },
            hidden_states: outs[2].ptr,
            logits: if cols > 0 { outs[3].ptr } else { 0 },
        },
        stream,
    };
    // A barrier before the step, so the uploads above are done.
    result::ctx::synchronize().map_err(|e| format!("{e:?}"))?;
    if let Some(busy) = busy {
        // A long memset ahead of the step on the same stream (several ms): a step that
        // synchronized or copied to the host would wait for it.
        for _ in 0..3 {
            busy.fill(0x5a, stream as _)?;
        }
    }
    let t0 = Instant::now();
    rt.step_device(&step).map_err(err)?;
    let host_us = t0.elapsed().as_secs_f64() * 1e6;
    // SAFETY: the caller's stream; querying has no preconditions.
    let pending = unsafe { cudarc::driver::sys::cuStreamQuery(stream as _) }
        == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY;
    // SAFETY: as above.
    unsafe { result::stream::synchronize(stream as _) }.map_err(|e| format!("{e:?}"))?;
    Ok((
        Outputs {
            probs: download(outs[0].ptr, b * k)?,
            ids: download(outs[1].ptr, b * k)?,
            hidden: download(outs[2].ptr, b * h)?,
            logits: download(outs[3].ptr, b * cols)?,
        },
        host_us,
        pending,
    ))
}

/// Result of one engine case.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct EngineReport {
    pub layout: &'static str,
    pub b: usize,
    /// Weights given as views 16 bytes into their allocations (compared within
    /// tolerances: their GEMM algorithms differ from owned memory's).
    pub weight_views: bool,
    /// The engine runtime built no graphs: every step issued eagerly (outputs still equal
    /// owned memory's graphs bitwise: same kernels, same GEMM algorithms).
    pub eager: bool,
    pub steps: usize,
    pub output_diffs: usize,
    /// Largest relative RMS error of the hidden states against owned memory (views only).
    pub hidden_rel: f64,
    pub refused_rows_written: usize,
    pub kv_written_diffs: usize,
    pub kv_unwritten_changed: usize,
    pub table_changed: usize,
    pub host_us: f64,
    pub pending_after_step: bool,
    pub refused: Vec<String>,
    pub failures: Vec<String>,
}

/// The pool's elements (per layer, slot-major) the real requests' new positions own.
fn written_slots(plan: &ValidatedPlan, c: &Case, skip: Option<usize>) -> Vec<bool> {
    let ps = plan.capture.page_size as usize;
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let slot = (plan.model.kv_heads * plan.model.head_dim) as usize;
    let mut w = vec![false; c.used_pages * ps * slot];
    for i in (0..c.b).filter(|&i| Some(i) != skip) {
        for j in 0..n {
            let p = c.step.prefix_lens[i] as usize + j;
            let t = c.pages[i][p / ps] as usize * ps + p % ps;
            w[t * slot..(t + 1) * slot].iter_mut().for_each(|x| *x = true);
        }
    }
    w
}

/// One step of a case: what the engine is given, how, and which request it must refuse.
struct StepCase<'a> {
    x: &'a StepInputs,
    /// The hidden states the engine is given (the case's, or a bad request's overflowing).
    hidden: &'a [u16],
    ints: Ints,
    bad: Option<(usize, DeviceRule)>,
    busy: Option<&'a DeviceBuf>,
}

/// Compares one engine step with the owned reference `oo` / `(ok_, ov)` of the valid case.
#[allow(clippy::too_many_arguments)]
fn check_step(
    plan: &ValidatedPlan,
    eng: &mut GpuRuntime,
    fx: &Fixture,
    c: &Case,
    s: &StepCase,
    oo: &specplan_runtime::gpu::HostOutputs,
    owned_kv: (&[u16], &[u16]),
    stream: u64,
    views: bool,
    rep: &mut EngineReport,
) -> Result<(), String> {
    let h = plan.model.hidden as usize;
    let k = if plan.capture.outputs.topk {
        plan.spec.topk as usize
    } else {
        0
    };
    let cols = if plan.capture.outputs.logits {
        specplan_format::signature::logits_cols(plan) as usize
    } else {
        0
    };
    fx.restore()?;
    let (eo, host_us, pending) = engine_step(eng, s.x, s.hidden, &fx.rows, s.ints, stream, s.busy)?;
    rep.steps += 1;
    if s.busy.is_some() {
        rep.host_us = host_us;
        rep.pending_after_step = pending;
        if !pending {
            rep.failures
                .push("the stream was idle right after the step returned: it synchronized".into());
        }
    }
    let skip = s.bad.map(|b| b.0);
    // A request flagged for non-finite outputs ran: its K/V were written and its outputs
    // are as computed (they must hold a non-finite value, or the flag is wrong).
    let flagged = matches!(s.bad, Some((_, DeviceRule::NonFinite)));
    for i in 0..c.b {
        let (pr, ir, hr) = (i * k..(i + 1) * k, i * k..(i + 1) * k, i * h..(i + 1) * h);
        let lr = i * cols..(i + 1) * cols;
        if Some(i) == skip && flagged {
            let act = plan.capture.dtype;
            let non_finite = eo.probs[pr].iter().any(|p| !p.is_finite())
                || eo.hidden[hr]
                    .iter()
                    .any(|&x| !specplan_runtime::bits::from_act_bits(x, act).is_finite())
                || eo.logits[lr].iter().any(|p| !p.is_finite());
            if !non_finite {
                rep.failures.push(format!(
                    "step {}: request {i}'s overflowing inputs gave finite outputs (the case does not test the flag)",
                    rep.steps
                ));
            }
        } else if Some(i) == skip {
            // A refused request's output rows are zeros (never a stale row).
            rep.refused_rows_written += eo.probs[pr].iter().filter(|p| p.to_bits() != 0).count()
                + eo.ids[ir].iter().filter(|&&x| x != 0).count()
                + eo.hidden[hr].iter().filter(|&&x| x != 0).count()
                + eo.logits[lr].iter().filter(|p| p.to_bits() != 0).count();
        } else if views {
            let g: Vec<f64> = eo.hidden[hr.clone()]
                .iter()
                .map(|&x| specplan_runtime::bits::from_act_bits(x, plan.capture.dtype) as f64)
                .collect();
            let w: Vec<f64> = oo.hidden_out[hr]
                .iter()
                .map(|&x| specplan_runtime::bits::from_act_bits(x, plan.capture.dtype) as f64)
                .collect();
            rep.hidden_rel = rep.hidden_rel.max(crate::tolerance::rel_rms(&g, &w));
            let bad_p = eo.probs[pr.clone()]
                .iter()
                .zip(&oo.topk_probs[pr.clone()])
                .filter(|(g, w)| !crate::tolerance::prob_close(**g as f64, **w as f64, 2e-2, 2e-3))
                .count();
            let bad_ids = crate::tolerance::id_mismatches(
                &eo.ids[ir.clone()],
                &oo.topk_ids[ir],
                &eo.probs[pr.clone()],
                &oo.topk_probs[pr],
                2e-3,
            )
            .len();
            let g: Vec<f64> = eo.logits[lr.clone()].iter().map(|&x| x as f64).collect();
            let w: Vec<f64> = oo.logits[lr].iter().map(|&x| x as f64).collect();
            let bad_l = (crate::tolerance::rel_rms(&g, &w) > 1e-2) as usize;
            rep.output_diffs += bad_p + bad_ids + bad_l;
        } else {
            rep.output_diffs += f32_bit_diffs(&eo.probs[pr.clone()], &oo.topk_probs[pr])
                + bit_diffs(&eo.ids[ir.clone()], &oo.topk_ids[ir])
                + bit_diffs(&eo.hidden[hr.clone()], &oo.hidden_out[hr])
                + f32_bit_diffs(&eo.logits[lr.clone()], &oo.logits[lr]);
        }
    }
    // The caller's pool: written slots equal the owned pool's (bitwise, or within the
    // activation's rounding for views); every other element kept.
    let written = written_slots(plan, c, skip);
    // The flagged request's slots hold what its overflowing forward wrote: neither
    // compared nor required unchanged.
    let ignored = match (flagged, skip) {
        (true, Some(_)) => {
            let all = written_slots(plan, c, None);
            all.iter().zip(&written).map(|(a, w)| *a && !*w).collect()
        }
        _ => vec![false; written.len()],
    };
    let per = written.len();
    for l in 0..plan.model.layers as usize {
        let (gk, gv, stray) = fx.read_layer(l, plan)?;
        // Bytes of the allocation outside the geometry's K and V (none written).
        rep.kv_unwritten_changed += stray;
        for (got, init, owned) in [
            (&gk, &fx.k0[l], &owned_kv.0[l * per..(l + 1) * per]),
            (&gv, &fx.v0[l], &owned_kv.1[l * per..(l + 1) * per]),
        ] {
            for e in 0..per {
                if ignored[e] {
                    continue;
                }
                if written[e] {
                    let differs = if views {
                        let (g, w) = (
                            specplan_runtime::bits::from_act_bits(got[e], plan.capture.dtype),
                            specplan_runtime::bits::from_act_bits(owned[e], plan.capture.dtype),
                        );
                        (g - w).abs() > 2e-2 * w.abs() + 2e-2 || !g.is_finite()
                    } else {
                        got[e] != owned[e]
                    };
                    rep.kv_written_diffs += differs as usize;
                } else {
                    rep.kv_unwritten_changed += (got[e] != init[e]) as usize;
                }
            }
        }
    }
    let table: Vec<i32> = download(fx.table.ptr, fx.table_host.len())?;
    rep.table_changed += bit_diffs(&table, &fx.table_host);
    let reported = eng.last_error().map_err(err)?;
    match (s.bad, &reported) {
        (None, None) => {}
        (None, Some(e)) => rep.failures.push(format!(
            "step {}: no bad request, but the device reported: {e}",
            rep.steps
        )),
        // An alias case's reader names request 0, whose new slot it reads.
        (Some((i, rule)), Some(e))
            if e.request == i as u64
                && e.rule == Some(rule)
                && e.count == 1
                && e.other == (rule == DeviceRule::Alias).then_some(0) =>
        {
            rep.refused
                .push(format!("request {i}: {rule:?} refused and reported ({e})"))
        }
        (Some((i, rule)), got) => rep.failures.push(format!(
            "step {}: request {i} broke {rule:?}, the device reported {got:?}",
            rep.steps
        )),
    }
    Ok(())
}

/// Runs case `c` in owned memory (the valid requests), then engine steps on one runtime:
/// `engine_x` (with its bad request, if any) in SGLang's integers with a busy stream,
/// `engine_x` again in plain integers with fresh tensors, and the valid case in SGLang's,
/// vLLM's and wide integers. A `Prefix` case's bad request is made in wide integers instead
/// (i64::MAX − 1, whose sum with N wraps an i64, and i64::MIN), values no other form carries.
#[allow(clippy::too_many_arguments)]
fn compare(
    plan: &ValidatedPlan,
    eng: &mut GpuRuntime,
    own: &mut GpuRuntime,
    fx: &mut Fixture,
    c: &Case,
    engine_x: &StepInputs,
    engine_hidden: &[u16],
    bad: Option<(usize, DeviceRule)>,
    views: bool,
    stream: u64,
    rep: &mut EngineReport,
) -> Result<(), String> {
    for (i, &s) in c.slots.iter().enumerate() {
        own.set_pages(s as usize, &c.pages[i]).map_err(err)?;
    }
    own.write_kv(&c.k0, &c.v0, c.used_pages).map_err(err)?;
    own.poison().map_err(err)?;
    let req = StepRequest {
        slots: &c.slots,
        input_ids: &c.step.input_ids,
        hidden: Hidden::Host(&c.hidden_bits),
        prefix_lens: &c.step.prefix_lens,
        accept_lens: &c.step.accept_lens,
    };
    own.step(&req, false).map_err(err)?;
    let oo = own.read_outputs().map_err(err)?;
    let (ok_, ov) = own.read_kv(c.used_pages).map_err(err)?;
    let busy = DeviceBuf::new(4 << 30)?;
    let (bad_ints, bad_ints_again) = match bad {
        Some((at, DeviceRule::Prefix)) => (Ints::Wide(Some((at, i64::MAX - 1))), Ints::Wide(Some((at, i64::MIN)))),
        _ => (Ints::Sglang, Ints::Plain),
    };
    let steps = [
        StepCase {
            x: engine_x,
            hidden: engine_hidden,
            ints: bad_ints,
            bad,
            busy: Some(&busy),
        },
        StepCase {
            x: engine_x,
            hidden: engine_hidden,
            ints: bad_ints_again,
            bad,
            busy: None,
        },
        StepCase {
            x: &c.step,
            hidden: &c.hidden_bits,
            ints: Ints::Sglang,
            bad: None,
            busy: None,
        },
        // vLLM's integers: i32 ids, selected rows instead of accept lengths.
        StepCase {
            x: &c.step,
            hidden: &c.hidden_bits,
            ints: Ints::Vllm,
            bad: None,
            busy: None,
        },
        StepCase {
            x: &c.step,
            hidden: &c.hidden_bits,
            ints: Ints::Wide(None),
            bad: None,
            busy: None,
        },
    ];
    for s in &steps {
        if s.bad.is_none() {
            fx.restore_table()?;
        }
        check_step(plan, eng, fx, c, s, &oo, (&ok_, &ov), stream, views, rep)?;
    }
    for (what, count) in [
        ("output values differ from owned memory", rep.output_diffs),
        ("output values written for refused requests", rep.refused_rows_written),
        ("written K/V values differ from owned memory", rep.kv_written_diffs),
        (
            "pool values outside the written slots changed",
            rep.kv_unwritten_changed,
        ),
        ("page-table entries changed", rep.table_changed),
    ] {
        if count > 0 {
            rep.failures.push(format!("{count} {what}"));
        }
    }
    if views && rep.hidden_rel > 1e-2 {
        rep.failures.push(format!(
            "hidden states rel {:.2e} against owned memory (bound 1e-2)",
            rep.hidden_rel
        ));
    }
    Ok(())
}

/// One engine case: `b` requests, the request at `bad.0` breaking `bad.1`, weights as views,
/// the engine runtime without graphs (`eager`).
struct EngineCase {
    b: usize,
    bad: Option<(usize, DeviceRule)>,
    views: bool,
    eager: bool,
    /// A `Slot` case's hole is a prefix position the attention reads (its last whole prefix
    /// page or token), not a new position.
    read_hole: bool,
}

/// The engine-memory check on one plan: good steps at several batch sizes (padding, chunks),
/// one step per bad-request rule (one of them in a later chunk), weights given as views.
/// `layout`: the engine's K/V layout and table. Both runtimes take cuBLASLt's first
/// heuristic choice, so equal shapes and alignments get equal algorithms.
pub fn engine_check(plan: &ValidatedPlan, rng: &mut Rng, layout: Layout) -> Result<Vec<EngineReport>, String> {
    let blocks = layout.blocks();
    let weights = crate::random::random_weights(plan, rng);
    let opts = || GpuOptions {
        gemms: GemmPolicy::Heuristic,
        ..GpuOptions::default()
    };
    let mut own = GpuRuntime::new(plan.clone(), &weights, opts()).map_err(err)?;
    let max_b = plan.buckets().last().map_or(1, |b| b.batch as usize);
    let mut reports = Vec::new();
    let case = |b, bad, views| EngineCase {
        b,
        bad,
        views,
        eager: false,
        read_hole: false,
    };
    let mut cases = vec![case(1, None, false), case(3, None, false), case(max_b, None, false)];
    if max_b + 3 <= plan.capture.max_requests as usize {
        cases.push(case(max_b + 3, None, false));
        // A bad request in the second chunk is reported by its index in the whole batch.
        cases.push(case(max_b + 3, Some((max_b + 1, DeviceRule::Accept)), false));
    }
    cases.extend([
        case(4, Some((1, DeviceRule::Accept)), false),
        case(4, Some((1, DeviceRule::Row)), false),
        case(4, Some((1, DeviceRule::Prefix)), false),
        case(4, Some((1, DeviceRule::Slot)), false),
        EngineCase {
            read_hole: true,
            ..case(4, Some((1, DeviceRule::Slot)), false)
        },
        case(4, Some((1, DeviceRule::Alias)), false),
        case(4, Some((2, DeviceRule::NonFinite)), false),
        case(3, None, true),
        // Eager steps (no graph): the end-of-step event is recorded by the host, and a
        // refusal must still be reported.
        EngineCase {
            eager: true,
            ..case(4, Some((1, DeviceRule::Accept)), false)
        },
    ]);
    let ps = plan.capture.page_size as usize;
    for ec in cases {
        let mut c = make_case(plan, rng, ec.b, 60);
        // The alias case reads a whole table entry of its prefix: the request needs a
        // prefix covering entry 0 (one token slot, or one page of ps). The read-hole case
        // needs a whole prefix entry some layer reads (`read_hole`).
        let cover = if blocks { ps } else { 1 };
        let usable = |c: &Case, at: usize| {
            let l = c.step.prefix_lens[at] as usize;
            if ec.read_hole {
                read_hole(plan, l, blocks).is_some()
            } else {
                l >= cover
            }
        };
        if let Some((at, rule)) = ec.bad.filter(|&(_, r)| r == DeviceRule::Alias || ec.read_hole) {
            for _ in 0..64 {
                if usable(&c, at) {
                    break;
                }
                c = make_case(plan, rng, ec.b, 60.max(2 * cover));
            }
            if !usable(&c, at) {
                return Err(format!(
                    "no {rule:?} case with a usable prefix found (read hole: {})",
                    ec.read_hole
                ));
            }
        }
        let mut fx = fixture(plan, &c, &weights, layout, ec.views, rng)?;
        let mem = EngineMemory {
            kv: fx.kv.clone(),
            table: fx.table.clone(),
            weights: &fx.weights,
        };
        // The engine runtimes' graphs carry L2 prefetch branches (they change no value: the
        // owned reference has none), so engine memory's capture with them is checked too.
        let eng_opts = GpuOptions {
            build_graphs: !ec.eager,
            l2_prefetch: crate::l2_branch::CHECKED,
            ..opts()
        };
        let mut eng = GpuRuntime::with_engine_memory(plan.clone(), mem, eng_opts).map_err(err)?;
        let stream = eng.context().new_stream().map_err(|e| format!("{e:?}"))?;
        let mut x = c.step.clone();
        if let Some((at, rule)) = ec.bad {
            match rule {
                DeviceRule::Accept => x.accept_lens[at] = 0,
                // Positions past the end of the row (the plan's own bound still holds).
                DeviceRule::Row => {
                    x.prefix_lens[at] = (fx.table.cols * if blocks { plan.capture.page_size as u64 } else { 1 }) as i32
                }
                DeviceRule::Slot => {
                    // The request's first new position names a slot past the pool; or, a
                    // read hole, its last whole prefix page (token) does: no new position
                    // is in it, so rules 1-6 pass and admit's aliasing walk finds it.
                    let l = x.prefix_lens[at] as usize;
                    let ps = plan.capture.page_size as usize;
                    let entry = match (ec.read_hole, blocks) {
                        (false, true) => l / ps,
                        (false, false) => l,
                        (true, _) => read_hole(plan, l, blocks).ok_or("no read-hole entry")?,
                    };
                    let e = fx.rows[at] as usize * fx.table.stride as usize + entry;
                    fx.table_host[e] = (fx.kv.geom.slots / if blocks { ps as u64 } else { 1 }) as i32 + 7;
                    // SAFETY: one entry inside the table allocation; synchronous.
                    unsafe { result::memcpy_htod_sync(fx.table.ptr + e as u64 * 4, &fx.table_host[e..e + 1]) }
                        .map_err(|e| format!("{e:?}"))?;
                    // Landed before the step's stream (non-blocking) reads the table.
                    result::ctx::synchronize().map_err(|e| format!("{e:?}"))?;
                }
                DeviceRule::Alias => {
                    // Entry 0 of the request's row (a prefix position it reads) names the
                    // slot, or page, of request 0's first new position.
                    let per = |p: usize| if blocks { p / ps } else { p };
                    let stride = fx.table.stride as usize;
                    let w = fx.rows[0] as usize * stride + per(x.prefix_lens[0] as usize);
                    let e = fx.rows[at] as usize * stride;
                    fx.table_host[e] = fx.table_host[w];
                    // SAFETY: one entry inside the table allocation; synchronous.
                    unsafe { result::memcpy_htod_sync(fx.table.ptr + e as u64 * 4, &fx.table_host[e..e + 1]) }
                        .map_err(|e| format!("{e:?}"))?;
                    // Landed before the step's stream (non-blocking) reads the table.
                    result::ctx::synchronize().map_err(|e| format!("{e:?}"))?;
                }
                // Hidden states at 90% of the activation type's largest value: finite
                // inputs whose forward overflows (set below).
                DeviceRule::NonFinite => {}
                // Given in wide integers by `compare`: engine_x keeps its valid prefix.
                DeviceRule::Prefix => {}
                other => return Err(format!("no engine case breaks {other:?}")),
            }
        }
        let mut engine_hidden = c.hidden_bits.clone();
        if let Some((at, DeviceRule::NonFinite)) = ec.bad {
            let act = plan.capture.dtype;
            let big = match act {
                specplan_format::DType::F16 => 0.9 * half::f16::MAX.to_f32(),
                _ => 0.9 * half::bf16::MAX.to_f32(),
            };
            // Each value signed as fc's row 0 weighs it, so fc's first output is at least
            // `big · Σ|w|` (several times the type's maximum: inf) whatever the random
            // weights: the request's outputs are then certainly not finite.
            let hin = plan.model.hidden_in() as usize;
            let (fc, fc_w) = plan
                .weights
                .iter()
                .zip(&weights)
                .find(|(d, _)| d.name == "fc.weight")
                .ok_or("the plan has no fc.weight")?;
            let WeightData::F32(fc_w) = fc_w else {
                return Err("fc.weight is not a float weight".into());
            };
            let cols = fc.shape[1] as usize;
            let off = cols - hin; // EAGLE-1: [embed ‖ hidden]; EAGLE-3: hidden alone
            let signed: Vec<f32> = (0..hin).map(|i| if fc_w[off + i] < 0.0 { -big } else { big }).collect();
            let bits = specplan_runtime::bits::to_act_bits(&signed, act);
            let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
            for row in engine_hidden[at * n * hin..(at + 1) * n * hin].chunks_mut(hin) {
                row.copy_from_slice(&bits);
            }
        }
        let mut rep = EngineReport {
            layout: layout.name(),
            b: ec.b,
            weight_views: ec.views,
            eager: ec.eager,
            ..EngineReport::default()
        };
        compare(
            plan,
            &mut eng,
            &mut own,
            &mut fx,
            &c,
            &x,
            &engine_hidden,
            ec.bad,
            ec.views,
            stream.cu_stream() as u64,
            &mut rep,
        )?;
        reports.push(rep);
    }
    Ok(reports)
}
