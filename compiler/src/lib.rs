//! specplan compiler: model + speculative + capture config → a static replay plan.
//!
//! The stages, in order ([`compile`] runs them; each has its own IR and printer; see
//! ARCHITECTURE.md):
//! 1. `config::resolve`   inputs → `Config`
//! 2. `lower::lower`      `Config` → unfused `OpGraph`          (then `verify::graph`)
//! 3. `passes::run`       fusion, recorded as `FusionRecord`s   (then `verify::graph`)
//! 4. `analysis`          replay verdict per bucket
//! 5. `schedule`          per bucket: arena offsets, launch list; kernel table
//! 6. `jit`               NVRTC: CUBIN + PTX per kernel (when a `Jit` is given), cached
//! 7. `emit`              → `Plan`, validated by the format crate's own `validate`
//!
//! Architecture invariant: the compiler never touches a GPU; its only device-adjacent
//! dependency is NVRTC (cudarc's `nvrtc` feature, loaded at run time).

pub mod analysis;
pub mod codegen;
pub mod config;
pub mod error;
pub mod graph;
pub mod jit;
pub mod lower;
pub mod nvrtc_locate;
pub mod passes;
pub mod schedule;
pub mod verify;

use std::collections::BTreeMap;

use specplan_format::{
    io_facts, kernel_facts, phase_facts, validate, CaptureDesc, LayerDesc, ModelDesc, Phase, PhaseKind, Plan, SpecDesc,
    TargetDesc, ValidatedPlan, WeightDesc,
};

pub use config::{Config, Overrides, Source};
pub use error::CompileError;
use graph::{OpGraph, Storage, TensorId};

/// Replaces every kernel binary of a validated plan with one compiled here, by `jit`, from
/// the plan's own (validated) constants and our templates — so the machine code that runs is
/// what this machine's NVRTC makes of sources we ship, not what the plan file carried (see
/// ARCHITECTURE.md, "Trust model"). The result is validated again.
pub fn rebuild_kernels(plan: &ValidatedPlan, jit: &jit::Jit) -> Result<ValidatedPlan, CompileError> {
    let mut p = plan.plan().clone();
    let mut sources = Vec::with_capacity(p.kernels.len());
    for k in &p.kernels {
        let src = specplan_format::kernel_source(plan, k)
            .ok_or_else(|| CompileError::Rebuild(format!("kernel {}: no source for its constants", k.name)))?;
        sources.push(src);
    }
    for k in &mut p.kernels {
        k.binary = None;
    }
    jit.compile_all(&mut p.kernels, &sources, p.target.sm)?;
    validate(p).map_err(|e| CompileError::Rebuild(e.to_string()))
}

/// Target facts the plan is specialized for.
#[derive(Clone, Debug)]
pub struct Target {
    /// SM architecture (90 = Hopper).
    pub sm: u32,
    /// Multiprocessors, used to choose the attention's KV split per bucket.
    pub sm_count: u32,
    /// Merge the attention's KV splits inside a thread block cluster (sm_90+) instead of
    /// with `attn_merge`. Off by default: on the H200 it measured slower for GQA heads
    /// (llama3-8b-eagle N 16: +4–17 µs a step at B 1–8) and even for MHA (docs/perf-notes.md,
    /// item 19); kept for the API and its tests.
    pub attn_cluster: bool,
    /// Merge a split top-K row in the last of its CTAs to finish (`topk_fused`, counting on
    /// the runtime's arrival counters) instead of a `topk_merge` launch after the records
    /// (docs/perf-notes.md, item 38). Unsharded rows only.
    pub topk_last_cta: bool,
    /// Merge a bucket's attention splits in the last CTA of each (request, kv head) to
    /// finish (the runtime's arrival counters) instead of with `attn_merge`, for instances of
    /// at most `ATTN_LAST_CTA_ROWS` packed rows a CTA — the draft-extend head's selected query
    /// rows, MHA and other small N·G layers, draft decode's lanes. Off by default: on the H200
    /// the fused launch measured 0.3–1.0 µs slower than the two launches at B 1 and no faster
    /// at B 8 (docs/perf-notes.md, item 52); kept for the API and its tests.
    pub attn_last_cta: bool,
}

impl Default for Target {
    /// H100/H200 SXM.
    fn default() -> Self {
        Target {
            sm: 90,
            sm_count: 132,
            attn_cluster: false,
            topk_last_cta: true,
            attn_last_cta: false,
        }
    }
}

