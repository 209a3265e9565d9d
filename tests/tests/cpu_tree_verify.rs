//! The draft-decode phase's verify inputs (`draft_decode_outputs = "tree,verify"`) on the
//! CPU executor, against a naive port written here of what SGLang 0.5.23 builds from the
//! tree for the target's verify (`build_tree_kernel_efficient` → the JIT kernel
//! `build_tree_efficient`, kernels/jit/include/sgl_kernel/speculative/eagle.cuh:35-124; its
//! QLEN_ONLY mask; `/work/engines/draft-decode-report.md` §3.2): the port reproduces the
//! release's worked example (§5, N = 4 and N = 6) exactly, and the executor's verify tensors
//! equal the port applied to the executor's own tree on fresh random inputs (the seed is
//! printed), trees and chains, pages 1 and 4, padded batches.

use specplan_compiler::config::{resolve, Overrides, Source};
use specplan_compiler::{compile, Target};
use specplan_format::{io, PhaseKind, ValidatedPlan};
use specplan_kernels::facts::decode_reach;
use specplan_runtime::bits::round_act;
use specplan_runtime::cpu::{CpuExecutor, KvPool};
use specplan_runtime::step::PageTable;
use specplan_tests::random::random_weights;
use specplan_tests::{seed, Rng};

/// What `build_tree_efficient` writes for one request (the kernel's per-thread rules; its
/// thread 0's list walk for the retrieve links).
#[derive(Debug, PartialEq)]
struct Verify {
    tokens: Vec<i64>,
    positions: Vec<i64>,
    retrieve_index: Vec<i64>,
    next_token: Vec<i64>,
    next_sibling: Vec<i64>,
    mask: Vec<Vec<i32>>,
}

/// The release's rules, request `r` of a batch (node 0 the bonus root, node j the score index
/// `sel[j − 1]`): a node's parent is the root when its index / K is 0, else the node whose
/// score index is `parent_list[index / K]`.
fn naive(r: usize, k: usize, parents: &[i64], sel: &[i64], draft: &[i64], bonus: i64, l: i64) -> Verify {
    let n = sel.len() + 1;
    let parent = |j: usize| -> usize {
        let tb = (sel[j - 1] / k as i64) as usize;
        if tb == 0 {
            return 0;
        }
        let target = parents[tb];
        1 + sel
            .iter()
            .position(|&s| s == target)
            .expect("every chosen node's parent is chosen")
    };
    let mut v = Verify {
        tokens: std::iter::once(bonus).chain(draft.iter().copied()).collect(),
        positions: vec![l; n],
        retrieve_index: (0..n).map(|j| (r * n + j) as i64).collect(),
        next_token: vec![-1; n],
        next_sibling: vec![-1; n],
        mask: vec![vec![0; n]; n],
    };
    for j in 0..n {
        v.mask[j][0] = 1;
        let mut a = j;
        while a != 0 {
            v.mask[j][a] = 1;
            v.positions[j] += 1;
            a = parent(a);
        }
    }
    // Thread 0: i = N−1 … 1 goes in front of its parent's child list.
    for i in (1..n).rev() {
        let p = parent(i);
        if v.next_token[p] != -1 {
            v.next_sibling[i] = v.next_token[p];
        }
        v.next_token[p] = i as i64;
    }
    v
}

#[test]
fn the_port_reproduces_the_releases_worked_example() {
    // Report §5: K 2, S 3, L 10, bonus 77; parent_list [−1, 0, 1, 4, 2].
    let parents = [-1, 0, 1, 4, 2];
    let v = naive(0, 2, &parents, &[0, 1, 4], &[503, 808, 202], 77, 10);
    assert_eq!(v.tokens, [77, 503, 808, 202]);
    assert_eq!(v.positions, [10, 11, 11, 12]);
    assert_eq!(v.retrieve_index, [0, 1, 2, 3]);
    assert_eq!(v.next_token, [1, -1, 3, -1]);
    assert_eq!(v.next_sibling, [-1, 2, -1, -1]);
    assert_eq!(v.mask, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]);
    // N = 6 on the same lists: top-5 sorted [0, 1, 2, 4, 6].
    let v = naive(0, 2, &parents, &[0, 1, 2, 4, 6], &[503, 808, 101, 202, 505], 77, 10);
    assert_eq!(v.positions, [10, 11, 11, 12, 12, 13]);
    assert_eq!(v.next_token, [1, 3, 4, -1, 5, -1]);
    assert_eq!(v.next_sibling, [-1, 2, -1, -1, -1, -1]);
    assert_eq!(v.mask[5], [1, 0, 1, 0, 1, 1]);
}

