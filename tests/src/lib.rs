//! Shared test support: a reproducible generator, random weights and step cases, the CPU
//! references and the comparison rules the GPU checks use, the `run` contract's files,
//! report records (JSON through serde) and, for the GPU binaries, timing helpers.
//!
//! Integration tests live in `tests/`; the GPU binaries (`src/bin/gpucheck/`,
//! `src/bin/specbench/`) are drivers over this library; `src/bin/peerprep.rs` writes the
//! peer benchmark's files.

pub mod checks;
pub mod contract_files;
pub mod decode_check;
pub mod decode_contract;
pub mod engine;
pub mod gpu;
pub mod host_layouts;
pub mod l2_branch;
pub mod numerics;
pub mod owned_refusals;
pub mod owned_staging;
pub mod random;
pub mod reference;
pub mod report;
pub mod sanitize;
pub mod soak;
pub mod tolerance;
pub mod tp_check;

/// xorshift64*: no dependency, reproducible from the printed seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// A random permutation of 0..n.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

/// A fresh seed per run (time based), or `SPECPLAN_SEED` to reproduce one; printed.
pub fn seed() -> u64 {
    let s = std::env::var("SPECPLAN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    println!("seed {s} (rerun with SPECPLAN_SEED={s})");
    s
}

/// The `.plan` files of a folder, sorted.
pub fn plan_files(dir: &str) -> Result<Vec<std::path::PathBuf>, String> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {dir}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "plan"))
        .collect();
    files.sort();
    Ok(files)
}

/// Writes a file through a temporary one renamed into place, so a run killed mid-write
/// leaves the previous complete file, never a truncated one.
pub fn write_atomic(path: &std::path::Path, text: &str) -> Result<(), String> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// A value as pretty JSON (the report records are plain serde structs).
pub fn json<T: serde::Serialize>(v: &T) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    s.push('\n');
    s
}
