//! Step 3 of scheduling: each op's launches. A kernel launch takes its grid, block, shared
//! memory and `u32` arguments from the entry's declaration for the bucket; its pointers
//! are bound here through the entry's typed builder (`<Entry>Ptrs`), so an argument that is
//! misnamed or missing does not compile.

use specplan_format::{ArgValue, BucketFacts, CollectiveDesc, CollectiveOp, GemmDesc, KernelFacts, Launch, LaunchKind};
use specplan_kernels::abi::{Kernel, Slot};
use specplan_kernels::entries::attention::{
    AttnFusedParams, AttnMergeParams, AttnMergePtrs, AttnPartialParams, AttnPartialPtrs,
};
use specplan_kernels::entries::embed::{
    EmbedConcatParams, EmbedConcatPtrs, EmbedNormConcatParams, EmbedNormConcatPtrs,
};
use specplan_kernels::entries::mlp::{SiluMulPairsParams, SiluMulPairsPtrs, SiluMulParams, SiluMulPtrs};
use specplan_kernels::entries::norm::{
    CastRowsParams, CastRowsPtrs, NormCastParams, NormCastPtrs, NormConcatParams, NormConcatPtrs, RmsNormParams,
    RmsNormPtrs,
};
use specplan_kernels::entries::rope::{RopeAppendParams, RopeAppendPtrs};
use specplan_kernels::entries::sample::{
    LogitsGatherParams, LogitsGatherPtrs, SoftmaxTopkParams, SoftmaxTopkPtrs, TopkFusedParams, TopkFusedPtrs,
    TopkMergeParams, TopkMergePtrs, TopkPartialParams, TopkPartialPtrs,
};
use specplan_kernels::entries::select::{
    SelectNormPairsParams, SelectNormPairsPtrs, SelectNormParams, SelectNormPtrs, SelectRowsParams, SelectRowsPtrs,
};
use specplan_kernels::entries::tree::{
    GatherRowsParams, GatherRowsPtrs, TreeFinishParams, TreeFinishPtrs, TreeInitParams, TreeInitPtrs, TreeSelectParams,
    TreeSelectPtrs, TreeVerifyParams, TreeVerifyPtrs,
};
use specplan_kernels::kv::COUNTER_WORDS;

use super::liveness::{Live, Workspace};
use super::{ScheduleError, Shared};
use crate::codegen::KernelTable;
use crate::graph::{Op, OpKind, Storage, TensorId};

struct Binder<'a> {
    sh: &'a Shared<'a>,
    live: &'a Live,
    kernels: &'a mut KernelTable,
    bf: &'a BucketFacts,
    launches: Vec<Launch>,
}

impl Binder<'_> {
    /// The argument naming tensor `t`'s storage.
    fn arg(&self, t: TensorId) -> ArgValue {
        let g = self.sh.g;
        let r = g.root(t);
        match g.tensor(r).storage {
            Storage::KvCache { layer, kind } => ArgValue::KvCache { layer, kind },
            Storage::PageTable => ArgValue::PageTable,
            Storage::Weight { .. } => ArgValue::Weight(self.sh.weight_ids.get(&r).copied().unwrap_or(u32::MAX)),
            Storage::Input | Storage::Activation { .. } => {
                ArgValue::Buffer(self.live.buf_of.get(&r).copied().unwrap_or(u32::MAX))
            }
        }
    }

    /// `t`'s argument when `present`, else null.
    fn arg_if(&self, present: bool, t: Option<&TensorId>) -> ArgValue {
        match (present, t) {
            (true, Some(&t)) => self.arg(t),
            _ => ArgValue::Null,
        }
    }

    /// One launch of entry `K` for `op`; `suffix` names it when an op has several.
    fn kernel<K: Kernel>(&mut self, op: &Op, suffix: bool, f: &KernelFacts, ptrs: K::Ptrs<ArgValue>) {
        let k = self.kernels.intern(K::ENTRY, f);
        let (grid, scalars) = K::launch(self.bf, f);
        let args = K::assemble(ptrs, scalars)
            .into_iter()
            .map(|s| match s {
                Slot::Ptr(v) => v,
                Slot::U32(x) => ArgValue::U32(x),
            })
            .collect();
        let name = if suffix {
            format!("{}.{}", op.name, K::ENTRY.name())
        } else {
            op.name.clone()
        };
        self.launches.push(Launch {
            op: name,
            kind: LaunchKind::Kernel {
                kernel: k,
                grid,
                block: [K::threads(f), 1, 1],
                smem: K::smem(f) as u32,
                cluster: K::cluster(self.bf, f),
                args,
            },
        });
    }

    fn buffer_id(&self, t: TensorId) -> u32 {
        match self.arg(t) {
            ArgValue::Buffer(id) | ArgValue::Weight(id) => id,
            _ => u32::MAX,
        }
    }
}

