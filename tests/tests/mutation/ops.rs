//! Structured mutations of a decoded plan: boundary values, variant changes, list edits,
//! re-pointed arguments, inflated sizes, changed strings. Each returns what it did (or
//! `None` when the plan has no site for it, and the caller draws another).

use specplan_format::{
    ArgValue, BufferRole, ConstValue, DType, Entry, GemmDesc, KernelBinary, KvKind, LaunchKind, Packing, Plan, Replay,
    ReplayBlocker, RopeScaling,
};
use specplan_tests::Rng;

use super::leaves::{self, pick, u32_value, u64_value};

const DTYPES: [DType; 5] = [DType::Bf16, DType::F16, DType::F32, DType::I32, DType::I64];
const ALIGN: u64 = 256;

/// An item of `xs` other than `old` (`xs` has at least two distinct items).
fn other<T: PartialEq + Clone>(rng: &mut Rng, xs: &[T], old: &T) -> T {
    let rest: Vec<&T> = xs.iter().filter(|x| *x != old).collect();
    rest[rng.below(rest.len())].clone()
}

/// Applies one mutation (or, one time in five, two or three).
pub fn mutate(p: &mut Plan, rng: &mut Rng) -> String {
    let times = if rng.below(5) == 0 { 2 + rng.below(2) } else { 1 };
    let mut out = Vec::new();
    while out.len() < times {
        let op: fn(&mut Plan, &mut Rng) -> Option<String> = match rng.below(100) {
            0..30 => leaf,
            30..45 => variant,
            45..62 => list,
            62..80 => repoint,
            80..92 => inflate,
            _ => string,
        };
        if let Some(d) = op(p, rng) {
            out.push(d);
        }
    }
    out.join(" + ")
}

fn leaf(p: &mut Plan, rng: &mut Rng) -> Option<String> {
    let region = rng.below(leaves::REGIONS);
    let n = leaves::count(p, region);
    (n > 0).then(|| leaves::set_leaf(p, region, rng.below(n), rng))
}

/// A random bucket index and a launch index in it.
fn some_launch(p: &Plan, rng: &mut Rng) -> Option<(usize, usize)> {
    let bi = rng.below(p.phases[0].buckets.len());
    let n = p.phases[0].buckets.get(bi)?.launches.len();
    (n > 0).then(|| (bi, rng.below(n)))
}

fn other_arg(p: &Plan, bi: usize, rng: &mut Rng) -> ArgValue {
    let nb = p.phases[0].buckets[bi].buffers.len().max(1);
    let kind = if rng.below(2) == 0 { KvKind::K } else { KvKind::V };
    match rng.below(8) {
        0 => ArgValue::Buffer(rng.below(nb + 1) as u32),
        1 => ArgValue::Weight(rng.below(p.weights.len() + 1) as u32),
        2 => ArgValue::PageTable,
        3 => ArgValue::KvCache {
            layer: rng.below(p.layers.len() + 1) as u32,
            kind,
        },
        4 => ArgValue::KvLayout,
        5 => ArgValue::U32(u32_value(1, rng)),
        6 => ArgValue::Counters,
        _ => ArgValue::Null,
    }
}

fn other_const(v: &ConstValue, rng: &mut Rng) -> ConstValue {
    let n = match v {
        ConstValue::U32(x) => *x,
        ConstValue::F32(x) => *x as u32,
        ConstValue::Bool(b) => *b as u32,
        ConstValue::F32Array(xs) => xs.len() as u32,
        ConstValue::Type(_) => 0,
    };
    match rng.below(6) {
        0 => ConstValue::U32(n),
        1 => ConstValue::F32(n as f32),
        2 => ConstValue::Bool(n != 0),
        3 => ConstValue::F32Array(vec![1.0; n.min(300) as usize]),
        4 => ConstValue::Type(pick(rng, &["__half", "__nv_bfloat16", "int", "float; int x"]).into()),
        _ => ConstValue::U32(0),
    }
}

