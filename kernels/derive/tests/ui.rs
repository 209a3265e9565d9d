//! UI tests: every error the KernelParams derive reports, with its span (`.stderr` snapshots).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass_*.rs");
    t.compile_fail("tests/ui/fail_*.rs");
}
