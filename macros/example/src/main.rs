//! A downstream crate's use of `include_plan!`: the `tiny` plan is compiled while this crate
//! builds, embedded, and run here on the CPU reference executor (no file I/O for the plan).
//! It runs on the CPU only, so it asks for a plan without kernel binaries (`kernels =
//! false`) and builds where NVRTC is missing; a crate that replays the plan on the GPU
//! leaves `kernels` out, and its build then needs NVRTC (`.ci/with-nvrtc cargo build`).

use specplan_runtime::cpu::{CpuExecutor, KvPool, WeightData};
use specplan_runtime::step::{pad_to_bucket, PageTable, StepInputs};

specplan_plan_macros::include_plan!(
    preset = "tiny",
    buckets = "1,2,4,8",
    sliding_window = 64,
    kernels = false
);

/// Deterministic pseudo-random values in [-1, 1) (the example needs no RNG crate).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let plan = plan::get()?;
    println!(
        "embedded plan {}: buckets {:?}, N = {}, top-{}, arena {} bytes, {} plan bytes",
        plan::NAME,
        plan::BUCKETS,
        plan::NUM_DRAFT_TOKENS,
        plan::TOPK,
        plan::ARENA_BYTES,
        plan::BYTES.len()
    );
    let weights: Vec<WeightData> = plan
        .weights
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let n = w.shape.iter().product::<u64>() as usize;
            let scale = 1.0 / (*w.shape.last().unwrap_or(&1) as f32).sqrt();
            WeightData::F32(if w.shape.len() == 1 {
                vec![1.0; n]
            } else {
                values(n, i as u64 + 7, scale)
            })
        })
        .collect();
    let (b, n, h) = (3usize, plan::NUM_DRAFT_TOKENS as usize, plan::HIDDEN as usize);
    let ps = plan.capture.page_size as usize;
    let prefix = vec![5, 40, 17];
    let cols = (40 + n).div_ceil(ps);
    let pages = b * cols;
    let step = StepInputs {
        batch: b,
        input_ids: (0..b * n).map(|i| (i * 37 % plan::VOCAB as usize) as i64).collect(),
        hidden_states: values(b * n * h, 99, 1.0),
        prefix_lens: prefix,
        accept_lens: vec![1, 4, 2],
        page_table: (0..pages as i32).collect(),
        page_cols: cols,
    };
    step.check(plan, pages)?;
    let per_layer = (pages + 1) * plan.kv_page_bytes() as usize / 2;
    let mut kv = KvPool {
        pages: pages + 1,
        k: (0..plan.model.layers)
            .map(|l| values(per_layer, 1000 + l as u64, 1.0))
            .collect(),
        v: (0..plan.model.layers)
            .map(|l| values(per_layer, 2000 + l as u64, 1.0))
            .collect(),
    };
    let mut table = PageTable::new(plan, pages as i32);
    for i in 0..b {
        table.set_row(i, &step.page_table[i * cols..(i + 1) * cols])?;
    }
    let bucket = plan.bucket_for(b as u32).ok_or("no bucket fits")?;
    let slots: Vec<i32> = (0..b as i32).collect();
    let inputs = pad_to_bucket(plan, bucket, &step, &slots, table.scratch_slot())?;
    let out = CpuExecutor::new(plan, weights)?.run(bucket, &inputs, &table, &mut kv)?;
    let k = plan::TOPK as usize;
    for i in 0..b {
        println!(
            "request {i}: top-{k} ids {:?} probs {:?}",
            &out.topk_ids[i * k..(i + 1) * k],
            out.topk_probs[i * k..(i + 1) * k]
                .iter()
                .map(|p| format!("{p:.4}"))
                .collect::<Vec<_>>()
        );
    }
    Ok(())
}
