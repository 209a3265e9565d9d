//! Every numeric leaf of a plan, by region, and the boundary values a leaf is set to.

use specplan_format::{ArgValue, ConstValue, LaunchKind, Plan, RopeScaling};
use specplan_tests::Rng;

/// A numeric leaf of a plan.
pub enum Leaf<'a> {
    U32(&'a mut u32),
    U64(&'a mut u64),
    F32(&'a mut f32),
    Bool(&'a mut bool),
}

/// Plan-wide descriptors; weights; kernel constants; bucket headers and buffers; launches.
pub const REGIONS: usize = 5;

type Visit<'v> = dyn FnMut(&dyn Fn() -> String, Leaf<'_>) + 'v;

/// Calls `f` with every leaf of `region` (a path, lazily, and the leaf).
pub fn visit(p: &mut Plan, region: usize, f: &mut Visit<'_>) {
    match region {
        0 => top(p, f),
        1 => {
            for (i, w) in p.weights.iter_mut().enumerate() {
                for (j, d) in w.shape.iter_mut().enumerate() {
                    f(&|| format!("weights[{i}].shape[{j}]"), Leaf::U64(d));
                }
                f(&|| format!("weights[{i}].offset"), Leaf::U64(&mut w.offset));
                f(&|| format!("weights[{i}].bytes"), Leaf::U64(&mut w.bytes));
            }
        }
        2 => {
            for (i, k) in p.kernels.iter_mut().enumerate() {
                for (name, v) in k.constants.iter_mut() {
                    let at = |x: &str| format!("kernels[{i}].constants.{name}{x}");
                    match v {
                        ConstValue::U32(x) => f(&|| at(""), Leaf::U32(x)),
                        ConstValue::F32(x) => f(&|| at(""), Leaf::F32(x)),
                        ConstValue::Bool(x) => f(&|| at(""), Leaf::Bool(x)),
                        ConstValue::F32Array(xs) => {
                            for (j, x) in xs.iter_mut().enumerate() {
                                f(&|| at(&format!("[{j}]")), Leaf::F32(x));
                            }
                        }
                        ConstValue::Type(_) => {}
                    }
                }
            }
        }
        3 => buckets(p, f),
        _ => launches(p, f),
    }
}

fn top(p: &mut Plan, f: &mut Visit<'_>) {
    let m = &mut p.model;
    for (name, v) in [
        ("model.hidden", &mut m.hidden),
        ("model.intermediate", &mut m.intermediate),
        ("model.heads", &mut m.heads),
        ("model.kv_heads", &mut m.kv_heads),
        ("model.head_dim", &mut m.head_dim),
        ("model.layers", &mut m.layers),
        ("model.vocab", &mut m.vocab),
        ("model.max_position_embeddings", &mut m.max_position_embeddings),
        ("spec.topk", &mut p.spec.topk),
        ("spec.num_steps", &mut p.spec.num_steps),
        ("spec.num_draft_tokens", &mut p.spec.num_draft_tokens),
        ("capture.page_size", &mut p.capture.page_size),
        ("capture.max_context_len", &mut p.capture.max_context_len),
        ("capture.max_pages_per_request", &mut p.capture.max_pages_per_request),
        ("capture.kv_pool_pages", &mut p.capture.kv_pool_pages),
        ("capture.max_requests", &mut p.capture.max_requests),
        ("capture.scratch_page", &mut p.capture.scratch_page),
        ("target.sm", &mut p.target.sm),
    ] {
        f(&|| name.to_string(), Leaf::U32(v));
    }
    if let Some(v) = p.capture.hot_vocab_size.as_mut() {
        f(&|| "capture.hot_vocab_size".into(), Leaf::U32(v));
    }
    f(&|| "model.rms_norm_eps".into(), Leaf::F32(&mut m.rms_norm_eps));
    f(&|| "model.rope_theta".into(), Leaf::F32(&mut m.rope_theta));
    f(&|| "model.fc_bias".into(), Leaf::Bool(&mut m.fc_bias));
    match &mut m.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => f(&|| "model.rope_scaling.factor".into(), Leaf::F32(factor)),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            f(&|| "model.rope_scaling.factor".into(), Leaf::F32(factor));
            f(&|| "model.rope_scaling.low".into(), Leaf::F32(low_freq_factor));
            f(&|| "model.rope_scaling.high".into(), Leaf::F32(high_freq_factor));
            f(
                &|| "model.rope_scaling.original_max".into(),
                Leaf::U32(original_max_position_embeddings),
            );
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            f(&|| "model.rope_scaling.factor".into(), Leaf::F32(factor));
            f(
                &|| "model.rope_scaling.original_max".into(),
                Leaf::U32(original_max_position_embeddings),
            );
            f(&|| "model.rope_scaling.beta_fast".into(), Leaf::F32(beta_fast));
            f(&|| "model.rope_scaling.beta_slow".into(), Leaf::F32(beta_slow));
            if let Some(x) = mscale.as_mut() {
                f(&|| "model.rope_scaling.mscale".into(), Leaf::F32(x));
            }
            if let Some(x) = mscale_all_dim.as_mut() {
                f(&|| "model.rope_scaling.mscale_all_dim".into(), Leaf::F32(x));
            }
            f(&|| "model.rope_scaling.truncate".into(), Leaf::Bool(truncate));
        }
        RopeScaling::LongRope {
            short_factor,
            original_max_position_embeddings,
            short_mscale,
        } => {
            for (i, x) in short_factor.iter_mut().enumerate() {
                f(&|| format!("model.rope_scaling.short_factor[{i}]"), Leaf::F32(x));
            }
            f(
                &|| "model.rope_scaling.original_max".into(),
                Leaf::U32(original_max_position_embeddings),
            );
            if let Some(x) = short_mscale.as_mut() {
                f(&|| "model.rope_scaling.short_mscale".into(), Leaf::F32(x));
            }
        }
    }
    f(&|| "weight_bytes".into(), Leaf::U64(&mut p.weight_bytes));
    for (i, x) in p.rope_inv_freq.iter_mut().enumerate() {
        f(&|| format!("rope_inv_freq[{i}]"), Leaf::F32(x));
    }
    for (i, l) in p.layers.iter_mut().enumerate() {
        if let Some(w) = l.window.as_mut() {
            f(&|| format!("layers[{i}].window"), Leaf::U32(w));
        }
    }
    for (i, r) in p.fusions.iter_mut().enumerate() {
        f(
            &|| format!("fusions[{i}].launches_saved"),
            Leaf::U32(&mut r.launches_saved),
        );
        f(
            &|| format!("fusions[{i}].bytes_saved"),
            Leaf::U64(&mut r.bytes_saved_per_request),
        );
    }
}

