//! Snapshots of every preset's plan text (kept in plans/), so a compiler change shows up as
//! a reviewable diff there; plus the op graph of `tiny` before and after fusion.

mod common;

use specplan_compiler::config::{resolve, Overrides, Source, PRESETS};
use specplan_compiler::{compile, graph, Target};

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/../plans"));
    s.set_prepend_module_to_snapshot(false);
    s.set_omit_expression(true);
    s
}

#[test]
fn every_preset_plan() {
    for p in PRESETS {
        let plan = common::compile_preset(p.name, &Overrides::default());
        settings().bind(|| insta::assert_snapshot!(p.name, common::snapshot_text(&plan)));
    }
}

#[test]
fn tiny_with_sliding_window_and_fr_spec() {
    let o = Overrides {
        sliding_window: Some(16),
        hot_vocab_size: Some(256),
        ..Overrides::default()
    };
    let plan = common::compile_preset("tiny", &o);
    settings().bind(|| insta::assert_snapshot!("tiny-swa16-hot256", common::snapshot_text(&plan)));
}

/// The logits output (SGLang's draft-extend contract): the selected rows' logits leave the
/// head, no softmax or top-K runs.
#[test]
fn tiny_with_logits_output() {
    let o = Overrides {
        outputs: Some("logits".into()),
        ..Overrides::default()
    };
    let plan = common::compile_preset("tiny", &o);
    settings().bind(|| insta::assert_snapshot!("tiny-logits", common::snapshot_text(&plan)));
}

/// A tensor-parallel rank's plan (rank 1 of 2, draft decode too): its shards of the
/// checkpoint, the all-reduces with rank 0 alone carrying the residual, the cross-rank
/// top-K (docs/tensor-parallel.md).
#[test]
fn tiny_tensor_parallel_rank() {
    let o = Overrides {
        tp_size: Some(2),
        tp_rank: Some(1),
        buckets: Some("1,4".into()),
        draft_decode_steps: Some("3".into()),
        ..Overrides::default()
    };
    let plan = common::compile_preset("tiny", &o);
    settings().bind(|| insta::assert_snapshot!("tiny-tp2-rank1", common::snapshot_text(&plan)));
}

/// The draft-decode phase beside draft-extend: a chain (topk 1) with three step-count tiers
/// (SGLang's adaptive speculation), and a tree (topk 4, 3 steps, N 8) over pages of 4.
#[test]
fn tiny_with_draft_decode() {
    let chain = Overrides {
        topk: Some(1),
        num_steps: Some(3),
        num_draft_tokens: Some(4),
        buckets: Some("1,4".into()),
        draft_decode_steps: Some("2,3,5".into()),
        ..Overrides::default()
    };
    let tree = Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(8),
        buckets: Some("1,4".into()),
        draft_decode_steps: Some("auto".into()),
        ..Overrides::default()
    };
    for (name, o) in [("tiny-decode-chain", chain), ("tiny-decode-tree", tree)] {
        let plan = common::compile_preset("tiny", &o);
        settings().bind(|| insta::assert_snapshot!(name, common::snapshot_text(&plan)));
    }
}

/// Whole plans of two released config formats: a YaRN EAGLE-3 head (Qwen3 style) and the
/// Speculators format vLLM's EAGLE-3 checkpoints ship.
#[test]
fn hf_heads_whole_plans() {
    let o = Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(8),
        buckets: Some("1,8".into()),
        max_context_len: Some(4096),
        ..Overrides::default()
    };
    for name in ["yarn-eagle3", "speculators-eagle3"] {
        let path = format!("{}/corpus/valid/{name}.json", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("corpus file");
        let cfg = resolve(
            &Source::HfConfig {
                name: name.into(),
                text,
            },
            &o,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let plan = compile(&cfg, &Target::default(), None, &|_, _| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .plan;
        settings().bind(|| insta::assert_snapshot!(name, common::snapshot_text(&plan)));
    }
}

#[test]
fn tiny_graph_before_and_after_fusion() {
    let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("tiny resolves");
    let c = compile(&cfg, &Target::default(), None, &|_, _| {}).expect("tiny compiles");
    settings().bind(|| {
        insta::assert_snapshot!("tiny.graph-unfused", graph::print_graph(&c.unfused));
        insta::assert_snapshot!("tiny.graph-fused", graph::print_graph(&c.fused));
    });
}

#[test]
fn compile_is_deterministic() {
    for p in PRESETS {
        let a = specplan_format::encode(&common::compile_preset(p.name, &Overrides::default())).expect("encode");
        let b = specplan_format::encode(&common::compile_preset(p.name, &Overrides::default())).expect("encode");
        assert_eq!(a, b, "{}: two compiles gave different bytes", p.name);
    }
}

#[test]
fn valid_hf_configs_compile() {
    let o = Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(8),
        buckets: Some("1,8,32".into()),
        max_context_len: Some(4096),
        ..Overrides::default()
    };
    insta::glob!("../corpus/valid", "*.json", |path| {
        let text = std::fs::read_to_string(path).expect("read corpus file");
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let cfg = resolve(&Source::HfConfig { name, text }, &o).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let plan = compile(&cfg, &Target::default(), None, &|_, _| {})
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .plan;
        // The model line and the layer windows are what the HF reader decides.
        let facts: Vec<String> = specplan_format::facts(&plan)
            .into_iter()
            .filter(|f| {
                f.key == "model" || f.key.starts_with("layer ") || f.key == "capture" || f.key == "rope inv_freq"
            })
            .map(|f| f.to_string())
            .collect();
        insta::assert_snapshot!(facts.join("\n"));
    });
}
