//! The CPU references the GPU checks compare with: the plan's own launches on the CPU
//! executor (chunked like the GPU above the largest bucket), and a naive f64 attention.

use specplan_format::PhaseKind;
use specplan_format::ValidatedPlan;
use specplan_runtime::bits::from_act_bits;
use specplan_runtime::cpu::{BucketOutputs, CpuExecutor, KvPool, WeightData};
use specplan_runtime::step::{pad_to_bucket, PageTable, StepInputs};

use crate::random::Case;

/// The case's initial cache as the CPU pool: its pages plus one scratch page.
pub fn case_pool(plan: &ValidatedPlan, c: &Case) -> KvPool {
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
    KvPool {
        pages: c.used_pages + 1,
        k: to_pool(&c.k0),
        v: to_pool(&c.v0),
    }
}

/// The case on the CPU executor: outputs of the real requests, and the updated pool.
/// Batches above the largest bucket run as chunks of at most that size, in order, as the
/// GPU runs them (requests are independent, so chunking changes nothing).
pub fn cpu_reference(
    plan: &ValidatedPlan,
    weights: &[WeightData],
    c: &Case,
) -> Result<(BucketOutputs, KvPool), String> {
    cpu_run(plan, weights, c, false)
}

/// As [`cpu_reference`] with the device's storage precision (`CpuExecutor::storing_rounded`):
/// what the plan's buffer types alone cost against the exact executor (`numerics`).
pub fn cpu_rounded(plan: &ValidatedPlan, weights: &[WeightData], c: &Case) -> Result<(BucketOutputs, KvPool), String> {
    cpu_run(plan, weights, c, true)
}

fn cpu_run(
    plan: &ValidatedPlan,
    weights: &[WeightData],
    c: &Case,
    rounded: bool,
) -> Result<(BucketOutputs, KvPool), String> {
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
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
    // Input rows are hidden_in wide (3·H_t for an EAGLE-3 head).
    let hin = plan.model.hidden_in() as usize;
    let mut pool = case_pool(plan, c);
    let mut table = PageTable::new(plan, c.used_pages as i32);
    for (i, &s) in c.slots.iter().enumerate() {
        table.set_row(s as usize, &c.pages[i]).map_err(|e| e.to_string())?;
    }
    let exec = CpuExecutor::borrowing(plan, weights).map_err(|e| e.to_string())?;
    let exec = if rounded { exec.storing_rounded() } else { exec };
    let max_b = plan.buckets().last().map_or(1, |x| x.batch as usize);
    let mut r = BucketOutputs {
        hidden_out: vec![],
        topk_probs: vec![],
        topk_ids: vec![],
        logits: vec![],
    };
    let x = &c.step;
    for start in (0..c.b).step_by(max_b) {
        let end = (start + max_b).min(c.b);
        let chunk = StepInputs {
            batch: end - start,
            input_ids: x.input_ids[start * n..end * n].to_vec(),
            hidden_states: x.hidden_states[start * n * hin..end * n * hin].to_vec(),
            prefix_lens: x.prefix_lens[start..end].to_vec(),
            accept_lens: x.accept_lens[start..end].to_vec(),
            page_table: x.page_table[start * x.page_cols..end * x.page_cols].to_vec(),
            page_cols: x.page_cols,
        };
        let bucket = plan.bucket_for((end - start) as u32).ok_or("no bucket")?;
        let padded = pad_to_bucket(plan, bucket, &chunk, &c.slots[start..end], table.scratch_slot())
            .map_err(|e| e.to_string())?;
        let o = exec
            .run(bucket, &padded, &table, &mut pool)
            .map_err(|e| e.to_string())?;
        r.hidden_out.extend_from_slice(&o.hidden_out[..(end - start) * h]);
        r.topk_probs.extend_from_slice(&o.topk_probs[..(end - start) * k]);
        r.topk_ids.extend_from_slice(&o.topk_ids[..(end - start) * k]);
        r.logits.extend_from_slice(&o.logits[..(end - start) * cols]);
    }
    Ok((r, pool))
}

/// Which elements of a layer's pool (the case's pages, layer-major bits) the real requests
/// write: the N new positions of each.
pub fn written_mask(plan: &ValidatedPlan, c: &Case) -> Vec<bool> {
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let ps = plan.capture.page_size as usize;
    let row = plan.model.kv_heads as usize * plan.model.head_dim as usize;
    let mut w = vec![false; c.used_pages * plan.kv_page_bytes() as usize / 2];
    for i in 0..c.b {
        for j in 0..n {
            let pos = c.step.prefix_lens[i] as usize + j;
            let at = (c.pages[i][pos / ps] as usize * ps + pos % ps) * row;
            w[at..at + row].iter_mut().for_each(|x| *x = true);
        }
    }
    w
}

/// Naive causal (optionally windowed) attention in f64 of one query row over positions
/// `[start, qpos]` of keys and values given by `kv(pos, dim) -> (k, v)`.
pub fn attention_row(
    q: &[f64],
    start: usize,
    qpos: usize,
    scale: f64,
    kv: &dyn Fn(usize, usize) -> (f64, f64),
) -> Vec<f64> {
    let d = q.len();
    let logits: Vec<f64> = (start..=qpos)
        .map(|p| (0..d).map(|e| q[e] * kv(p, e).0).sum::<f64>() * scale)
        .collect();
    let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|x| (x - mx).exp()).collect();
    let sum: f64 = w.iter().sum();
    (0..d)
        .map(|e| (start..=qpos).zip(&w).map(|(p, wt)| wt * kv(p, e).1).sum::<f64>() / sum)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::attention_row;

    #[test]
    fn attention_row_is_a_softmax_average() {
        // Equal keys: uniform weights, so the output is the mean of the values.
        let kv = |p: usize, _e: usize| (1.0, p as f64);
        let o = attention_row(&[0.5, 0.5], 0, 3, 1.0, &kv);
        assert!((o[0] - 1.5).abs() < 1e-12 && (o[1] - 1.5).abs() < 1e-12);
        // One position only: its value.
        assert_eq!(attention_row(&[1.0], 2, 2, 1.0, &kv), vec![2.0]);
    }
}
