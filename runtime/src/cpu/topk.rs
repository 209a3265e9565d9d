//! The sample.cu entries on the CPU (softmax, top-K, the chunk records and their merge, the
//! sharded logits gather, the top-K refinement), from the contract in sample.cu's header.

use specplan_format::io;
use specplan_format::KernelDesc;
use specplan_kernels::entries::sample::{
    LogitsGatherPtrs, LogitsGatherScalars, SoftmaxTopkPtrs, SoftmaxTopkScalars, TopkFusedPtrs, TopkFusedScalars,
    TopkMergePtrs, TopkMergeScalars, TopkPartialPtrs, TopkPartialScalars,
};
use specplan_kernels::facts::topk_record_floats;

use super::entries::{buf, c_bool, c_f32, c_pos, c_u32, rms_inv, weight};
use super::{Ctx, KvStore, Ptr, R};

impl<K: KvStore> Ctx<'_, K> {
    /// The id of column `c` of a logits row: the hot map's entry (HOT_MAP), `c` plus its
    /// d2t offset (ID_OFFSET, EAGLE-3), or `c`.
    fn column_id(&self, k: &KernelDesc, map: Ptr, c: usize) -> R<f64> {
        let (hot, offset) = (c_bool(k, "HOT_MAP")?, c_bool(k, "ID_OFFSET")?);
        match (hot, offset, map) {
            (true, true, _) => Err("HOT_MAP and ID_OFFSET are exclusive".into()),
            (true, false, Ptr::Weight(w)) => self.wf(w, c),
            (false, true, Ptr::Weight(w)) => Ok(c as f64 + self.wf(w, c)?),
            (true, false, other) | (false, true, other) => {
                Err(format!("an id map without a hot_ids weight ({other:?})"))
            }
            (false, false, _) => Ok(c as f64),
        }
    }

    /// REFINE (sample.cu's contract): the candidates `(value, column)` recomputed from row
    /// `i` of the fp32 stream `x` — normed by `norm_w` with HEAD_NORM — through the lm_head
    /// rows `lm_w[column]`, the reference max raised to m' = max(m, v'), `sum` rescaled to it
    /// with each candidate's exp(v − m') replaced by exp(v' − m') (the others' share clamped
    /// at 0), and sorted again (descending, ties to the lower column). Nothing without
    /// REFINE, or for an empty range (m = −∞).
    #[allow(clippy::too_many_arguments)] // the kernel's row state, as refine_cands has it
    fn refine(
        &self,
        k: &KernelDesc,
        r: Refine,
        i: usize,
        m: &mut f64,
        sum: &mut f64,
        cands: &mut [(f64, usize)],
    ) -> R<()> {
        if !c_bool(k, "REFINE")? || *m == f64::NEG_INFINITY {
            return Ok(());
        }
        let h = c_pos(k, "HIDDEN")?;
        let x = buf(r.x, "x")?;
        let lm = weight(r.lm_w, "lm_w")?;
        let mut y: Vec<f64> = (0..h).map(|e| self.ld(x, i * h + e)).collect::<R<_>>()?;
        if c_bool(k, "HEAD_NORM")? {
            let (nw, eps) = (weight(r.norm_w, "norm_w")?, c_f32(k, "EPS")? as f64);
            let inv = rms_inv(&y, eps);
            for (e, v) in y.iter_mut().enumerate() {
                *v *= inv * self.wf(nw, e)?;
            }
        }
        let mut refined = Vec::with_capacity(cands.len());
        for (_, c) in cands.iter() {
            let mut acc = 0.0;
            for (e, ye) in y.iter().enumerate() {
                acc += ye * self.wf(lm, *c * h + e)?;
            }
            refined.push(acc as f32 as f64);
        }
        let m2 = refined.iter().cloned().fold(*m, f64::max);
        // The other columns' share (clamped at 0, as the kernel does), then the refined
        // candidates'.
        let others = *sum * (*m - m2).exp() - cands.iter().map(|(v, _)| (v - m2).exp()).sum::<f64>();
        let mut s = others.max(0.0);
        for ((v, _), v2) in cands.iter_mut().zip(&refined) {
            s += (v2 - m2).exp();
            *v = *v2;
        }
        (*m, *sum) = (m2, s);
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        Ok(())
    }

    pub(super) fn softmax_topk(&mut self, k: &KernelDesc, p: &SoftmaxTopkPtrs<Ptr>, s: &SoftmaxTopkScalars) -> R<()> {
        let (cols, topk, cands_n) = (c_u32(k, "COLS")?, c_u32(k, "TOPK")?, c_u32(k, "CANDS")?);
        let (logits, probs, ids) = (buf(p.logits, io::LOGITS)?, buf(p.probs, "probs")?, buf(p.ids, "ids")?);
        let r = Refine {
            x: p.x,
            norm_w: p.norm_w,
            lm_w: p.lm_w,
        };
        for i in 0..s.batch as usize {
            let row: Vec<f64> = (0..cols).map(|c| self.ld(logits, i * cols + c)).collect::<R<_>>()?;
            let mut m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let mut sum: f64 = row.iter().map(|x| (x - m).exp()).sum();
            let mut order: Vec<usize> = (0..cols).collect();
            // Descending by logit; ties to the lower column (a stable sort keeps them).
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let mut cands: Vec<(f64, usize)> = order.iter().take(cands_n).map(|&c| (row[c], c)).collect();
            self.refine(k, r, i, &mut m, &mut sum, &mut cands)?;
            for slot in 0..topk {
                let (prob, id) = match cands.get(slot) {
                    Some(&(v, c)) => (((v - m).exp() / sum) as f32 as f64, self.column_id(k, p.hot_ids, c)?),
                    None => (0.0, -1.0),
                };
                self.st(probs, i * topk + slot, prob)?;
                self.st(ids, i * topk + slot, id)?;
            }
        }
        Ok(())
    }

    pub(super) fn topk_partial(&mut self, k: &KernelDesc, p: &TopkPartialPtrs<Ptr>, s: &TopkPartialScalars) -> R<()> {
        let (cols, cands_n) = (c_u32(k, "COLS")?, c_u32(k, "CANDS")?);
        // A tensor-parallel rank's columns start at COL_OFFSET of the full row; its records
        // carry full-row columns.
        let offset = c_u32(k, "COL_OFFSET")?;
        let (logits, part) = (buf(p.logits, io::LOGITS)?, buf(p.part, "part")?);
        let chunks = s.chunks as usize;
        if chunks == 0 {
            return Err("chunks is 0".into());
        }
        let rec = topk_record_floats(cands_n as u32) as usize;
        // Chunk ch: columns [ch·W, min(cols, (ch+1)·W)), W = ceil(cols/chunks) rounded up
        // to a multiple of 4 (sample.cu's contract).
        let width = cols.div_ceil(chunks).div_ceil(4) * 4;
        for i in 0..s.batch as usize {
            for ch in 0..chunks {
                let (c0, c1) = ((ch * width).min(cols), ((ch + 1) * width).min(cols));
                let vals: Vec<f64> = (c0..c1).map(|c| self.ld(logits, i * cols + c)).collect::<R<_>>()?;
                let m = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = if m == f64::NEG_INFINITY {
                    0.0
                } else {
                    vals.iter().map(|x| (x - m).exp()).sum()
                };
                let mut order: Vec<usize> = (0..vals.len()).collect();
                // Stable: ties to the lower column.
                order.sort_by(|&a, &b| vals[b].total_cmp(&vals[a]));
                let cands: Vec<(f64, usize)> = order.iter().take(cands_n).map(|&j| (vals[j], c0 + j)).collect();
                let base = (i * chunks + ch) * rec;
                self.st(part, base, m as f32 as f64)?;
                self.st(part, base + 1, sum as f32 as f64)?;
                for slot in 0..cands_n {
                    let (v, c) = match cands.get(slot) {
                        Some(&(v, c)) => (v, (offset + c) as f64),
                        None => (f64::NEG_INFINITY, -1.0),
                    };
                    self.st(part, base + 2 + slot, v)?;
                    self.st(part, base + 2 + cands_n + slot, c)?;
                }
            }
        }
        Ok(())
    }

    /// `logits_gather`: every rank's share (rank-major) into full rows (sample.cu's header).
    pub(super) fn logits_gather(
        &mut self,
        k: &KernelDesc,
        p: &LogitsGatherPtrs<Ptr>,
        s: &LogitsGatherScalars,
    ) -> R<()> {
        let (cols, ranks) = (c_u32(k, "COLS")?, c_u32(k, "RANKS")?.max(1));
        let (part, out) = (buf(p.part, "part")?, buf(p.out, "out")?);
        let batch = s.batch as usize;
        for t in 0..ranks {
            for i in 0..batch {
                for c in 0..cols {
                    let v = self.ld(part, (t * batch + i) * cols + c)?;
                    self.st(out, i * cols * ranks + t * cols + c, v)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn topk_merge(&mut self, k: &KernelDesc, p: &TopkMergePtrs<Ptr>, s: &TopkMergeScalars) -> R<()> {
        let (cols, topk, ranks) = (c_u32(k, "COLS")?, c_u32(k, "TOPK")?, c_u32(k, "RANKS")?.max(1));
        let cands_n = c_u32(k, "CANDS")?;
        let (part, probs, ids) = (buf(p.part, "part")?, buf(p.probs, "probs")?, buf(p.ids, "ids")?);
        let r = Refine {
            x: p.x,
            norm_w: p.norm_w,
            lm_w: p.lm_w,
        };
        let (chunks, batch) = (s.chunks as usize, s.batch as usize);
        let rec = topk_record_floats(cands_n as u32) as usize;
        // Every rank's records, rank-major (sample.cu's contract); columns of the full row.
        let all_cols = cols * ranks;
        for i in 0..batch {
            let base = |x: usize| (((x / chunks) * batch + i) * chunks + x % chunks) * rec;
            let chunks = chunks * ranks;
            let mut heads = Vec::with_capacity(chunks);
            for ch in 0..chunks {
                heads.push((self.ld(part, base(ch))?, self.ld(part, base(ch) + 1)?));
            }
            let mut m = heads.iter().map(|h| h.0).fold(f64::NEG_INFINITY, f64::max);
            let mut sum: f64 = heads
                .iter()
                .filter(|&&(mc, _)| mc != f64::NEG_INFINITY)
                .map(|&(mc, sc)| sc * (mc - m).exp())
                .sum();
            // Every chunk's candidates with a column, best first (ties: lower column).
            let mut cand = Vec::new();
            for ch in 0..chunks {
                for sl in 0..cands_n {
                    let (v, c) = (
                        self.ld(part, base(ch) + 2 + sl)?,
                        self.ld(part, base(ch) + 2 + cands_n + sl)?,
                    );
                    if c >= 0.0 {
                        cand.push((v, c));
                    }
                }
            }
            cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.total_cmp(&b.1)));
            // The kernel's guard: a winner whose column is outside [0, COLS·RANKS) (only a
            // corrupt record holds one) yields probability 0, id -1 in its slot; with REFINE
            // it is an empty entry, sorted after the refined winners (sample.cu's topk_merge).
            let valid = |c: f64| c >= 0.0 && (c as usize) < all_cols;
            let top: Vec<(f64, f64)> = cand.iter().take(cands_n).copied().collect();
            let won: Vec<Option<(f64, usize)>> = if c_bool(k, "REFINE")? {
                let mut refined: Vec<(f64, usize)> = top
                    .iter()
                    .filter(|x| valid(x.1))
                    .map(|&(v, c)| (v, c as usize))
                    .collect();
                self.refine(k, r, i, &mut m, &mut sum, &mut refined)?;
                refined.into_iter().map(Some).collect()
            } else {
                top.iter().map(|&(v, c)| valid(c).then_some((v, c as usize))).collect()
            };
            for slot in 0..topk {
                let (prob, id) = match won.get(slot).copied().flatten() {
                    Some((v, c)) => {
                        let prob = if m != f64::NEG_INFINITY && sum > 0.0 {
                            ((v - m).exp() / sum) as f32 as f64
                        } else {
                            0.0
                        };
                        (prob, self.column_id(k, p.hot_ids, c)?)
                    }
                    None => (0.0, -1.0),
                };
                self.st(probs, i * topk + slot, prob)?;
                self.st(ids, i * topk + slot, id)?;
            }
        }
        Ok(())
    }

    /// `topk_fused` (sample.cu's contract): `topk_partial`'s records, the CTAs' arrivals on
    /// the row's counter (`atomicInc` wrapping at chunks − 1: the arrival that finds
    /// chunks − 1 is the row's last and merges), then `topk_merge`'s merge of every row. The
    /// executor runs the CTAs in order, so the last arrival is the last chunk; what it checks
    /// is the counters' contract: each row's word starts at 0, exactly one arrival is last,
    /// and the word is 0 again after the launch.
    pub(super) fn topk_fused(&mut self, k: &KernelDesc, p: &TopkFusedPtrs<Ptr>, s: &TopkFusedScalars) -> R<()> {
        if c_u32(k, "RANKS")? != 1 {
            return Err("topk_fused merges one rank's records (RANKS must be 1)".into());
        }
        if !matches!(p.counters, Ptr::Counters) {
            return Err(format!(
                "counters must be the runtime's counter words, is {:?}",
                p.counters
            ));
        }
        let (batch, chunks) = (s.batch as usize, s.chunks);
        if chunks == 0 || chunks > specplan_kernels::facts::MAX_TOPK_CHUNKS {
            return Err(format!("chunks {chunks} outside [1, 32]"));
        }
        if batch > self.counters.len() {
            return Err(format!("{batch} rows, {} counter words", self.counters.len()));
        }
        let part = TopkPartialPtrs {
            logits: p.logits,
            part: p.part,
        };
        self.topk_partial(k, &part, &TopkPartialScalars { batch: s.batch, chunks })?;
        for (i, word) in self.counters.iter_mut().take(batch).enumerate() {
            if *word != 0 {
                return Err(format!("row {i}'s counter is {word} before the launch (must be 0)"));
            }
            let mut last = 0;
            for _ in 0..chunks {
                let prev = *word;
                *word = if prev >= chunks - 1 { 0 } else { prev + 1 };
                last += (prev == chunks - 1) as u32;
            }
            if last != 1 || *word != 0 {
                return Err(format!(
                    "row {i}: {last} last arrivals, counter {word} after the launch"
                ));
            }
        }
        let merge = TopkMergePtrs {
            part: p.part,
            hot_ids: p.hot_ids,
            probs: p.probs,
            ids: p.ids,
            x: p.x,
            norm_w: p.norm_w,
            lm_w: p.lm_w,
        };
        self.topk_merge(k, &merge, &TopkMergeScalars { batch: s.batch, chunks })
    }
}

/// The refinement's arguments of `softmax_topk` / `topk_merge` (null without REFINE).
#[derive(Clone, Copy)]
struct Refine {
    x: Ptr,
    norm_w: Ptr,
    lm_w: Ptr,
}
