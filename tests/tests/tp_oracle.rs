//! The CPU oracle of tensor-parallel plans (docs/tensor-parallel.md): the sharded forward,
//! written from the engines' split (column-parallel q/k/v and gate/up, row-parallel o/down
//! with an all-reduce, kv heads sharded with their GQA groups, a vocabulary-parallel head
//! merged from per-rank top-K records), against the unsharded forward, T ∈ {1, 2, 4, 8}.
//! Independent of the compiler: the per-rank plans, when they exist, are checked against
//! this. Fresh random inputs every run (the seed is printed).

use specplan_tests::{seed, Rng};

mod naive;
use naive::{matvec, rand_vec, rms, round_bf16};

/// One rank's reduction of its logits columns: `(max, Σ exp(l − max), its best K (value,
/// global column), best first, ties to the lower column)`, as `topk_partial` writes a record.
struct Record {
    max: f64,
    sum: f64,
    top: Vec<(f32, usize)>,
}

/// The record of columns `col0 .. col0 + logits.len()`; those at or past `valid` are the
/// padded vocabulary's tail, masked.
fn record(logits: &[f32], col0: usize, valid: usize, k: usize) -> Record {
    let cols: Vec<(f32, usize)> = logits
        .iter()
        .enumerate()
        .filter(|&(j, _)| col0 + j < valid)
        .map(|(j, &v)| (v, col0 + j))
        .collect();
    let max = cols.iter().map(|c| c.0 as f64).fold(f64::NEG_INFINITY, f64::max);
    let sum = cols.iter().map(|c| (c.0 as f64 - max).exp()).sum::<f64>() as f32 as f64;
    let mut top = cols;
    top.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    top.truncate(k);
    Record {
        max: max as f32 as f64,
        sum,
        top,
    }
}

/// The global top-K from the ranks' records (the all-gather's result): the global max, the
/// rescaled sums, the best K of every rank's candidates (ties to the lower global column).
fn merge(recs: &[Record], k: usize) -> Vec<(f64, usize)> {
    let m = recs.iter().map(|r| r.max).fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = recs
        .iter()
        .filter(|r| r.max != f64::NEG_INFINITY)
        .map(|r| r.sum * (r.max - m).exp())
        .sum();
    let mut cand: Vec<(f32, usize)> = recs.iter().flat_map(|r| r.top.iter().copied()).collect();
    cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    cand.iter()
        .take(k)
        .map(|&(v, c)| ((v as f64 - m).exp() / z, c))
        .collect()
}

/// The unsharded softmax top-K over the valid columns.
fn full(logits: &[f32], valid: usize, k: usize) -> Vec<(f64, usize)> {
    let l = &logits[..valid];
    let m = l.iter().map(|&v| v as f64).fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = l.iter().map(|&v| (v as f64 - m).exp()).sum();
    let mut idx: Vec<usize> = (0..valid).collect();
    idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    idx.iter().take(k).map(|&c| ((l[c] as f64 - m).exp() / z, c)).collect()
}

#[test]
fn vocabulary_parallel_top_k_merges_to_the_full_softmax() {
    let s = seed();
    println!("seed {s} (rerun with SPECPLAN_SEED={s})");
    let mut rng = Rng(s);
    // (vocabulary, K): a padded tail (1003 = 8·126 − 5), and ranks with fewer columns than K.
    for (vocab, k) in [(1003usize, 4usize), (1003, 1), (1003, 8), (20, 8)] {
        for t in [1usize, 2, 4, 8] {
            let per = vocab.div_ceil(t);
            let padded = per * t;
            for row in 0..20 {
                let mut logits: Vec<f32> = (0..padded).map(|_| 4.0 * rng.uniform()).collect();
                // Exact ties across ranks: the lower global column must win.
                if t > 1 && row % 2 == 0 {
                    let (a, b) = (rng.below(per), per + rng.below(per.min(vocab - per)));
                    let top = logits[..vocab].iter().cloned().fold(f32::NEG_INFINITY, f32::max) + 1.0;
                    logits[a] = top;
                    logits[b] = top;
                }
                let recs: Vec<Record> = (0..t)
                    .map(|r| record(&logits[r * per..(r + 1) * per], r * per, vocab, k))
                    .collect();
                let (got, want) = (merge(&recs, k), full(&logits, vocab, k));
                assert_eq!(got.len(), want.len(), "V {vocab} T {t} K {k}: candidates");
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.1, w.1, "V {vocab} T {t} K {k} row {row} slot {j}: ids");
                    assert!(
                        (g.0 - w.0).abs() <= 1e-6 * w.0,
                        "V {vocab} T {t} K {k} row {row} slot {j}: p {} vs {}",
                        g.0,
                        w.0
                    );
                }
            }
        }
    }
}

