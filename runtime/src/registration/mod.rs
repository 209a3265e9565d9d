//! An engine's memory, registered once and used in place by either runtime (the GPU
//! runtime's engine mode, the CPU engine): its K/V pool (per layer a K and a V address and
//! one [`KvGeometry`]), its page table (token slots or page ids, a row stride) and its
//! weights (tensors by name, used in place or packed once). Everything here is pure: the
//! rules a registration must pass and how each plan weight binds to the caller's tensors;
//! no memory is read.

mod regions;

pub use regions::{shares_with_outputs, Regions, StepTensor};
use specplan_format::io;
use specplan_format::PhaseKind;
use std::collections::HashMap;

use specplan_format::{DType, Packing, Plan};
pub use specplan_kernels::kv::KvGeometry;
use specplan_kernels::kv::{self, TableMode};

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

/// The caller's K/V pool: per layer a K and a V address, and one geometry for all of them
/// (where a slot's heads and elements are, in elements of the plan's activation type:
/// [`KvGeometry`], which takes SGLang's NHD/HND pools and vLLM's packed `[.., 2·D]` layer
/// tensors, V at K + D, in place).
#[derive(Clone, Debug, PartialEq)]
pub struct KvRegistration {
    pub k: Vec<u64>,
    pub v: Vec<u64>,
    pub geom: KvGeometry,
}

impl KvRegistration {
    /// Slots `stride` elements apart, each `[kv_heads, head_dim]` contiguous.
    pub fn dense(k: Vec<u64>, v: Vec<u64>, slots: u64, stride: u64, head_dim: u64) -> KvRegistration {
        KvRegistration {
            k,
            v,
            geom: KvGeometry::dense(slots, stride, head_dim),
        }
    }
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

/// A registration the plan cannot run on, naming the tensor and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegError {
    #[error("registration: {0}")]
    Registration(String),
    #[error("weights: {0}")]
    Weights(String),
}

fn bad(what: &str, msg: String) -> RegError {
    RegError::Registration(format!("{what}: {msg}"))
}