fn plan(topk: u32, steps: u32, n: u32, page_size: u32) -> ValidatedPlan {
    let o = Overrides {
        topk: Some(topk),
        num_steps: Some(steps),
        num_draft_tokens: Some(n),
        page_size: Some(page_size),
        draft_decode_steps: Some(steps.to_string()),
        draft_decode_outputs: Some("tree,verify".into()),
        buckets: Some("1,4".into()),
        max_context_len: Some(256),
        ..Default::default()
    };
    let cfg = resolve(&Source::Preset("tiny".into()), &o).expect("config");
    compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan
}

#[test]
fn the_executors_verify_inputs_are_the_releases_for_its_tree() {
    let s = seed();
    println!("seed {s:#x}");
    let mut rng = Rng(s);
    for (topk, steps, n, ps, b) in [
        (4u32, 3u32, 8u32, 4u32, 3usize),
        (2, 5, 6, 1, 4),
        (1, 3, 4, 1, 1),
        (4, 3, 8, 1, 2),
    ] {
        let plan = plan(topk, steps, n, ps);
        let kind = PhaseKind::DraftDecode { steps };
        let phase = plan.phase(kind).expect("phase");
        let bucket = phase.bucket_for(b as u32).expect("bucket");
        let bb = bucket.batch as usize;
        let (k, h, p) = (topk as usize, plan.model.hidden as usize, ps as usize);
        let act = plan.capture.dtype;
        // Prefixes, whole pages per request for the lanes' reach, K/V random.
        let prefix: Vec<usize> = (0..b).map(|_| rng.below(40)).collect();
        let need: Vec<usize> = prefix
            .iter()
            .map(|&l| (l + decode_reach(l as u64, steps, topk, ps) as usize).div_ceil(p))
            .collect();
        let used: usize = need.iter().sum();
        let perm = rng.permutation(used);
        let per_layer = (used + 1) * p * (plan.model.kv_heads * plan.model.head_dim) as usize;
        let layer = |rng: &mut Rng| {
            (0..per_layer)
                .map(|_| round_act(rng.uniform(), act))
                .collect::<Vec<f32>>()
        };
        let mut pool = KvPool {
            pages: used + 1,
            k: (0..plan.model.layers).map(|_| layer(&mut rng)).collect(),
            v: (0..plan.model.layers).map(|_| layer(&mut rng)).collect(),
        };
        let mut table = PageTable::new(&plan, used as i32);
        let mut at = 0;
        for (i, &c) in need.iter().enumerate() {
            let pages: Vec<i32> = perm[at..at + c].iter().map(|&x| x as i32).collect();
            at += c;
            table.set_row(i, &pages).expect("row");
        }
        let mut probs = Vec::new();
        let mut ids = Vec::new();
        for _ in 0..bb {
            let mut pr: Vec<f64> = (0..k).map(|_| 0.05 + 0.45 * (rng.uniform() as f64 + 1.0)).collect();
            pr.sort_by(|a, b| b.total_cmp(a));
            probs.extend(pr);
            ids.extend(
                rng.permutation(plan.model.vocab as usize)[..k]
                    .iter()
                    .map(|&x| x as f64),
            );
        }
        let bonus: Vec<f64> = (0..bb).map(|_| rng.below(plan.model.vocab as usize) as f64).collect();
        let scratch = table.scratch_slot() as f64;
        let inputs: Vec<(&str, Vec<f64>)> = vec![
            (io::TOPK_PROBS, probs),
            (io::TOPK_IDS, ids),
            (
                io::HIDDEN_STATES,
                (0..bb * h).map(|_| round_act(rng.uniform(), act) as f64).collect(),
            ),
            (
                io::PREFIX_LENS,
                (0..bb).map(|i| if i < b { prefix[i] as f64 } else { 0.0 }).collect(),
            ),
            (
                io::REQ_SLOTS,
                (0..bb).map(|i| if i < b { i as f64 } else { scratch }).collect(),
            ),
            (io::BONUS_TOKENS, bonus.clone()),
        ];
        let w = random_weights(&plan, &mut rng);
        let exec = CpuExecutor::borrowing(&plan, &w).expect("executor");
        let outs = exec.run_named(kind, bucket, &inputs, &table, &mut pool).expect("runs");
        let get = |name: &str| -> Vec<i64> {
            outs.iter()
                .find(|(x, _)| x == name)
                .unwrap_or_else(|| panic!("no {name} output"))
                .1
                .iter()
                .map(|&x| x as i64)
                .collect()
        };
        let (pl, top, dt) = (get(io::PARENT_LIST), get(io::TOP_SCORES_INDEX), get(io::DRAFT_TOKENS));
        let pw = pl.len() / bb;
        let nodes = n as usize - 1;
        let un = n as usize;
        let (vt, vp, ri, nt, ns, mask) = (
            get(io::VERIFY_TOKENS),
            get(io::VERIFY_POSITIONS),
            get(io::RETRIEVE_INDEX),
            get(io::RETRIEVE_NEXT_TOKEN),
            get(io::RETRIEVE_NEXT_SIBLING),
            get(io::TREE_MASK),
        );
        for r in 0..b {
            let tag = format!("topk {topk} steps {steps} N {n} page {ps} request {r}");
            let want = naive(
                r,
                k,
                &pl[r * pw..(r + 1) * pw],
                &top[r * nodes..(r + 1) * nodes],
                &dt[r * nodes..(r + 1) * nodes],
                bonus[r] as i64,
                prefix[r] as i64,
            );
            let got = Verify {
                tokens: vt[r * un..(r + 1) * un].to_vec(),
                positions: vp[r * un..(r + 1) * un].to_vec(),
                retrieve_index: ri[r * un..(r + 1) * un].to_vec(),
                next_token: nt[r * un..(r + 1) * un].to_vec(),
                next_sibling: ns[r * un..(r + 1) * un].to_vec(),
                mask: (0..un)
                    .map(|j| {
                        mask[(r * un + j) * un..(r * un + j + 1) * un]
                            .iter()
                            .map(|&x| x as i32)
                            .collect()
                    })
                    .collect(),
            };
            assert_eq!(got, want, "{tag}");
            if topk == 1 {
                // The chain: SGLang's build_chain_tree gives the same (lower-triangular mask).
                assert_eq!(
                    got.positions,
                    (0..un as i64).map(|c| prefix[r] as i64 + c).collect::<Vec<_>>(),
                    "{tag}"
                );
                assert!(got
                    .mask
                    .iter()
                    .enumerate()
                    .all(|(j, row)| row.iter().enumerate().all(|(c, &x)| x == (c <= j) as i32)));
            }
        }
    }
}

