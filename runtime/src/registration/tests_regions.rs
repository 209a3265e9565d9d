//! The registered memory's byte ranges and a step's tensors against them (regions.rs).

use super::*;

fn memory_case(weights: &HashMap<String, DeviceTensor>, table_ptr: u64) -> EngineMemory<'_> {
    EngineMemory {
        kv: kv_ok(),
        table: TableRegistration {
            ptr: table_ptr,
            mode: TableMode::TokenSlots,
            rows: 4,
            cols: 64,
            stride: 64,
            page_size: 1,
        },
        weights,
    }
}

#[test]
fn registered_kinds_must_not_share_bytes() {
    let p = plan();
    // Pools of 100 slots of 128 elements: K of layer 0 at [0x100000, 0x106400).
    let mut weights = HashMap::new();
    weights.insert("fc.weight".to_string(), bf16(0x50_0000, vec![256, 512]));
    // Tied weights share one tensor: accepted.
    weights.insert("lm_head.weight".to_string(), bf16(0x60_0000, vec![1000, 256]));
    weights.insert("embed_tokens.weight".to_string(), bf16(0x60_0000, vec![1000, 256]));
    assert!(Regions::of(&p, &memory_case(&weights, 0x100)).is_ok());
    // The table inside layer 0's K pool.
    let e = Regions::of(&p, &memory_case(&weights, 0x10_0400))
        .unwrap_err()
        .to_string();
    assert!(e.contains("req_to_token") && e.contains("k_cache[0]"), "{e}");
    // A weight ending inside layer 1's V pool.
    weights.insert("extra".to_string(), bf16(0x40_0000 - 16, vec![16]));
    let e = Regions::of(&p, &memory_case(&weights, 0x100)).unwrap_err().to_string();
    assert!(e.contains("weight extra") && e.contains("v_cache[1]"), "{e}");
    // Interleaved layers' pools are the caller's to lay out (check_kv proves each layer).
    weights.remove("extra");
    let mut m = memory_case(&weights, 0x100);
    m.kv = KvRegistration::dense(vec![0x10_0000, 0x10_0080], vec![0x30_0000, 0x30_0080], 100, 128, 64);
    assert!(Regions::of(&p, &m).is_ok());
}

#[test]
fn a_steps_tensors_must_not_overwrite_registered_memory_or_each_other() {
    let p = plan();
    let weights = HashMap::from([("fc.weight".to_string(), bf16(0x50_0000, vec![256, 512]))]);
    let r = Regions::of(&p, &memory_case(&weights, 0x100)).expect("registers");
    let t = |name, ptr, row, written| StepTensor {
        name,
        ptr,
        row,
        written,
    };
    // 4 requests: hidden rows of 1 KiB in, 512 B out.
    let input = t(io::HIDDEN_STATES, 0x90_0000, 1024, false);
    let out = t("outputs.hidden_states", 0xa0_0000, 512, true);
    assert!(r
        .check_step(&[input, out, t("outputs.logits", 0, 64, true)], 4, 4)
        .is_ok());
    // The batch first: [1, max_requests] (8), before any extent is computed from it.
    for b in [0, 9, u64::MAX] {
        let e = r.check_step(&[input, out], b, 4).unwrap_err();
        assert!(e.starts_with("b: ") && e.contains("[1, 8]"), "{e}");
    }
    // An output over the pool, the table or a weight.
    for (at, what) in [
        (0x10_0000 + 64, "k_cache[0]"),
        (0x100, "req_to_token"),
        (0x50_0100, "weight fc.weight"),
    ] {
        let e = r
            .check_step(&[input, t("outputs.hidden_states", at, 512, true)], 4, 4)
            .unwrap_err();
        assert!(e.starts_with("outputs.hidden_states") && e.contains(what), "{e}");
    }
    // An input over the pool (the step writes K/V there); over the table or a weight it
    // is only read.
    let e = r
        .check_step(&[t(io::HIDDEN_STATES, 0x30_0000, 64, false), out], 4, 4)
        .unwrap_err();
    assert!(e.contains("v_cache[0]") && e.contains("writes K/V"), "{e}");
    assert!(r.check_step(&[t(io::PREFIX_LENS, 0x100, 4, false), out], 4, 4).is_ok());
    // Two outputs may not share; two inputs may.
    let e = r
        .check_step(&[out, t("outputs.logits", 0xa0_0000 + 1000, 16, true)], 4, 4)
        .unwrap_err();
    assert!(
        e.contains("outputs.hidden_states") && e.contains("outputs.logits"),
        "{e}"
    );
    assert!(r
        .check_step(&[input, t(io::INPUT_IDS, 0x90_0000, 64, false)], 4, 4)
        .is_ok());
    // An output over the step's own input rows (vLLM writes its hidden rows over its input
    // buffer) is fine in one replay and in consecutive ones, which read each chunk's rows
    // before writing its outputs, at rows no later chunk reads...
    let in_place = t("outputs.hidden_states", 0x90_0000, 512, true);
    assert!(r.check_step(&[input, in_place], 4, 4).is_ok());
    assert!(r.check_step(&[input, in_place], 4, 2).is_ok());
    // ...but not where a chunk's outputs land on a later chunk's inputs.
    let late = t("outputs.hidden_states", 0x90_0000 + 2048, 512, true);
    assert!(r.check_step(&[input, late], 4, 4).is_ok());
    let e = r.check_step(&[input, late], 4, 2).unwrap_err();
    assert!(e.contains("requests 0..2") && e.contains("later requests"), "{e}");
    // Whether an input must be copied before a host step (it shares memory with an output).
    assert!(shares_with_outputs(&input, &[input, in_place], 4));
    assert!(!shares_with_outputs(&input, &[input, out], 4));
}

#[test]
fn a_pools_extent_is_its_largest_offset_not_its_last_slots() {
    // 6 slots in pages of 4, a slot further from its page's start than the next page is
    // (slot stride 256 > page stride 128): slot 3 (page 0) lies past slot 5 (page 1).
    let g = KvGeometry {
        slots: 6,
        page: 4,
        page_stride: 128,
        slot_stride: 256,
        head_stride: 64,
    };
    assert_eq!(g.offset(5, 1, 63), Some(128 + 256 + 64 + 63));
    assert_eq!(g.offset(3, 1, 63), Some(768 + 64 + 63));
    assert_eq!(g.span(2, 64), Some(768 + 128));
    // Whole pages: the last slot is the largest (the runner registers whole pages).
    let whole = KvGeometry { slots: 8, ..g };
    assert_eq!(whole.span(2, 64), Some(128 + 3 * 256 + 128));
    assert_eq!(KvGeometry::dense(100, 128, 64).span(2, 64), Some(99 * 128 + 128));
    // An output over slot 3's K is over the registered pool.
    let p = plan();
    let weights = HashMap::new();
    let mut m = memory_case(&weights, 0x100);
    m.kv = KvRegistration {
        k: vec![0x10_0000, 0x20_0000],
        v: vec![0x30_0000, 0x40_0000],
        geom: g,
    };
    assert!(check_kv(&p, &m.kv).is_ok());
    let r = Regions::of(&p, &m).expect("registers");
    let slot3 = 0x10_0000 + 2 * 768;
    let out = StepTensor {
        name: "outputs.hidden_states",
        ptr: slot3,
        row: 16,
        written: true,
    };
    assert!(r.check_step(&[out], 1, 1).unwrap_err().contains("k_cache[0]"));
}
