//! The records the GPU binaries write as JSON (through serde; the peer's `report.py` and
//! `docs/bench/` read them).

use serde::Serialize;

/// One checked step of `gpucheck`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CaseReport {
    pub b: usize,
    pub bucket: u32,
    pub hidden_rel: f64,
    pub prob_abs: f64,
    pub kv_rel: f64,
    /// Largest relative RMS error of a request's logits row against the CPU executor (plans
    /// that emit logits; 0 otherwise).
    pub logits_rel: f64,
    pub id_mismatch: usize,
    /// The outputs against the numerics targets (`numerics`: hidden, probabilities, ids).
    pub numerics: crate::numerics::Numerics,
    pub kv_untouched_changed: usize,
    pub graph_vs_eager_diff: usize,
    pub ok: bool,
    pub failures: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct AttentionReport {
    pub b: usize,
    pub rel: f64,
    pub max_abs_over_rms: f64,
    pub ok: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    pub bucket: u32,
    pub replay_us: f64,
    pub prep_us: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct GraphBuild {
    pub bucket: u32,
    pub ms: f64,
}

/// Everything `gpucheck` found for one plan.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PlanReport {
    pub plan: String,
    pub load_ms: f64,
    pub arena_bytes: usize,
    pub kv_bytes: usize,
    pub graph_build: Vec<GraphBuild>,
    pub cases: Vec<CaseReport>,
    pub attention: Vec<AttentionReport>,
    /// The draft-decode phases' checks (`decode_check`).
    pub decode: Vec<crate::decode_check::DecodeReport>,
    pub latency: Vec<Latency>,
    pub errors: Vec<String>,
}

/// Ceilings measured on the device in the same run.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Ceilings {
    pub copy_bytes_per_s: f64,
    pub bf16_flops_per_s: f64,
}

/// One `specbench` draft-decode row: a tier of a plan at batch B, every request at prefix L
/// (owned memory: the phase's graph replayed alone, L2 flushed before each run).
#[derive(Clone, Debug, Serialize)]
pub struct DecodeRow {
    pub plan: String,
    pub phase: String,
    pub batch: usize,
    pub prefix: usize,
    pub topk: u32,
    pub steps: u32,
    pub draft_tokens: u32,
    pub replay_us: f64,
    /// The longer of: the bytes the S − 1 forwards must move (weights per forward, the
    /// prefix K/V once per request and layer, each lane's own slots, the K/V written) over
    /// the copy ceiling; their FLOPs over the bf16 matmul ceiling.
    pub floor_us: f64,
    pub bytes: f64,
    /// Matmul FLOPs of the S − 1 forwards (GEMMs and attention), over the bf16 ceiling.
    pub flops: f64,
}

/// One `specbench` row: a plan at batch B and prefix L.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub plan: String,
    pub batch: usize,
    pub prefix: usize,
    pub pages: &'static str,
    pub prep_us: f64,
    pub replay_us: f64,
    pub full_us: f64,
    pub eager_us: f64,
    /// The step's bytes over the copy ceiling or its FLOPs over the matmul ceiling, whichever
    /// is longer (specbench's `floors`).
    pub floor_us: f64,
    /// The same op by op, summed: what a step running its ops one after another cannot beat.
    pub op_floor_us: f64,
    pub attn_us: f64,
    pub attn_tb_s: f64,
    pub graph_build_ms_all: f64,
    pub gemm_tune_ms: f64,
    pub load_ms: f64,
    pub arena_bytes: usize,
    pub kv_bytes: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct OpTime {
    pub plan: String,
    pub batch: usize,
    pub prefix: usize,
    pub op: String,
    pub us: f64,
}

/// One op's span in a bucket's in-graph timeline (`GpuRuntime::timeline`): its kernels plus
/// the gap since the previous node, µs (median over replays).
#[derive(Clone, Debug, Serialize)]
pub struct SpanTime {
    pub plan: String,
    pub batch: usize,
    pub prefix: usize,
    pub op: String,
    /// `gemm`, `attention` or `kernel`.
    pub class: &'static str,
    pub us: f64,
}

