//! The CPU reference executor: runs a plan's launch list for one bucket in f32.
//!
//! It interprets exactly what the GPU runtime replays — the same launches, the same
//! arguments, the same arena offsets — with plain loops, so it is the oracle for GPU tests
//! and it exercises the memory plan itself: the arena is one array in which every buffer
//! lives at its planned offset (one f64 cell per 2 bytes, so bf16, f32, i32 and i64
//! values are all held exactly), and two buffers that wrongly share bytes while live
//! corrupt each other here just as they would on the device.
//!
//! Math is f32 as the kernels do it (reductions accumulate in f64, a slightly better
//! oracle); activations are not rounded to bf16 between ops. The maths of each entry is
//! written here from the kernel's documented contract (`entries.rs`), never derived from
//! the kernels. Every access is bounds-checked: a plan `validate` accepts runs here
//! without a panic, and bad data (a page outside the pool) is an error, not a fault.

mod audit;
pub mod collective;
mod eagle3;
pub mod engine;
pub mod engine_decode;
mod entries;
mod gemm;
mod kv;
mod topk;
mod tree;

use specplan_format::io;
use specplan_format::PhaseKind;
use std::borrow::Cow;

pub use audit::{audit_bucket, synthetic_weights, Audit, AuditError, AuditLimits};
pub use kv::{KvPool, KvStore, StridedKv};
use specplan_format::{
    ArgValue, BucketPlan, CollectiveDesc, CollectiveOp, DType, KernelDesc, KvKind, LaunchKind, Plan, ValidatedPlan,
};
use specplan_kernels::abi::{KernelParams, Slot};
use specplan_kernels::entries::{attention, embed, mlp, norm, rope, sample, select, tree as tree_entries};
use specplan_kernels::Entry;

use crate::step::{BucketInputs, PageTable};

/// A weight in host memory (floats as f32; the FR-Spec id map as i64).
#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

impl WeightData {
    pub fn len(&self) -> usize {
        match self {
            WeightData::F32(v) => v.len(),
            WeightData::I64(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Outputs for the bucket's rows (the caller slices the real requests).
#[derive(Clone, Debug, PartialEq)]
pub struct BucketOutputs {
    pub hidden_out: Vec<f32>,
    /// Empty when the plan emits no top-K (`capture.outputs`).
    pub topk_probs: Vec<f32>,
    pub topk_ids: Vec<i64>,
    /// `[B, logits_cols]`; empty when the plan emits no logits.
    pub logits: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error("launch {launch} ({op}): {message}")]
    Launch { launch: usize, op: String, message: String },
    #[error("weights: {0}")]
    Weights(String),
    #[error("the bucket's arena of {bytes} bytes exceeds the CPU executor's limit of {limit}")]
    TooLarge { bytes: u64, limit: u64 },
    #[error("{0}")]
    Setup(String),
}

/// Largest arena the CPU executor holds (it keeps 4 bytes of f64 cells per arena byte).
pub const MAX_CPU_ARENA_BYTES: u64 = 1 << 30;

pub struct CpuExecutor<'p> {
    plan: &'p Plan,
    weights: Cow<'p, [WeightData]>,
    /// The ranks' communicator of a sharded plan (`capture.tp`).
    comm: Option<&'p dyn collective::Communicator>,
    /// Round every value stored into a 16-bit float buffer or the K/V store to that type,
    /// as the device's memory does ([`CpuExecutor::storing_rounded`]); off for the oracle.
    rounded: bool,
}

/// The executor's state after host prep (`launch: None`) and after each launch, for
/// [`CpuExecutor::run_observed`]. Cell `i` holds the element that starts at arena byte `2i`
/// (one f64 cell per 2 arena bytes; an element lives in the cell of its first byte).
pub struct Observed<'a> {
    pub launch: Option<usize>,
    pub cells: &'a [f64],
    pub kv: &'a KvPool,
}

/// What `run_core` shows after host prep (`None`) and after each launch: the arena cells,
/// the launch index and the K/V store.
type Observer<'a, K> = dyn FnMut(&[f64], Option<usize>, &K) + 'a;

/// A resolved pointer argument.
#[derive(Clone, Copy, Debug)]
enum Ptr {
    Buf(usize),
    Weight(usize),
    Kv(usize, KvKind),
    Table,
    Layout,
    /// The runtime's arrival counters (`Ctx::counters`).
    Counters,
    Null,
}

struct Ctx<'a, K: KvStore> {
    plan: &'a Plan,
    bucket: &'a BucketPlan,
    weights: &'a [WeightData],
    cells: Vec<f64>,
    kv: &'a mut K,
    table: &'a PageTable,
    /// Stores rounded to 16-bit buffers' types and the cache's (`CpuExecutor::rounded`).
    rounded: bool,
    /// The runtime's arrival counters (`kv::COUNTER_WORDS`): zero at the start of a step, as
    /// the device's are at load, and zero again after every launch that counts.
    counters: Vec<u32>,
}

