//! The `run` contract: weights, inputs and outputs as safetensors files.
//!
//! Everything is checked before any work — name, dtype, shape, value bounds — and a
//! violation names the tensor, the index and the bound. Beyond what the step API checks
//! ([`StepInputs::check`]), the contract checks what only files carry:
//! - every float value (weights, hidden states, K/V caches) is finite *after* rounding to
//!   the plan's activation type, which is what the device holds (an f32 70000 is finite,
//!   but infinite in fp16);
//! - `k_cache` and `v_cache` are both in the plan's activation type (they are written
//!   back in it), with equal shapes;
//! - the FR-Spec id map and an unexpected `fc.bias`.
//!
//! Outputs are written only after the whole step succeeded, by the rules of [`output`]
//! (atomic for files; never replacing a device, FIFO, link, read-only file or an input).

pub mod decode;
mod finite;
pub mod output;

use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use specplan_format::PhaseKind;
use specplan_format::{io, DType, Packing, ValidatedPlan};
use specplan_runtime::cpu::{BucketOutputs, CpuExecutor, KvPool, WeightData};
use specplan_runtime::step::{first_non_finite, input_error, pad_to_bucket, InputError, PageTable, StepInputs};

#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    #[error("cannot read {path}: {message}")]
    Io { path: String, message: String },
    #[error("{file}: not a safetensors file: {message}")]
    Format { file: String, message: String },
    // The input error is part of this message, not a `source`: a chain printer would
    // print it twice.
    #[error("{file}: {error}")]
    Input { file: String, error: InputError },
    #[error(transparent)]
    Exec(#[from] specplan_runtime::cpu::ExecError),
    #[error(transparent)]
    Gpu(#[from] specplan_runtime::gpu::GpuError),
    #[error("cannot write {path}: {message}")]
    Write { path: String, message: String },
    /// The step ran, but a request's outputs are not finite: nothing is written.
    #[error("{tensor}[{request}]: {message}; no outputs were written (inputs, K/V or weights near the activation type's range overflow in the forward)")]
    NonFinite {
        tensor: String,
        request: usize,
        message: String,
    },
}

impl ContractError {
    fn input(file: &str, e: InputError) -> Self {
        ContractError::Input {
            file: file.into(),
            error: e,
        }
    }
}

fn read(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>, ContractError> {
    specplan_format::read_capped(path, limit, what).map_err(|e| ContractError::Io {
        path: path.display().to_string(),
        message: match e {
            specplan_format::ReadError::Io { message, .. } => message,
            e @ specplan_format::ReadError::TooLarge { .. } => e
                .to_string()
                .trim_start_matches(&format!("cannot read {}: ", path.display()))
                .to_string(),
        },
    })
}

/// Room in a safetensors file beyond its tensors' bytes: the JSON header (names, shapes,
/// offsets) and tensors the plan does not read.
const FILE_SLACK: u64 = 64 << 20;

/// The largest weights file the plan can need: every plan weight's sources at 4 bytes per
/// element (f32, the widest float the contract takes; FR-Spec's full lm_head for its hot
/// rows; EAGLE-3's d2t and t2d), twice over for tensors the plan ignores, plus the header.
pub fn weights_cap(plan: &ValidatedPlan) -> u64 {
    let m = &plan.model;
    let elems: u64 = plan
        .weights
        .iter()
        .map(|w| match w.packing {
            Packing::GatherRows => m.vocab as u64 * w.shape.iter().skip(1).product::<u64>() + w.shape[0],
            _ => w.shape.iter().product::<u64>(),
        })
        .sum();
    (elems + m.vocab as u64).saturating_mul(8).saturating_add(FILE_SLACK)
}

/// The largest inputs file a step of the plan can need: the largest bucket's ids, hidden
/// states (f32), lengths and page-table rows, and K/V caches of the plan's whole pool (f32),
/// plus the header.
pub fn inputs_cap(plan: &ValidatedPlan) -> u64 {
    let b = plan.buckets().last().map_or(0, |x| x.batch) as u64;
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as u64;
    let step =
        b * n * (8 + plan.model.hidden_in() as u64 * 4) + b * (16 + plan.capture.max_pages_per_request as u64 * 4);
    let kv = 2 * plan.kv_pool_bytes() * 2;
    step.saturating_add(kv).saturating_add(FILE_SLACK)
}

fn parse<'a>(bytes: &'a [u8], file: &str) -> Result<SafeTensors<'a>, ContractError> {
    SafeTensors::deserialize(bytes).map_err(|e| ContractError::Format {
        file: file.into(),
        message: e.to_string(),
    })
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}").to_lowercase()
}

