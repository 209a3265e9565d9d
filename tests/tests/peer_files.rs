//! The peer benchmark's files (`peerprep`, `specplan_tests::contract_files`): the `run`
//! contract accepts them and runs on them, a seed reproduces them, and the plan JSON
//! carries the plan's exact f32 facts.

mod common;

use specplan_compiler::config::Overrides;
use specplan_contract::{load_inputs, load_weights, run_cpu};
use specplan_tests::contract_files::{input_tensors, plan_json, weight_tensors, write_safetensors};

fn roundtrip(o: Overrides, b: usize, max_prefix: usize) {
    let plan = common::compile_preset("tiny", &o);
    let dir = tempfile::tempdir().expect("tempdir");
    let (w, i) = (dir.path().join("w.safetensors"), dir.path().join("i.safetensors"));
    write_safetensors(&w, &weight_tensors(&plan, 7).expect("weights")).expect("write weights");
    write_safetensors(&i, &input_tensors(&plan, 7, b, max_prefix).expect("inputs")).expect("write inputs");
    let weights = load_weights(&plan, &w).unwrap_or_else(|e| panic!("weights rejected: {e}"));
    let mut inputs = load_inputs(&plan, &i).unwrap_or_else(|e| panic!("inputs rejected: {e}"));
    assert_eq!(inputs.step.batch, b);
    assert_eq!(
        inputs.step.prefix_lens[0] as usize, max_prefix,
        "request 0 sits at the maximum"
    );
    let n = plan.spec.num_draft_tokens as usize;
    assert!(inputs.step.accept_lens.iter().all(|&a| a >= 1 && a as usize <= n));
    let out = run_cpu(&plan, weights, &mut inputs).expect("run");
    assert!(out.outputs.hidden_out.iter().all(|x| x.is_finite()));
    assert!(out.outputs.topk_probs.iter().all(|p| (0.0..=1.0).contains(p)));
}

#[test]
fn files_follow_the_run_contract() {
    roundtrip(Overrides::default(), 3, 40);
    roundtrip(
        Overrides {
            sliding_window: Some(13),
            hot_vocab_size: Some(300),
            ..Overrides::default()
        },
        5,
        50,
    );
    roundtrip(
        Overrides {
            dtype: Some("fp16".into()),
            page_size: Some(1),
            ..Overrides::default()
        },
        2,
        30,
    );
}

#[test]
fn a_seed_reproduces_the_files() {
    let plan = common::compile_preset("tiny", &Overrides::default());
    let bytes = |seed| -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = weight_tensors(&plan, seed)
            .expect("w")
            .into_iter()
            .map(|t| t.bytes)
            .collect();
        v.extend(
            input_tensors(&plan, seed, 4, 20)
                .expect("i")
                .into_iter()
                .map(|t| t.bytes),
        );
        v
    };
    assert_eq!(bytes(11), bytes(11));
    assert_ne!(bytes(11), bytes(12));
}

#[test]
fn inputs_outside_the_plan_are_refused() {
    let plan = common::compile_preset("tiny", &Overrides::default());
    let max_b = plan.buckets().last().map_or(0, |b| b.batch as usize);
    assert!(input_tensors(&plan, 1, max_b + 1, 10).is_err());
    assert!(input_tensors(&plan, 1, 0, 10).is_err());
    assert!(input_tensors(&plan, 1, 1, plan.capture.max_context_len as usize).is_err());
}

#[test]
fn plan_json_carries_exact_facts() {
    let plan = common::compile_preset(
        "tiny",
        &Overrides {
            sliding_window: Some(13),
            hot_vocab_size: Some(300),
            ..Overrides::default()
        },
    );
    let v: serde_json::Value = serde_json::from_str(&plan_json(&plan)).expect("valid JSON");
    let bits: Vec<u32> = v["rope_inv_freq_bits"]
        .as_array()
        .expect("bits")
        .iter()
        .map(|x| x.as_u64().expect("u32") as u32)
        .collect();
    assert_eq!(bits, plan.rope_inv_freq.iter().map(|f| f.to_bits()).collect::<Vec<_>>());
    assert_eq!(
        v["rms_norm_eps_bits"].as_u64(),
        Some(plan.model.rms_norm_eps.to_bits() as u64)
    );
    assert_eq!(v["num_draft_tokens"].as_u64(), Some(plan.spec.num_draft_tokens as u64));
    assert_eq!(v["hot_vocab_size"].as_u64(), Some(300));
    assert!(v["windows"]
        .as_array()
        .expect("windows")
        .iter()
        .all(|w| w.as_u64() == Some(13)));
    assert_eq!(v["fc_bias"].as_bool(), Some(plan.model.fc_bias));
}
