//! `specplan doctor` and `run --rebuild-kernels`: what the machine has, and running a plan
//! on kernels compiled here instead of the machine code the plan file carries.

mod common;

use common::*;
use specplan_tests::contract_files::{input_tensors, weight_tensors, write_safetensors};

#[test]
fn doctor_reports_nvrtc_the_driver_and_what_would_fail() {
    let out = specplan(&["doctor"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("nvrtc:") && text.contains("driver:") && text.contains("would fail:"),
        "{text}"
    );
    let found = text.contains("nvrtc:        found");
    assert_eq!(out.status.code(), Some(if found { 0 } else { 1 }), "{text}");
}

#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn rebuilt_kernels_run_the_same_step() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("p.plan");
    let c = specplan(&["compile", "--preset", "tiny", "-o", plan.to_str().expect("utf-8")]);
    assert!(c.status.success(), "NVRTC was provided at build time: {}", text(&c));
    let p = specplan_format::load_file(&plan).expect("load plan");
    let (w, i) = (dir.path().join("w.safetensors"), dir.path().join("i.safetensors"));
    write_safetensors(&w, &weight_tensors(&p, 3).expect("weights")).expect("write weights");
    write_safetensors(&i, &input_tensors(&p, 3, 3, 20).expect("inputs")).expect("write inputs");
    let run = |out: &str, extra: &[&str]| {
        let o = dir.path().join(out);
        let mut args = vec![
            "run",
            "--plan",
            plan.to_str().expect("utf-8"),
            "--weights",
            w.to_str().expect("utf-8"),
        ];
        args.extend([
            "--inputs",
            i.to_str().expect("utf-8"),
            "--out",
            o.to_str().expect("utf-8"),
        ]);
        args.extend(extra);
        let r = specplan(&args);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        std::fs::read(o).expect("outputs")
    };
    assert_eq!(run("a.safetensors", &[]), run("b.safetensors", &["--rebuild-kernels"]));
}

/// The plan records the NVRTC it was compiled with by what was found, not by how: a run
/// under `.ci/with-nvrtc` and a plain run (NVRTC found in its install folder, no
/// environment) give byte-identical plans, through one shared kernel cache.
#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn with_nvrtc_and_plain_runs_give_identical_plans() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().join("kernels");
    let compile = |name: &str, plain: bool| {
        let out = dir.path().join(name);
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_specplan"));
        c.args(["compile", "--preset", "tiny", "-o", out.to_str().expect("utf-8")])
            .env("SPECPLAN_CACHE_DIR", &cache);
        if plain {
            c.env_remove("SPECPLAN_NVRTC_VERSION")
                .env_remove("SPECPLAN_CUDA_INCLUDE")
                .env_remove("LD_LIBRARY_PATH");
        }
        let o = c.output().expect("run specplan");
        assert!(o.status.success(), "{}", text(&o));
        (
            std::fs::read(&out).expect("plan"),
            String::from_utf8_lossy(&o.stdout).into_owned(),
        )
    };
    let (a, _) = compile("a.plan", false);
    let (b, out_b) = compile("b.plan", true);
    assert!(a == b, "the plans differ: {}", out_b);
    // The second compile found every kernel in the cache the first filled.
    assert!(
        out_b.contains("kernels: 0 compiled by NVRTC") && !out_b.contains(", 0 from the cache"),
        "{out_b}"
    );
}
