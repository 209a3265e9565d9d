//! Validation of kernels against the plan's facts: what each entry point reads and writes.
//!
//! Names, kinds and offsets of arguments are checked in `validate.rs`; here every
//! specialization constant must equal the plan fact it encodes, every `u32` argument the
//! bucket's value, and every buffer or weight argument must hold at least the elements the
//! kernel touches, in the dtype it reads. A plan that passes cannot make a kernel (or the
//! CPU executor, which interprets the same launches) index outside an allocation.

use super::types::*;

/// Plan-wide constant checks for one kernel (independent of buckets).
pub(super) fn kernel_constants(p: &Plan, k: &KernelDesc) -> Vec<String> {
    let m = &p.model;
    let c = &p.capture;
    let mut errs = Vec::new();
    let want_u32 = |name: &str| -> Option<u64> {
        Some(match name {
            "HIDDEN" => m.hidden as u64,
            "VOCAB" | "FULL_VOCAB" => m.vocab as u64,
            "HEADS" => m.heads as u64,
            "KV_HEADS" => m.kv_heads as u64,
            "HEAD_DIM" => m.head_dim as u64,
            "N" => p.spec.num_draft_tokens as u64,
            "PAGE_SIZE" => c.page_size as u64,
            "MAX_PAGES" => c.max_pages_per_request as u64,
            "SLOTS" => p.page_table_rows(),
            "INTER" => m.intermediate as u64,
            "TOPK" => p.spec.topk as u64,
            "COLS" => c.hot_vocab_size.unwrap_or(m.vocab) as u64,
            _ => return None,
        })
    };
    for (name, v) in &k.constants {
        let bad = match (name.as_str(), v) {
            ("KV_TILE", ConstValue::U32(t)) => ![16, 32, 64].contains(t),
            ("STAGES", ConstValue::U32(t)) => !(2..=4).contains(t),
            ("WINDOW", ConstValue::U32(w)) => *w != 0 && !p.layers.iter().any(|l| l.window == Some(*w)),
            ("EPS", ConstValue::F32(x)) => x.to_bits() != m.rms_norm_eps.to_bits(),
            ("SCALE", ConstValue::F32(x)) => !(x.is_finite() && *x > 0.0),
            ("INV_FREQ", ConstValue::F32Array(xs)) => *xs != p.rope_inv_freq,
            ("HAS_BIAS", ConstValue::Bool(b)) => *b != m.fc_bias,
            ("HOT_MAP", ConstValue::Bool(b)) => *b != c.hot_vocab_size.is_some(),
            ("act_t", ConstValue::Type(t)) => {
                t != if c.dtype == DType::F16 {
                    "__half"
                } else {
                    "__nv_bfloat16"
                }
            }
            (n, ConstValue::U32(x)) => want_u32(n).is_some_and(|want| *x as u64 != want),
            _ => false,
        };
        if bad {
            errs.push(format!(
                "kernels ({}): constant {name} = {v:?} does not match the plan",
                k.name
            ));
        }
    }
    errs
}