pub(super) fn launches(
    sh: &Shared,
    kernels: &mut KernelTable,
    bf: &BucketFacts,
    live: &Live,
) -> Result<Vec<Launch>, ScheduleError> {
    let mut b = Binder {
        sh,
        live,
        kernels,
        bf,
        launches: Vec::new(),
    };
    for &node in sh.order {
        let op = &sh.g.graph[node];
        let at = || format!("n{} {}", node.index(), op.name);
        match &op.kind {
            OpKind::Linear { bias: true, .. } => return Err(ScheduleError::UnfoldedBias { node: at() }),
            OpKind::Linear {
                bias: false,
                accumulate,
            } => gemm(&mut b, op, *accumulate),
            OpKind::Attention {
                window, step, select, ..
            } => {
                let ws = match live.workspace.get(&node) {
                    Some(Workspace::Attention(o, l)) => Some((*o, *l)),
                    _ => None,
                };
                attention(&mut b, op, (*window, *step, *select), ws)?
            }
            OpKind::TreeInit
            | OpKind::TreeSelect { .. }
            | OpKind::TreeFinish
            | OpKind::TreeVerify
            | OpKind::GatherRows { .. } => tree_op(&mut b, op),
            OpKind::AllReduce
            | OpKind::AllGather { .. }
            | OpKind::TopKRecords { .. }
            | OpKind::TopKMerge { .. }
            | OpKind::LogitsGather { .. }
            | OpKind::NormConcat => tp_op(&mut b, op),
            OpKind::SoftmaxTopK { map, refine, .. } => {
                let ws = match live.workspace.get(&node) {
                    Some(Workspace::TopK(p)) => Some(*p),
                    _ => None,
                };
                softmax_topk(&mut b, op, map.is_some(), *refine, ws)
            }
            OpKind::EmbedConcat { bias } => {
                let (ins, outs) = (&op.ins, &op.outs);
                let p = EmbedConcatPtrs {
                    ids: b.arg(ins[0]),
                    table: b.arg(ins[1]),
                    hidden: b.arg(ins[2]),
                    bias: b.arg_if(*bias, ins.get(3)),
                    out: b.arg(outs[0]),
                    bias_out: b.arg_if(*bias, outs.get(1)),
                };
                b.kernel::<EmbedConcatParams>(op, false, sh.facts, p)
            }
            OpKind::EmbedNormConcat => {
                let ins = &op.ins;
                let p = EmbedNormConcatPtrs {
                    ids: b.arg(ins[0]),
                    table: b.arg(ins[1]),
                    w_embed: b.arg(ins[2]),
                    h: b.arg(ins[3]),
                    w_hidden: b.arg(ins[4]),
                    out: b.arg(op.outs[0]),
                };
                b.kernel::<EmbedNormConcatParams>(op, false, sh.facts, p)
            }
            OpKind::SelectNorm => {
                let p = SelectNormPtrs {
                    x: b.arg(op.ins[0]),
                    accept_lens: b.arg(op.ins[1]),
                    add: b.arg(op.ins[3]),
                    weight: b.arg(op.ins[2]),
                    // One output: a tensor-parallel rank that needs no selected rows.
                    out: b.arg_if(op.outs.len() == 2, op.outs.first()),
                    normed: b.arg(op.outs[op.outs.len() - 1]),
                };
                b.kernel::<SelectNormParams>(op, false, sh.facts, p)
            }
            // The rmsnorm entry runs over every row of the phase or over one row per request
            // (the selected rows: the last layer's post norm, EAGLE-3's final norm).
            OpKind::RmsNorm => {
                let f = row_facts(
                    sh,
                    op,
                    &at,
                    "rmsnorm over rows that are neither the phase's nor one per request",
                )?;
                let p = RmsNormPtrs {
                    x: b.arg(op.ins[0]),
                    weight: b.arg(op.ins[1]),
                    out: b.arg(op.outs[0]),
                };
                b.kernel::<RmsNormParams>(op, false, &f, p)
            }
            // EAGLE-3's head over the fp32 stream's selected rows: lm_head's input and
            // hidden_out from one launch.
            OpKind::NormCast => {
                let f = row_facts(
                    sh,
                    op,
                    &at,
                    "norm_cast over rows that are neither the phase's nor one per request",
                )?;
                let p = NormCastPtrs {
                    x: b.arg(op.ins[0]),
                    weight: b.arg(op.ins[1]),
                    out: b.arg(op.outs[0]),
                    cast: b.arg(op.outs[1]),
                };
                b.kernel::<NormCastParams>(op, false, &f, p)
            }
            // The stream's rounding: EAGLE-1's layer-0 input (every row) or hidden_out (one
            // row per request).
            OpKind::Cast => {
                let f = row_facts(
                    sh,
                    op,
                    &at,
                    "cast_rows over rows that are neither the phase's nor one per request",
                )?;
                let p = CastRowsPtrs {
                    x: b.arg(op.ins[0]),
                    out: b.arg(op.outs[0]),
                };
                b.kernel::<CastRowsParams>(op, false, &f, p)
            }
            OpKind::RopeAppend { step, .. } => {
                let ins = &op.ins;
                let p = RopeAppendPtrs {
                    qkv: b.arg(ins[0]),
                    prefix_lens: b.arg(ins[1]),
                    req_slots: b.arg(ins[2]),
                    page_table: b.arg(ins[3]),
                    kv_layout: ArgValue::KvLayout,
                    k_cache: b.arg(ins[4]),
                    v_cache: b.arg(ins[5]),
                };
                b.kernel::<RopeAppendParams>(op, false, &sh.facts.at_step(*step), p)
            }
            OpKind::SiluMul => {
                let f = row_facts(
                    sh,
                    op,
                    &at,
                    "silu_mul over rows that are neither the phase's nor one per request",
                )?;
                // In place: the product's storage is gate_up's (`alias_of`).
                let p = SiluMulPtrs {
                    gate_up: b.arg(op.ins[0]),
                };
                b.kernel::<SiluMulParams>(op, false, &f, p)
            }
            OpKind::SelectNormPairs => {
                let p = SelectNormPairsPtrs {
                    x: b.arg(op.ins[0]),
                    accept_lens: b.arg(op.ins[1]),
                    add: b.arg(op.ins[3]),
                    weight: b.arg(op.ins[2]),
                    out: b.arg(op.outs[0]),
                    normed: b.arg(op.outs[1]),
                };
                b.kernel::<SelectNormPairsParams>(op, false, sh.facts, p)
            }
            // Over the selected rows only (its input's 2B rows are their pairs).
            OpKind::SiluMulPairs => {
                let p = SiluMulPairsPtrs {
                    gate_up: b.arg(op.ins[0]),
                    out: b.arg(op.outs[0]),
                };
                b.kernel::<SiluMulPairsParams>(op, false, &sh.facts.selected_rows(), p)
            }
            OpKind::SelectRows => {
                let p = SelectRowsPtrs {
                    x: b.arg(op.ins[0]),
                    accept_lens: b.arg(op.ins[1]),
                    out: b.arg(op.outs[0]),
                };
                b.kernel::<SelectRowsParams>(op, false, sh.facts, p)
            }
            other => {
                return Err(ScheduleError::NoKernel {
                    node: at(),
                    kind: other.mnemonic(),
                })
            }
        }
    }
    Ok(b.launches)
}

