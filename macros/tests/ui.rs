//! UI tests: every error `include_plan!` reports, on the argument it concerns; and, where
//! NVRTC is available (CI runs the tests under `.ci/with-nvrtc`), a plan embedded with its
//! kernel binaries. What a build without NVRTC does is unit-tested in the crate
//! (`kernel_jit`), since this machine's NVRTC cannot be taken away from one test.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail_*.rs");
    if specplan_compiler::jit::Jit::from_env().is_ok() {
        t.pass("tests/ui/pass_kernels.rs");
    } else {
        println!("SKIP: NVRTC not available; the embedded-kernels case is not built");
    }
}
