//! The K/V cache as the CPU executor reads and writes it: the executor's own dense f32
//! pool ([`KvPool`]), or an engine's pool in place ([`StridedKv`]: activation-typed memory
//! under any [`KvGeometry`] the GPU runtime also takes — SGLang's NHD and HND pools,
//! vLLM's packed `[.., 2·D]` tensors), so the CPU executor checks the same layouts the
//! kernels walk.

use specplan_format::{DType, KvKind, Plan};
use specplan_kernels::kv::KvGeometry;

use super::R;

/// Where the executor's launches read and write K/V: element `d` of kv head `head` of token
/// slot `slot` of a layer's K or V pool. Out-of-range accesses are errors, never faults.
pub trait KvStore {
    /// Token slots of each layer's pool (valid slots are `[0, slots)`).
    fn slots(&self) -> u64;
    /// Whether the store has the plan's layers, kv heads and head size.
    fn fits(&self, plan: &Plan) -> bool;
    fn load(&self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize) -> R<f64>;
    fn store(&mut self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize, v: f64) -> R<()>;
}

/// The K/V pool: per layer, `[pages, page_size, kv_heads, head_dim]` as f32, that is
/// `pages · page_size` token slots of `kv_heads · head_dim` values. Values are kept in
/// f32, not rounded to the activation type (the oracle's choice).
#[derive(Clone, Debug, PartialEq)]
pub struct KvPool {
    pub pages: usize,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// A [`KvPool`] seen with a plan's slot shape.
pub(crate) struct DenseKv<'a> {
    pool: &'a mut KvPool,
    heads: usize,
    dim: usize,
    page_size: usize,
    layers: usize,
}

impl<'a> DenseKv<'a> {
    pub fn new(plan: &Plan, pool: &'a mut KvPool) -> DenseKv<'a> {
        DenseKv {
            pool,
            heads: plan.model.kv_heads as usize,
            dim: plan.model.head_dim as usize,
            page_size: plan.capture.page_size as usize,
            layers: plan.model.layers as usize,
        }
    }
    pub fn pool(&self) -> &KvPool {
        self.pool
    }
    fn at(&self, slot: usize, head: usize, d: usize) -> R<usize> {
        if head >= self.heads || d >= self.dim || slot as u64 >= self.slots() {
            return Err(format!(
                "K/V element (slot {slot}, head {head}, {d}) is outside the pool"
            ));
        }
        Ok((slot * self.heads + head) * self.dim + d)
    }
}

impl KvStore for DenseKv<'_> {
    fn slots(&self) -> u64 {
        (self.pool.pages as u64).saturating_mul(self.page_size as u64)
    }
    fn fits(&self, plan: &Plan) -> bool {
        let per = self.pool.pages * self.page_size * self.heads * self.dim;
        plan.model.layers as usize == self.layers
            && self.pool.k.len() == self.layers
            && self.pool.v.len() == self.layers
            && self.pool.k.iter().chain(&self.pool.v).all(|l| l.len() == per)
    }
    fn load(&self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize) -> R<f64> {
        let at = self.at(slot, head, d)?;
        let pool = match kind {
            KvKind::K => &self.pool.k,
            KvKind::V => &self.pool.v,
        };
        pool.get(layer)
            .and_then(|l| l.get(at))
            .map(|x| *x as f64)
            .ok_or_else(|| format!("{kind:?} pool layer {layer} has no element {at}"))
    }
    fn store(&mut self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize, v: f64) -> R<()> {
        let at = self.at(slot, head, d)?;
        let pool = match kind {
            KvKind::K => &mut self.pool.k,
            KvKind::V => &mut self.pool.v,
        };
        let cell = pool
            .get_mut(layer)
            .and_then(|l| l.get_mut(at))
            .ok_or_else(|| format!("{kind:?} pool layer {layer} has no element {at}"))?;
        *cell = v as f32;
        Ok(())
    }
}

/// An engine's K/V pool in place: per layer a K and a V base pointer to activation-typed
/// elements (bf16 or fp16 bits) laid out by one [`KvGeometry`]. Values are read exactly and
/// written rounded to the activation type, as the kernels do. K and V may share memory
/// (vLLM packs V at K + D): accesses go through raw pointers, element by element, at
/// offsets the geometry gives, and registration (`gpu::memory::check_kv`, which the
/// constructor's callers run) has proven that no two elements share an address.
pub struct StridedKv {
    k: Vec<*mut u16>,
    v: Vec<*mut u16>,
    geom: KvGeometry,
    heads: u64,
    dim: u64,
    /// Elements each pointer may touch: one past the geometry's last element.
    span: u64,
    act: DType,
}

impl StridedKv {
    /// # Safety
    /// SAFETY: every pointer of `k` and `v` must be valid for reads and writes of
    /// `geom.span(kv_heads, head_dim)` u16 elements (one past the largest offset) for as
    /// long as the store is used; nothing else may access that memory while a
    /// step runs; and the geometry must keep every K and V element of a layer at a distinct
    /// address (what `check_kv` proves for a registration).
    pub unsafe fn new(plan: &Plan, k: Vec<*mut u16>, v: Vec<*mut u16>, geom: KvGeometry) -> Result<StridedKv, String> {
        let (heads, dim) = (plan.model.kv_heads as u64, plan.model.head_dim as u64);
        let span = geom.span(heads, dim).ok_or("the K/V geometry's extent overflows")?;
        Ok(StridedKv {
            k,
            v,
            geom,
            heads,
            dim,
            span,
            act: plan.capture.dtype,
        })
    }

    fn ptr(&self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize) -> R<*mut u16> {
        let base = match kind {
            KvKind::K => self.k.get(layer),
            KvKind::V => self.v.get(layer),
        }
        .ok_or_else(|| format!("{kind:?} pool has no layer {layer}"))?;
        let (s, h, e) = (slot as u64, head as u64, d as u64);
        let off = (s < self.geom.slots && h < self.heads && e < self.dim)
            .then(|| self.geom.offset(s, h, e))
            .flatten()
            .filter(|&o| o < self.span)
            .ok_or_else(|| format!("K/V element (slot {slot}, head {head}, {d}) is outside the pool"))?;
        // SAFETY: `off < span`, and the constructor's contract makes `base` valid for `span`
        // elements.
        Ok(unsafe { base.add(off as usize) })
    }
}

impl KvStore for StridedKv {
    fn slots(&self) -> u64 {
        self.geom.slots
    }
    fn fits(&self, plan: &Plan) -> bool {
        let layers = plan.model.layers as usize;
        self.k.len() == layers
            && self.v.len() == layers
            && self.heads == plan.model.kv_heads as u64
            && self.dim == plan.model.head_dim as u64
            && self.act == plan.capture.dtype
    }
    fn load(&self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize) -> R<f64> {
        let p = self.ptr(kind, layer, slot, head, d)?;
        // SAFETY: `p` lies inside the registered memory (ptr); u16 needs 2-byte alignment,
        // which registration's 16-byte base alignment and whole-element strides give.
        let bits = unsafe { p.read() };
        Ok(crate::bits::from_act_bits(bits, self.act) as f64)
    }
    fn store(&mut self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize, v: f64) -> R<()> {
        let p = self.ptr(kind, layer, slot, head, d)?;
        let bits = crate::bits::to_act_bits(&[v as f32], self.act)[0];
        // SAFETY: as in `load`; the store is the only writer while a step runs.
        unsafe { p.write(bits) };
        Ok(())
    }
}
