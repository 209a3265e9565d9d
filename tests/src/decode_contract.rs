//! `gpucheck contract-decode`: the draft-decode phase's `specplan run` contract on the GPU
//! (owned memory, graph and eager) against the same files on the CPU: a draft-decode inputs
//! file of fresh random values (four requests, prefixes up to 100, pages dealt in random
//! order, the verify inputs' bonus tokens where the plan has them), graph and eager output
//! files equal byte for byte, the trees equal to the CPU's for at least `TREE_AGREEMENT` of
//! the requests (a near tie between bf16 and f32 may part one), the caches within the
//! relative bound.

use safetensors::Dtype;
use specplan_format::{io, PhaseKind};
use specplan_kernels::facts::decode_reach;
use specplan_runtime::bits::to_act_bits;

use crate::checks::REL_BOUND;
use crate::contract_files::{weight_tensors, write_safetensors, FileTensor};
use crate::decode_check::TREE_AGREEMENT;
use crate::tolerance::rel_rms;
use crate::Rng;

fn tensor(name: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> FileTensor {
    FileTensor {
        name: name.into(),
        dtype,
        shape,
        bytes,
    }
}

/// Writes `weights.safetensors` and a draft-decode `inputs.safetensors` for the plan's first
/// draft-decode tier into `dir`; returns the tier and the requests.
pub fn write_decode_files(
    plan: &specplan_format::ValidatedPlan,
    dir: &std::path::Path,
    seed: u64,
) -> Result<(PhaseKind, usize), String> {
    let kind = plan
        .phases
        .iter()
        .map(|p| p.kind)
        .find(|k| matches!(k, PhaseKind::DraftDecode { .. }))
        .ok_or("the plan has no draft-decode phase")?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    write_safetensors(&dir.join("weights.safetensors"), &weight_tensors(plan, seed)?)?;
    let mut rng = Rng(seed ^ 0xdec0);
    let (k, s, ps) = (plan.spec.topk, kind.steps(), plan.capture.page_size as usize);
    let (b, ku, h) = (4usize, k as usize, plan.model.hidden as usize);
    let prefix: Vec<usize> = (0..b).map(|_| rng.below(100)).collect();
    let need: Vec<usize> = prefix
        .iter()
        .map(|&l| (l + decode_reach(l as u64, s, k, ps as u32) as usize).div_ceil(ps))
        .collect();
    let cols = need.iter().copied().max().unwrap_or(1);
    let pages: usize = need.iter().sum();
    let perm = rng.permutation(pages);
    let mut table = vec![0i32; b * cols];
    let mut at = 0;
    for (i, &c) in need.iter().enumerate() {
        for j in 0..c {
            table[i * cols + j] = perm[at + j] as i32;
        }
        at += c;
    }
    let act = plan.capture.dtype;
    let (hkv, d, layers) = (
        plan.model.kv_heads as usize,
        plan.model.head_dim as usize,
        plan.model.layers as usize,
    );
    let kv_n = layers * pages * ps * hkv * d;
    let bits = |rng: &mut Rng, n: usize| -> Vec<u8> {
        let v: Vec<f32> = (0..n).map(|_| rng.uniform()).collect();
        to_act_bits(&v, act).iter().flat_map(|u| u.to_le_bytes()).collect()
    };
    let adt = if act == specplan_format::DType::F16 {
        Dtype::F16
    } else {
        Dtype::BF16
    };
    let (probs, ids) = crate::random::random_topk(&mut rng, b, ku, plan.model.vocab as usize);
    let kv_shape = vec![layers, pages, ps, hkv, d];
    let mut t = vec![
        tensor(
            io::TOPK_PROBS,
            Dtype::F32,
            vec![b, ku],
            probs.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        tensor(
            io::TOPK_IDS,
            Dtype::I64,
            vec![b, ku],
            ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        tensor(io::HIDDEN_STATES, adt, vec![b, h], bits(&mut rng, b * h)),
        tensor(
            io::PREFIX_LENS,
            Dtype::I32,
            vec![b],
            prefix.iter().flat_map(|&l| (l as i32).to_le_bytes()).collect(),
        ),
        tensor(
            io::PAGE_TABLE,
            Dtype::I32,
            vec![b, cols],
            table.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ),
        tensor(io::K_CACHE, adt, kv_shape.clone(), bits(&mut rng, kv_n)),
        tensor(io::V_CACHE, adt, kv_shape, bits(&mut rng, kv_n)),
    ];
    if plan.capture.decode_verify {
        let bonus: Vec<u8> = (0..b)
            .flat_map(|_| (rng.below(plan.model.vocab as usize) as i64).to_le_bytes())
            .collect();
        t.push(tensor(io::BONUS_TOKENS, Dtype::I64, vec![b], bonus));
    }
    write_safetensors(&dir.join("inputs.safetensors"), &t)?;
    Ok((kind, b))
}

pub fn decode_contract_check(plan_path: &str, specplan: &str, dir: &str, seed: u64) -> Result<String, String> {
    let plan = specplan_format::load_file(std::path::Path::new(plan_path)).map_err(|e| e.to_string())?;
    let dir = std::path::Path::new(dir);
    let (kind, b) = write_decode_files(&plan, dir, seed)?;
    let (k, s) = (plan.spec.topk, kind.steps());
    let ku = k as usize;
    let label = kind.label();
    let outs = crate::checks::run_cpu_graph_eager(specplan, &["--plan", plan_path, "--phase", &label], dir)?;
    if outs[1] != outs[2] {
        return Err("graph and eager output files differ".into());
    }
    let read = |bytes: &[u8], name: &str| -> Result<(Dtype, Vec<u8>), String> {
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
        Ok((t.dtype(), t.data().to_vec()))
    };
    let (pw, nodes) = ((s as usize - 1) * ku + 1, kind.draft_tokens(&plan.spec) as usize - 1);
    let mut equal = 0;
    let trees: Vec<(Vec<u8>, Vec<u8>)> = [io::PARENT_LIST, io::TOP_SCORES_INDEX, io::DRAFT_TOKENS]
        .iter()
        .map(|n| Ok((read(&outs[1], n)?.1, read(&outs[0], n)?.1)))
        .collect::<Result<_, String>>()?;
    for r in 0..b {
        let same = trees.iter().zip([pw, nodes, nodes]).all(|((g, c), w)| {
            let (lo, hi) = (r * w * 8, (r + 1) * w * 8);
            g.get(lo..hi) == c.get(lo..hi)
        });
        equal += same as usize;
    }
    if (equal as f64) < TREE_AGREEMENT * b as f64 {
        return Err(format!("trees equal to the CPU's in only {equal}/{b} requests"));
    }
    let mut report = vec![format!("{label}: trees equal {equal}/{b}")];
    for name in [io::K_CACHE, io::V_CACHE] {
        let f = |(dt, v): (Dtype, Vec<u8>)| -> Vec<f64> {
            v.chunks_exact(2)
                .map(|c| {
                    let u = u16::from_le_bytes([c[0], c[1]]);
                    if dt == Dtype::F16 {
                        half::f16::from_bits(u).to_f64()
                    } else {
                        half::bf16::from_bits(u).to_f64()
                    }
                })
                .collect()
        };
        let e = rel_rms(&f(read(&outs[1], name)?), &f(read(&outs[0], name)?));
        report.push(format!("{name} rel {e:.2e}"));
        if e > REL_BOUND {
            return Err(format!("{name}: cuda vs cpu relative error {e:.3e}"));
        }
    }
    Ok(report.join(", "))
}
