//! The CPU reference executor on EAGLE-3 plans against a naive EAGLE-3 forward written here
//! from the head's definition (docs/semantics.md, "The EAGLE-3 head"), not from the plan:
//! per request, dense loops over the released checkpoint names (`fc` over three target
//! layers, `midlayer.*` with its 2H-wide q/k/v, `norm`, a draft-vocabulary `lm_head`, `d2t`).
//! Fresh random weights, lengths and accept lengths every run (the seed is printed), GQA
//! 4/2, padding (batches below their bucket), page sizes 1 and 4, and a `t2d` tensor in the
//! weights file that the contract ignores as SGLang does.

use std::path::Path;

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_contract::{load_inputs, load_weights, run_cpu, write_outputs};
use specplan_format::ValidatedPlan;
use specplan_tests::{seed, Rng};

mod common;
mod naive;
use naive::*;

/// One written cache slot: (page, slot), its new K and V.
type SlotWrite = ((usize, usize), Vec<f64>, Vec<f64>);

/// Per request: the selected pre-norm row, the top-K (probability, target id), and every
/// written cache slot.
struct Expected {
    hidden_out: Vec<Vec<f64>>,
    top: Vec<Vec<(f64, i64)>>,
    writes: Vec<SlotWrite>,
}

/// The EAGLE-3 forward of one step, row by row.
fn naive_eagle3(hd: &Head, st: &Step, n: usize, ps: usize, k_top: usize) -> Expected {
    let (h, d) = (hd.h, hd.d);
    let g = hd.hq / hd.hkv;
    let per_page = ps * hd.hkv * d;
    let (mut kc, mut vc) = (st.k_cache.clone(), st.v_cache.clone());
    let slot_of = |i: usize, pos: usize| (st.table[i * st.cols + pos / ps] as usize, pos % ps);
    let mut out = Expected {
        hidden_out: vec![],
        top: vec![],
        writes: vec![],
    };
    for i in 0..st.b {
        let l0 = st.prefix[i] as usize;
        // h = fc(target features); the layer's input is [norm(embed) ‖ norm(h)], its residual h.
        let mut x: Vec<Vec<f64>> = Vec::with_capacity(n);
        let mut q = Vec::with_capacity(n);
        for j in 0..n {
            let row = i * n + j;
            let feats: Vec<f64> = st.hidden[row * hd.ht3..(row + 1) * hd.ht3]
                .iter()
                .map(|&v| v as f64)
                .collect();
            let hrow = matvec(&hd.fc, &feats, h);
            let id = st.ids[row] as usize;
            let e: Vec<f64> = hd.embed[id * h..(id + 1) * h].iter().map(|&v| v as f64).collect();
            let mut a = rms(&e, &hd.n_embed, hd.eps);
            a.extend(rms(&hrow, &hd.n_hidden, hd.eps));
            let mut qj = matvec(&hd.wq, &a, hd.hq * d);
            let mut kj = matvec(&hd.wk, &a, hd.hkv * d);
            let vj = matvec(&hd.wv, &a, hd.hkv * d);
            rope(&mut qj, l0 + j, d, hd.theta);
            rope(&mut kj, l0 + j, d, hd.theta);
            let (page, slot) = slot_of(i, l0 + j);
            let base = page * per_page + slot * hd.hkv * d;
            for t in 0..hd.hkv * d {
                kc[base + t] = kj[t] as f32;
                vc[base + t] = vj[t] as f32;
            }
            out.writes.push(((page, slot), kj, vj));
            q.push(qj);
            x.push(hrow);
        }
        let at = |p: usize, kvh: usize, t: usize, cache: &[f32]| {
            let (page, slot) = slot_of(i, p);
            cache[page * per_page + (slot * hd.hkv + kvh) * d + t] as f64
        };
        for j in 0..n {
            let mut attn = vec![0.0; hd.hq * d];
            for head in 0..hd.hq {
                let kvh = head / g;
                let scores: Vec<f64> = (0..=l0 + j)
                    .map(|p| (0..d).map(|t| q[j][head * d + t] * at(p, kvh, t, &kc)).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let den: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (p, s) in scores.iter().enumerate() {
                    let w = (s - m).exp() / den;
                    for t in 0..d {
                        attn[head * d + t] += w * at(p, kvh, t, &vc);
                    }
                }
            }
            let o = matvec(&hd.wo, &attn, h);
            for c in 0..h {
                x[j][c] += o[c];
            }
            let m2 = rms(&x[j], &hd.n_post, hd.eps);
            let gate = matvec(&hd.wg, &m2, hd.inter);
            let up = matvec(&hd.wu, &m2, hd.inter);
            let mid: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = matvec(&hd.wd, &mid, h);
            for c in 0..h {
                x[j][c] += down[c];
            }
        }
        // The pre-norm row leaves the head; its final norm feeds the draft-vocabulary head.
        let pre = x[st.accept[i] as usize - 1].clone();
        let normed = rms(&pre, &hd.n_final, hd.eps);
        let logits = matvec(&hd.lm, &normed, hd.vd);
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = logits.iter().map(|v| (v - m).exp()).sum();
        let mut idx: Vec<usize> = (0..hd.vd).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        out.top.push(
            idx.iter()
                .take(k_top)
                .map(|&c| ((logits[c] - m).exp() / s, c as i64 + hd.d2t[c]))
                .collect(),
        );
        out.hidden_out.push(pre);
    }
    out
}

fn check(page_size: u32, batches: &[usize]) {
    let mut rng = Rng(seed());
    let (src, mut o) = common::tiny_eagle3();
    o.page_size = Some(page_size);
    let cfg = resolve(&src, &o).expect("config");
    let plan = compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan;
    let (n, ps, k_top) = (
        plan.spec.num_draft_tokens as usize,
        plan.capture.page_size as usize,
        plan.spec.topk as usize,
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let hd = make_head(&plan, &mut rng, dir.path());
    for &b in batches {
        let shape = StepShape {
            layers: 1,
            hkv: hd.hkv,
            d: hd.d,
            vocab: hd.vocab,
            hidden_in: hd.ht3,
            max_prefix: 90,
        };
        let st = random_step(&plan, &shape, &mut rng, b, dir.path());
        let w = load_weights(&plan, &dir.path().join("weights.safetensors")).expect("weights load");
        let mut x = load_inputs(&plan, &dir.path().join("inputs.safetensors")).expect("inputs load");
        let res = run_cpu(&plan, w, &mut x).expect("cpu run");
        let out_path = dir.path().join("out.safetensors");
        write_outputs(&plan, &out_path, &res, &x).expect("write outputs");
        let got = read_out(&out_path);
        let want = naive_eagle3(&hd, &st, n, ps, k_top);
        check_requests(&got, &want.hidden_out, &want.top, hd.vocab, &format!("page {ps} b={b}"));
        let (_, _, _, kc, vc) = got;
        let per_page = ps * hd.hkv * hd.d;
        let writes: Vec<_> = want
            .writes
            .iter()
            .map(|((page, slot), k, v)| {
                let base = page * per_page + slot * hd.hkv * hd.d;
                (base, format!("page {page} slot {slot}"), k.as_slice(), v.as_slice())
            })
            .collect();
        check_cache(&kc, &vc, &st.k_cache, &st.v_cache, &writes, &format!("b={b}"));
    }
}

#[test]
fn eagle3_page4_matches_naive_forward() {
    check(4, &[1, 3, 8]);
}

#[test]
fn eagle3_token_slots_match_naive_forward() {
    check(1, &[2, 5]);
}

/// The run contract refuses EAGLE-3 weight files that do not fit the head, naming the
/// tensor: an fc of the wrong width, no d2t, a d2t mapping outside the target vocabulary,
/// an lm_head whose rows are not the draft vocabulary.
#[test]
fn eagle3_weight_files_that_do_not_fit_are_refused() {
    let mut rng = Rng(seed());
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/valid/tiny-eagle3.json");
    let src = Source::HfConfig {
        name: "tiny-eagle3".into(),
        text: std::fs::read_to_string(&path).expect("tiny-eagle3.json"),
    };
    let o = Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(4),
        buckets: Some("1,2".into()),
        max_context_len: Some(256),
        ..Overrides::default()
    };
    let plan = compile(
        &resolve(&src, &o).expect("config"),
        &Target::default(),
        None,
        &|_, _| {},
    )
    .expect("compile")
    .plan;
    let dir = tempfile::tempdir().expect("tempdir");
    let hd = make_head(&plan, &mut rng, dir.path());
    let file = dir.path().join("weights.safetensors");
    assert!(load_weights(&plan, &file).is_ok(), "the good file loads");
    let bytes = std::fs::read(&file).expect("weights");
    let good = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let tensors = |skip: &str, extra: Vec<Tensor>| -> Vec<Tensor> {
        let mut v: Vec<Tensor> = good
            .tensors()
            .into_iter()
            .filter(|(n, _)| n != skip)
            .map(|(n, t)| Tensor {
                name: n,
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                bytes: t.data().to_vec(),
            })
            .collect();
        v.extend(extra);
        v
    };
    let (h, vd) = (hd.h, hd.vd);
    let mut far = hd.d2t.clone();
    far[7] = hd.vocab as i64; // 7 + vocab is past the target vocabulary
    let mut twice = hd.d2t.clone();
    twice[1] = hd.d2t[0] - 1; // draft id 1 maps to draft id 0's target id
    let cases: Vec<(&str, Vec<Tensor>, &str)> = vec![
        (
            "fc.weight",
            vec![bf16_tensor("fc.weight", vec![h, 2 * h], &vec![0.0; 2 * h * h])],
            "fc.weight",
        ),
        ("d2t", vec![], "d2t"),
        ("d2t", vec![i64_tensor("d2t", vec![vd], &far)], "d2t[7]"),
        ("d2t", vec![i64_tensor("d2t", vec![vd], &twice)], "one to one"),
        (
            "lm_head.weight",
            vec![bf16_tensor(
                "lm_head.weight",
                vec![hd.vocab, h],
                &vec![0.0; hd.vocab * h],
            )],
            "lm_head.weight",
        ),
    ];
    for (skip, extra, want) in cases {
        let bad = dir.path().join("bad.safetensors");
        save(&bad, &tensors(skip, extra));
        let err = match load_weights(&plan, &bad) {
            Ok(_) => panic!("{want}: a weights file that does not fit was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{want}: {err}");
        println!("refused: {err}");
    }
}

/// A tied EAGLE-3 head (`tie_word_embeddings`) reads its lm_head from `embed_tokens.weight`
/// — all of it when the draft vocabulary is the vocabulary, its first V_d rows under a draft
/// vocabulary (SGLang's tied head): its plan names that source, a weights file without
/// `lm_head.weight` loads, and its outputs equal, bit for bit, those of the same head untied
/// whose `lm_head.weight` is a copy of those rows (the untied path is the one checked against
/// the naive forward above).
#[test]
fn a_tied_eagle3_head_reads_its_lm_head_from_the_embedding() {
    for draft_vocab in [1000u64, 600] {
        tied_case(draft_vocab);
    }
}

fn tied_case(draft_vocab: u64) {
    use specplan_tests::contract_files::{input_tensors, weight_tensors, write_safetensors};
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/valid/tiny-eagle3.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("tiny-eagle3.json")).expect("json");
    cfg["draft_vocab_size"] = draft_vocab.into();
    let o = Overrides {
        topk: Some(4),
        num_steps: Some(3),
        num_draft_tokens: Some(4),
        buckets: Some("1,2,4".into()),
        page_size: Some(4),
        max_context_len: Some(512),
        ..Overrides::default()
    };
    let plan_of = |tied: bool| {
        let mut c = cfg.clone();
        c["tie_word_embeddings"] = serde_json::Value::Bool(tied);
        let src = Source::HfConfig {
            name: format!("tiny-eagle3-tied-{tied}"),
            text: c.to_string(),
        };
        let r = resolve(&src, &o).expect("config");
        assert_eq!(r.notes.len(), usize::from(tied && draft_vocab < 1000), "{:?}", r.notes);
        compile(&r, &Target::default(), None, &|_, _| {}).expect("compile").plan
    };
    let (tied, untied) = (plan_of(true), plan_of(false));
    let lm = |p: &ValidatedPlan| {
        p.weights
            .iter()
            .find(|w| w.name == "lm_head.weight")
            .cloned()
            .expect("lm_head")
    };
    assert_eq!(lm(&tied).sources, vec!["embed_tokens.weight".to_string()]);
    assert_eq!(lm(&untied).sources, vec!["lm_head.weight".to_string()]);
    assert_eq!(lm(&tied).shape, lm(&untied).shape);
    assert_eq!(lm(&tied).shape[0], draft_vocab);
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = seed();
    let mut files = weight_tensors(&tied, seed).expect("weights");
    assert!(
        files.iter().all(|t| t.name != "lm_head.weight"),
        "the tied file has no lm_head"
    );
    write_safetensors(&dir.path().join("tied.safetensors"), &files).expect("write");
    let mut copy = files
        .iter()
        .find(|t| t.name == "embed_tokens.weight")
        .expect("embed")
        .clone();
    let row_bytes = copy.bytes.len() / copy.shape[0];
    copy.name = "lm_head.weight".into();
    copy.bytes.truncate(draft_vocab as usize * row_bytes);
    copy.shape[0] = draft_vocab as usize;
    files.push(copy);
    write_safetensors(&dir.path().join("untied.safetensors"), &files).expect("write");
    for b in [1usize, 3] {
        let inputs = input_tensors(&tied, seed ^ b as u64, b, 100).expect("inputs");
        let ip = dir.path().join(format!("in{b}.safetensors"));
        write_safetensors(&ip, &inputs).expect("write");
        let run = |p: &ValidatedPlan, w: &str| {
            let w = load_weights(p, &dir.path().join(w)).expect("weights load");
            let mut x = load_inputs(p, &ip).expect("inputs load");
            run_cpu(p, w, &mut x).expect("cpu run").outputs
        };
        let (a, u) = (run(&tied, "tied.safetensors"), run(&untied, "untied.safetensors"));
        let at = format!("V_d {draft_vocab}, b={b}");
        assert_eq!(a.topk_ids, u.topk_ids, "{at}");
        assert_eq!(a.topk_probs, u.topk_probs, "{at}");
        assert_eq!(a.hidden_out, u.hidden_out, "{at}");
    }
}
