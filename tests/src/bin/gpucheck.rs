//! GPU correctness check: every plan in a folder, replayed on the GPU as a graph and
//! eagerly, against the CPU reference executor, on fresh random weights and inputs.
//!
//! Usage: `gpucheck PLAN_DIR OUT_DIR [--quick]`. Prints SKIP and exits 0 where there is no
//! CUDA driver. Exits 1 when any check fails. Writes `OUT_DIR/gpucheck.json`.
//!
//! Per plan and batch size b (bucket sizes and sizes in between, so padding is exercised):
//! - outputs are poisoned (0xFF) before every run;
//! - graph vs CPU: hidden_out relative error ≤ 1e-2, identical top-K ids wherever the
//!   reference probabilities of neighbours differ by more than 1e-3, probabilities within
//!   1e-2·p + 1e-4, written K/V within bf16 rounding of the reference;
//! - graph == eager bitwise (outputs and the whole cache);
//! - every cache slot no request writes is bit-identical to before (padding included),
//!   and padded rows wrote only the scratch page.

use std::process::ExitCode;
use std::time::Instant;

use specplan_format::{load_file, ValidatedPlan};
use specplan_runtime::cpu::{CpuExecutor, KvPool, WeightData};
use specplan_runtime::gpu::{GpuOptions, GpuRuntime, Hidden, StepRequest};
use specplan_runtime::step::{pad_to_bucket, PageTable, StepInputs};
use specplan_tests::{seed, Rng};

fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}
fn act_bits(x: f32, is_f16: bool) -> u16 {
    if is_f16 {
        half::f16::from_f32(x).to_bits()
    } else {
        bf16_bits(x)
    }
}
fn from_bits(b: u16, is_f16: bool) -> f32 {
    if is_f16 {
        half::f16::from_bits(b).to_f32()
    } else {
        half::bf16::from_bits(b).to_f32()
    }
}

/// Random packed weights for every plan weight (scaled so activations stay O(1)).
fn random_weights(plan: &ValidatedPlan, rng: &mut Rng) -> Vec<WeightData> {
    let vocab = plan.model.vocab as usize;
    let is_f16 = plan.capture.dtype == specplan_format::DType::F16;
    plan.weights
        .iter()
        .map(|w| {
            let n: u64 = w.shape.iter().product();
            if w.name == "hot_token_ids" {
                let mut p = rng.permutation(vocab);
                p.truncate(n as usize);
                return WeightData::I64(p.into_iter().map(|x| x as i64).collect());
            }
            let cols = w.shape.get(1).copied().unwrap_or(1) as f32;
            let norm = w.shape.len() == 1 && !w.name.contains("bias");
            let scale = if w.name.contains("embed") {
                1.0
            } else if w.name.contains("lm_head") {
                4.0 / cols.sqrt()
            } else if w.shape.len() == 1 {
                0.1
            } else {
                1.0 / cols.sqrt()
            };
            let v = (0..n)
                .map(|_| {
                    let x = if norm {
                        1.0 + 0.2 * rng.uniform()
                    } else {
                        rng.uniform() * scale
                    };
                    from_bits(act_bits(x, is_f16), is_f16)
                })
                .collect();
            WeightData::F32(v)
        })
        .collect()
}

struct Case {
    b: usize,
    slots: Vec<i32>,
    pages: Vec<Vec<i32>>,
    used_pages: usize,
    step: StepInputs,
    hidden_bits: Vec<u16>,
    k0: Vec<u16>,
    v0: Vec<u16>,
}