fn blocker(rng: &mut Rng) -> Replay {
    Replay::Eager(match rng.below(3) {
        0 => ReplayBlocker::PoolTooSmall {
            need_pages: u64::MAX,
            pool_pages: 0,
        },
        1 => ReplayBlocker::IndexOverflow {
            what: "x\ny".into(),
            value: u64::MAX,
            limit: 0,
        },
        _ => ReplayBlocker::HostSync { op: String::new() },
    })
}

/// An enum field set to another variant.
fn variant(p: &mut Plan, rng: &mut Rng) -> Option<String> {
    let bi = rng.below(p.phases[0].buckets.len().max(1));
    match rng.below(14) {
        0 => {
            p.capture.dtype = other(rng, &DTYPES, &p.capture.dtype);
            Some(format!("capture.dtype -> {:?}", p.capture.dtype))
        }
        1 => {
            let i = rng.below(p.weights.len());
            let w = p.weights.get_mut(i)?;
            w.dtype = other(rng, &DTYPES, &w.dtype);
            Some(format!("weights[{i}].dtype -> {:?}", w.dtype))
        }
        2 | 3 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            let i = rng.below(b.buffers.len());
            let x = b.buffers.get_mut(i)?;
            if rng.below(2) == 0 {
                x.dtype = other(rng, &DTYPES, &x.dtype);
                Some(format!("buckets[{bi}].buffers[{i}].dtype -> {:?}", x.dtype))
            } else {
                x.role = other(
                    rng,
                    &[BufferRole::Input, BufferRole::Output, BufferRole::Scratch],
                    &x.role,
                );
                Some(format!("buckets[{bi}].buffers[{i}].role -> {:?}", x.role))
            }
        }
        4 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            b.replay = if rng.below(2) == 0 { Replay::Graph } else { blocker(rng) };
            Some(format!("buckets[{bi}].replay -> {:?}", b.replay))
        }
        5 => {
            let i = rng.below(p.weights.len());
            let w = p.weights.get_mut(i)?;
            w.packing = other(
                rng,
                &[
                    Packing::Single,
                    Packing::ConcatRows,
                    Packing::GatherRows,
                    Packing::LeadingRows,
                ],
                &w.packing,
            );
            Some(format!("weights[{i}].packing -> {:?}", w.packing))
        }
        6 => {
            p.model.rope_scaling = match rng.below(4) {
                0 => RopeScaling::None,
                1 => RopeScaling::Linear { factor: 0.0 },
                2 => RopeScaling::Yarn {
                    factor: 4.0,
                    original_max_position_embeddings: 64,
                    beta_fast: 1.0,
                    beta_slow: 32.0,
                    mscale: None,
                    mscale_all_dim: Some(f32::INFINITY),
                    truncate: true,
                },
                _ => RopeScaling::Llama3 {
                    factor: f32::NAN,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 0,
                },
            };
            Some(format!("model.rope_scaling -> {:?}", p.model.rope_scaling))
        }
        7 | 8 => {
            let (bi, li) = some_launch(p, rng)?;
            let new = other_arg(p, bi, rng);
            let LaunchKind::Kernel { args, .. } = &mut p.phases[0].buckets[bi].launches[li].kind else {
                return None;
            };
            let ai = rng.below(args.len());
            let old = std::mem::replace(args.get_mut(ai)?, new);
            Some(format!("buckets[{bi}].launches[{li}].args[{ai}]: {old:?} -> {new:?}"))
        }
        9 | 10 => {
            let ki = rng.below(p.kernels.len());
            let k = p.kernels.get_mut(ki)?;
            let ci = rng.below(k.constants.len());
            let (name, v) = k.constants.get_mut(ci)?;
            let new = other_const(v, rng);
            let d = format!("kernels[{ki}].constants.{name}: {v:?} -> {new:?}");
            *v = new;
            Some(d)
        }
        11 => {
            let ki = rng.below(p.kernels.len());
            let k = p.kernels.get_mut(ki)?;
            k.entry = other(rng, Entry::ALL, &k.entry);
            Some(format!("kernels[{ki}].entry -> {}", k.entry))
        }
        12 => {
            // A launch replaced by another launch kind from the same bucket.
            let (bi, li) = some_launch(p, rng)?;
            let b = &mut p.phases[0].buckets[bi];
            let want_gemm = matches!(b.launches[li].kind, LaunchKind::Kernel { .. });
            let donor = b
                .launches
                .iter()
                .position(|l| matches!(l.kind, LaunchKind::Gemm(_)) == want_gemm)?;
            b.launches[li].kind = b.launches[donor].kind.clone();
            Some(format!("buckets[{bi}].launches[{li}].kind <- launches[{donor}]"))
        }
        _ => match rng.below(4) {
            0 => {
                p.capture.hot_vocab_size = match p.capture.hot_vocab_size {
                    Some(_) => None,
                    None => Some(p.spec.topk.max(1)),
                };
                Some(format!("capture.hot_vocab_size -> {:?}", p.capture.hot_vocab_size))
            }
            1 => {
                let i = rng.below(p.layers.len());
                let l = p.layers.get_mut(i)?;
                l.window = match l.window {
                    Some(_) => None,
                    None => Some(pick(rng, &[1, 16, u32::MAX])),
                };
                Some(format!("layers[{i}].window -> {:?}", l.window))
            }
            2 => {
                let ki = rng.below(p.kernels.len());
                let donor = p.kernels.get(rng.below(p.kernels.len()))?.binary.clone();
                let k = p.kernels.get_mut(ki)?;
                k.binary = if k.binary.is_some() && rng.below(2) == 0 {
                    None
                } else {
                    donor
                };
                Some(format!("kernels[{ki}].binary swapped"))
            }
            _ => {
                p.target.nvrtc = p.target.nvrtc.take().xor(Some("99.9".into()));
                Some(format!("target.nvrtc -> {:?}", p.target.nvrtc))
            }
        },
    }
}