/// The safetensors dtype of a plan activation type.
fn file_dtype(act: DType) -> Dtype {
    match act {
        DType::F16 => Dtype::F16,
        _ => Dtype::BF16,
    }
}

/// `[i][j]..` of a flat index into `shape`.
fn index_of(mut flat: usize, shape: &[usize]) -> String {
    let mut parts = vec![0; shape.len()];
    for (p, &d) in parts.iter_mut().zip(shape).rev() {
        *p = flat % d.max(1);
        flat /= d.max(1);
    }
    parts.iter().map(|p| format!("[{p}]")).collect()
}

/// A float tensor as f32 (bf16, f16 or f32 in the file), checked against `shape` and for
/// finite values in the plan's activation type `act` (the first bad index is named).
fn floats(st: &SafeTensors, name: &str, shape: &[usize], act: DType) -> Result<Vec<f32>, InputError> {
    let t = st
        .tensor(name)
        .map_err(|_| input_error(name, String::new(), "missing".into()))?;
    if t.shape() != shape {
        return Err(input_error(
            name,
            String::new(),
            format!("has shape {:?}, expected {shape:?}", t.shape()),
        ));
    }
    let d = t.data();
    let v: Vec<f32> = match t.dtype() {
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        other => {
            return Err(input_error(
                name,
                String::new(),
                format!("has dtype {}, expected bf16, f16 or f32", dtype_name(other)),
            ))
        }
    };
    match first_non_finite(&v, act) {
        Some((i, message)) => Err(input_error(name, index_of(i, shape), message)),
        None => Ok(v),
    }
}

fn ints(
    st: &SafeTensors,
    name: &str,
    want: Dtype,
    shape: Option<&[usize]>,
) -> Result<(Vec<i64>, Vec<usize>), InputError> {
    let t = st
        .tensor(name)
        .map_err(|_| input_error(name, String::new(), "missing".into()))?;
    if let Some(s) = shape {
        if t.shape() != s {
            return Err(input_error(
                name,
                String::new(),
                format!("has shape {:?}, expected {s:?}", t.shape()),
            ));
        }
    }
    let d = t.data();
    let v = match (t.dtype(), want) {
        (Dtype::I64, Dtype::I64) => d
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect(),
        (Dtype::I32, Dtype::I32) => d
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        (got, _) => {
            return Err(input_error(
                name,
                String::new(),
                format!("has dtype {}, expected {}", dtype_name(got), dtype_name(want)),
            ))
        }
    };
    Ok((v, t.shape().to_vec()))
}

