specplan_plan_macros::include_plan!(preset = "tiny", num_draft_tokens = 99);
fn main() {}