/// One decoder layer's weights (bf16-rounded), causal attention over its own rows (the
/// sharding does not depend on where K/V come from).
struct Layer {
    h: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    inter: usize,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    wg: Vec<f32>,
    wu: Vec<f32>,
    wd: Vec<f32>,
    n_post: Vec<f32>,
}

fn bf(x: f64) -> f64 {
    half::bf16::from_f64(x).to_f64()
}

/// Rows `rows` of a `[.., cols]` weight.
fn rows_of(w: &[f32], cols: usize, rows: std::ops::Range<usize>) -> Vec<f32> {
    w[rows.start * cols..rows.end * cols].to_vec()
}

/// Columns `c` of a `[rows, cols]` weight.
fn cols_of(w: &[f32], cols: usize, c: std::ops::Range<usize>) -> Vec<f32> {
    w.chunks_exact(cols)
        .flat_map(|r| r[c.clone()].iter().copied())
        .collect()
}

/// What rank `r` of `t` holds: its query heads, its kv heads (replicated when t > Hkv) and
/// its intermediate columns.
fn shard(l: &Layer, t: usize, r: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>, std::ops::Range<usize>) {
    let q = r * l.hq / t..(r + 1) * l.hq / t;
    let kv = if t <= l.hkv {
        r * l.hkv / t..(r + 1) * l.hkv / t
    } else {
        let h = r * l.hkv / t;
        h..h + 1
    };
    let i = r * l.inter / t..(r + 1) * l.inter / t;
    (q, kv, i)
}

