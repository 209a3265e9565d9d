//! The `specplan` command line.
//!
//! Exit codes: 0 success (for `diff`: equal), 1 `diff` found differences, 2 any error.
//! Every file it writes follows `specplan_contract::output` (atomic; never
//! replacing a device, FIFO, link, read-only file or one of the command's inputs), checked
//! before any work; a closed standard output ends the command quietly (see `stdout`).

mod dot;
mod flags;
mod stdout;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use specplan_compiler::config::{self, Source, PRESETS};
use specplan_compiler::jit::Jit;
use specplan_compiler::{compile, graph, Target};
use specplan_contract::{self as contract, output};
use specplan_format::{self as format, ValidatedPlan};
use stdout::{out, outln};

#[derive(Parser)]
#[command(
    name = "specplan",
    version,
    about = "Compile EAGLE draft-extend forwards into static CUDA-graph replay plans"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compile a plan from a preset, a TOML config or a Hugging Face config.json.
    Compile {
        #[command(flatten)]
        input: InputArgs,
        /// Where to write the plan (written atomically: a failed compile leaves nothing; a
        /// FIFO or device is written through, a link followed, never replaced).
        #[arg(short, long)]
        out: PathBuf,
        /// Also write the canonical text form next to the plan (PLAN.txt).
        #[arg(long)]
        text: bool,
        /// Skip NVRTC: the plan carries no kernel binaries (enough for review and the CPU
        /// executor, not for the GPU runtime).
        #[arg(long)]
        no_kernels: bool,
        /// Also print how the config was read: its format and the keys nothing reads.
        #[arg(short, long)]
        verbose: bool,
        /// Where a split top-K row's chunk records merge: in the row's last CTA to finish
        /// (`topk_fused`), or in a `topk_merge` launch after them.
        #[arg(long, value_enum, default_value_t = TopkMerge::LastCta)]
        topk_merge: TopkMerge,
        /// Where the attention's KV splits merge, for instances of at most 16 packed rows a CTA
        /// (the selected query rows, small N·G layers): in each (request, kv head)'s last CTA to finish
        /// (`attn_fused`, measured slower: docs/perf-notes.md item 52), or in an `attn_merge`
        /// launch after them (the default).
        #[arg(long, value_enum, default_value_t = TopkMerge::Launch)]
        attn_merge: TopkMerge,
    },
    /// Print a plan's canonical text form.
    Show { plan: PathBuf },
    /// Compare two plans fact by fact (exit 0 equal, 1 different, 2 error).
    Diff {
        a: PathBuf,
        b: PathBuf,
        /// Print only the per-category summary.
        #[arg(long)]
        summary: bool,
    },
    /// Graphviz of a plan's launches and buffers for one bucket.
    Dot {
        plan: PathBuf,
        /// Batch bucket to draw (default: the smallest).
        #[arg(long)]
        bucket: Option<u32>,
    },
    /// Print the op graph IR (after fusion, or before with --unfused) of a config.
    Graph {
        #[command(flatten)]
        input: InputArgs,
        #[arg(long)]
        unfused: bool,
        /// Graphviz instead of text.
        #[arg(long)]
        dot: bool,
    },
    /// List the built-in presets.
    Presets,
    /// Run one step of a plan's phase on safetensors weights and inputs.
    Run {
        #[arg(long)]
        plan: PathBuf,
        /// Weights: embed_tokens.weight, fc.*, layers.L.*, lm_head.weight (+ hot_token_ids).
        #[arg(long)]
        weights: PathBuf,
        /// Inputs: input_ids, hidden_states, prefix_lens, accept_lens, page_table [b, P], k_cache, v_cache
        /// (draft decode: topk_probs, topk_ids, hidden_states [b, H], prefix_lens, page_table, k_cache, v_cache).
        #[arg(long)]
        inputs: PathBuf,
        /// Outputs: topk_probs, topk_ids, hidden_out and the updated k_cache, v_cache (draft decode:
        /// parent_list, top_scores_index, draft_tokens and the caches).
        #[arg(long)]
        out: PathBuf,
        /// The phase: draft_extend, or draft_decode (draft_decode:S when the plan has several tiers).
        #[arg(long, default_value = "draft_extend")]
        phase: String,
        #[arg(long, value_enum, default_value_t = Device::Cpu)]
        device: Device,
        /// GPU only: issue the launches without a CUDA graph.
        #[arg(long)]
        eager: bool,
        /// Compile every kernel here (NVRTC) from the plan's validated constants instead of
        /// running the machine code the plan file carries (for plans from elsewhere: a
        /// plan's checksum is integrity, not authenticity).
        #[arg(long)]
        rebuild_kernels: bool,
    },
    /// What specplan finds on this machine: NVRTC and the CUDA headers (and every place
    /// looked at), the CUDA driver and GPUs; what would fail. Exit 1 when NVRTC is missing.
    Doctor,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

