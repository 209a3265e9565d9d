//! The `run` contract of a draft-decode phase (CPU): the inputs file holds the phase's
//! staged tensors by their signature names — `topk_probs [b, K]` f32, `topk_ids [b, K]` i64
//! (target ids), `hidden_states [b, H]`, `prefix_lens [b]` i32 — plus `page_table [b, P]`
//! i32 and the caller's `k_cache`/`v_cache`, as draft-extend's file has them; the outputs
//! file holds `parent_list`, `top_scores_index`, `draft_tokens` (i64) and the updated caches
//! (only the lanes' slots change). A plan with the verify inputs (`decode_verify`) also takes
//! `bonus_tokens [b]` i64 and writes `verify_tokens`, `verify_positions`, `retrieve_*` and
//! `tree_mask`. Every input is checked before anything runs, and a bad one is named with its
//! index and the bound it broke.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use specplan_format::{io, PhaseKind, ValidatedPlan};
use specplan_kernels::facts::{decode_reach, lane_offset};
use specplan_runtime::admission;
use specplan_runtime::cpu::{CpuExecutor, KvPool, WeightData};
use specplan_runtime::step::{input_error, InputError, PageTable};

use super::{floats, ints, kv_shape, load_kv, parse, read, to_bytes, ContractError};

/// A draft-decode step's inputs, checked.
pub struct DecodeInputs {
    pub kind: PhaseKind,
    pub b: usize,
    pub topk_probs: Vec<f32>,
    pub topk_ids: Vec<i64>,
    pub hidden_states: Vec<f32>,
    pub prefix_lens: Vec<i32>,
    pub page_table: Vec<i32>,
    pub page_cols: usize,
    /// The tree roots (plans with the verify inputs only).
    pub bonus_tokens: Option<Vec<i64>>,
    pub kv: KvPool,
    pub kv_dtype: Dtype,
}

/// Reads and checks a draft-decode inputs file for phase `kind`.
pub fn load_decode_inputs(plan: &ValidatedPlan, kind: PhaseKind, path: &Path) -> Result<DecodeInputs, ContractError> {
    let file = path.display().to_string();
    let bytes = read(path, super::inputs_cap(plan), "a step's inputs")?;
    let st = parse(&bytes, &file)?;
    let fail = |e: InputError| ContractError::input(&file, e);
    let k = plan.spec.topk as usize;
    let (ids, shape) = ints(&st, io::TOPK_IDS, Dtype::I64, None).map_err(fail)?;
    if shape.len() != 2 || shape[1] != k {
        return Err(fail(input_error(
            io::TOPK_IDS,
            String::new(),
            format!("has shape {shape:?}, expected [b, topk = {k}]"),
        )));
    }
    let b = shape[0];
    let max_b = plan
        .phase(kind)
        .and_then(|p| p.buckets.last())
        .map_or(0, |x| x.batch as usize);
    let max_b = max_b.min(plan.capture.max_requests as usize);
    if b == 0 || b > max_b {
        return Err(fail(input_error(
            io::TOPK_IDS,
            String::new(),
            format!("{b} requests: a step needs 1 to {max_b} (the phase's largest bucket)"),
        )));
    }
    let act = plan.capture.dtype;
    let probs = floats(&st, io::TOPK_PROBS, &[b, k], act).map_err(fail)?;
    let hidden = floats(&st, io::HIDDEN_STATES, &[b, plan.model.hidden as usize], act).map_err(fail)?;
    let (prefix, _) = ints(&st, io::PREFIX_LENS, Dtype::I32, Some(&[b])).map_err(fail)?;
    let (table, tshape) = ints(&st, io::PAGE_TABLE, Dtype::I32, None).map_err(fail)?;
    if tshape.len() != 2 || tshape[0] != b || tshape[1] == 0 {
        return Err(fail(input_error(
            io::PAGE_TABLE,
            String::new(),
            format!("has shape {tshape:?}, expected [{b}, P] with P > 0"),
        )));
    }
    let (ks, kv_dtype) = kv_shape(plan, &st).map_err(fail)?;
    let bonus_tokens = if plan.capture.decode_verify {
        let (v, _) = ints(&st, io::BONUS_TOKENS, Dtype::I64, Some(&[b])).map_err(fail)?;
        Some(v)
    } else {
        None
    };
    let x = DecodeInputs {
        kind,
        b,
        topk_probs: probs,
        topk_ids: ids,
        hidden_states: hidden,
        prefix_lens: prefix.iter().map(|&v| v as i32).collect(),
        page_table: table.iter().map(|&v| v as i32).collect(),
        page_cols: tshape[1],
        bonus_tokens,
        kv: KvPool {
            pages: 0,
            k: Vec::new(),
            v: Vec::new(),
        },
        kv_dtype,
    };
    // The cheap bounds before converting the (large) caches.
    x.check(plan, ks[1]).map_err(fail)?;
    Ok(DecodeInputs {
        kv: load_kv(&st, &ks, act).map_err(fail)?,
        ..x
    })
}

