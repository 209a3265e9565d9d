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
use specplan_format::{RopeScaling, ValidatedPlan};
use specplan_tests::{seed, Rng};

mod naive;
use naive::*;

/// Model weights as the naive forward reads them (already bf16-rounded, as in the file).
struct Model {
    h: usize,
    inter: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    layers: usize,
    vocab: usize,
    eps: f64,
    /// RoPE frequencies and the cos/sin scale, computed here from the config (not the plan's
    /// table): plain `θ^(−2t/d)`, or YaRN's blend and attention factor.
    inv_freq: Vec<f32>,
    rope_scale: f64,
    embed: Vec<f32>,
    fc_w: Vec<f32>,
    fc_b: Vec<f32>,
    wq: Vec<Vec<f32>>,
    wk: Vec<Vec<f32>>,
    wv: Vec<Vec<f32>>,
    wo: Vec<Vec<f32>>,
    wg: Vec<Vec<f32>>,
    wu: Vec<Vec<f32>>,
    wd: Vec<Vec<f32>>,
    n_in: Vec<Vec<f32>>,
    n_post: Vec<Vec<f32>>,
    lm: Vec<f32>,
    hot: Option<Vec<i64>>,
}

/// The RoPE table and cos/sin scale of a model, written from the definitions (YaRN: Peng et
/// al., as SGLang's `YaRNScalingRotaryEmbedding` applies it), independently of the format
/// crate's `rope_inv_freq`.
fn reference_rope(m: &specplan_format::ModelDesc) -> (Vec<f32>, f64) {
    let (d, theta) = (m.head_dim as f64, m.rope_theta as f64);
    let plain = |t: usize| theta.powf(-2.0 * t as f64 / d);
    match &m.rope_scaling {
        RopeScaling::None => ((0..m.head_dim as usize / 2).map(|t| plain(t) as f32).collect(), 1.0),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            let f = *factor as f64;
            // The dimension index at which `rot` full turns fit the training length.
            let at = |rot: f32| d * (*orig as f64 / (rot as f64 * std::f64::consts::TAU)).ln() / (2.0 * theta.ln());
            let (mut lo, mut hi) = (at(*beta_fast), at(*beta_slow));
            if *truncate {
                (lo, hi) = (lo.floor(), hi.ceil());
            }
            let (lo, hi) = (lo.max(0.0), hi.min(d - 1.0));
            let hi = if hi == lo { hi + 0.001 } else { hi };
            let inv = (0..m.head_dim as usize / 2)
                .map(|t| {
                    // 0 below `lo` (keep the trained frequency), 1 above `hi` (interpolate).
                    let gamma = ((t as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    (plain(t) * (1.0 - gamma) + plain(t) / f * gamma) as f32
                })
                .collect();
            let ms = |m: f64| if f <= 1.0 { 1.0 } else { 0.1 * m * f.ln() + 1.0 };
            let scale = match (mscale, mscale_all_dim) {
                (Some(a), Some(b)) => ms(*a as f64) / ms(*b as f64),
                _ => ms(1.0),
            };
            (inv, scale as f32 as f64)
        }
        RopeScaling::LongRope {
            short_factor,
            original_max_position_embeddings: orig,
            short_mscale,
        } => {
            let inv = (0..m.head_dim as usize / 2)
                .map(|t| (plain(t) / short_factor[t] as f64) as f32)
                .collect();
            let ratio = m.max_position_embeddings as f64 / *orig as f64;
            let scale = short_mscale.map_or_else(
                || {
                    if ratio > 1.0 {
                        (1.0 + ratio.ln() / (*orig as f64).ln()).sqrt()
                    } else {
                        1.0
                    }
                },
                |x| x as f64,
            );
            (inv, scale as f32 as f64)
        }
        other => panic!("the naive forward has no reference for {other:?}"),
    }
}

fn make_model(plan: &ValidatedPlan, rng: &mut Rng, dir: &Path) -> Model {
    let m = &plan.model;
    let (h, inter, hq, hkv, d, layers, vocab) = (
        m.hidden as usize,
        m.intermediate as usize,
        m.heads as usize,
        m.kv_heads as usize,
        m.head_dim as usize,
        m.layers as usize,
        m.vocab as usize,
    );
    let s = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let per_layer = |rng: &mut Rng, rows: usize, cols: usize| -> Vec<Vec<f32>> {
        (0..layers).map(|_| rand_vec(rng, rows * cols, s(cols))).collect()
    };
    let hot = plan.capture.hot_vocab_size.map(|vh| {
        let vh = vh as usize;
        let mut ids: Vec<i64> = (0..vocab as i64).collect();
        for i in 0..vh {
            let j = i + rng.below(vocab - i);
            ids.swap(i, j);
        }
        ids.truncate(vh);
        ids
    });
    let norm = |rng: &mut Rng| -> Vec<Vec<f32>> {
        (0..layers)
            .map(|_| round_bf16(&(0..h).map(|_| 1.0 + 0.2 * rng.uniform()).collect::<Vec<_>>()))
            .collect()
    };
    let model = Model {
        h,
        inter,
        hq,
        hkv,
        d,
        layers,
        vocab,
        eps: m.rms_norm_eps as f64,
        inv_freq: reference_rope(m).0,
        rope_scale: reference_rope(m).1,
        embed: rand_vec(rng, vocab * h, 1.0),
        fc_w: rand_vec(rng, h * 2 * h, s(2 * h)),
        fc_b: rand_vec(rng, h, 0.1),
        wq: per_layer(rng, hq * d, h),
        wk: per_layer(rng, hkv * d, h),
        wv: per_layer(rng, hkv * d, h),
        wo: per_layer(rng, h, hq * d),
        wg: per_layer(rng, inter, h),
        wu: per_layer(rng, inter, h),
        wd: per_layer(rng, h, inter),
        n_in: norm(rng),
        n_post: norm(rng),
        lm: rand_vec(rng, vocab * h, 4.0 * s(h)),
        hot,
    };
    let mut t = vec![
        bf16_tensor("embed_tokens.weight", vec![vocab, h], &model.embed),
        bf16_tensor("fc.weight", vec![h, 2 * h], &model.fc_w),
        bf16_tensor("fc.bias", vec![h], &model.fc_b),
        bf16_tensor("lm_head.weight", vec![vocab, h], &model.lm),
    ];
    for l in 0..layers {
        let p = format!("layers.{l}.");
        t.push(bf16_tensor(
            &format!("{p}self_attn.q_proj.weight"),
            vec![hq * d, h],
            &model.wq[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}self_attn.k_proj.weight"),
            vec![hkv * d, h],
            &model.wk[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}self_attn.v_proj.weight"),
            vec![hkv * d, h],
            &model.wv[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}self_attn.o_proj.weight"),
            vec![h, hq * d],
            &model.wo[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}mlp.gate_proj.weight"),
            vec![inter, h],
            &model.wg[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}mlp.up_proj.weight"),
            vec![inter, h],
            &model.wu[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}mlp.down_proj.weight"),
            vec![h, inter],
            &model.wd[l],
        ));
        // Layer 0's input norm is present in checkpoints but must be ignored (identity).
        t.push(bf16_tensor(
            &format!("{p}input_layernorm.weight"),
            vec![h],
            &model.n_in[l],
        ));
        t.push(bf16_tensor(
            &format!("{p}post_attention_layernorm.weight"),
            vec![h],
            &model.n_post[l],
        ));
    }
    if let Some(ids) = &model.hot {
        t.push(i64_tensor("hot_token_ids", vec![ids.len()], ids));
    }
    save(&dir.join("weights.safetensors"), &t);
    model
}

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
    check_source(Source::Preset("tiny".into()), o, batches);
}