/// The facts of a row-wise op's instance: the phase's over every row, or the selected
/// rows' (one per request, the draft-extend head's last layer past its K/V append); for
/// other rows, no kernel (`kind` says which, `node` names the op).
fn row_facts(
    sh: &Shared,
    op: &Op,
    node: &dyn Fn() -> String,
    kind: &'static str,
) -> Result<KernelFacts, ScheduleError> {
    match sh.g.tensor(op.ins[0]).shape[0].per_batch {
        r if r == sh.facts.n as u64 => Ok(sh.facts.clone()),
        1 => Ok(sh.facts.selected_rows()),
        _ => Err(ScheduleError::NoKernel { node: node(), kind }),
    }
}

fn gemm(b: &mut Binder, op: &Op, accumulate: bool) {
    let g = b.sh.g;
    let bb = b.bf.batch as u64;
    let (a, w) = (g.tensor(op.ins[0]), g.tensor(op.ins[1]));
    // A view in place over a wider tensor (the SwiGLU product in the gate half of the
    // gate/up rows) is read with its storage's row stride.
    let lda = g.tensor(g.root(op.ins[0])).shape.last().map_or(0, |d| d.at(bb));
    b.launches.push(Launch {
        op: op.name.clone(),
        kind: LaunchKind::Gemm(GemmDesc {
            m: a.shape[0].at(bb),
            n: w.shape[0].at(bb),
            k: w.shape[1].at(bb),
            lda,
            a: b.buffer_id(op.ins[0]),
            w: b.buffer_id(op.ins[1]),
            c: b.buffer_id(op.outs[0]),
            accumulate,
            rounded: op.outs.get(1).map(|&t| b.buffer_id(t)),
        }),
    });
}

