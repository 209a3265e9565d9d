//! The engine-like memory of one case: pool, table and weights allocated as SGLang or
//! vLLM lays them out (see `engine`), with the case's cache in place.

use std::collections::HashMap;

use cudarc::driver::result;
use specplan_format::PhaseKind;
use specplan_format::{DType, Packing, ValidatedPlan};
use specplan_runtime::bits::to_act_bits;
use specplan_runtime::cpu::WeightData;
use specplan_runtime::gpu::{DeviceTensor, KvGeometry, KvRegistration, TableMode, TableRegistration};

use crate::gpu::DeviceBuf;
use crate::random::Case;
use crate::Rng;

pub(crate) fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

pub(crate) fn download<T: Copy + Default>(ptr: u64, n: usize) -> Result<Vec<T>, String> {
    let mut v = vec![T::default(); n];
    // Every stream first: the copy below runs on the legacy stream, which does not wait for
    // the non-blocking streams steps run on.
    result::ctx::synchronize().map_err(|e| format!("{e:?}"))?;
    // SAFETY: `ptr` holds at least n elements (the caller's allocation); synchronous.
    unsafe { result::memcpy_dtoh_sync(&mut v, ptr) }.map_err(|e| format!("{e:?}"))?;
    Ok(v)
}

/// The engine's memory for one case: pool, table, weights, inputs, outputs (all device).
pub(crate) struct Fixture {
    pub _bufs: Vec<DeviceBuf>,
    pub kv: KvRegistration,
    /// Each layer's whole allocation at the start, as the layout placed the case's cache.
    pub images: Vec<Vec<u16>>,
    pub table: TableRegistration,
    /// The table as the device holds it now (a case may break an entry).
    pub table_host: Vec<i32>,
    /// The table as built (every entry valid).
    pub table_good: Vec<i32>,
    /// Pool contents at the start, per layer (K then V), raw bits; slot-major.
    pub k0: Vec<Vec<u16>>,
    pub v0: Vec<Vec<u16>>,
    pub weights: HashMap<String, DeviceTensor>,
    /// Request rows of the table.
    pub rows: Vec<i64>,
}

pub(crate) fn upload<T: Copy>(bufs: &mut Vec<DeviceBuf>, data: &[T]) -> Result<u64, String> {
    let b = DeviceBuf::from_slice(data)?;
    let p = b.ptr;
    bufs.push(b);
    Ok(p)
}

/// Uploads `data` `offset` bytes into a fresh allocation (a view, as a slice of a larger
/// tensor would be).
pub(crate) fn upload_at<T: Copy>(bufs: &mut Vec<DeviceBuf>, data: &[T], offset: usize) -> Result<u64, String> {
    if offset == 0 {
        return upload(bufs, data);
    }
    let b = DeviceBuf::new(std::mem::size_of_val(data) + offset)?;
    let p = b.ptr + offset as u64;
    bufs.push(b);
    // SAFETY: `p` lies `offset` bytes into an allocation of the data's size plus `offset`.
    unsafe { result::memcpy_htod_sync(p, data) }.map_err(|e| format!("{e:?}"))?;
    // Landed before any stream's next work (as `DeviceBuf::from_slice`).
    result::ctx::synchronize().map_err(|e| format!("{e:?}"))?;
    Ok(p)
}

/// Device copies of the plan's weights: the packed q/k/v under their sources (so the
/// runtime packs them once), every other weight under its own name (used in place),
/// `offset` bytes into its allocation.
pub(crate) fn device_weights(
    plan: &ValidatedPlan,
    w: &[WeightData],
    bufs: &mut Vec<DeviceBuf>,
    offset: usize,
) -> Result<HashMap<String, DeviceTensor>, String> {
    let act = plan.capture.dtype;
    let m = &plan.model;
    let mut out = HashMap::new();
    for (d, data) in plan.weights.iter().zip(w) {
        let qkv = d.packing == Packing::ConcatRows && d.name.contains("qkv");
        match data {
            WeightData::I64(v) => {
                let ptr = upload(bufs, v)?;
                out.insert(
                    d.name.clone(),
                    DeviceTensor {
                        ptr,
                        dtype: DType::I64,
                        shape: d.shape.clone(),
                    },
                );
            }
            WeightData::F32(v) if qkv => {
                let cols = d.shape[1] as usize;
                let mut row = 0usize;
                for (s, rows) in d.sources.iter().zip([m.heads, m.kv_heads, m.kv_heads]) {
                    let rows = (rows * m.head_dim) as usize;
                    let ptr = upload(bufs, &to_act_bits(&v[row * cols..(row + rows) * cols], act))?;
                    out.insert(
                        s.clone(),
                        DeviceTensor {
                            ptr,
                            dtype: act,
                            shape: vec![rows as u64, cols as u64],
                        },
                    );
                    row += rows;
                }
            }
            WeightData::F32(v) => {
                let ptr = upload_at(bufs, &to_act_bits(v, act), offset)?;
                out.insert(
                    d.name.clone(),
                    DeviceTensor {
                        ptr,
                        dtype: act,
                        shape: d.shape.clone(),
                    },
                );
            }
        }
    }
    Ok(out)
}