/// Reads the weights file and packs every plan weight (concatenations, FR-Spec gather).
pub fn load_weights(plan: &ValidatedPlan, path: &Path) -> Result<Vec<WeightData>, ContractError> {
    let file = path.display().to_string();
    let bytes = read(path, weights_cap(plan), "the plan's weights")?;
    let st = parse(&bytes, &file)?;
    let m = &plan.model;
    let (h, v) = (m.hidden as usize, m.vocab as usize);
    let act = plan.capture.dtype;
    let fail = |e: InputError| ContractError::input(&file, e);
    // A bias the plan does not expect would be silently dropped: refuse it.
    if !m.fc_bias && st.tensor("fc.bias").is_ok() {
        return Err(fail(input_error(
            "fc.bias",
            String::new(),
            "present, but the plan was compiled without an fc bias (bias = false)".into(),
        )));
    }
    let mut out = Vec::with_capacity(plan.weights.len());
    for w in &plan.weights {
        let rows_of = |name: &str| -> usize {
            let hd = m.head_dim as usize;
            if name.ends_with("q_proj.weight") {
                m.heads as usize * hd
            } else if name.ends_with("k_proj.weight") || name.ends_with("v_proj.weight") {
                m.kv_heads as usize * hd
            } else if name.ends_with("gate_proj.weight") || name.ends_with("up_proj.weight") {
                m.intermediate as usize
            } else {
                w.shape[0] as usize
            }
        };
        let cols: usize = w.shape.iter().skip(1).product::<u64>() as usize;
        // The plan's dtype decides how a weight is read, never its name: an id map is an
        // i64 weight the plan declares as such (and a float tensor under an id map's name
        // is refused by `ints`), every other weight a float of the activation type.
        let bad = |msg: String| ContractError::input(&file, input_error(&w.name, String::new(), msg));
        match (w.dtype, &w.packing) {
            (DType::I64, Packing::Single) if w.name == "d2t" || w.name == "hot_token_ids" => {}
            (DType::I64, _) => {
                return Err(bad(
                    "an i64 weight the run contract does not know (only d2t and hot_token_ids are id maps)".into(),
                ))
            }
            (dt, _) if dt == act => {}
            (dt, _) => {
                return Err(bad(format!(
                    "the plan declares it {}, not its activation type {}",
                    dt.name(),
                    act.name()
                )))
            }
        }
        let data = match w.packing {
            Packing::Single if w.dtype == DType::I64 && w.name == "hot_token_ids" => {
                let (ids, _) = ints(&st, "hot_token_ids", Dtype::I64, Some(&[w.shape[0] as usize])).map_err(fail)?;
                check_hot_ids(&ids, v).map_err(fail)?;
                WeightData::I64(ids)
            }
            Packing::Single if w.dtype == DType::I64 => {
                let (d2t, _) = ints(&st, "d2t", Dtype::I64, Some(&[w.shape[0] as usize])).map_err(fail)?;
                check_d2t(&d2t, v).map_err(fail)?;
                WeightData::I64(d2t)
            }
            Packing::Single => {
                let shape: Vec<usize> = w.shape.iter().map(|&d| d as usize).collect();
                WeightData::F32(floats(&st, &w.sources[0], &shape, act).map_err(fail)?)
            }
            Packing::LeadingRows => {
                let s = &w.sources[0];
                let (rows, need) = (
                    st.tensor(s).map_or(0, |t| t.shape().first().copied().unwrap_or(0)),
                    w.shape[0] as usize,
                );
                if rows < need {
                    return Err(fail(input_error(
                        s,
                        String::new(),
                        format!("has {rows} rows, {} takes its first {need}", w.name),
                    )));
                }
                let mut all = floats(&st, s, &[rows, cols], act).map_err(fail)?;
                all.truncate(need * cols);
                WeightData::F32(all)
            }
            Packing::ConcatRows => {
                let mut all = Vec::with_capacity(w.shape.iter().product::<u64>() as usize);
                for s in &w.sources {
                    all.extend(floats(&st, s, &[rows_of(s), cols], act).map_err(fail)?);
                }
                WeightData::F32(all)
            }
            Packing::GatherRows => {
                let table = floats(&st, &w.sources[0], &[v, h], act).map_err(fail)?;
                let (ids, _) = ints(&st, &w.sources[1], Dtype::I64, Some(&[w.shape[0] as usize])).map_err(fail)?;
                check_hot_ids(&ids, v).map_err(fail)?;
                WeightData::F32(
                    ids.iter()
                        .flat_map(|&id| table[id as usize * h..(id as usize + 1) * h].to_vec())
                        .collect(),
                )
            }
        };
        out.push(data);
    }
    Ok(out)
}