impl DecodeInputs {
    /// The token slot of position `pos` of request `i` (its row of the file's table).
    fn slot(&self, ps: usize, i: usize, pos: usize) -> u64 {
        let pg = self.page_table[i * self.page_cols + pos / ps];
        pg as u64 * ps as u64 + (pos % ps) as u64
    }

    /// The positions request `i`'s lanes write (forwards 0 .. S−2).
    fn writes(&self, plan: &ValidatedPlan, i: usize) -> Vec<usize> {
        let (k, s, ps) = (plan.spec.topk, self.kind.steps(), plan.capture.page_size);
        let l = self.prefix_lens[i] as usize;
        (0..k)
            .flat_map(|lane| {
                let base = l + lane_offset(l as u64, lane, s, k, ps) as usize;
                (0..s.saturating_sub(1) as usize).map(move |step| base + step)
            })
            .collect()
    }

    /// Every rule before a run: probabilities in [0, 1], ids in the vocabulary, prefixes
    /// whose lanes fit the context, rows long enough with pages in the pool, and no request
    /// reading or writing a slot another (or another of its own positions) writes.
    fn check(&self, plan: &ValidatedPlan, pool_pages: usize) -> Result<(), InputError> {
        let k = plan.spec.topk as usize;
        if let Some(j) = self.topk_probs.iter().position(|p| !(0.0..=1.0).contains(p)) {
            return Err(input_error(
                io::TOPK_PROBS,
                format!("[{}][{}]", j / k, j % k),
                format!("{} is not a probability (outside [0, 1])", self.topk_probs[j]),
            ));
        }
        let vocab = plan.model.vocab as i64;
        if let Some(j) = self.topk_ids.iter().position(|&t| t < 0 || t >= vocab) {
            return Err(input_error(
                io::TOPK_IDS,
                format!("[{}][{}]", j / k, j % k),
                format!("{} is outside [0, vocab_size = {vocab}) (target ids)", self.topk_ids[j]),
            ));
        }
        if let Some(bonus) = &self.bonus_tokens {
            if let Some(i) = bonus.iter().position(|&t| t < 0 || t >= vocab) {
                return Err(input_error(
                    io::BONUS_TOKENS,
                    format!("[{i}]"),
                    format!("{} is outside [0, vocab_size = {vocab}) (target ids)", bonus[i]),
                ));
            }
        }
        let (ps, steps) = (plan.capture.page_size, self.kind.steps());
        for i in 0..self.b {
            let l = self.prefix_lens[i];
            admission::check_prefix(plan, self.kind, i, l)?;
            let reach = decode_reach(l as u64, steps, plan.spec.topk, ps) as usize;
            let row = &self.page_table[i * self.page_cols..(i + 1) * self.page_cols];
            admission::check_row_len(i, l as usize, reach, ps as usize, row.len())?;
            let used = (l as usize + reach).div_ceil(ps as usize);
            admission::check_page_ids(io::PAGE_TABLE, i, &row[..used], pool_pages)?;
        }
        // Aliasing: O(Σ L + b·K·S) over the slots the step reads and writes.
        let ps = ps as usize;
        let mut written: HashMap<u64, (usize, usize)> = HashMap::new();
        for i in 0..self.b {
            for pos in self.writes(plan, i) {
                if let Some(&(j, p)) = written.get(&self.slot(ps, i, pos)) {
                    return Err(input_error(
                        io::PAGE_TABLE,
                        format!("[{i}][{}]", pos / ps),
                        format!(
                            "request {i} writes position {pos} to the cache slot request {j} writes at position {p} (their K/V would race)"
                        ),
                    ));
                }
                written.insert(self.slot(ps, i, pos), (i, pos));
            }
        }
        for i in 0..self.b {
            for pos in 0..self.prefix_lens[i] as usize {
                if let Some(&(j, p)) = written.get(&self.slot(ps, i, pos)) {
                    return Err(input_error(
                        io::PAGE_TABLE,
                        format!("[{i}][{}]", pos / ps),
                        format!(
                            "request {i} reads prefix position {pos} from the cache slot request {j} writes at position {p} in this step"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// What a draft-decode step returns (real requests only).
pub struct DecodeResult {
    pub parent_list: Vec<i64>,
    pub top_scores_index: Vec<i64>,
    pub draft_tokens: Vec<i64>,
    /// The verify inputs (plans with them): each output's name, its real requests' values
    /// and its shape.
    pub verify: Vec<(&'static str, Vec<i64>, Vec<usize>)>,
    pub bucket: u32,
}

/// Runs the step on the CPU executor: requests in slots 0..b of a table built from the
/// file's rows, padded requests (prefix 0, request 0's inputs) in the scratch slot.
pub fn run_cpu_decode(
    plan: &ValidatedPlan,
    weights: Vec<WeightData>,
    x: &mut DecodeInputs,
) -> Result<DecodeResult, ContractError> {
    let fail = |e: InputError| ContractError::input("inputs", e);
    let bucket = plan
        .phase(x.kind)
        .and_then(|p| p.bucket_for(x.b as u32))
        .ok_or_else(|| {
            fail(input_error(
                io::TOPK_IDS,
                String::new(),
                "no bucket holds the batch".into(),
            ))
        })?;
    let bb = bucket.batch as usize;
    let mut table = PageTable::new(plan, (x.kv.pages - 1) as i32);
    for i in 0..x.b {
        table
            .set_row(i, &x.page_table[i * x.page_cols..(i + 1) * x.page_cols])
            .map_err(fail)?;
    }
    let b = x.b;
    let pad = |v: &[f64], w: usize| -> Vec<f64> { (0..bb * w).map(|i| v[if i < b * w { i } else { i % w }]).collect() };
    let f = |v: &[f32]| v.iter().map(|&t| t as f64).collect::<Vec<_>>();
    let (k, h) = (plan.spec.topk as usize, plan.model.hidden as usize);
    let scratch = table.scratch_slot() as f64;
    let inputs = vec![
        (io::TOPK_PROBS, pad(&f(&x.topk_probs), k)),
        (
            io::TOPK_IDS,
            pad(&x.topk_ids.iter().map(|&t| t as f64).collect::<Vec<_>>(), k),
        ),
        (io::HIDDEN_STATES, pad(&f(&x.hidden_states), h)),
        (
            io::PREFIX_LENS,
            (0..bb)
                .map(|i| if i < b { x.prefix_lens[i] as f64 } else { 0.0 })
                .collect(),
        ),
        (
            io::REQ_SLOTS,
            (0..bb).map(|i| if i < b { i as f64 } else { scratch }).collect(),
        ),
    ];
    let mut inputs = inputs;
    if let Some(bonus) = &x.bonus_tokens {
        inputs.push((
            io::BONUS_TOKENS,
            (0..bb).map(|i| bonus[if i < b { i } else { 0 }] as f64).collect(),
        ));
    }
    let exec = CpuExecutor::new(plan, weights)?;
    let outs = exec.run_named(x.kind, bucket, &inputs, &table, &mut x.kv)?;
    let rows = |name: &str| -> Vec<i64> {
        let v = outs.iter().find(|(n, _)| n == name).map_or(&[][..], |(_, v)| &v[..]);
        v[..v.len() / bb * b].iter().map(|&t| t as i64).collect()
    };
    let n = x.kind.draft_tokens(&plan.spec) as usize;
    let verify = if x.bonus_tokens.is_some() {
        [
            (io::VERIFY_TOKENS, vec![b, n]),
            (io::VERIFY_POSITIONS, vec![b, n]),
            (io::RETRIEVE_INDEX, vec![b, n]),
            (io::RETRIEVE_NEXT_TOKEN, vec![b, n]),
            (io::RETRIEVE_NEXT_SIBLING, vec![b, n]),
            (io::TREE_MASK, vec![b, n, n]),
        ]
        .into_iter()
        .map(|(name, shape)| (name, rows(name), shape))
        .collect()
    } else {
        Vec::new()
    };
    Ok(DecodeResult {
        parent_list: rows(io::PARENT_LIST),
        top_scores_index: rows(io::TOP_SCORES_INDEX),
        draft_tokens: rows(io::DRAFT_TOKENS),
        verify,
        bucket: bucket.batch,
    })
}

/// The outputs file's bytes: the tree (i64) and the updated caches (the caller's pages, in
/// the caller's dtype).
pub fn encode_decode_outputs(
    plan: &ValidatedPlan,
    res: &DecodeResult,
    x: &DecodeInputs,
) -> Result<Vec<u8>, ContractError> {
    let werr = |e: String| ContractError::Write {
        path: "outputs".into(),
        message: e,
    };
    let m = &plan.model;
    let b = x.b;
    let pages = x.kv.pages - 1;
    let per_layer = pages * plan.capture.page_size as usize * m.kv_heads as usize * m.head_dim as usize;
    let cache = |layers: &[Vec<f32>]| -> Vec<f32> { layers.iter().flat_map(|l| l[..per_layer].to_vec()).collect() };
    let kv_shape = vec![
        m.layers as usize,
        pages,
        plan.capture.page_size as usize,
        m.kv_heads as usize,
        m.head_dim as usize,
    ];
    let i64s = |v: &[i64]| v.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>();
    let w = |v: &[i64]| v.len() / b.max(1);
    let tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = vec![
        (
            io::PARENT_LIST,
            Dtype::I64,
            vec![b, w(&res.parent_list)],
            i64s(&res.parent_list),
        ),
        (
            io::TOP_SCORES_INDEX,
            Dtype::I64,
            vec![b, w(&res.top_scores_index)],
            i64s(&res.top_scores_index),
        ),
        (
            io::DRAFT_TOKENS,
            Dtype::I64,
            vec![b, w(&res.draft_tokens)],
            i64s(&res.draft_tokens),
        ),
        (
            io::K_CACHE,
            x.kv_dtype,
            kv_shape.clone(),
            to_bytes(&cache(&x.kv.k), x.kv_dtype),
        ),
        (io::V_CACHE, x.kv_dtype, kv_shape, to_bytes(&cache(&x.kv.v), x.kv_dtype)),
    ];
    // The verify inputs as the plan emits them: i64, the mask i32.
    let verify: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = res
        .verify
        .iter()
        .map(|(name, v, shape)| {
            if *name == io::TREE_MASK {
                let b: Vec<u8> = v.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect();
                (*name, Dtype::I32, shape.clone(), b)
            } else {
                (*name, Dtype::I64, shape.clone(), i64s(v))
            }
        })
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .chain(verify.iter())
        .map(|(n, d, s, bytes)| {
            TensorView::new(*d, s.clone(), bytes)
                .map(|v| (n.to_string(), v))
                .map_err(|e| werr(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|e| werr(e.to_string()))
}

/// Runs the step on the GPU (owned memory: the file's pages in a pool of their own plus a
/// scratch page; graph replay unless `eager`), with the same files and semantics as
/// [`run_cpu_decode`]. Only the lanes' slots of the real requests are copied back into the
/// caller's cache, so every other slot keeps its exact original value.
pub fn run_gpu_decode(
    plan: &ValidatedPlan,
    weights: Vec<WeightData>,
    x: &mut DecodeInputs,
    eager: bool,
) -> Result<DecodeResult, ContractError> {
    use specplan_runtime::gpu::{GemmPolicy, GpuOptions, GpuRuntime};
    let fail = |e: InputError| ContractError::input("inputs", e);
    let bucket = plan
        .phase(x.kind)
        .and_then(|p| p.bucket_for(x.b as u32))
        .ok_or_else(|| {
            fail(input_error(
                io::TOPK_IDS,
                String::new(),
                "no bucket holds the batch".into(),
            ))
        })?
        .batch;
    let file_pages = x.kv.pages - 1;
    let opts = GpuOptions {
        kv_pool_pages: Some(file_pages as u32 + 1),
        build_graphs: !eager,
        // One step: cublasGemmEx's default choice serves it (as `run_gpu`).
        gemms: GemmPolicy::Heuristic,
        ..GpuOptions::default()
    };
    let mut rt = GpuRuntime::new(plan.clone(), &weights, opts)?;
    let act = plan.capture.dtype;
    let per = file_pages * plan.kv_page_bytes() as usize / 2;
    let bits = |layers: &[Vec<f32>]| -> Vec<u16> {
        layers
            .iter()
            .flat_map(|l| specplan_runtime::bits::to_act_bits(&l[..per], act))
            .collect()
    };
    rt.write_kv(&bits(&x.kv.k), &bits(&x.kv.v), file_pages)?;
    let (k, s, ps) = (plan.spec.topk, x.kind.steps(), plan.capture.page_size as usize);
    for i in 0..x.b {
        let l = x.prefix_lens[i] as u64;
        let used = (l as usize + decode_reach(l, s, k, ps as u32) as usize).div_ceil(ps);
        rt.set_pages(i, &x.page_table[i * x.page_cols..i * x.page_cols + used])?;
    }
    // The staged inputs padded to the bucket: padded rows repeat request 0's inputs at
    // prefix 0 in the scratch slot (their outputs are discarded).
    let (b, bb, ku, h) = (x.b, bucket as usize, k as usize, plan.model.hidden as usize);
    let pad = |i: usize, w: usize| if i < b * w { i } else { i % w };
    let probs: Vec<u8> = (0..bb * ku)
        .flat_map(|i| x.topk_probs[pad(i, ku)].to_le_bytes())
        .collect();
    let ids: Vec<u8> = (0..bb * ku)
        .flat_map(|i| x.topk_ids[pad(i, ku)].to_le_bytes())
        .collect();
    let hidden: Vec<f32> = (0..bb * h).map(|i| x.hidden_states[pad(i, h)]).collect();
    let hidden: Vec<u8> = specplan_runtime::bits::to_act_bits(&hidden, act)
        .iter()
        .flat_map(|u| u.to_le_bytes())
        .collect();
    let lens: Vec<u8> = (0..bb)
        .flat_map(|i| if i < b { x.prefix_lens[i] } else { 0 }.to_le_bytes())
        .collect();
    let scratch = plan.capture.max_requests as i32;
    let slots: Vec<u8> = (0..bb)
        .flat_map(|i| if i < b { i as i32 } else { scratch }.to_le_bytes())
        .collect();
    let mut staged = vec![
        (io::TOPK_PROBS, probs),
        (io::TOPK_IDS, ids),
        (io::HIDDEN_STATES, hidden),
        (io::PREFIX_LENS, lens),
        (io::REQ_SLOTS, slots),
    ];
    if let Some(bonus) = &x.bonus_tokens {
        staged.push((
            io::BONUS_TOKENS,
            (0..bb).flat_map(|i| bonus[pad(i, 1)].to_le_bytes()).collect(),
        ));
    }
    for (name, bytes) in &staged {
        rt.write_phase_buffer(x.kind, bucket, name, bytes)?;
    }
    rt.run_phase(x.kind, bucket, eager)?;
    let read_i64 = |rt: &GpuRuntime, name: &str| -> Result<Vec<i64>, ContractError> {
        let bytes = rt.read_phase_buffer(x.kind, bucket, name)?;
        let v: Vec<i64> = bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        Ok(v[..v.len() / bb * b].to_vec())
    };
    let n = x.kind.draft_tokens(&plan.spec) as usize;
    let mut verify = Vec::new();
    if x.bonus_tokens.is_some() {
        for name in [
            io::VERIFY_TOKENS,
            io::VERIFY_POSITIONS,
            io::RETRIEVE_INDEX,
            io::RETRIEVE_NEXT_TOKEN,
            io::RETRIEVE_NEXT_SIBLING,
        ] {
            verify.push((name, read_i64(&rt, name)?, vec![b, n]));
        }
        let bytes = rt.read_phase_buffer(x.kind, bucket, io::TREE_MASK)?;
        let m: Vec<i64> = bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64)
            .collect();
        verify.push((io::TREE_MASK, m[..m.len() / bb * b].to_vec(), vec![b, n, n]));
    }
    let res = DecodeResult {
        parent_list: read_i64(&rt, io::PARENT_LIST)?,
        top_scores_index: read_i64(&rt, io::TOP_SCORES_INDEX)?,
        draft_tokens: read_i64(&rt, io::DRAFT_TOKENS)?,
        verify,
        bucket,
    };
    // The lanes' slots back into the caller's cache.
    let (kb, vb) = rt.read_kv(file_pages)?;
    let to_f = |u: u16| specplan_runtime::bits::from_act_bits(u, act);
    let row = plan.model.kv_heads as usize * plan.model.head_dim as usize;
    for i in 0..b {
        for pos in x.writes(plan, i) {
            let at = x.slot(ps, i, pos) as usize * row;
            for layer in 0..plan.model.layers as usize {
                for t in at..at + row {
                    x.kv.k[layer][t] = to_f(kb[layer * per + t]);
                    x.kv.v[layer][t] = to_f(vb[layer * per + t]);
                }
            }
        }
    }
    Ok(res)
}