/// Delete, duplicate, swap, move, truncate or clear items of a vector.
fn edit<T: Clone>(v: &mut Vec<T>, rng: &mut Rng) -> Option<String> {
    if v.is_empty() {
        return None;
    }
    let i = rng.below(v.len());
    // j differs from i where it can (a swap or move in place changes nothing).
    let j = (i + 1 + rng.below(v.len().max(2) - 1)) % v.len();
    Some(match rng.below(6) {
        0 | 1 => {
            v.remove(i);
            format!("delete [{i}]")
        }
        2 => {
            v.insert(j, v[i].clone());
            format!("duplicate [{i}] at [{j}]")
        }
        3 => {
            v.swap(i, j);
            format!("swap [{i}] [{j}]")
        }
        4 => {
            let x = v.remove(i);
            v.insert(j, x);
            format!("move [{i}] to [{j}]")
        }
        _ => {
            v.truncate(i);
            format!("truncate to {i}")
        }
    })
}

fn list(p: &mut Plan, rng: &mut Rng) -> Option<String> {
    let bi = rng.below(p.phases[0].buckets.len().max(1));
    let wi = rng.below(p.weights.len().max(1));
    let ki = rng.below(p.kernels.len().max(1));
    let (what, d) = match rng.below(16) {
        0 => ("buckets".to_string(), edit(&mut p.phases[0].buckets, rng)),
        1 | 2 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            (format!("buckets[{bi}].buffers"), edit(&mut b.buffers, rng))
        }
        3..=5 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            (format!("buckets[{bi}].launches"), edit(&mut b.launches, rng))
        }
        6 | 7 => {
            let (bi, li) = some_launch(p, rng)?;
            let LaunchKind::Kernel { args, .. } = &mut p.phases[0].buckets[bi].launches[li].kind else {
                return None;
            };
            (format!("buckets[{bi}].launches[{li}].args"), edit(args, rng))
        }
        8 => ("kernels".into(), edit(&mut p.kernels, rng)),
        9 => ("weights".into(), edit(&mut p.weights, rng)),
        10 | 11 => {
            let k = p.kernels.get_mut(ki)?;
            (format!("kernels[{ki}].constants"), edit(&mut k.constants, rng))
        }
        12 => ("layers".into(), edit(&mut p.layers, rng)),
        13 => ("rope_inv_freq".into(), edit(&mut p.rope_inv_freq, rng)),
        14 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            if rng.below(2) == 0 {
                (format!("buckets[{bi}].qo_indptr"), edit(&mut b.qo_indptr, rng))
            } else {
                let i = rng.below(b.buffers.len());
                let x = b.buffers.get_mut(i)?;
                (format!("buckets[{bi}].buffers[{i}].shape"), edit(&mut x.shape, rng))
            }
        }
        _ => {
            let w = p.weights.get_mut(wi)?;
            if rng.below(2) == 0 {
                (format!("weights[{wi}].shape"), edit(&mut w.shape, rng))
            } else {
                (format!("weights[{wi}].sources"), edit(&mut w.sources, rng))
            }
        }
    };
    d.map(|d| format!("{what}: {d}"))
}

