//! Files for the PyTorch + FlashInfer peer (`tests/peer/`), written from a plan; needs no GPU.
//!
//! ```text
//! peerprep plan-json PLAN [OUT.json]                  the plan's facts (stdout without OUT)
//! peerprep weights PLAN OUT.safetensors               random weights under Hugging Face names
//! peerprep inputs PLAN OUT.safetensors [--batch B] [--max-prefix L]
//!                                                     one step's inputs (default B 3, L 1000 or
//!                                                     the plan's max context − N if less)
//! peerprep contract-files PLAN DIR [--batch B] [--max-prefix L] [--no-weights]
//!                                                     DIR/{weights,inputs}.safetensors + plan.json
//! ```
//!
//! The files follow the `run` contract (`specplan run --help`), so `specplan run --device
//! cuda` and the peer read the same ones. The seed is printed (`SPECPLAN_SEED` reproduces it).
//! Exit 2 on a usage or input error.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use specplan_format::PhaseKind;
use specplan_format::{load_file, ValidatedPlan};
use specplan_tests::contract_files::{input_tensors, plan_json, weight_tensors, write_safetensors};
use specplan_tests::seed;

const USAGE: &str = "usage:
  peerprep plan-json PLAN [OUT.json]
  peerprep weights PLAN OUT.safetensors
  peerprep inputs PLAN OUT.safetensors [--batch B] [--max-prefix L]
  peerprep contract-files PLAN DIR [--batch B] [--max-prefix L] [--no-weights]";

struct Opts {
    batch: usize,
    /// `None`: 1000, or less where the plan's context is shorter.
    max_prefix: Option<usize>,
    no_weights: bool,
}

fn opts(rest: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        batch: 3,
        max_prefix: None,
        no_weights: false,
    };
    let mut it = rest.iter();
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .ok_or(format!("{name} needs a value"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))
        };
        match a.as_str() {
            "--batch" => o.batch = num("--batch")?,
            "--max-prefix" => o.max_prefix = Some(num("--max-prefix")?),
            "--no-weights" => o.no_weights = true,
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(o)
}

fn load(path: &str) -> Result<ValidatedPlan, String> {
    load_file(Path::new(path)).map_err(|e| format!("cannot load plan {path}: {e}"))
}

fn write_weights(plan: &ValidatedPlan, out: &Path, seed: u64) -> Result<(), String> {
    let t0 = Instant::now();
    let t = weight_tensors(plan, seed)?;
    write_safetensors(out, &t)?;
    let bytes: usize = t.iter().map(|x| x.bytes.len()).sum();
    println!(
        "wrote {} ({} tensors, {:.1} MB) in {:.1} s",
        out.display(),
        t.len(),
        bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn write_inputs(plan: &ValidatedPlan, out: &Path, seed: u64, o: &Opts) -> Result<(), String> {
    let t0 = Instant::now();
    let room =
        (plan.capture.max_context_len as usize).saturating_sub(plan.rows_per_request(PhaseKind::DraftExtend) as usize);
    let max_prefix = o.max_prefix.unwrap_or(room.min(1000));
    let t = input_tensors(plan, seed, o.batch, max_prefix)?;
    write_safetensors(out, &t)?;
    let bytes: usize = t.iter().map(|x| x.bytes.len()).sum();
    println!(
        "wrote {} (batch {}, max prefix {}, {:.1} MB) in {:.1} s",
        out.display(),
        o.batch,
        max_prefix,
        bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn write_text(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn run(args: &[String]) -> Result<(), String> {
    let cmd = args.get(1).map(String::as_str).unwrap_or("");
    let need = |i: usize| args.get(i).ok_or_else(|| USAGE.to_string());
    match cmd {
        "plan-json" => {
            let plan = load(need(2)?)?;
            let text = plan_json(&plan);
            match args.get(3) {
                Some(out) => write_text(Path::new(out), &text),
                None => {
                    print!("{text}");
                    Ok(())
                }
            }
        }
        "weights" => {
            let plan = load(need(2)?)?;
            write_weights(&plan, Path::new(need(3)?), seed())
        }
        "inputs" => {
            let plan = load(need(2)?)?;
            let out = need(3)?;
            let o = opts(&args[4..])?;
            write_inputs(&plan, Path::new(out), seed(), &o)
        }
        "contract-files" => {
            let plan = load(need(2)?)?;
            let dir = Path::new(need(3)?);
            let o = opts(&args[4..])?;
            std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            let s = seed();
            write_text(&dir.join("plan.json"), &plan_json(&plan))?;
            if !o.no_weights {
                write_weights(&plan, &dir.join("weights.safetensors"), s)?;
            }
            write_inputs(&plan, &dir.join("inputs.safetensors"), s, &o)
        }
        _ => Err(USAGE.to_string()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("peerprep: {e}");
            ExitCode::from(2)
        }
    }
}
