//! The registration rules, one case per rule.

use super::*;
use specplan_format::{CaptureDesc, ModelDesc, RopeScaling, SpecDesc, TargetDesc, WeightDesc};

/// The facts these rules read: 2 layers, 2 kv heads of 64 (a slot of 128), N 4, page 4.
fn plan() -> Plan {
    let w = |name: &str, shape: Vec<u64>, sources: &[&str], packing: Packing| WeightDesc {
        name: name.into(),
        dtype: DType::Bf16,
        bytes: shape.iter().product::<u64>() * 2,
        shape,
        sources: sources.iter().map(|s| s.to_string()).collect(),
        packing,
        shard: Vec::new(),
        offset: 0,
    };
    Plan {
        name: "t".into(),
        compiler: "test".into(),
        model: ModelDesc {
            head: specplan_format::HeadKind::Eagle1,
            target_hidden: 256,
            draft_vocab: None,
            hidden: 256,
            intermediate: 688,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            layers: 2,
            vocab: 1000,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: RopeScaling::None,
            max_position_embeddings: 512,
            fc_bias: false,
        },
        spec: SpecDesc {
            topk: 4,
            num_steps: 3,
            num_draft_tokens: 4,
        },
        capture: CaptureDesc {
            page_size: 4,
            max_context_len: 512,
            max_pages_per_request: 128,
            kv_pool_pages: 100,
            max_requests: 8,
            scratch_page: 99,
            dtype: DType::Bf16,
            hot_vocab_size: None,
            outputs: specplan_format::HeadOutputs::TOPK,
            decode_verify: false,
            tp: specplan_format::TensorParallel::SINGLE,
        },
        target: TargetDesc { sm: 90, nvrtc: None },
        rope_inv_freq: vec![],
        layers: vec![],
        weights: vec![
            w(
                "embed_tokens.weight",
                vec![1000, 256],
                &["embed_tokens.weight"],
                Packing::Single,
            ),
            w(
                "layers.0.self_attn.qkv_proj.weight",
                vec![512, 256],
                &[
                    "layers.0.self_attn.q_proj.weight",
                    "layers.0.self_attn.k_proj.weight",
                    "layers.0.self_attn.v_proj.weight",
                ],
                Packing::ConcatRows,
            ),
        ],
        weight_bytes: 0,
        kernels: vec![],
        fusions: vec![],
        phases: vec![],
    }
}

/// A weight of the test plans.
fn desc(name: &str, dtype: DType, shape: Vec<u64>, sources: &[&str], packing: Packing) -> WeightDesc {
    WeightDesc {
        name: name.into(),
        dtype,
        bytes: shape.iter().product::<u64>() * dtype.size(),
        shape,
        sources: sources.iter().map(|s| s.to_string()).collect(),
        packing,
        shard: Vec::new(),
        offset: 0,
    }
}

/// A caller's bf16 tensor.
fn bf16(ptr: u64, shape: Vec<u64>) -> DeviceTensor {
    DeviceTensor {
        ptr,
        dtype: DType::Bf16,
        shape,
    }
}

fn kv_ok() -> KvRegistration {
    KvRegistration::dense(vec![0x10_0000, 0x20_0000], vec![0x30_0000, 0x40_0000], 100, 128, 64)
}