/// Draft decode's tree ops and the gather of its lanes' rows.
fn tree_op(b: &mut Binder, op: &Op) {
    let sh = b.sh;
    match &op.kind {
        OpKind::TreeInit => {
            let (ins, outs) = (&op.ins, &op.outs);
            let p = TreeInitPtrs {
                topk_probs: b.arg(ins[0]),
                topk_ids: b.arg(ins[1]),
                scores: b.arg(outs[0]),
                ids: b.arg(outs[1]),
                score_list: b.arg(outs[2]),
                token_list: b.arg(outs[3]),
                parent_list: b.arg(outs[4]),
                src: b.arg_if(true, outs.get(5)),
            };
            b.kernel::<TreeInitParams>(op, false, sh.facts, p)
        }
        OpKind::TreeSelect { step } => {
            let (ins, outs) = (&op.ins, &op.outs);
            let more = outs.len() >= 5;
            let p = TreeSelectPtrs {
                scores: b.arg(ins[0]),
                probs: b.arg(ins[1]),
                ids: b.arg(ins[2]),
                score_list: b.arg(outs[0]),
                token_list: b.arg(outs[1]),
                parent_list: b.arg_if(more, outs.get(2)),
                scores_out: b.arg_if(more, outs.get(3)),
                next_ids: b.arg_if(more, outs.get(4)),
                src: b.arg_if(more, outs.get(5)),
            };
            b.kernel::<TreeSelectParams>(op, false, &sh.facts.at_step(*step), p)
        }
        OpKind::TreeFinish => {
            let p = TreeFinishPtrs {
                score_list: b.arg(op.ins[0]),
                token_list: b.arg(op.ins[1]),
                top_scores_index: b.arg(op.outs[0]),
                draft_tokens: b.arg(op.outs[1]),
            };
            b.kernel::<TreeFinishParams>(op, false, sh.facts, p)
        }
        OpKind::TreeVerify => {
            let (ins, outs) = (&op.ins, &op.outs);
            let p = TreeVerifyPtrs {
                parent_list: b.arg(ins[0]),
                top_scores_index: b.arg(ins[1]),
                draft_tokens: b.arg(ins[2]),
                bonus_tokens: b.arg(ins[3]),
                prefix_lens: b.arg(ins[4]),
                tokens: b.arg(outs[0]),
                positions: b.arg(outs[1]),
                retrieve_index: b.arg(outs[2]),
                next_token: b.arg(outs[3]),
                next_sibling: b.arg(outs[4]),
                mask: b.arg(outs[5]),
            };
            b.kernel::<TreeVerifyParams>(op, false, sh.facts, p)
        }
        OpKind::GatherRows { step } => {
            let p = GatherRowsPtrs {
                x: b.arg(op.ins[0]),
                src: b.arg(op.ins[1]),
                out: b.arg(op.outs[0]),
            };
            // One instance reads the request rows (step 0), one the lanes (after).
            b.kernel::<GatherRowsParams>(op, false, &sh.facts.at_step((*step).min(1)), p)
        }
        _ => {}
    }
}