/// `compile --topk-merge` and `--attn-merge`: `Target::topk_last_cta`, `Target::attn_last_cta`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum TopkMerge {
    LastCta,
    Launch,
}

#[derive(Args)]
struct InputArgs {
    /// A built-in preset (see `specplan presets`).
    #[arg(long, group = "source")]
    preset: Option<String>,
    /// A TOML config with [model], [speculative] and [capture] tables.
    #[arg(long, group = "source")]
    config: Option<PathBuf>,
    /// A Hugging Face config.json of the EAGLE draft head.
    #[arg(long, group = "source")]
    hf_config: Option<PathBuf>,
    #[command(flatten)]
    flags: flags::FlagArgs,
}

impl InputArgs {
    /// The files this command reads (an output must be none of them).
    fn files(&self) -> Vec<(&'static str, &Path)> {
        let mut v: Vec<(&'static str, &Path)> = Vec::new();
        if let Some(p) = &self.config {
            v.push(("--config", p));
        }
        if let Some(p) = &self.hf_config {
            v.push(("--hf-config", p));
        }
        v
    }

    fn resolve(&self) -> Result<config::Config> {
        let read = |p: &Path| specplan_format::read_config(p).map_err(anyhow::Error::from);
        let name = |p: &Path| {
            p.file_stem()
                .map_or("config".into(), |s| s.to_string_lossy().into_owned())
        };
        let source = match (&self.preset, &self.config, &self.hf_config) {
            (Some(p), None, None) => Source::Preset(p.clone()),
            (None, Some(p), None) => Source::Toml {
                name: name(p),
                text: read(p)?,
            },
            (None, None, Some(p)) => Source::HfConfig {
                name: name(p),
                text: read(p)?,
            },
            _ => bail!("give exactly one of --preset NAME, --config FILE or --hf-config FILE"),
        };
        Ok(config::resolve(&source, &self.flags.0)?)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        // The reader of our output has gone (`| head`): the work is done, nothing to say.
        Err(e) if stdout::is_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed standard error has nowhere to report to either.
            let _ = writeln!(std::io::stderr(), "error: {}", stdout::message(&e));
            ExitCode::from(2)
        }
    }
}

