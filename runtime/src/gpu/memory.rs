//! Where a runtime's tensors live. Both modes resolve every launch argument here, so the
//! launches are issued by one code path:
//! - owned memory (`GpuRuntime::new`): the runtime allocates the weight region (uploaded
//!   from the host), a K/V pool of the plan's pages and its own page table (page ids);
//! - engine memory (`GpuRuntime::with_engine_memory`): the caller registers its K/V pool
//!   (per layer a K and a V address, a slot stride), its page table (token slots or page
//!   ids, a row stride) and its weights (device tensors, used in place) once; the graphs are
//!   captured against those addresses, and no byte of them is ever copied.
//!
//! Either way the kernels see the cache through the layout words (`specplan_kernels::kv`),
//! written once at load into the runtime's small `meta` allocation beside the step status.

use std::collections::HashMap;

use specplan_format::{ArgValue, BucketPlan, DType, KvKind, Packing, Plan};
use specplan_kernels::kv::{self, TableMode};

use super::device::{DevMem, GpuError};

/// A caller's device tensor: address, element type and shape (row-major, contiguous).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceTensor {
    pub ptr: u64,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

impl DeviceTensor {
    pub fn elems(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// The caller's K/V pool: per layer a K and a V address; token slot `t` of a layer starts
/// at `k[layer] + t · stride` elements of the plan's activation type.
#[derive(Clone, Debug, PartialEq)]
pub struct KvRegistration {
    pub k: Vec<u64>,
    pub v: Vec<u64>,
    /// Token slots of each pool (valid slot indices are `[0, slots)`).
    pub slots: u64,
    /// Elements between consecutive token slots (at least `kv_heads · head_dim`).
    pub stride: u64,
}

/// The caller's page table: `rows` request rows of `cols` i32 entries, `stride` entries
/// apart.
#[derive(Clone, Debug, PartialEq)]
pub struct TableRegistration {
    pub ptr: u64,
    pub mode: TableMode,
    pub rows: u64,
    pub cols: u64,
    pub stride: u64,
    /// Tokens one entry covers: 1 for token slots; the engine's block size for page ids,
    /// which must equal the plan's `page_size` (the kernels compute a token's slot as
    /// `page · page_size + position mod page_size`; another block size would read and
    /// write other tokens' K/V without leaving the pool, so no device rule could see it).
    pub page_size: u64,
}

/// Everything an engine registers once.
pub struct EngineMemory<'a> {
    pub kv: KvRegistration,
    pub table: TableRegistration,
    /// The draft head's weights on the device, by name: a plan weight's own name (e.g. the
    /// packed `layers.0.self_attn.qkv_proj.weight`) is used in place; otherwise its sources
    /// (`q_proj`, `k_proj`, `v_proj`, ...) are packed once at load into runtime memory.
    pub weights: &'a HashMap<String, DeviceTensor>,
}

fn bad(what: &str, msg: String) -> GpuError {
    GpuError::Registration(format!("{what}: {msg}"))
}

/// Checks a K/V registration against the plan: one K and V per layer, 16-byte aligned,
/// a stride of whole 16-byte rows at least a slot wide, a pool the kernels can index.
pub fn check_kv(plan: &Plan, kv: &KvRegistration) -> Result<(), GpuError> {
    let layers = plan.model.layers as usize;
    let row = plan.model.kv_heads as u64 * plan.model.head_dim as u64;
    if kv.k.len() != layers || kv.v.len() != layers {
        return Err(bad(
            "k_cache/v_cache",
            format!(
                "{} K and {} V pools, the plan has {layers} layers",
                kv.k.len(),
                kv.v.len()
            ),
        ));
    }
    for (name, ptrs) in [("k_cache", &kv.k), ("v_cache", &kv.v)] {
        if let Some((l, p)) = ptrs.iter().enumerate().find(|(_, &p)| p == 0 || !p.is_multiple_of(16)) {
            return Err(bad(
                &format!("{name}[{l}]"),
                format!("address {p:#x} is null or not 16-byte aligned"),
            ));
        }
    }
    if kv.stride < row || !kv.stride.is_multiple_of(8) {
        return Err(bad(
            "k_cache/v_cache",
            format!(
                "slot stride {} must be a multiple of 8 elements and at least kv_heads · head_dim = {row}",
                kv.stride
            ),
        ));
    }
    if kv.slots == 0 || kv.slots > i32::MAX as u64 {
        return Err(bad(
            "k_cache/v_cache",
            format!("{} token slots is outside [1, 2^31 - 1]", kv.slots),
        ));
    }
    let bytes = kv
        .slots
        .checked_mul(kv.stride)
        .and_then(|e| e.checked_mul(plan.capture.dtype.size()));
    for (name, ptrs) in [("k_cache", &kv.k), ("v_cache", &kv.v)] {
        if let Some((l, _)) = ptrs
            .iter()
            .enumerate()
            .find(|(_, &p)| bytes.and_then(|b| p.checked_add(b)).is_none())
        {
            return Err(bad(
                &format!("{name}[{l}]"),
                "the pool's end overflows the address space".into(),
            ));
        }
    }
    Ok(())
}

/// Checks a page-table registration: a non-null 4-byte aligned table of at least one row,
/// rows wide enough for one step's positions and `stride ≥ cols`.
pub fn check_table(plan: &Plan, t: &TableRegistration) -> Result<(), GpuError> {
    let what = match t.mode {
        TableMode::TokenSlots => "req_to_token",
        TableMode::PageIds => "block_table",
    };
    if t.ptr == 0 || !t.ptr.is_multiple_of(4) {
        return Err(bad(what, format!("address {:#x} is null or not 4-byte aligned", t.ptr)));
    }
    if t.rows == 0 || t.rows > i32::MAX as u64 || t.cols == 0 || t.cols > i32::MAX as u64 {
        return Err(bad(
            what,
            format!(
                "shape [{}, {}] must have rows and columns in [1, 2^31 - 1]",
                t.rows, t.cols
            ),
        ));
    }
    let want = match t.mode {
        TableMode::TokenSlots => 1,
        TableMode::PageIds => plan.capture.page_size as u64,
    };
    if t.page_size != want {
        return Err(bad(
            what,
            format!(
                "{} tokens per entry, the plan needs {want} ({})",
                t.page_size,
                match t.mode {
                    TableMode::TokenSlots => "a token-slot table maps one token per entry",
                    TableMode::PageIds => "the plan's page_size: compile the plan with the engine's block size",
                }
            ),
        ));
    }
    if t.stride < t.cols {
        return Err(bad(
            what,
            format!("row stride {} is below the {} columns", t.stride, t.cols),
        ));
    }
    let n = plan.spec.num_draft_tokens as u64;
    let positions = match t.mode {
        TableMode::TokenSlots => t.cols,
        TableMode::PageIds => t.cols.saturating_mul(plan.capture.page_size as u64),
    };
    if positions <= n {
        return Err(bad(
            what,
            format!("rows cover {positions} positions, a step needs more than num_draft_tokens = {n}"),
        ));
    }
    Ok(())
}

/// The layout words of a registration (`specplan_kernels::kv`).
pub fn layout_words(kv: &KvRegistration, t: &TableRegistration) -> [i64; kv::KV_WORDS] {
    let mut w = [0i64; kv::KV_WORDS];
    w[kv::KV_WORD_MODE] = t.mode.word();
    w[kv::KV_WORD_TABLE_ROWS] = t.rows as i64;
    w[kv::KV_WORD_TABLE_COLS] = t.cols as i64;
    w[kv::KV_WORD_TABLE_STRIDE] = t.stride as i64;
    w[kv::KV_WORD_SLOTS] = kv.slots as i64;
    w[kv::KV_WORD_KV_STRIDE] = kv.stride as i64;
    w
}

/// How each plan weight is found among the caller's tensors: in place (its own name), or
/// packed from its sources (concatenated rows or gathered rows), or missing.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightBinding {
    InPlace(u64),
    /// Source tensors to copy, in order, each `(address, bytes)`; gathered rows name the
    /// table and the ids separately.
    Concat(Vec<(u64, u64)>),
    Gather {
        table: u64,
        row_bytes: u64,
        ids: Vec<i64>,
    },
}

