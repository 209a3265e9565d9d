//! Properties of the static memory plan, for every preset and bucket (the validator
//! already proves no two live buffers share bytes; these check the plan is also good).

mod common;

use specplan_compiler::config::{Overrides, PRESETS};
use specplan_compiler::schedule::INPUT_ORDER;
use specplan_format::BufferRole;

#[test]
fn liveness_reuses_memory_and_inputs_are_one_block() {
    for p in PRESETS {
        let plan = common::compile_preset(p.name, &Overrides::default());
        // (arena, attention splits) of the previous bucket: a larger batch never needs less,
        // unless it splits the keys fewer ways (the split-KV partials are then smaller).
        let mut prev = (0, u32::MAX);
        for b in plan.buckets() {
            let total: u64 = b.buffers.iter().map(|x| x.bytes).sum();
            assert!(
                b.arena_bytes < total,
                "{} bucket {}: arena {} is no smaller than the sum of its buffers {total}",
                p.name,
                b.batch,
                b.arena_bytes
            );
            assert!(
                b.arena_bytes >= prev.0 || b.attn_splits < prev.1,
                "{} bucket {}: arena shrank with a larger batch and as many attention splits",
                p.name,
                b.batch
            );
            prev = (b.arena_bytes, b.attn_splits);
            // Inputs first, in staging order, each 256-aligned right after the previous one.
            let mut at = 0u64;
            for name in INPUT_ORDER {
                let (_, x) = b.buffer(name).unwrap_or_else(|| panic!("{}: no input {name}", p.name));
                assert_eq!(x.role, BufferRole::Input);
                assert_eq!(
                    x.offset, at,
                    "{} bucket {}: input {name} not contiguous",
                    p.name, b.batch
                );
                at += x.bytes.div_ceil(256) * 256;
            }
            // Nothing else lives in the input block.
            for x in b.buffers.iter().filter(|x| x.role != BufferRole::Input) {
                assert!(
                    x.offset >= at,
                    "{} bucket {}: {} inside the input block",
                    p.name,
                    b.batch,
                    x.name
                );
            }
        }
        println!("{}: arena {} B at the largest bucket", p.name, plan.arena_bytes());
    }
}

#[test]
fn padded_requests_reach_only_the_scratch_page() {
    // The scratch slot is the page table's last row and the scratch page the pool's last
    // page; no request slot or page id a caller can assign reaches either.
    for p in PRESETS {
        let plan = common::compile_preset(p.name, &Overrides::default());
        assert_eq!(plan.page_table_rows(), plan.capture.max_requests as u64 + 1);
        assert_eq!(plan.capture.scratch_page, plan.capture.kv_pool_pages - 1);
        let table = specplan_runtime::step::PageTable::new(&plan, plan.capture.scratch_page as i32);
        assert_eq!(table.scratch_slot() as u32, plan.capture.max_requests);
        assert!(table.data.iter().all(|&x| x == plan.capture.scratch_page as i32));
    }
}
