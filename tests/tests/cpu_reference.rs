//! The CPU reference executor against an independent naive implementation.
//!
//! The naive forward below is written from docs/semantics.md, not from the
//! plan: per request, dense loops, its own RoPE frequencies, its own attention over the
//! caller's pages. Inputs are fresh random values every run (the seed is printed), on the
//! `tiny` preset: GQA 4/2, 2 layers, topk 4, page size 4, with and without a sliding window
//! and FR-Spec, random prefix and accept lengths, batches that need padding.

use std::path::Path;

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_contract::{load_inputs, load_weights, run_cpu, write_outputs};
use specplan_format::ValidatedPlan;
use specplan_tests::{seed, Rng};

mod naive;
use naive::*;

/// (layer, page, slot, k, v).
type SlotWrite = (usize, usize, usize, Vec<f64>, Vec<f64>);

struct Expected {
    hidden_out: Vec<Vec<f64>>,
    probs: Vec<Vec<(f64, i64)>>,
    /// Every written slot: (layer, page, slot) and its new K and V.
    writes: Vec<SlotWrite>,
}

/// The forward, straight from the semantics.
fn naive(md: &Model, st: &Step, n: usize, ps: usize, window: Option<usize>, k_top: usize) -> Expected {
    let (h, d) = (md.h, md.d);
    let g = md.hq / md.hkv;
    let per_page = ps * md.hkv * d;
    let mut k_cache = st.k_cache.clone();
    let mut v_cache = st.v_cache.clone();
    let slot_of = |i: usize, pos: usize| (st.table[i * st.cols + pos / ps] as usize, pos % ps);
    let mut out = Expected {
        hidden_out: vec![],
        probs: vec![],
        writes: vec![],
    };
    for i in 0..st.b {
        let l0 = st.prefix[i] as usize;
        let mut x: Vec<Vec<f64>> = (0..n)
            .map(|j| {
                let id = st.ids[i * n + j] as usize;
                let mut inp: Vec<f64> = md.embed[id * h..(id + 1) * h].iter().map(|&v| v as f64).collect();
                inp.extend(
                    st.hidden[(i * n + j) * h..(i * n + j + 1) * h]
                        .iter()
                        .map(|&v| v as f64),
                );
                matvec(&md.fc_w, &inp, h)
                    .iter()
                    .zip(&md.fc_b)
                    .map(|(a, b)| a + *b as f64)
                    .collect()
            })
            .collect();
        for l in 0..md.layers {
            let hn: Vec<Vec<f64>> = x
                .iter()
                .map(|r| if l == 0 { r.clone() } else { rms(r, &md.n_in[l], md.eps) })
                .collect();
            let mut q: Vec<Vec<f64>> = hn.iter().map(|r| matvec(&md.wq[l], r, md.hq * d)).collect();
            for (j, row) in hn.iter().enumerate() {
                let mut k = matvec(&md.wk[l], row, md.hkv * d);
                let v = matvec(&md.wv[l], row, md.hkv * d);
                rope_with(&mut q[j], l0 + j, d, &md.inv_freq, md.rope_scale);
                rope_with(&mut k, l0 + j, d, &md.inv_freq, md.rope_scale);
                let (page, slot) = slot_of(i, l0 + j);
                let base = l * st.pages * per_page + page * per_page + slot * md.hkv * d;
                for t in 0..md.hkv * d {
                    k_cache[base + t] = k[t] as f32;
                    v_cache[base + t] = v[t] as f32;
                }
                out.writes.push((l, page, slot, k, v));
            }
            let key = |p: usize, kvh: usize, t: usize, cache: &[f32]| {
                let (page, slot) = slot_of(i, p);
                cache[l * st.pages * per_page + page * per_page + (slot * md.hkv + kvh) * d + t] as f64
            };
            let mut attn = vec![vec![0.0; md.hq * d]; n];
            for j in 0..n {
                let end = l0 + j;
                let start = window.map_or(0, |w| (end + 1).saturating_sub(w));
                for head in 0..md.hq {
                    let kvh = head / g;
                    let scores: Vec<f64> = (start..=end)
                        .map(|p| {
                            (0..d)
                                .map(|t| q[j][head * d + t] * key(p, kvh, t, &k_cache))
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let den: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (pi, p) in (start..=end).enumerate() {
                        let w = (scores[pi] - m).exp() / den;
                        for t in 0..d {
                            attn[j][head * d + t] += w * key(p, kvh, t, &v_cache);
                        }
                    }
                }
            }
            for j in 0..n {
                let o = matvec(&md.wo[l], &attn[j], h);
                for c in 0..h {
                    x[j][c] += o[c];
                }
                let h2 = rms(&x[j], &md.n_post[l], md.eps);
                let gate = matvec(&md.wg[l], &h2, md.inter);
                let up = matvec(&md.wu[l], &h2, md.inter);
                let mid: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let down = matvec(&md.wd[l], &mid, h);
                for c in 0..h {
                    x[j][c] += down[c];
                }
            }
        }
        let sel = x[st.accept[i] as usize - 1].clone();
        let (rows, map): (Vec<usize>, Option<&Vec<i64>>) = match &md.hot {
            Some(ids) => (ids.iter().map(|&v| v as usize).collect(), Some(ids)),
            None => ((0..md.vocab).collect(), None),
        };
        let logits: Vec<f64> = rows
            .iter()
            .map(|&r| (0..h).map(|c| md.lm[r * h + c] as f64 * sel[c]).sum())
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = logits.iter().map(|v| (v - m).exp()).sum();
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        out.probs.push(
            idx.iter()
                .take(k_top)
                .map(|&c| ((logits[c] - m).exp() / s, map.map_or(c as i64, |mp| mp[c])))
                .collect(),
        );
        out.hidden_out.push(sel);
    }
    out
}

fn check(o: Overrides, batches: &[usize]) {
    check_source(Source::Preset("tiny".into()), o, &Target::default(), batches);
}

fn check_source(src: Source, o: Overrides, target: &Target, batches: &[usize]) {
    let mut rng = Rng(seed());
    let cfg = resolve(&src, &o).expect("config");
    let plan = compile(&cfg, target, None, &|_, _| {}).expect("compile").plan;
    let n = plan.spec.num_draft_tokens as usize;
    let ps = plan.capture.page_size as usize;
    let window = plan.layers[0].window.map(|w| w as usize);
    let dir = tempfile::tempdir().expect("tempdir");
    let md = make_model(&plan, &mut rng, dir.path(), 4.0);
    for &b in batches {
        let shape = StepShape {
            layers: md.layers,
            hkv: md.hkv,
            d: md.d,
            vocab: md.vocab,
            hidden_in: md.h,
            max_prefix: 120,
        };
        let st = random_step(&plan, &shape, &mut rng, b, dir.path());
        let w = load_weights(&plan, &dir.path().join("weights.safetensors")).expect("weights load");
        let mut x = load_inputs(&plan, &dir.path().join("inputs.safetensors")).expect("inputs load");
        let res = run_cpu(&plan, w, &mut x).expect("cpu run");
        let out_path = dir.path().join("out.safetensors");
        write_outputs(&plan, &out_path, &res, &x).expect("write outputs");
        let got = read_out(&out_path);
        let want = naive(&md, &st, n, ps, window, plan.spec.topk as usize);
        check_requests(&got, &want.hidden_out, &want.probs, md.vocab, &format!("b={b}"));
        let (_, _, _, kc, vc) = got;
        // Cache: every written slot holds the new K/V (bf16 of it), every other slot is untouched.
        let per_page = ps * md.hkv * md.d;
        let writes: Vec<_> = want
            .writes
            .iter()
            .map(|(l, page, slot, k, v)| {
                let base = l * st.pages * per_page + page * per_page + slot * md.hkv * md.d;
                (
                    base,
                    format!("layer {l} page {page} slot {slot}"),
                    k.as_slice(),
                    v.as_slice(),
                )
            })
            .collect();
        check_cache(&kc, &vc, &st.k_cache, &st.v_cache, &writes, &format!("b={b}"));
    }
}

#[test]
fn tiny_matches_naive_forward() {
    check(Overrides::default(), &[1, 3, 8]);
}

#[test]
fn tiny_with_window_and_fr_spec_matches_naive_forward() {
    check(
        Overrides {
            sliding_window: Some(13),
            hot_vocab_size: Some(300),
            ..Overrides::default()
        },
        &[2, 5],
    );
}

#[test]
fn topk1_plan_matches_naive_forward() {
    check(
        Overrides {
            topk: Some(1),
            num_steps: Some(4),
            num_draft_tokens: Some(5),
            ..Overrides::default()
        },
        &[4],
    );
}

/// `tiny`'s attention splits its keys at small buckets (two splits at B 1); both layers'
/// instances are narrow (N·G 8, and the selected rows' 2), so with `Target::attn_last_cta`
/// the splits merge in each group's last CTA (`attn_fused`), and by default with
/// `attn_merge`. Layer 1 runs over the selected query rows either way.
#[test]
fn attention_splits_merge_in_their_last_cta_or_a_launch() {
    use specplan_format::{Entry, LaunchKind};
    let src = || Source::Preset("tiny".into());
    let (launch, fused) = (
        Target::default(),
        Target {
            attn_last_cta: true,
            ..Target::default()
        },
    );
    // Bucket 1's attention launches and whether each runs over the selected queries.
    let launches = |t: &Target| -> Vec<(Entry, bool)> {
        let plan = specplan_tests_common_compile(src(), t);
        let b1 = &plan.buckets()[0];
        assert_eq!(b1.batch, 1);
        assert!(b1.attn_splits > 1, "tiny's bucket 1 should split its keys");
        assert_eq!(b1.attn_last_cta, t.attn_last_cta);
        b1.launches
            .iter()
            .filter_map(|l| match &l.kind {
                LaunchKind::Kernel { kernel, .. } => Some(&plan.kernels[*kernel as usize]),
                _ => None,
            })
            .filter(|k| matches!(k.entry, Entry::AttnPartial | Entry::AttnMerge | Entry::AttnFused))
            .map(|k| {
                let selects = k
                    .constants
                    .iter()
                    .any(|(c, v)| c == "SELECT_FROM" && !matches!(v, specplan_kernels::ConstValue::U32(0)));
                (k.entry, selects)
            })
            .collect()
    };
    assert_eq!(launches(&fused), [(Entry::AttnFused, false), (Entry::AttnFused, true)]);
    assert_eq!(
        launches(&launch),
        [
            (Entry::AttnPartial, false),
            (Entry::AttnMerge, false),
            (Entry::AttnPartial, true),
            (Entry::AttnMerge, true)
        ]
    );
    for t in [fused, launch] {
        check_source(src(), Overrides::default(), &t, &[1, 3]);
    }
}

/// `tiny` with a 20,000-token vocabulary: its logits rows are split across CTAs, merged in
/// the row's last CTA (topk_fused) or by a launch after the records (topk_partial +
/// topk_merge), with and without an FR-Spec hot map.
#[test]
fn split_topk_rows_match_naive_forward() {
    let text = include_str!("../../compiler/presets/tiny.toml").replace("vocab_size = 1000", "vocab_size = 20000");
    assert!(
        text.contains("vocab_size = 20000"),
        "tiny.toml changed: update this test"
    );
    let src = || Source::Toml {
        name: "tiny-v20000".into(),
        text: text.clone(),
    };
    use specplan_format::Entry;
    let launch = Target {
        topk_last_cta: false,
        ..Target::default()
    };
    let entries = |t: &Target| -> Vec<Entry> {
        let mut v: Vec<Entry> = specplan_tests_common_compile(src(), t)
            .kernels
            .iter()
            .map(|k| k.entry)
            .collect();
        v.retain(|e| {
            matches!(
                e,
                Entry::TopkPartial | Entry::TopkMerge | Entry::TopkFused | Entry::SoftmaxTopk
            )
        });
        v
    };
    assert_eq!(
        entries(&Target::default()),
        [Entry::TopkFused],
        "a 20,000-column row should be split, merged in its last CTA"
    );
    assert_eq!(entries(&launch), [Entry::TopkPartial, Entry::TopkMerge]);
    for t in [Target::default(), launch] {
        check_source(src(), Overrides::default(), &t, &[1, 3]);
        check_source(
            src(),
            Overrides {
                hot_vocab_size: Some(17000),
                ..Overrides::default()
            },
            &t,
            &[2],
        );
    }
}

/// A bucket whose top-K rows outnumber the runtime's counter words (draft decode: B · K rows,
/// here 1,024 · 8) merges them with a `topk_merge` launch; the smaller buckets of the same
/// phase merge in the row's last CTA. The rows are split at all only past 32,768 columns
/// (`TOPK_WIDEST_CHUNK`, when the rows alone fill the GPU): a 40,000-token vocabulary.
/// (Compiled only: a CPU run of 8,192 rows of 40,000 columns would take minutes.)
#[test]
fn rows_past_the_counter_words_merge_in_a_launch() {
    use specplan_format::{Entry, LaunchKind};
    let text = include_str!("../../compiler/presets/tiny.toml").replace("vocab_size = 1000", "vocab_size = 40000");
    let o = Overrides {
        topk: Some(8),
        num_steps: Some(3),
        num_draft_tokens: Some(8),
        buckets: Some("1,1024".into()),
        max_bs: Some(1024),
        max_requests: Some(1024),
        draft_decode_steps: Some("3".into()),
        ..Overrides::default()
    };
    let src = Source::Toml {
        name: "tiny-v40000".into(),
        text,
    };
    let cfg = resolve(&src, &o).expect("config");
    let plan = compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan;
    let decode = plan
        .phases
        .iter()
        .find(|p| matches!(p.kind, specplan_format::PhaseKind::DraftDecode { .. }))
        .expect("a draft-decode phase");
    let merges = |b: &specplan_format::BucketPlan| -> Vec<Entry> {
        b.launches
            .iter()
            .filter_map(|l| match &l.kind {
                LaunchKind::Kernel { kernel, .. } => Some(plan.kernels[*kernel as usize].entry),
                _ => None,
            })
            .filter(|e| matches!(e, Entry::TopkFused | Entry::TopkPartial | Entry::TopkMerge))
            .collect()
    };
    let (small, large) = (&decode.buckets[0], &decode.buckets[1]);
    assert!(small.rows <= 4096 && large.rows > specplan_kernels::kv::COUNTER_WORDS as u32);
    assert!(!merges(small).is_empty() && merges(small).iter().all(|e| *e == Entry::TopkFused));
    let big = merges(large);
    assert!(
        !big.is_empty() && !big.contains(&Entry::TopkFused) && big.contains(&Entry::TopkMerge),
        "{big:?}"
    );
}

fn specplan_tests_common_compile(src: Source, target: &Target) -> specplan_format::ValidatedPlan {
    let cfg = resolve(&src, &Overrides::default()).expect("config");
    compile(&cfg, target, None, &|_, _| {}).expect("compile").plan
}

/// A YaRN head (factor 4 over a 64-position training length, so the blend and the 1.14
/// attention factor both act on the test's positions) against the naive forward with the
/// reference's own table; its plan's table and scale constant are checked against it too.
#[test]
fn yarn_head_matches_naive_forward() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/hf/rope-yarn.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("rope-yarn")).expect("json");
    cfg["rope_scaling"]["original_max_position_embeddings"] = 64.into();
    let src = Source::HfConfig {
        name: "yarn".into(),
        text: cfg.to_string(),
    };
    let o = rope_head_flags();
    let (plan, inv, scale) = rope_head(&src, &o);
    assert!(
        (scale - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-6,
        "attention factor {scale}"
    );
    let plain = |t: usize| 500000f64.powf(-2.0 * t as f64 / 64.0) as f32;
    assert!(
        inv.iter()
            .enumerate()
            .any(|(t, &x)| (x - plain(t)).abs() > 1e-3 * plain(t)),
        "YaRN changes the table"
    );
    let k = plan
        .kernels
        .iter()
        .find(|k| k.entry == specplan_format::Entry::RopeAppend)
        .expect("rope kernel");
    let c = k.constants.iter().find(|(n, _)| n == "ROPE_SCALE").map(|x| x.1.clone());
    assert_eq!(c, Some(specplan_format::ConstValue::F32(scale as f32)));
    check_source(src, o, &Target::default(), &[1, 3]);
}

/// A LongRoPE head (Phi-3 / MiniCPM style short factors and the √(1 + ln s / ln L) factor)
/// against the naive forward, at a context within its training length; above it the config
/// is refused naming max_context_len.
#[test]
fn longrope_head_matches_naive_forward() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/hf/rope-longrope.json");
    let text = std::fs::read_to_string(&path).expect("rope-longrope");
    let src = Source::HfConfig {
        name: "longrope".into(),
        text,
    };
    let o = rope_head_flags();
    let (_, _, scale) = rope_head(&src, &o);
    assert!(scale > 1.05, "the long-context factor applies: {scale}");
    check_source(src.clone(), o.clone(), &Target::default(), &[1, 3]);
    let above = Overrides {
        max_context_len: Some(8192),
        ..o
    };
    let e = resolve(&src, &above).expect_err("a context past the training length");
    assert!(
        e.0.iter().any(|f| f.field.starts_with("capture.max_context_len")),
        "{e}"
    );
}

/// The flags of the RoPE-scaling heads' tests: small buckets, page 4, context 512.
fn rope_head_flags() -> Overrides {
    Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(4),
        buckets: Some("1,2,4".into()),
        page_size: Some(4),
        max_context_len: Some(512),
        ..Overrides::default()
    }
}

/// A RoPE-scaling head compiled with `o`, its table checked against the reference's (within
/// 2 f32 ulps): the plan, the reference table and the reference cos/sin scale.
fn rope_head(src: &Source, o: &Overrides) -> (ValidatedPlan, Vec<f32>, f64) {
    let plan = compile(&resolve(src, o).expect("config"), &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan;
    let (inv, scale) = reference_rope(&plan.model);
    for (t, (a, b)) in plan.rope_inv_freq.iter().zip(&inv).enumerate() {
        assert!(
            (a - b).abs() <= 2.0 * f32::EPSILON * b.abs(),
            "inv_freq[{t}]: plan {a}, reference {b}"
        );
    }
    (plan, inv, scale)
}
