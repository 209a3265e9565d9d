//! The maths of each kernel entry on the CPU, written from the contract in the kernel's
//! header (`kernels/cuda/*.cu`): the same indexing, the same guards (a bad id reads row 0,
//! an accept length is clamped to [1, N], a column outside the row has id -1), f64
//! accumulation.

use specplan_format::io;
use specplan_format::{ConstValue, KernelDesc, KvKind};
use specplan_kernels::entries::attention::{
    AttnFusedPtrs, AttnFusedScalars, AttnMergePtrs, AttnMergeScalars, AttnPartialPtrs, AttnPartialScalars,
};
use specplan_kernels::entries::embed::{EmbedConcatPtrs, EmbedConcatScalars};
use specplan_kernels::entries::mlp::{SiluMulPairsPtrs, SiluMulPairsScalars, SiluMulPtrs, SiluMulScalars};
use specplan_kernels::entries::norm::{
    CastRowsPtrs, CastRowsScalars, NormCastPtrs, NormCastScalars, RmsNormPtrs, RmsNormScalars,
};
use specplan_kernels::entries::rope::{RopeAppendPtrs, RopeAppendScalars};
use specplan_kernels::entries::select::{SelectRowsPtrs, SelectRowsScalars};

use super::{Ctx, KvStore, Ptr, R};
use crate::step::TableMode;

pub(super) fn constant<'k>(k: &'k KernelDesc, name: &str) -> R<&'k ConstValue> {
    k.constants
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
        .ok_or_else(|| format!("kernel {} has no constant {name}", k.name))
}

pub(super) fn c_u32(k: &KernelDesc, name: &str) -> R<usize> {
    match constant(k, name)? {
        ConstValue::U32(v) => Ok(*v as usize),
        other => Err(format!("kernel {}: constant {name} is {other:?}, not a u32", k.name)),
    }
}

pub(super) fn c_bool(k: &KernelDesc, name: &str) -> R<bool> {
    match constant(k, name)? {
        ConstValue::Bool(v) => Ok(*v),
        other => Err(format!("kernel {}: constant {name} is {other:?}, not a bool", k.name)),
    }
}

pub(super) fn c_f32(k: &KernelDesc, name: &str) -> R<f32> {
    match constant(k, name)? {
        ConstValue::F32(v) => Ok(*v),
        other => Err(format!("kernel {}: constant {name} is {other:?}, not an f32", k.name)),
    }
}

fn c_table<'k>(k: &'k KernelDesc, name: &str) -> R<&'k [f32]> {
    match constant(k, name)? {
        ConstValue::F32Array(v) => Ok(v),
        other => Err(format!("kernel {}: constant {name} is {other:?}, not a table", k.name)),
    }
}

/// A positive constant (a divisor or a loop bound).
pub(super) fn c_pos(k: &KernelDesc, name: &str) -> R<usize> {
    match c_u32(k, name)? {
        0 => Err(format!("kernel {}: constant {name} is 0", k.name)),
        v => Ok(v),
    }
}

pub(super) fn buf(p: Ptr, name: &str) -> R<usize> {
    match p {
        Ptr::Buf(b) => Ok(b),
        other => Err(format!("argument {name} must be a buffer, is {other:?}")),
    }
}

pub(super) fn weight(p: Ptr, name: &str) -> R<usize> {
    match p {
        Ptr::Weight(w) => Ok(w),
        other => Err(format!("argument {name} must be a weight, is {other:?}")),
    }
}

/// RMSNorm's scale of `row`, 1 / sqrt(mean(x²) + eps) (norm.cu's maths, in f64).
pub(super) fn rms_inv(row: &[f64], eps: f64) -> f64 {
    let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len().max(1) as f64;
    1.0 / (ms + eps).sqrt()
}

fn kv(p: Ptr, want: KvKind, name: &str) -> R<usize> {
    match p {
        Ptr::Kv(layer, kind) if kind == want => Ok(layer),
        other => Err(format!(
            "argument {name} must be the {want:?} pool of a layer, is {other:?}"
        )),
    }
}