/// EAGLE-3's d2t: draft id d maps to target id d + d2t[d], which must be a target id.
fn check_d2t(d2t: &[i64], vocab: usize) -> Result<(), InputError> {
    let bad = d2t
        .iter()
        .enumerate()
        .position(|(d, &x)| (d as i64).checked_add(x).is_none_or(|t| t < 0 || t as usize >= vocab));
    match bad {
        Some(d) => Err(input_error(
            "d2t",
            format!("[{d}]"),
            format!(
                "maps draft id {d} to {}, outside the target vocabulary [0, {vocab})",
                (d as i64).saturating_add(d2t[d])
            ),
        )),
        None => Ok(()),
    }
}

fn check_hot_ids(ids: &[i64], vocab: usize) -> Result<(), InputError> {
    match ids.iter().position(|&x| x < 0 || x as usize >= vocab) {
        Some(i) => Err(input_error(
            "hot_token_ids",
            format!("[{i}]"),
            format!("{} is outside [0, {vocab})", ids[i]),
        )),
        None => Ok(()),
    }
}

/// The inputs file: step inputs plus the caller's K/V cache.
pub struct InputsFile {
    pub step: StepInputs,
    pub kv: KvPool,
    /// dtype of the caller's cache, written back in the same type.
    pub kv_dtype: Dtype,
}

pub fn load_inputs(plan: &ValidatedPlan, path: &Path) -> Result<InputsFile, ContractError> {
    let file = path.display().to_string();
    let bytes = read(path, inputs_cap(plan), "a step's inputs")?;
    let st = parse(&bytes, &file)?;
    let fail = |e: InputError| ContractError::input(&file, e);
    let m = &plan.model;
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let (ids, shape) = ints(&st, io::INPUT_IDS, Dtype::I64, None).map_err(fail)?;
    if shape.len() != 2 || shape[1] != n {
        return Err(fail(input_error(
            io::INPUT_IDS,
            String::new(),
            format!("has shape {shape:?}, expected [b, {n}]"),
        )));
    }
    let b = shape[0];
    let act = plan.capture.dtype;
    let hidden = floats(&st, io::HIDDEN_STATES, &[b, n, m.hidden_in() as usize], act).map_err(fail)?;
    let (prefix, _) = ints(&st, io::PREFIX_LENS, Dtype::I32, Some(&[b])).map_err(fail)?;
    let (accept, _) = ints(&st, io::ACCEPT_LENS, Dtype::I32, Some(&[b])).map_err(fail)?;
    let (table, tshape) = ints(&st, io::PAGE_TABLE, Dtype::I32, None).map_err(fail)?;
    if tshape.len() != 2 || tshape[0] != b {
        return Err(fail(input_error(
            io::PAGE_TABLE,
            String::new(),
            format!("has shape {tshape:?}, expected [{b}, P]"),
        )));
    }
    let (ks, kdt) = kv_shape(plan, &st).map_err(fail)?;
    let pages = ks[1];
    let step = StepInputs {
        batch: b,
        input_ids: ids,
        hidden_states: hidden,
        prefix_lens: prefix.iter().map(|&x| x as i32).collect(),
        accept_lens: accept.iter().map(|&x| x as i32).collect(),
        page_table: table.iter().map(|&x| x as i32).collect(),
        page_cols: tshape[1],
    };
    // Check the cheap bounds before converting the (large) caches.
    step.check(plan, pages).map_err(fail)?;
    let kv = load_kv(&st, &ks, act).map_err(fail)?;
    Ok(InputsFile {
        step,
        kv,
        kv_dtype: kdt,
    })
}