/// A sharded plan's ops around its collectives: this rank's top-K records (`topk_partial`
/// over its columns), the merge of every rank's gathered records (`topk_merge`), the
/// gathered logits' full rows (`logits_gather`), or EAGLE-3's layer-0 input from the
/// all-reduced embedding (`norm_concat`).
fn tp_op(b: &mut Binder, op: &Op) {
    let f = b.sh.facts;
    match op.kind {
        OpKind::AllReduce => collective(b, op, CollectiveOp::AllReduceSum),
        OpKind::AllGather { .. } => collective(b, op, CollectiveOp::AllGather),
        OpKind::NormConcat => {
            let p = NormConcatPtrs {
                x: b.arg(op.ins[0]),
                w_a: b.arg(op.ins[1]),
                w_b: b.arg(op.ins[2]),
                out: b.arg(op.outs[0]),
            };
            b.kernel::<NormConcatParams>(op, false, f, p)
        }
        OpKind::LogitsGather { .. } => {
            let p = LogitsGatherPtrs {
                part: b.arg(op.ins[0]),
                out: b.arg(op.outs[0]),
            };
            b.kernel::<LogitsGatherParams>(op, false, f, p)
        }
        OpKind::TopKMerge { map, .. } => {
            // A sharded plan's merge: no refinement (its stream is an activation).
            let p = TopkMergePtrs {
                part: b.arg(op.ins[0]),
                hot_ids: b.arg_if(map.is_some(), op.ins.get(1)),
                probs: b.arg(op.outs[0]),
                ids: b.arg(op.outs[1]),
                x: ArgValue::Null,
                norm_w: ArgValue::Null,
                lm_w: ArgValue::Null,
            };
            b.kernel::<TopkMergeParams>(op, false, f, p)
        }
        _ => {
            // A sharded plan's records.
            let p = TopkPartialPtrs {
                logits: b.arg(op.ins[0]),
                part: b.arg(op.outs[0]),
            };
            b.kernel::<TopkPartialParams>(op, false, f, p)
        }
    }
}

/// A collective over the ranks: the all-reduce in place over its input's storage, the
/// all-gather from its input into its output; `count` is the input's elements.
fn collective(b: &mut Binder, op: &Op, kind: CollectiveOp) {
    let g = b.sh.g;
    let x = g.tensor(op.ins[0]);
    let count = x.shape.iter().map(|d| d.at(b.bf.batch as u64)).product();
    b.launches.push(Launch {
        op: op.name.clone(),
        kind: LaunchKind::Collective(CollectiveDesc {
            op: kind,
            send: b.buffer_id(op.ins[0]),
            recv: b.buffer_id(op.outs[0]),
            count,
            dtype: x.dtype,
        }),
    });
}

