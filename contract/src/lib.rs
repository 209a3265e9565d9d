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
mod tensors;
mod weights;

pub(crate) use tensors::{dtype_name, file_dtype, floats, ints, parse, read};
pub use tensors::{inputs_cap, weights_cap};
pub use weights::load_weights;

use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use specplan_format::PhaseKind;
use specplan_format::{io, DType, ValidatedPlan};
use specplan_runtime::cpu::{BucketOutputs, CpuExecutor, KvPool, WeightData};
use specplan_runtime::step::{input_error, pad_to_bucket, InputError, PageTable, StepInputs};

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