/// A bucket's timeline summed by class, beside the plain replay of the same shape.
#[derive(Clone, Debug, Serialize)]
pub struct Breakdown {
    pub plan: String,
    pub batch: usize,
    pub prefix: usize,
    pub gemm_us: f64,
    pub attention_us: f64,
    pub kernel_us: f64,
    /// First event to last of the instrumented graph.
    pub timeline_us: f64,
    /// The plain graph's replay, µs: `timeline_us − replay_us` is what the event nodes add.
    pub replay_us: f64,
    /// The bucket's GEMM launches: weight bytes (each launch's n·k) and FLOPs (2·m·n·k), the
    /// GEMMs' own floor (the last layer's MLP runs on the selected rows, so m is not B·N
    /// for every layer GEMM).
    pub gemm_weight_bytes: f64,
    pub gemm_flops: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct GemmRecord {
    pub plan: String,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub first_us: f32,
    pub best_us: f32,
    pub rank: usize,
    pub candidates: usize,
    /// The plan's skinny GEMM was kept (the list's last candidate).
    pub skinny: bool,
    /// The parts the shape's cuBLASLt algorithm splits K into (1: none).
    pub split: u32,
}

/// `specbench --gemm-flip`: one GEMM's load-time choice (skinny kernel or cuBLASLt) against
/// the other one, inside the bucket's plan launches captured as one graph (afresh each way,
/// L2 flushed before every replay; the two alternated `rounds` times, medians kept).
#[derive(Clone, Debug, Serialize)]
pub struct GemmFlipRecord {
    pub plan: String,
    pub batch: usize,
    pub prefix: usize,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// The load-time choice was the skinny GEMM.
    pub tuned_skinny: bool,
    /// The graph with the load-time choice, median µs.
    pub tuned_us: f64,
    /// The graph with the other one, median µs (`None`: not switched, `refused` says why).
    pub flipped_us: Option<f64>,
    /// Why the other choice was not timed (the runtime's `GemmFlip`), else `None`.
    pub refused: Option<String>,
    pub rounds: usize,
}

/// One engine-memory `specbench` row: the step on caller memory and the caller's stream.
#[derive(Clone, Debug, Serialize)]
pub struct EngineRow {
    pub plan: String,
    pub batch: usize,
    pub prefix: usize,
    /// Host time of one `step_device` call (parameters set, graph launched), median µs, in
    /// steady state: calls issued back to back while earlier steps run on the GPU, as an
    /// engine's loop issues them (not right after a synchronization).
    pub host_us: f64,
    /// The 90th percentile of the same calls, µs.
    pub host_p90_us: f64,
    /// Host time of a call issued while exactly one earlier step is queued or running (an
    /// engine that keeps one step ahead), median µs: the first call of each pair follows a
    /// wait and is not timed, so neither the thread's wake-up nor a deep launch queue is in it.
    pub host_ahead1_us: f64,
    /// The 90th percentile of the same calls, µs.
    pub host_ahead1_p90_us: f64,
    /// Of the host time, the part before the graph launch (checks, the admit node's
    /// parameters), median µs; the rest is the driver's `cuGraphLaunch`.
    pub prep_us: f64,
    /// The step on the stream (admit, the bucket's graph, emit), CUDA events, median µs.
    pub step_us: f64,
    /// The owned-memory replay of the same shape in the same run, µs.
    pub owned_replay_us: f64,
    pub load_ms: f64,
}

/// `specbench.json`: the ceilings, then the rows.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Bench {
    /// The graphs' L2 prefetch branches (`--l2-prefetch`: `off`, or MiB x CTAs / largest bucket).
    pub l2_prefetch: String,
    /// `--split-gemm-round`: every GEMM's rounded copy in its own launch.
    pub split_gemm_round: bool,
    pub ceilings: Option<Ceilings>,
    pub rows: Vec<BenchRow>,
    pub engine: Vec<EngineRow>,
    pub ops: Vec<OpTime>,
    pub spans: Vec<SpanTime>,
    pub breakdown: Vec<Breakdown>,
    pub gemms: Vec<GemmRecord>,
    /// `--gemm-flip` only: each GEMM's choice against the other inside the bucket's graph.
    pub gemm_flips: Vec<GemmFlipRecord>,
    /// Draft-decode phases (plans compiled with `--draft-decode-steps`).
    pub decode: Vec<DecodeRow>,
}