fn make_case(plan: &ValidatedPlan, rng: &mut Rng, b: usize, max_prefix: usize) -> Case {
    let n = plan.spec.num_draft_tokens as usize;
    let h = plan.model.hidden as usize;
    let ps = plan.capture.page_size as usize;
    let prefix: Vec<i32> = (0..b).map(|_| rng.below(max_prefix + 1) as i32).collect();
    let need: Vec<usize> = prefix.iter().map(|&l| (l as usize + n).div_ceil(ps)).collect();
    let used_pages: usize = need.iter().sum();
    let perm = rng.permutation(used_pages);
    let mut next = 0;
    let pages: Vec<Vec<i32>> = need
        .iter()
        .map(|&c| {
            let v = perm[next..next + c].iter().map(|&p| p as i32).collect();
            next += c;
            v
        })
        .collect();
    let slots: Vec<i32> = rng.permutation(plan.capture.max_requests as usize)[..b]
        .iter()
        .map(|&s| s as i32)
        .collect();
    let cols = need.iter().copied().max().unwrap_or(1);
    let mut table = vec![0i32; b * cols];
    for i in 0..b {
        table[i * cols..i * cols + pages[i].len()].copy_from_slice(&pages[i]);
    }
    let is_f16 = plan.capture.dtype == specplan_format::DType::F16;
    let hidden: Vec<f32> = (0..b * n * h)
        .map(|_| from_bits(act_bits(rng.uniform(), is_f16), is_f16))
        .collect();
    let per = used_pages * plan.kv_page_bytes() as usize / 2 * plan.model.layers as usize;
    let rand_bits = |rng: &mut Rng| (0..per).map(|_| act_bits(rng.uniform(), is_f16)).collect::<Vec<u16>>();
    let (k0, v0) = (rand_bits(rng), rand_bits(rng));
    let step = StepInputs {
        batch: b,
        input_ids: (0..b * n)
            .map(|_| rng.below(plan.model.vocab as usize) as i64)
            .collect(),
        hidden_states: hidden.clone(),
        prefix_lens: prefix,
        accept_lens: (0..b).map(|_| 1 + rng.below(n) as i32).collect(),
        page_table: table,
        page_cols: cols,
    };
    let hidden_bits = hidden.iter().map(|&x| act_bits(x, is_f16)).collect();
    Case {
        b,
        slots,
        pages,
        used_pages,
        step,
        hidden_bits,
        k0,
        v0,
    }
}

#[derive(Default, Debug)]
struct Errors {
    hidden_rel: f64,
    prob_abs: f64,
    id_mismatch: usize,
    kv_rel: f64,
    kv_untouched_changed: usize,
    graph_vs_eager_diff: usize,
    failures: Vec<String>,
}

