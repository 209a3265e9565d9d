//! Tensor-parallel plans on the CPU executor: T per-rank plans (`--tp-size T --tp-rank r`)
//! run in lockstep (one thread per rank, meeting at every collective launch) against the
//! unsharded plan on the same weights file and inputs (docs/tensor-parallel.md).
//!
//! For T ∈ {2, 4, 8} on tiny heads (EAGLE-1 with GQA 4/2 and an fc bias, the same with
//! FR-Spec hot rows, EAGLE-3 with d2t, 8 heads over 2 kv heads: kv heads split, and
//! replicated when T exceeds them), both phases (draft-extend and draft decode), padded and
//! full buckets, fresh random inputs (the seed is printed):
//! - every rank's outputs are bitwise the same (the all-reduce and the top-K merge give
//!   every rank the same values);
//! - rank 0's outputs equal the unsharded plan's: hidden within 1e-5 relative, top-K
//!   probabilities within 1e-5, ids equal wherever the unsharded run's neighbouring
//!   probabilities differ by more than 1e-6, the draft-decode tree equal;
//! - each rank's KV pool is exactly the unsharded pool's slice of its kv heads.
//!
//! The CPU executor holds activations unrounded, so the only difference between the runs is
//! the order of the sums the sharding splits: the bounds are far below bf16's 4e-3.

mod common;

use std::path::Path;

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_contract::load_weights;
use specplan_format::{io, PhaseKind, Plan, ValidatedPlan};
use specplan_runtime::cpu::collective::lockstep;
use specplan_runtime::cpu::{CpuExecutor, KvPool, WeightData};
use specplan_runtime::step::PageTable;
use specplan_tests::contract_files::{weight_tensors, write_safetensors};
use specplan_tests::{seed, Rng};

const TINY: &str = include_str!("../../compiler/presets/tiny.toml");

fn plan(src: &Source, o: &Overrides, size: u32, rank: u32) -> ValidatedPlan {
    let o = Overrides {
        tp_size: Some(size),
        tp_rank: Some(rank),
        ..o.clone()
    };
    let cfg = resolve(src, &o).unwrap_or_else(|e| panic!("config at tp {size} rank {rank}: {e}"));
    compile(&cfg, &Target::default(), None, &|_, _| {})
        .unwrap_or_else(|e| panic!("compile at tp {size} rank {rank}: {e}"))
        .plan
}

/// One step's named inputs for bucket `bb` of phase `kind` with `b` real requests, and the
/// page table.
fn inputs(
    plan: &Plan,
    kind: PhaseKind,
    bb: usize,
    b: usize,
    rng: &mut Rng,
) -> (Vec<(&'static str, Vec<f64>)>, PageTable) {
    let (m, c) = (&plan.model, &plan.capture);
    let pages = c.kv_pool_pages as usize;
    let mut table = PageTable::new(plan, (pages - 1) as i32);
    let perm = rng.permutation(pages - 1);
    let cols = c.max_pages_per_request as usize;
    for i in 0..b {
        let row: Vec<i32> = (0..cols).map(|j| perm[(i * cols + j) % (pages - 1)] as i32).collect();
        table.set_row(i, &row).expect("table row");
    }
    let slots: Vec<f64> = (0..bb)
        .map(|i| if i < b { i as f64 } else { table.scratch_slot() as f64 })
        .collect();
    let prefix_max = 60usize;
    let prefix: Vec<f64> = (0..bb)
        .map(|i| if i < b { rng.below(prefix_max + 1) as f64 } else { 0.0 })
        .collect();
    let k = plan.spec.topk as usize;
    let v = m.vocab as usize;
    let named = match kind {
        PhaseKind::DraftExtend => {
            let n = plan.spec.num_draft_tokens as usize;
            let rows = bb * n;
            vec![
                (io::INPUT_IDS, (0..rows).map(|_| rng.below(v) as f64).collect()),
                (io::HIDDEN_STATES, uvec(rng, rows * m.hidden_in() as usize)),
                (io::PREFIX_LENS, prefix),
                (io::ACCEPT_LENS, (0..bb).map(|_| 1.0 + rng.below(n) as f64).collect()),
                (io::REQ_SLOTS, slots),
            ]
        }
        PhaseKind::DraftDecode { .. } => {
            let mut probs = Vec::with_capacity(bb * k);
            for _ in 0..bb {
                let mut p: Vec<f64> = (0..k)
                    .map(|_| 0.05 + 0.9 * (0.5 + 0.5 * rng.uniform() as f64))
                    .collect();
                p.sort_by(|a, b| b.total_cmp(a));
                probs.extend(p);
            }
            let ids = (0..bb)
                .flat_map(|_| rng.permutation(v)[..k].to_vec())
                .map(|x| x as f64)
                .collect();
            vec![
                (io::TOPK_PROBS, probs),
                (io::TOPK_IDS, ids),
                (io::HIDDEN_STATES, uvec(rng, bb * m.hidden as usize)),
                (io::PREFIX_LENS, prefix),
                (io::REQ_SLOTS, slots),
            ]
        }
    };
    (named, table)
}

fn uvec(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.uniform() as f64).collect()
}