type R<T> = Result<T, String>;

impl<'p> CpuExecutor<'p> {
    /// `weights[i]` is the plan's weight `i`, already packed (see `specplan_contract::load_weights`).
    pub fn new(plan: &'p ValidatedPlan, weights: Vec<WeightData>) -> Result<Self, ExecError> {
        Self::with_weights(plan, Cow::Owned(weights))
    }

    /// As [`CpuExecutor::new`], borrowing the weights (runs of many plans over one set).
    pub fn borrowing(plan: &'p ValidatedPlan, weights: &'p [WeightData]) -> Result<Self, ExecError> {
        Self::with_weights(plan, Cow::Borrowed(weights))
    }

    fn with_weights(plan: &'p ValidatedPlan, weights: Cow<'p, [WeightData]>) -> Result<Self, ExecError> {
        if weights.len() != plan.weights.len() {
            return Err(ExecError::Weights(format!(
                "{} weights given, the plan has {}",
                weights.len(),
                plan.weights.len()
            )));
        }
        for (w, d) in plan.weights.iter().zip(weights.iter()) {
            let n = w.shape.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
            if n != Some(d.len() as u64) {
                return Err(ExecError::Weights(format!(
                    "{}: {} elements, expected {:?}",
                    w.name,
                    d.len(),
                    w.shape
                )));
            }
        }
        Ok(CpuExecutor {
            plan,
            weights,
            comm: None,
            rounded: false,
        })
    }

    /// The same executor with the device's storage precision: every value stored into a
    /// bf16/f16 buffer or the K/V cache is rounded to that type (the math between stores
    /// stays f32/f64). Not an oracle: it predicts how far the device's results lie from the
    /// exact executor's, from the plan's buffer types alone (`specplan-tests`' numerics
    /// test compares a plan's two runs).
    pub fn storing_rounded(mut self) -> Self {
        self.rounded = true;
        self
    }

    /// The executor of one rank of a sharded plan, meeting the other ranks' executors at
    /// every collective launch through `comm` (a group of the plan's `capture.tp.size`).
    pub fn with_communicator(mut self, comm: &'p dyn collective::Communicator) -> Result<Self, ExecError> {
        let tp = self.plan.capture.tp;
        if comm.size() != tp.size {
            return Err(ExecError::Setup(format!(
                "capture.tp: a communicator of {} ranks for a plan of tp size {}",
                comm.size(),
                tp.size
            )));
        }
        self.comm = Some(comm);
        Ok(self)
    }

    /// Runs one bucket on padded inputs, updating `kv` in place.
    pub fn run(
        &self,
        bucket: &BucketPlan,
        inputs: &BucketInputs,
        table: &PageTable,
        kv: &mut KvPool,
    ) -> Result<BucketOutputs, ExecError> {
        self.run_observed(bucket, inputs, table, kv, &mut |_| {})
    }