/// What an entry's code assumes about its launch: the exact block (kernels index their
/// shared memory and loops by compile-time thread counts) and the least dynamic shared
/// memory. These mirror `specplan_kernels::geometry` (the runtime does not depend on the
/// kernels crate); a plan the compiler wrote meets them exactly.
pub(super) fn launch_shape(p: &Plan, k: &KernelDesc, block: [u32; 3], smem: u32) -> Vec<String> {
    let m = &p.model;
    let c = |name: &str| -> u64 {
        k.constants
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| {
                if let ConstValue::U32(x) = v {
                    Some(*x as u64)
                } else {
                    None
                }
            })
            .unwrap_or(0)
    };
    let act = p.capture.dtype.size();
    let topk_smem = 512 * p.spec.topk as u64 * 8;
    let (threads, least_smem): (u32, u64) = match k.entry.as_str() {
        "embed_concat" | "rmsnorm" | "silu_mul" | "select_rows" => (256, 0),
        "rope_append" => (128, 0),
        "attn_partial" => {
            // q rows of one pass (≤ 64 packed rows, padded to 16), then the larger of the
            // K/V stages and the cross-warp merge area (attention.cu's header).
            let rows = p.spec.num_draft_tokens as u64 * (m.heads / m.kv_heads.max(1)) as u64;
            let (d, tile, stages) = (m.head_dim as u64, c("KV_TILE"), c("STAGES"));
            let pass = rows.div_ceil(16).clamp(1, 4) * 16;
            let merge = 4 * 16 * d * 4 + 4 * 16 * 2 * 4;
            (128, pass * d * act + (stages * 2 * tile * d * act).max(merge))
        }
        "attn_merge" => (m.head_dim, 0),
        "softmax_topk" | "topk_partial" => (512, topk_smem),
        "topk_merge" => (32, 0),
        _ => return Vec::new(),
    };
    let mut errs = Vec::new();
    if block != [threads, 1, 1] {
        errs.push(format!("block: {block:?}, but {} runs with ({threads}, 1, 1)", k.entry));
    }
    if (smem as u64) < least_smem {
        errs.push(format!(
            "smem: {smem} bytes, but {} needs at least {least_smem}",
            k.entry
        ));
    }
    errs
}

/// Minimum elements and dtype of each pointer argument of an entry, given the launch's
/// u32 arguments. `None` dtype = the activation type.
fn needs(p: &Plan, entry: &str, arg: &str, u: &dyn Fn(&str) -> u64) -> Option<(u64, Option<DType>)> {
    let m = &p.model;
    let (h, hq, hkv, d) = (m.hidden as u64, m.heads as u64, m.kv_heads as u64, m.head_dim as u64);
    let n = p.spec.num_draft_tokens as u64;
    let k = p.spec.topk as u64;
    let cols = p.capture.hot_vocab_size.unwrap_or(m.vocab) as u64;
    let (rows, batch, splits) = (u("rows"), u("batch"), u("splits"));
    let f32 = Some(DType::F32);
    let i32 = Some(DType::I32);
    let i64 = Some(DType::I64);
    Some(match (entry, arg) {
        ("embed_concat", "ids") => (rows, i64),
        ("embed_concat", "table") => (m.vocab as u64 * h, None),
        ("embed_concat", "hidden") | ("embed_concat", "bias_out") => (rows * h, None),
        ("embed_concat", "bias") => (h, None),
        ("embed_concat", "out") => (rows * 2 * h, None),
        ("rmsnorm", "x") | ("rmsnorm", "out") => (rows * h, None),
        ("rmsnorm", "weight") => (h, None),
        ("rope_append", "qkv") => (rows * (hq + 2 * hkv) * d, None),
        ("rope_append", "prefix_lens") | ("rope_append", "req_slots") => (rows.div_ceil(n), i32),
        ("attn_partial", "q") => (batch * n * u("q_stride"), None),
        ("attn_partial", "prefix_lens") | ("attn_partial", "req_slots") => (batch, i32),
        ("attn_partial", "out") => (batch * n * hq * d, None),
        ("attn_partial", "part_o") => (splits * batch * n * hq * d, f32),
        ("attn_partial", "part_lse") => (splits * batch * n * hq, f32),
        ("attn_merge", "part_o") => (splits * rows * hq * d, f32),
        ("attn_merge", "part_lse") => (splits * rows * hq, f32),
        ("attn_merge", "out") => (rows * hq * d, None),
        ("silu_mul", "gate_up") => (rows * 2 * m.intermediate as u64, None),
        ("silu_mul", "out") => (rows * m.intermediate as u64, None),
        ("select_rows", "x") => (batch * n * h, None),
        ("select_rows", "accept_lens") => (batch, i32),
        ("select_rows", "out") => (batch * h, None),
        ("softmax_topk", "logits") => (batch * cols, f32),
        ("softmax_topk", "hot_ids") => (cols, i64),
        ("softmax_topk", "probs") => (batch * k, f32),
        ("softmax_topk", "ids") => (batch * k, i64),
        ("topk_partial", "logits") => (batch * cols, f32),
        ("topk_partial", "part") | ("topk_merge", "part") => (batch * u("chunks") * (2 + 2 * k), f32),
        ("topk_merge", "hot_ids") => (cols, i64),
        ("topk_merge", "probs") => (batch * k, f32),
        ("topk_merge", "ids") => (batch * k, i64),
        _ => return None,
    })
}

