//! The weights file: every plan weight by its checkpoint name, packed as the plan stores it,
//! values finite in the activation type, the FR-Spec and d2t id maps in range.

use std::path::Path;

use safetensors::tensor::Dtype;
use specplan_format::{DType, Packing, Shard, ValidatedPlan};
use specplan_runtime::cpu::WeightData;
use specplan_runtime::registration::{first_repeat, source_rows};
use specplan_runtime::step::{input_error, InputError};

use super::tensors::{floats, ints, parse, read, weights_cap};
use super::ContractError;

/// Reads the weights file and packs every plan weight (concatenations, FR-Spec gather); a
/// tensor-parallel rank's plan takes its shards of the full checkpoint tensors.
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
        let rows_of = |name: &str| -> usize { source_rows(m, name).unwrap_or(w.shape[0]) as usize };
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
        // A sharded part is read at its full size (`parts` times the rank's along its
        // axis) and sliced to the rank's part.
        let shard = |part: usize| w.shard.get(part).copied();
        let grow = |n: usize, sh: Option<Shard>, axis: u32| match sh {
            Some(sh) if sh.axis == axis => n * sh.parts as usize,
            _ => n,
        };
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
                let full: Vec<usize> = w
                    .shape
                    .iter()
                    .enumerate()
                    .map(|(ax, &d)| grow(d as usize, shard(0), ax as u32))
                    .collect();
                let all = floats(&st, &w.sources[0], &full, act).map_err(fail)?;
                WeightData::F32(take_part(all, &full, shard(0)))
            }
            Packing::LeadingRows => {
                let s = &w.sources[0];
                let need = grow(w.shape[0] as usize, shard(0), 0);
                let rows = st.tensor(s).map_or(0, |t| t.shape().first().copied().unwrap_or(0));
                if rows < need {
                    return Err(fail(input_error(
                        s,
                        String::new(),
                        format!("has {rows} rows, {} takes its first {need}", w.name),
                    )));
                }
                let mut all = floats(&st, s, &[rows, cols], act).map_err(fail)?;
                all.truncate(need * cols);
                WeightData::F32(take_part(all, &[need, cols], shard(0)))
            }
            Packing::ConcatRows => {
                let mut all = Vec::with_capacity(w.shape.iter().product::<u64>() as usize);
                for (i, s) in w.sources.iter().enumerate() {
                    let full = [grow(rows_of(s), shard(i), 0), grow(cols, shard(i), 1)];
                    let part = floats(&st, s, &full, act).map_err(fail)?;
                    all.extend(take_part(part, &full, shard(i)));
                }
                WeightData::F32(all)
            }
            Packing::GatherRows => {
                let table = floats(&st, &w.sources[0], &[v, h], act).map_err(fail)?;
                let count = grow(w.shape[0] as usize, shard(0), 0);
                let (ids, _) = ints(&st, &w.sources[1], Dtype::I64, Some(&[count])).map_err(fail)?;
                check_hot_ids(&ids, v).map_err(fail)?;
                let rows: Vec<f32> = ids
                    .iter()
                    .flat_map(|&id| table[id as usize * h..(id as usize + 1) * h].to_vec())
                    .collect();
                WeightData::F32(take_part(rows, &[count, h], shard(0)))
            }
        };
        out.push(data);
    }
    Ok(out)
}

/// Part `sh.index` of `sh.parts` along `sh.axis` of a row-major tensor of shape `full`
/// (the whole tensor without a shard). The loader sized `full` so the parts are equal.
fn take_part(data: Vec<f32>, full: &[usize], sh: Option<Shard>) -> Vec<f32> {
    let Some(sh) = sh else { return data };
    let (parts, index) = (sh.parts.max(1) as usize, sh.index as usize);
    let rows = full.first().copied().unwrap_or(0);
    let cols: usize = full.iter().skip(1).product();
    if sh.axis == 0 {
        let per = rows / parts;
        data[index * per * cols..(index + 1) * per * cols].to_vec()
    } else {
        let per = cols / parts;
        data.chunks(cols.max(1))
            .flat_map(|row| row[index * per..(index + 1) * per].iter().copied())
            .collect()
    }
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
        None => match first_repeat(d2t.iter().enumerate().map(|(d, &x)| d as i64 + x)) {
            Some((e, d, t)) => Err(input_error(
                "d2t",
                format!("[{d}]"),
                format!(
                    "maps draft id {d} to target id {t}, as d2t[{e}] maps draft id {e}: the map must be one to one"
                ),
            )),
            None => Ok(()),
        },
    }
}

fn check_hot_ids(ids: &[i64], vocab: usize) -> Result<(), InputError> {
    match ids.iter().position(|&x| x < 0 || x as usize >= vocab) {
        Some(i) => Err(input_error(
            "hot_token_ids",
            format!("[{i}]"),
            format!("{} is outside [0, {vocab})", ids[i]),
        )),
        None => match first_repeat(ids.iter().copied()) {
            Some((e, i, id)) => Err(input_error(
                "hot_token_ids",
                format!("[{i}]"),
                format!("repeats id {id} (hot_token_ids[{e}]): the ids must be distinct"),
            )),
            None => Ok(()),
        },
    }
}
