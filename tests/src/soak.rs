//! The soak: thousands of random steps on one runtime (random batch sizes across the buckets
//! and above the largest, random prefix and accept lengths). Every step runs as a graph
//! replay and eagerly from the same cache and must be bit-identical, and must leave every
//! cache element outside its written slots as it was; every `sample_every`-th step is also
//! checked against the CPU executor (`checks::check_case`). Device memory must not grow:
//! free memory is read after a warm-up step at the largest batch (which sizes the runtime's
//! chunk buffers) and again at the end.

use cudarc::driver::result;
use specplan_format::PhaseKind;
use specplan_format::ValidatedPlan;
use specplan_runtime::gpu::{GpuOptions, GpuRuntime, Hidden, StepRequest};

use crate::checks::check_case;
use crate::random::{make_case, random_weights};
use crate::reference::written_mask;
use crate::tolerance::{bit_diffs, f32_bit_diffs};
use crate::Rng;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SoakReport {
    pub plan: String,
    pub steps: usize,
    /// Steps whose bucket replays a graph (the rest are eager: chunked batches).
    pub graph_steps: usize,
    pub chunked_steps: usize,
    pub graph_vs_eager_diffs: usize,
    pub untouched_changed: usize,
    pub sampled: usize,
    pub worst_hidden_rel: f64,
    /// The sampled steps' numerics pooled (`numerics::Numerics::max`): the probability
    /// target is asserted over them, not per step.
    pub numerics: crate::numerics::Numerics,
    pub free_bytes_after_warmup: u64,
    pub free_bytes_at_end: u64,
    pub seconds: f64,
    pub failures: Vec<String>,
}

fn g<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn free_bytes() -> Result<u64, String> {
    result::mem_get_info()
        .map(|(free, _)| free as u64)
        .map_err(|e| format!("{e:?}"))
}

/// Runs `steps` random steps of `plan`; a failure is recorded (the first few kept), the
/// soak goes on.
pub fn soak(plan: &ValidatedPlan, rng: &mut Rng, steps: usize, sample_every: usize) -> Result<SoakReport, String> {
    let t0 = std::time::Instant::now();
    let weights = random_weights(plan, rng);
    let mut rt = GpuRuntime::new(plan.clone(), &weights, GpuOptions::default()).map_err(g)?;
    let max_b = plan.buckets().last().map_or(1, |b| b.batch as usize);
    let top = (plan.capture.max_requests as usize).min(max_b + max_b / 2 + 3).max(1);
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let max_prefix = (plan.capture.max_context_len as usize).saturating_sub(n).min(400);
    // Request pages of the pool (the last one is the scratch page).
    let (pool_pages, ps) = (
        (rt.pool_pages() as usize).saturating_sub(1),
        plan.capture.page_size as usize,
    );
    // The longest prefix such that b requests always fit those pages (at worst each takes
    // ceil((prefix + N) / page) of them).
    let fit = |b: usize| (pool_pages / b.max(1) * ps).saturating_sub(n).min(max_prefix);
    let mut rep = SoakReport {
        plan: plan.name.clone(),
        ..SoakReport::default()
    };
    // Warm-up at the largest batch: the runtime allocates its chunk buffer once here.
    let c = make_case(plan, rng, top, fit(top));
    check_case(plan, &mut rt, &weights, &c)?;
    rt.synchronize().map_err(g)?;
    rep.free_bytes_after_warmup = free_bytes()?;
    for step in 0..steps {
        let b = 1 + rng.below(top);
        let longest = rng.below(fit(b) + 1);
        let c = make_case(plan, rng, b, longest);
        if b > max_b {
            rep.chunked_steps += 1;
        } else if plan
            .bucket_for(b as u32)
            .is_some_and(|x| x.replay == specplan_format::Replay::Graph)
        {
            rep.graph_steps += 1;
        }
        if sample_every > 0 && step % sample_every == 0 {
            let r = check_case(plan, &mut rt, &weights, &c)?;
            rep.sampled += 1;
            rep.worst_hidden_rel = rep.worst_hidden_rel.max(r.hidden_rel);
            rep.numerics = std::mem::take(&mut rep.numerics).max(r.numerics.clone());
            rep.graph_vs_eager_diffs += r.graph_vs_eager_diff;
            rep.untouched_changed += r.kv_untouched_changed;
            if !r.ok && rep.failures.len() < 8 {
                rep.failures.push(format!("step {step}: {}", r.failures.join("; ")));
            }
            rep.steps += 1;
            continue;
        }
        for (i, &s) in c.slots.iter().enumerate() {
            rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
        }
        let req = StepRequest {
            slots: &c.slots,
            input_ids: &c.step.input_ids,
            hidden: Hidden::Host(&c.hidden_bits),
            prefix_lens: &c.step.prefix_lens,
            accept_lens: &c.step.accept_lens,
        };
        let mut run = |eager: bool| -> Result<_, String> {
            rt.write_kv(&c.k0, &c.v0, c.used_pages).map_err(g)?;
            rt.poison().map_err(g)?;
            rt.step(&req, eager).map_err(g)?;
            let out = rt.read_outputs().map_err(g)?;
            let (kk, vv) = rt.read_kv(c.used_pages).map_err(g)?;
            Ok((out, kk, vv))
        };
        let (og, kg, vg) = run(false)?;
        let (oe, ke, ve) = run(true)?;
        let diffs = bit_diffs(&og.hidden_out, &oe.hidden_out)
            + f32_bit_diffs(&og.topk_probs, &oe.topk_probs)
            + bit_diffs(&og.topk_ids, &oe.topk_ids)
            + bit_diffs(&kg, &ke)
            + bit_diffs(&vg, &ve);
        let written = written_mask(plan, &c);
        let per_layer = written.len();
        let mut changed = 0;
        for (got, init) in [(&kg, &c.k0), (&vg, &c.v0)] {
            for layer in 0..plan.model.layers as usize {
                for (idx, &w) in written.iter().enumerate() {
                    let at = layer * per_layer + idx;
                    if !w && got.get(at) != init.get(at) {
                        changed += 1;
                    }
                }
            }
        }
        rep.graph_vs_eager_diffs += diffs;
        rep.untouched_changed += changed;
        if (diffs > 0 || changed > 0) && rep.failures.len() < 8 {
            rep.failures.push(format!(
                "step {step} (b {b}): graph vs eager {diffs} values differ, {changed} cache values outside the written slots changed"
            ));
        }
        rep.steps += 1;
    }
    if let Some(f) = rep.numerics.probability_failure(plan) {
        rep.failures.push(f);
    }
    rt.synchronize().map_err(g)?;
    let left = rt.counters_left().map_err(g)?;
    if left > 0 {
        rep.failures
            .push(format!("{left} arrival counters left nonzero after the soak"));
    }
    rep.free_bytes_at_end = free_bytes()?;
    if rep.free_bytes_at_end < rep.free_bytes_after_warmup {
        rep.failures.push(format!(
            "device memory grew by {} bytes over the soak",
            rep.free_bytes_after_warmup - rep.free_bytes_at_end
        ));
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    Ok(rep)
}
