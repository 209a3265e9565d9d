//! Helpers shared by the integration tests (each test binary uses a subset).
#![allow(dead_code)]

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_format::{Plan, ValidatedPlan};

pub fn corpus(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(path)
}

/// The corpus's tiny EAGLE-3 head and the speculative shape its tests share (topk 4, 3 steps,
/// N 4, buckets 1,2,4,8, page size 4, context 512); callers change what they vary.
pub fn tiny_eagle3() -> (Source, Overrides) {
    let text = std::fs::read_to_string(corpus("valid/tiny-eagle3.json")).expect("tiny-eagle3.json");
    let src = Source::HfConfig {
        name: "tiny-eagle3".into(),
        text,
    };
    let o = Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(4),
        buckets: Some("1,2,4,8".into()),
        page_size: Some(4),
        max_context_len: Some(512),
        ..Overrides::default()
    };
    (src, o)
}

/// Compiles a preset with overrides; panics with the error (tests only).
pub fn compile_preset(name: &str, o: &Overrides) -> ValidatedPlan {
    let cfg = resolve(&Source::Preset(name.into()), o).unwrap_or_else(|e| panic!("{name}: {e}"));
    compile(&cfg, &Target::default(), None, &|_, _| {})
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .plan
}

/// Text form with toolchain-dependent binary facts redacted, so a NVRTC bump does not
/// churn every snapshot (the source hash, which we control, stays).
pub fn snapshot_text(p: &Plan) -> String {
    specplan_format::facts(p)
        .into_iter()
        .map(|f| {
            if f.key.ends_with(" binary") && f.value != "none" {
                format!("{} [binary]", f.key)
            } else if f.key == "target" {
                "target [target]".to_string()
            } else {
                f.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}