/// A random pool of the unsharded plan's shape.
fn pool(plan: &Plan, rng: &mut Rng) -> KvPool {
    let (m, c) = (&plan.model, &plan.capture);
    let per_layer = c.kv_pool_pages as usize * c.page_size as usize * m.kv_heads as usize * m.head_dim as usize;
    let mut fill = || -> Vec<Vec<f32>> {
        (0..m.layers)
            .map(|_| (0..per_layer).map(|_| rng.uniform()).collect())
            .collect()
    };
    KvPool {
        pages: c.kv_pool_pages as usize,
        k: fill(),
        v: fill(),
    }
}

/// Rank `rank`'s kv heads of `full` (`heads` of them from head `first`).
fn slice_pool(full: &KvPool, full_heads: usize, first: usize, heads: usize, d: usize) -> KvPool {
    let take = |layer: &Vec<f32>| -> Vec<f32> {
        layer
            .chunks(full_heads * d)
            .flat_map(|slot| slot[first * d..(first + heads) * d].iter().copied())
            .collect()
    };
    KvPool {
        pages: full.pages,
        k: full.k.iter().map(take).collect(),
        v: full.v.iter().map(take).collect(),
    }
}

/// The first kv head rank `r` of `size` holds: kv heads split in `size` parts, or (more
/// ranks than kv heads) each replicated on `size / kv` ranks.
fn first_kv_head(full_kv: usize, local_kv: usize, size: usize, r: usize) -> usize {
    let parts = full_kv / local_kv;
    (r / (size / parts)) * local_kv
}

type Outs = Vec<(String, Vec<f64>)>;

fn get<'a>(o: &'a Outs, name: &str) -> &'a [f64] {
    o.iter()
        .find(|(n, _)| n == name)
        .map(|x| &x.1[..])
        .unwrap_or_else(|| panic!("no output {name}"))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / (1.0 + b.abs())
}

/// Rank 0's outputs against the unsharded run's over the `b` real requests of a bucket of
/// `bb`; returns the largest hidden difference.
fn compare(tag: &str, kind: PhaseKind, want: &Outs, got: &Outs, k: usize, (b, bb): (usize, usize)) -> f64 {
    let mut worst = 0.0f64;
    match kind {
        PhaseKind::DraftExtend => {
            let (wh, gh) = (get(want, io::HIDDEN_OUT), get(got, io::HIDDEN_OUT));
            let h = wh.len() / bb;
            assert_eq!(wh.len(), gh.len(), "{tag}: hidden_out sizes");
            for i in 0..b * h {
                worst = worst.max(rel(gh[i], wh[i]));
            }
            assert!(worst <= 1e-5, "{tag}: hidden_out differs by {worst:.3e} relative");
            // The logits output (full rows, every rank's share gathered) when compiled.
            if want.iter().any(|(n, _)| n == specplan_format::io::LOGITS) {
                let (wl, gl) = (get(want, io::LOGITS), get(got, io::LOGITS));
                assert_eq!(wl.len(), gl.len(), "{tag}: logits sizes");
                let cols = wl.len() / bb;
                let d = (0..b * cols).map(|i| rel(gl[i], wl[i])).fold(0.0f64, f64::max);
                assert!(d <= 1e-5, "{tag}: logits differ by {d:.3e} relative");
            }
            if !want.iter().any(|(n, _)| n == io::TOPK_PROBS) {
                return worst;
            }
            let (wp, gp) = (get(want, io::TOPK_PROBS), get(got, io::TOPK_PROBS));
            let (wi, gi) = (get(want, io::TOPK_IDS), get(got, io::TOPK_IDS));
            for r in 0..b {
                for j in 0..k {
                    let at = r * k + j;
                    assert!(
                        (gp[at] - wp[at]).abs() <= 1e-5,
                        "{tag}: request {r} top-{j} probability {} vs {}",
                        gp[at],
                        wp[at]
                    );
                    let near = |x: usize| x < k && (wp[r * k + x] - wp[at]).abs() <= 1e-6;
                    let tie = (j > 0 && near(j - 1)) || near(j + 1);
                    assert!(
                        gi[at] == wi[at] || tie,
                        "{tag}: request {r} top-{j} id {} vs {} (probability {})",
                        gi[at],
                        wi[at],
                        wp[at]
                    );
                }
            }
        }
        PhaseKind::DraftDecode { .. } => {
            for name in [io::PARENT_LIST, io::TOP_SCORES_INDEX, io::DRAFT_TOKENS] {
                let (w, g) = (get(want, name), get(got, name));
                assert_eq!(w.len(), g.len(), "{tag}: {name} sizes");
                let per = w.len() / bb;
                assert_eq!(&g[..b * per], &w[..b * per], "{tag}: {name}");
            }
        }
    }
    worst
}

