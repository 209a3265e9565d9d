specplan_plan_macros::include_plan!(preset = "tiny", kernels = "no");

fn main() {}
