//! Stage 4: per bucket, the fused graph → buffers at arena offsets and a launch list.
//!
//! Memory: every arena tensor (graph inputs, activations, attention workspaces) gets a
//! live range over the op order — inputs from host prep on, outputs until the caller reads
//! them — and in-place results share their alias root's bytes. Ranges are packed greedily
//! (largest first, lowest fitting offset), so tensors whose ranges do not intersect reuse
//! the same bytes. Launches bind kernel parameters to those buffers, to weights and to the
//! KV pool, never to raw addresses.

use std::collections::BTreeMap;

use petgraph::stable_graph::NodeIndex;
use specplan_kernels::geometry;
use specplan_runtime::format::{
    io, Access, ArgValue, BucketPlan, BufferDesc, BufferRole, DType, GemmDesc, KernelArg, Launch, LaunchKind, Replay,
};

use crate::codegen::{attn_geometry, kernel_specs, KernelTable};
use crate::config::Config;
use crate::graph::{OpGraph, OpKind, Storage, TensorId};

const ALIGN: u64 = 256;

/// Where the inputs sit at the start of the arena (see step 2 of `schedule_bucket`).
pub const INPUT_ORDER: [&str; 5] = [
    io::INPUT_IDS,
    io::PREFIX_LENS,
    io::ACCEPT_LENS,
    io::REQ_SLOTS,
    io::HIDDEN_STATES,
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("node {node}: a GEMM with a bias reached scheduling (the bias must be folded into a kernel)")]
    UnfoldedBias { node: String },
    #[error("node {node} ({kind}) has no kernel: an unfused op reached scheduling")]
    NoKernel { node: String, kind: &'static str },
    #[error("attention of {rows} rows per CTA (num_draft_tokens · heads/kv_heads) with head_dim {head_dim} does not fit in shared memory even with 16-key tiles")]
    AttentionSmem { rows: u32, head_dim: u32 },
}

/// Static facts shared by every bucket's schedule.
pub struct Shared<'a> {
    pub g: &'a OpGraph,
    pub order: &'a [NodeIndex],
    pub cfg: &'a Config,
    /// Weight index in the plan for each weight tensor.
    pub weight_ids: &'a BTreeMap<TensorId, u32>,
    pub sm_count: u32,
}

fn root(g: &OpGraph, mut t: TensorId) -> TensorId {
    while let Some(a) = g.tensor(t).alias_of {
        t = a;
    }
    t
}

/// KV splits for a bucket: enough CTAs to fill the GPU twice, at most one split per
/// 256 keys of the longest context, at most 16.
pub fn attn_splits(cfg: &Config, batch: u32, sm_count: u32) -> u32 {
    let ctas = batch as u64 * cfg.model.desc.kv_heads as u64;
    let want = (2 * sm_count as u64).div_ceil(ctas.max(1));
    let by_len = (cfg.capture.max_context_len as u64).div_ceil(256);
    want.min(by_len).clamp(1, 16) as u32
}

struct Item {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    role: BufferRole,
    first: usize,
    last: usize,
}