/// How an engine lays out its K/V pool and page table (the layouts the registration takes
/// in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// SGLang's default: per layer K and V `[slots, Hkv, D]`, K and V halves of one
    /// allocation, a token-slot `req_to_token`.
    SglangNhd,
    /// SGLang's `SGLANG_USE_HND_KVCACHE`: per layer `[pages, Hkv, P, D]`, token slots.
    SglangHnd,
    /// vLLM 0.33's default (LBNHC): per layer one `[blocks, block, Hkv, 2·D]` tensor, V at
    /// K + D, a block table.
    VllmNhd,
    /// vLLM with the HND layout (LBHNC): `[blocks, Hkv, block, 2·D]`.
    VllmHnd,
}

impl Layout {
    pub const ALL: [Layout; 4] = [Layout::SglangNhd, Layout::SglangHnd, Layout::VllmNhd, Layout::VllmHnd];

    pub fn name(self) -> &'static str {
        match self {
            Layout::SglangNhd => "sglang-nhd-token-slots",
            Layout::SglangHnd => "sglang-hnd-token-slots",
            Layout::VllmNhd => "vllm-nhd-packed-blocks",
            Layout::VllmHnd => "vllm-hnd-packed-blocks",
        }
    }

    /// A page-id (block) table, else token slots.
    pub fn blocks(self) -> bool {
        matches!(self, Layout::VllmNhd | Layout::VllmHnd)
    }

    fn packed(self) -> bool {
        self.blocks()
    }

    /// The pool geometry for `slots` token slots of pages of `p`.
    pub fn geometry(self, slots: u64, p: u64, h: u64, d: u64) -> KvGeometry {
        match self {
            Layout::SglangNhd => KvGeometry::dense(slots, h * d, d),
            Layout::SglangHnd => KvGeometry {
                slots,
                page: p,
                page_stride: h * p * d,
                slot_stride: d,
                head_stride: p * d,
            },
            Layout::VllmNhd => KvGeometry {
                slots,
                page: p,
                page_stride: p * h * 2 * d,
                slot_stride: h * 2 * d,
                head_stride: 2 * d,
            },
            Layout::VllmHnd => KvGeometry {
                slots,
                page: p,
                page_stride: h * p * 2 * d,
                slot_stride: 2 * d,
                head_stride: p * 2 * d,
            },
        }
    }
}