/// An argument, GEMM operand, kernel index or pool pointed at something else of its kind.
fn repoint(p: &mut Plan, rng: &mut Rng) -> Option<String> {
    let (bi, li) = some_launch(p, rng)?;
    let (nb, nw, nk, nl) = (
        p.phases[0].buckets[bi].buffers.len() as u32,
        p.weights.len() as u32,
        p.kernels.len() as u32,
        p.layers.len() as u32,
    );
    let same_dtype: Vec<Vec<u32>> = {
        let bufs = &p.phases[0].buckets[bi].buffers;
        bufs.iter()
            .map(|x| (0..nb).filter(|&j| bufs[j as usize].dtype == x.dtype).collect())
            .collect()
    };
    let to = |n: u32, rng: &mut Rng| rng.below(n.max(1) as usize) as u32;
    let at = format!("buckets[{bi}].launches[{li}]");
    match &mut p.phases[0].buckets[bi].launches[li].kind {
        LaunchKind::Kernel { kernel, args, .. } => {
            if rng.below(5) == 0 {
                let old = *kernel;
                *kernel = to(nk, rng);
                return Some(format!("{at}.kernel: {old} -> {kernel}"));
            }
            if rng.below(4) == 0 && args.iter().any(|a| matches!(a, ArgValue::KvCache { .. })) {
                // Both pools of the launch to another layer (or K and V swapped).
                let layer = to(nl, rng);
                let swap = rng.below(2) == 0;
                for a in args.iter_mut() {
                    if let ArgValue::KvCache { layer: l, kind } = a {
                        *l = layer;
                        if swap {
                            *kind = if *kind == KvKind::K { KvKind::V } else { KvKind::K };
                        }
                    }
                }
                return Some(format!("{at}: pools -> layer {layer} (K/V swapped: {swap})"));
            }
            let ai = rng.below(args.len());
            let a = args.get_mut(ai)?;
            let old = *a;
            *a = match *a {
                ArgValue::Buffer(id) => match same_dtype.get(id as usize) {
                    Some(c) if rng.below(3) > 0 && !c.is_empty() => ArgValue::Buffer(pick(rng, c)),
                    _ => ArgValue::Buffer(to(nb, rng)),
                },
                ArgValue::Weight(_) => ArgValue::Weight(to(nw, rng)),
                ArgValue::KvCache { kind, .. } => ArgValue::KvCache {
                    layer: to(nl, rng),
                    kind,
                },
                _ => return None,
            };
            Some(format!("{at}.args[{ai}]: {old:?} -> {a:?}"))
        }
        LaunchKind::Gemm(g) => {
            let GemmDesc { a, w, c, rounded, .. } = g;
            let (name, slot, n) = match (rng.below(4), rounded) {
                (0, _) => ("a", a, nb),
                (1, _) => ("w", w, nw),
                (3, Some(r)) => ("rounded", r, nb),
                _ => ("c", c, nb),
            };
            let old = *slot;
            *slot = to(n, rng);
            Some(format!("{at}.{name}: {old} -> {slot}"))
        }
        LaunchKind::Collective(c) => {
            let slot = if rng.below(2) == 0 { &mut c.send } else { &mut c.recv };
            let old = *slot;
            *slot = to(nb, rng);
            Some(format!("{at}: collective buffer {old} -> {slot}"))
        }
    }
}