/// The shape and dtype of the file's `k_cache` and `v_cache`: `[layers, pages, page_size,
/// kv_heads, head_dim]` in the plan's activation type, both alike.
pub(crate) fn kv_shape(plan: &ValidatedPlan, st: &SafeTensors) -> Result<(Vec<usize>, Dtype), InputError> {
    let m = &plan.model;
    let act = plan.capture.dtype;
    let kv_shape_of = |name: &str| -> Result<(Vec<usize>, Dtype), InputError> {
        let t = st
            .tensor(name)
            .map_err(|_| input_error(name, String::new(), "missing".into()))?;
        let s = t.shape().to_vec();
        let want_tail = [
            plan.capture.page_size as usize,
            m.kv_heads as usize,
            m.head_dim as usize,
        ];
        if s.len() != 5 || s[0] != m.layers as usize || s[2..] != want_tail || s[1] == 0 {
            return Err(input_error(
                name,
                String::new(),
                format!(
                    "has shape {s:?}, expected [{}, num_pages, {}, {}, {}]",
                    m.layers, want_tail[0], want_tail[1], want_tail[2]
                ),
            ));
        }
        // One KV dtype, the plan's: the caches are written back in it, and a cache in
        // another type would come back rounded.
        if t.dtype() != file_dtype(act) {
            return Err(input_error(
                name,
                String::new(),
                format!(
                    "has dtype {}, expected {} (the plan's activation type; k_cache and v_cache are both in it)",
                    dtype_name(t.dtype()),
                    dtype_name(file_dtype(act))
                ),
            ));
        }
        Ok((s, t.dtype()))
    };
    let (ks, kdt) = kv_shape_of(io::K_CACHE)?;
    let (vs, _) = kv_shape_of(io::V_CACHE)?;
    if ks != vs {
        return Err(input_error(
            io::V_CACHE,
            String::new(),
            format!("has shape {vs:?}, k_cache has {ks:?}"),
        ));
    }
    Ok((ks, kdt))
}

/// The file's caches as the CPU pool: the caller's pages plus one scratch page (padded rows
/// write there).
pub(crate) fn load_kv(st: &SafeTensors, ks: &[usize], act: DType) -> Result<KvPool, InputError> {
    let pages = ks[1];
    let per_layer = pages * ks[2] * ks[3] * ks[4];
    let k_all = floats(st, io::K_CACHE, ks, act)?;
    let v_all = floats(st, io::V_CACHE, ks, act)?;
    // One extra page past the caller's: the scratch page padded rows write to.
    let scratch = ks[2] * ks[3] * ks[4];
    let split = |all: Vec<f32>| -> Vec<Vec<f32>> {
        all.chunks_exact(per_layer)
            .map(|c| {
                let mut v = c.to_vec();
                v.extend(std::iter::repeat_n(0.0, scratch));
                v
            })
            .collect()
    };
    Ok(KvPool {
        pages: pages + 1,
        k: split(k_all),
        v: split(v_all),
    })
}

/// What a step returns to the caller (real requests only).
pub struct StepResult {
    pub outputs: BucketOutputs,
    pub bucket: u32,
}

