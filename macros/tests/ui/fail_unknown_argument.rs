specplan_plan_macros::include_plan!(preset = "tiny", batch_sizes = "1,2");
fn main() {}