/// `specplan doctor`: NVRTC and the headers, the driver and GPUs, and what would fail.
fn doctor() -> Result<ExitCode> {
    let mut problems = Vec::new();
    match specplan_compiler::nvrtc_locate::locate(&[]) {
        Ok(found) => {
            outln!("nvrtc:        found ({})", found.origin);
            outln!(
                "  library:    {}",
                found
                    .library
                    .as_ref()
                    .map_or("on the loader path".to_string(), |p| p.display().to_string())
            );
            outln!("  headers:    {}", found.include_dir.display());
            match Jit::from_env() {
                Ok(j) => outln!("  version:    NVRTC {}", j.version),
                Err(e) => {
                    outln!("  unusable:   {e}");
                    problems.push("compile (kernels): NVRTC does not work");
                }
            }
        }
        Err(tried) => {
            outln!("nvrtc:        not found; looked at:");
            for t in tried.split("; ") {
                outln!("  {t}");
            }
            outln!("  provision:  {}", specplan_compiler::jit::PROVISION);
            problems.push("compile without --no-kernels, include_plan! with kernels");
        }
    }
    let drv = specplan_runtime::gpu::driver_report();
    for (k, v) in &drv {
        outln!("{:<13} {v}", format!("{k}:"));
    }
    if drv.get("gpus").is_none_or(|g| g == "0") {
        problems.push("run --device cuda, the GPU runtime and the Python runner (no GPU)");
    }
    outln!(
        "would fail:   {}",
        if problems.is_empty() {
            "nothing".to_string()
        } else {
            problems.join("; ")
        }
    );
    Ok(
        if problems.iter().any(|p| p.contains("NVRTC") || p.contains("compile")) {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        },
    )
}

