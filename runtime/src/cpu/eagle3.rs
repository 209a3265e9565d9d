//! The EAGLE-3 entries on the CPU (`embed.cu` `embed_norm_concat`) and the selected rows'
//! residual norms (`select.cu` `select_norm`, `select_norm_pairs`), written from their
//! headers with the same guards as the other entries.

use specplan_format::KernelDesc;
use specplan_format::{io, DType};
use specplan_kernels::entries::embed::{EmbedNormConcatPtrs, EmbedNormConcatScalars};
use specplan_kernels::entries::norm::{NormConcatPtrs, NormConcatScalars};
use specplan_kernels::entries::select::{
    SelectNormPairsPtrs, SelectNormPairsScalars, SelectNormPtrs, SelectNormScalars,
};

use super::entries::{buf, c_f32, c_pos, c_u32, rms_inv, weight};
use super::{Ctx, KvStore, R};

impl<K: KvStore> Ctx<'_, K> {
    /// RMSNorm of `row` by weight `w` into buffer `out` at element `at` (norm.cu's maths).
    fn norm_into(&mut self, row: &[f64], w: usize, eps: f64, out: usize, at: usize) -> R<()> {
        let inv = rms_inv(row, eps);
        for (c, v) in row.iter().enumerate() {
            let y = v * inv * self.wf(w, c)?;
            self.st(out, at + c, y)?;
        }
        Ok(())
    }

    pub(super) fn embed_norm_concat(
        &mut self,
        k: &KernelDesc,
        p: &EmbedNormConcatPtrs<super::Ptr>,
        s: &EmbedNormConcatScalars,
    ) -> R<()> {
        let (h, vocab, eps) = (c_pos(k, "HIDDEN")?, c_u32(k, "VOCAB")? as i64, c_f32(k, "EPS")? as f64);
        let (ids, table, we, hb, wh, out) = (
            buf(p.ids, "ids")?,
            weight(p.table, "table")?,
            weight(p.w_embed, "w_embed")?,
            buf(p.h, "h")?,
            weight(p.w_hidden, "w_hidden")?,
            buf(p.out, "out")?,
        );
        for r in 0..s.rows as usize {
            let id = self.ld(ids, r)? as i64;
            let id = if (0..vocab).contains(&id) { id as usize } else { 0 };
            let e: Vec<f64> = (0..h).map(|c| self.wf(table, id * h + c)).collect::<R<_>>()?;
            self.norm_into(&e, we, eps, out, r * 2 * h)?;
            let x: Vec<f64> = (0..h).map(|c| self.ld(hb, r * h + c)).collect::<R<_>>()?;
            self.norm_into(&x, wh, eps, out, r * 2 * h + h)?;
        }
        Ok(())
    }

    /// `norm_concat` (norm.cu's header): both halves of each `[2H]` row normed, each with
    /// its weight.
    pub(super) fn norm_concat(
        &mut self,
        k: &KernelDesc,
        p: &NormConcatPtrs<super::Ptr>,
        s: &NormConcatScalars,
    ) -> R<()> {
        let (h, eps) = (c_pos(k, "HIDDEN")?, c_f32(k, "EPS")? as f64);
        let (x, wa, wb, out) = (
            buf(p.x, "x")?,
            weight(p.w_a, "w_a")?,
            weight(p.w_b, "w_b")?,
            buf(p.out, "out")?,
        );
        for r in 0..s.rows as usize {
            for (half, w) in [(0, wa), (1, wb)] {
                let base = r * 2 * h + half * h;
                let row: Vec<f64> = (0..h).map(|c| self.ld(x, base + c)).collect::<R<_>>()?;
                self.norm_into(&row, w, eps, out, base)?;
            }
        }
        Ok(())
    }

    /// `select_norm` with the norm as hi/lo row pairs (`select_norm_pairs`): `hi` is the
    /// norm rounded to the buffer's type, `lo` the rest (stored exactly here, rounded too
    /// by a rounding executor, as on the device).
    pub(super) fn select_norm_pairs(
        &mut self,
        k: &KernelDesc,
        p: &SelectNormPairsPtrs<super::Ptr>,
        s: &SelectNormPairsScalars,
    ) -> R<()> {
        let (h, n, eps) = (c_pos(k, "HIDDEN")?, c_pos(k, "N")?, c_f32(k, "EPS")? as f64);
        let (x, acc, add, w, out, normed) = (
            buf(p.x, "x")?,
            buf(p.accept_lens, io::ACCEPT_LENS)?,
            buf(p.add, "add")?,
            weight(p.weight, "weight")?,
            buf(p.out, "out")?,
            buf(p.normed, "normed")?,
        );
        let act = self.plan.capture.dtype;
        for i in 0..s.batch as usize {
            let row = self.select_row(x, acc, add, Some(out), i, n, h)?;
            let inv = rms_inv(&row, eps);
            for (c, v) in row.iter().enumerate() {
                let y = v * inv * self.wf(w, c)?;
                let hi = crate::bits::round_act(y as f32, act) as f64;
                self.st(normed, 2 * i * h + c, hi)?;
                self.st(normed, (2 * i + 1) * h + c, y - hi)?;
            }
        }
        Ok(())
    }

    pub(super) fn select_norm(
        &mut self,
        k: &KernelDesc,
        p: &SelectNormPtrs<super::Ptr>,
        s: &SelectNormScalars,
    ) -> R<()> {
        let (h, n, eps) = (c_pos(k, "HIDDEN")?, c_pos(k, "N")?, c_f32(k, "EPS")? as f64);
        let (x, acc, add, w, normed) = (
            buf(p.x, "x")?,
            buf(p.accept_lens, io::ACCEPT_LENS)?,
            buf(p.add, "add")?,
            weight(p.weight, "weight")?,
            buf(p.normed, "normed")?,
        );
        // Null on a tensor-parallel rank other than 0 (the header).
        let out = match p.out {
            super::Ptr::Null => None,
            o => Some(buf(o, "out")?),
        };
        for i in 0..s.batch as usize {
            let row = self.select_row(x, acc, add, out, i, n, h)?;
            self.norm_into(&row, w, eps, normed, i * h)?;
        }
        Ok(())
    }

    /// Request `i`'s selected row of `x` (its accept length clamped to [1, N]) plus row `i`
    /// of `add`, copied into row `i` of `out` when there is one: `select_norm`'s and
    /// `select_norm_pairs`' first half: the sum as `out` holds it (the device rounds it once
    /// to the stream's type, exact for an fp32 stream).
    #[allow(clippy::too_many_arguments)]
    fn select_row(
        &mut self,
        x: usize,
        acc: usize,
        add: usize,
        out: Option<usize>,
        i: usize,
        n: usize,
        h: usize,
    ) -> R<Vec<f64>> {
        let a = (self.ld(acc, i)? as i64).clamp(1, n as i64) as usize;
        let row: Vec<f64> = (0..h)
            .map(|c| Ok(self.ld(x, (i * n + a - 1) * h + c)? + self.ld(add, i * h + c)?))
            .collect::<R<_>>()?;
        let Some(out) = out else {
            // No sum written (a tensor-parallel rank other than 0): its rounding to the
            // stream's type, as the device's norm reads it.
            let dtype = self.bucket.buffers.get(x).map(|b| b.dtype);
            return Ok(match dtype {
                Some(d @ (DType::Bf16 | DType::F16)) if self.rounded => row
                    .iter()
                    .map(|&v| crate::bits::round_act(v as f32, d) as f64)
                    .collect(),
                _ => row,
            });
        };
        for (c, v) in row.iter().enumerate() {
            self.st(out, i * h + c, *v)?;
        }
        // The norm reads the sum as stored (a rounding executor's stream type, as on the
        // device).
        (0..h).map(|c| self.ld(out, i * h + c)).collect()
    }
}
