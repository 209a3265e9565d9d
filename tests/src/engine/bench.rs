//! Engine memory for timing and for the sanitizers: load time onto caller memory, a
//! constant-filled fixture for timing steps, one step at a given batch.

use std::collections::HashMap;
use std::time::Instant;

use cudarc::driver::result;
use specplan_format::{DType, PhaseKind, ValidatedPlan};
use specplan_runtime::gpu::{
    DeviceInts, DeviceOutputs, DeviceStep, DeviceTensor, EngineMemory, GpuOptions, GpuRuntime, KvRegistration,
    TableMode, TableRegistration,
};

use crate::gpu::DeviceBuf;
use crate::random::make_case;
use crate::Rng;

use super::fixture::{err, fixture, upload, Layout};
use super::{engine_step, Ints};

/// The device memory a runtime loaded onto caller memory adds beyond the caller's weights,
/// pool and table: measured (free device memory before the load and with the runtime
/// alive, all its graphs built) and the parts the runtime knows.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct AddedMemory {
    pub measured_bytes: u64,
    pub arena_bytes: u64,
    pub workspace_bytes: u64,
}

/// The most device memory an engine runner with every bucket graphed may add beyond the
/// engine's weights and K/V: `gpucheck engine` asserts it and the bench judges it
/// (llama3-8b-eagle's 27 buckets added 86 MiB with a fixed 32 MiB GEMM workspace, 38–50 MiB
/// since).
pub const ENGINE_MEMORY_BOUND: u64 = 64 << 20;

/// One load's entry in `gpucheck engine`'s and `engine-memory`'s JSON (what
/// tests/peer/criteria.py reads): the plan's path and name, its buckets, the two load times
/// and the memory it added.
pub fn load_record(
    path: &str,
    name: &str,
    buckets: usize,
    first_ms: f64,
    second_ms: f64,
    m: &AddedMemory,
) -> serde_json::Value {
    serde_json::json!({"plan": path, "name": name, "buckets": buckets, "first_ms": first_ms,
                       "second_ms": second_ms, "added_memory": m})
}

/// `gpucheck engine-memory`'s file: the bound and one entry per load (null: it failed).
pub fn memory_file(loads: Vec<serde_json::Value>) -> serde_json::Value {
    serde_json::json!({"bound_bytes": ENGINE_MEMORY_BOUND, "load": loads})
}

fn free_bytes() -> Result<u64, String> {
    result::mem_get_info()
        .map(|(free, _)| free as u64)
        .map_err(|e| format!("{e:?}"))
}