/// The layer on `x` [n, h] in t ranks: (output rows, each rank's K and V rows).
#[allow(clippy::type_complexity)]
fn forward(l: &Layer, x: &[Vec<f64>], t: usize) -> (Vec<Vec<f64>>, Vec<(Vec<Vec<f64>>, Vec<Vec<f64>>)>) {
    let (n, d) = (x.len(), l.d);
    let group = l.hq / l.hkv;
    let mut o_parts = vec![vec![vec![0.0; l.h]; n]; t];
    let mut kvs = Vec::new();
    for (r, o_part) in o_parts.iter_mut().enumerate() {
        let (qh, kvh, _) = shard(l, t, r);
        let wq = rows_of(&l.wq, l.h, qh.start * d..qh.end * d);
        let wk = rows_of(&l.wk, l.h, kvh.start * d..kvh.end * d);
        let wv = rows_of(&l.wv, l.h, kvh.start * d..kvh.end * d);
        let round = |v: Vec<f64>| v.into_iter().map(bf).collect::<Vec<f64>>();
        let q: Vec<Vec<f64>> = x.iter().map(|row| round(matvec(&wq, row, qh.len() * d))).collect();
        let k: Vec<Vec<f64>> = x.iter().map(|row| round(matvec(&wk, row, kvh.len() * d))).collect();
        let v: Vec<Vec<f64>> = x.iter().map(|row| round(matvec(&wv, row, kvh.len() * d))).collect();
        let mut attn = vec![vec![0.0; qh.len() * d]; n];
        for (j, a) in attn.iter_mut().enumerate() {
            for (hi, head) in qh.clone().enumerate() {
                // The rank's kv head this query head reads (its group's).
                let kv = head / group - kvh.start;
                let sc: Vec<f64> = (0..=j)
                    .map(|p| (0..d).map(|e| q[j][hi * d + e] * k[p][kv * d + e]).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                for (p, s) in sc.iter().enumerate() {
                    for e in 0..d {
                        a[hi * d + e] += (s - m).exp() / z * v[p][kv * d + e];
                    }
                }
            }
            a.iter_mut().for_each(|z| *z = bf(*z));
        }
        // Row-parallel o_proj: the rank's partial, rounded as a GEMM output.
        let wo = cols_of(&l.wo, l.hq * d, qh.start * d..qh.end * d);
        for (o, a) in o_part.iter_mut().zip(&attn) {
            *o = matvec(&wo, a, l.h).into_iter().map(bf).collect();
        }
        kvs.push((k, v));
    }
    // The all-reduce: fp32 sum of the partials in rank order, with the residual, rounded once.
    let reduce = |x: &[Vec<f64>], parts: &[Vec<Vec<f64>>]| -> Vec<Vec<f64>> {
        (0..n)
            .map(|j| {
                (0..l.h)
                    .map(|c| {
                        let s = parts.iter().fold(x[j][c] as f32, |acc, p| acc + p[j][c] as f32);
                        bf(s as f64)
                    })
                    .collect()
            })
            .collect()
    };
    let x1 = reduce(x, &o_parts);
    let mut d_parts = vec![vec![vec![0.0; l.h]; n]; t];
    for (r, part) in d_parts.iter_mut().enumerate() {
        let (_, _, ic) = shard(l, t, r);
        let wg = rows_of(&l.wg, l.h, ic.clone());
        let wu = rows_of(&l.wu, l.h, ic.clone());
        let wd = cols_of(&l.wd, l.inter, ic.clone());
        for j in 0..n {
            let h2: Vec<f64> = rms(&x1[j], &l.n_post, 1e-5).into_iter().map(bf).collect();
            let g: Vec<f64> = matvec(&wg, &h2, ic.len()).into_iter().map(bf).collect();
            let u: Vec<f64> = matvec(&wu, &h2, ic.len()).into_iter().map(bf).collect();
            let mid: Vec<f64> = g.iter().zip(&u).map(|(g, u)| bf(g / (1.0 + (-g).exp()) * u)).collect();
            part[j] = matvec(&wd, &mid, l.h).into_iter().map(bf).collect();
        }
    }
    (reduce(&x1, &d_parts), kvs)
}

#[test]
fn a_sharded_layer_equals_the_unsharded_one_in_bf16() {
    let s = seed();
    println!("seed {s} (rerun with SPECPLAN_SEED={s})");
    let mut rng = Rng(s);
    // GQA 8/4 (T 8 replicates kv heads), head_dim 16, intermediate 96, 6 rows.
    let (h, hq, hkv, d, inter, n) = (64usize, 8usize, 4usize, 16usize, 96usize, 6usize);
    let sc = |fan: usize| 1.0 / (fan as f32).sqrt();
    let l = Layer {
        h,
        hq,
        hkv,
        d,
        inter,
        wq: rand_vec(&mut rng, hq * d * h, sc(h)),
        wk: rand_vec(&mut rng, hkv * d * h, sc(h)),
        wv: rand_vec(&mut rng, hkv * d * h, sc(h)),
        wo: rand_vec(&mut rng, h * hq * d, sc(hq * d)),
        wg: rand_vec(&mut rng, inter * h, sc(h)),
        wu: rand_vec(&mut rng, inter * h, sc(h)),
        wd: rand_vec(&mut rng, h * inter, sc(inter)),
        n_post: round_bf16(&(0..h).map(|_| 1.0 + 0.2 * rng.uniform()).collect::<Vec<_>>()),
    };
    let x: Vec<Vec<f64>> = (0..n)
        .map(|_| {
            round_bf16(&(0..h).map(|_| rng.uniform()).collect::<Vec<_>>())
                .iter()
                .map(|&v| v as f64)
                .collect()
        })
        .collect();
    let (want, kv1) = forward(&l, &x, 1);
    for t in [2usize, 4, 8] {
        let (got, kvt) = forward(&l, &x, t);
        let (mut num, mut den) = (0.0, 0.0);
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            num += (g - w) * (g - w);
            den += w * w;
        }
        let rel = (num / den).sqrt();
        println!("T {t}: layer output rel {rel:.2e} against T 1");
        assert!(rel <= 1e-2, "T {t}: output rel {rel:.3e} above 1e-2");
        // Each rank's K/V are exactly its kv heads' columns of the unsharded ones.
        for (r, (k, v)) in kvt.iter().enumerate() {
            let (_, kvh, _) = shard(&l, t, r);
            for j in 0..n {
                assert_eq!(
                    k[j][..],
                    kv1[0].0[j][kvh.start * d..kvh.end * d],
                    "T {t} rank {r} K row {j}"
                );
                assert_eq!(
                    v[j][..],
                    kv1[0].1[j][kvh.start * d..kvh.end * d],
                    "T {t} rank {r} V row {j}"
                );
            }
        }
    }
}