fn check_source(src: Source, o: Overrides, batches: &[usize]) {
    let mut rng = Rng(seed());
    let cfg = resolve(&src, &o).expect("config");
    let plan = compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan;
    let n = plan.spec.num_draft_tokens as usize;
    let ps = plan.capture.page_size as usize;
    let window = plan.layers[0].window.map(|w| w as usize);
    let dir = tempfile::tempdir().expect("tempdir");
    let md = make_model(&plan, &mut rng, dir.path());
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

/// `tiny` with a 20,000-token vocabulary: its logits rows are split across CTAs
/// (topk_partial + topk_merge), with and without an FR-Spec hot map.
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
    let plan = specplan_tests_common_compile(src());
    assert!(
        plan.kernels
            .iter()
            .any(|k| k.entry == specplan_format::Entry::TopkPartial)
            && plan
                .kernels
                .iter()
                .any(|k| k.entry == specplan_format::Entry::TopkMerge),
        "a 20,000-column row should be split"
    );
    check_source(src(), Overrides::default(), &[1, 3]);
    check_source(
        src(),
        Overrides {
            hot_vocab_size: Some(17000),
            ..Overrides::default()
        },
        &[2],
    );
}

fn specplan_tests_common_compile(src: Source) -> specplan_format::ValidatedPlan {
    let cfg = resolve(&src, &Overrides::default()).expect("config");
    compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan
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
    check_source(src, o, &[1, 3]);
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
    check_source(src.clone(), o.clone(), &[1, 3]);
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