/// Sizes grown consistently (shape and bytes together, the region grown to fit), so the
/// mutant gets past the bytes-match rules and tests the ones behind them.
fn inflate(p: &mut Plan, rng: &mut Rng) -> Option<String> {
    let bi = rng.below(p.phases[0].buckets.len().max(1));
    let factor = pick(rng, &[2u64, 3, 16, 1 << 20, 1 << 40]);
    match rng.below(7) {
        0 | 1 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            let i = rng.below(b.buffers.len());
            let x = b.buffers.get_mut(i)?;
            let d = rng.below(x.shape.len());
            x.shape[d] = x.shape.get(d)?.saturating_mul(factor);
            x.bytes = x.shape.iter().fold(x.dtype.size(), |a, &s| a.saturating_mul(s));
            let end = x.offset.saturating_add(x.bytes);
            b.arena_bytes = b.arena_bytes.max(end.div_ceil(ALIGN).saturating_mul(ALIGN));
            Some(format!(
                "buckets[{bi}].buffers[{i}].shape[{d}] x{factor} (bytes, arena follow)"
            ))
        }
        2 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            let i = rng.below(b.buffers.len());
            let x = b.buffers.get_mut(i)?;
            x.offset = if rng.below(2) == 0 {
                b.arena_bytes.div_ceil(ALIGN).saturating_mul(ALIGN)
            } else {
                x.offset.saturating_add(ALIGN.saturating_mul(factor))
            };
            b.arena_bytes = b
                .arena_bytes
                .max(x.offset.saturating_add(x.bytes).div_ceil(ALIGN).saturating_mul(ALIGN));
            Some(format!(
                "buckets[{bi}].buffers[{i}].offset -> {} (arena follows)",
                x.offset
            ))
        }
        3 => {
            let i = rng.below(p.weights.len());
            let w = p.weights.get_mut(i)?;
            let d = rng.below(w.shape.len());
            w.shape[d] = w.shape.get(d)?.saturating_mul(factor);
            w.bytes = w.shape.iter().fold(w.dtype.size(), |a, &s| a.saturating_mul(s));
            let end = w.offset.saturating_add(w.bytes);
            p.weight_bytes = p.weight_bytes.max(end.div_ceil(ALIGN).saturating_mul(ALIGN));
            Some(format!("weights[{i}].shape[{d}] x{factor} (bytes, region follow)"))
        }
        4 => {
            let c = &mut p.capture;
            match rng.below(4) {
                0 => c.max_requests = u32_value(c.max_requests, rng),
                1 => {
                    c.kv_pool_pages = u32_value(c.kv_pool_pages, rng);
                    c.scratch_page = c.kv_pool_pages.wrapping_sub(1);
                }
                2 => {
                    c.max_context_len = u32_value(c.max_context_len, rng);
                    c.max_pages_per_request = c.max_context_len.div_ceil(c.page_size.max(1));
                }
                _ => {
                    c.page_size = pick(rng, &[1, 2, 1024, 2048, 1 << 31]);
                    c.max_pages_per_request = c.max_context_len.div_ceil(c.page_size.max(1));
                }
            }
            Some(format!(
                "capture (consistent): requests {}, pool {}, context {}, page {}",
                c.max_requests, c.kv_pool_pages, c.max_context_len, c.page_size
            ))
        }
        5 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            b.arena_bytes = u64_value(b.arena_bytes, rng);
            Some(format!("buckets[{bi}].arena_bytes -> {}", b.arena_bytes))
        }
        _ => {
            // A bucket's batch changed with its rows and qo layout (launch shapes stay).
            let n = p.spec.num_draft_tokens;
            let b = p.phases[0].buckets.get_mut(bi)?;
            b.batch = u32_value(b.batch, rng) % 8192;
            b.rows = b.batch.wrapping_mul(n);
            b.qo_indptr = (0..=b.batch.min(8192)).map(|i| i.wrapping_mul(n)).collect();
            Some(format!("buckets[{bi}].batch -> {} (rows, qo follow)", b.batch))
        }
    }
}

