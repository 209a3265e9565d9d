specplan_plan_macros::include_plan!(preset = "tiny", topk = "four");
fn main() {}
