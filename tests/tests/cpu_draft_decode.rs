//! The draft-decode phase on the CPU executor against a naive implementation of SGLang
//! 0.5.23's `draft_forward` written here from the release's code (srt/speculative/
//! eagle_worker_v2.py:742-923, spec_utils.py select_top_k_tokens, eagle_utils.py
//! organize_draft_results; `/work/engines/draft-decode-report.md` §2-§3): per request, per
//! lane, dense loops; lane k writes forward i's K/V at L + lane_offset(k) + i (page-aligned
//! runs with pages and several lanes), attends the prefix plus its own lane's slots, takes
//! its parent lane's hidden; path scores are fp32 products of softmax probabilities, the
//! K best of K² per step (ties to the lower index), the N − 1 best overall, ascending.
//! Fresh random inputs every run (the seed is printed): random prefixes, padded batches,
//! GQA 4/2, page sizes 1 and 4, topk 1/2/4, steps 2/3/5, FR-Spec's hot map, EAGLE-1 and
//! EAGLE-3 heads.

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_contract::load_weights;
use specplan_format::{io, PhaseKind, ValidatedPlan};
use specplan_runtime::cpu::{CpuExecutor, KvPool};
use specplan_runtime::step::PageTable;
use specplan_tests::{seed, Rng};

mod naive;
use naive::*;

/// The draft head as the lane forward reads it, for either head kind.
struct Net<'a> {
    h: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    inter: usize,
    layers: usize,
    vocab: usize,
    eps: f64,
    inv_freq: Vec<f32>,
    rope_scale: f64,
    embed: &'a [f32],
    input: Input<'a>,
    wq: Vec<&'a [f32]>,
    wk: Vec<&'a [f32]>,
    wv: Vec<&'a [f32]>,
    wo: Vec<&'a [f32]>,
    wg: Vec<&'a [f32]>,
    wu: Vec<&'a [f32]>,
    wd: Vec<&'a [f32]>,
    n_post: Vec<&'a [f32]>,
    /// lm_head, `h` wide, and the rows the logits are over (the hot ones under FR-Spec).
    lm: &'a [f32],
    lm_rows: Vec<usize>,
    /// The target id of each logits column.
    ids: Vec<i64>,
}

/// How a lane's token and hidden row enter the head, and what feeds lm_head.
enum Input<'a> {
    /// EAGLE-1: `fc(embed ‖ hidden) + bias` every forward; layers ≥ 1 norm their input;
    /// lm_head reads the layer output.
    Eagle1 {
        fc_w: &'a [f32],
        fc_b: &'a [f32],
        n_in: Vec<&'a [f32]>,
    },
    /// EAGLE-3 in draft decode: no fc (the hidden is the head's own H-wide output, SGLang
    /// 0.5.23 `llama_eagle3.py:238-247`); layer 0 on `[norm(embed) ‖ norm(hidden)]` with
    /// residual hidden; lm_head reads the final norm of the (fed back) pre-norm output.
    Eagle3 {
        n_embed: &'a [f32],
        n_hidden: &'a [f32],
        n_final: &'a [f32],
    },
}