/// Load time of a plan onto caller memory (weights, pool and table allocated here, not
/// initialized: only the addresses matter), twice: the first load may time GEMMs into the
/// cache and pays the libraries' first use; the second is what an engine process pays, and
/// the memory it adds is measured.
pub fn engine_load_ms(
    plan: &ValidatedPlan,
) -> Result<(f64, f64, specplan_runtime::gpu::LoadTimes, AddedMemory), String> {
    // The caller's allocations below need a current context before any runtime makes one:
    // the primary context the runtime retains, bound to this thread and held until the
    // buffers are freed (run alone, as `gpucheck engine-memory` does, nothing else had made
    // one current, and the first allocation failed with CUDA_ERROR_INVALID_CONTEXT).
    let _ctx = cudarc::driver::CudaContext::new(GpuOptions::default().device).map_err(|e| format!("{e:?}"))?;
    let m = &plan.model;
    let act = plan.capture.dtype;
    let mut bufs = Vec::new();
    let mut weights = HashMap::new();
    for w in &plan.weights {
        let b = DeviceBuf::new(w.bytes as usize)?;
        if w.name == "d2t" {
            // EAGLE-3's d2t is read and range-checked at load: zero offsets map d to d.
            b.fill(0, std::ptr::null_mut())?;
        } else if w.dtype == DType::I64 {
            // FR-Spec's hot ids likewise (in range, distinct): 0, 1, 2, ...
            let ids: Vec<i64> = (0..(w.bytes / 8) as i64).collect();
            // SAFETY: `b` holds the weight's bytes, `w.bytes / 8` i64s.
            unsafe { result::memcpy_htod_sync(b.ptr, &ids) }.map_err(|e| format!("{e:?}"))?;
            result::ctx::synchronize().map_err(|e| format!("{e:?}"))?;
        }
        weights.insert(
            w.name.clone(),
            DeviceTensor {
                ptr: b.ptr,
                dtype: w.dtype,
                shape: w.shape.clone(),
            },
        );
        bufs.push(b);
    }
    let slots = 4096u64;
    let stride = (m.kv_heads * m.head_dim) as u64;
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for _ in 0..m.layers {
        let kb = DeviceBuf::new((slots * stride * act.size()) as usize)?;
        let vb = DeviceBuf::new((slots * stride * act.size()) as usize)?;
        k.push(kb.ptr);
        v.push(vb.ptr);
        bufs.extend([kb, vb]);
    }
    let cols = plan.capture.max_context_len as u64;
    let table = DeviceBuf::new((cols * 128 * 4) as usize)?;
    let mut times = Vec::new();
    let mut last = None;
    let mut added = AddedMemory::default();
    for round in 0..2 {
        let mem = EngineMemory {
            kv: KvRegistration::dense(k.clone(), v.clone(), slots, stride, plan.model.head_dim as u64),
            table: TableRegistration {
                ptr: table.ptr,
                mode: TableMode::TokenSlots,
                rows: 128,
                cols,
                stride: cols,
                page_size: 1,
            },
            weights: &weights,
        };
        let free0 = free_bytes()?;
        let t0 = Instant::now();
        let rt = GpuRuntime::with_engine_memory(plan.clone(), mem, GpuOptions::default()).map_err(err)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        last = Some(rt.load);
        if round == 1 {
            added = AddedMemory {
                measured_bytes: free0.saturating_sub(free_bytes()?),
                arena_bytes: rt.arena_bytes() as u64,
                workspace_bytes: rt.workspace_bytes() as u64,
            };
        }
    }
    drop(bufs);
    Ok((times[0], times[1], last.unwrap_or_default(), added))
}

