//! UI tests: every error `include_plan!` reports, on the argument it concerns.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail_*.rs");
}