fn check(name: &str, src: Source, o: Overrides, sizes: &[u32]) {
    let seed = seed();
    let mut rng = Rng(seed);
    let full = plan(&src, &o, 1, 0);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("weights.safetensors");
    write_safetensors(&path, &weight_tensors(&full, seed).expect("weights")).expect("write weights");
    let load = |p: &ValidatedPlan| load_weights(p, Path::new(&path)).expect("load weights");
    let full_w = load(&full);
    let exec = CpuExecutor::new(&full, full_w).expect("executor");
    let (m, k) = (&full.model, full.spec.topk as usize);
    for &size in sizes {
        let ranks: Vec<ValidatedPlan> = (0..size).map(|r| plan(&src, &o, size, r)).collect();
        let weights: Vec<Vec<WeightData>> = ranks.iter().map(load).collect();
        let (mut worst, mut worst_kv) = (0.0f64, 0.0f64);
        for ph in &full.phases {
            let last = ph.buckets.last().map_or(1, |x| x.batch as usize);
            // A bucket of one, a padded bucket and the largest, full.
            for b in [1usize, 3.min(last), last] {
                let bucket = ph.bucket_for(b as u32).expect("bucket");
                let bb = bucket.batch as usize;
                let tag = format!("{name} tp {size} {} b {b}/{bb} (seed {seed})", ph.kind.label());
                let (named, table) = inputs(&full, ph.kind, bb, b, &mut rng);
                let pool0 = pool(&full, &mut rng);
                let mut want_pool = pool0.clone();
                let want = exec
                    .run_named(ph.kind, bucket, &named, &table, &mut want_pool)
                    .unwrap_or_else(|e| panic!("{tag}: unsharded run: {e}"));
                let got = lockstep(size, |r, group| {
                    let p = &ranks[r as usize];
                    let (kv, d) = (p.model.kv_heads as usize, p.model.head_dim as usize);
                    let first = first_kv_head(m.kv_heads as usize, kv, size as usize, r as usize);
                    let mut pool_r = slice_pool(&pool0, m.kv_heads as usize, first, kv, d);
                    let ex = CpuExecutor::borrowing(p, &weights[r as usize])?.with_communicator(group)?;
                    let bk = p
                        .phase(ph.kind)
                        .and_then(|x| x.bucket_for(b as u32))
                        .expect("rank bucket");
                    let outs = ex.run_named(ph.kind, bk, &named, &table, &mut pool_r)?;
                    Ok((outs, pool_r, first, kv, d))
                })
                .unwrap_or_else(|e| panic!("{tag}: sharded run: {e}"));
                for (r, (outs, pool_r, first, kv, d)) in got.iter().enumerate() {
                    assert_eq!(outs, &got[0].0, "{tag}: rank {r}'s outputs differ from rank 0's");
                    // Draft-extend's layer 0 K/V are exact (replicated inputs); later layers'
                    // (and draft decode's later forwards') follow the all-reduced stream,
                    // whose sums run in another order.
                    let want_r = slice_pool(&want_pool, m.kv_heads as usize, *first, *kv, *d);
                    let exact0 =
                        ph.kind != PhaseKind::DraftExtend || (pool_r.k[0] == want_r.k[0] && pool_r.v[0] == want_r.v[0]);
                    let kv_diff = pool_r
                        .k
                        .iter()
                        .chain(&pool_r.v)
                        .zip(want_r.k.iter().chain(&want_r.v))
                        .flat_map(|(a, b)| a.iter().zip(b).map(|(&x, &y)| rel(x as f64, y as f64)))
                        .fold(0.0f64, f64::max);
                    assert!(
                        kv_diff <= 1e-5 && exact0,
                        "{tag}: rank {r}'s KV pool is not the unsharded pool's kv heads {first}..{} ({kv_diff:.2e} relative)",
                        first + kv
                    );
                    worst_kv = worst_kv.max(kv_diff);
                }
                worst = worst.max(compare(&tag, ph.kind, &want, &got[0].0, k, (b, bb)));
            }
        }
        eprintln!(
            "{name} tp {size}: every phase and bucket matches; largest differences: hidden {worst:.2e}, K/V {worst_kv:.2e} relative (seed {seed})"
        );
    }
}

