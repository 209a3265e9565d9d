//! The engine-like memory of one case: pool, table and weights allocated as SGLang or
//! vLLM lays them out (see `engine`), with the case's cache in place.

use std::collections::HashMap;

use cudarc::driver::result;
use specplan_format::{DType, Packing, ValidatedPlan};
use specplan_runtime::bits::to_act_bits;
use specplan_runtime::cpu::WeightData;
use specplan_runtime::gpu::{DeviceTensor, KvRegistration, TableMode, TableRegistration};

use crate::gpu::DeviceBuf;
use crate::random::Case;
use crate::Rng;

pub(crate) fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

pub(crate) fn download<T: Copy + Default>(ptr: u64, n: usize) -> Result<Vec<T>, String> {
    let mut v = vec![T::default(); n];
    // SAFETY: `ptr` holds at least n elements (the caller's allocation); synchronous.
    unsafe { result::memcpy_dtoh_sync(&mut v, ptr) }.map_err(|e| format!("{e:?}"))?;
    Ok(v)
}

/// The engine's memory for one case: pool, table, weights, inputs, outputs (all device).
pub(crate) struct Fixture {
    pub _bufs: Vec<DeviceBuf>,
    pub kv: KvRegistration,
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

/// The engine's pool and table for case `c`, holding the case's cache: engine slot (or
/// block) t holds what the owned pool's page t holds. `blocks`: vLLM's layout, else SGLang's.
pub(crate) fn fixture(
    plan: &ValidatedPlan,
    c: &Case,
    w: &[WeightData],
    blocks: bool,
    views: bool,
    rng: &mut Rng,
) -> Result<Fixture, String> {
    let m = &plan.model;
    let ps = plan.capture.page_size as usize;
    let slot = (m.kv_heads * m.head_dim) as usize;
    let layers = m.layers as usize;
    let mut bufs = Vec::new();
    let pool_slots = c.used_pages * ps;
    let per_layer = pool_slots * slot;
    let (mut k0, mut v0) = (Vec::new(), Vec::new());
    let (mut kp, mut vp) = (Vec::new(), Vec::new());
    for l in 0..layers {
        let (k, v) = (
            &c.k0[l * per_layer..(l + 1) * per_layer],
            &c.v0[l * per_layer..(l + 1) * per_layer],
        );
        if blocks {
            // One [2, blocks, block, Hkv, D] tensor per layer: K then V halves.
            let both: Vec<u16> = k.iter().chain(v).copied().collect();
            let base = upload(&mut bufs, &both)?;
            kp.push(base);
            vp.push(base + (per_layer * 2) as u64);
        } else {
            kp.push(upload(&mut bufs, k)?);
            vp.push(upload(&mut bufs, v)?);
        }
        k0.push(k.to_vec());
        v0.push(v.to_vec());
    }
    // Table rows in scattered order; unused entries -1. Token slots (SGLang) or blocks.
    let n = plan.spec.num_draft_tokens as usize;
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
        kv: KvRegistration::dense(kp, vp, pool_slots as u64, slot as u64, plan.model.head_dim as u64),
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
        unsafe { result::memcpy_htod_sync(self.table.ptr, self.table_host.as_slice()) }.map_err(|e| format!("{e:?}"))
    }

    /// Puts the case's initial cache back into the caller's pool.
    pub fn restore(&self) -> Result<(), String> {
        for l in 0..self.kv.k.len() {
            for (pool, init) in [(self.kv.k[l], &self.k0[l]), (self.kv.v[l], &self.v0[l])] {
                // SAFETY: the pool holds the layer's initial contents' size; synchronous.
                unsafe { result::memcpy_htod_sync(pool, init.as_slice()) }.map_err(|e| format!("{e:?}"))?;
            }
        }
        Ok(())
    }
}
