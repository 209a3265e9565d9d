specplan_plan_macros::include_plan!(config = "configs/does-not-exist.toml");
fn main() {}