/// tiny with 8 query heads of 32 over its 2 kv heads (GQA 4).
fn tiny8() -> Source {
    let text = TINY
        .replace("num_attention_heads = 4", "num_attention_heads = 8")
        .replace("head_dim = 64", "head_dim = 32");
    Source::Toml {
        name: "tiny8".into(),
        text,
    }
}

fn tiny_overrides() -> Overrides {
    Overrides {
        draft_decode_steps: Some("3".into()),
        ..Overrides::default()
    }
}

#[test]
fn eagle1_gqa_with_bias_at_tp_2_and_4() {
    check("tiny", Source::Preset("tiny".into()), tiny_overrides(), &[2, 4]);
}

/// The embedding split by vocabulary as SGLang's and vLLM's `VocabParallelEmbedding` hold
/// it (`tp_embedding = "vocab"`): each rank looks up its ids, the fc input is all-reduced.
#[test]
fn vocabulary_parallel_embedding_at_tp_2_4_8() {
    let o = Overrides {
        tp_embedding: Some("vocab".into()),
        ..tiny_overrides()
    };
    check(
        "tiny vocab-embedding",
        Source::Preset("tiny".into()),
        o.clone(),
        &[2, 4],
    );
    let src = tiny8();
    check("tiny8 vocab-embedding", src, o, &[8]);
}

/// SGLang's draft-extend slot takes the selected rows' logits: a sharded plan gathers every
/// rank's columns into full rows (beside the top-K, and alone).
#[test]
fn logits_output_at_tp_2_and_4() {
    for outputs in ["topk,logits", "logits"] {
        let o = Overrides {
            outputs: Some(outputs.into()),
            ..Overrides::default()
        };
        check(
            &format!("tiny outputs {outputs}"),
            Source::Preset("tiny".into()),
            o,
            &[2, 4],
        );
    }
}

/// One kv head (multi-query attention): every rank holds k and v whole beside its share of
/// the query heads.
#[test]
fn one_kv_head_at_tp_2_and_4() {
    let src = Source::Toml {
        name: "tiny-mqa".into(),
        text: TINY.replace("num_key_value_heads = 2", "num_key_value_heads = 1"),
    };
    check("tiny-mqa", src, tiny_overrides(), &[2, 4]);
}

#[test]
fn fr_spec_hot_rows_at_tp_2() {
    let o = Overrides {
        hot_vocab_size: Some(500),
        ..tiny_overrides()
    };
    check("tiny hot 500", Source::Preset("tiny".into()), o, &[2]);
}

#[test]
fn eight_heads_over_two_kv_heads_at_tp_2_4_8() {
    // Query heads split at every T; the two kv heads split at T = 2 and are replicated at
    // T = 4 and 8 (2 and 4 ranks per kv head).
    let src = tiny8();
    check("tiny8", src, tiny_overrides(), &[2, 4, 8]);
}

#[test]
fn eagle3_with_d2t_at_tp_2_and_4() {
    let (src, mut o) = common::tiny_eagle3();
    o.buckets = Some("1,2,4".into());
    o.draft_decode_steps = Some("3".into());
    check("tiny-eagle3", src.clone(), o.clone(), &[2, 4]);
    // The embedding split by vocabulary, as SGLang's EAGLE-3 head holds it: the ranks'
    // `embed(ids) ‖ h` summed before both norms (`norm_concat`).
    let o = Overrides {
        tp_embedding: Some("vocab".into()),
        ..o
    };
    check("tiny-eagle3 vocab-embedding", src, o, &[2, 4]);
}