pub fn schedule_bucket(
    sh: &Shared,
    kernels: &mut KernelTable,
    batch: u32,
    replay: Replay,
) -> Result<BucketPlan, ScheduleError> {
    let (g, cfg) = (sh.g, sh.cfg);
    let m = &cfg.model.desc;
    let n = cfg.spec.num_draft_tokens;
    let rows = batch * n;
    let bb = batch as u64;
    let splits = attn_splits(cfg, batch, sh.sm_count);
    let steps = sh.order.len();

    // 1. Live ranges of arena tensors (by alias root), in tensor-id order for stable ids.
    let mut range: BTreeMap<TensorId, (usize, usize)> = BTreeMap::new();
    for (s, &node) in sh.order.iter().enumerate() {
        let op = &g.graph[node];
        for &t in op.ins.iter().chain(op.outs.iter()) {
            let r = root(g, t);
            match g.tensor(r).storage {
                Storage::Input | Storage::Activation { .. } => {
                    let e = range.entry(r).or_insert((s + 1, s + 1));
                    e.0 = e.0.min(s + 1);
                    e.1 = e.1.max(s + 1);
                }
                _ => {}
            }
        }
    }
    let mut items = Vec::new();
    let mut buf_of: BTreeMap<TensorId, u32> = BTreeMap::new();
    for (&t, &(first, last)) in &range {
        let tensor = g.tensor(t);
        let role = match tensor.storage {
            Storage::Input => BufferRole::Input,
            Storage::Activation { output: true } => BufferRole::Output,
            _ => BufferRole::Scratch,
        };
        // Inputs stay reserved for the whole step: host prep for the next step may copy
        // into them while the caller still holds this step's outputs on the device.
        let first = if role == BufferRole::Input { 0 } else { first };
        let last = if role == BufferRole::Input { steps + 1 } else { last };
        let last = if role == BufferRole::Output { steps + 1 } else { last };
        buf_of.insert(t, items.len() as u32);
        items.push(Item {
            name: tensor.name.clone(),
            dtype: tensor.dtype,
            shape: tensor.shape.iter().map(|d| d.at(bb)).collect(),
            role,
            first,
            last,
        });
    }
    // Attention workspaces (split-KV partials), live only during their op.
    let mut workspace: BTreeMap<NodeIndex, (u32, u32)> = BTreeMap::new();
    if splits > 1 {
        for (s, &node) in sh.order.iter().enumerate() {
            if let OpKind::Attention { layer, .. } = g.graph[node].kind {
                let o = items.len() as u32;
                let hd = (m.heads * m.head_dim) as u64;
                for (name, shape) in [
                    (format!("l{layer}.attn_part_o"), vec![splits as u64, rows as u64, hd]),
                    (
                        format!("l{layer}.attn_part_lse"),
                        vec![splits as u64, rows as u64, m.heads as u64],
                    ),
                ] {
                    items.push(Item {
                        name,
                        dtype: DType::F32,
                        shape,
                        role: BufferRole::Scratch,
                        first: s + 1,
                        last: s + 1,
                    });
                }
                workspace.insert(node, (o, o + 1));
            }
        }
    }

    // Top-K workspaces (per-chunk records of split rows), live only during their op.
    let topk_chunks = geometry::topk_chunks(cfg.capture.hot_vocab_size.unwrap_or(m.vocab));
    if topk_chunks > 1 {
        for (s, &node) in sh.order.iter().enumerate() {
            if let OpKind::SoftmaxTopK { .. } = g.graph[node].kind {
                workspace.insert(node, (items.len() as u32, u32::MAX));
                items.push(Item {
                    name: "topk_part".into(),
                    dtype: DType::F32,
                    shape: vec![
                        bb,
                        topk_chunks as u64,
                        geometry::topk_record_floats(cfg.spec.topk) as u64,
                    ],
                    role: BufferRole::Scratch,
                    first: s + 1,
                    last: s + 1,
                });
            }
        }
    }

    // 2. Inputs first, contiguous at the arena's start in the order host prep stages them
    // (the integer inputs, then the hidden states), so one copy moves them all. They are
    // live for the whole step anyway, so this costs no reuse.
    let bytes = |it: &Item| it.shape.iter().product::<u64>() * it.dtype.size();
    let mut offsets = vec![0u64; items.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut arena = 0u64;
    for name in INPUT_ORDER {
        if let Some(i) = items
            .iter()
            .position(|it| it.name == name && it.role == BufferRole::Input)
        {
            offsets[i] = arena;
            arena += bytes(&items[i]).div_ceil(ALIGN) * ALIGN;
            placed.push(i);
        }
    }
    // 3. Greedy packing of the rest: largest first, lowest offset clear of every
    // intersecting live range.
    let mut by_size: Vec<usize> = (0..items.len()).filter(|i| !placed.contains(i)).collect();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(bytes(&items[i])), items[i].first, i));
    for &i in &by_size {
        let size = bytes(&items[i]).div_ceil(ALIGN) * ALIGN;
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&j| items[j].first <= items[i].last && items[i].first <= items[j].last)
            .map(|&j| (offsets[j], offsets[j] + bytes(&items[j]).div_ceil(ALIGN) * ALIGN))
            .collect();
        busy.sort();
        let mut at = 0u64;
        for (lo, hi) in busy {
            if at + size <= lo {
                break;
            }
            at = at.max(hi);
        }
        offsets[i] = at;
        arena = arena.max(at + size);
        placed.push(i);
    }
    let buffers: Vec<BufferDesc> = items
        .iter()
        .zip(&offsets)
        .map(|(it, &offset)| BufferDesc {
            name: it.name.clone(),
            dtype: it.dtype,
            shape: it.shape.clone(),
            offset,
            bytes: bytes(it),
            role: it.role,
        })
        .collect();

    // 4. Launches.
    let mut launches = Vec::new();
    let buf = |t: TensorId, access: Access| -> ArgValue {
        let r = root(g, t);
        match g.tensor(r).storage {
            Storage::KvCache { layer, kind } => ArgValue::KvCache { layer, kind, access },
            Storage::PageTable => ArgValue::PageTable,
            Storage::Weight { .. } => ArgValue::Weight {
                id: sh.weight_ids.get(&r).copied().unwrap_or(u32::MAX),
            },
            _ => ArgValue::Buffer {
                id: buf_of.get(&r).copied().unwrap_or(u32::MAX),
                access,
            },
        }
    };
    let arg = |name: &str, value: ArgValue| KernelArg {
        name: name.into(),
        value,
    };
    let u32a = |name: &str, v: u32| KernelArg {
        name: name.into(),
        value: ArgValue::U32(v),
    };
    for &node in sh.order {
        let op = &g.graph[node];
        let (ins, outs) = (&op.ins, &op.outs);
        let specs = kernel_specs(&op.kind, cfg);
        let mut kernel = |i: usize, grid: [u32; 3], block: u32, smem: u64, args: Vec<KernelArg>| {
            let k = kernels.intern(&specs[i]);
            let op_name = if specs.len() > 1 {
                format!("{}.{}", op.name, specs[i].entry)
            } else {
                op.name.clone()
            };
            launches.push(Launch {
                op: op_name,
                kind: LaunchKind::Kernel {
                    kernel: k,
                    grid,
                    block: [block, 1, 1],
                    smem: smem as u32,
                    args,
                },
            });
        };
        match &op.kind {
            OpKind::Linear { bias: true, .. } => {
                return Err(ScheduleError::UnfoldedBias {
                    node: format!("n{} {}", node.index(), op.name),
                })
            }
            OpKind::Linear {
                bias: false,
                accumulate,
            } => {
                let a = g.tensor(ins[0]);
                let w = g.tensor(ins[1]);
                let id = |t: TensorId| match buf(t, Access::Read) {
                    ArgValue::Buffer { id, .. } | ArgValue::Weight { id } => id,
                    _ => u32::MAX,
                };
                launches.push(Launch {
                    op: op.name.clone(),
                    kind: LaunchKind::Gemm(GemmDesc {
                        m: a.shape[0].at(bb),
                        n: w.shape[0].at(bb),
                        k: w.shape[1].at(bb),
                        a: id(ins[0]),
                        w: id(ins[1]),
                        c: id(outs[0]),
                        accumulate: *accumulate,
                    }),
                });
            }
            OpKind::EmbedConcat { bias } => kernel(
                0,
                [rows, 1, 1],
                geometry::EMBED_THREADS,
                0,
                vec![
                    arg("ids", buf(ins[0], Access::Read)),
                    arg("table", buf(ins[1], Access::Read)),
                    arg("hidden", buf(ins[2], Access::Read)),
                    arg(
                        "bias",
                        if *bias {
                            buf(ins[3], Access::Read)
                        } else {
                            ArgValue::Null
                        },
                    ),
                    arg("out", buf(outs[0], Access::Write)),
                    arg(
                        "bias_out",
                        if *bias {
                            buf(outs[1], Access::Write)
                        } else {
                            ArgValue::Null
                        },
                    ),
                    u32a("rows", rows),
                ],
            ),
            OpKind::RmsNorm => kernel(
                0,
                [rows, 1, 1],
                geometry::NORM_THREADS,
                0,
                vec![
                    arg("x", buf(ins[0], Access::Read)),
                    arg("weight", buf(ins[1], Access::Read)),
                    arg("out", buf(outs[0], Access::Write)),
                    u32a("rows", rows),
                ],
            ),
            OpKind::RopeAppend { .. } => kernel(
                0,
                [rows, 1, 1],
                geometry::ROPE_THREADS,
                0,
                vec![
                    arg("qkv", buf(ins[0], Access::ReadWrite)),
                    arg("prefix_lens", buf(ins[1], Access::Read)),
                    arg("req_slots", buf(ins[2], Access::Read)),
                    arg("page_table", buf(ins[3], Access::Read)),
                    arg("k_cache", buf(ins[4], Access::Write)),
                    arg("v_cache", buf(ins[5], Access::Write)),
                    u32a("rows", rows),
                ],
            ),
            OpKind::Attention { .. } => {
                let group = m.heads / m.kv_heads;
                let (tile, stages) = attn_geometry(cfg).ok_or(ScheduleError::AttentionSmem {
                    rows: n * group,
                    head_dim: m.head_dim,
                })?;
                let smem =
                    geometry::attn_smem_bytes(n * group, m.head_dim, tile, stages, cfg.capture.dtype.size() as u32);
                let q_stride = g.tensor(ins[0]).shape[1].at(bb) as u32;
                let ws = workspace.get(&node).copied();
                let part = |i: Option<u32>, access| i.map_or(ArgValue::Null, |id| ArgValue::Buffer { id, access });
                kernel(
                    0,
                    [batch, m.kv_heads, splits],
                    geometry::ATTN_THREADS,
                    smem,
                    vec![
                        arg("q", buf(ins[0], Access::Read)),
                        arg("k_cache", buf(ins[1], Access::Read)),
                        arg("v_cache", buf(ins[2], Access::Read)),
                        arg("req_slots", buf(ins[3], Access::Read)),
                        arg("page_table", buf(ins[4], Access::Read)),
                        arg("prefix_lens", buf(ins[5], Access::Read)),
                        arg(
                            "out",
                            if ws.is_some() {
                                ArgValue::Null
                            } else {
                                buf(outs[0], Access::Write)
                            },
                        ),
                        arg("part_o", part(ws.map(|w| w.0), Access::Write)),
                        arg("part_lse", part(ws.map(|w| w.1), Access::Write)),
                        u32a("batch", batch),
                        u32a("splits", splits),
                        u32a("q_stride", q_stride),
                    ],
                );
                if let Some((po, pl)) = ws {
                    kernel(
                        1,
                        [rows, m.heads, 1],
                        m.head_dim,
                        0,
                        vec![
                            arg(
                                "part_o",
                                ArgValue::Buffer {
                                    id: po,
                                    access: Access::Read,
                                },
                            ),
                            arg(
                                "part_lse",
                                ArgValue::Buffer {
                                    id: pl,
                                    access: Access::Read,
                                },
                            ),
                            arg("out", buf(outs[0], Access::Write)),
                            u32a("rows", rows),
                            u32a("splits", splits),
                        ],
                    );
                }
            }
            OpKind::SiluMul => kernel(
                0,
                [rows, 1, 1],
                geometry::SILU_THREADS,
                0,
                vec![
                    arg("gate_up", buf(ins[0], Access::Read)),
                    arg("out", buf(outs[0], Access::Write)),
                    u32a("rows", rows),
                ],
            ),
            OpKind::SelectRows => kernel(
                0,
                [batch, 1, 1],
                geometry::SELECT_THREADS,
                0,
                vec![
                    arg("x", buf(ins[0], Access::Read)),
                    arg("accept_lens", buf(ins[1], Access::Read)),
                    arg("out", buf(outs[0], Access::Write)),
                    u32a("batch", batch),
                ],
            ),
            OpKind::SoftmaxTopK { k, hot_map } => {
                let hot = || {
                    if *hot_map {
                        buf(ins[1], Access::Read)
                    } else {
                        ArgValue::Null
                    }
                };
                match workspace.get(&node).copied() {
                    None => kernel(
                        0,
                        [batch, 1, 1],
                        geometry::TOPK_THREADS,
                        geometry::topk_smem_bytes(*k),
                        vec![
                            arg("logits", buf(ins[0], Access::Read)),
                            arg("hot_ids", hot()),
                            arg("probs", buf(outs[0], Access::Write)),
                            arg("ids", buf(outs[1], Access::Write)),
                            u32a("batch", batch),
                        ],
                    ),
                    Some((part, _)) => {
                        let ws = |access| ArgValue::Buffer { id: part, access };
                        kernel(
                            0,
                            [batch, topk_chunks, 1],
                            geometry::TOPK_THREADS,
                            geometry::topk_smem_bytes(*k),
                            vec![
                                arg("logits", buf(ins[0], Access::Read)),
                                arg("part", ws(Access::Write)),
                                u32a("batch", batch),
                                u32a("chunks", topk_chunks),
                            ],
                        );
                        kernel(
                            1,
                            [batch, 1, 1],
                            geometry::TOPK_MERGE_THREADS,
                            0,
                            vec![
                                arg("part", ws(Access::Read)),
                                arg("hot_ids", hot()),
                                arg("probs", buf(outs[0], Access::Write)),
                                arg("ids", buf(outs[1], Access::Write)),
                                u32a("batch", batch),
                                u32a("chunks", topk_chunks),
                            ],
                        );
                    }
                }
            }
            other => {
                return Err(ScheduleError::NoKernel {
                    node: format!("n{} {}", node.index(), op.name),
                    kind: other.mnemonic(),
                })
            }
        }
    }
    Ok(BucketPlan {
        batch,
        rows,
        arena_bytes: arena,
        qo_indptr: (0..=batch).map(|i| i * n).collect(),
        attn_splits: splits,
        buffers,
        launches,
        replay,
    })
}