mod naive;

/// The run contract of a verify plan: `bonus_tokens` read (and refused when missing or
/// outside the vocabulary, by name), the verify tensors written to the outputs file in the
/// plan's dtypes, equal to the port applied to the file's tree.
#[test]
fn the_run_contract_takes_bonus_tokens_and_writes_the_verify_inputs() {
    use naive::{bf16_tensor, i32_tensor, i64_tensor, save, Tensor};
    let mut rng = Rng(seed() ^ 0xb0b);
    let (topk, steps, n, ps) = (4u32, 3u32, 8u32, 4u32);
    let plan = plan(topk, steps, n, ps);
    let kind = PhaseKind::DraftDecode { steps };
    let (b, k, h) = (3usize, topk as usize, plan.model.hidden as usize);
    let p = ps as usize;
    let prefix: Vec<usize> = (0..b).map(|_| rng.below(30)).collect();
    let cols = (0..b)
        .map(|i| (prefix[i] + decode_reach(prefix[i] as u64, steps, topk, ps) as usize).div_ceil(p))
        .max()
        .unwrap_or(1);
    let pages = b * cols;
    let perm = rng.permutation(pages);
    let table: Vec<i32> = perm.iter().map(|&x| x as i32).collect();
    let (hkv, d, layers) = (
        plan.model.kv_heads as usize,
        plan.model.head_dim as usize,
        plan.model.layers as usize,
    );
    let kv: Vec<f32> = (0..layers * pages * p * hkv * d).map(|_| rng.uniform()).collect();
    let mut probs: Vec<f32> = Vec::new();
    let mut ids: Vec<i64> = Vec::new();
    for _ in 0..b {
        let mut pr: Vec<f32> = (0..k).map(|_| 0.05 + 0.4 * (rng.uniform() + 1.0)).collect();
        pr.sort_by(|a, b| b.total_cmp(a));
        probs.extend(pr);
        ids.extend(
            rng.permutation(plan.model.vocab as usize)[..k]
                .iter()
                .map(|&x| x as i64),
        );
    }
    let bonus: Vec<i64> = (0..b).map(|_| rng.below(plan.model.vocab as usize) as i64).collect();
    let hidden: Vec<f32> = (0..b * h).map(|_| rng.uniform()).collect();
    let files = |bonus: Option<&[i64]>| -> Vec<Tensor> {
        let mut t = vec![
            Tensor {
                name: io::TOPK_PROBS.into(),
                dtype: safetensors::tensor::Dtype::F32,
                shape: vec![b, k],
                bytes: probs.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
            i64_tensor(io::TOPK_IDS, vec![b, k], &ids),
            bf16_tensor(io::HIDDEN_STATES, vec![b, h], &hidden),
            i32_tensor(
                io::PREFIX_LENS,
                vec![b],
                &prefix.iter().map(|&l| l as i32).collect::<Vec<_>>(),
            ),
            i32_tensor(io::PAGE_TABLE, vec![b, cols], &table),
            bf16_tensor(io::K_CACHE, vec![layers, pages, p, hkv, d], &kv),
            bf16_tensor(io::V_CACHE, vec![layers, pages, p, hkv, d], &kv),
        ];
        if let Some(x) = bonus {
            t.push(i64_tensor(io::BONUS_TOKENS, vec![b], x));
        }
        t
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("inputs.safetensors");
    save(&path, &files(Some(&bonus)));
    let mut x = specplan_contract::decode::load_decode_inputs(&plan, kind, &path).expect("inputs");
    let w = random_weights(&plan, &mut rng);
    let res = specplan_contract::decode::run_cpu_decode(&plan, w, &mut x).expect("run");
    let (pw, nodes, un) = ((steps as usize - 1) * k + 1, n as usize - 1, n as usize);
    let get = |name: &str| res.verify.iter().find(|v| v.0 == name).expect(name);
    for r in 0..b {
        let want = naive(
            r,
            k,
            &res.parent_list[r * pw..(r + 1) * pw],
            &res.top_scores_index[r * nodes..(r + 1) * nodes],
            &res.draft_tokens[r * nodes..(r + 1) * nodes],
            bonus[r],
            prefix[r] as i64,
        );
        assert_eq!(get(io::VERIFY_TOKENS).1[r * un..(r + 1) * un], want.tokens[..]);
        assert_eq!(get(io::VERIFY_POSITIONS).1[r * un..(r + 1) * un], want.positions[..]);
        assert_eq!(
            get(io::RETRIEVE_NEXT_TOKEN).1[r * un..(r + 1) * un],
            want.next_token[..]
        );
        let mask: Vec<i32> = want.mask.iter().flatten().copied().collect();
        let got: Vec<i32> = get(io::TREE_MASK).1[r * un * un..(r + 1) * un * un]
            .iter()
            .map(|&v| v as i32)
            .collect();
        assert_eq!(got, mask, "request {r}: tree_mask");
    }
    let bytes = specplan_contract::decode::encode_decode_outputs(&plan, &res, &x).expect("encode");
    let out = safetensors::SafeTensors::deserialize(&bytes).expect("outputs file");
    let m = out.tensor(io::TREE_MASK).expect("tree_mask");
    assert_eq!(
        (m.dtype(), m.shape()),
        (safetensors::tensor::Dtype::I32, &[b, un, un][..])
    );
    let t = out.tensor(io::VERIFY_TOKENS).expect("verify_tokens");
    assert_eq!((t.dtype(), t.shape()), (safetensors::tensor::Dtype::I64, &[b, un][..]));

    // A missing bonus_tokens, and one outside the vocabulary, are refused by name.
    save(&path, &files(None));
    let e = specplan_contract::decode::load_decode_inputs(&plan, kind, &path)
        .err()
        .expect("missing bonus");
    assert!(e.to_string().contains(io::BONUS_TOKENS), "{e}");
    let mut bad = bonus.clone();
    bad[1] = plan.model.vocab as i64;
    save(&path, &files(Some(&bad)));
    let e = specplan_contract::decode::load_decode_inputs(&plan, kind, &path)
        .err()
        .expect("bad bonus");
    assert!(
        e.to_string().contains("bonus_tokens[1]") && e.to_string().contains("outside"),
        "{e}"
    );
}

/// The files `gpucheck contract-decode` writes (tests/src/decode_contract.rs) satisfy the run
/// contract on the CPU: loaded, checked and run, the verify tensors among the outputs.
#[test]
fn the_gpu_contract_checks_files_run_on_the_cpu() {
    let plan = plan(4, 3, 8, 4);
    let dir = tempfile::tempdir().expect("tempdir");
    let files = specplan_tests::decode_contract::write_decode_files(&plan, dir.path(), seed()).expect("files");
    let (kind, b) = (files.kind, files.requests);
    let w = specplan_contract::load_weights(&plan, &dir.path().join("weights.safetensors")).expect("weights");
    let mut x = specplan_contract::decode::load_decode_inputs(&plan, kind, &dir.path().join("inputs.safetensors"))
        .expect("inputs");
    let res = specplan_contract::decode::run_cpu_decode(&plan, w, &mut x).expect("runs");
    assert_eq!(res.draft_tokens.len(), b * 7);
    assert_eq!(res.verify.len(), 6, "the verify inputs");
}