/// The engine's pool and table for case `c`, holding the case's cache: engine slot (or
/// block) t holds what the owned pool's page t holds, placed by the layout's geometry.
pub(crate) fn fixture(
    plan: &ValidatedPlan,
    c: &Case,
    w: &[WeightData],
    layout: Layout,
    views: bool,
    rng: &mut Rng,
) -> Result<Fixture, String> {
    let m = &plan.model;
    let ps = plan.capture.page_size as usize;
    let (h, d) = (m.kv_heads as u64, m.head_dim as u64);
    let slot = (h * d) as usize;
    let layers = m.layers as usize;
    let mut bufs = Vec::new();
    let pool_slots = c.used_pages * ps;
    let per_layer = pool_slots * slot;
    let geom = layout.geometry(pool_slots as u64, ps as u64, h, d);
    // One allocation per layer: K and V halves (SGLang), or one packed tensor (vLLM).
    let span = pool_slots * slot * if layout.packed() { 2 } else { 1 };
    let (mut k0, mut v0) = (Vec::new(), Vec::new());
    let (mut kp, mut vp, mut images) = (Vec::new(), Vec::new(), Vec::new());
    for l in 0..layers {
        let (k, v) = (
            &c.k0[l * per_layer..(l + 1) * per_layer],
            &c.v0[l * per_layer..(l + 1) * per_layer],
        );
        let mut image = vec![0u16; if layout.packed() { span } else { 2 * span }];
        let v_at = if layout.packed() { d as usize } else { span };
        for t in 0..pool_slots as u64 {
            for g in 0..h {
                for e in 0..d {
                    let at = geom.offset(t, g, e).ok_or("geometry overflow")? as usize;
                    let src = ((t * h + g) * d + e) as usize;
                    image[at] = k[src];
                    image[at + v_at] = v[src];
                }
            }
        }
        let base = upload(&mut bufs, &image)?;
        kp.push(base);
        vp.push(base + (v_at * 2) as u64);
        images.push(image);
        k0.push(k.to_vec());
        v0.push(v.to_vec());
    }
    // Table rows in scattered order; unused entries -1. Token slots (SGLang) or blocks.
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let blocks = layout.blocks();
    let rows_n = 2 * c.b + 3;
    let perm = rng.permutation(rows_n);
    let cols = if blocks {
        c.pages.iter().map(|p| p.len()).max().unwrap_or(1) + 1
    } else {
        c.step.prefix_lens.iter().map(|&l| l as usize + n).max().unwrap_or(n) + 8
    };
    let stride = cols + 5;
    let mut table = vec![-1i32; rows_n * stride];
    let rows: Vec<i64> = (0..c.b).map(|i| perm[i] as i64).collect();
    for i in 0..c.b {
        let row = &mut table[rows[i] as usize * stride..];
        if blocks {
            row[..c.pages[i].len()].copy_from_slice(&c.pages[i]);
        } else {
            let used = c.step.prefix_lens[i] as usize + n;
            for (p, e) in row[..used].iter_mut().enumerate() {
                *e = c.pages[i][p / ps] * ps as i32 + (p % ps) as i32;
            }
        }
    }
    let tp = upload(&mut bufs, &table)?;
    let weights = device_weights(plan, w, &mut bufs, if views { 16 } else { 0 })?;
    Ok(Fixture {
        _bufs: bufs,
        kv: KvRegistration { k: kp, v: vp, geom },
        images,
        table: TableRegistration {
            ptr: tp,
            mode: if blocks {
                TableMode::PageIds
            } else {
                TableMode::TokenSlots
            },
            rows: rows_n as u64,
            cols: cols as u64,
            stride: stride as u64,
            page_size: if blocks { plan.capture.page_size as u64 } else { 1 },
        },
        table_good: table.clone(),
        table_host: table,
        k0,
        v0,
        weights,
        rows,
    })
}

impl Fixture {
    /// Puts the valid table back (after a case broke an entry).
    pub fn restore_table(&mut self) -> Result<(), String> {
        self.table_host = self.table_good.clone();
        // SAFETY: the whole table allocation; synchronous.
        unsafe { result::memcpy_htod_sync(self.table.ptr, self.table_host.as_slice()) }
            .map_err(|e| format!("{e:?}"))?;
        // A legacy-stream upload: steps on a non-blocking stream would not wait for it.
        result::ctx::synchronize().map_err(|e| format!("{e:?}"))
    }

    /// Puts the case's initial cache back into the caller's pool (the whole allocation of
    /// each layer, as the layout placed it).
    pub fn restore(&self) -> Result<(), String> {
        for (l, image) in self.images.iter().enumerate() {
            // SAFETY: layer l's allocation holds its image's size; synchronous.
            unsafe { result::memcpy_htod_sync(self.kv.k[l], image.as_slice()) }.map_err(|e| format!("{e:?}"))?;
        }
        // Legacy-stream uploads: steps on a non-blocking stream would not wait for them.
        result::ctx::synchronize().map_err(|e| format!("{e:?}"))
    }

    /// Layer `l`'s K and V as the device holds them now, gathered slot-major through the
    /// geometry (`[slots, Hkv, D]` each), and whether any element outside the geometry's
    /// K and V (padding of the allocation) changed.
    pub fn read_layer(&self, l: usize, plan: &ValidatedPlan) -> Result<(Vec<u16>, Vec<u16>, usize), String> {
        let image = &self.images[l];
        let got: Vec<u16> = download(self.kv.k[l], image.len())?;
        let (h, d) = (plan.model.kv_heads as u64, plan.model.head_dim as u64);
        let g = self.kv.geom;
        let v_at = ((self.kv.v[l] - self.kv.k[l]) / 2) as usize;
        let per = (g.slots * h * d) as usize;
        let (mut k, mut v) = (vec![0u16; per], vec![0u16; per]);
        let mut owned = vec![false; image.len()];
        for t in 0..g.slots {
            for hh in 0..h {
                for e in 0..d {
                    let at = g.offset(t, hh, e).ok_or("geometry overflow")? as usize;
                    let dst = ((t * h + hh) * d + e) as usize;
                    k[dst] = got[at];
                    v[dst] = got[at + v_at];
                    owned[at] = true;
                    owned[at + v_at] = true;
                }
            }
        }
        let stray = (0..image.len()).filter(|&i| !owned[i] && got[i] != image[i]).count();
        Ok((k, v, stray))
    }
}