impl<'a> Net<'a> {
    fn eagle1(md: &'a Model) -> Net<'a> {
        let v = |x: &'a [Vec<f32>]| x.iter().map(|w| &w[..]).collect::<Vec<_>>();
        let (rows, ids): (Vec<usize>, Vec<i64>) = match &md.hot {
            Some(m) => (m.iter().map(|&r| r as usize).collect(), m.clone()),
            None => ((0..md.vocab).collect(), (0..md.vocab as i64).collect()),
        };
        Net {
            h: md.h,
            hq: md.hq,
            hkv: md.hkv,
            d: md.d,
            inter: md.inter,
            layers: md.layers,
            vocab: md.vocab,
            eps: md.eps,
            inv_freq: md.inv_freq.clone(),
            rope_scale: md.rope_scale,
            embed: &md.embed,
            input: Input::Eagle1 {
                fc_w: &md.fc_w,
                fc_b: &md.fc_b,
                n_in: v(&md.n_in),
            },
            wq: v(&md.wq),
            wk: v(&md.wk),
            wv: v(&md.wv),
            wo: v(&md.wo),
            wg: v(&md.wg),
            wu: v(&md.wu),
            wd: v(&md.wd),
            n_post: v(&md.n_post),
            lm: &md.lm,
            lm_rows: rows,
            ids,
        }
    }

    fn eagle3(plan: &ValidatedPlan, hd: &'a Head) -> Net<'a> {
        let (inv_freq, rope_scale) = reference_rope(&plan.model);
        Net {
            h: hd.h,
            hq: hd.hq,
            hkv: hd.hkv,
            d: hd.d,
            inter: hd.inter,
            layers: 1,
            vocab: hd.vocab,
            eps: hd.eps,
            inv_freq,
            rope_scale,
            embed: &hd.embed,
            input: Input::Eagle3 {
                n_embed: &hd.n_embed,
                n_hidden: &hd.n_hidden,
                n_final: &hd.n_final,
            },
            wq: vec![&hd.wq],
            wk: vec![&hd.wk],
            wv: vec![&hd.wv],
            wo: vec![&hd.wo],
            wg: vec![&hd.wg],
            wu: vec![&hd.wu],
            wd: vec![&hd.wd],
            n_post: vec![&hd.n_post],
            lm: &hd.lm,
            lm_rows: (0..hd.vd).collect(),
            ids: (0..hd.vd).map(|c| c as i64 + hd.d2t[c]).collect(),
        }
    }

    /// A lane's residual stream and layer-0 input from its token and hidden row.
    fn enter(&self, id: usize, hid: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let h = self.h;
        let e: Vec<f64> = self.embed[id * h..(id + 1) * h].iter().map(|&v| v as f64).collect();
        match &self.input {
            Input::Eagle1 { fc_w, fc_b, .. } => {
                let mut inp = e;
                inp.extend(hid);
                let x: Vec<f64> = matvec(fc_w, &inp, h)
                    .iter()
                    .zip(fc_b.iter())
                    .map(|(a, b)| a + *b as f64)
                    .collect();
                (x.clone(), x)
            }
            Input::Eagle3 { n_embed, n_hidden, .. } => {
                let mut a = rms(&e, n_embed, self.eps);
                a.extend(rms(hid, n_hidden, self.eps));
                (hid.to_vec(), a)
            }
        }
    }

    /// Layer `l`'s attention input from the residual stream (layer 0: `first`).
    fn layer_input(&self, l: usize, x: &[f64], first: &[f64]) -> Vec<f64> {
        match &self.input {
            _ if l == 0 => first.to_vec(),
            Input::Eagle1 { n_in, .. } => rms(x, n_in[l], self.eps),
            Input::Eagle3 { .. } => unreachable!("an EAGLE-3 head has one layer"),
        }
    }

    /// What lm_head reads from a lane's output row.
    fn head_input(&self, x: &[f64]) -> Vec<f64> {
        match &self.input {
            Input::Eagle1 { .. } => x.to_vec(),
            Input::Eagle3 { n_final, .. } => rms(x, n_final, self.eps),
        }
    }
}

/// One step's inputs: the draft-extend top-K and hidden rows, prefixes, the caller's pages
/// and its K/V pool (every slot random, so a wrong read shows).
struct Step {
    probs: Vec<f32>,
    ids: Vec<i64>,
    hidden: Vec<f32>,
    prefix: Vec<usize>,
    /// Page ids of each request's row, `cols` per request.
    table: Vec<i32>,
    cols: usize,
    pool: KvPool,
}

/// Lane k's offset past the prefix (SGLang's `assign_draft_cache_locs`, written from the
/// release: eagle_worker_common.py:275-333).
fn lane_offset(l: usize, k: usize, steps: usize, topk: usize, ps: usize) -> usize {
    if ps == 1 || topk == 1 {
        k * steps
    } else {
        let last = l % ps;
        k * (last + steps).div_ceil(ps) * ps
    }
}

fn random_step(plan: &ValidatedPlan, md: &Net, rng: &mut Rng, b: usize, steps: usize) -> Step {
    let (k, ps) = (plan.spec.topk as usize, plan.capture.page_size as usize);
    let ctx = plan.capture.max_context_len as usize;
    let cols = plan.capture.max_pages_per_request as usize;
    let prefix: Vec<usize> = (0..b)
        .map(|_| loop {
            let l = rng.below(200);
            if l + lane_offset(l, k.saturating_sub(1), steps, k, ps) + steps <= ctx {
                break l;
            }
        })
        .collect();
    // Each request's root children: K distinct ids, probabilities descending.
    let mut probs = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..b {
        let mut p: Vec<f32> = (0..k).map(|_| 0.05 + 0.9 * (rng.uniform() * 0.5 + 0.5)).collect();
        p.sort_by(|a, b| b.total_cmp(a));
        probs.extend(p);
        let perm = rng.permutation(md.vocab);
        ids.extend(perm[..k].iter().map(|&x| x as i64));
    }
    let hidden = rand_vec(rng, b * md.h, 1.0);
    let pages = plan.capture.kv_pool_pages as usize;
    // Distinct pages for every request (shuffled), the pool's last page left as scratch.
    let perm = rng.permutation(pages - 1);
    let table: Vec<i32> = (0..b * cols).map(|i| perm[i % (pages - 1)] as i32).collect();
    let per_layer = pages * ps * md.hkv * md.d;
    let fill = |rng: &mut Rng| -> Vec<Vec<f32>> {
        (0..md.layers)
            .map(|_| round_bf16(&(0..per_layer).map(|_| rng.uniform()).collect::<Vec<_>>()))
            .collect()
    };
    let pool = KvPool {
        pages,
        k: fill(rng),
        v: fill(rng),
    };
    Step {
        probs,
        ids,
        hidden,
        prefix,
        table,
        cols,
        pool,
    }
}

/// What the naive forward predicts for one request.
struct Want {
    parents: Vec<i64>,
    top: Vec<i64>,
    tokens: Vec<i64>,
    /// Every slot the request's lanes write: (layer, element offset of the slot), K and V.
    writes: Vec<(usize, usize, Vec<f64>, Vec<f64>)>,
    /// The smallest relative gap at any cut the selection made (a near tie: the executor's
    /// f32 and this f64 forward may order it differently).
    min_gap: f64,
}

/// Order of candidates: value descending, ties to the lower index.
fn best(v: &[f32], n: usize) -> (Vec<usize>, f64) {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    let gap = if n < v.len() {
        let (x, y) = (v[idx[n - 1]] as f64, v[idx[n]] as f64);
        (x - y).abs() / x.abs().max(1e-30)
    } else {
        f64::INFINITY
    };
    idx.truncate(n);
    (idx, gap)
}

#[allow(clippy::too_many_arguments)]
fn naive_request(plan: &ValidatedPlan, md: &Net, st: &Step, r: usize, steps: usize, nodes: usize) -> Want {
    let (h, d) = (md.h, md.d);
    let (k, ps) = (plan.spec.topk as usize, plan.capture.page_size as usize);
    let g = md.hq / md.hkv;
    let l0 = st.prefix[r];
    let slot_el = |pos: usize| {
        let page = st.table[r * st.cols + pos / ps] as usize;
        (page * ps + pos % ps) * md.hkv * d
    };
    let mut kc = st.pool.k.clone();
    let mut vc = st.pool.v.clone();
    // i = 0 (select_top_k_tokens, first): lane k = candidate k, the request's hidden.
    let mut ids: Vec<i64> = st.ids[r * k..(r + 1) * k].to_vec();
    let mut scores: Vec<f32> = st.probs[r * k..(r + 1) * k].to_vec();
    let mut hid: Vec<Vec<f64>> = (0..k)
        .map(|_| st.hidden[r * h..(r + 1) * h].iter().map(|&v| v as f64).collect())
        .collect();
    let mut score_list: Vec<f32> = scores.clone();
    let mut token_list: Vec<i64> = ids.clone();
    let mut parents: Vec<i64> = (-1..k as i64).collect();
    let mut writes = Vec::new();
    let mut min_gap = f64::INFINITY;
    for i in 0..steps - 1 {
        let pos = l0 + i;
        // Each lane's residual stream and layer-0 input (EAGLE-1: fc; EAGLE-3: the norms).
        let (mut x, first): (Vec<Vec<f64>>, Vec<Vec<f64>>) =
            (0..k).map(|lane| md.enter(ids[lane] as usize, &hid[lane])).unzip();
        for l in 0..md.layers {
            let hn: Vec<Vec<f64>> = (0..k).map(|lane| md.layer_input(l, &x[lane], &first[lane])).collect();
            let mut q: Vec<Vec<f64>> = hn.iter().map(|row| matvec(md.wq[l], row, md.hq * d)).collect();
            for lane in 0..k {
                let mut kk = matvec(md.wk[l], &hn[lane], md.hkv * d);
                let vv = matvec(md.wv[l], &hn[lane], md.hkv * d);
                rope_with(&mut q[lane], pos, d, &md.inv_freq, md.rope_scale);
                rope_with(&mut kk, pos, d, &md.inv_freq, md.rope_scale);
                let at = slot_el(l0 + lane_offset(l0, lane, steps, k, ps) + i);
                for t in 0..md.hkv * d {
                    kc[l][at + t] = kk[t] as f32;
                    vc[l][at + t] = vv[t] as f32;
                }
                writes.push((l, at, kk, vv));
            }
            for lane in 0..k {
                // The prefix, then the lane's own slots of steps 0..=i.
                let keys: Vec<usize> = (0..l0)
                    .chain((0..=i).map(|j| l0 + lane_offset(l0, lane, steps, k, ps) + j))
                    .map(slot_el)
                    .collect();
                let mut attn = vec![0.0; md.hq * d];
                for head in 0..md.hq {
                    let kvh = head / g;
                    let sc: Vec<f64> = keys
                        .iter()
                        .map(|&e| {
                            (0..d)
                                .map(|t| q[lane][head * d + t] * kc[l][e + kvh * d + t] as f64)
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let den: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                    for (ki, &e) in keys.iter().enumerate() {
                        let w = (sc[ki] - m).exp() / den;
                        for t in 0..d {
                            attn[head * d + t] += w * vc[l][e + kvh * d + t] as f64;
                        }
                    }
                }
                let o = matvec(md.wo[l], &attn, h);
                for c in 0..h {
                    x[lane][c] += o[c];
                }
                let h2 = rms(&x[lane], md.n_post[l], md.eps);
                let gate = matvec(md.wg[l], &h2, md.inter);
                let up = matvec(md.wu[l], &h2, md.inter);
                let mid: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let down = matvec(md.wd[l], &mid, h);
                for c in 0..h {
                    x[lane][c] += down[c];
                }
            }
        }
        // Per lane: softmax over the lm_head rows, top-K, mapped to target ids once.
        let cols = md.ids.len();
        let mut step_p: Vec<Vec<f32>> = Vec::new();
        let mut step_i: Vec<Vec<i64>> = Vec::new();
        for row in &x {
            let row = md.head_input(row);
            let logits: Vec<f64> = (0..cols)
                .map(|v| (0..h).map(|c| md.lm[md.lm_rows[v] * h + c] as f64 * row[c]).sum())
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = logits.iter().map(|v| (v - m).exp()).sum();
            let probs: Vec<f32> = logits.iter().map(|v| ((v - m).exp() / s) as f32).collect();
            let (top, gap) = best(&probs, k);
            min_gap = min_gap.min(gap);
            step_p.push(top.iter().map(|&c| probs[c]).collect());
            step_i.push(top.iter().map(|&c| md.ids[c]).collect());
        }
        // Selection i + 1 (select_top_k_tokens, later).
        let kk = k * k;
        let expand: Vec<f32> = (0..kk).map(|c| scores[c / k] * step_p[c / k][c % k]).collect();
        let cand_ids: Vec<i64> = (0..kk).map(|c| step_i[c / k][c % k]).collect();
        score_list.extend(&expand);
        token_list.extend(&cand_ids);
        let (sel, gap) = best(&expand, k);
        min_gap = min_gap.min(gap);
        if i + 1 < steps - 1 {
            parents.extend(sel.iter().map(|&c| (c + kk * i + k) as i64));
        }
        scores = sel.iter().map(|&c| expand[c]).collect();
        ids = sel.iter().map(|&c| cand_ids[c]).collect();
        hid = sel.iter().map(|&c| x[c / k].clone()).collect();
    }
    // organize_draft_results.
    let (mut top, gap) = best(&score_list, nodes);
    min_gap = min_gap.min(gap);
    top.sort_unstable();
    Want {
        parents,
        tokens: top.iter().map(|&c| token_list[c]).collect(),
        top: top.into_iter().map(|c| c as i64).collect(),
        writes,
        min_gap,
    }
}

fn check(topk: u32, steps: u32, n: u32, page_size: u32, hot: Option<u32>, batches: &[usize]) {
    check_head(false, topk, steps, n, page_size, hot, batches)
}

/// `check` on the tiny preset (EAGLE-1) or, with `eagle3`, the tiny EAGLE-3 head of the
/// corpus (draft vocabulary 600, d2t).
fn check_head(eagle3: bool, topk: u32, steps: u32, n: u32, page_size: u32, hot: Option<u32>, batches: &[usize]) {
    let mut rng = Rng(seed());
    let o = Overrides {
        topk: Some(topk),
        num_steps: Some(steps),
        num_draft_tokens: Some(n),
        page_size: Some(page_size),
        hot_vocab_size: hot,
        draft_decode_steps: Some(steps.to_string()),
        buckets: Some("1,2,4,8".into()),
        max_context_len: Some(512),
        ..Default::default()
    };
    let src = if eagle3 {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/valid/tiny-eagle3.json");
        Source::HfConfig {
            name: "tiny-eagle3".into(),
            text: std::fs::read_to_string(&path).expect("tiny-eagle3.json"),
        }
    } else {
        Source::Preset("tiny".into())
    };
    let cfg = resolve(&src, &o).expect("config");
    let plan = compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan;
    let kind = PhaseKind::DraftDecode { steps };
    let phase = plan.phase(kind).expect("the draft-decode phase");
    let dir = tempfile::tempdir().expect("tempdir");
    // Large logits: peaked distributions, so the tree's products are well separated.
    let (model, head);
    let md = if eagle3 {
        head = make_head(&plan, &mut rng, dir.path());
        Net::eagle3(&plan, &head)
    } else {
        model = make_model(&plan, &mut rng, dir.path(), 8.0);
        Net::eagle1(&model)
    };
    let weights = load_weights(&plan, &dir.path().join("weights.safetensors")).expect("weights");
    let exec = CpuExecutor::new(&plan, weights).expect("executor");
    let (k, s, nodes) = (topk as usize, steps as usize, n as usize - 1);
    let mut ties = 0;
    for &b in batches {
        let tag = format!("topk {topk} steps {steps} N {n} page {page_size} hot {hot:?} b {b}");
        let st = random_step(&plan, &md, &mut rng, b, s);
        let bucket = phase.bucket_for(b as u32).expect("bucket");
        let bb = bucket.batch as usize;
        let mut table = PageTable::new(&plan, (st.pool.pages - 1) as i32);
        for i in 0..b {
            table
                .set_row(i, &st.table[i * st.cols..(i + 1) * st.cols])
                .expect("row");
        }
        // Padded requests: prefix 0 in the scratch slot, inputs repeated from request 0.
        let pad = |v: &[f64], w: usize| -> Vec<f64> {
            (0..bb * w).map(|i| if i < b * w { v[i] } else { v[i % w] }).collect()
        };
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let inputs = vec![
            (io::TOPK_PROBS, pad(&f(&st.probs), k)),
            (
                io::TOPK_IDS,
                pad(&st.ids.iter().map(|&x| x as f64).collect::<Vec<_>>(), k),
            ),
            (io::HIDDEN_STATES, pad(&f(&st.hidden), md.h)),
            (
                io::PREFIX_LENS,
                (0..bb).map(|i| if i < b { st.prefix[i] as f64 } else { 0.0 }).collect(),
            ),
            (
                io::REQ_SLOTS,
                (0..bb)
                    .map(|i| if i < b { i as f64 } else { table.scratch_slot() as f64 })
                    .collect(),
            ),
        ];
        let mut pool = st.pool.clone();
        let outs = exec
            .run_named(kind, bucket, &inputs, &table, &mut pool)
            .expect("cpu run");
        let get = |name: &str| outs.iter().find(|(n, _)| n == name).map(|x| x.1.clone()).expect(name);
        let (parents, top, tokens) = (get(io::PARENT_LIST), get(io::TOP_SCORES_INDEX), get(io::DRAFT_TOKENS));
        let pw = (s - 1) * k + 1;
        let mut touched = vec![vec![false; st.pool.k[0].len()]; md.layers];
        for r in 0..b {
            let want = naive_request(&plan, &md, &st, r, s, nodes);
            let got_p: Vec<i64> = parents[r * pw..(r + 1) * pw].iter().map(|&x| x as i64).collect();
            let got_t: Vec<i64> = top[r * nodes..(r + 1) * nodes].iter().map(|&x| x as i64).collect();
            let got_d: Vec<i64> = tokens[r * nodes..(r + 1) * nodes].iter().map(|&x| x as i64).collect();
            let same = got_p == want.parents && got_t == want.top && got_d == want.tokens;
            if !same && want.min_gap < 1e-4 {
                // A near tie between the f32 executor and this f64 forward: not a verdict.
                ties += 1;
                continue;
            }
            assert_eq!(got_p, want.parents, "{tag} request {r}: parent_list");
            assert_eq!(got_t, want.top, "{tag} request {r}: top_scores_index");
            assert_eq!(got_d, want.tokens, "{tag} request {r}: draft_tokens");
            for (l, at, kk, vv) in &want.writes {
                for t in 0..md.hkv * md.d {
                    let (gk, gv) = (pool.k[*l][at + t] as f64, pool.v[*l][at + t] as f64);
                    assert!(
                        (gk - kk[t]).abs() <= 2e-2 * (1.0 + kk[t].abs()),
                        "{tag} request {r} layer {l}: K at {}",
                        at + t
                    );
                    assert!(
                        (gv - vv[t]).abs() <= 2e-2 * (1.0 + vv[t].abs()),
                        "{tag} request {r} layer {l}: V at {}",
                        at + t
                    );
                    touched[*l][at + t] = true;
                }
            }
        }
        // Nothing but the lanes' slots (and the scratch page of padded rows) changed.
        let scratch = (st.pool.pages - 1) * page_size as usize * md.hkv * md.d;
        for (l, seen) in touched.iter().enumerate() {
            for (e, (&a, &w)) in pool.k[l].iter().zip(&st.pool.k[l]).enumerate() {
                assert!(
                    seen[e] || e >= scratch || a == w,
                    "{tag}: layer {l} K element {e} changed"
                );
            }
        }
    }
    eprintln!("{ties} near ties skipped");
    assert!(
        ties <= batches.iter().sum::<usize>() / 4 + 1,
        "{ties} near ties: the test's data is degenerate"
    );
}

#[test]
fn chain_topk1_matches_naive_draft_forward() {
    check(1, 3, 4, 4, None, &[1, 3, 8]);
    check(1, 5, 6, 1, None, &[2, 5]);
}

#[test]
fn tree_topk2_and_topk4_match_naive_draft_forward() {
    check(2, 3, 5, 1, None, &[1, 3]);
    check(4, 3, 8, 4, None, &[2, 7]);
    check(4, 2, 4, 4, None, &[3]);
}

#[test]
fn tree_with_pages_and_five_steps_matches_naive_draft_forward() {
    check(2, 5, 8, 4, None, &[1, 4]);
}

/// EAGLE-3: no fc on the head's own hidden, layer 0 on the two norms, lm_head over the draft
/// vocabulary after the final norm, ids through d2t, the pre-norm row fed back.
#[test]
fn eagle3_chain_and_tree_match_naive_draft_forward() {
    check_head(true, 1, 3, 4, 4, None, &[1, 5]);
    check_head(true, 4, 3, 8, 4, None, &[2, 7]);
    check_head(true, 2, 5, 8, 1, None, &[3]);
}

#[test]
fn tree_with_fr_spec_hot_map_matches_naive_draft_forward() {
    check(4, 3, 6, 4, Some(300), &[2, 5]);
}

/// The worked example of the report (§5) on the selection arithmetic alone: SGLang's own
/// functions give parent_list [-1, 0, 1, 4, 2], top_scores_index [0, 1, 4] and draft_tokens
/// [503, 808, 202] for these per-step top-2s (b = 1, K = 2, S = 3, N = 4).
#[test]
fn tree_arithmetic_reproduces_the_release_example() {
    let (k, nodes) = (2usize, 3usize);
    let mut scores = vec![0.6f32, 0.35];
    let mut score_list = scores.clone();
    let mut token_list = vec![503i64, 808];
    let mut parents: Vec<i64> = vec![-1, 0, 1];
    // (probs, ids) per lane after forwards 0 and 1, ids already mapped (report §5).
    let steps: [[(Vec<f32>, Vec<i64>); 2]; 2] = [
        [(vec![0.5, 0.3], vec![101, 404]), (vec![0.9, 0.05], vec![202, 606])],
        [(vec![0.8, 0.1], vec![505, 707]), (vec![0.55, 0.25], vec![919, 1000])],
    ];
    for (i, lanes) in steps.iter().enumerate() {
        let expand: Vec<f32> = (0..k * k).map(|c| scores[c / k] * lanes[c / k].0[c % k]).collect();
        let ids: Vec<i64> = (0..k * k).map(|c| lanes[c / k].1[c % k]).collect();
        score_list.extend(&expand);
        token_list.extend(&ids);
        let (sel, _) = best(&expand, k);
        if i + 1 < steps.len() {
            parents.extend(sel.iter().map(|&c| (c + k * k * i + k) as i64));
        }
        scores = sel.iter().map(|&c| expand[c]).collect();
    }
    let (mut top, _) = best(&score_list, nodes);
    top.sort_unstable();
    assert_eq!(parents, vec![-1, 0, 1, 4, 2]);
    assert_eq!(top, vec![0, 1, 4]);
    assert_eq!(
        top.iter().map(|&c| token_list[c]).collect::<Vec<_>>(),
        vec![503, 808, 202]
    );
}

/// The inputs file of a draft-decode step (`specplan run --phase draft_decode`).
fn write_inputs(
    path: &std::path::Path,
    plan: &ValidatedPlan,
    md: &Net,
    st: &Step,
    b: usize,
    edit: &dyn Fn(&mut Vec<Tensor>),
) {
    let k = plan.spec.topk as usize;
    let ps = plan.capture.page_size as usize;
    let caller_pages = st.pool.pages - 1;
    let per_layer = caller_pages * ps * md.hkv * md.d;
    let cache = |layers: &[Vec<f32>]| -> Vec<f32> { layers.iter().flat_map(|l| l[..per_layer].to_vec()).collect() };
    let kv_shape = vec![md.layers, caller_pages, ps, md.hkv, md.d];
    let mut t = vec![
        Tensor {
            name: io::TOPK_PROBS.into(),
            dtype: safetensors::tensor::Dtype::F32,
            shape: vec![b, k],
            bytes: st.probs[..b * k].iter().flat_map(|x| x.to_le_bytes()).collect(),
        },
        i64_tensor(io::TOPK_IDS, vec![b, k], &st.ids[..b * k]),
        bf16_tensor(io::HIDDEN_STATES, vec![b, md.h], &st.hidden[..b * md.h]),
        i32_tensor(
            io::PREFIX_LENS,
            vec![b],
            &st.prefix[..b].iter().map(|&l| l as i32).collect::<Vec<_>>(),
        ),
        i32_tensor(io::PAGE_TABLE, vec![b, st.cols], &st.table[..b * st.cols]),
        bf16_tensor(io::K_CACHE, kv_shape.clone(), &cache(&st.pool.k)),
        bf16_tensor(io::V_CACHE, kv_shape, &cache(&st.pool.v)),
    ];
    edit(&mut t);
    save(path, &t);
}

/// Sets element `at` of tensor `name` (i64, i32 or f32 little-endian) in a file's tensors.
fn poke(t: &mut [Tensor], name: &str, at: usize, v: f64) {
    let x = t.iter_mut().find(|x| x.name == name).expect("tensor");
    match x.dtype {
        safetensors::tensor::Dtype::I64 => x.bytes[at * 8..at * 8 + 8].copy_from_slice(&(v as i64).to_le_bytes()),
        safetensors::tensor::Dtype::I32 => x.bytes[at * 4..at * 4 + 4].copy_from_slice(&(v as i32).to_le_bytes()),
        _ => x.bytes[at * 4..at * 4 + 4].copy_from_slice(&(v as f32).to_le_bytes()),
    }
}

/// The `run` contract of a draft-decode plan on the CPU: the inputs file through
/// `specplan_contract::decode` gives the naive forward's tree and K/V, and bad inputs are
/// refused naming the tensor, the index and the bound (before anything runs).
#[test]
fn run_contract_matches_naive_and_names_bad_inputs() {
    let mut rng = Rng(seed());
    let (topk, steps, n) = (4u32, 3u32, 8u32);
    let o = Overrides {
        topk: Some(topk),
        num_steps: Some(steps),
        num_draft_tokens: Some(n),
        draft_decode_steps: Some("auto".into()),
        ..Default::default()
    };
    let cfg = resolve(&Source::Preset("tiny".into()), &o).expect("config");
    let plan = compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan;
    let kind = plan.phase_by_label("draft_decode").expect("one draft-decode tier");
    let dir = tempfile::tempdir().expect("tempdir");
    let model = make_model(&plan, &mut rng, dir.path(), 8.0);
    let md = Net::eagle1(&model);
    let b = 3;
    let st = random_step(&plan, &md, &mut rng, b, steps as usize);
    let path = dir.path().join("inputs.safetensors");
    let weights = || load_weights(&plan, &dir.path().join("weights.safetensors")).expect("weights");
    write_inputs(&path, &plan, &md, &st, b, &|_| {});
    let mut x = specplan_contract::decode::load_decode_inputs(&plan, kind, &path).expect("inputs");
    let res = specplan_contract::decode::run_cpu_decode(&plan, weights(), &mut x).expect("run");
    let (k, nodes) = (topk as usize, n as usize - 1);
    let pw = (steps as usize - 1) * k + 1;
    for r in 0..b {
        let want = naive_request(&plan, &md, &st, r, steps as usize, nodes);
        if want.min_gap < 1e-4 {
            continue; // a near tie between the f32 executor and the f64 forward
        }
        assert_eq!(
            res.parent_list[r * pw..(r + 1) * pw],
            want.parents[..],
            "request {r}: parent_list"
        );
        assert_eq!(
            res.top_scores_index[r * nodes..(r + 1) * nodes],
            want.top[..],
            "request {r}"
        );
        assert_eq!(
            res.draft_tokens[r * nodes..(r + 1) * nodes],
            want.tokens[..],
            "request {r}"
        );
        for (l, at, kk, _) in &want.writes {
            let got = x.kv.k[*l][*at] as f64;
            assert!(
                (got - kk[0]).abs() <= 2e-2 * (1.0 + kk[0].abs()),
                "request {r} layer {l}: K at {at}"
            );
        }
    }
    let bytes = specplan_contract::decode::encode_decode_outputs(&plan, &res, &x).expect("encode");
    let out = safetensors::SafeTensors::deserialize(&bytes).expect("outputs file");
    assert_eq!(out.tensor(io::DRAFT_TOKENS).expect("draft_tokens").shape(), &[b, nodes]);
    assert_eq!(out.tensor(io::PARENT_LIST).expect("parent_list").shape(), &[b, pw]);

    // Bad inputs, each refused by name before anything runs.
    let ctx = plan.capture.max_context_len as f64;
    let vocab = plan.model.vocab as f64;
    type Edit<'a> = &'a dyn Fn(&mut Vec<Tensor>);
    let cases: [(&str, Edit, &str); 4] = [
        ("id", &|t| poke(t, io::TOPK_IDS, k + 2, vocab), "topk_ids [1][2]"),
        ("prob", &|t| poke(t, io::TOPK_PROBS, 1, 1.5), "topk_probs [0][1]"),
        ("prefix", &|t| poke(t, io::PREFIX_LENS, 0, ctx), "prefix_lens [0]"),
        (
            "alias",
            &|t| {
                // Request 1 names request 0's pages: its lanes would write request 0's slots.
                let x = t.iter_mut().find(|x| x.name == io::PAGE_TABLE).expect("table");
                let row = x.bytes.len() / b;
                let first = x.bytes[..row].to_vec();
                x.bytes[row..2 * row].copy_from_slice(&first);
            },
            // Whichever request the check meets first is named, with the request it races.
            "page_table writes",
        ),
    ];
    for (what, edit, want) in cases {
        write_inputs(&path, &plan, &md, &st, b, edit);
        let err = match specplan_contract::decode::load_decode_inputs(&plan, kind, &path) {
            Ok(_) => panic!("{what}: bad input accepted"),
            Err(e) => e.to_string(),
        };
        let (name, detail) = want.split_once(' ').unwrap_or((want, ""));
        assert!(err.contains(name) && err.contains(detail), "{what}: {err}");
    }
}