fn check_case(plan: &ValidatedPlan, rt: &mut GpuRuntime, weights: &[WeightData], c: &Case) -> Result<Errors, String> {
    let n = plan.spec.num_draft_tokens as usize;
    let h = plan.model.hidden as usize;
    let k = plan.spec.topk as usize;
    let is_f16 = plan.capture.dtype == specplan_format::DType::F16;
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
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
    let mut run = |eager: bool| -> Result<(_, Vec<u16>, Vec<u16>), String> {
        rt.write_kv(&c.k0, &c.v0, c.used_pages).map_err(g)?;
        rt.poison().map_err(g)?;
        let info = rt.step(&req, eager).map_err(g)?;
        let out = rt.read_outputs().map_err(g)?;
        let (kk, vv) = rt.read_kv(c.used_pages).map_err(g)?;
        if !eager
            && !info.graph
            && plan
                .bucket_for(c.b as u32)
                .is_some_and(|b| b.replay == specplan_format::Replay::Graph)
        {
            return Err(format!("b={}: expected a graph replay", c.b));
        }
        Ok((out, kk, vv))
    };
    let (og, kg, vg) = run(false)?;
    let (oe, ke, ve) = run(true)?;
    let mut e = Errors::default();
    let diff = |a: &[u16], b: &[u16]| a.iter().zip(b).filter(|(x, y)| x != y).count();
    e.graph_vs_eager_diff = diff(&og.hidden_out, &oe.hidden_out)
        + og.topk_probs
            .iter()
            .zip(&oe.topk_probs)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count()
        + og.topk_ids.iter().zip(&oe.topk_ids).filter(|(a, b)| a != b).count()
        + diff(&kg, &ke)
        + diff(&vg, &ve);

    // CPU reference on the same inputs, pages and initial cache.
    let per_layer = c.used_pages * plan.kv_page_bytes() as usize / 2;
    let scratch_cpu = c.used_pages;
    let to_pool = |bits: &[u16]| -> Vec<Vec<f32>> {
        bits.chunks_exact(per_layer)
            .map(|l| {
                let mut v: Vec<f32> = l.iter().map(|&x| from_bits(x, is_f16)).collect();
                v.extend(std::iter::repeat_n(0.0, plan.kv_page_bytes() as usize / 2));
                v
            })
            .collect()
    };
    let mut pool = KvPool {
        pages: c.used_pages + 1,
        k: to_pool(&c.k0),
        v: to_pool(&c.v0),
    };
    let mut table = PageTable::new(plan, scratch_cpu as i32);
    for (i, &s) in c.slots.iter().enumerate() {
        table.set_row(s as usize, &c.pages[i]);
    }
    // Batches above the largest bucket run as chunks of at most that size, in order; the
    // reference does the same (requests are independent, so chunking changes nothing).
    let exec = CpuExecutor::new(plan, weights.to_vec()).map_err(|e| e.to_string())?;
    let max_b = plan.buckets.last().map_or(1, |x| x.batch as usize);
    let (kk, hh) = (plan.spec.topk as usize, plan.model.hidden as usize);
    let mut r = specplan_runtime::cpu::BucketOutputs {
        hidden_out: vec![],
        topk_probs: vec![],
        topk_ids: vec![],
    };
    for start in (0..c.b).step_by(max_b) {
        let end = (start + max_b).min(c.b);
        let x = &c.step;
        let chunk = StepInputs {
            batch: end - start,
            input_ids: x.input_ids[start * n..end * n].to_vec(),
            hidden_states: x.hidden_states[start * n * hh..end * n * hh].to_vec(),
            prefix_lens: x.prefix_lens[start..end].to_vec(),
            accept_lens: x.accept_lens[start..end].to_vec(),
            page_table: x.page_table[start * x.page_cols..end * x.page_cols].to_vec(),
            page_cols: x.page_cols,
        };
        let bucket = plan.bucket_for((end - start) as u32).ok_or("no bucket")?;
        let padded = pad_to_bucket(plan, bucket, &chunk, &c.slots[start..end], table.scratch_slot());
        let o = exec
            .run(bucket, &padded, &table, &mut pool)
            .map_err(|e| e.to_string())?;
        r.hidden_out.extend_from_slice(&o.hidden_out[..(end - start) * hh]);
        r.topk_probs.extend_from_slice(&o.topk_probs[..(end - start) * kk]);
        r.topk_ids.extend_from_slice(&o.topk_ids[..(end - start) * kk]);
    }

    for i in 0..c.b {
        let (mut num, mut den) = (0f64, 0f64);
        for col in 0..h {
            let got = from_bits(og.hidden_out[i * h + col], is_f16) as f64;
            let want = r.hidden_out[i * h + col] as f64;
            if !got.is_finite() {
                e.failures
                    .push(format!("b={} req {i}: hidden_out[{col}] is {got}", c.b));
                break;
            }
            num += (got - want).powi(2);
            den += want.powi(2);
        }
        e.hidden_rel = e.hidden_rel.max((num / den.max(1e-30)).sqrt());
        for s in 0..k {
            let want_p = r.topk_probs[i * k + s] as f64;
            let got_p = og.topk_probs[i * k + s] as f64;
            e.prob_abs = e.prob_abs.max((got_p - want_p).abs());
            if (got_p - want_p).abs() > 1e-2 * want_p + 1e-4 || !got_p.is_finite() {
                e.failures
                    .push(format!("b={} req {i} slot {s}: prob {got_p} vs {want_p}", c.b));
            }
            let prev = if s > 0 {
                r.topk_probs[i * k + s - 1] as f64 - want_p
            } else {
                1.0
            };
            // The last slot's rival is the (K+1)-th candidate, which the reference does not
            // list: there a different id is a tie when the GPU's probability for it is within
            // 1e-3 of the reference's K-th.
            let next = if s + 1 < k {
                want_p - r.topk_probs[i * k + s + 1] as f64
            } else if (got_p - want_p).abs() <= 1e-3 {
                0.0
            } else {
                1.0
            };
            if prev > 1e-3 && next > 1e-3 && og.topk_ids[i * k + s] != r.topk_ids[i * k + s] {
                e.id_mismatch += 1;
                e.failures.push(format!(
                    "b={} req {i} slot {s}: id {} vs {} (p = {want_p:.5})",
                    c.b,
                    og.topk_ids[i * k + s],
                    r.topk_ids[i * k + s]
                ));
            }
        }
    }
    if e.hidden_rel > 1e-2 {
        e.failures.push(format!(
            "b={}: hidden_out relative error {:.3e} > 1e-2",
            c.b, e.hidden_rel
        ));
    }
    // Cache: slots written by real requests vs the reference (bf16 of it); everything else
    // bit-identical to the initial contents.
    let written = {
        let mut w = vec![false; per_layer];
        let ps = plan.capture.page_size as usize;
        let row = plan.model.kv_heads as usize * plan.model.head_dim as usize;
        for i in 0..c.b {
            for j in 0..n {
                let pos = c.step.prefix_lens[i] as usize + j;
                let at = (c.pages[i][pos / ps] as usize * ps + pos % ps) * row;
                w[at..at + row].iter_mut().for_each(|x| *x = true);
            }
        }
        w
    };
    // Written slots: relative RMS error per (K|V, layer) against the f32 reference, with
    // the same 1e-2 bound as hidden_out (deeper layers inherit the bf16 rounding of every
    // activation before them, so elementwise equality after rounding holds only for the
    // first layer's inputs). Unwritten slots: bit-identical to the initial cache.
    for (which, got, init, refp) in [("k", &kg, &c.k0, &pool.k), ("v", &vg, &c.v0, &pool.v)] {
        for (layer, refl) in refp.iter().enumerate() {
            let (mut num, mut den) = (0f64, 0f64);
            for idx in 0..per_layer {
                let gi = layer * per_layer + idx;
                if written[idx] {
                    let (gv, wv) = (from_bits(got[gi], is_f16) as f64, refl[idx] as f64);
                    num += (gv - wv).powi(2);
                    den += wv.powi(2);
                } else if got[gi] != init[gi] {
                    e.kv_untouched_changed += 1;
                }
            }
            let rel = (num / den.max(1e-30)).sqrt();
            e.kv_rel = e.kv_rel.max(rel);
            if rel > 1e-2 || rel.is_nan() {
                e.failures.push(format!(
                    "b={} {which}_cache layer {layer}: written slots relative error {rel:.3e}",
                    c.b
                ));
            }
        }
    }
    if e.kv_untouched_changed > 0 {
        e.failures.push(format!(
            "b={}: {} cache elements outside the written slots changed",
            c.b, e.kv_untouched_changed
        ));
    }
    if e.graph_vs_eager_diff > 0 {
        e.failures.push(format!(
            "b={}: graph and eager differ in {} values",
            c.b, e.graph_vs_eager_diff
        ));
    }
    e.failures.truncate(12);
    Ok(e)
}