fn load(path: &Path) -> Result<ValidatedPlan> {
    format::load_file(path).with_context(|| format!("cannot load plan {}", path.display()))
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Compile {
            input,
            out,
            text,
            no_kernels,
            verbose,
            topk_merge,
            attn_merge,
        } => {
            let t0 = Instant::now();
            // Outputs first (cheap, and a doomed command should fail before compiling),
            // then the config, then NVRTC: a config error is reported wherever NVRTC is.
            let inputs = input.files();
            let plan_out = output::check_output(&out, &inputs)?;
            let text_out = if text {
                let mut p = out.clone().into_os_string();
                p.push(".txt");
                let mut also = inputs.clone();
                also.push(("-o", &out));
                Some(output::check_output(Path::new(&p), &also)?)
            } else {
                None
            };
            let cfg = input.resolve()?;
            for n in &cfg.notes {
                outln!("note: {n}");
            }
            if verbose {
                outln!("config: {} read as a {}", cfg.name, cfg.format);
                match cfg.ignored.as_slice() {
                    [] => outln!("ignored keys: none"),
                    keys => outln!("ignored keys ({}, nothing reads them): {}", keys.len(), keys.join(", ")),
                }
            }
            let jit = if no_kernels { None } else { Some(Jit::from_env()?) };
            let total = cfg.capture.buckets.len();
            let bar = indicatif::ProgressBar::new(total as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template("compiling {prefix} [{bar:30}] {pos}/{len} buckets")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_prefix(cfg.name.clone());
            if total < 8 {
                bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
            }
            let target = Target {
                topk_last_cta: topk_merge == TopkMerge::LastCta,
                attn_last_cta: attn_merge == TopkMerge::LastCta,
                ..Target::default()
            };
            let compiled = compile(&cfg, &target, jit.as_ref(), &|done, _| bar.set_position(done as u64))?;
            bar.finish_and_clear();
            let bytes = format::encode(&compiled.plan)?;
            write_plan(&plan_out, text_out.as_ref(), &bytes, &compiled.plan)?;
            print_summary(&compiled.plan, &out, bytes.len(), t0.elapsed().as_secs_f64())?;
            match compiled.jit {
                Some(st) => outln!(
                    "kernels: {} compiled by NVRTC {}, {} from the cache",
                    st.compiled,
                    compiled.plan.target.nvrtc.as_deref().unwrap_or("?"),
                    st.cached
                ),
                None => outln!("kernels: not compiled (--no-kernels)"),
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Show { plan } => {
            let p = load(&plan)?;
            stdout::print(&format::to_text(&p))?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Diff { a, b, summary } => {
            let (pa, pb) = (load(&a)?, load(&b)?);
            let d = format::diff(&pa, &pb);
            let verdict = if d.is_empty() { 0 } else { 1 };
            let printed = (|| -> Result<()> {
                if d.is_empty() {
                    outln!("plans are equal");
                    return Ok(());
                }
                if !summary {
                    for e in &d.entries {
                        outln!("{e}");
                    }
                    outln!();
                }
                for line in d.summary() {
                    outln!("{line}");
                }
                Ok(())
            })();
            match printed {
                // The verdict stands even when nobody reads the listing.
                Err(e) if !stdout::is_closed(&e) => Err(e),
                _ => Ok(ExitCode::from(verdict)),
            }
        }
        Cmd::Dot { plan, bucket } => {
            let p = load(&plan)?;
            let b = match bucket {
                None => &p.buckets()[0],
                Some(x) => p.buckets().iter().find(|b| b.batch == x).with_context(|| {
                    format!(
                        "--bucket {x}: the plan has no such bucket (buckets: {})",
                        bucket_list(&p)
                    )
                })?,
            };
            out!("{}", dot::plan_dot(&p, b));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Graph { input, unfused, dot } => {
            let cfg = input.resolve()?;
            let compiled = compile(&cfg, &Target::default(), None, &|_, _| {})?;
            let g = if unfused { &compiled.unfused } else { &compiled.fused };
            if dot {
                out!("{}", graph::to_dot(g, &cfg.name));
            } else {
                out!("{}", graph::print_graph(g));
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run {
            plan,
            weights,
            inputs,
            out,
            device,
            eager,
            rebuild_kernels,
            phase,
        } => {
            if eager && device == Device::Cpu {
                bail!("--eager applies to --device cuda only");
            }
            // Before any work: the output must be writable and none of the inputs.
            let target = output::check_output(
                &out,
                &[("--plan", &plan), ("--weights", &weights), ("--inputs", &inputs)],
            )?;
            let mut p = load(&plan)?;
            if rebuild_kernels {
                let jit = Jit::from_env()?;
                p = specplan_compiler::rebuild_kernels(&p, &jit)?;
            }
            let kind = p
                .phase_by_label(&phase)
                .ok_or_else(|| anyhow::anyhow!("--phase {phase}: the plan has {}", p.phase_labels()))?;
            let t0 = Instant::now();
            let w = contract::load_weights(&p, &weights)?;
            if kind != format::PhaseKind::DraftExtend {
                return run_decode(&p, kind, w, (&inputs, &out), target, (device, eager), t0);
            }
            let mut x = contract::load_inputs(&p, &inputs)?;
            let res = match device {
                Device::Cpu => contract::run_cpu(&p, w, &mut x)?,
                Device::Cuda => contract::run_gpu(&p, w, &mut x, eager)?,
            };
            target.write(&contract::encode_outputs(&p, &res, &x)?)?;
            outln!(
                "ran {} requests in bucket {} on the {} in {:.3} s; wrote {}",
                x.step.batch,
                res.bucket,
                match (device, eager) {
                    (Device::Cpu, _) => "cpu",
                    (Device::Cuda, false) => "gpu (graph)",
                    (Device::Cuda, true) => "gpu (eager)",
                },
                t0.elapsed().as_secs_f64(),
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Presets => {
            for p in PRESETS {
                outln!("{:<16} {}", p.name, p.summary);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Doctor => doctor(),
    }
}

/// Writes a compiled plan to `plan_out`, and its text form to `text_out` (`--text`), both or
/// neither as far as files go.
fn write_plan(
    plan_out: &output::OutputTarget,
    text_out: Option<&output::OutputTarget>,
    bytes: &[u8],
    plan: &format::Plan,
) -> Result<()> {
    // A stream (a FIFO or a device) may block, fail, and cannot be taken back: streams
    // are written first, before any temporary file exists, so a command killed while
    // a FIFO waits for its reader leaves nothing behind. The files are then staged
    // (written to temporary files) before either is put in place: a failure while
    // staging leaves both paths as they were; then the plan, then the text (a plan
    // this command created goes if the text cannot be put).
    let text = text_out.map(|t| (t, format::to_text(plan)));
    let streams = |t: &output::OutputTarget| t.kind == output::OutputKind::Stream;
    if streams(plan_out) {
        plan_out.write(bytes)?;
    }
    if let Some((t, text)) = text.as_ref().filter(|(t, _)| streams(t)) {
        t.write(text.as_bytes())?;
    }
    let text_staged = match text.as_ref().filter(|(t, _)| !streams(t)) {
        Some((t, text)) => Some(t.stage(text.as_bytes())?),
        None => None,
    };
    if !streams(plan_out) {
        plan_out.stage(bytes)?.commit()?;
    }
    if let Some(t) = text_staged {
        if let Err(e) = t.commit() {
            plan_out.undo_new();
            return Err(e.into());
        }
    }
    Ok(())
}

fn bucket_list(p: &format::Plan) -> String {
    p.buckets()
        .iter()
        .map(|b| b.batch.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1024.0 * 1024.0))
}

fn print_summary(p: &format::Plan, out: &Path, file_bytes: usize, secs: f64) -> Result<()> {
    outln!(
        "wrote {} ({} bytes): {} buckets, {} kernels, {} launches per bucket, compiled in {:.3} s",
        out.display(),
        file_bytes,
        p.buckets().len(),
        p.kernels.len(),
        p.buckets().first().map_or(0, |b| b.launches.len()),
        secs
    );
    outln!(
        "weights {}  kv pool {} ({} pages)  arena (max) {}",
        mib(p.weight_bytes),
        mib(p.kv_pool_bytes()),
        p.capture.kv_pool_pages,
        mib(p.arena_bytes())
    );
    // Per phase (draft decode: per step-count tier), before anything runs: its share of the
    // one arena, its launches and the positions past a prefix its step writes.
    outln!(
        "{:<16} {:>12} {:>9} {:>10} {:>14}",
        "phase",
        "buckets",
        "launches",
        "arena",
        "positions/req"
    );
    for ph in &p.phases {
        outln!(
            "{:<16} {:>12} {:>9} {:>10} {:>14}",
            ph.kind.label(),
            ph.buckets
                .iter()
                .map(|b| b.batch.to_string())
                .collect::<Vec<_>>()
                .join(","),
            ph.buckets.last().map_or(0, |b| b.launches.len()),
            mib(ph.arena_bytes()),
            ph.positions_per_request(&p.spec, p.capture.page_size)
        );
    }
    outln!("{:>6} {:>7} {:>12} {:>7} replay", "bucket", "rows", "arena", "splits");
    for b in p.buckets() {
        let replay = match &b.replay {
            format::Replay::Graph => "graph".to_string(),
            other => format!("{other:?}"),
        };
        outln!(
            "{:>6} {:>7} {:>12} {:>7} {}",
            b.batch,
            b.rows,
            mib(b.arena_bytes),
            // "c": the splits merge in a thread block cluster.
            format!("{}{}", b.attn_splits, if b.attn_cluster { "c" } else { "" }),
            replay
        );
    }
    Ok(())
}

/// `specplan run --phase draft_decode[:S]` on the CPU (`contract::decode`).
fn run_decode(
    p: &ValidatedPlan,
    kind: format::PhaseKind,
    w: Vec<specplan_runtime::cpu::WeightData>,
    (inputs, out): (&Path, &Path),
    target: output::OutputTarget,
    (device, eager): (Device, bool),
    t0: Instant,
) -> Result<ExitCode> {
    let mut x = contract::decode::load_decode_inputs(p, kind, inputs)?;
    let res = match device {
        Device::Cpu => contract::decode::run_cpu_decode(p, w, &mut x)?,
        Device::Cuda => contract::decode::run_gpu_decode(p, w, &mut x, eager)?,
    };
    target.write(&contract::decode::encode_decode_outputs(p, &res, &x)?)?;
    let on = match (device, eager) {
        (Device::Cpu, _) => "the cpu",
        (Device::Cuda, false) => "the gpu (graph)",
        (Device::Cuda, true) => "the gpu (eager)",
    };
    outln!(
        "ran {} requests of {} in bucket {} on {on} in {:.3} s; wrote {}",
        x.b,
        kind.label(),
        res.bucket,
        t0.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}
