specplan_plan_macros::include_plan!(preset = "llama9-eagle");
fn main() {}
