// trybuild builds this file in target/tests/trybuild/specplan-plan-macros, the manifest
// directory `plan = ...` is relative to.
specplan_plan_macros::include_plan!(plan = "../../../../macros/tests/ui/corrupt.plan");
fn main() {}