#[test]
fn kv_registration_rules() {
    let p = plan();
    assert!(check_kv(&p, &kv_ok()).is_ok());
    let mut kv = kv_ok();
    kv.k.pop();
    assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("2 layers"));
    let mut kv = kv_ok();
    kv.v[1] = 0x40_0008;
    assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("v_cache[1]"));
    let mut kv = kv_ok();
    kv.geom.page_stride = 130;
    assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("multiple of 8"));
    // A slot stride below a slot's two heads of 64: slots would overlap.
    let mut kv = kv_ok();
    kv.geom.slot_stride = 64;
    kv.geom.page_stride = 64;
    let e = check_kv(&p, &kv).unwrap_err().to_string();
    assert!(e.contains("share an address"), "{e}");
    let mut kv = kv_ok();
    kv.geom.slots = 0;
    assert!(check_kv(&p, &kv).is_err());
    let mut kv = kv_ok();
    kv.k[0] = u64::MAX - 15;
    assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("overflows"));
    // A layer's pool past 2^32 - 1 sixteen-byte units (the attention's 32-bit key offsets).
    let mut kv = kv_ok();
    kv.geom.slots = 1 << 28;
    kv.geom.slot_stride = 256;
    kv.geom.page_stride = 256;
    let e = check_kv(&p, &kv).unwrap_err().to_string();
    assert!(e.contains("the attention addresses"), "{e}");
    // One tensor passed as K and V of a layer, or as two layers' pools.
    let mut kv = kv_ok();
    kv.v[0] = kv.k[0];
    let e = check_kv(&p, &kv).unwrap_err().to_string();
    assert!(
        e.contains("v_cache[0]: is k_cache[0]") && e.contains("must not share memory"),
        "{e}"
    );
    let mut kv = kv_ok();
    kv.k[1] = kv.k[0];
    let e = check_kv(&p, &kv).unwrap_err().to_string();
    assert!(e.contains("k_cache[1]") && e.contains("as k_cache[0] does"), "{e}");
    let mut kv = kv_ok();
    kv.k[1] = kv.v[0];
    let e = check_kv(&p, &kv).unwrap_err().to_string();
    assert!(e.contains("k_cache[1]") && e.contains("v_cache[0]"), "{e}");
}

/// The engines' layouts in place: SGLang NHD and HND pools, vLLM's packed `[.., 2·D]`
/// tensors with V at K + D (NHD and HND); overlapping K and V are refused.
#[test]
fn engine_kv_layouts_register_in_place() {
    let p = plan();
    let (h, d) = (2u64, 64u64);
    // SGLang HND: (pages, H, P, D) with P = 4.
    let hnd = KvGeometry {
        slots: 400,
        page: 4,
        page_stride: h * 4 * d,
        slot_stride: d,
        head_stride: 4 * d,
    };
    let reg = |k: u64, v: u64, geom| KvRegistration {
        k: vec![k, k + (1 << 24)],
        v: vec![v, v + (1 << 24)],
        geom,
    };
    assert!(check_kv(&p, &reg(0x100_0000, 0x180_0000, hnd)).is_ok());
    // vLLM NHD: [blocks, block 16, H, 2D], V = K + D elements.
    let vllm = KvGeometry {
        slots: 16 * 10,
        page: 16,
        page_stride: 16 * h * 2 * d,
        slot_stride: h * 2 * d,
        head_stride: 2 * d,
    };
    assert!(check_kv(&p, &reg(0x100_0000, 0x100_0000 + d * 2, vllm)).is_ok());
    assert_eq!(vllm.canonical().page, 1, "back-to-back blocks need no division");
    // vLLM HND: [blocks, H, block, 2D].
    let vllm_hnd = KvGeometry {
        slots: 16 * 10,
        page: 16,
        page_stride: h * 16 * 2 * d,
        slot_stride: 2 * d,
        head_stride: 16 * 2 * d,
    };
    assert!(check_kv(&p, &reg(0x100_0000, 0x100_0000 + d * 2, vllm_hnd)).is_ok());
    assert_eq!(vllm_hnd.canonical().page, 16);
    // V at K + D/2 would overlap K's elements.
    let e = check_kv(&p, &reg(0x100_0000, 0x100_0000 + d, vllm))
        .unwrap_err()
        .to_string();
    assert!(e.contains("share an address"), "{e}");
    // Element offsets follow the geometry.
    assert_eq!(hnd.offset(5, 1, 3), Some(2 * 4 * 64 + 64 + 4 * 64 + 3));
}