#[test]
fn refusals_name_the_field() {
    let src = Source::Preset("tiny".into());
    let cases: [(Overrides, &str); 5] = [
        (
            Overrides {
                tp_size: Some(2),
                tp_embedding: Some("rows".into()),
                ..Overrides::default()
            },
            "tp_embedding",
        ),
        (
            Overrides {
                tp_size: Some(8),
                ..Overrides::default()
            },
            "num_attention_heads",
        ),
        (
            Overrides {
                tp_size: Some(3),
                ..Overrides::default()
            },
            "tp_size",
        ),
        (
            Overrides {
                tp_size: Some(2),
                tp_rank: Some(2),
                ..Overrides::default()
            },
            "tp_rank",
        ),
        (
            Overrides {
                tp_size: Some(4),
                hot_vocab_size: Some(502),
                ..Overrides::default()
            },
            "hot_vocab_size",
        ),
    ];
    for (o, field) in cases {
        let e = match resolve(&src, &o) {
            Ok(_) => panic!("{o:?} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(field), "{o:?}: the error does not name {field}: {e}");
    }
}

/// The GPU runtime refuses a sharded plan without its communicator before any device
/// work (so this runs on a machine without a GPU too), naming the plan's rank.
#[test]
fn gpu_runtime_refuses_a_sharded_plan_without_a_communicator() {
    let p = plan(&Source::Preset("tiny".into()), &Overrides::default(), 2, 1);
    let weights = specplan_tests::random::random_weights(&p, &mut Rng(1));
    let e = match specplan_runtime::gpu::GpuRuntime::new(p, &weights, Default::default()) {
        Ok(_) => panic!("a rank-1-of-2 plan loaded without a communicator"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("capture.tp") && e.contains("rank 1 of tp size 2"), "{e}");
}

/// The attention's split merge inside a thread block cluster (`Target::attn_cluster` on
/// sm_90: one `attn_partial` launch writing `out`) against the same head for sm_80
/// (partials, then `attn_merge`), on the CPU executor: the same outputs and K/V, both
/// phases, buckets that split the keys. (Off by default; its GPU check is in
/// docs/perf-notes.md, item 19.)
#[test]
fn clustered_split_merge_equals_partials_and_merge() {
    let seed = seed();
    let mut rng = Rng(seed);
    let src = Source::Preset("tiny".into());
    let cfg = resolve(&src, &tiny_overrides()).expect("config");
    let at = |sm: u32| {
        let target = Target {
            sm,
            sm_count: 132,
            attn_cluster: true,
            ..Target::default()
        };
        compile(&cfg, &target, None, &|_, _| {})
            .unwrap_or_else(|e| panic!("compile for sm_{sm}: {e}"))
            .plan
    };
    let (hopper, ampere) = (at(90), at(80));
    let clustered = hopper.all_buckets().filter(|(_, b)| b.attn_cluster).count();
    let merged = ampere.all_buckets().filter(|(_, b)| b.attn_splits > 1).count();
    assert!(
        clustered > 0 && merged > 0,
        "{clustered} clustered vs {merged} split buckets"
    );
    assert!(ampere.all_buckets().all(|(_, b)| !b.attn_cluster));
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("weights.safetensors");
    write_safetensors(&path, &weight_tensors(&hopper, seed).expect("weights")).expect("write weights");
    let load = |p: &ValidatedPlan| load_weights(p, Path::new(&path)).expect("load weights");
    let (eh, ea) = (
        CpuExecutor::new(&hopper, load(&hopper)).expect("executor"),
        CpuExecutor::new(&ampere, load(&ampere)).expect("executor"),
    );
    let k = hopper.spec.topk as usize;
    for ph in &hopper.phases {
        for bucket in ph.buckets.iter().filter(|b| b.attn_cluster) {
            let (bb, b) = (bucket.batch as usize, bucket.batch as usize);
            let tag = format!("tiny {} b {bb} (seed {seed})", ph.kind.label());
            let (named, table) = inputs(&hopper, ph.kind, bb, b, &mut rng);
            let pool0 = pool(&hopper, &mut rng);
            let (mut ph_pool, mut pa_pool) = (pool0.clone(), pool0);
            let got = eh
                .run_named(ph.kind, bucket, &named, &table, &mut ph_pool)
                .expect("sm_90 run");
            let other = ampere
                .phase(ph.kind)
                .and_then(|x| x.bucket_for(bb as u32))
                .expect("bucket");
            let want = ea
                .run_named(ph.kind, other, &named, &table, &mut pa_pool)
                .expect("sm_80 run");
            compare(&tag, ph.kind, &want, &got, k, (b, bb));
            assert!(ph_pool.k == pa_pool.k && ph_pool.v == pa_pool.v, "{tag}: K/V differ");
        }
    }
}
