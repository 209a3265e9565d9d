//! Config recognition on a corpus of draft-head configs written for each rule
//! (`tests/corpus/hf/`, one file per rule, accepted and refused), with the README's example
//! flags: each accepted file compiles (no kernels) to the expected head kind and layer count;
//! each refused one names the expected key, once, and nothing is compiled.

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_format::HeadKind;

enum Verdict {
    Accept { head: HeadKind, layers: u32 },
    Refuse { key: &'static str },
}
use Verdict::*;

const CASES: &[(&str, Verdict)] = &[
    // Accepted.
    (
        "eagle1-sglang-training-length",
        Accept {
            head: HeadKind::Eagle1,
            layers: 1,
        },
    ),
    (
        "eagle1-safeailab-plain-llama",
        Accept {
            head: HeadKind::Eagle1,
            layers: 1,
        },
    ),
    (
        "eagle1-mistral",
        Accept {
            head: HeadKind::Eagle1,
            layers: 1,
        },
    ),
    (
        "eagle1-max-sequence-length",
        Accept {
            head: HeadKind::Eagle1,
            layers: 1,
        },
    ),
    (
        "eagle3-sglang",
        Accept {
            head: HeadKind::Eagle3,
            layers: 1,
        },
    ),
    (
        "eagle3-tied-full-vocab",
        Accept {
            head: HeadKind::Eagle3,
            layers: 1,
        },
    ),
    (
        "eagle3-safeailab-training",
        Accept {
            head: HeadKind::Eagle3,
            layers: 1,
        },
    ),
    (
        "vllm-nested-eagle1",
        Accept {
            head: HeadKind::Eagle1,
            layers: 1,
        },
    ),
    (
        "speculators-eagle3",
        Accept {
            head: HeadKind::Eagle3,
            layers: 1,
        },
    ),
    (
        "eagle3-mrope",
        Accept {
            head: HeadKind::Eagle3,
            layers: 1,
        },
    ),
    // Refused, by the key that says what the file is or what it would change.
    ("dflash", Refuse { key: "architectures" }),
    ("peagle", Refuse { key: "architectures" }),
    ("mtp-nextn", Refuse { key: "architectures" }),
    ("qwen2-eagle", Refuse { key: "architectures" }),
    ("medusa", Refuse { key: "model_type" }),
    ("qwen3-moe-eagle3", Refuse { key: "num_experts" }),
    (
        "target-llama",
        Refuse {
            key: "num_hidden_layers",
        },
    ),
    ("hidden-act-gelu", Refuse { key: "hidden_act" }),
    ("attention-bias", Refuse { key: "attention_bias" }),
    ("mlp-bias", Refuse { key: "mlp_bias" }),
    (
        "partial-rotary",
        Refuse {
            key: "partial_rotary_factor",
        },
    ),
    (
        "rope-longrope",
        Accept {
            head: HeadKind::Eagle1,
            layers: 1,
        },
    ),
    (
        "rope-yarn",
        Accept {
            head: HeadKind::Eagle1,
            layers: 1,
        },
    ),
    (
        "speculators-medusa",
        Refuse {
            key: "speculators_model_type",
        },
    ),
    (
        "eagle3-tied",
        Accept {
            head: HeadKind::Eagle3,
            layers: 1,
        },
    ),
];

/// The README's example flags.
fn readme_flags() -> Overrides {
    Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(8),
        buckets: Some("auto".into()),
        max_bs: Some(64),
        page_size: Some(1),
        max_context_len: Some(4096),
        ..Overrides::default()
    }
}

fn source(name: &str) -> Source {
    let path = format!("{}/corpus/hf/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Source::HfConfig {
        name: name.into(),
        text,
    }
}

