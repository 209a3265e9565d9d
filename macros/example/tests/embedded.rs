//! The embedded plan is byte-for-byte the plan the compiler produces for the same inputs.

specplan_plan_macros::include_plan!(
    preset = "tiny",
    buckets = "1,2,4,8",
    sliding_window = 64,
    kernels = false
);

#[test]
fn embedded_plan_equals_the_compiled_plan() {
    use specplan_compiler::config::{resolve, Overrides, Source};
    let o = Overrides {
        buckets: Some("1,2,4,8".into()),
        sliding_window: Some(64),
        ..Overrides::default()
    };
    let cfg = resolve(&Source::Preset("tiny".into()), &o).expect("config");
    // `kernels = false`: compiled without NVRTC, whatever the build environment has.
    let compiled = specplan_compiler::compile(&cfg, &specplan_compiler::Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan;
    let bytes = specplan_format::encode(&compiled).expect("encode");
    assert_eq!(
        plan::BYTES,
        bytes.as_slice(),
        "embedded plan differs from `specplan compile`'s"
    );
    let p = plan::get().expect("embedded plan decodes");
    assert_eq!(p.plan(), compiled.plan());
    assert_eq!(plan::BUCKETS, &[1, 2, 4, 8]);
    assert_eq!(plan::NUM_DRAFT_TOKENS, 4);
    assert!(
        p.kernels.iter().all(|k| k.binary.is_none()),
        "kernels = false embedded binaries"
    );
}
