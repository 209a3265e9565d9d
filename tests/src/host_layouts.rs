//! Engines' K/V layouts and weights in host memory, for tests of the CPU engine (the
//! runtime on an engine's memory in place): SGLang's NHD and HND token pools, vLLM's packed
//! `[.., 2·D]` tensors with V at K + D (NHD and HND), each filled from a case's dense K/V
//! bits, and the plan's weights under their own names.

use std::collections::HashMap;

use specplan_format::{DType, ValidatedPlan};
use specplan_kernels::kv::KvGeometry;
use specplan_runtime::bits::{from_act_bits, to_act_bits};
use specplan_runtime::cpu::WeightData;
use specplan_runtime::registration::{DeviceTensor, KvRegistration};

/// Host copies of the plan's weights under their own names (bf16 bits, i64 ids).
pub struct HostWeights {
    act: Vec<Vec<u16>>,
    ids: Vec<Vec<i64>>,
    pub tensors: HashMap<String, DeviceTensor>,
}

pub fn host_weights(plan: &ValidatedPlan, w: &[WeightData]) -> HostWeights {
    let mut hw = HostWeights {
        act: Vec::new(),
        ids: Vec::new(),
        tensors: HashMap::new(),
    };
    for (d, data) in plan.weights.iter().zip(w) {
        let (ptr, dtype) = match data {
            WeightData::F32(v) => {
                hw.act.push(to_act_bits(v, plan.capture.dtype));
                (hw.act.last().map_or(0, |x| x.as_ptr() as u64), plan.capture.dtype)
            }
            WeightData::I64(v) => {
                hw.ids.push(v.clone());
                (hw.ids.last().map_or(0, |x| x.as_ptr() as u64), DType::I64)
            }
        };
        hw.tensors.insert(
            d.name.clone(),
            DeviceTensor {
                ptr,
                dtype,
                shape: d.shape.clone(),
            },
        );
    }
    hw
}

/// One engine layout: how K and V of a (page, offset) slot sit in one host buffer per layer.
#[derive(Clone, Copy, Debug)]
pub enum Layout {
    /// SGLang NHD: K and V separate `[slots, H, D]`, token-slot table.
    SglangNhd,
    /// SGLang HND: `[pages, H, P, D]`, token-slot table.
    SglangHnd,
    /// vLLM NHD: `[blocks, P, H, 2·D]`, V at K + D, page-id table.
    VllmNhd,
    /// vLLM HND: `[blocks, H, P, 2·D]`.
    VllmHnd,
}

/// A host buffer of u16 whose element 0 is 16-byte aligned (what a registration asks).
pub struct Buf {
    v: Vec<u16>,
    off: usize,
}

impl Buf {
    pub fn new(elems: usize, fill: u16) -> Buf {
        let v = vec![fill; elems + 8];
        let off = (v.as_ptr() as usize).next_multiple_of(16) - v.as_ptr() as usize;
        Buf { v, off: off / 2 }
    }
    pub fn get(&self, i: usize) -> u16 {
        self.v[self.off + i]
    }
    pub fn set(&mut self, i: usize, x: u16) {
        self.v[self.off + i] = x;
    }
    pub fn addr(&mut self) -> u64 {
        self.v[self.off..].as_mut_ptr() as u64
    }
}

pub struct Pools {
    /// Per layer: the K buffer (and V's for SGLang; vLLM's V lives in K's, D further).
    pub k: Vec<Buf>,
    pub v: Vec<Buf>,
    pub geom: KvGeometry,
    pub packed: bool,
}

pub fn pools(plan: &ValidatedPlan, used_pages: usize, k0: &[u16], v0: &[u16], layout: Layout) -> Pools {
    let (h, d) = (plan.model.kv_heads as u64, plan.model.head_dim as u64);
    let p = plan.capture.page_size as u64;
    // One spare page past the case's (the dense pool's scratch page).
    let pages = used_pages as u64 + 1;
    let slots = pages * p;
    let (geom, packed) = match layout {
        Layout::SglangNhd => (KvGeometry::dense(slots, h * d, d), false),
        Layout::SglangHnd => (
            KvGeometry {
                slots,
                page: p,
                page_stride: h * p * d,
                slot_stride: d,
                head_stride: p * d,
            },
            false,
        ),
        Layout::VllmNhd => (
            KvGeometry {
                slots,
                page: p,
                page_stride: p * h * 2 * d,
                slot_stride: h * 2 * d,
                head_stride: 2 * d,
            },
            true,
        ),
        Layout::VllmHnd => (
            KvGeometry {
                slots,
                page: p,
                page_stride: h * p * 2 * d,
                slot_stride: 2 * d,
                head_stride: p * 2 * d,
            },
            true,
        ),
    };
    let elems = (slots * h * d * if packed { 2 } else { 1 }) as usize;
    // Poison-free filler that differs from every written value: the case's bits go where
    // the geometry says, the rest of the buffer keeps a marker.
    let mut out = Pools {
        k: Vec::new(),
        v: Vec::new(),
        geom,
        packed,
    };
    let per_layer = used_pages * (p * h * d) as usize;
    for l in 0..plan.model.layers as usize {
        // A filler (1.0) that no case value is guaranteed to equal, for the unwritten checks.
        let mut kb = Buf::new(elems, 0x3f80);
        let mut vb = Buf::new(if packed { 0 } else { elems }, 0x3f80);
        for t in 0..(used_pages as u64 * p) {
            for g in 0..h {
                for e in 0..d {
                    let src = l * per_layer + ((t * h + g) * d + e) as usize;
                    let at = geom.offset(t, g, e).expect("offset") as usize;
                    kb.set(at, k0[src]);
                    if packed {
                        kb.set(at + d as usize, v0[src]);
                    } else {
                        vb.set(at, v0[src]);
                    }
                }
            }
        }
        out.k.push(kb);
        out.v.push(vb);
    }
    out
}

pub fn read_back(plan: &ValidatedPlan, pools: &Pools, layer: usize, v: bool, t: u64, g: u64, e: u64) -> f32 {
    let d = plan.model.head_dim as u64;
    let at = pools.geom.offset(t, g, e).expect("offset") as usize;
    let bits = match (v, pools.packed) {
        (false, _) => pools.k[layer].get(at),
        (true, true) => pools.k[layer].get(at + d as usize),
        (true, false) => pools.v[layer].get(at),
    };
    from_act_bits(bits, plan.capture.dtype)
}

/// The K/V registration of `pools`: per layer K's address and V's (vLLM's packed V lies D
/// elements, 2·D bytes, after K), under the pools' geometry.
pub fn kv_registration(plan: &ValidatedPlan, pools: &mut Pools) -> KvRegistration {
    let d = plan.model.head_dim as u64;
    let (k, v) = (0..plan.model.layers as usize)
        .map(|l| {
            let k = pools.k[l].addr();
            let v = if pools.packed { k + 2 * d } else { pools.v[l].addr() };
            (k, v)
        })
        .unzip();
    KvRegistration { k, v, geom: pools.geom }
}