impl<K: KvStore> Ctx<'_, K> {
    pub(super) fn embed_concat(&mut self, k: &KernelDesc, p: &EmbedConcatPtrs<Ptr>, s: &EmbedConcatScalars) -> R<()> {
        let (h, vocab) = (c_u32(k, "HIDDEN")?, c_u32(k, "VOCAB")? as i64);
        // A vocabulary-parallel rank's rows of the table (embed.cu's header).
        let (rows, start) = (c_u32(k, "EMBED_ROWS")? as i64, c_u32(k, "EMBED_START")? as i64);
        let zero_hidden = c_bool(k, "ZERO_HIDDEN")?;
        let (ids, table, hid, out) = (
            buf(p.ids, "ids")?,
            weight(p.table, "table")?,
            buf(p.hidden, "hidden")?,
            buf(p.out, "out")?,
        );
        let bias = match (c_bool(k, "HAS_BIAS")?, p.bias, p.bias_out) {
            (true, Ptr::Weight(w), Ptr::Buf(o)) => Some((w, o)),
            (_, Ptr::Null, Ptr::Null) => None,
            _ => return Err("bias and bias_out must both be set (HAS_BIAS) or both null".into()),
        };
        for r in 0..s.rows as usize {
            if let Some((w, o)) = bias {
                for c in 0..h {
                    let b = self.wf(w, c)?;
                    self.st(o, r * h + c, b)?;
                }
            }
            let id = self.ld(ids, r)? as i64;
            let id = if (0..vocab).contains(&id) { id } else { 0 };
            let local = id - start;
            for c in 0..h {
                let e = if (0..rows).contains(&local) {
                    self.wf(table, local as usize * h + c)?
                } else {
                    0.0
                };
                self.st(out, r * 2 * h + c, e)?;
                let x = if zero_hidden { 0.0 } else { self.ld(hid, r * h + c)? };
                self.st(out, r * 2 * h + h + c, x)?;
            }
        }
        Ok(())
    }

    pub(super) fn rmsnorm(&mut self, k: &KernelDesc, p: &RmsNormPtrs<Ptr>, s: &RmsNormScalars) -> R<()> {
        let (h, eps) = (c_pos(k, "HIDDEN")?, c_f32(k, "EPS")? as f64);
        let (x, w, out) = (buf(p.x, "x")?, weight(p.weight, "weight")?, buf(p.out, "out")?);
        for r in 0..s.rows as usize {
            let row: Vec<f64> = (0..h).map(|c| self.ld(x, r * h + c)).collect::<R<_>>()?;
            let inv = rms_inv(&row, eps);
            for (c, v) in row.iter().enumerate() {
                let y = v * inv * self.wf(w, c)?;
                self.st(out, r * h + c, y)?;
            }
        }
        Ok(())
    }

    /// The stream's rounding; the oracle holds activations unrounded, so a copy here.
    pub(super) fn cast_rows(&mut self, k: &KernelDesc, p: &CastRowsPtrs<Ptr>, s: &CastRowsScalars) -> R<()> {
        let h = c_pos(k, "HIDDEN")?;
        let (x, out) = (buf(p.x, "x")?, buf(p.out, "out")?);
        for e in 0..s.rows as usize * h {
            let v = self.ld(x, e)?;
            self.st(out, e, v)?;
        }
        Ok(())
    }

    /// `norm_cast`: the same rows rounded into `cast` (`cast_rows`) and normed into `out`
    /// (`rmsnorm`).
    pub(super) fn norm_cast(&mut self, k: &KernelDesc, p: &NormCastPtrs<Ptr>, s: &NormCastScalars) -> R<()> {
        let rows = s.rows;
        self.cast_rows(k, &CastRowsPtrs { x: p.x, out: p.cast }, &CastRowsScalars { rows })?;
        let norm = RmsNormPtrs {
            x: p.x,
            weight: p.weight,
            out: p.out,
        };
        self.rmsnorm(k, &norm, &RmsNormScalars { rows })
    }

    pub(super) fn silu_mul(&mut self, k: &KernelDesc, p: &SiluMulPtrs<Ptr>, s: &SiluMulScalars) -> R<()> {
        let inter = c_u32(k, "INTER")?;
        let gu = buf(p.gate_up, "gate_up")?;
        for r in 0..s.rows as usize {
            for c in 0..inter {
                let g = self.ld(gu, r * 2 * inter + c)?;
                let u = self.ld(gu, r * 2 * inter + inter + c)?;
                // In place over the gate half, as the kernel.
                self.st(gu, r * 2 * inter + c, g / (1.0 + (-g).exp()) * u)?;
            }
        }
        Ok(())
    }

    /// `silu_mul_pairs`: rows `2r` and `2r + 1` of the fp32 gate/up output are `W·hi` and
    /// `W·lo` of the selected row's norm; their sums go through the activation.
    pub(super) fn silu_mul_pairs(
        &mut self,
        k: &KernelDesc,
        p: &SiluMulPairsPtrs<Ptr>,
        s: &SiluMulPairsScalars,
    ) -> R<()> {
        let inter = c_u32(k, "INTER")?;
        let (gu, out) = (buf(p.gate_up, "gate_up")?, buf(p.out, "out")?);
        for r in 0..s.rows as usize {
            let (hi, lo) = (2 * r * 2 * inter, (2 * r + 1) * 2 * inter);
            for c in 0..inter {
                let g = self.ld(gu, hi + c)? + self.ld(gu, lo + c)?;
                let u = self.ld(gu, hi + inter + c)? + self.ld(gu, lo + inter + c)?;
                self.st(out, r * inter + c, g / (1.0 + (-g).exp()) * u)?;
            }
        }
        Ok(())
    }

    pub(super) fn select_rows(&mut self, k: &KernelDesc, p: &SelectRowsPtrs<Ptr>, s: &SelectRowsScalars) -> R<()> {
        let (h, n) = (c_u32(k, "HIDDEN")?, c_pos(k, "N")?);
        let (x, acc, out) = (buf(p.x, "x")?, buf(p.accept_lens, io::ACCEPT_LENS)?, buf(p.out, "out")?);
        for i in 0..s.batch as usize {
            let a = (self.ld(acc, i)? as i64).clamp(1, n as i64) as usize;
            for c in 0..h {
                let v = self.ld(x, (i * n + a - 1) * h + c)?;
                self.st(out, i * h + c, v)?;
            }
        }
        Ok(())
    }

    /// Token slot of position `pos` of request `i` (whose table row is `slots[i]`), or
    /// `None` when it has none: the kernels' `kv_token` rule (a row outside the table, a
    /// position outside the row, a negative page, a slot outside the pool).
    fn token_slot(&self, slots: usize, i: usize, pos: i64) -> R<Option<usize>> {
        let req = self.ld(slots, i)? as i64;
        let t = self.table;
        if req < 0 || req as usize >= t.rows || pos < 0 {
            return Ok(None);
        }
        let row = &t.data[req as usize * t.cols..(req as usize + 1) * t.cols];
        let ps = self.plan.capture.page_size as i64;
        let tok = match t.mode {
            TableMode::TokenSlots => match row.get(pos as usize) {
                Some(&x) => x as i64,
                None => return Ok(None),
            },
            TableMode::PageIds => match row.get((pos / ps) as usize) {
                Some(&pg) if pg >= 0 => pg as i64 * ps + pos % ps,
                _ => return Ok(None),
            },
        };
        let pool = self.kv.slots().min(i64::MAX as u64) as i64;
        Ok((tok >= 0 && tok < pool).then_some(tok as usize))
    }

    fn kv_store(&mut self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize, v: f64) -> R<()> {
        let v = if self.rounded {
            crate::bits::round_act(v as f32, self.plan.capture.dtype) as f64
        } else {
            v
        };
        self.kv.store(kind, layer, slot, head, d, v)
    }

    fn kv_load(&self, kind: KvKind, layer: usize, slot: usize, head: usize, d: usize) -> R<f64> {
        self.kv.load(kind, layer, slot, head, d)
    }

    pub(super) fn rope_append(&mut self, k: &KernelDesc, p: &RopeAppendPtrs<Ptr>, s: &RopeAppendScalars) -> R<()> {
        let (hq, hkv, d, n) = (
            c_u32(k, "HEADS")?,
            c_u32(k, "KV_HEADS")?,
            c_u32(k, "HEAD_DIM")?,
            c_pos(k, "N")?,
        );
        let inv_freq = c_table(k, "INV_FREQ")?.to_vec();
        let lanes = Lanes::of(k)?;
        // YaRN's attention factor scales cos and sin (f32, as the kernel's tables).
        let scale = c_f32(k, "ROPE_SCALE")? as f64;
        let (qkv, prefix, slots) = (
            buf(p.qkv, "qkv")?,
            buf(p.prefix_lens, io::PREFIX_LENS)?,
            buf(p.req_slots, io::REQ_SLOTS)?,
        );
        if !matches!((p.page_table, p.kv_layout), (Ptr::Table, Ptr::Layout)) {
            return Err("page_table and kv_layout must be the page table and its layout".into());
        }
        let (kl, vl) = (
            kv(p.k_cache, KvKind::K, io::K_CACHE)?,
            kv(p.v_cache, KvKind::V, io::V_CACHE)?,
        );
        let half = d / 2;
        if inv_freq.len() < half {
            return Err(format!("INV_FREQ has {} entries, HEAD_DIM/2 is {half}", inv_freq.len()));
        }
        let stride = (hq + 2 * hkv) * d;
        for r in 0..s.rows as usize {
            let (i, j) = (r / n, r % n);
            let l = self.ld(prefix, i)? as i64;
            // Draft decode: every lane at L + step, its K/V in the lane's slot (rope_append.cu).
            let (pos, wpos) = match lanes {
                Some(ln) => (
                    l + ln.step as i64,
                    l + ln.offset(l.max(0) as u64, j) as i64 + ln.step as i64,
                ),
                None => (l + j as i64, l + j as i64),
            };
            let rotate = |x: &[f64]| -> Vec<f64> {
                let mut y = vec![0.0; d];
                for t in 0..half {
                    // f32 angle, as Hugging Face computes freqs in fp32.
                    let angle = (pos as f32 * inv_freq[t]) as f64;
                    let (sn, cs) = angle.sin_cos();
                    let (sn, cs) = (sn * scale, cs * scale);
                    y[t] = x[t] * cs - x[t + half] * sn;
                    y[t + half] = x[t + half] * cs + x[t] * sn;
                }
                y
            };
            for h in 0..hq {
                let x: Vec<f64> = (0..d).map(|t| self.ld(qkv, r * stride + h * d + t)).collect::<R<_>>()?;
                for (t, v) in rotate(&x).into_iter().enumerate() {
                    self.st(qkv, r * stride + h * d + t, v)?;
                }
            }
            // The kernel skips the cache write of a position without a token slot.
            let Some(tok) = self.token_slot(slots, i, wpos)? else {
                continue;
            };
            for h in 0..hkv {
                let kx: Vec<f64> = (0..d)
                    .map(|t| self.ld(qkv, r * stride + (hq + h) * d + t))
                    .collect::<R<_>>()?;
                for (t, v) in rotate(&kx).into_iter().enumerate() {
                    self.kv_store(KvKind::K, kl, tok, h, t, v)?;
                }
                for t in 0..d {
                    let v = self.ld(qkv, r * stride + (hq + hkv + h) * d + t)?;
                    self.kv_store(KvKind::V, vl, tok, h, t, v)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn attn_partial(
        &mut self,
        k: &KernelDesc,
        grid: [u32; 3],
        p: &AttnPartialPtrs<Ptr>,
        s: &AttnPartialScalars,
    ) -> R<()> {
        let (hq, hkv, d, n) = (
            c_u32(k, "HEADS")?,
            c_pos(k, "KV_HEADS")?,
            c_u32(k, "HEAD_DIM")?,
            c_pos(k, "N")?,
        );
        let window = c_u32(k, "WINDOW")?;
        let (scale, tile) = (c_f32(k, "SCALE")? as f64, c_pos(k, "KV_TILE")?);
        let lanes = Lanes::of(k)?;
        // Over the selected query rows (SELECT_FROM = S > 0, N = 1): request i's one row is
        // q row i·S + A_i − 1 at position L + A_i − 1 (attention.cu's header).
        let select_from = c_u32(k, "SELECT_FROM")? as usize;
        if select_from > 0 && (n != 1 || lanes.is_some()) {
            return Err(format!("SELECT_FROM {select_from} needs N 1 and no lanes (N {n})"));
        }
        let accept = match select_from {
            0 => None,
            _ => Some(buf(p.accept_lens, io::ACCEPT_LENS)?),
        };
        let (q, slots, prefix) = (
            buf(p.q, "q")?,
            buf(p.req_slots, io::REQ_SLOTS)?,
            buf(p.prefix_lens, io::PREFIX_LENS)?,
        );
        if !matches!((p.page_table, p.kv_layout), (Ptr::Table, Ptr::Layout)) {
            return Err("page_table and kv_layout must be the page table and its layout".into());
        }
        let (kl, vl) = (
            kv(p.k_cache, KvKind::K, io::K_CACHE)?,
            kv(p.v_cache, KvKind::V, io::V_CACHE)?,
        );
        let (batch, splits, q_stride) = (s.batch as usize, s.splits as usize, s.q_stride as usize);
        if grid[2] as usize != splits || splits == 0 {
            return Err(format!("grid.z {} != splits {splits}", grid[2]));
        }
        let rows = batch * n;
        let g = hq / hkv;
        // Splits that merge in their cluster (`cluster` = splits) write `out` as one split
        // does: the merge is exact, so one pass over all the keys is the same result.
        if s.cluster > 1 && s.cluster as usize != splits {
            return Err(format!("cluster {} is neither 1 nor the {splits} splits", s.cluster));
        }
        let parts = if s.cluster > 1 { 1 } else { splits };
        for i in 0..batch {
            let sel = match accept {
                Some(a) => (self.ld(a, i)? as i64).clamp(1, select_from as i64) as usize - 1,
                None => 0,
            };
            let l = self.ld(prefix, i)?.max(0.0) as usize + sel;
            // The first q row of request i: its selected row, or its first of N.
            let q0 = match accept {
                Some(_) => i * select_from + sel,
                None => i * n,
            };
            // Draft decode: the prefix, then every lane's step + 1 slots (attention.cu).
            let kv_len = match lanes {
                Some(ln) => l + n * (ln.step + 1),
                None => l + n,
            };
            let kv_start = match (window, lanes) {
                (0, _) => 0,
                (w, Some(ln)) => (l + ln.step + 1).saturating_sub(w).min(l),
                (w, None) => (l + 1).saturating_sub(w),
            };
            let total = kv_len - kv_start;
            let chunk = total.div_ceil(parts).div_ceil(tile) * tile;
            for sp in 0..parts {
                let lo = (kv_start + sp * chunk).min(kv_len);
                let hi = (kv_start + (sp + 1) * chunk).min(kv_len);
                for kvh in 0..hkv {
                    for j in 0..n {
                        let r = i * n + j;
                        for hh in 0..g {
                            let head = kvh * g + hh;
                            let qv: Vec<f64> = (0..d)
                                .map(|t| self.ld(q, (q0 + j) * q_stride + head * d + t))
                                .collect::<R<_>>()?;
                            let mut scores = Vec::new();
                            // A key without a token slot reads as zero K and V (the kernel's
                            // guard): score 0, no contribution to o.
                            for key in lo..hi {
                                let Some(pos) = key_position(lanes, l, j, n, window, key) else {
                                    continue;
                                };
                                let tok = self.token_slot(slots, i, pos as i64)?;
                                let mut dot = 0.0;
                                if let Some(tok) = tok {
                                    for (t, qt) in qv.iter().enumerate() {
                                        dot += qt * self.kv_load(KvKind::K, kl, tok, kvh, t)?;
                                    }
                                }
                                scores.push((dot * scale, tok));
                            }
                            let m = scores.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                            let den: f64 = scores.iter().map(|x| (x.0 - m).exp()).sum();
                            let mut o = vec![0.0f64; d];
                            for &(sc, tok) in &scores {
                                let w = (sc - m).exp() / den;
                                if let Some(tok) = tok {
                                    for (t, ot) in o.iter_mut().enumerate() {
                                        *ot += w * self.kv_load(KvKind::V, vl, tok, kvh, t)?;
                                    }
                                }
                            }
                            let lse = if scores.is_empty() {
                                f64::NEG_INFINITY
                            } else {
                                m + den.ln()
                            };
                            if parts == 1 {
                                let out = buf(p.out, "out")?;
                                for (t, v) in o.into_iter().enumerate() {
                                    self.st(out, r * hq * d + head * d + t, v)?;
                                }
                            } else {
                                let (po, pl) = (buf(p.part_o, "part_o")?, buf(p.part_lse, "part_lse")?);
                                for (t, v) in o.into_iter().enumerate() {
                                    self.st(po, ((sp * rows + r) * hq + head) * d + t, v)?;
                                }
                                self.st(pl, (sp * rows + r) * hq + head, lse)?;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `attn_fused`: the splits and, in each group's last CTA, their merge. The merge is
    /// exact, so `out` is what one pass over all the keys gives: `attn_partial`'s result with
    /// the splits merged in their cluster.
    pub(super) fn attn_fused(
        &mut self,
        k: &KernelDesc,
        grid: [u32; 3],
        p: &AttnFusedPtrs<Ptr>,
        s: &AttnFusedScalars,
    ) -> R<()> {
        let (mut whole, counters) = p.clone().unfused();
        if !matches!(counters, Ptr::Counters) {
            return Err("counters must be the runtime's arrival counters".into());
        }
        // One pass over all the keys: no partials.
        (whole.part_o, whole.part_lse) = (Ptr::Null, Ptr::Null);
        let scalars = AttnPartialScalars {
            batch: s.batch,
            splits: s.splits,
            q_stride: s.q_stride,
            cluster: s.splits,
        };
        self.attn_partial(k, grid, &whole, &scalars)
    }

    pub(super) fn attn_merge(&mut self, k: &KernelDesc, p: &AttnMergePtrs<Ptr>, s: &AttnMergeScalars) -> R<()> {
        let (heads, d) = (c_u32(k, "HEADS")?, c_u32(k, "HEAD_DIM")?);
        let (po, pl, out) = (
            buf(p.part_o, "part_o")?,
            buf(p.part_lse, "part_lse")?,
            buf(p.out, "out")?,
        );
        let (rows, splits) = (s.rows as usize, s.splits as usize);
        for r in 0..rows {
            for hh in 0..heads {
                let lse: Vec<f64> = (0..splits)
                    .map(|sp| self.ld(pl, (sp * rows + r) * heads + hh))
                    .collect::<R<_>>()?;
                let m = lse.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = lse
                    .iter()
                    .map(|&l| if l == f64::NEG_INFINITY { 0.0 } else { (l - m).exp() })
                    .collect();
                let total: f64 = w.iter().sum();
                for dd in 0..d {
                    let mut acc = 0.0;
                    for (sp, ws) in w.iter().enumerate() {
                        if *ws > 0.0 {
                            acc += ws * self.ld(po, ((sp * rows + r) * heads + hh) * d + dd)?;
                        }
                    }
                    self.st(
                        out,
                        r * heads * d + hh * d + dd,
                        if total > 0.0 { acc / total } else { 0.0 },
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// Draft decode's lane rule of a rope_append or attention instance (`LANE_STEPS > 0`).
#[derive(Clone, Copy)]
pub(super) struct Lanes {
    pub steps: u32,
    pub lanes: u32,
    pub page: u32,
    pub step: usize,
}

impl Lanes {
    pub fn of(k: &KernelDesc) -> R<Option<Lanes>> {
        let steps = c_u32(k, "LANE_STEPS")? as u32;
        if steps == 0 {
            return Ok(None);
        }
        Ok(Some(Lanes {
            steps,
            lanes: c_pos(k, "N")? as u32,
            page: c_pos(k, "PAGE_SIZE")? as u32,
            step: c_u32(k, "STEP")?,
        }))
    }

    /// Lane `lane`'s offset past the prefix `l` (common.cuh `lane_offset`).
    pub fn offset(self, l: u64, lane: usize) -> u64 {
        specplan_kernels::facts::lane_offset(l, lane as u32, self.steps, self.lanes, self.page)
    }
}

/// The position of key index `key` for row `j` of a request with prefix `l` when the row sees
/// it (attention.cu): draft-extend's causal rows (key = position, up to `l + j`, within the
/// window), or draft decode's prefix and own lane (the window by sequence position).
fn key_position(lanes: Option<Lanes>, l: usize, j: usize, n: usize, window: usize, key: usize) -> Option<usize> {
    let Some(ln) = lanes else {
        let q = l + j;
        return (key <= q && (window == 0 || key + window > q)).then_some(key);
    };
    let q = l + ln.step;
    if key < l {
        return (window == 0 || key + window > q).then_some(key);
    }
    let (lane, at) = ((key - l) / (ln.step + 1), (key - l) % (ln.step + 1));
    let seen = lane == j && lane < n && (window == 0 || l + at + window > q);
    seen.then(|| l + ln.offset(l as u64, lane) as usize + at)
}