/// Binds every plan weight to the caller's tensors (pure: no device access). Gathered
/// FR-Spec rows need the ids on the host: `host_ids` gives them by tensor name.
pub fn bind_weights(
    plan: &Plan,
    tensors: &HashMap<String, DeviceTensor>,
    host_ids: &dyn Fn(&str) -> Option<Vec<i64>>,
) -> Result<Vec<WeightBinding>, GpuError> {
    let act = plan.capture.dtype;
    let check = |name: &str, t: &DeviceTensor, dtype: DType, shape: &[u64]| -> Result<(), GpuError> {
        if t.dtype != dtype || t.shape != shape {
            return Err(GpuError::Weights(format!(
                "{name}: {} {:?}, expected {} {shape:?}",
                t.dtype.name(),
                t.shape,
                dtype.name()
            )));
        }
        if t.ptr == 0 || !t.ptr.is_multiple_of(16) {
            return Err(GpuError::Weights(format!(
                "{name}: address {:#x} is null or not 16-byte aligned",
                t.ptr
            )));
        }
        Ok(())
    };
    let mut out = Vec::with_capacity(plan.weights.len());
    for w in &plan.weights {
        if let Some(t) = tensors.get(&w.name) {
            check(&w.name, t, w.dtype, &w.shape)?;
            out.push(WeightBinding::InPlace(t.ptr));
            continue;
        }
        let missing = |s: &str| GpuError::Weights(format!("{}: neither it nor its source {s} was given", w.name));
        let cols: u64 = w.shape.iter().skip(1).product();
        match w.packing {
            Packing::Single => {
                let s = &w.sources[0];
                let t = tensors.get(s).ok_or_else(|| missing(s))?;
                check(s, t, w.dtype, &w.shape)?;
                out.push(WeightBinding::InPlace(t.ptr));
            }
            Packing::ConcatRows => {
                let mut parts = Vec::new();
                let mut rows = 0u64;
                for s in &w.sources {
                    let t = tensors.get(s).ok_or_else(|| missing(s))?;
                    let r = t.shape.first().copied().unwrap_or(0);
                    check(s, t, act, &[r, cols])?;
                    rows += r;
                    parts.push((t.ptr, r * cols * act.size()));
                }
                if rows != w.shape[0] {
                    return Err(GpuError::Weights(format!(
                        "{}: its sources have {rows} rows, the plan packs {}",
                        w.name, w.shape[0]
                    )));
                }
                out.push(WeightBinding::Concat(parts));
            }
            Packing::GatherRows => {
                let (ts, is) = (&w.sources[0], &w.sources[1]);
                let table = tensors.get(ts).ok_or_else(|| missing(ts))?;
                let vocab = plan.model.vocab as u64;
                check(ts, table, act, &[vocab, cols])?;
                let ids = host_ids(is).ok_or_else(|| {
                    GpuError::Weights(format!(
                        "{}: neither it nor its source {is} (a 1-D i64 tensor of {} vocabulary ids) was given",
                        w.name, w.shape[0]
                    ))
                })?;
                if ids.len() as u64 != w.shape[0] || ids.iter().any(|&x| x < 0 || x as u64 >= vocab) {
                    return Err(GpuError::Weights(format!(
                        "{is}: {} ids, expected {} in [0, {vocab})",
                        ids.len(),
                        w.shape[0]
                    )));
                }
                out.push(WeightBinding::Gather {
                    table: table.ptr,
                    row_bytes: cols * act.size(),
                    ids,
                });
            }
        }
    }
    Ok(out)
}