/// Runs the step on the CPU: pads to the smallest bucket that fits, executes, slices.
pub fn run_cpu(
    plan: &ValidatedPlan,
    weights: Vec<WeightData>,
    inputs: &mut InputsFile,
) -> Result<StepResult, ContractError> {
    let b = inputs.step.batch;
    let bucket = plan.bucket_for(b as u32).ok_or_else(|| {
        ContractError::input(
            "inputs",
            input_error(
                io::INPUT_IDS,
                String::new(),
                format!("batch {b} exceeds the largest bucket"),
            ),
        )
    })?;
    // The file's page-table rows become slots 0..b; the scratch page is the pool's extra
    // last page, which no caller page table can name.
    let scratch_page = (inputs.kv.pages - 1) as i32;
    let mut table = PageTable::new(plan, scratch_page);
    let x = &inputs.step;
    for i in 0..b {
        table
            .set_row(i, &x.page_table[i * x.page_cols..(i + 1) * x.page_cols])
            .map_err(|e| ContractError::input("inputs", e))?;
    }
    let slots: Vec<i32> = (0..b as i32).collect();
    let padded =
        pad_to_bucket(plan, bucket, x, &slots, table.scratch_slot()).map_err(|e| ContractError::input("inputs", e))?;
    let exec = CpuExecutor::new(plan, weights)?;
    let out = exec.run(bucket, &padded, &table, &mut inputs.kv)?;
    let h = plan.model.hidden as usize;
    // Each output's first b rows (a row's width: its length over the bucket's rows).
    let rows = |v: &[f32]| v[..v.len() / bucket.batch as usize * b].to_vec();
    let k = out.topk_ids.len() / bucket.batch as usize;
    let res = StepResult {
        outputs: BucketOutputs {
            hidden_out: out.hidden_out[..b * h].to_vec(),
            topk_probs: rows(&out.topk_probs),
            topk_ids: out.topk_ids[..b * k].to_vec(),
            logits: rows(&out.logits),
        },
        bucket: bucket.batch,
    };
    res.check_finite(plan, b)?;
    Ok(res)
}

/// Runs the step on the GPU (graph replay unless `eager`), with the same files and the
/// same semantics as [`run_cpu`]. Only the slots the real requests write are copied back
/// into the caller's cache, so every other slot keeps its exact original value.
pub fn run_gpu(
    plan: &ValidatedPlan,
    weights: Vec<WeightData>,
    inputs: &mut InputsFile,
    eager: bool,
) -> Result<StepResult, ContractError> {
    use specplan_runtime::gpu::{GpuOptions, GpuRuntime, Hidden, StepRequest};
    let x = &inputs.step;
    let b = x.batch;
    let file_pages = inputs.kv.pages - 1;
    let opts = GpuOptions {
        kv_pool_pages: Some(file_pages as u32 + 1),
        build_graphs: !eager,
        // One step: timing every bucket's GEMM candidates (0.1–0.6 s) would cost more than
        // it could save; cublasGemmEx's default choice serves this run.
        gemms: specplan_runtime::gpu::GemmPolicy::Heuristic,
        ..GpuOptions::default()
    };
    let mut rt = GpuRuntime::new(plan.clone(), &weights, opts)?;
    let act = plan.capture.dtype;
    let bits = |layers: &[Vec<f32>]| -> Vec<u16> {
        let per = file_pages * plan.kv_page_bytes() as usize / 2;
        layers
            .iter()
            .flat_map(|l| specplan_runtime::bits::to_act_bits(&l[..per], act))
            .collect()
    };
    rt.write_kv(&bits(&inputs.kv.k), &bits(&inputs.kv.v), file_pages)?;
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let ps = plan.capture.page_size as usize;
    for i in 0..b {
        let used = (x.prefix_lens[i] as usize + n).div_ceil(ps);
        rt.set_pages(i, &x.page_table[i * x.page_cols..i * x.page_cols + used])?;
    }
    let hidden = specplan_runtime::bits::to_act_bits(&x.hidden_states, act);
    let slots: Vec<i32> = (0..b as i32).collect();
    let req = StepRequest {
        slots: &slots,
        input_ids: &x.input_ids,
        hidden: Hidden::Host(&hidden),
        prefix_lens: &x.prefix_lens,
        accept_lens: &x.accept_lens,
    };
    let info = rt.step(&req, eager)?;
    let out = rt.read_outputs()?;
    let (k, v) = rt.read_kv(file_pages)?;
    let to_f = |u: u16| specplan_runtime::bits::from_act_bits(u, act);
    let row = plan.model.kv_heads as usize * plan.model.head_dim as usize;
    let per = file_pages * ps * row;
    for layer in 0..plan.model.layers as usize {
        for i in 0..b {
            for j in 0..n {
                let pos = x.prefix_lens[i] as usize + j;
                let page = x.page_table[i * x.page_cols + pos / ps] as usize;
                let at = (page * ps + pos % ps) * row;
                for t in at..at + row {
                    inputs.kv.k[layer][t] = to_f(k[layer * per + t]);
                    inputs.kv.v[layer][t] = to_f(v[layer * per + t]);
                }
            }
        }
    }
    let res = StepResult {
        outputs: BucketOutputs {
            hidden_out: out.hidden_out.iter().map(|&u| to_f(u)).collect(),
            topk_probs: out.topk_probs,
            topk_ids: out.topk_ids,
            logits: out.logits,
        },
        bucket: info.bucket,
    };
    res.check_finite(plan, b)?;
    Ok(res)
}

