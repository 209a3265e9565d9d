//! The GPU probes (`tests/gpu/*_probe.py`: measurements run by hand on the GPU machine, each
//! recorded in docs/perf-notes.md) keep working where they can be checked without a GPU: each
//! probe's kernels compile through the pinned NVRTC (`--compile-only`; the skinny probe
//! compiles the tree's own `gemm.cu`), and the persistent probe's stage lists pass its
//! `--self-test`. A probe that no longer compiles is found here, not in a device call.
//!
//! Needs python3 and the pinned NVRTC. Built without the latter (not under `.ci/with-nvrtc`:
//! `tests/build.rs`) the test is ignored and the summary says so; built with it, a missing
//! NVRTC or python3 is a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The probes that take `--compile-only`.
const PROBES: [&str; 4] = [
    "skinny_probe.py",
    "pdl_probe.py",
    "persistent_probe.py",
    "overlap_probe.py",
];

fn probe_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu")
}

/// The pinned NVRTC library `.ci/with-nvrtc` puts on the loader path.
fn nvrtc_lib() -> PathBuf {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("libnvrtc.so.13"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no libnvrtc.so.13 on LD_LIBRARY_PATH ({path}): run under .ci/with-nvrtc"))
}

fn python(args: &[&str], envs: &[(&str, &Path)]) -> (bool, String) {
    let mut cmd = Command::new("python3");
    cmd.args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("python3 {args:?} could not start: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn gpu_probes_compile_with_the_pinned_nvrtc() {
    let lib = nvrtc_lib();
    let inc = PathBuf::from(
        std::env::var("SPECPLAN_CUDA_INCLUDE")
            .unwrap_or_else(|_| panic!("SPECPLAN_CUDA_INCLUDE unset: run under .ci/with-nvrtc")),
    );
    for probe in PROBES {
        let file = probe_dir().join(probe);
        let arg = file.to_string_lossy().into_owned();
        let (ok, text) = python(&[&arg, "--compile-only"], &[("NVRTC_LIB", &lib), ("CUDA_INC", &inc)]);
        assert!(
            ok && text.contains("compiled: "),
            "{probe} --compile-only failed:\n{text}"
        );
    }
    let file = probe_dir().join("persistent_probe.py");
    let (ok, text) = python(&[&file.to_string_lossy(), "--self-test"], &[]);
    assert!(
        ok && text.contains("self-test passed"),
        "persistent_probe.py --self-test failed:\n{text}"
    );
}
