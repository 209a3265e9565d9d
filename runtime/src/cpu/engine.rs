//! The CPU engine: a plan run by the CPU executor on an engine's host memory in place — the
//! registration the GPU runtime's engine mode takes ([`crate::registration`]: a K/V pool of
//! any [`KvGeometry`](crate::registration::KvGeometry), a token-slot or page-id table,
//! weights by name), the per-request rules `admit` checks on the device
//! ([`DeviceRule`], checked here on the host in the same order), and `emit`'s outputs (an
//! admitted request's rows, a refused one's zeros). It is what the Python package runs on
//! CPU tensors, so an engine adapter can be tested against the engine's own classes on a
//! machine without a GPU, and the oracle of the layouts the kernels walk.

use specplan_format::io;
use specplan_format::PhaseKind;
use specplan_format::{read_window, signature, DType, Packing, Plan, ValidatedPlan};
use specplan_kernels::kv::{DeviceRule, TableMode};

use super::{CpuExecutor, ExecError, KvStore, StridedKv, WeightData};
use crate::aliasing;
use crate::gpu::DeviceError;
use crate::registration::{
    bind_weights, check_d2t, check_hot_ids, check_kv, check_table, EngineMemory, RegError, WeightBinding,
};
use crate::step::{first_non_finite, BucketInputs, PageTable};

/// A `[b]` integer tensor of the caller, i32 or i64.
#[derive(Clone, Copy, Debug)]
pub enum Ints<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl Ints<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Ints::I32(v) => v.len(),
            Ints::I64(v) => v.len(),
        }
    }
    pub(super) fn get(&self, i: usize) -> i64 {
        match self {
            Ints::I32(v) => v[i] as i64,
            Ints::I64(v) => v[i],
        }
    }
}

/// One step's inputs on the host: `b = req.len()` requests.
#[derive(Clone, Copy, Debug)]
pub struct HostStep<'a> {
    /// `[b, N]`, i64 or i32.
    pub input_ids: Ints<'a>,
    /// `[b, N, H_in]`, activation bits (bf16 or fp16, as the plan's dtype).
    pub hidden: &'a [u16],
    /// Rows of the registered page table.
    pub req: Ints<'a>,
    /// Tokens already cached per request, plus `prefix_bias` (−N for SGLang's `seq_lens`).
    pub prefix: Ints<'a>,
    /// `A` per request, or (`accept_form`) each request's selected row `r·N + A − 1`.
    pub accept: Ints<'a>,
    pub accept_form: crate::gpu::AcceptForm,
    pub prefix_bias: i32,
}

/// Where the outputs go (`None`: not copied; an output the plan does not emit must be
/// `None`).
#[derive(Debug, Default)]
pub struct HostOutputs<'a> {
    pub topk_p: Option<&'a mut [f32]>,
    pub topk_index: Option<&'a mut [i64]>,
    /// `[b, H]` activation bits.
    pub hidden: Option<&'a mut [u16]>,
    pub logits: Option<&'a mut [f32]>,
}

/// The caller's page table in host memory.
pub(super) struct HostTable {
    ptr: *const i32,
    pub(super) mode: TableMode,
    pub(super) rows: u64,
    pub(super) cols: u64,
    stride: u64,
}

impl HostTable {
    pub(super) fn row(&self, r: u64) -> Vec<i32> {
        let at = r.saturating_mul(self.stride) as usize;
        // SAFETY: `r < rows` (callers check), and the constructor's contract makes the
        // table valid for `rows × stride` i32 values with `cols ≤ stride`.
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), self.cols as usize) }.to_vec()
    }
}

pub struct CpuEngine {
    plan: ValidatedPlan,
    weights: Vec<WeightData>,
    kv: StridedKv,
    table: HostTable,
    /// The registered memory's byte ranges (`check_step_memory`).
    regions: crate::registration::Regions,
    last: Option<DeviceError>,
    /// Refusals of steps not yet taken by `take_unpolled`.
    unpolled: Vec<DeviceError>,
}

/// Reads `n` u16 activation values at host address `p` as f32.
///
/// # Safety
/// SAFETY: `p` must be valid for reads of `n` u16 values.
unsafe fn read_act(p: u64, n: usize, act: DType) -> Vec<f32> {
    // SAFETY: the caller's contract.
    let bits = unsafe { std::slice::from_raw_parts(p as *const u16, n) };
    bits.iter().map(|&u| crate::bits::from_act_bits(u, act)).collect()
}

/// # Safety
/// SAFETY: `p` must be valid for reads of `n` i64 values.
unsafe fn read_i64(p: u64, n: usize) -> Vec<i64> {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(p as *const i64, n) }.to_vec()
}