/// The attention kernels alone (attn_partial, and attn_merge when the bucket splits), on
/// random q and cache contents with long prefixes: layer 0's launches are replayed over
/// buffers this check writes, and the output is compared with an f64 softmax attention
/// computed here from the same bf16/fp16 values. Returns (relative RMS error, max abs error
/// / output RMS).
fn attention_check(
    plan: &ValidatedPlan,
    rt: &mut GpuRuntime,
    rng: &mut Rng,
    b: usize,
    max_prefix: usize,
) -> Result<(f64, f64), String> {
    use specplan_format::io;
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    let is_f16 = plan.capture.dtype == specplan_format::DType::F16;
    let bucket = plan.bucket_for(b as u32).ok_or("no bucket")?.batch;
    let (n, ps) = (plan.spec.num_draft_tokens as usize, plan.capture.page_size as usize);
    let (hq, hkv, d) = (
        plan.model.heads as usize,
        plan.model.kv_heads as usize,
        plan.model.head_dim as usize,
    );
    let group = hq / hkv;
    let window = plan.layers.first().and_then(|l| l.window).map(|w| w as usize);
    let c = make_case(plan, rng, b, max_prefix);
    for (i, &s) in c.slots.iter().enumerate() {
        rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
    }
    rt.write_kv(&c.k0, &c.v0, c.used_pages).map_err(g)?;
    let bu = bucket as usize;
    let ints = |v: Vec<i32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut prefix = c.step.prefix_lens.clone();
    prefix.resize(bu, 0);
    let mut slots = c.slots.clone();
    slots.resize(bu, plan.capture.max_requests as i32); // padding rows: the scratch slot
    rt.write_buffer(bucket, io::PREFIX_LENS, &ints(prefix)).map_err(g)?;
    rt.write_buffer(bucket, io::REQ_SLOTS, &ints(slots)).map_err(g)?;
    // The NaN poison goes in before q: when the bucket splits, l0.qkv (last read by
    // attn_partial) and l0.attn (first written by attn_merge) have disjoint live ranges and
    // may share arena bytes, and the poison must not overwrite q.
    let (_, out_bytes) = rt.buffer_ptr(bucket, "l0.attn").ok_or("no l0.attn buffer")?;
    rt.write_buffer(bucket, "l0.attn", &vec![0xffu8; out_bytes])
        .map_err(g)?; // NaN poison
    let (_, qkv_bytes) = rt.buffer_ptr(bucket, "l0.qkv").ok_or("no l0.qkv buffer")?;
    let stride = qkv_bytes / 2 / (bu * n);
    let q: Vec<u16> = (0..qkv_bytes / 2).map(|_| act_bits(rng.uniform(), is_f16)).collect();
    rt.write_buffer(
        bucket,
        "l0.qkv",
        &q.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .map_err(g)?;
    rt.replay_only(bucket, Some("l0.attention")).map_err(g)?;
    let raw = rt.read_buffer(bucket, "l0.attn").map_err(g)?;
    let got: Vec<f32> = raw
        .chunks_exact(2)
        .map(|x| from_bits(u16::from_le_bytes([x[0], x[1]]), is_f16))
        .collect();
    let (kc, vc) = rt.read_kv(c.used_pages).map_err(g)?; // layer 0 comes first
    let kv_at = |page: i32, pos: usize, head: usize| ((page as usize * ps + pos % ps) * hkv + head) * d;
    let scale = 1.0 / (d as f64).sqrt();
    let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
    let (mut logits, mut acc) = (Vec::new(), vec![0f64; d]);
    for i in 0..b {
        let l = c.step.prefix_lens[i] as usize;
        for j in 0..n {
            let qpos = l + j;
            let start = window.map_or(0, |w| (qpos + 1).saturating_sub(w));
            for h in 0..hq {
                let kvh = h / group;
                let qrow = &q[(i * n + j) * stride + h * d..][..d];
                logits.clear();
                for p in start..=qpos {
                    let at = kv_at(c.pages[i][p / ps], p, kvh);
                    let dot: f64 = (0..d)
                        .map(|e| from_bits(qrow[e], is_f16) as f64 * from_bits(kc[at + e], is_f16) as f64)
                        .sum();
                    logits.push(dot * scale);
                }
                let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = w.iter().sum();
                acc.iter_mut().for_each(|x| *x = 0.0);
                for (t, p) in (start..=qpos).enumerate() {
                    let at = kv_at(c.pages[i][p / ps], p, kvh);
                    for (e, a) in acc.iter_mut().enumerate() {
                        *a += w[t] * from_bits(vc[at + e], is_f16) as f64;
                    }
                }
                for (e, &a) in acc.iter().enumerate() {
                    let want = a / sum;
                    let have = got[(i * n + j) * hq * d + h * d + e] as f64;
                    if !have.is_finite() {
                        return Err(format!(
                            "b={b}: attention output row {} head {h} dim {e} is {have}",
                            i * n + j
                        ));
                    }
                    num += (have - want).powi(2);
                    den += want.powi(2);
                    max_abs = max_abs.max((have - want).abs());
                }
            }
        }
    }
    let rms = (den / (b * n * hq * d) as f64).sqrt();
    Ok(((num / den.max(1e-30)).sqrt(), max_abs / rms.max(1e-30)))
}

/// Median replay time of a bucket's graph with CUDA events, µs (after warm-up).
fn replay_us(
    rt: &mut GpuRuntime,
    plan: &ValidatedPlan,
    rng: &mut Rng,
    b: usize,
    prefix: usize,
) -> Result<(f64, f64), String> {
    let c = make_case(plan, rng, b, prefix);
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    for (i, &s) in c.slots.iter().enumerate() {
        rt.set_pages(s as usize, &c.pages[i]).map_err(g)?;
    }
    // The hidden states come from the device, as an engine passes the target model's.
    let bytes = c.hidden_bits.len() * 2;
    // SAFETY: a plain allocation, freed below; the upload is synchronous.
    let dev = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(|e| format!("{e:?}"))?;
    // SAFETY: `dev` holds exactly `bytes` bytes.
    unsafe { cudarc::driver::result::memcpy_htod_sync(dev, &c.hidden_bits) }.map_err(|e| format!("{e:?}"))?;
    let req = StepRequest {
        slots: &c.slots,
        input_ids: &c.step.input_ids,
        hidden: Hidden::Device(dev),
        prefix_lens: &c.step.prefix_lens,
        accept_lens: &c.step.accept_lens,
    };
    let r = time_steps(rt, &req);
    rt.synchronize().map_err(g)?;
    // SAFETY: allocated above, no longer used (the stream is idle).
    let _ = unsafe { cudarc::driver::result::free_sync(dev) };
    r
}

fn time_steps(rt: &mut GpuRuntime, req: &StepRequest) -> Result<(f64, f64), String> {
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    use cudarc::driver::result::event;
    use cudarc::driver::sys::CUevent_flags;
    let start = event::create(CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("{e:?}"))?;
    let end = event::create(CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("{e:?}"))?;
    for _ in 0..20 {
        rt.step(req, false).map_err(g)?;
    }
    rt.synchronize().map_err(g)?;
    let mut times = Vec::new();
    let mut preps = Vec::new();
    let stream = rt.stream().cu_stream();
    for _ in 0..200 {
        // SAFETY: live events on the runtime's stream.
        unsafe { event::record(start, stream) }.map_err(|e| format!("{e:?}"))?;
        let info = rt.step(req, false).map_err(g)?;
        // SAFETY: as above.
        unsafe { event::record(end, stream) }.map_err(|e| format!("{e:?}"))?;
        // SAFETY: as above; waiting here is the benchmark, not the replay path.
        unsafe { event::synchronize(end) }.map_err(|e| format!("{e:?}"))?;
        // SAFETY: both events recorded and complete.
        times.push(unsafe { event::elapsed(start, end) }.map_err(|e| format!("{e:?}"))? as f64 * 1e3);
        preps.push(info.prep_us);
    }
    times.sort_by(f64::total_cmp);
    preps.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], preps[preps.len() / 2]))
}