/// Checks a K/V registration against the plan: one K and V per layer, 16-byte aligned,
/// strides of whole 16-byte rows, a pool the kernels can index, and a geometry under which
/// no two elements of a layer's K and V share an address (each dimension's stride at least
/// the span of the ones below it, K and V included as a dimension of extent 2).
pub fn check_kv(plan: &Plan, kv: &KvRegistration) -> Result<(), RegError> {
    let layers = plan.model.layers as usize;
    let (heads, d) = (plan.model.kv_heads as u64, plan.model.head_dim as u64);
    let g = &kv.geom;
    let elem = plan.capture.dtype.size();
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
    for (name, ptrs) in [(io::K_CACHE, &kv.k), (io::V_CACHE, &kv.v)] {
        if let Some((l, p)) = ptrs.iter().enumerate().find(|(_, &p)| p == 0 || !p.is_multiple_of(16)) {
            return Err(bad(
                &format!("{name}[{l}]"),
                format!("address {p:#x} is null or not 16-byte aligned"),
            ));
        }
    }
    if g.slots == 0 || g.slots > i32::MAX as u64 {
        return Err(bad(
            "k_cache/v_cache",
            format!("{} token slots is outside [1, 2^31 - 1]", g.slots),
        ));
    }
    if g.page == 0 || g.page > i32::MAX as u64 {
        return Err(bad(
            "k_cache/v_cache",
            format!("{} slots per physical page is outside [1, 2^31 - 1]", g.page),
        ));
    }
    for (what, s) in [
        ("slot stride", g.slot_stride),
        ("page stride", g.page_stride),
        ("head stride", g.head_stride),
    ] {
        if s == 0 || !s.is_multiple_of(8) {
            return Err(bad(
                "k_cache/v_cache",
                format!("{what} {s} must be a positive multiple of 8 elements (16-byte rows)"),
            ));
        }
    }
    let pages = g.slots.div_ceil(g.page);
    let span = g
        .span(heads, d)
        .ok_or_else(|| bad("k_cache/v_cache", "the pool's extent overflows 64 bits".into()))?;
    // The attention's tile loader holds each key's offset in 16-byte units in 32 bits
    // (attention.cu, kSlotBytes): a layer's K or V extent of at most 2^32 - 1 units.
    if span.div_ceil(8) >= u32::MAX as u64 {
        return Err(bad(
            "k_cache/v_cache",
            format!("a layer's pool spans {span} elements, above the 8 * (2^32 - 2) the attention addresses"),
        ));
    }
    let bytes = span.checked_mul(elem);
    // Two layers' pools starting at one address share their first element (a list that
    // names one tensor twice; K and V of one layer are the gap's check below). Partial
    // overlaps between layers are not looked for: engines may interleave layers in one
    // buffer, where only an element-wise test could tell.
    let mut starts: Vec<(u64, usize, &str)> = (0..layers)
        .flat_map(|l| [(kv.k[l], l, io::K_CACHE), (kv.v[l], l, io::V_CACHE)])
        .collect();
    starts.sort();
    if let Some(w) = starts.windows(2).find(|w| w[0].0 == w[1].0 && w[0].1 != w[1].1) {
        let ((p, la, na), (_, lb, nb)) = (w[0], w[1]);
        return Err(bad(
            &format!("{nb}[{lb}]"),
            format!("starts at {p:#x}, as {na}[{la}] does: two layers' pools would share memory"),
        ));
    }
    for l in 0..layers {
        let (k, v) = (kv.k[l], kv.v[l]);
        for (name, p) in [(io::K_CACHE, k), (io::V_CACHE, v)] {
            if bytes.and_then(|b| p.checked_add(b)).is_none() {
                return Err(bad(
                    &format!("{name}[{l}]"),
                    "the pool's end overflows the address space".into(),
                ));
            }
        }
        // K and V as one more dimension of extent 2, `|v - k|` apart (never 0: one pool).
        let gap = v.abs_diff(k);
        if gap == 0 {
            return Err(bad(
                &format!("v_cache[{l}]"),
                format!("is k_cache[{l}] (address {k:#x}): K and V must not share memory"),
            ));
        }
        if !gap.is_multiple_of(elem) {
            return Err(bad(
                &format!("v_cache[{l}]"),
                format!("lies {gap} bytes from k_cache[{l}], not a whole number of elements"),
            ));
        }
        let mut dims = vec![
            ("element", 1, d),
            ("head", g.head_stride, heads),
            ("slot", g.slot_stride, g.page.min(g.slots)),
            ("page", g.page_stride, pages),
            ("K/V", gap / elem, 2),
        ];
        dims.retain(|&(_, _, n)| n > 1);
        dims.sort_by_key(|&(_, s, _)| s);
        for w in dims.windows(2) {
            let ((lo, ls, ln), (hi, hs, _)) = (w[0], w[1]);
            if ls.checked_mul(ln).is_none_or(|need| hs < need) {
                return Err(bad(
                    &format!("k_cache[{l}]/v_cache[{l}]"),
                    format!(
                        "the {hi} stride {hs} is below the {ln} {lo}s of stride {ls} it must clear: two elements would share an address"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Checks a page-table registration: a non-null 4-byte aligned table of at least one row,
/// rows wide enough for one step's positions and `stride ≥ cols`.
pub fn check_table(plan: &Plan, t: &TableRegistration) -> Result<(), RegError> {
    let what = match t.mode {
        TableMode::TokenSlots => "req_to_token",
        TableMode::PageIds => "block_table",
    };
    if t.ptr == 0 || !t.ptr.is_multiple_of(4) {
        return Err(bad(what, format!("address {:#x} is null or not 4-byte aligned", t.ptr)));
    }
    // Rows below 2^30: emit marks a request's row entry with bit 30 (kv::NON_FINITE_MARK).
    if t.rows == 0 || t.rows >= kv::NON_FINITE_MARK as u64 || t.cols == 0 || t.cols > i32::MAX as u64 {
        return Err(bad(
            what,
            format!(
                "shape [{}, {}] must have rows in [1, 2^30 - 1] and columns in [1, 2^31 - 1]",
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
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as u64;
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

/// The first id of `ids` that an earlier one repeats: `(earlier index, index, id)`. An id
/// map (FR-Spec's hot ids, EAGLE-3's draft→target map) must be one to one, or the top-K
/// would emit one token under several of its places.
pub fn first_repeat(ids: impl IntoIterator<Item = i64>) -> Option<(usize, usize, i64)> {
    let mut seen = std::collections::HashMap::new();
    for (i, id) in ids.into_iter().enumerate() {
        if let Some(&first) = seen.get(&id) {
            return Some((first, i, id));
        }
        seen.insert(id, i);
    }
    None
}

/// EAGLE-3's d2t, read once at load: every draft id d must map to a target id d + d2t[d]
/// inside the vocabulary (the ids leave the runtime as target ids), and no two draft ids to
/// the same target id.
pub fn check_d2t(plan: &Plan, d2t: Option<&[i64]>) -> Result<(), RegError> {
    if !plan.weights.iter().any(|w| w.name == "d2t") {
        return Ok(());
    }
    let d2t = d2t.ok_or_else(|| {
        RegError::Weights("d2t: the EAGLE-3 draft→target id offsets (i64 [draft_vocab]) were not given".into())
    })?;
    let vocab = plan.model.vocab as i64;
    match d2t
        .iter()
        .enumerate()
        .map(|(d, &x)| (d, (d as i64).saturating_add(x)))
        .find(|&(_, t)| t < 0 || t >= vocab)
    {
        Some((d, t)) => Err(RegError::Weights(format!(
            "d2t[{d}] maps draft id {d} to {t}, outside the target vocabulary [0, {vocab})"
        ))),
        None => match first_repeat(d2t.iter().enumerate().map(|(d, &x)| d as i64 + x)) {
            Some((e, d, t)) => Err(RegError::Weights(format!(
                "d2t[{d}] maps draft id {d} to target id {t}, which d2t[{e}] maps draft id {e} to: the map must be one to one"
            ))),
            None => Ok(()),
        },
    }
}

/// FR-Spec's map from the hot columns to vocabulary ids, read once at load whenever the plan
/// has one (whether `lm_head.hot` is gathered here or given packed): ids in [0, V), distinct.
pub fn check_hot_ids(plan: &Plan, ids: Option<&[i64]>) -> Result<(), RegError> {
    let Some(w) = plan.weights.iter().find(|w| w.name == "hot_token_ids") else {
        return Ok(());
    };
    let ids = ids.ok_or_else(|| {
        RegError::Weights(format!(
            "hot_token_ids: FR-Spec's hot vocabulary ids must be given as a 1-D i64 tensor of {} (missing, or another dtype or shape)",
            w.shape.first().copied().unwrap_or(0)
        ))
    })?;
    let vocab = plan.model.vocab as i64;
    if let Some(i) = ids.iter().position(|&x| x < 0 || x >= vocab) {
        return Err(RegError::Weights(format!(
            "hot_token_ids[{i}] is {}, outside the vocabulary [0, {vocab})",
            ids[i]
        )));
    }
    match first_repeat(ids.iter().copied()) {
        Some((e, i, id)) => Err(RegError::Weights(format!(
            "hot_token_ids[{i}] repeats id {id} (hot_token_ids[{e}]): the ids must be distinct"
        ))),
        None => Ok(()),
    }
}

/// The rows a packed weight takes from the source named `source` (the rank's share in a
/// sharded plan, whose model facts are the rank's), where the name says it: q_proj's heads
/// × head_dim, k_proj's and v_proj's kv heads × head_dim, gate_proj's and up_proj's
/// intermediate rows; `None` for other names.
pub fn source_rows(m: &specplan_format::ModelDesc, source: &str) -> Option<u64> {
    let hd = m.head_dim as u64;
    if source.ends_with("q_proj.weight") {
        Some(m.heads as u64 * hd)
    } else if source.ends_with("k_proj.weight") || source.ends_with("v_proj.weight") {
        Some(m.kv_heads as u64 * hd)
    } else if source.ends_with("gate_proj.weight") || source.ends_with("up_proj.weight") {
        Some(m.intermediate as u64)
    } else {
        None
    }
}

/// The layout words of a registration (`specplan_kernels::kv`).
pub fn layout_words(kv: &KvRegistration, t: &TableRegistration) -> [i64; kv::KV_WORDS] {
    let mut w = [0i64; kv::KV_WORDS];
    w[kv::KV_WORD_MODE] = t.mode.word();
    w[kv::KV_WORD_TABLE_ROWS] = t.rows as i64;
    w[kv::KV_WORD_TABLE_COLS] = t.cols as i64;
    w[kv::KV_WORD_TABLE_STRIDE] = t.stride as i64;
    let g = kv.geom.canonical();
    w[kv::KV_WORD_SLOTS] = g.slots as i64;
    w[kv::KV_WORD_KV_STRIDE] = g.slot_stride as i64;
    w[kv::KV_WORD_PHYS_PAGE] = g.page as i64;
    w[kv::KV_WORD_PAGE_STRIDE] = g.page_stride as i64;
    w[kv::KV_WORD_HEAD_STRIDE] = g.head_stride as i64;
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
) -> Result<Vec<WeightBinding>, RegError> {
    let act = plan.capture.dtype;
    let check = |name: &str, t: &DeviceTensor, dtype: DType, shape: &[u64]| -> Result<(), RegError> {
        if t.dtype != dtype || t.shape != shape {
            return Err(RegError::Weights(format!(
                "{name}: {} {:?}, expected {} {shape:?}",
                t.dtype.name(),
                t.shape,
                dtype.name()
            )));
        }
        if t.ptr == 0 || !t.ptr.is_multiple_of(16) {
            return Err(RegError::Weights(format!(
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
        let missing = |s: &str| RegError::Weights(format!("{}: neither it nor its source {s} was given", w.name));
        let cols: u64 = w.shape.iter().skip(1).product();
        match w.packing {
            Packing::Single => {
                let s = &w.sources[0];
                let t = tensors.get(s).ok_or_else(|| missing(s))?;
                check(s, t, w.dtype, &w.shape)?;
                out.push(WeightBinding::InPlace(t.ptr));
            }
            Packing::LeadingRows => {
                // In place: the first rows of a row-major tensor are its own prefix.
                let s = &w.sources[0];
                let t = tensors.get(s).ok_or_else(|| missing(s))?;
                let r = t.shape.first().copied().unwrap_or(0);
                if r < w.shape[0] {
                    return Err(RegError::Weights(format!(
                        "{s}: {r} rows, {} takes its first {}",
                        w.name, w.shape[0]
                    )));
                }
                check(s, t, w.dtype, &[r, cols])?;
                out.push(WeightBinding::InPlace(t.ptr));
            }
            Packing::ConcatRows => {
                let mut parts = Vec::new();
                let mut rows = 0u64;
                for s in &w.sources {
                    let t = tensors.get(s).ok_or_else(|| missing(s))?;
                    // Each part's own rows where its name says them (q/k/v, gate/up): a
                    // q of 320 rows beside a k of 64 would otherwise pass as 384.
                    let r = source_rows(&plan.model, s).unwrap_or_else(|| t.shape.first().copied().unwrap_or(0));
                    check(s, t, act, &[r, cols])?;
                    rows += r;
                    parts.push((t.ptr, r * cols * act.size()));
                }
                if rows != w.shape[0] {
                    return Err(RegError::Weights(format!(
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
                    RegError::Weights(format!(
                        "{}: neither it nor its source {is} (a 1-D i64 tensor of {} vocabulary ids) was given",
                        w.name, w.shape[0]
                    ))
                })?;
                if ids.len() as u64 != w.shape[0] || ids.iter().any(|&x| x < 0 || x as u64 >= vocab) {
                    return Err(RegError::Weights(format!(
                        "{is}: {} ids, expected {} in [0, {vocab})",
                        ids.len(),
                        w.shape[0]
                    )));
                }
                if let Some((e, i, id)) = first_repeat(ids.iter().copied()) {
                    return Err(RegError::Weights(format!(
                        "{is}[{i}] repeats id {id} ({is}[{e}]): the ids must be distinct"
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

#[cfg(test)]
mod tests;