/// Caller memory and inputs for timing an engine step: every request at prefix `l`, token
/// slots in scattered order, weights and cache filled with a constant (values do not change
/// the time; finite ones keep every kernel on its usual path).
pub struct BenchFixture {
    _bufs: Vec<DeviceBuf>,
    pub runtime: GpuRuntime,
    pub step: DeviceStep,
    pub stream: std::sync::Arc<cudarc::driver::CudaStream>,
    // Last: dropped after the buffers it made current for (see engine_load_ms).
    _ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

/// The fixture's engine runtime is loaded with `opts` (specbench's A/B switches, so that its
/// engine rows are on the same side of an A/B as its owned rows).
pub fn bench_fixture(plan: &ValidatedPlan, b: usize, l: usize, opts: GpuOptions) -> Result<BenchFixture, String> {
    // A current context for the caller's allocations, as in engine_load_ms.
    let ctx = cudarc::driver::CudaContext::new(opts.device).map_err(|e| format!("{e:?}"))?;
    let m = &plan.model;
    let act = plan.capture.dtype;
    let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let mut bufs: Vec<DeviceBuf> = Vec::new();
    let fill = |bufs: &mut Vec<DeviceBuf>, bytes: usize| -> Result<u64, String> {
        let d = DeviceBuf::new(bytes)?;
        d.fill(0x3c, std::ptr::null_mut())?;
        let p = d.ptr;
        bufs.push(d);
        Ok(p)
    };
    let mut weights = HashMap::new();
    for w in &plan.weights {
        let ptr = fill(&mut bufs, w.bytes as usize)?;
        if w.dtype == DType::I64 {
            // A byte pattern is no id map (its ids would leave the vocabulary, or repeat):
            // d2t's zero offsets, the hot ids 0, 1, 2, ...
            let n = (w.bytes / 8) as i64;
            let ids: Vec<i64> = if w.name == "d2t" {
                vec![0; n as usize]
            } else {
                (0..n).collect()
            };
            let z = upload(&mut bufs, &ids)?;
            weights.insert(
                w.name.clone(),
                DeviceTensor {
                    ptr: z,
                    dtype: w.dtype,
                    shape: w.shape.clone(),
                },
            );
            continue;
        }
        weights.insert(
            w.name.clone(),
            DeviceTensor {
                ptr,
                dtype: w.dtype,
                shape: w.shape.clone(),
            },
        );
    }
    let stride = (m.kv_heads * m.head_dim) as u64;
    let slots = (b * (l + n)) as u64 + 16;
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for _ in 0..m.layers {
        k.push(fill(&mut bufs, (slots * stride * act.size()) as usize)?);
        v.push(fill(&mut bufs, (slots * stride * act.size()) as usize)?);
    }
    let cols = l + n;
    let order = Rng(0x5eed_0000 + slots).permutation(b * cols);
    let table: Vec<i32> = order.iter().map(|&t| t as i32).collect();
    let tp = upload(&mut bufs, &table)?;
    let mem = EngineMemory {
        kv: KvRegistration::dense(k, v, slots, stride, plan.model.head_dim as u64),
        table: TableRegistration {
            ptr: tp,
            mode: TableMode::TokenSlots,
            rows: b as u64,
            cols: cols as u64,
            stride: cols as u64,
            page_size: 1,
        },
        weights: &weights,
    };
    let runtime = GpuRuntime::with_engine_memory(plan.clone(), mem, opts).map_err(err)?;
    let stream = runtime.context().new_stream().map_err(|e| format!("{e:?}"))?;
    let ids: Vec<i64> = (0..b * n).map(|i| (i % 1000) as i64).collect();
    let rows: Vec<i64> = (0..b as i64).collect();
    let prefix = vec![l as i32; b];
    let accept = vec![n as i32; b];
    let hidden = fill(&mut bufs, b * n * m.hidden_in() as usize * act.size() as usize)?;
    let (k_, h) = (plan.spec.topk as usize, m.hidden as usize);
    let step = DeviceStep {
        b,
        input_ids: upload(&mut bufs, &ids)?,
        ids_i32: false,
        hidden_states: hidden,
        req_pool_indices: DeviceInts {
            ptr: upload(&mut bufs, &rows)?,
            i32: false,
        },
        prefix_lens: DeviceInts {
            ptr: upload(&mut bufs, &prefix)?,
            i32: true,
        },
        accept_lens: DeviceInts {
            ptr: upload(&mut bufs, &accept)?,
            i32: true,
        },
        accept_form: specplan_runtime::gpu::AcceptForm::Lengths,
        prefix_bias: 0,
        outputs: DeviceOutputs {
            topk_p: fill(&mut bufs, b * k_ * 4)?,
            topk_index: fill(&mut bufs, b * k_ * 8)?,
            hidden_states: fill(&mut bufs, b * h * act.size() as usize)?,
            logits: 0,
        },
        stream: stream.cu_stream() as u64,
    };
    result::ctx::synchronize().map_err(|e| format!("{e:?}"))?;
    Ok(BenchFixture {
        _bufs: bufs,
        runtime,
        step,
        stream,
        _ctx: ctx,
    })
}

/// One engine-memory step at batch `b` (for the sanitizers: little work, every kernel).
pub fn engine_once(plan: &ValidatedPlan, rng: &mut Rng, layout: Layout, b: usize) -> Result<(), String> {
    let weights = crate::random::random_weights(plan, rng);
    let c = make_case(plan, rng, b, 40);
    let fx = fixture(plan, &c, &weights, layout, false, rng)?;
    let mem = EngineMemory {
        kv: fx.kv.clone(),
        table: fx.table.clone(),
        weights: &fx.weights,
    };
    let mut eng = GpuRuntime::with_engine_memory(plan.clone(), mem, GpuOptions::default()).map_err(err)?;
    let stream = eng.context().new_stream().map_err(|e| format!("{e:?}"))?;
    engine_step(
        &mut eng,
        &c.step,
        &c.hidden_bits,
        &fx.rows,
        Ints::Sglang,
        stream.cu_stream() as u64,
        None,
    )?;
    match eng.last_error().map_err(err)? {
        None => Ok(()),
        Some(e) => Err(e.to_string()),
    }
}