/// Writes a plan's weights and one step's inputs as the `run` contract's safetensors files.
fn write_contract_files(plan: &ValidatedPlan, rng: &mut Rng, dir: &std::path::Path, b: usize) -> Result<(), String> {
    use safetensors::tensor::{Dtype, TensorView};
    let weights = random_weights(plan, rng);
    let bf = |v: &[f32]| {
        v.iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    // Unpack the plan's packed weights back into the file tensors they came from.
    let m = &plan.model;
    let mut files: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (w, d) in plan.weights.iter().zip(&weights) {
        match (d, &w.packing) {
            (WeightData::I64(ids), _) => files.push((
                w.name.clone(),
                Dtype::I64,
                vec![ids.len()],
                ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )),
            (WeightData::F32(v), specplan_format::Packing::Single) => files.push((
                w.sources[0].clone(),
                Dtype::BF16,
                w.shape.iter().map(|&x| x as usize).collect(),
                bf(v),
            )),
            (WeightData::F32(v), specplan_format::Packing::ConcatRows) => {
                let cols = w.shape[1] as usize;
                let mut row = 0;
                for src in &w.sources {
                    let rows = if src.contains("q_proj") {
                        (m.heads * m.head_dim) as usize
                    } else if src.contains("k_proj") || src.contains("v_proj") {
                        (m.kv_heads * m.head_dim) as usize
                    } else {
                        m.intermediate as usize
                    };
                    files.push((
                        src.clone(),
                        Dtype::BF16,
                        vec![rows, cols],
                        bf(&v[row * cols..(row + rows) * cols]),
                    ));
                    row += rows;
                }
            }
            (WeightData::F32(_), specplan_format::Packing::GatherRows) => {
                return Err("the contract check uses plans without FR-Spec".into());
            }
        }
    }
    let st = |path: &std::path::Path, t: &[(String, Dtype, Vec<usize>, Vec<u8>)]| -> Result<(), String> {
        let views: Vec<(String, TensorView)> = t
            .iter()
            .map(|(n, d, s, b)| {
                TensorView::new(*d, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?;
        std::fs::write(path, safetensors::serialize(views, None).map_err(|e| e.to_string())?).map_err(|e| e.to_string())
    };
    st(&dir.join("weights.safetensors"), &files)?;
    let c = make_case(plan, rng, b, 100);
    let layers = m.layers as usize;
    let kv_shape = vec![
        layers,
        c.used_pages,
        plan.capture.page_size as usize,
        m.kv_heads as usize,
        m.head_dim as usize,
    ];
    let u16b = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let n = plan.spec.num_draft_tokens as usize;
    let inputs = vec![
        (
            "input_ids".to_string(),
            Dtype::I64,
            vec![b, n],
            c.step.input_ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        (
            "hidden_states".to_string(),
            Dtype::BF16,
            vec![b, n, m.hidden as usize],
            u16b(&c.hidden_bits),
        ),
        (
            "prefix_lens".to_string(),
            Dtype::I32,
            vec![b],
            c.step.prefix_lens.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        (
            "accept_lens".to_string(),
            Dtype::I32,
            vec![b],
            c.step.accept_lens.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        (
            "page_table".to_string(),
            Dtype::I32,
            vec![b, c.step.page_cols],
            c.step.page_table.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        ("k_cache".to_string(), Dtype::BF16, kv_shape.clone(), u16b(&c.k0)),
        ("v_cache".to_string(), Dtype::BF16, kv_shape, u16b(&c.v0)),
    ];
    st(&dir.join("inputs.safetensors"), &inputs)
}

/// `specplan run` on the CPU, the GPU graph and the GPU eagerly, on the same files.
fn contract_check(plan_path: &str, specplan: &str, dir: &str) -> Result<String, String> {
    let plan = load_file(std::path::Path::new(plan_path)).map_err(|e| e.to_string())?;
    let dir = std::path::Path::new(dir);
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut rng = Rng(seed());
    write_contract_files(&plan, &mut rng, dir, 3)?;
    let p = |n: &str| dir.join(n).to_string_lossy().into_owned();
    let mut outs = Vec::new();
    for (dev, eager, out) in [
        ("cpu", false, "cpu.safetensors"),
        ("cuda", false, "graph.safetensors"),
        ("cuda", true, "eager.safetensors"),
    ] {
        let mut args = vec!["run", "--plan", plan_path, "--device", dev];
        let (w, i, o) = (p("weights.safetensors"), p("inputs.safetensors"), p(out));
        args.extend(["--weights", &w, "--inputs", &i, "--out", &o]);
        if eager {
            args.push("--eager");
        }
        let r = std::process::Command::new(specplan)
            .args(&args)
            .output()
            .map_err(|e| e.to_string())?;
        if !r.status.success() {
            return Err(format!("specplan {args:?}: {}", String::from_utf8_lossy(&r.stderr)));
        }
        outs.push(std::fs::read(dir.join(out)).map_err(|e| e.to_string())?);
    }
    if outs[1] != outs[2] {
        return Err("graph and eager output files differ".into());
    }
    let read = |b: &[u8], name: &str| -> Result<Vec<f32>, String> {
        let st = safetensors::SafeTensors::deserialize(b).map_err(|e| e.to_string())?;
        let t = st.tensor(name).map_err(|e| e.to_string())?;
        Ok(match t.dtype() {
            safetensors::Dtype::F32 => t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            safetensors::Dtype::I64 => t
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32)
                .collect(),
            _ => t
                .data()
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    };
    let rel = |a: &[f32], b: &[f32]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    };
    let mut report = Vec::new();
    for name in ["hidden_out", "topk_probs", "k_cache", "v_cache"] {
        let (g, c) = (read(&outs[1], name)?, read(&outs[0], name)?);
        let e = rel(&g, &c);
        report.push(format!("{name} rel {e:.2e}"));
        if e > 1e-2 {
            return Err(format!("{name}: cuda vs cpu relative error {e:.3e}"));
        }
    }
    let (gi, ci) = (read(&outs[1], "topk_ids")?, read(&outs[0], "topk_ids")?);
    report.push(format!(
        "topk_ids equal {}/{}",
        gi.iter().zip(&ci).filter(|(a, b)| a == b).count(),
        gi.len()
    ));
    Ok(report.join(", "))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("contract") {
        if !GpuRuntime::available() {
            println!("SKIP: no CUDA driver or device on this machine");
            return ExitCode::SUCCESS;
        }
        if args.len() < 5 {
            eprintln!("usage: gpucheck contract PLAN SPECPLAN_BIN WORK_DIR");
            return ExitCode::from(2);
        }
        return match contract_check(&args[2], &args[3], &args[4]) {
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
    if args.len() < 3 {
        eprintln!("usage: gpucheck PLAN_DIR OUT_DIR [--quick]");
        return ExitCode::from(2);
    }
    if !GpuRuntime::available() {
        println!("SKIP: no CUDA driver or device on this machine");
        return ExitCode::SUCCESS;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let mut files: Vec<_> = match std::fs::read_dir(&args[1]) {
        Ok(d) => d
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "plan"))
            .collect(),
        Err(e) => {
            eprintln!("cannot read {}: {e}", args[1]);
            return ExitCode::from(2);
        }
    };
    files.sort();
    let mut rng = Rng(seed());
    let mut report = Vec::new();
    let mut failed = false;
    println!(
        "{:<28} {:>5} {:>6} {:>10} {:>9} {:>9} {:>8} {:>9}  verdict",
        "plan", "b", "bucket", "hidden_rel", "prob_abs", "kv_rel", "ids_bad", "g!=eager"
    );
    for f in files {
        let name = f
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let plan = match load_file(&f) {
            Ok(p) => p,
            Err(e) => {
                println!("{name}: cannot load: {e}");
                failed = true;
                continue;
            }
        };
        let weights = random_weights(&plan, &mut rng);
        let t0 = Instant::now();
        let mut rt = match GpuRuntime::new(plan.clone(), &weights, GpuOptions::default()) {
            Ok(r) => r,
            Err(e) => {
                println!("{name}: runtime: {e}");
                failed = true;
                continue;
            }
        };
        let load_ms = t0.elapsed().as_secs_f64() * 1e3;
        let buckets: Vec<u32> = plan.buckets.iter().map(|b| b.batch).collect();
        let max_b = *buckets.last().unwrap_or(&1) as usize;
        let mut bs: Vec<usize> = vec![1, 3, max_b.min(8), max_b.min(5)];
        if !quick {
            bs.push(max_b);
            if max_b > 8 {
                bs.push(max_b - 1);
                bs.push(max_b + 3);
            }
        }
        bs.sort_unstable();
        bs.dedup();
        let max_prefix = (plan.capture.max_context_len as usize - plan.spec.num_draft_tokens as usize).min(700);
        let mut cases = Vec::new();
        for &b in &bs {
            if b > plan.capture.max_requests as usize {
                continue;
            }
            let c = make_case(&plan, &mut rng, b, max_prefix);
            let bucket = plan.bucket_for(b as u32).map_or(max_b as u32, |x| x.batch);
            match check_case(&plan, &mut rt, &weights, &c) {
                Ok(e) => {
                    let ok = e.failures.is_empty();
                    failed |= !ok;
                    println!(
                        "{:<28} {:>5} {:>6} {:>10.2e} {:>9.1e} {:>9.2e} {:>8} {:>9}  {}",
                        name,
                        b,
                        bucket,
                        e.hidden_rel,
                        e.prob_abs,
                        e.kv_rel,
                        e.id_mismatch,
                        e.graph_vs_eager_diff,
                        if ok { "ok" } else { "FAIL" }
                    );
                    for f in &e.failures {
                        println!("    {f}");
                    }
                    cases.push(format!(
                        "{{\"b\":{b},\"bucket\":{bucket},\"hidden_rel\":{:e},\"prob_abs\":{:e},\"kv_rel\":{:e},\"id_mismatch\":{},\"graph_vs_eager_diff\":{},\"ok\":{ok}}}",
                        e.hidden_rel, e.prob_abs, e.kv_rel, e.id_mismatch, e.graph_vs_eager_diff
                    ));
                }
                Err(msg) => {
                    failed = true;
                    println!("{name:<28} {b:>5} {bucket:>6}  ERROR {msg}");
                }
            }
        }
        // The attention kernels alone, at long prefixes (splits, several key tiles).
        let attn_prefix = (plan.capture.max_context_len as usize - plan.spec.num_draft_tokens as usize).min(3000);
        let mut attn = Vec::new();
        for b in [1usize, 3, max_b.min(8)] {
            if b > plan.capture.max_requests as usize || plan.bucket_for(b as u32).is_none() {
                continue;
            }
            match attention_check(&plan, &mut rt, &mut rng, b, attn_prefix) {
                Ok((rel, max_rel)) => {
                    let ok = rel <= 1e-2 && max_rel <= 5e-2;
                    failed |= !ok;
                    println!(
                        "{name:<28} {b:>5} attention alone (prefix <= {attn_prefix}): rel {rel:.2e}, max abs / rms {max_rel:.2e}  {}",
                        if ok { "ok" } else { "FAIL (bounds 1e-2, 5e-2)" }
                    );
                    attn.push(format!(
                        "{{\"b\":{b},\"rel\":{rel:e},\"max_abs_over_rms\":{max_rel:e},\"ok\":{ok}}}"
                    ));
                }
                Err(msg) => {
                    failed = true;
                    println!("{name:<28} {b:>5} attention alone: ERROR {msg}");
                }
            }
        }
        let mut lat = Vec::new();
        for b in [1usize, 8, 32, 64] {
            if buckets.contains(&(b as u32)) {
                match replay_us(&mut rt, &plan, &mut rng, b, 1024.min(max_prefix)) {
                    Ok((us, prep)) => lat.push(format!(
                        "{{\"bucket\":{b},\"replay_us\":{us:.1},\"prep_us\":{prep:.2}}}"
                    )),
                    Err(e) => {
                        failed = true;
                        println!("{name}: replay timing b={b}: {e}");
                    }
                }
            }
        }
        let builds: Vec<String> = plan
            .buckets
            .iter()
            .zip(&rt.graph_build_ms)
            .map(|(b, ms)| format!("{{\"bucket\":{},\"ms\":{ms:.3}}}", b.batch))
            .collect();
        println!(
            "{name}: load+build {load_ms:.1} ms, graphs {:.1} ms total, arena {} B, kv {} B; latency {}",
            rt.graph_build_ms.iter().sum::<f64>(),
            rt.arena_bytes(),
            rt.kv_bytes(),
            lat.join(" ")
        );
        report.push(format!(
            "{{\"plan\":\"{name}\",\"load_ms\":{load_ms:.1},\"arena_bytes\":{},\"kv_bytes\":{},\"graph_build\":[{}],\"cases\":[{}],\"attention\":[{}],\"latency\":[{}]}}",
            rt.arena_bytes(),
            rt.kv_bytes(),
            builds.join(","),
            cases.join(","),
            attn.join(","),
            lat.join(",")
        ));
    }
    let json = format!("[\n{}\n]\n", report.join(",\n"));
    if let Err(e) =
        std::fs::create_dir_all(&args[2]).and_then(|_| std::fs::write(format!("{}/gpucheck.json", args[2]), json))
    {
        eprintln!("cannot write the report: {e}");
    }
    if failed {
        println!("gpucheck: FAILED");
        ExitCode::from(1)
    } else {
        println!("gpucheck: all checks passed");
        ExitCode::SUCCESS
    }
}
