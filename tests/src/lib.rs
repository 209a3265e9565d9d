//! Shared test support: a small reproducible random generator.
//!
//! Integration tests live in `tests/`; the GPU check binary is `src/bin/gpucheck.rs`.
//! [`contract_files`] writes the `run` contract's files and a plan's facts for the peer
//! benchmark (`src/bin/peerprep.rs`).

pub mod contract_files;

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
