//! Draft decode's tree entries on the CPU, written from tree.cu's header: the root, the
//! selection between forwards, the result and the row gather. Values are f32 products as
//! the kernels compute them; the order of candidates is value descending, NaN above every
//! number, ties to the lower index.

use std::cmp::Ordering;

use specplan_format::{io, KernelDesc};
use specplan_kernels::entries::tree::{
    GatherRowsPtrs, GatherRowsScalars, TreeFinishPtrs, TreeFinishScalars, TreeInitPtrs, TreeInitScalars,
    TreeSelectPtrs, TreeSelectScalars, TreeVerifyPtrs, TreeVerifyScalars,
};

use super::entries::{buf, c_pos, c_u32};
use super::{Ctx, KvStore, Ptr, R};

/// The tree's sizes from an instance's constants.
struct Tree {
    k: usize,
    cands: usize,
    parents: usize,
    nodes: usize,
    step: usize,
}

impl Tree {
    fn of(k: &KernelDesc) -> R<Tree> {
        let (topk, steps) = (c_pos(k, "TOPK")?, c_pos(k, "LANE_STEPS")?);
        let n = c_pos(k, "DRAFT_TOKENS")?;
        Ok(Tree {
            k: topk,
            cands: specplan_kernels::facts::tree_candidates(topk as u32, steps as u32) as usize,
            parents: specplan_kernels::facts::parent_width(topk as u32, steps as u32) as usize,
            nodes: n - 1,
            step: c_u32(k, "STEP")?,
        })
    }
}

/// The candidates' order: `a` before `b` (tree.cu `before`).
fn order(a: (f32, usize), b: (f32, usize)) -> Ordering {
    match (a.0.is_nan(), b.0.is_nan()) {
        (true, true) => a.1.cmp(&b.1),
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        _ => b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1)),
    }
}

/// Indices of the `n` first of `v` in [`order`].
fn best(v: &[f32], n: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| order((v[a], a), (v[b], b)));
    idx.truncate(n);
    idx
}

fn opt(p: Ptr, name: &str) -> R<Option<usize>> {
    match p {
        Ptr::Null => Ok(None),
        other => buf(other, name).map(Some),
    }
}