#[test]
fn table_registration_rules() {
    let p = plan();
    let t = TableRegistration {
        ptr: 0x100,
        mode: TableMode::TokenSlots,
        rows: 4,
        cols: 64,
        stride: 64,
        page_size: 1,
    };
    assert!(check_table(&p, &t).is_ok());
    let e = check_table(
        &p,
        &TableRegistration {
            page_size: 4,
            ..t.clone()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("one token per entry"), "{e}");
    assert!(check_table(
        &p,
        &TableRegistration {
            stride: 63,
            ..t.clone()
        }
    )
    .is_err());
    assert!(check_table(
        &p,
        &TableRegistration {
            ptr: 0x102,
            ..t.clone()
        }
    )
    .is_err());
    // Four token columns cannot hold N = 4 new positions after any prefix.
    let e = check_table(
        &p,
        &TableRegistration {
            cols: 4,
            stride: 4,
            ..t.clone()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("req_to_token"), "{e}");
    // Page ids: 2 pages of 4 tokens are 8 positions.
    assert!(check_table(
        &p,
        &TableRegistration {
            mode: TableMode::PageIds,
            cols: 2,
            stride: 2,
            page_size: 4,
            ..t.clone()
        }
    )
    .is_ok());
    // A block size other than the plan's page_size would land on other tokens' slots.
    let e = check_table(
        &p,
        &TableRegistration {
            mode: TableMode::PageIds,
            cols: 2,
            stride: 2,
            page_size: 16,
            ..t
        },
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("block_table: 16 tokens per entry, the plan needs 4"),
        "{e}"
    );
}

/// A token-slot table of 4 rows of 64 entries, 80 apart (the layout-word tests' table).
fn table_words_case() -> TableRegistration {
    TableRegistration {
        ptr: 0x100,
        mode: TableMode::TokenSlots,
        rows: 4,
        cols: 64,
        stride: 80,
        page_size: 1,
    }
}

#[test]
fn layout_words_follow_the_kernels_indices() {
    let t = table_words_case();
    let w = layout_words(&kv_ok(), &t);
    assert_eq!(w[kv::KV_WORD_MODE], 1);
    assert_eq!(
        (
            w[kv::KV_WORD_TABLE_ROWS],
            w[kv::KV_WORD_TABLE_COLS],
            w[kv::KV_WORD_TABLE_STRIDE]
        ),
        (4, 64, 80)
    );
    assert_eq!((w[kv::KV_WORD_SLOTS], w[kv::KV_WORD_KV_STRIDE]), (100, 128));
    assert_eq!(
        (
            w[kv::KV_WORD_PHYS_PAGE],
            w[kv::KV_WORD_PAGE_STRIDE],
            w[kv::KV_WORD_HEAD_STRIDE]
        ),
        (1, 128, 64)
    );
}

#[test]
fn one_slot_pages_step_the_page_stride() {
    // An HND pool at page size 1 ([pages, H, 1, D]): the slot stride within a page is D, but
    // consecutive slots are a page (H·D) apart; the kernels step KV_WORD_KV_STRIDE when a
    // page holds one slot, so that word must be the page stride (as `offset` places slots).
    let (h, d) = (4u64, 64u64);
    let g = KvGeometry {
        slots: 100,
        page: 1,
        page_stride: h * d,
        slot_stride: d,
        head_stride: d,
    };
    let kv = KvRegistration {
        k: vec![0x1000],
        v: vec![0x100000],
        geom: g,
    };
    let t = table_words_case();
    let w = layout_words(&kv, &t);
    assert_eq!(w[kv::KV_WORD_KV_STRIDE], (h * d) as i64);
    for t in [0u64, 1, 57] {
        assert_eq!(g.offset(t, 1, 3), Some(t * w[kv::KV_WORD_KV_STRIDE] as u64 + d + 3));
    }
}

/// The kernels' `kv_at` (kernels/cuda/common.cuh) on the layout words: slot t's offset.
fn device_kv_at(w: &[i64; kv::KV_WORDS], t: u64) -> u64 {
    let (stride, page, page_stride) = (
        w[kv::KV_WORD_KV_STRIDE] as u64,
        w[kv::KV_WORD_PHYS_PAGE] as u64,
        w[kv::KV_WORD_PAGE_STRIDE] as u64,
    );
    if page == 1 {
        t * stride
    } else {
        t / page * page_stride + t % page * stride
    }
}

#[test]
fn the_device_places_every_slot_where_the_registration_checked_it() {
    // Every geometry the registration accepts: the kernels' addressing (from the layout
    // words) must put each slot where `KvGeometry::offset` (what the registration's bounds
    // and aliasing checks use) puts it. Pages of 1, 2, 16 tokens; dense, HND, padded pages.
    let t = table_words_case();
    let (h, d) = (4u64, 64u64);
    for page in [1u64, 2, 16] {
        for (slot_stride, head_stride, page_stride) in [
            (h * d, d, page * h * d),             // NHD pages back to back
            (d, page * d, h * page * d),          // HND
            (h * d, d, page * h * d + 8 * 64),    // NHD with padding between pages
            (2 * h * d, 2 * d, page * 2 * h * d), // vLLM's packed K|V
        ] {
            let g = KvGeometry {
                slots: 40 * page,
                page,
                page_stride,
                slot_stride,
                head_stride,
            };
            let kv = KvRegistration {
                k: vec![0x1000],
                v: vec![0x1000_0000],
                geom: g,
            };
            let w = layout_words(&kv, &t);
            for slot in 0..g.slots {
                assert_eq!(
                    Some(device_kv_at(&w, slot)),
                    g.offset(slot, 0, 0),
                    "page {page}, strides slot {slot_stride} head {head_stride} page {page_stride}: slot {slot}"
                );
            }
        }
    }
}

#[test]
fn weights_bind_in_place_or_packed() {
    let p = plan();
    let t = |ptr: u64, shape: Vec<u64>| DeviceTensor {
        ptr,
        dtype: DType::Bf16,
        shape,
    };
    let mut tensors = HashMap::new();
    tensors.insert("embed_tokens.weight".to_string(), t(0x10_0000, vec![1000, 256]));
    tensors.insert(
        "layers.0.self_attn.q_proj.weight".to_string(),
        t(0x20_0000, vec![256, 256]),
    );
    tensors.insert(
        "layers.0.self_attn.k_proj.weight".to_string(),
        t(0x30_0000, vec![128, 256]),
    );
    tensors.insert(
        "layers.0.self_attn.v_proj.weight".to_string(),
        t(0x40_0000, vec![128, 256]),
    );
    let b = bind_weights(&p, &tensors, &|_| None).expect("binds");
    assert_eq!(b[0], WeightBinding::InPlace(0x10_0000));
    assert_eq!(
        b[1],
        WeightBinding::Concat(vec![
            (0x20_0000, 256 * 256 * 2),
            (0x30_0000, 128 * 256 * 2),
            (0x40_0000, 128 * 256 * 2)
        ])
    );
    // The packed weight itself, when given, is used in place.
    tensors.insert(
        "layers.0.self_attn.qkv_proj.weight".to_string(),
        t(0x50_0000, vec![512, 256]),
    );
    assert_eq!(
        bind_weights(&p, &tensors, &|_| None).expect("binds")[1],
        WeightBinding::InPlace(0x50_0000)
    );
    // Each part's rows, not only their sum: a q of 320 rows beside a k of 64 is refused
    // naming the q (their 384 rows equal 256 + 128).
    let mut split = tensors.clone();
    split.remove("layers.0.self_attn.qkv_proj.weight");
    split.insert(
        "layers.0.self_attn.q_proj.weight".to_string(),
        t(0x20_0000, vec![320, 256]),
    );
    split.insert(
        "layers.0.self_attn.k_proj.weight".to_string(),
        t(0x30_0000, vec![64, 256]),
    );
    let e = bind_weights(&p, &split, &|_| None).unwrap_err().to_string();
    assert!(
        e.contains("layers.0.self_attn.q_proj.weight") && e.contains("256"),
        "{e}"
    );
    // A wrong shape names the tensor and both shapes; a missing source is named.
    tensors.get_mut("embed_tokens.weight").expect("embed").shape[0] = 999;
    let e = bind_weights(&p, &tensors, &|_| None).unwrap_err().to_string();
    assert!(e.contains("embed_tokens.weight") && e.contains("expected"), "{e}");
    tensors.remove("embed_tokens.weight");
    let e = bind_weights(&p, &tensors, &|_| None).unwrap_err().to_string();
    assert!(e.contains("neither it nor its source"), "{e}");
    tensors.insert("embed_tokens.weight".to_string(), t(0x10_0008, vec![1000, 256]));
    let e = bind_weights(&p, &tensors, &|_| None).unwrap_err().to_string();
    assert!(e.contains("16-byte"), "{e}");
}

/// `LeadingRows` (a tied EAGLE-3 head's lm_head): the source in place when it has at least
/// the weight's rows and its columns; fewer rows are refused naming the source.
#[test]
fn leading_rows_bind_in_place() {
    let mut p = plan();
    p.weights.push(desc(
        "lm_head.weight",
        DType::Bf16,
        vec![600, 256],
        &["embed_tokens.weight"],
        Packing::LeadingRows,
    ));
    let t = bf16;
    let mut tensors = HashMap::new();
    tensors.insert("embed_tokens.weight".to_string(), t(0x10_0000, vec![1000, 256]));
    for (name, rows) in [("q", 256), ("k", 128), ("v", 128)] {
        tensors.insert(
            format!("layers.0.self_attn.{name}_proj.weight"),
            t(0x20_0000 + rows * 0x1000, vec![rows, 256]),
        );
    }
    let b = bind_weights(&p, &tensors, &|_| None).expect("binds");
    assert_eq!(b.last(), Some(&WeightBinding::InPlace(0x10_0000)));
    let mut small = p.clone();
    small.weights.last_mut().expect("lm_head").shape[0] = 1001;
    let e = bind_weights(&small, &tensors, &|_| None).unwrap_err().to_string();
    assert!(
        e.contains("embed_tokens.weight: 1000 rows") && e.contains("first 1001"),
        "{e}"
    );
}

/// FR-Spec's hot ids and EAGLE-3's d2t are one-to-one maps: a repeated id is refused naming
/// both places (the top-K would otherwise emit one token under several of its places).
#[test]
fn id_maps_must_be_one_to_one() {
    assert_eq!(first_repeat([3, 1, 4, 1, 5]), Some((1, 3, 1)));
    assert_eq!(first_repeat([3, 1, 4]), None);
    let mut p = plan();
    p.weights
        .push(desc("d2t", DType::I64, vec![4], &["d2t"], Packing::Single));
    check_d2t(&p, Some(&[10, 10, 10, 10])).expect("d -> d + 10 is one to one");
    // Draft ids 0 and 1 both map to target id 5.
    let e = check_d2t(&p, Some(&[5, 4, 0, 0])).unwrap_err().to_string();
    assert!(
        e.contains("d2t[1]") && e.contains("d2t[0]") && e.contains("one to one"),
        "{e}"
    );
    // The hot rows of lm_head, gathered by hot_token_ids: a repeated id is refused.
    p.weights.push(desc(
        "lm_head.hot",
        DType::Bf16,
        vec![3, 256],
        &["lm_head.weight", "hot_token_ids"],
        Packing::GatherRows,
    ));
    let mut tensors = HashMap::new();
    tensors.insert("embed_tokens.weight".to_string(), bf16(0x10_0000, vec![1000, 256]));
    tensors.insert(
        "layers.0.self_attn.qkv_proj.weight".to_string(),
        bf16(0x20_0000, vec![512, 256]),
    );
    tensors.insert("lm_head.weight".to_string(), bf16(0x30_0000, vec![1000, 256]));
    tensors.insert(
        "d2t".to_string(),
        DeviceTensor {
            ptr: 0x40_0000,
            dtype: DType::I64,
            shape: vec![4],
        },
    );
    let ids = |v: Vec<i64>| move |name: &str| (name == "hot_token_ids").then(|| v.clone());
    bind_weights(&p, &tensors, &ids(vec![7, 3, 999])).expect("distinct hot ids bind");
    let e = bind_weights(&p, &tensors, &ids(vec![7, 3, 7])).unwrap_err().to_string();
    assert!(
        e.contains("hot_token_ids[2] repeats id 7") && e.contains("hot_token_ids[0]"),
        "{e}"
    );
    // The top-K's own map, checked whether or not lm_head.hot is gathered here.
    p.weights.push(desc(
        "hot_token_ids",
        DType::I64,
        vec![3],
        &["hot_token_ids"],
        Packing::Single,
    ));
    check_hot_ids(&p, Some(&[7, 3, 999])).expect("distinct ids in range");
    let e = check_hot_ids(&p, Some(&[7, 3, 7])).unwrap_err().to_string();
    assert!(e.contains("hot_token_ids[2] repeats id 7"), "{e}");
    let e = check_hot_ids(&p, Some(&[7, 1000, 3])).unwrap_err().to_string();
    assert!(
        e.contains("hot_token_ids[1] is 1000, outside the vocabulary [0, 1000)"),
        "{e}"
    );
    let e = check_hot_ids(&p, None).unwrap_err().to_string();
    assert!(e.contains("1-D i64 tensor of 3"), "{e}");
}

// The byte-range rules (regions.rs).
#[path = "tests_regions.rs"]
mod regions_cases;