impl CpuEngine {
    /// Registers the caller's host memory, checked as the GPU runtime checks a device
    /// registration. Weights are read once into the executor's f32 copies (packed as the
    /// plan says); the K/V pool and the table are used in place on every step.
    ///
    /// # Safety
    /// SAFETY: every address in `mem` is host memory valid for what its registration says (the K/V
    /// pointers for the geometry's extent, read and written; the table for `rows × stride`
    /// i32; each weight tensor for its shape and dtype), 2-byte aligned or better, alive and
    /// untouched by anyone else while the engine is used.
    pub unsafe fn new(plan: ValidatedPlan, mem: EngineMemory) -> Result<CpuEngine, RegError> {
        check_kv(&plan, &mem.kv)?;
        check_table(&plan, &mem.table)?;
        let regions = crate::registration::Regions::of(&plan, &mem)?;
        let tensors = mem.weights;
        let ids_of = |name: &str| -> Option<Vec<i64>> {
            let t = tensors.get(name)?;
            if t.dtype != DType::I64 || t.shape.len() != 1 || t.ptr == 0 || t.ptr % 8 != 0 {
                return None;
            }
            // SAFETY: an i64 tensor of shape [n] by the caller's registration.
            Some(unsafe { read_i64(t.ptr, usize::try_from(t.shape[0]).ok()?) })
        };
        let bindings = bind_weights(&plan, tensors, &ids_of)?;
        check_d2t(&plan, ids_of("d2t").as_deref())?;
        check_hot_ids(&plan, ids_of("hot_token_ids").as_deref())?;
        let act = plan.capture.dtype;
        let mut weights = Vec::with_capacity(bindings.len());
        for (w, b) in plan.weights.iter().zip(&bindings) {
            let elems = w.shape.iter().product::<u64>() as usize;
            let data = match (b, w.dtype) {
                // SAFETY: bind_weights checked the tensor's dtype and shape against the plan
                // weight; the caller's contract makes it readable.
                (WeightBinding::InPlace(p), DType::I64) => WeightData::I64(unsafe { read_i64(*p, elems) }),
                (WeightBinding::InPlace(p), _) => WeightData::F32(unsafe { read_act(*p, elems, act) }),
                (WeightBinding::Concat(parts), _) => {
                    let mut v = Vec::with_capacity(elems);
                    for &(p, bytes) in parts {
                        // SAFETY: each part is a source tensor of `bytes` bytes (bind_weights).
                        v.extend(unsafe { read_act(p, bytes as usize / 2, act) });
                    }
                    WeightData::F32(v)
                }
                (WeightBinding::Gather { table, row_bytes, ids }, _) => {
                    let mut v = Vec::with_capacity(elems);
                    for &id in ids {
                        // SAFETY: ids are in [0, vocab) and the table has vocab rows of
                        // `row_bytes` (bind_weights).
                        v.extend(unsafe { read_act(table + id as u64 * row_bytes, *row_bytes as usize / 2, act) });
                    }
                    WeightData::F32(v)
                }
            };
            weights.push(data);
        }
        debug_assert!(plan
            .weights
            .iter()
            .all(|w| w.packing != Packing::GatherRows || w.sources.len() == 2));
        let k = mem.kv.k.iter().map(|&p| p as *mut u16).collect();
        let v = mem.kv.v.iter().map(|&p| p as *mut u16).collect();
        // SAFETY: check_kv proved the geometry keeps every element of a layer's K and V
        // apart; the caller's contract makes the pointers valid for its extent.
        let kv = unsafe { StridedKv::new(&plan, k, v, mem.kv.geom) }.map_err(RegError::Registration)?;
        let t = &mem.table;
        let table = HostTable {
            ptr: t.ptr as *const i32,
            mode: t.mode,
            rows: t.rows,
            cols: t.cols,
            stride: t.stride,
        };
        // Executor check of the weights' lengths, once.
        CpuExecutor::borrowing(&plan, &weights).map_err(|e| RegError::Weights(e.to_string()))?;
        Ok(CpuEngine {
            plan,
            weights,
            kv,
            table,
            regions,
            last: None,
            unpolled: Vec::new(),
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// A step's host tensors of `b` requests against the registered memory and each other
    /// (`Regions::check_step`, one chunk: the CPU engine reads all its inputs before it writes
    /// an output; `b` in `[1, max_requests]` first): what a caller building a step's slices
    /// from raw addresses checks first, before any length derived from `b`. An
    /// input that shares memory with an output (`shares_with_outputs`) must be passed as a
    /// copy: a slice may not alias a mutable one.
    pub fn check_step_memory(&self, tensors: &[crate::registration::StepTensor], b: u64) -> Result<(), String> {
        self.regions.check_step(tensors, b, b)
    }

    pub(super) fn table(&self) -> &HostTable {
        &self.table
    }

    pub(super) fn kv_slots(&self) -> u64 {
        self.kv.slots()
    }

    /// Runs one bucket of phase `kind` on the engine's pool in place.
    pub(super) fn run_named(
        &mut self,
        kind: PhaseKind,
        bucket: &specplan_format::BucketPlan,
        inputs: &[(&str, Vec<f64>)],
        table: &PageTable,
    ) -> Result<Vec<(String, Vec<f64>)>, ExecError> {
        let exec = CpuExecutor::borrowing(&self.plan, &self.weights)?;
        exec.run_named_on(kind, bucket, inputs, table, &mut self.kv)
    }

    /// Records a step's first refusal (or none) as the last error, and for polling.
    pub(super) fn record(&mut self, last: Option<DeviceError>) {
        self.last = last;
        self.unpolled.extend(self.last.clone());
    }

    /// What the per-request rules refused in the last step (each refused request wrote
    /// nothing and has zero outputs).
    pub fn last_error(&self) -> Option<DeviceError> {
        self.last.clone()
    }

    /// The refusals of every step since the last call, oldest first (the CPU twin of
    /// `GpuRuntime::poll_error`).
    pub fn take_unpolled(&mut self) -> Vec<DeviceError> {
        std::mem::take(&mut self.unpolled)
    }

    /// Request `i`'s accept length (`A`, however the caller gave it); 0 (outside [1, N], so
    /// refused) where a select index is so far out that the arithmetic would overflow.
    fn accept(&self, x: &HostStep, i: usize) -> i64 {
        let n = self.plan.rows_per_request(PhaseKind::DraftExtend) as i64;
        match x.accept_form {
            crate::gpu::AcceptForm::Lengths => x.accept.get(i),
            crate::gpu::AcceptForm::SelectRows => x
                .accept
                .get(i)
                .checked_sub(i as i64 * n)
                .and_then(|a| a.checked_add(1))
                .unwrap_or(0),
        }
    }

    /// Request `i`'s table row, or the first rule it breaks in `admit`'s order.
    fn admit(&self, x: &HostStep, i: usize) -> Result<Vec<i32>, DeviceRule> {
        let p = &self.plan;
        let n = p.rows_per_request(PhaseKind::DraftExtend) as i64;
        let ps = p.capture.page_size as i64;
        let r = x.req.get(i);
        let a = self.accept(x, i);
        let t = &self.table;
        if r < 0 || r as u64 >= t.rows {
            return Err(DeviceRule::Request);
        }
        // Compared before any sum: a prefix near the i64 limits is refused, never overflowed.
        let l = match x.prefix.get(i).checked_add(x.prefix_bias as i64) {
            Some(l) if l >= 0 && l <= p.capture.max_context_len as i64 - n => l,
            _ => return Err(DeviceRule::Prefix),
        };
        let end = l + n;
        let need = match t.mode {
            TableMode::TokenSlots => end,
            TableMode::PageIds => (end + ps - 1).div_euclid(ps),
        };
        if need > t.cols as i64 {
            return Err(DeviceRule::Row);
        }
        if a < 1 || a > n {
            return Err(DeviceRule::Accept);
        }
        let row = t.row(r as u64);
        let slots = self.kv.slots();
        let bad_slot = (l..end).any(|pos| slot_of(t.mode, &row, ps as usize, pos as usize).is_none_or(|s| s >= slots));
        if bad_slot {
            return Err(DeviceRule::Slot);
        }
        let un = n as usize;
        if (i * un..(i + 1) * un).any(|e| {
            let id = x.input_ids.get(e);
            id < 0 || id >= p.model.vocab as i64
        }) {
            return Err(DeviceRule::Id);
        }
        Ok(row)
    }

    /// One draft-extend step of `b = x.req.len()` requests; batches above the largest
    /// bucket run as consecutive chunks. Shapes are checked first (an error names the
    /// tensor and nothing runs); a request breaking a device rule is refused (no K/V
    /// written, zero outputs) and reported by [`CpuEngine::last_error`].
    pub fn step(&mut self, x: &HostStep, out: &mut HostOutputs) -> Result<(), String> {
        let p = self.plan.plan().clone();
        let n = p.rows_per_request(PhaseKind::DraftExtend) as usize;
        let (h, hin, k) = (
            p.model.hidden as usize,
            p.model.hidden_in() as usize,
            p.spec.topk as usize,
        );
        let cols = signature::logits_cols(&p) as usize;
        let b = x.req.len();
        let outs = p.capture.outputs;
        if b == 0 {
            return Err("req_pool_indices: a step needs at least one request".into());
        }
        let shape = |name: &str, len: usize, want: usize| {
            (len == want)
                .then_some(())
                .ok_or_else(|| format!("{name}: {len} values, expected {want}"))
        };
        shape(io::INPUT_IDS, x.input_ids.len(), b * n)?;
        shape(io::HIDDEN_STATES, x.hidden.len(), b * n * hin)?;
        shape(io::PREFIX_LENS, x.prefix.len(), b)?;
        shape(io::ACCEPT_LENS, x.accept.len(), b)?;
        for (name, given, emitted, want) in [
            ("topk_p", out.topk_p.as_ref().map(|v| v.len()), outs.topk, b * k),
            ("topk_index", out.topk_index.as_ref().map(|v| v.len()), outs.topk, b * k),
            ("hidden_states (out)", out.hidden.as_ref().map(|v| v.len()), true, b * h),
            (io::LOGITS, out.logits.as_ref().map(|v| v.len()), outs.logits, b * cols),
        ] {
            match given {
                Some(_) if !emitted => {
                    return Err(format!(
                        "{name}: the plan does not emit it (capture.outputs = {})",
                        outs.name()
                    ))
                }
                Some(len) => shape(name, len, want)?,
                None => {}
            }
        }
        let max_b = p.buckets().last().map_or(1, |x| x.batch as usize);
        let exec = CpuExecutor::borrowing(&self.plan, &self.weights).map_err(|e| e.to_string())?;
        // (request, rule, the other request of an alias)
        let mut refused: Vec<(usize, DeviceRule, Option<usize>)> = Vec::new();
        let ps = p.capture.page_size as usize;
        for start in (0..b).step_by(max_b) {
            let end = (start + max_b).min(b);
            let bucket = p.bucket_for((end - start) as u32).ok_or("no bucket serves the chunk")?;
            let bb = bucket.batch as usize;
            let mut table = PageTable {
                rows: bb,
                cols: self.table.cols as usize,
                data: vec![-1; bb * self.table.cols as usize],
                mode: self.table.mode,
            };
            let mut inp = BucketInputs {
                input_ids: vec![0; bb * n],
                hidden_states: vec![0.0; bb * n * hin],
                prefix_lens: vec![0; bb],
                accept_lens: vec![n as i32; bb],
                req_slots: vec![-1; bb],
            };
            // Rules 1-6 per request, then the aliasing rule over the chunk (one replay),
            // as admit checks them.
            let admitted: Vec<Result<Vec<i32>, DeviceRule>> = (start..end).map(|i| self.admit(x, i)).collect();
            let reqs: Vec<aliasing::Request> = (start..end)
                .zip(&admitted)
                .map(|(i, a)| aliasing::Request {
                    // A refused request's prefix may be anything an i64 holds; it reads nothing.
                    l: if a.is_ok() {
                        (x.prefix.get(i) + x.prefix_bias as i64) as usize
                    } else {
                        0
                    },
                    admitted: a.is_ok(),
                })
                .collect();
            let (mode, slots) = (self.table.mode, self.kv.slots());
            let aliases = aliasing::check(&reqs, n, |c, pos| {
                slot_of(mode, admitted[c].as_ref().ok()?, ps, pos).filter(|&s| s < slots)
            });
            let window = read_window(p.layers.iter().map(|l| l.window));
            let mut ok = vec![false; end - start];
            for i in start..end {
                let c = i - start;
                let hole = admitted[c]
                    .as_ref()
                    .is_ok_and(|row| prefix_hole(mode, row, ps, reqs[c].l, window, slots));
                let Some(row) = admitted_row(&admitted[c], hole, aliases[c], i, start, &mut refused) else {
                    continue;
                };
                ok[c] = true;
                table.data[c * table.cols..(c + 1) * table.cols].copy_from_slice(row);
                inp.req_slots[c] = c as i32;
                inp.prefix_lens[c] = (x.prefix.get(i) + x.prefix_bias as i64) as i32;
                inp.accept_lens[c] = self.accept(x, i) as i32;
                for j in 0..n {
                    inp.input_ids[c * n + j] = x.input_ids.get(i * n + j);
                }
                for (dst, &u) in inp.hidden_states[c * n * hin..(c + 1) * n * hin]
                    .iter_mut()
                    .zip(&x.hidden[i * n * hin..(i + 1) * n * hin])
                {
                    *dst = crate::bits::from_act_bits(u, p.capture.dtype);
                }
            }
            let o = exec
                .run_on(bucket, &inp, &table, &mut self.kv)
                .map_err(|e: ExecError| e.to_string())?;
            let act = p.capture.dtype;
            for (c, &keep) in ok.iter().enumerate() {
                let i = start + c;
                // emit's flag: an admitted request's outputs, as the device holds them.
                if keep {
                    let hidden_bad = first_non_finite(&o.hidden_out[c * h..(c + 1) * h], act).is_some();
                    let probs_bad = outs.topk && o.topk_probs[c * k..(c + 1) * k].iter().any(|v| !v.is_finite());
                    let logits_bad = outs.logits && o.logits[c * cols..(c + 1) * cols].iter().any(|v| !v.is_finite());
                    if hidden_bad || probs_bad || logits_bad {
                        refused.push((i, DeviceRule::NonFinite, None));
                    }
                }
                if let Some(dst) = out.topk_p.as_deref_mut() {
                    for j in 0..k {
                        dst[i * k + j] = if keep { o.topk_probs[c * k + j] } else { 0.0 };
                    }
                }
                if let Some(dst) = out.topk_index.as_deref_mut() {
                    for j in 0..k {
                        dst[i * k + j] = if keep { o.topk_ids[c * k + j] } else { 0 };
                    }
                }
                if let Some(dst) = out.hidden.as_deref_mut() {
                    for j in 0..h {
                        let v = if keep { o.hidden_out[c * h + j] } else { 0.0 };
                        dst[i * h + j] = crate::bits::to_act_bits(&[v], act)[0];
                    }
                }
                if let Some(dst) = out.logits.as_deref_mut() {
                    for j in 0..cols {
                        dst[i * cols + j] = if keep { o.logits[c * cols + j] } else { 0.0 };
                    }
                }
            }
        }
        // The lowest request first (a request breaks one rule), as the status words.
        refused.sort_by_key(|r| r.0);
        self.record(refused.first().map(|&(request, rule, other)| DeviceError {
            count: refused.len() as u64,
            request: request as u64,
            rule: Some(rule),
            other: other.map(|o| o as u64),
        }));
        Ok(())
    }
}

/// The token slot of position `pos` in a table row (`None`: outside the row, or a negative
/// page or slot); callers bound it by the pool.
pub(super) fn slot_of(mode: TableMode, row: &[i32], ps: usize, pos: usize) -> Option<u64> {
    let tok = match mode {
        TableMode::TokenSlots => *row.get(pos)? as i64,
        TableMode::PageIds => match *row.get(pos / ps)? {
            pg if pg >= 0 => pg as i64 * ps as i64 + (pos % ps) as i64,
            _ => -1,
        },
    };
    u64::try_from(tok).ok()
}

/// Whether a prefix position some layer reads (`max(0, l − window + 1) .. l`; window 0: all
/// of it) has no slot in the pool: the attention would read its key as zeros. `admit` finds
/// it in its aliasing walk and refuses the request by rule `Slot`, ahead of `Alias`.
pub(super) fn prefix_hole(mode: TableMode, row: &[i32], ps: usize, l: usize, window: u32, slots: u64) -> bool {
    let from = if window > 0 {
        (l + 1).saturating_sub(window as usize)
    } else {
        0
    };
    (from..l).any(|pos| slot_of(mode, row, ps, pos).is_none_or(|s| s >= slots))
}

/// Request `i`'s table row when it passed the per-request rules, has no hole in the prefix
/// it reads (`hole`: [`prefix_hole`]) and passed the aliasing rule; else its refusal
/// recorded as `(request, rule, the other request of an alias)`.
pub(super) fn admitted_row<'a>(
    admitted: &'a Result<Vec<i32>, DeviceRule>,
    hole: bool,
    alias: Option<aliasing::Alias>,
    i: usize,
    start: usize,
    refused: &mut Vec<(usize, DeviceRule, Option<usize>)>,
) -> Option<&'a Vec<i32>> {
    match (admitted, alias) {
        (Err(rule), _) => {
            refused.push((i, *rule, None));
            None
        }
        (Ok(_), _) if hole => {
            refused.push((i, DeviceRule::Slot, None));
            None
        }
        (Ok(_), Some(a)) => {
            refused.push((i, DeviceRule::Alias, Some(start + a.writer)));
            None
        }
        (Ok(row), None) => Some(row),
    }
}