/// `attn_partial`, plus `attn_merge` when the bucket splits the keys.
fn attention(
    b: &mut Binder,
    op: &Op,
    (window, step, select): (Option<u32>, u32, bool),
    ws: Option<(u32, u32)>,
) -> Result<(), ScheduleError> {
    let f = b.sh.facts.with_window(window).at_step(step);
    // Over the selected query rows: one row a request, chosen by accept_lens (its 7th input).
    let f = if select { f.selected_query() } else { f };
    if f.attn_tiling().is_none() {
        return Err(ScheduleError::AttentionSmem {
            rows: f.n * f.group(),
            head_dim: f.head_dim,
        });
    }
    let (ins, out) = (&op.ins, b.arg(op.outs[0]));
    let part = |i: Option<u32>| i.map_or(ArgValue::Null, ArgValue::Buffer);
    // The splits and their merge in one launch (`attn_fused`): the group's last CTA merges,
    // writing `out` beside the partials.
    let fused = ws.is_some() && AttnFusedParams::serves(b.bf, &f);
    let p = AttnPartialPtrs {
        q: b.arg(ins[0]),
        k_cache: b.arg(ins[1]),
        v_cache: b.arg(ins[2]),
        req_slots: b.arg(ins[3]),
        page_table: b.arg(ins[4]),
        kv_layout: ArgValue::KvLayout,
        prefix_lens: b.arg(ins[5]),
        accept_lens: b.arg_if(select, ins.get(6)),
        out: if ws.is_some() && !fused { ArgValue::Null } else { out },
        part_o: part(ws.map(|w| w.0)),
        part_lse: part(ws.map(|w| w.1)),
    };
    if fused {
        b.kernel::<AttnFusedParams>(op, true, &f, p.fused(ArgValue::Counters));
        return Ok(());
    }
    b.kernel::<AttnPartialParams>(op, true, &f, p);
    if let Some((po, pl)) = ws {
        let p = AttnMergePtrs {
            part_o: ArgValue::Buffer(po),
            part_lse: ArgValue::Buffer(pl),
            out,
        };
        b.kernel::<AttnMergeParams>(op, true, &f, p);
    }
    Ok(())
}

/// One CTA per row, or split rows (partial + merge) when the plan splits the columns.
fn softmax_topk(b: &mut Binder, op: &Op, hot_map: bool, refine: bool, ws: Option<u32>) {
    let f = b.sh.facts;
    let (ins, outs) = (&op.ins, &op.outs);
    let hot = b.arg_if(hot_map, ins.get(1));
    // The refinement's x, lm_w (, norm_w) follow the logits and the map.
    let r = 1 + hot_map as usize;
    let (x, lm_w, norm_w) = (
        b.arg_if(refine, ins.get(r)),
        b.arg_if(refine, ins.get(r + 1)),
        b.arg_if(refine, ins.get(r + 2)),
    );
    match ws {
        None => {
            let p = SoftmaxTopkPtrs {
                logits: b.arg(ins[0]),
                hot_ids: hot,
                probs: b.arg(outs[0]),
                ids: b.arg(outs[1]),
                x,
                norm_w,
                lm_w,
            };
            b.kernel::<SoftmaxTopkParams>(op, false, f, p)
        }
        // The records and the merge in one launch: the row's last CTA to finish merges, found
        // by the runtime's arrival counters (one a row).
        Some(part) if b.sh.topk_last_cta && f.head_rows(b.bf) as usize <= COUNTER_WORDS => {
            let p = TopkFusedPtrs {
                logits: b.arg(ins[0]),
                part: ArgValue::Buffer(part),
                hot_ids: hot,
                probs: b.arg(outs[0]),
                ids: b.arg(outs[1]),
                x,
                norm_w,
                lm_w,
                counters: ArgValue::Counters,
            };
            b.kernel::<TopkFusedParams>(op, true, f, p)
        }
        Some(part) => {
            let p = TopkPartialPtrs {
                logits: b.arg(ins[0]),
                part: ArgValue::Buffer(part),
            };
            b.kernel::<TopkPartialParams>(op, true, f, p);
            // The merge refines the row's final K (sample.cu).
            let p = TopkMergePtrs {
                part: ArgValue::Buffer(part),
                hot_ids: hot,
                probs: b.arg(outs[0]),
                ids: b.arg(outs[1]),
                x,
                norm_w,
                lm_w,
            };
            b.kernel::<TopkMergeParams>(op, true, f, p)
        }
    }
}