/// Everything a compile produced, for printing any stage.
pub struct Compiled {
    pub plan: ValidatedPlan,
    /// The draft-extend phase's graphs before and after fusion.
    pub unfused: OpGraph,
    pub fused: OpGraph,
    /// Every other phase's fused graph, in the plan's phase order.
    pub phase_graphs: Vec<(PhaseKind, OpGraph)>,
    pub jit: Option<jit::JitStats>,
}

/// The plan-wide descriptors of a config.
pub(crate) struct Descs {
    model: ModelDesc,
    spec: SpecDesc,
    capture: CaptureDesc,
    inv_freq: Vec<f32>,
}

pub(crate) fn descs(cfg: &Config) -> Descs {
    let c = &cfg.capture;
    Descs {
        model: cfg.model.desc.clone(),
        spec: cfg.spec.clone(),
        capture: CaptureDesc {
            page_size: c.page_size,
            max_context_len: c.max_context_len,
            max_pages_per_request: c.pages_per_request(),
            kv_pool_pages: c.kv_pool_pages,
            max_requests: c.max_requests,
            // The last page: requests get pages from the front of the pool.
            scratch_page: c.kv_pool_pages - 1,
            dtype: c.dtype,
            hot_vocab_size: c.hot_vocab_size,
            outputs: c.outputs,
            decode_verify: c.decode_verify,
            tp: c.tp,
        },
        inv_freq: config::rope_inv_freq(&cfg.model.desc),
    }
}

/// The phases a config compiles, in plan order: draft-extend, then each draft-decode tier.
pub fn phase_kinds(cfg: &Config) -> Vec<PhaseKind> {
    let mut kinds = vec![PhaseKind::DraftExtend];
    kinds.extend(
        cfg.capture
            .decode_steps
            .iter()
            .map(|&steps| PhaseKind::DraftDecode { steps }),
    );
    kinds
}

/// One phase after lowering and fusion.
struct Lowered {
    kind: PhaseKind,
    unfused: OpGraph,
    fused: OpGraph,
    order: Vec<petgraph::stable_graph::NodeIndex>,
    fusions: Vec<specplan_format::FusionRecord>,
}

fn lower_phase(cfg: &Config, kind: PhaseKind) -> Result<Lowered, CompileError> {
    let n = kind.rows_per_request(&cfg.spec) as u64;
    let unfused = lower::lower(cfg, kind)?;
    verify::graph(&unfused, n)?;
    let mut fused = unfused.clone();
    let fusions = passes::run(&mut fused, cfg);
    verify::graph(&fused, n)?;
    let order = fused
        .topo_order()
        .map_err(|node| verify::VerifyError(vec![format!("n{} is part of a cycle", node.index())]))?;
    Ok(Lowered {
        kind,
        unfused,
        fused,
        order,
        fusions,
    })
}