fn buckets(p: &mut Plan, f: &mut Visit<'_>) {
    for (bi, b) in p.phases[0].buckets.iter_mut().enumerate() {
        f(&|| format!("buckets[{bi}].batch"), Leaf::U32(&mut b.batch));
        f(&|| format!("buckets[{bi}].rows"), Leaf::U32(&mut b.rows));
        f(&|| format!("buckets[{bi}].arena_bytes"), Leaf::U64(&mut b.arena_bytes));
        f(&|| format!("buckets[{bi}].attn_splits"), Leaf::U32(&mut b.attn_splits));
        f(
            &|| format!("buckets[{bi}].attn_cluster"),
            Leaf::Bool(&mut b.attn_cluster),
        );
        f(
            &|| format!("buckets[{bi}].attn_last_cta"),
            Leaf::Bool(&mut b.attn_last_cta),
        );
        for (i, x) in b.qo_indptr.iter_mut().enumerate() {
            f(&|| format!("buckets[{bi}].qo_indptr[{i}]"), Leaf::U32(x));
        }
        for (i, x) in b.buffers.iter_mut().enumerate() {
            for (j, d) in x.shape.iter_mut().enumerate() {
                f(&|| format!("buckets[{bi}].buffers[{i}].shape[{j}]"), Leaf::U64(d));
            }
            f(
                &|| format!("buckets[{bi}].buffers[{i}].offset"),
                Leaf::U64(&mut x.offset),
            );
            f(&|| format!("buckets[{bi}].buffers[{i}].bytes"), Leaf::U64(&mut x.bytes));
        }
    }
}

