specplan_plan_macros::include_plan!(topk = 4);
fn main() {}