    /// As [`CpuExecutor::run`], showing `observe` the arena and the pool after host prep
    /// and after every launch (audits of what each launch writes).
    pub fn run_observed(
        &self,
        bucket: &BucketPlan,
        inputs: &BucketInputs,
        table: &PageTable,
        kv: &mut KvPool,
        observe: &mut dyn FnMut(Observed<'_>),
    ) -> Result<BucketOutputs, ExecError> {
        let mut dense = kv::DenseKv::new(self.plan, kv);
        self.run_core(bucket, inputs, table, &mut dense, &mut |cells, launch, kv| {
            observe(Observed {
                launch,
                cells,
                kv: kv.pool(),
            })
        })
    }

    /// Runs one bucket on padded inputs over any K/V store (an engine's pool in place:
    /// [`StridedKv`]).
    pub fn run_on<K: KvStore>(
        &self,
        bucket: &BucketPlan,
        inputs: &BucketInputs,
        table: &PageTable,
        kv: &mut K,
    ) -> Result<BucketOutputs, ExecError> {
        self.run_core(bucket, inputs, table, kv, &mut |_, _, _| {})
    }

    /// Runs one bucket of phase `kind` on padded inputs given by name (each staged input of
    /// the phase's signature, `f64` values), updating `kv` in place; returns every output
    /// buffer of the bucket by name.
    pub fn run_named(
        &self,
        kind: PhaseKind,
        bucket: &BucketPlan,
        inputs: &[(&str, Vec<f64>)],
        table: &PageTable,
        kv: &mut KvPool,
    ) -> Result<Vec<(String, Vec<f64>)>, ExecError> {
        self.run_named_reading(kind, bucket, inputs, table, kv, &[])
    }

    /// As [`CpuExecutor::run_named`], over any K/V store (an engine's pool in place).
    pub fn run_named_on<K: KvStore>(
        &self,
        kind: PhaseKind,
        bucket: &BucketPlan,
        inputs: &[(&str, Vec<f64>)],
        table: &PageTable,
        kv: &mut K,
    ) -> Result<Vec<(String, Vec<f64>)>, ExecError> {
        self.run_raw(kind, bucket, inputs, table, kv, &[], &mut |_, _, _| {})
    }

    /// As [`CpuExecutor::run_named`], also returning the buffers named in `extra` as the last
    /// launch left them (the caller names buffers still live there: a check comparing the
    /// GPU's intermediate values, such as a draft-decode tree's `token_list`).
    pub fn run_named_reading(
        &self,
        kind: PhaseKind,
        bucket: &BucketPlan,
        inputs: &[(&str, Vec<f64>)],
        table: &PageTable,
        kv: &mut KvPool,
        extra: &[&str],
    ) -> Result<Vec<(String, Vec<f64>)>, ExecError> {
        let mut dense = kv::DenseKv::new(self.plan, kv);
        self.run_raw(kind, bucket, inputs, table, &mut dense, extra, &mut |_, _, _| {})
    }

    fn run_core<K: KvStore>(
        &self,
        bucket: &BucketPlan,
        inputs: &BucketInputs,
        table: &PageTable,
        kv: &mut K,
        observe: &mut Observer<'_, K>,
    ) -> Result<BucketOutputs, ExecError> {
        let named: [(&str, Vec<f64>); 5] = [
            (io::INPUT_IDS, inputs.input_ids.iter().map(|&x| x as f64).collect()),
            (
                io::HIDDEN_STATES,
                inputs.hidden_states.iter().map(|&x| x as f64).collect(),
            ),
            (io::PREFIX_LENS, inputs.prefix_lens.iter().map(|&x| x as f64).collect()),
            (io::ACCEPT_LENS, inputs.accept_lens.iter().map(|&x| x as f64).collect()),
            (io::REQ_SLOTS, inputs.req_slots.iter().map(|&x| x as f64).collect()),
        ];
        let outs = self.run_raw(PhaseKind::DraftExtend, bucket, &named, table, kv, &[], observe)?;
        let get = |name: &str| {
            outs.iter()
                .find(|(n, _)| n == name)
                .map_or_else(Vec::new, |(_, v)| v.clone())
        };
        Ok(BucketOutputs {
            hidden_out: get(io::HIDDEN_OUT).into_iter().map(|x| x as f32).collect(),
            topk_probs: get(io::TOPK_PROBS).into_iter().map(|x| x as f32).collect(),
            topk_ids: get(io::TOPK_IDS).into_iter().map(|x| x as i64).collect(),
            logits: get(specplan_kernels::io::LOGITS)
                .into_iter()
                .map(|x| x as f32)
                .collect(),
        })
    }

    #[allow(clippy::too_many_arguments)] // the run's parts, each passed through from a public entry
    fn run_raw<K: KvStore>(
        &self,
        kind: PhaseKind,
        bucket: &BucketPlan,
        inputs: &[(&str, Vec<f64>)],
        table: &PageTable,
        kv: &mut K,
        extra: &[&str],
        observe: &mut Observer<'_, K>,
    ) -> Result<Vec<(String, Vec<f64>)>, ExecError> {
        if bucket.arena_bytes > MAX_CPU_ARENA_BYTES {
            return Err(ExecError::TooLarge {
                bytes: bucket.arena_bytes,
                limit: MAX_CPU_ARENA_BYTES,
            });
        }
        if !kv.fits(self.plan) || table.data.len() != table.rows * table.cols {
            return Err(ExecError::Setup(
                "the KV pool or page table does not have the plan's layout".into(),
            ));
        }
        let cells = (bucket.arena_bytes as usize).div_ceil(2);
        let mut arena = Vec::new();
        arena
            .try_reserve_exact(cells)
            .map_err(|e| ExecError::Setup(format!("arena: {e}")))?;
        // Poison: every cell starts NaN, so a read of anything no launch wrote shows up.
        arena.resize(cells, f64::NAN);
        let mut ctx = Ctx {
            plan: self.plan,
            bucket,
            weights: &self.weights,
            cells: arena,
            kv,
            table,
            rounded: self.rounded,
            counters: vec![0; specplan_kernels::kv::COUNTER_WORDS],
        };
        let setup = |e: String| ExecError::Setup(format!("inputs: {e}"));
        for (name, values) in inputs {
            ctx.store_input(name, values.iter().copied()).map_err(setup)?;
        }
        let prefixes: Vec<i32> = inputs
            .iter()
            .find(|(n, _)| *n == io::PREFIX_LENS)
            .map_or_else(Vec::new, |(_, v)| v.iter().map(|&x| x as i32).collect());
        check_prefixes(self.plan, kind, &prefixes).map_err(setup)?;
        observe(&ctx.cells, None, ctx.kv);
        for (li, launch) in bucket.launches.iter().enumerate() {
            let err = |message: String| ExecError::Launch {
                launch: li,
                op: launch.op.clone(),
                message,
            };
            match &launch.kind {
                LaunchKind::Gemm(g) => ctx.gemm(g).map_err(err)?,
                LaunchKind::Collective(c) => ctx.collective(c, self.comm).map_err(err)?,
                LaunchKind::Kernel { kernel, grid, args, .. } => {
                    let k = self
                        .plan
                        .kernels
                        .get(*kernel as usize)
                        .ok_or_else(|| err("no such kernel".into()))?;
                    ctx.kernel(k, *grid, args).map_err(err)?
                }
            }
            observe(&ctx.cells, Some(li), ctx.kv);
        }
        let out = |e: String| ExecError::Setup(format!("outputs: {e}"));
        bucket
            .buffers
            .iter()
            .filter(|b| b.role == specplan_format::BufferRole::Output || extra.contains(&b.name.as_str()))
            .map(|b| Ok((b.name.clone(), ctx.load_named(&b.name).map_err(out)?)))
            .collect()
    }
}

/// The admission rule the kernels rely on (`admission::check_lengths`): every prefix in
/// `[0, max_context_len - N]` (draft decode: with its lanes' reach within `max_context_len`).
/// The attention's work grows with the prefix, so an executor given an unchecked one could
/// loop for as long as an i32 allows.
fn check_prefixes(plan: &Plan, kind: PhaseKind, prefix_lens: &[i32]) -> R<()> {
    for (i, &l) in prefix_lens.iter().enumerate() {
        crate::admission::check_prefix(plan, kind, i, l).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn by_runtime(e: Entry) -> String {
    format!("{e} is launched by the GPU runtime itself, never by a plan")
}

/// The typed arguments of entry `K` from a launch's resolved argument list.
fn typed<P: KernelParams>(slots: &[Slot<Ptr>]) -> R<(P::Ptrs<Ptr>, P::Scalars)> {
    P::split(slots).ok_or_else(|| format!("arguments do not match {}", P::C_NAME))
}

impl<K: KvStore> Ctx<'_, K> {
    fn elems(&self, buf: usize) -> usize {
        self.bucket
            .buffers
            .get(buf)
            .map_or(0, |b| (b.bytes / b.dtype.size()) as usize)
    }
    fn cell(&self, buf: usize, elem: usize) -> R<usize> {
        let b = self.bucket.buffers.get(buf).ok_or_else(|| format!("no buffer {buf}"))?;
        if elem >= self.elems(buf) {
            return Err(format!(
                "element {elem} outside %{} ({} elements)",
                b.name,
                self.elems(buf)
            ));
        }
        let c = (b.offset as usize + elem * b.dtype.size() as usize) / 2;
        if c >= self.cells.len() {
            return Err(format!("%{} lies outside the arena", b.name));
        }
        Ok(c)
    }
    fn ld(&self, buf: usize, elem: usize) -> R<f64> {
        Ok(self.cells[self.cell(buf, elem)?])
    }
    fn st(&mut self, buf: usize, elem: usize, v: f64) -> R<()> {
        let c = self.cell(buf, elem)?;
        self.cells[c] = match self.bucket.buffers.get(buf).map(|b| b.dtype) {
            Some(d @ (DType::Bf16 | DType::F16)) if self.rounded => crate::bits::round_act(v as f32, d) as f64,
            _ => v,
        };
        Ok(())
    }
    fn store_input(&mut self, name: &str, values: impl Iterator<Item = f64>) -> R<()> {
        if let Some((id, _)) = self.bucket.buffer(name) {
            for (e, v) in values.enumerate() {
                self.st(id as usize, e, v)?;
            }
        }
        Ok(())
    }
    fn load_named(&self, name: &str) -> R<Vec<f64>> {
        match self.bucket.buffer(name) {
            Some((id, _)) => (0..self.elems(id as usize)).map(|e| self.ld(id as usize, e)).collect(),
            None => Ok(Vec::new()),
        }
    }
    /// A collective launch through the ranks' communicator: the all-reduce sums every
    /// rank's values in rank order, the all-gather lays them out rank-major.
    fn collective(&mut self, c: &CollectiveDesc, comm: Option<&dyn collective::Communicator>) -> R<()> {
        let tp = self.plan.capture.tp;
        let comm = comm.ok_or_else(|| {
            format!(
                "a {} of a plan of tp size {}: the CPU executor runs a sharded plan only with its ranks' communicator (CpuExecutor::with_communicator)",
                c.op.name(),
                tp.size
            )
        })?;
        let (send, recv, n) = (c.send as usize, c.recv as usize, c.count as usize);
        // The values after a tag of the op, so ranks meeting at different collectives are an
        // error, not a silent mix.
        let tag = match c.op {
            CollectiveOp::AllReduceSum => 1.0,
            CollectiveOp::AllGather => 2.0,
        };
        let mut mine = Vec::with_capacity(n + 1);
        mine.push(tag);
        for i in 0..n {
            mine.push(self.ld(send, i)?);
        }
        let all = comm.exchange(tp.rank, mine)?;
        if all.len() != tp.size as usize || all.iter().any(|v| v.len() != n + 1 || v[0] != tag) {
            return Err(format!(
                "the ranks met at a {} with different collectives or counts",
                c.op.name()
            ));
        }
        let all: Vec<&[f64]> = all.iter().map(|v| &v[1..]).collect();
        match c.op {
            CollectiveOp::AllReduceSum => {
                for i in 0..n {
                    let sum = all.iter().map(|v| v[i]).fold(0.0, |a, x| a + x);
                    self.st(recv, i, sum)?;
                }
            }
            CollectiveOp::AllGather => {
                for (r, v) in all.iter().enumerate() {
                    for (i, &x) in v.iter().enumerate() {
                        self.st(recv, r * n + i, x)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Element `i` of weight `w` (floats and ids alike, as f64).
    fn wf(&self, w: usize, i: usize) -> R<f64> {
        match self.weights.get(w) {
            Some(WeightData::F32(v)) => v.get(i).map(|x| *x as f64),
            Some(WeightData::I64(v)) => v.get(i).map(|x| *x as f64),
            None => None,
        }
        .ok_or_else(|| format!("weight {w} has no element {i}"))
    }

    fn resolve(&self, v: &ArgValue) -> Slot<Ptr> {
        Slot::Ptr(match v {
            ArgValue::U32(x) => return Slot::U32(*x),
            ArgValue::Buffer(id) => Ptr::Buf(*id as usize),
            ArgValue::Weight(id) => Ptr::Weight(*id as usize),
            ArgValue::KvCache { layer, kind } => Ptr::Kv(*layer as usize, *kind),
            ArgValue::PageTable => Ptr::Table,
            ArgValue::KvLayout => Ptr::Layout,
            ArgValue::Counters => Ptr::Counters,
            ArgValue::Null => Ptr::Null,
        })
    }

    /// One kernel launch: an exhaustive dispatch over the entries.
    fn kernel(&mut self, k: &KernelDesc, grid: [u32; 3], args: &[ArgValue]) -> R<()> {
        let slots: Vec<Slot<Ptr>> = args.iter().map(|a| self.resolve(a)).collect();
        match k.entry {
            Entry::EmbedConcat => {
                let (p, s) = typed::<embed::EmbedConcatParams>(&slots)?;
                self.embed_concat(k, &p, &s)
            }
            Entry::EmbedNormConcat => {
                let (p, s) = typed::<embed::EmbedNormConcatParams>(&slots)?;
                self.embed_norm_concat(k, &p, &s)
            }
            Entry::SelectNorm => {
                let (p, s) = typed::<select::SelectNormParams>(&slots)?;
                self.select_norm(k, &p, &s)
            }
            Entry::NormConcat => {
                let (p, s) = typed::<norm::NormConcatParams>(&slots)?;
                self.norm_concat(k, &p, &s)
            }
            Entry::RmsNorm => {
                let (p, s) = typed::<norm::RmsNormParams>(&slots)?;
                self.rmsnorm(k, &p, &s)
            }
            Entry::CastRows => {
                let (p, s) = typed::<norm::CastRowsParams>(&slots)?;
                self.cast_rows(k, &p, &s)
            }
            Entry::NormCast => {
                let (p, s) = typed::<norm::NormCastParams>(&slots)?;
                self.norm_cast(k, &p, &s)
            }
            Entry::RopeAppend => {
                let (p, s) = typed::<rope::RopeAppendParams>(&slots)?;
                self.rope_append(k, &p, &s)
            }
            Entry::AttnPartial => {
                let (p, s) = typed::<attention::AttnPartialParams>(&slots)?;
                self.attn_partial(k, grid, &p, &s)
            }
            Entry::AttnFused => {
                let (p, s) = typed::<attention::AttnFusedParams>(&slots)?;
                self.attn_fused(k, grid, &p, &s)
            }
            Entry::AttnMerge => {
                let (p, s) = typed::<attention::AttnMergeParams>(&slots)?;
                self.attn_merge(k, &p, &s)
            }
            Entry::SiluMul => {
                let (p, s) = typed::<mlp::SiluMulParams>(&slots)?;
                self.silu_mul(k, &p, &s)
            }
            Entry::SiluMulPairs => {
                let (p, s) = typed::<mlp::SiluMulPairsParams>(&slots)?;
                self.silu_mul_pairs(k, &p, &s)
            }
            Entry::SelectNormPairs => {
                let (p, s) = typed::<select::SelectNormPairsParams>(&slots)?;
                self.select_norm_pairs(k, &p, &s)
            }
            Entry::SelectRows => {
                let (p, s) = typed::<select::SelectRowsParams>(&slots)?;
                self.select_rows(k, &p, &s)
            }
            Entry::SoftmaxTopk => {
                let (p, s) = typed::<sample::SoftmaxTopkParams>(&slots)?;
                self.softmax_topk(k, &p, &s)
            }
            Entry::TopkPartial => {
                let (p, s) = typed::<sample::TopkPartialParams>(&slots)?;
                self.topk_partial(k, &p, &s)
            }
            Entry::LogitsGather => {
                let (p, s) = typed::<sample::LogitsGatherParams>(&slots)?;
                self.logits_gather(k, &p, &s)
            }
            Entry::TopkMerge => {
                let (p, s) = typed::<sample::TopkMergeParams>(&slots)?;
                self.topk_merge(k, &p, &s)
            }
            Entry::TopkFused => {
                let (p, s) = typed::<sample::TopkFusedParams>(&slots)?;
                self.topk_fused(k, &p, &s)
            }
            Entry::TreeInit => {
                let (p, s) = typed::<tree_entries::TreeInitParams>(&slots)?;
                self.tree_init(k, &p, &s)
            }
            Entry::TreeSelect => {
                let (p, s) = typed::<tree_entries::TreeSelectParams>(&slots)?;
                self.tree_select(k, &p, &s)
            }
            Entry::TreeFinish => {
                let (p, s) = typed::<tree_entries::TreeFinishParams>(&slots)?;
                self.tree_finish(k, &p, &s)
            }
            Entry::TreeVerify => {
                let (p, s) = typed::<tree_entries::TreeVerifyParams>(&slots)?;
                self.tree_verify(k, &p, &s)
            }
            Entry::GatherRows => {
                let (p, s) = typed::<tree_entries::GatherRowsParams>(&slots)?;
                self.gather_rows(k, &p, &s)
            }
            // Never plan launches (validation refuses one); skinny_gemm stands in for a GEMM.
            Entry::Admit | Entry::Emit | Entry::AdmitDecode | Entry::EmitDecode => Err(by_runtime(k.entry)),
            Entry::Fill | Entry::SkinnyGemm | Entry::StageIn | Entry::L2Prefetch | Entry::GemmRound => {
                Err(by_runtime(k.entry))
            }
        }
    }
}
