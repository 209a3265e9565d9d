// Built only where NVRTC is available (see ui.rs): by default the embedded plan carries
// every kernel's binary.
specplan_plan_macros::include_plan!(preset = "tiny", buckets = "1,2");

fn main() {
    let p = plan::get().expect("embedded plan decodes");
    assert!(!p.kernels.is_empty());
    assert!(p.kernels.iter().all(|k| k.binary.is_some()), "a kernel without a binary");
}
