//! `pad_to_bucket` and `PageTable::set_row` refuse what they cannot do, naming the tensor
//! (they panicked on mismatched lengths or a slot outside the table before).

mod common;

use specplan_compiler::config::Overrides;
use specplan_runtime::step::{pad_to_bucket, PageTable, StepInputs};

#[test]
fn padding_refuses_what_it_cannot_pad() {
    let plan = common::compile_preset("tiny", &Overrides::default());
    let n = plan.spec.num_draft_tokens as usize;
    let h = plan.model.hidden_in() as usize;
    let bucket = &plan.buckets()[0];
    let x = StepInputs {
        batch: 1,
        input_ids: vec![1; n],
        hidden_states: vec![0.5; n * h],
        prefix_lens: vec![3],
        accept_lens: vec![1],
        page_table: vec![0],
        page_cols: 1,
    };
    let padded = pad_to_bucket(&plan, bucket, &x, &[0], 9).expect("pads");
    assert_eq!(padded.req_slots.len(), bucket.batch as usize);
    assert_eq!(padded.req_slots[0], 0);
    assert_eq!(padded.hidden_states[..n * h], x.hidden_states[..]);

    let err = |x: &StepInputs, slots: &[i32]| pad_to_bucket(&plan, bucket, x, slots, 9).expect_err("refused");
    let short = StepInputs {
        hidden_states: vec![0.5; n * h - 1],
        ..x.clone()
    };
    let e = err(&short, &[0]);
    assert_eq!(e.tensor, "hidden_states");
    assert!(e.message.contains(&format!("expected [1, {n}, {h}]")), "{e}");
    let few = StepInputs {
        accept_lens: Vec::new(),
        ..x.clone()
    };
    assert_eq!(err(&few, &[0]).tensor, "accept_lens");
    assert_eq!(err(&x, &[]).tensor, "slots");
    let big = StepInputs {
        batch: bucket.batch as usize + 1,
        ..x.clone()
    };
    let e = err(&big, &[0; 64]);
    assert!(e.message.contains("the plan's bucket"), "{e}");

    let mut table = PageTable::new(&plan, 0);
    let rows = plan.page_table_rows() as usize;
    assert!(table.set_row(rows - 1, &[1, 2]).is_ok());
    let e = table.set_row(rows, &[1]).expect_err("outside the table");
    assert_eq!(
        (e.tensor.as_str(), e.index.clone()),
        ("page_table", format!("[{rows}]"))
    );
}
