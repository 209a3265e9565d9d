//! GPU smoke test inside `cargo test`: the `tiny` plan replayed as a graph and eagerly on
//! the GPU against the CPU reference executor. Ignored (the summary says so) where the tests
//! were built without a CUDA driver or without NVRTC (as in CI: `tests/build.rs`); the full
//! check is `.ci/gpu` (gpucheck).

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::jit::Jit;
use specplan_compiler::{compile, Target};
use specplan_runtime::cpu::{CpuExecutor, KvPool, WeightData};
use specplan_runtime::gpu::{GpuOptions, GpuRuntime, Hidden, StepRequest};
use specplan_runtime::step::{pad_to_bucket, PageTable, StepInputs};
use specplan_tests::{seed, Rng};

#[test]
#[cfg_attr(
    not(all(specplan_gpu, specplan_nvrtc)),
    ignore = "needs a CUDA driver and NVRTC (.ci/with-nvrtc) where the tests are built; the GPU check runs via .ci/gpu"
)]
fn tiny_on_the_gpu_matches_the_cpu_reference() {
    assert!(
        GpuRuntime::available(),
        "a CUDA driver was found at build time but no device is usable"
    );
    let jit = Jit::from_env().expect("NVRTC (the build found .ci/with-nvrtc's)");
    let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("config");
    let plan = compile(&cfg, &Target::default(), Some(&jit), &|_, _| {})
        .expect("compile")
        .plan;
    let mut rng = Rng(seed());
    let bf = |x: f32| half::bf16::from_f32(x);
    let weights: Vec<WeightData> = plan
        .weights
        .iter()
        .map(|w| {
            let n = w.shape.iter().product::<u64>() as usize;
            let scale = 1.0 / (*w.shape.last().unwrap_or(&1) as f32).sqrt();
            let norm = w.shape.len() == 1 && !w.name.contains("bias");
            WeightData::F32(
                (0..n)
                    .map(|_| bf(if norm { 1.0 } else { rng.uniform() * scale }).to_f32())
                    .collect(),
            )
        })
        .collect();
    let (b, n, h) = (3usize, 4usize, 256usize);
    let pages_per = 40usize;
    let pages = b * pages_per;
    let step = StepInputs {
        batch: b,
        input_ids: (0..b * n).map(|_| rng.below(1000) as i64).collect(),
        hidden_states: (0..b * n * h).map(|_| bf(rng.uniform()).to_f32()).collect(),
        prefix_lens: (0..b).map(|_| rng.below(150) as i32).collect(),
        accept_lens: (0..b).map(|_| 1 + rng.below(n) as i32).collect(),
        page_table: (0..pages as i32).collect(),
        page_cols: pages_per,
    };
    let hidden_bits: Vec<u16> = step.hidden_states.iter().map(|&x| bf(x).to_bits()).collect();
    let opts = GpuOptions {
        kv_pool_pages: Some(pages as u32 + 1),
        ..GpuOptions::default()
    };
    let mut rt = GpuRuntime::new(plan.clone(), &weights, opts).expect("runtime");
    let slots: Vec<i32> = (0..b as i32).collect();
    for i in 0..b {
        rt.set_pages(i, &step.page_table[i * pages_per..(i + 1) * pages_per])
            .expect("pages");
    }
    let req = StepRequest {
        slots: &slots,
        input_ids: &step.input_ids,
        hidden: Hidden::Host(&hidden_bits),
        prefix_lens: &step.prefix_lens,
        accept_lens: &step.accept_lens,
    };
    let mut outs = Vec::new();
    for eager in [false, true] {
        rt.poison().expect("poison");
        let info = rt.step(&req, eager).expect("step");
        assert_eq!(info.graph, !eager);
        outs.push(rt.read_outputs().expect("outputs"));
    }
    assert_eq!(outs[0], outs[1], "graph and eager differ");
    let per_layer = (pages + 1) * plan.kv_page_bytes() as usize / 2;
    let mut kv = KvPool {
        pages: pages + 1,
        k: vec![vec![0.0; per_layer]; 2],
        v: vec![vec![0.0; per_layer]; 2],
    };
    let mut table = PageTable::new(&plan, pages as i32);
    for i in 0..b {
        table
            .set_row(i, &step.page_table[i * pages_per..(i + 1) * pages_per])
            .expect("a row of the table");
    }
    let bucket = plan.bucket_for(b as u32).expect("bucket");
    let padded = pad_to_bucket(&plan, bucket, &step, &slots, table.scratch_slot()).expect("padded");
    let want = CpuExecutor::new(&plan, weights)
        .expect("cpu")
        .run(bucket, &padded, &table, &mut kv)
        .expect("cpu run");
    let got: Vec<f32> = outs[0]
        .hidden_out
        .iter()
        .map(|&u| half::bf16::from_bits(u).to_f32())
        .collect();
    let num: f32 = got.iter().zip(&want.hidden_out).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f32 = want.hidden_out[..b * h].iter().map(|x| x * x).sum();
    let rel = (num / den).sqrt();
    println!("tiny on the GPU: hidden_out relative error {rel:.3e}");
    assert!(rel < 1e-2, "hidden_out relative error {rel}");
}