fn launches(p: &mut Plan, f: &mut Visit<'_>) {
    for (bi, b) in p.phases[0].buckets.iter_mut().enumerate() {
        for (li, l) in b.launches.iter_mut().enumerate() {
            let at = |x: &str| format!("buckets[{bi}].launches[{li}]{x}");
            match &mut l.kind {
                LaunchKind::Kernel {
                    kernel,
                    grid,
                    block,
                    smem,
                    cluster,
                    args,
                } => {
                    f(&|| at(".kernel"), Leaf::U32(kernel));
                    f(&|| at(".cluster"), Leaf::U32(cluster));
                    for (d, g) in grid.iter_mut().enumerate() {
                        f(&|| at(&format!(".grid[{d}]")), Leaf::U32(g));
                    }
                    for (d, g) in block.iter_mut().enumerate() {
                        f(&|| at(&format!(".block[{d}]")), Leaf::U32(g));
                    }
                    f(&|| at(".smem"), Leaf::U32(smem));
                    for (ai, a) in args.iter_mut().enumerate() {
                        let leaf = match a {
                            ArgValue::Buffer(x) | ArgValue::Weight(x) | ArgValue::U32(x) => Leaf::U32(x),
                            ArgValue::KvCache { layer, .. } => Leaf::U32(layer),
                            _ => continue,
                        };
                        f(&|| at(&format!(".args[{ai}]")), leaf);
                    }
                }
                LaunchKind::Gemm(g) => {
                    f(&|| at(".m"), Leaf::U64(&mut g.m));
                    f(&|| at(".n"), Leaf::U64(&mut g.n));
                    f(&|| at(".k"), Leaf::U64(&mut g.k));
                    f(&|| at(".lda"), Leaf::U64(&mut g.lda));
                    f(&|| at(".a"), Leaf::U32(&mut g.a));
                    f(&|| at(".w"), Leaf::U32(&mut g.w));
                    f(&|| at(".c"), Leaf::U32(&mut g.c));
                    f(&|| at(".accumulate"), Leaf::Bool(&mut g.accumulate));
                    if let Some(r) = g.rounded.as_mut() {
                        f(&|| at(".rounded"), Leaf::U32(r));
                    }
                }
                LaunchKind::Collective(c) => {
                    f(&|| at(".send"), Leaf::U32(&mut c.send));
                    f(&|| at(".recv"), Leaf::U32(&mut c.recv));
                    f(&|| at(".count"), Leaf::U64(&mut c.count));
                }
            }
        }
    }
}

pub fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len())]
}

/// A boundary value other than `v` (where the list has one).
pub fn u32_value(v: u32, rng: &mut Rng) -> u32 {
    (0..8)
        .map(|_| u32_any(v, rng))
        .find(|&x| x != v)
        .unwrap_or(v.wrapping_add(1))
}

fn u32_any(v: u32, rng: &mut Rng) -> u32 {
    let r = rng.next_u64() as u32;
    pick(
        rng,
        &[
            0,
            1,
            2,
            v.wrapping_sub(1),
            v.wrapping_add(1),
            v.wrapping_mul(2),
            v / 2,
            u32::MAX - 1,
            u32::MAX,
            1 << 31,
            1 << 24,
            1 << 16,
            255,
            256,
            4096,
            r,
            r % 64,
        ],
    )
}

/// A boundary value other than `v` (where the list has one).
pub fn u64_value(v: u64, rng: &mut Rng) -> u64 {
    (0..8)
        .map(|_| u64_any(v, rng))
        .find(|&x| x != v)
        .unwrap_or(v.wrapping_add(1))
}

fn u64_any(v: u64, rng: &mut Rng) -> u64 {
    let r = rng.next_u64();
    pick(
        rng,
        &[
            0,
            1,
            v.wrapping_sub(1),
            v.wrapping_add(1),
            v.wrapping_mul(2),
            v / 2,
            v.wrapping_add(256),
            v.wrapping_sub(256),
            u64::MAX,
            u64::MAX - 1,
            u64::MAX - 255,
            u64::MAX / 2 + 1,
            1 << 32,
            1 << 40,
            64 << 30,
            (64 << 30) + 256,
            u32::MAX as u64,
            r,
            r % 4096 * 256,
        ],
    )
}

pub fn f32_value(v: f32, rng: &mut Rng) -> f32 {
    (0..8)
        .map(|_| f32_any(v, rng))
        .find(|x| x.to_bits() != v.to_bits())
        .unwrap_or(f32::NAN)
}

fn f32_any(v: f32, rng: &mut Rng) -> f32 {
    pick(
        rng,
        &[
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            v * 2.0,
            v / 2.0,
            -v,
            f32::from_bits(v.to_bits().wrapping_add(1)),
        ],
    )
}

/// Sets the `k`-th leaf of `region` to a boundary value; returns what it did.
pub fn set_leaf(p: &mut Plan, region: usize, k: usize, rng: &mut Rng) -> String {
    let mut i = 0;
    let mut desc = String::new();
    visit(p, region, &mut |path, leaf| {
        if i == k {
            desc = match leaf {
                Leaf::U32(x) => {
                    let (old, new) = (*x, u32_value(*x, rng));
                    *x = new;
                    format!("{}: {old} -> {new}", path())
                }
                Leaf::U64(x) => {
                    let (old, new) = (*x, u64_value(*x, rng));
                    *x = new;
                    format!("{}: {old} -> {new}", path())
                }
                Leaf::F32(x) => {
                    let (old, new) = (*x, f32_value(*x, rng));
                    *x = new;
                    format!("{}: {old:?} -> {new:?}", path())
                }
                Leaf::Bool(x) => {
                    *x = !*x;
                    format!("{}: flipped to {x}", path())
                }
            };
        }
        i += 1;
    });
    desc
}

/// Leaves in a region.
pub fn count(p: &mut Plan, region: usize) -> usize {
    let mut n = 0;
    visit(p, region, &mut |_, _| n += 1);
    n
}