/// Runs every stage. Kernels are compiled when `jit` is given (plans without binaries are
/// still complete for the CPU executor and for review). `progress(done, total)` is called
/// after each bucket.
pub fn compile(
    cfg: &Config,
    target: &Target,
    jit: Option<&jit::Jit>,
    progress: &dyn Fn(usize, usize),
) -> Result<Compiled, CompileError> {
    let lowered = phase_kinds(cfg)
        .into_iter()
        .map(|kind| lower_phase(cfg, kind))
        .collect::<Result<Vec<_>, _>>()?;
    let d = descs(cfg);
    // Weights are the plan's: laid out once, in first-use order over the phases.
    let graphs: Vec<(&OpGraph, &[petgraph::stable_graph::NodeIndex])> =
        lowered.iter().map(|l| (&l.fused, &l.order[..])).collect();
    let (weights, weight_bytes) = layout_weights(&graphs);
    let mut kernels = codegen::KernelTable::default();
    let total = lowered.len() * cfg.capture.buckets.len();
    let mut phases = Vec::with_capacity(lowered.len());
    let mut fusions = Vec::new();
    for l in &lowered {
        let n = l.kind.rows_per_request(&cfg.spec);
        let facts = phase_facts(&d.model, &d.spec, &d.capture, &d.inv_freq, l.kind);
        let weight_ids = weight_ids(&l.fused, &weights);
        let shared = schedule::Shared {
            g: &l.fused,
            order: &l.order,
            cfg,
            facts: &facts,
            weight_ids: &weight_ids,
            sm_count: target.sm_count,
            clusters: target.attn_cluster && target.sm >= 90,
            topk_last_cta: target.topk_last_cta,
            attn_last_cta: target.attn_last_cta,
            rows_per_request: n,
        };
        let mut buckets = Vec::with_capacity(cfg.capture.buckets.len());
        for &b in &cfg.capture.buckets {
            let replay = analysis::replay_verdict(&l.fused, cfg, b, l.kind);
            buckets.push(schedule::schedule_bucket(&shared, &mut kernels, b, replay)?);
            progress(phases.len() * cfg.capture.buckets.len() + buckets.len(), total);
        }
        fusions.extend(l.fusions.iter().cloned());
        phases.push(Phase {
            kind: l.kind,
            rows_per_request: n,
            buckets,
        });
    }
    // The engine-memory prologues and epilogues (draft-extend's and draft decode's), the fill
    // that stands in for a GEMM library's memset nodes, the skinny GEMM the runtime times
    // beside cuBLASLt, the owned-memory graphs' stage_in, the graphs' L2 prefetch branch and
    // the rounded copy after a cuBLASLt GEMM: launched by the runtime, carried by every plan.
    // The io kernels carry the layers' read window: admission checks the table entries of the
    // prefix positions some layer's attention reads.
    let layers: Vec<LayerDesc> = cfg.model.windows.iter().map(|&window| LayerDesc { window }).collect();
    let facts = kernel_facts(&d.model, &d.spec, &d.capture, &d.inv_freq);
    let io = io_facts(&facts, &layers);
    kernels.intern(specplan_kernels::Entry::Admit, &io);
    kernels.intern(specplan_kernels::Entry::Emit, &io);
    kernels.intern(specplan_kernels::Entry::AdmitDecode, &io);
    kernels.intern(specplan_kernels::Entry::EmitDecode, &io);
    kernels.intern(specplan_kernels::Entry::Fill, &io);
    kernels.intern(specplan_kernels::Entry::SkinnyGemm, &facts);
    kernels.intern(specplan_kernels::Entry::StageIn, &io);
    kernels.intern(specplan_kernels::Entry::L2Prefetch, &io);
    kernels.intern(specplan_kernels::Entry::GemmRound, &facts);
    let stats = match jit {
        Some(j) => Some(j.compile_all(&mut kernels.kernels, &kernels.sources, target.sm)?),
        None => None,
    };
    let plan = Plan {
        name: cfg.name.clone(),
        compiler: format!("specplan {}", env!("CARGO_PKG_VERSION")),
        model: d.model,
        spec: d.spec,
        capture: d.capture,
        target: TargetDesc {
            sm: target.sm,
            nvrtc: jit.map(|j| j.version.clone()),
        },
        rope_inv_freq: d.inv_freq,
        layers,
        weights,
        weight_bytes,
        kernels: kernels.kernels,
        fusions,
        phases,
    };
    let mut lowered = lowered.into_iter();
    let first = lowered
        .next()
        .ok_or_else(|| verify::VerifyError(vec!["no phase to compile (a compiler bug)".into()]))?;
    Ok(Compiled {
        plan: validate(plan)?,
        unfused: first.unfused,
        fused: first.fused,
        phase_graphs: lowered.map(|l| (l.kind, l.fused)).collect(),
        jit: stats,
    })
}

/// Each weight tensor of `g` as its index in the plan's weights (by name: one weight however
/// many phases and forwards read it).
fn weight_ids(g: &OpGraph, weights: &[WeightDesc]) -> BTreeMap<TensorId, u32> {
    g.tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| matches!(t.storage, Storage::Weight { .. }))
        .filter_map(|(i, t)| {
            let id = weights.iter().position(|w| w.name == t.name)?;
            Some((TensorId(i as u32), id as u32))
        })
        .collect()
}

/// Weights in first-use order over the phases' graphs, 256-byte aligned in one region; a
/// name is laid out once.
fn layout_weights(graphs: &[(&OpGraph, &[petgraph::stable_graph::NodeIndex])]) -> (Vec<WeightDesc>, u64) {
    let mut descs: Vec<WeightDesc> = Vec::new();
    let mut offset = 0u64;
    for &(g, order) in graphs {
        for &node in order {
            for &t in &g.graph[node].ins {
                let tensor = g.tensor(t);
                let Storage::Weight {
                    sources,
                    packing,
                    shard,
                } = &tensor.storage
                else {
                    continue;
                };
                if descs.iter().any(|w| w.name == tensor.name) {
                    continue;
                }
                let bytes = tensor.bytes_at(0);
                descs.push(WeightDesc {
                    name: tensor.name.clone(),
                    dtype: tensor.dtype,
                    shape: tensor.shape.iter().map(|d| d.fixed).collect(),
                    sources: sources.clone(),
                    packing: packing.clone(),
                    shard: shard.clone(),
                    offset,
                    bytes,
                });
                offset += bytes.div_ceil(256) * 256;
            }
        }
    }
    (descs, offset)
}