impl<K: KvStore> Ctx<'_, K> {
    pub(super) fn tree_init(&mut self, k: &KernelDesc, p: &TreeInitPtrs<Ptr>, s: &TreeInitScalars) -> R<()> {
        let t = Tree::of(k)?;
        let (probs, ids) = (buf(p.topk_probs, io::TOPK_PROBS)?, buf(p.topk_ids, io::TOPK_IDS)?);
        let (scores, out_ids, sl, tl, pl) = (
            buf(p.scores, "scores")?,
            buf(p.ids, "ids")?,
            buf(p.score_list, "score_list")?,
            buf(p.token_list, "token_list")?,
            buf(p.parent_list, io::PARENT_LIST)?,
        );
        let src = opt(p.src, "src")?;
        for r in 0..s.batch as usize {
            for j in 0..t.k {
                let z = r * t.k + j;
                let (pr, id) = (self.ld(probs, z)? as f32 as f64, self.ld(ids, z)?);
                self.st(scores, z, pr)?;
                self.st(out_ids, z, id)?;
                if let Some(src) = src {
                    self.st(src, z, r as f64)?;
                }
                self.st(sl, r * t.cands + j, pr)?;
                self.st(tl, r * t.cands + j, id)?;
            }
            for j in 0..=t.k {
                self.st(pl, r * t.parents + j, j as f64 - 1.0)?;
            }
        }
        Ok(())
    }

    pub(super) fn tree_select(&mut self, k: &KernelDesc, p: &TreeSelectPtrs<Ptr>, s: &TreeSelectScalars) -> R<()> {
        let t = Tree::of(k)?;
        if t.step == 0 {
            return Err("tree_select runs at steps 1 and later".into());
        }
        let kk = t.k * t.k;
        let (scores, probs, ids) = (buf(p.scores, "scores")?, buf(p.probs, "probs")?, buf(p.ids, "ids")?);
        let (sl, tl) = (buf(p.score_list, "score_list")?, buf(p.token_list, "token_list")?);
        let pl = opt(p.parent_list, io::PARENT_LIST)?;
        let (s_out, next, src) = (
            opt(p.scores_out, "scores_out")?,
            opt(p.next_ids, "next_ids")?,
            opt(p.src, "src")?,
        );
        for r in 0..s.batch as usize {
            let base = r * t.cands + t.k + (t.step - 1) * kk;
            let mut e = vec![0f32; kk];
            for (c, ec) in e.iter_mut().enumerate() {
                let z = r * t.k + c / t.k;
                // fp32 product, as torch and the kernel compute it.
                *ec = self.ld(scores, z)? as f32 * self.ld(probs, z * t.k + c % t.k)? as f32;
                self.st(sl, base + c, *ec as f64)?;
                let id = self.ld(ids, z * t.k + c % t.k)?;
                self.st(tl, base + c, id)?;
            }
            for (lane, c) in best(&e, t.k).into_iter().enumerate() {
                let z = r * t.k + lane;
                let from = r * t.k + c / t.k;
                if let Some(o) = s_out {
                    self.st(o, z, e[c] as f64)?;
                }
                if let Some(o) = next {
                    let id = self.ld(ids, from * t.k + c % t.k)?;
                    self.st(o, z, id)?;
                }
                if let Some(o) = src {
                    self.st(o, z, from as f64)?;
                }
                if let Some(o) = pl {
                    let at = r * t.parents + t.k + 1 + (t.step - 1) * t.k + lane;
                    self.st(o, at, (c + kk * (t.step - 1) + t.k) as f64)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn tree_finish(&mut self, k: &KernelDesc, p: &TreeFinishPtrs<Ptr>, s: &TreeFinishScalars) -> R<()> {
        let t = Tree::of(k)?;
        let (sl, tl) = (buf(p.score_list, "score_list")?, buf(p.token_list, "token_list")?);
        let (top, tokens) = (
            buf(p.top_scores_index, io::TOP_SCORES_INDEX)?,
            buf(p.draft_tokens, io::DRAFT_TOKENS)?,
        );
        for r in 0..s.batch as usize {
            let v: Vec<f32> = (0..t.cands)
                .map(|c| self.ld(sl, r * t.cands + c).map(|x| x as f32))
                .collect::<R<_>>()?;
            let mut chosen = best(&v, t.nodes);
            chosen.sort_unstable();
            for (at, c) in chosen.into_iter().enumerate() {
                self.st(top, r * t.nodes + at, c as f64)?;
                let id = self.ld(tl, r * t.cands + c)?;
                self.st(tokens, r * t.nodes + at, id)?;
            }
        }
        Ok(())
    }

    /// The verify inputs of each request's tree (tree.cu `tree_verify`).
    pub(super) fn tree_verify(&mut self, k: &KernelDesc, p: &TreeVerifyPtrs<Ptr>, s: &TreeVerifyScalars) -> R<()> {
        let t = Tree::of(k)?;
        let n = t.nodes + 1;
        let (pl, top, dt) = (
            buf(p.parent_list, io::PARENT_LIST)?,
            buf(p.top_scores_index, io::TOP_SCORES_INDEX)?,
            buf(p.draft_tokens, io::DRAFT_TOKENS)?,
        );
        let (bonus, prefix) = (
            buf(p.bonus_tokens, io::BONUS_TOKENS)?,
            buf(p.prefix_lens, io::PREFIX_LENS)?,
        );
        let outs = [
            buf(p.tokens, io::VERIFY_TOKENS)?,
            buf(p.positions, io::VERIFY_POSITIONS)?,
            buf(p.retrieve_index, io::RETRIEVE_INDEX)?,
            buf(p.next_token, io::RETRIEVE_NEXT_TOKEN)?,
            buf(p.next_sibling, io::RETRIEVE_NEXT_SIBLING)?,
        ];
        let mask = buf(p.mask, io::TREE_MASK)?;
        for r in 0..s.batch as usize {
            let sel: Vec<i64> = (0..t.nodes)
                .map(|j| self.ld(top, r * t.nodes + j).map(|x| x as i64))
                .collect::<R<_>>()?;
            // Each node's parent node: the root for a root child or when the parent's score
            // index is not chosen (only at exact ties or NaN).
            let mut par = vec![-1i64; n];
            for j in 1..n {
                let tb = sel[j - 1].div_euclid(t.k as i64);
                par[j] = 0;
                if tb > 0 && (tb as usize) < t.parents {
                    let target = self.ld(pl, r * t.parents + tb as usize)? as i64;
                    if let Some(q) = sel.iter().position(|&x| x == target) {
                        par[j] = q as i64 + 1;
                    }
                }
            }
            let l = self.ld(prefix, r)?;
            let mut next = vec![-1i64; n];
            let mut sibling = vec![-1i64; n];
            for j in (1..n).rev() {
                let q = par[j] as usize;
                sibling[j] = next[q];
                next[q] = j as i64;
            }
            for j in 0..n {
                let mut row = vec![0.0; n];
                let (mut a, mut depth, mut guard) = (j as i64, 0i64, 0);
                while a >= 0 && guard <= n {
                    row[a as usize] = 1.0;
                    depth += (a > 0) as i64;
                    a = par[a as usize];
                    guard += 1;
                }
                let token = if j == 0 {
                    self.ld(bonus, r)?
                } else {
                    self.ld(dt, r * t.nodes + j - 1)?
                };
                let at = r * n + j;
                let vals = [token, l + depth as f64, at as f64, next[j] as f64, sibling[j] as f64];
                for (o, v) in outs.iter().zip(vals) {
                    self.st(*o, at, v)?;
                }
                for (c, &v) in row.iter().enumerate() {
                    self.st(mask, at * n + c, v)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn gather_rows(&mut self, k: &KernelDesc, p: &GatherRowsPtrs<Ptr>, s: &GatherRowsScalars) -> R<()> {
        let h = c_u32(k, "HIDDEN")?;
        let (x, src, out) = (buf(p.x, "x")?, buf(p.src, "src")?, buf(p.out, "out")?);
        for z in 0..s.rows as usize {
            let from = self.ld(src, z)? as i64;
            // A source outside the rows reads row 0 (the kernel's guard).
            let from = if from < 0 || from >= s.src_rows as i64 {
                0
            } else {
                from as usize
            };
            for c in 0..h {
                let v = self.ld(x, from * h + c)?;
                self.st(out, z * h + c, v)?;
            }
        }
        Ok(())
    }
}
