//! Random (and fixed-pattern) weights and step cases for the checks and benchmarks.

use specplan_format::PhaseKind;
use specplan_format::{DType, ValidatedPlan};
use specplan_runtime::bits::{round_act, to_act_bits};
use specplan_runtime::cpu::WeightData;
use specplan_runtime::step::StepInputs;

use crate::Rng;

/// Random packed weights for every plan weight, rounded to the activation type (scaled so
/// activations stay O(1): RMSNorm weights 1 ± 0.2, biases 0.1·u, the embedding u, lm_head
/// 4·u/√cols, other matrices u/√cols). The FR-Spec map is a random id subset; EAGLE-3's
/// d2t maps the draft ids onto a sorted random subset of the target vocabulary.
pub fn random_weights(plan: &ValidatedPlan, rng: &mut Rng) -> Vec<WeightData> {
    let vocab = plan.model.vocab as usize;
    let act = plan.capture.dtype;
    plan.weights
        .iter()
        .map(|w| {
            let n: u64 = w.shape.iter().product();
            if w.dtype == DType::I64 && w.name == "d2t" {
                // EAGLE-3: draft id d is target id d + d2t[d], over a sorted random subset.
                let mut p = rng.permutation(vocab);
                p.truncate(n as usize);
                p.sort_unstable();
                return WeightData::I64(p.into_iter().enumerate().map(|(d, t)| t as i64 - d as i64).collect());
            }
            if w.dtype == DType::I64 {
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
                    round_act(x, act)
                })
                .collect();
            WeightData::F32(v)
        })
        .collect()
}

/// Deterministic weights for timing (values do not change the time).
pub fn pattern_weights(plan: &ValidatedPlan) -> Vec<WeightData> {
    plan.weights
        .iter()
        .map(|w| {
            let n = w.shape.iter().product::<u64>() as usize;
            if w.dtype == DType::I64 && w.name == "d2t" {
                WeightData::I64(vec![0; n])
            } else if w.dtype == DType::I64 {
                WeightData::I64((0..n as i64).collect())
            } else {
                let scale = 1.0 / (*w.shape.last().unwrap_or(&1) as f32).sqrt();
                WeightData::F32(
                    (0..n)
                        .map(|i| ((i * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
                        .map(|x| x * scale)
                        .collect(),
                )
            }
        })
        .collect()
}

/// One step of `b` requests on random data: request slots, pages dealt in random order,
/// random prefixes in [0, max_prefix], accept lengths in [1, N], ids, hidden states, and a
/// random initial cache holding exactly the pages the requests use (layer-major raw bits).
#[derive(Clone)]
pub struct Case {
    pub b: usize,
    pub slots: Vec<i32>,
    pub pages: Vec<Vec<i32>>,
    pub used_pages: usize,
    pub step: StepInputs,
    pub hidden_bits: Vec<u16>,
    pub k0: Vec<u16>,
    pub v0: Vec<u16>,
}

/// Whole pages for each request, `need[i]` of them, dealt from a shuffled order of
/// `Σ need` pages (as an engine's allocator hands them out): the rows and the pages used.
pub fn deal_pages(rng: &mut Rng, need: &[usize]) -> (Vec<Vec<i32>>, usize) {
    let used: usize = need.iter().sum();
    let perm = rng.permutation(used);
    let mut next = 0;
    let pages = need
        .iter()
        .map(|&c| {
            next += c;
            perm[next - c..next].iter().map(|&p| p as i32).collect()
        })
        .collect();
    (pages, used)
}

/// Draft-extend's top-K of `b` requests as a draft-decode phase takes it: descending
/// probabilities in [0.05, 0.95] and distinct ids of `vocab`.
pub fn random_topk(rng: &mut Rng, b: usize, k: usize, vocab: usize) -> (Vec<f32>, Vec<i64>) {
    let (mut probs, mut ids) = (Vec::new(), Vec::new());
    for _ in 0..b {
        let mut p: Vec<f32> = (0..k).map(|_| 0.05 + 0.45 * (rng.uniform() + 1.0)).collect();
        p.sort_by(|a, b| b.total_cmp(a));
        probs.extend(p);
        ids.extend(rng.permutation(vocab)[..k].iter().map(|&x| x as i64));
    }
    (probs, ids)
}

pub fn make_case(plan: &ValidatedPlan, rng: &mut Rng, b: usize, max_prefix: usize) -> Case {
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    // Input rows: 3·H_t wide for an EAGLE-3 head.
    let h = plan.model.hidden_in() as usize;
    let ps = plan.capture.page_size as usize;
    let act = plan.capture.dtype;
    let prefix: Vec<i32> = (0..b).map(|_| rng.below(max_prefix + 1) as i32).collect();
    let need: Vec<usize> = prefix.iter().map(|&l| (l as usize + n).div_ceil(ps)).collect();
    let (pages, used_pages) = deal_pages(rng, &need);
    let slots: Vec<i32> = rng.permutation(plan.capture.max_requests as usize)[..b]
        .iter()
        .map(|&s| s as i32)
        .collect();
    let cols = need.iter().copied().max().unwrap_or(1);
    let mut table = vec![0i32; b * cols];
    for i in 0..b {
        table[i * cols..i * cols + pages[i].len()].copy_from_slice(&pages[i]);
    }
    let hidden: Vec<f32> = (0..b * n * h).map(|_| round_act(rng.uniform(), act)).collect();
    let per = used_pages * plan.kv_page_bytes() as usize / 2 * plan.model.layers as usize;
    let rand_bits = |rng: &mut Rng| -> Vec<u16> {
        let v: Vec<f32> = (0..per).map(|_| rng.uniform()).collect();
        to_act_bits(&v, act)
    };
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
    let hidden_bits = to_act_bits(&hidden, act);
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