/// The device memory a runtime launches against.
pub(crate) struct Memory {
    pub arena: DevMem,
    /// Device address of each plan weight.
    pub weights: Vec<u64>,
    pub kv: KvRegistration,
    pub table: TableRegistration,
    /// Layout words, then status words (i64).
    pub meta: DevMem,
    /// Allocations the runtime owns behind `weights`, `kv` and `table` (owned mode, packed
    /// weights); kept alive, never read directly.
    pub _owned: Vec<DevMem>,
}

impl Memory {
    pub fn layout_ptr(&self) -> u64 {
        self.meta.ptr
    }

    pub fn status_ptr(&self) -> u64 {
        self.meta.ptr + (kv::KV_WORDS * 8) as u64
    }

    /// The device address an argument names (0 for null and `u32`s).
    pub fn arg_ptr(&self, plan: &Plan, b: &BucketPlan, v: &ArgValue) -> u64 {
        match v {
            ArgValue::Buffer(id) => self.arena.ptr + b.buffers.get(*id as usize).map_or(0, |x| x.offset),
            ArgValue::Weight(id) => self.weights.get(*id as usize).copied().unwrap_or(0),
            ArgValue::KvCache { layer, kind } => {
                let pools = if *kind == KvKind::K { &self.kv.k } else { &self.kv.v };
                pools.get(*layer as usize).copied().unwrap_or(0)
            }
            ArgValue::PageTable => self.table.ptr,
            ArgValue::KvLayout => self.layout_ptr(),
            ArgValue::Null | ArgValue::U32(_) => {
                let _ = plan;
                0
            }
        }
    }
}

#[cfg(test)]
mod tests {
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
            buckets: vec![],
        }
    }

    fn kv_ok() -> KvRegistration {
        KvRegistration {
            k: vec![0x1000, 0x2000],
            v: vec![0x3000, 0x4000],
            slots: 100,
            stride: 128,
        }
    }

    #[test]
    fn kv_registration_rules() {
        let p = plan();
        assert!(check_kv(&p, &kv_ok()).is_ok());
        let mut kv = kv_ok();
        kv.k.pop();
        assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("2 layers"));
        let mut kv = kv_ok();
        kv.v[1] = 0x3008;
        assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("v_cache[1]"));
        let mut kv = kv_ok();
        kv.stride = 120;
        assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("stride"));
        let mut kv = kv_ok();
        kv.slots = 0;
        assert!(check_kv(&p, &kv).is_err());
        let mut kv = kv_ok();
        kv.k[0] = u64::MAX - 15;
        assert!(check_kv(&p, &kv).unwrap_err().to_string().contains("overflows"));
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

    #[test]
    fn layout_words_follow_the_kernels_indices() {
        let t = TableRegistration {
            ptr: 0x100,
            mode: TableMode::TokenSlots,
            rows: 4,
            cols: 64,
            stride: 80,
            page_size: 1,
        };
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
}