/// Bucket-level checks of one kernel launch.
pub(super) fn launch_args(p: &Plan, b: &BucketPlan, k: &KernelDesc, args: &[KernelArg]) -> Vec<String> {
    let mut errs = Vec::new();
    let u = |name: &str| -> u64 {
        args.iter()
            .find(|a| a.name == name)
            .and_then(|a| {
                if let ArgValue::U32(x) = a.value {
                    Some(x as u64)
                } else {
                    None
                }
            })
            .unwrap_or(0)
    };
    for a in args {
        if let ArgValue::U32(x) = a.value {
            let want = match a.name.as_str() {
                "rows" => Some(b.rows as u64),
                "batch" => Some(b.batch as u64),
                "splits" => Some(b.attn_splits as u64),
                _ => None,
            };
            if let Some(w) = want.filter(|&w| w != x as u64) {
                errs.push(format!("args ({}): {x} does not match the bucket's {w}", a.name));
            }
            if a.name == "q_stride" && (x as u64) < (p.model.heads * p.model.head_dim) as u64 {
                errs.push(format!("args (q_stride): {x} is below heads · head_dim"));
            }
            if a.name == "chunks" && !(1..=32).contains(&x) {
                errs.push(format!(
                    "args (chunks): {x} is outside [1, 32] (topk_merge has one lane per chunk)"
                ));
            }
        }
    }
    for a in args {
        let Some((elems, dtype)) = needs(p, &k.entry, &a.name, &u) else {
            continue;
        };
        let want_dtype = dtype.unwrap_or(p.capture.dtype);
        let (have_bytes, have_dtype) = match &a.value {
            ArgValue::Buffer { id, .. } => match b.buffers.get(*id as usize) {
                Some(x) => (x.bytes, x.dtype),
                None => continue,
            },
            ArgValue::Weight { id } => match p.weights.get(*id as usize) {
                Some(x) => (x.bytes, x.dtype),
                None => continue,
            },
            _ => continue,
        };
        if have_dtype != want_dtype {
            errs.push(format!(
                "args ({}): {} where {} reads {}",
                a.name,
                have_dtype.name(),
                k.entry,
                want_dtype.name()
            ));
        }
        let want_bytes = elems.saturating_mul(want_dtype.size());
        if have_bytes < want_bytes {
            errs.push(format!(
                "args ({}): {have_bytes} bytes, {} touches {want_bytes}",
                a.name, k.entry
            ));
        }
    }
    errs
}

/// An ELF image whose header tables lie inside it (the driver reads them unchecked).
pub(super) fn cubin_ok(c: &[u8]) -> bool {
    if c.len() < 64 || &c[..4] != b"\x7fELF" || c[4] != 2 {
        return false;
    }
    let u64_at = |o: usize| u64::from_le_bytes(c[o..o + 8].try_into().unwrap_or([0; 8]));
    let u16_at = |o: usize| u16::from_le_bytes([c[o], c[o + 1]]) as u64;
    let (phoff, shoff) = (u64_at(0x20), u64_at(0x28));
    let (phentsize, phnum, shentsize, shnum) = (u16_at(0x36), u16_at(0x38), u16_at(0x3a), u16_at(0x3c));
    let within = |off: u64, size: u64, num: u64| off.checked_add(size * num).is_some_and(|end| end <= c.len() as u64);
    within(phoff, phentsize, phnum) && within(shoff, shentsize, shnum)
}
