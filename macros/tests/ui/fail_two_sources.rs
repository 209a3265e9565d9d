specplan_plan_macros::include_plan!(preset = "tiny", config = "x.toml");
fn main() {}
