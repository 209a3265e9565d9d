//! The CPU engine's draft-decode step: a draft-decode phase of the plan run by the CPU
//! executor on the engine's host memory in place, with the per-request rules of
//! draft-extend's `admit` applied to the phase's lanes (the prefix and the lanes' reach, the
//! row, the lanes' slots, the ids, the prefix positions some layer reads, and the aliasing
//! rule over what the lanes write), and the
//! tree of an admitted request (a refused one's rows are zeros and it writes nothing).

use specplan_format::{io, PhaseKind};
use specplan_kernels::facts::{decode_reach, lane_offset, parent_width};
use specplan_kernels::kv::{DeviceRule, TableMode};

use super::engine::{admitted_row, prefix_hole, slot_of, CpuEngine, Ints};
use super::ExecError;
use crate::aliasing;
use crate::gpu::DeviceError;
use crate::step::PageTable;

/// One draft-decode step's inputs on the host: `b = req.len()` requests.
#[derive(Clone, Copy, Debug)]
pub struct HostDecode<'a> {
    /// `[b, K]` f32: draft-extend's top-K probabilities (1 for topk = 1, as SGLang sets).
    pub topk_p: &'a [f32],
    /// `[b, K]`: draft-extend's top-K ids in the target vocabulary (mapped once by the
    /// caller when the head has a hot map or d2t).
    pub topk_index: Ints<'a>,
    /// `[b, H]` activation bits: draft-extend's hidden row (EAGLE-3: before the final norm).
    pub hidden: &'a [u16],
    /// Rows of the registered page table.
    pub req: Ints<'a>,
    /// Tokens already cached per request, plus `prefix_bias`.
    pub prefix: Ints<'a>,
    pub prefix_bias: i32,
    /// `[b]`: the tree roots, for a plan with the verify inputs (`capture.decode_verify`);
    /// `None` otherwise.
    pub bonus_tokens: Option<Ints<'a>>,
}

/// Where the tree goes (`None`: not copied), each `[b, ·]` i64.
#[derive(Debug, Default)]
pub struct HostDecodeOutputs<'a> {
    /// `[b, (S−1)·K + 1]`.
    pub parent_list: Option<&'a mut [i64]>,
    /// `[b, N−1]`.
    pub top_scores_index: Option<&'a mut [i64]>,
    /// `[b, N−1]`, target ids.
    pub draft_tokens: Option<&'a mut [i64]>,
    /// The verify inputs (a plan with `decode_verify`): `verify_tokens`,
    /// `verify_positions`, `retrieve_index`, `retrieve_next_token`, `retrieve_next_sibling`
    /// `[b, N]` each, in that order.
    pub verify: [Option<&'a mut [i64]>; 5],
    /// `tree_mask [b, N, N]`.
    pub tree_mask: Option<&'a mut [i32]>,
}

/// The verify outputs' names, in `HostDecodeOutputs::verify` order.
const VERIFY: [&str; 5] = [
    io::VERIFY_TOKENS,
    io::VERIFY_POSITIONS,
    io::RETRIEVE_INDEX,
    io::RETRIEVE_NEXT_TOKEN,
    io::RETRIEVE_NEXT_SIBLING,
];

impl CpuEngine {
    /// Request `i`'s table row, or the first rule it breaks (draft-extend's order; the
    /// accept rule has no counterpart here).
    fn admit_decode(&self, kind: PhaseKind, x: &HostDecode, i: usize) -> Result<Vec<i32>, DeviceRule> {
        let p = self.plan();
        let (k, steps, ps) = (p.spec.topk, kind.steps(), p.capture.page_size as i64);
        let r = x.req.get(i);
        let t = self.table();
        if r < 0 || r as u64 >= t.rows {
            return Err(DeviceRule::Request);
        }
        let l = x
            .prefix
            .get(i)
            .checked_add(x.prefix_bias as i64)
            .ok_or(DeviceRule::Prefix)?;
        let l32 = i32::try_from(l).map_err(|_| DeviceRule::Prefix)?;
        crate::admission::check_prefix(p, kind, i, l32).map_err(|_| DeviceRule::Prefix)?;
        let end = l + decode_reach(l as u64, steps, k, ps as u32) as i64;
        let need = match t.mode {
            TableMode::TokenSlots => end,
            TableMode::PageIds => (end + ps - 1).div_euclid(ps),
        };
        if need > t.cols as i64 {
            return Err(DeviceRule::Row);
        }
        let row = t.row(r as u64);
        let slots = self.kv_slots() as i64;
        if lane_positions(p, kind, l as usize).any(|pos| {
            let tok = slot_of(t.mode, &row, ps as usize, pos).map_or(-1, |s| s as i64);
            tok < 0 || tok >= slots
        }) {
            return Err(DeviceRule::Slot);
        }
        let ku = k as usize;
        let vocab = p.model.vocab as i64;
        if (i * ku..(i + 1) * ku).any(|e| {
            let id = x.topk_index.get(e);
            id < 0 || id >= vocab
        }) || x.bonus_tokens.is_some_and(|t| !(0..vocab).contains(&t.get(i)))
        {
            return Err(DeviceRule::Id);
        }
        Ok(row)
    }