fn to_bytes(v: &[f32], dt: Dtype) -> Vec<u8> {
    match dt {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
    }
}

/// Writes the outputs file ([`encode_outputs`]) by the rules of [`output`].
pub fn write_outputs(
    plan: &ValidatedPlan,
    path: &Path,
    res: &StepResult,
    inputs: &InputsFile,
) -> Result<(), ContractError> {
    let bytes = encode_outputs(plan, res, inputs)?;
    output::write_file(path, &bytes).map_err(|e| ContractError::Write {
        path: e.path,
        message: e.message,
    })
}

/// The outputs file's bytes: top-K, hidden_out (in the plan's activation dtype, as the
/// device holds it) and the updated caches (the caller's pages only, in the caller's
/// dtype).
pub fn encode_outputs(plan: &ValidatedPlan, res: &StepResult, inputs: &InputsFile) -> Result<Vec<u8>, ContractError> {
    let werr = |e: String| ContractError::Write {
        path: "outputs".into(),
        message: e,
    };
    let m = &plan.model;
    let b = res.outputs.hidden_out.len() / m.hidden as usize;
    let k = plan.spec.topk as usize;
    let pages = inputs.kv.pages - 1;
    let per_layer = pages * plan.capture.page_size as usize * m.kv_heads as usize * m.head_dim as usize;
    let cache = |layers: &[Vec<f32>]| -> Vec<f32> { layers.iter().flat_map(|l| l[..per_layer].to_vec()).collect() };
    let kv_shape = vec![
        m.layers as usize,
        pages,
        plan.capture.page_size as usize,
        m.kv_heads as usize,
        m.head_dim as usize,
    ];
    let kd = inputs.kv_dtype;
    let mut tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    if plan.capture.outputs.topk {
        tensors.push((
            io::TOPK_PROBS,
            Dtype::F32,
            vec![b, k],
            to_bytes(&res.outputs.topk_probs, Dtype::F32),
        ));
        tensors.push((
            io::TOPK_IDS,
            Dtype::I64,
            vec![b, k],
            res.outputs.topk_ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    if plan.capture.outputs.logits {
        tensors.push((
            io::LOGITS,
            Dtype::F32,
            vec![b, specplan_format::signature::logits_cols(plan) as usize],
            to_bytes(&res.outputs.logits, Dtype::F32),
        ));
    }
    tensors.extend([
        (
            io::HIDDEN_OUT,
            file_dtype(plan.capture.dtype),
            vec![b, m.hidden as usize],
            to_bytes(&res.outputs.hidden_out, file_dtype(plan.capture.dtype)),
        ),
        (io::K_CACHE, kd, kv_shape.clone(), to_bytes(&cache(&inputs.kv.k), kd)),
        (io::V_CACHE, kd, kv_shape, to_bytes(&cache(&inputs.kv.v), kd)),
    ]);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, bytes)| {
            TensorView::new(*d, s.clone(), bytes)
                .map(|v| (n.to_string(), v))
                .map_err(|e| werr(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize(views, None).map_err(|e| werr(e.to_string()))
}
