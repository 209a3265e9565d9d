//! Reading a contract file: size-capped reads, safetensors parsing, and typed tensors whose
//! violations name the tensor, the index and the bound.

use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use specplan_format::{DType, Packing, PhaseKind, ValidatedPlan};
use specplan_runtime::step::{first_non_finite, input_error, InputError};

use super::ContractError;

pub(crate) fn read(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>, ContractError> {
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
/// A tensor-parallel rank's sharded weight is read at its full size (its parts' count times
/// the rank's share).
pub fn weights_cap(plan: &ValidatedPlan) -> u64 {
    let m = &plan.model;
    let elems: u64 = plan
        .weights
        .iter()
        .map(|w| {
            let parts = w.shard.iter().map(|s| s.parts as u64).max().unwrap_or(1).max(1);
            let own = match w.packing {
                Packing::GatherRows => m.vocab as u64 * w.shape.iter().skip(1).product::<u64>() + w.shape[0],
                _ => w.shape.iter().product::<u64>(),
            };
            own.saturating_mul(parts)
        })
        .fold(0u64, u64::saturating_add);
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

pub(crate) fn parse<'a>(bytes: &'a [u8], file: &str) -> Result<SafeTensors<'a>, ContractError> {
    SafeTensors::deserialize(bytes).map_err(|e| ContractError::Format {
        file: file.into(),
        message: e.to_string(),
    })
}

pub(crate) fn dtype_name(d: Dtype) -> String {
    format!("{d:?}").to_lowercase()
}

/// The safetensors dtype of a plan activation type.
pub(crate) fn file_dtype(act: DType) -> Dtype {
    match act {
        DType::F16 => Dtype::F16,
        _ => Dtype::BF16,
    }
}

/// `[i][j]..` of a flat index into `shape`.
pub(crate) fn index_of(mut flat: usize, shape: &[usize]) -> String {
    let mut parts = vec![0; shape.len()];
    for (p, &d) in parts.iter_mut().zip(shape).rev() {
        *p = flat % d.max(1);
        flat /= d.max(1);
    }
    parts.iter().map(|p| format!("[{p}]")).collect()
}

/// A float tensor as f32 (bf16, f16 or f32 in the file), checked against `shape` and for
/// finite values in the plan's activation type `act` (the first bad index is named).
pub(crate) fn floats(st: &SafeTensors, name: &str, shape: &[usize], act: DType) -> Result<Vec<f32>, InputError> {
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

pub(crate) fn ints(
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