    /// One step of draft-decode phase `kind` for `b = x.req.len()` requests; batches above
    /// the phase's largest bucket run as consecutive chunks. Shapes are checked first (an
    /// error names the tensor and nothing runs); a request breaking a rule is refused (no
    /// K/V written, zero rows) and reported by [`CpuEngine::last_error`].
    pub fn draft_decode(&mut self, kind: PhaseKind, x: &HostDecode, out: &mut HostDecodeOutputs) -> Result<(), String> {
        let p = self.plan().clone();
        let phase = p
            .phase(kind)
            .ok_or_else(|| format!("the plan has no {} phase", kind.label()))?;
        let (k, steps) = (p.spec.topk as usize, kind.steps() as usize);
        let (h, nodes) = (p.model.hidden as usize, kind.draft_tokens(&p.spec) as usize - 1);
        let pw = parent_width(k as u32, steps as u32) as usize;
        let b = x.req.len();
        if b == 0 {
            return Err("req_pool_indices: a step needs at least one request".into());
        }
        let shape = |name: &str, len: usize, want: usize| {
            (len == want)
                .then_some(())
                .ok_or_else(|| format!("{name}: {len} values, expected {want}"))
        };
        shape(io::TOPK_PROBS, x.topk_p.len(), b * k)?;
        shape(io::TOPK_IDS, x.topk_index.len(), b * k)?;
        shape(io::HIDDEN_STATES, x.hidden.len(), b * h)?;
        shape(io::PREFIX_LENS, x.prefix.len(), b)?;
        let verify = p.capture.decode_verify;
        let n = nodes + 1;
        match (&x.bonus_tokens, verify) {
            (Some(t), true) => shape(io::BONUS_TOKENS, t.len(), b)?,
            (None, false) => {}
            (None, true) => {
                return Err(format!(
                    "{}: the plan emits the verify inputs (draft_decode_outputs tree,verify) and needs the tree roots",
                    io::BONUS_TOKENS
                ))
            }
            (Some(_), false) => {
                return Err(format!(
                    "{}: the plan emits no verify inputs (compile it with draft_decode_outputs tree,verify)",
                    io::BONUS_TOKENS
                ))
            }
        }
        for (name, len) in VERIFY
            .iter()
            .zip(out.verify.iter().map(|v| v.as_ref().map(|s| s.len())))
            .chain([(&io::TREE_MASK, out.tree_mask.as_ref().map(|v| v.len()))])
        {
            match len {
                Some(_) if !verify => return Err(format!("{name}: the plan does not emit it")),
                Some(l) => shape(name, l, if *name == io::TREE_MASK { b * n * n } else { b * n })?,
                None => {}
            }
        }
        for (name, len, want) in [
            (io::PARENT_LIST, out.parent_list.as_ref().map(|v| v.len()), b * pw),
            (
                io::TOP_SCORES_INDEX,
                out.top_scores_index.as_ref().map(|v| v.len()),
                b * nodes,
            ),
            (io::DRAFT_TOKENS, out.draft_tokens.as_ref().map(|v| v.len()), b * nodes),
        ] {
            if let Some(len) = len {
                shape(name, len, want)?;
            }
        }
        let max_b = phase.buckets.last().map_or(1, |x| x.batch as usize);
        let ps = p.capture.page_size as usize;
        let act = p.capture.dtype;
        let mut refused: Vec<(usize, DeviceRule, Option<usize>)> = Vec::new();
        for start in (0..b).step_by(max_b) {
            let end = (start + max_b).min(b);
            let bucket = phase
                .bucket_for((end - start) as u32)
                .ok_or("no bucket serves the chunk")?;
            let bb = bucket.batch as usize;
            let cols = self.table().cols as usize;
            let mut table = PageTable {
                rows: bb,
                cols,
                data: vec![-1; bb * cols],
                mode: self.table().mode,
            };
            let admitted: Vec<Result<Vec<i32>, DeviceRule>> =
                (start..end).map(|i| self.admit_decode(kind, x, i)).collect();
            // Admitted requests' prefixes only: a refused one reads and writes nothing, and
            // its prefix may be anything an i64 holds.
            let prefix = |i: usize| x.prefix.get(i).saturating_add(x.prefix_bias as i64).max(0) as usize;
            // The aliasing rule over the lanes' writes: a request reads its prefix and its
            // own lanes' slots, and writes those.
            let mode = self.table().mode;
            let slot = |c: usize, pos: usize| slot_of(mode, admitted[c].as_ref().ok()?, ps, pos);
            let reqs: Vec<aliasing::Sets> = (start..end)
                .zip(&admitted)
                .map(|(i, a)| {
                    if a.is_err() {
                        return aliasing::Sets {
                            reads: Vec::new(),
                            writes: Vec::new(),
                            admitted: false,
                        };
                    }
                    let l = prefix(i);
                    let writes: Vec<usize> = lane_positions(&p, kind, l).collect();
                    aliasing::Sets {
                        reads: (0..l).chain(writes.iter().copied()).collect(),
                        writes,
                        admitted: true,
                    }
                })
                .collect();
            let aliases = aliasing::check_sets(&reqs, slot);
            let mut named: Vec<(&str, Vec<f64>)> = vec![
                (io::TOPK_PROBS, vec![0.0; bb * k]),
                (io::TOPK_IDS, vec![0.0; bb * k]),
                (io::HIDDEN_STATES, vec![0.0; bb * h]),
                (io::PREFIX_LENS, vec![0.0; bb]),
                (io::REQ_SLOTS, vec![-1.0; bb]),
            ];
            if verify {
                named.push((io::BONUS_TOKENS, vec![0.0; bb]));
            }
            let mut ok = vec![false; end - start];
            let window = specplan_format::read_window(p.layers.iter().map(|l| l.window));
            let pool = self.kv_slots();
            for i in start..end {
                let c = i - start;
                let hole = admitted[c]
                    .as_ref()
                    .is_ok_and(|row| prefix_hole(mode, row, ps, prefix(i), window, pool));
                let Some(row) = admitted_row(&admitted[c], hole, aliases[c], i, start, &mut refused) else {
                    continue;
                };
                ok[c] = true;
                table.data[c * cols..(c + 1) * cols].copy_from_slice(row);
                for j in 0..k {
                    named[0].1[c * k + j] = x.topk_p[i * k + j] as f64;
                    named[1].1[c * k + j] = x.topk_index.get(i * k + j) as f64;
                }
                for j in 0..h {
                    named[2].1[c * h + j] = crate::bits::from_act_bits(x.hidden[i * h + j], act) as f64;
                }
                named[3].1[c] = prefix(i) as f64;
                named[4].1[c] = c as f64;
                if let (Some(t), Some(slot)) = (&x.bonus_tokens, named.get_mut(5)) {
                    slot.1[c] = t.get(i) as f64;
                }
            }
            let outs = self
                .run_named(kind, bucket, &named, &table)
                .map_err(|e: ExecError| e.to_string())?;
            let get = |name: &str| -> Result<&[f64], String> {
                outs.iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| &v[..])
                    .ok_or_else(|| format!("the phase has no {name} output"))
            };
            for (dst, name, w) in [
                (out.parent_list.as_deref_mut(), io::PARENT_LIST, pw),
                (out.top_scores_index.as_deref_mut(), io::TOP_SCORES_INDEX, nodes),
                (out.draft_tokens.as_deref_mut(), io::DRAFT_TOKENS, nodes),
            ] {
                let Some(dst) = dst else { continue };
                let src = get(name)?;
                for (c, &keep) in ok.iter().enumerate() {
                    let i = start + c;
                    for j in 0..w {
                        dst[i * w + j] = if keep { src[c * w + j] as i64 } else { 0 };
                    }
                }
            }
            for (dst, name) in out.verify.iter_mut().zip(VERIFY) {
                let Some(dst) = dst.as_deref_mut() else { continue };
                let src = get(name)?;
                for (c, &keep) in ok.iter().enumerate() {
                    let i = start + c;
                    for j in 0..n {
                        dst[i * n + j] = if keep { src[c * n + j] as i64 } else { 0 };
                    }
                }
            }
            if let Some(dst) = out.tree_mask.as_deref_mut() {
                let src = get(io::TREE_MASK)?;
                let w = n * n;
                for (c, &keep) in ok.iter().enumerate() {
                    let i = start + c;
                    for j in 0..w {
                        dst[i * w + j] = if keep { src[c * w + j] as i32 } else { 0 };
                    }
                }
            }
        }
        refused.sort_by_key(|r| r.0);
        self.record(refused.first().map(|&(request, rule, other)| DeviceError {
            count: refused.len() as u64,
            request: request as u64,
            rule: Some(rule),
            other: other.map(|o| o as u64),
        }));
        Ok(())
    }
}

/// The positions request `l`'s lanes write: lane k's forwards 0 .. S−2 at
/// `L + lane_offset(L, k) + i`.
fn lane_positions(p: &specplan_format::Plan, kind: PhaseKind, l: usize) -> impl Iterator<Item = usize> {
    let (k, s, ps) = (p.spec.topk, kind.steps(), p.capture.page_size);
    (0..k).flat_map(move |lane| {
        let base = l + lane_offset(l as u64, lane, s, k, ps) as usize;
        (0..s.saturating_sub(1) as usize).map(move |i| base + i)
    })
}