fn string(p: &mut Plan, rng: &mut Rng) -> Option<String> {
    let long = "x".repeat(300);
    let values = [
        "",
        "a\nb",
        "q\"uote",
        long.as_str(),
        "é",
        "input_ids",
        "topk_probs",
        "STAGES",
        "\u{7f}",
    ];
    let s = pick(rng, &values).to_string();
    let bi = rng.below(p.phases[0].buckets.len().max(1));
    let target: &mut String = match rng.below(12) {
        0 => &mut p.name,
        1 => &mut p.compiler,
        2 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            let i = rng.below(b.buffers.len());
            &mut b.buffers.get_mut(i)?.name
        }
        3 => {
            let b = p.phases[0].buckets.get_mut(bi)?;
            let i = rng.below(b.launches.len());
            &mut b.launches.get_mut(i)?.op
        }
        4 => {
            let i = rng.below(p.weights.len());
            &mut p.weights.get_mut(i)?.name
        }
        5 => {
            let i = rng.below(p.weights.len());
            let w = p.weights.get_mut(i)?;
            let j = rng.below(w.sources.len());
            w.sources.get_mut(j)?
        }
        6 => {
            let i = rng.below(p.kernels.len());
            &mut p.kernels.get_mut(i)?.name
        }
        7 => {
            let i = rng.below(p.kernels.len());
            &mut p.kernels.get_mut(i)?.source_hash
        }
        8 => {
            let i = rng.below(p.kernels.len());
            let k = p.kernels.get_mut(i)?;
            let j = rng.below(k.constants.len());
            &mut k.constants.get_mut(j)?.0
        }
        9 => {
            let i = rng.below(p.kernels.len());
            let b: &mut KernelBinary = p.kernels.get_mut(i)?.binary.as_mut()?;
            match rng.below(3) {
                0 => &mut b.arch,
                1 => &mut b.ptx,
                _ => {
                    let n = rng.below(b.cubin.len() + 1);
                    b.cubin.truncate(n);
                    return Some(format!("kernels[{i}].binary.cubin truncated to {n}"));
                }
            }
        }
        10 => {
            let i = rng.below(p.fusions.len());
            &mut p.fusions.get_mut(i)?.rule
        }
        _ => {
            // A name copied from another item of the same list (a duplicate).
            let b = p.phases[0].buckets.get_mut(bi)?;
            let (i, j) = (rng.below(b.buffers.len()), rng.below(b.buffers.len()));
            let name = b.buffers.get(j)?.name.clone();
            let x = b.buffers.get_mut(i)?;
            x.name = name;
            return Some(format!(
                "buckets[{bi}].buffers[{i}].name <- buffers[{j}]'s {:?}",
                x.name
            ));
        }
    };
    let d = format!("string {target:?} -> {s:?}");
    *target = s;
    Some(d)
}