#[test]
fn every_corpus_config_gets_its_verdict() {
    let dir = format!("{}/corpus/hf", env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("corpus dir")
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json").map(str::to_string))
        .collect();
    files.sort();
    let mut listed: Vec<String> = CASES.iter().map(|(n, _)| n.to_string()).collect();
    listed.sort();
    assert_eq!(files, listed, "every corpus file has a verdict here, and only those");
    for (name, want) in CASES {
        let got = resolve(&source(name), &readme_flags());
        match (want, got) {
            (Accept { head, layers }, Ok(cfg)) => {
                assert_eq!(cfg.model.desc.head, *head, "{name}: head kind");
                assert_eq!(cfg.model.desc.layers, *layers, "{name}: layers");
                let c = compile(&cfg, &Target::default(), None, &|_, _| {})
                    .unwrap_or_else(|e| panic!("{name}: compile: {e}"));
                assert_eq!(c.plan.model.head, *head, "{name}: the plan's head kind");
                assert_eq!(c.plan.model.layers, *layers, "{name}: the plan's layers");
            }
            (Accept { .. }, Err(e)) => panic!("{name} was refused:\n{e}"),
            (Refuse { key }, Ok(cfg)) => panic!(
                "{name} was accepted ({:?}); expected a refusal naming {key}",
                cfg.model.desc.head
            ),
            (Refuse { key }, Err(e)) => {
                let fields: Vec<&str> = e.0.iter().map(|f| f.field.as_str()).collect();
                assert!(
                    fields.iter().any(|f| f.split(' ').next() == Some(*key)),
                    "{name}: expected an error naming {key}, got {fields:?}:\n{e}"
                );
            }
        }
    }
}

/// A head served above its training length compiles, says so in one note, and its plan
/// records both numbers.
#[test]
fn a_serving_context_above_the_training_length_compiles_with_a_note() {
    let cfg = resolve(&source("eagle1-sglang-training-length"), &readme_flags()).expect("accepted");
    assert_eq!(cfg.notes.len(), 1, "{:?}", cfg.notes);
    assert!(
        cfg.notes[0].contains("above the head's max_position_embeddings 2048"),
        "{:?}",
        cfg.notes
    );
    let c = compile(&cfg, &Target::default(), None, &|_, _| {}).expect("compiles");
    assert_eq!(c.plan.model.max_position_embeddings, 2048);
    assert_eq!(c.plan.capture.max_context_len, 4096);
}

/// The interchange formats read into the same config as the flat file they describe, and
/// keys nothing reads are listed.
#[test]
fn interchange_formats_read_as_the_flat_config() {
    let flat = resolve(&source("eagle3-safeailab-training"), &readme_flags()).expect("flat");
    let spec = resolve(&source("speculators-eagle3"), &readme_flags()).expect("speculators");
    assert_eq!(spec.format, "Speculators config");
    assert_eq!(spec.model.desc, flat.model.desc, "the Speculators head is the flat one");
    let nested = resolve(&source("vllm-nested-eagle1"), &readme_flags()).expect("nested");
    let plain = resolve(&source("eagle1-safeailab-plain-llama"), &readme_flags()).expect("plain");
    assert_eq!(nested.format, "vLLM nested EAGLE config");
    // The plain file has an fc bias; the nested one does not say (the EAGLE-1 default: on).
    assert_eq!(nested.model.desc, plain.model.desc);
    assert!(flat.ignored.contains(&"_comment".to_string()), "{:?}", flat.ignored);
}

/// A top-level `original_max_position_embeddings` wins over `rope_scaling`'s, as SGLang's
/// Llama layers copy it in (`srt/models/llama.py:329-334`): YaRN's training length, and
/// LongRoPE's limit on the serving context, come from it.
#[test]
fn a_top_level_training_length_wins_over_rope_scalings() {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{}/corpus/hf/rope-yarn.json", env!("CARGO_MANIFEST_DIR"))).expect("yarn"),
    )
    .expect("json");
    cfg["original_max_position_embeddings"] = 2048.into();
    let src = Source::HfConfig {
        name: "yarn-top-level".into(),
        text: cfg.to_string(),
    };
    let c = resolve(&src, &readme_flags()).expect("accepted");
    assert!(
        c.ignored.iter().all(|k| k != "original_max_position_embeddings"),
        "{:?}",
        c.ignored
    );
    match c.model.desc.rope_scaling {
        specplan_format::RopeScaling::Yarn {
            original_max_position_embeddings,
            ..
        } => assert_eq!(original_max_position_embeddings, 2048),
        other => panic!("{other:?}"),
    }
    let mut lr: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{}/corpus/hf/rope-longrope.json", env!("CARGO_MANIFEST_DIR")))
            .expect("longrope"),
    )
    .expect("json");
    lr["original_max_position_embeddings"] = 2048.into();
    let e = resolve(
        &Source::HfConfig {
            name: "longrope-top-level".into(),
            text: lr.to_string(),
        },
        &readme_flags(),
    )
    .expect_err("4096 is above the top-level training length 2048");
    assert!(e.to_string().contains("original_max_position_embeddings 2048"), "{e}");
}
