//! Coverage-guided fuzzing of `decode` + `validate`, and of the CPU executor on what they
//! accept (see fuzz/README.md).
//!
//! An input is a plan file. It is decoded as it is (header, size and checksum rules), then
//! its body is sealed again with a correct header and checksum and decoded: a mutated body
//! would otherwise never get past the checksum, and everything behind it (postcard,
//! `validate`) would go unexplored. A plan that validates runs its smallest bucket on the
//! CPU executor with synthetic data and bounded sizes (`specplan_runtime::cpu::audit_bucket`),
//! which checks that every launch writes only the memory it names for writing. A panic,
//! abort, unbounded allocation or out-of-bounds write anywhere is a finding.

#![no_main]

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use specplan_format::{decode, FORMAT_VERSION, MAGIC};
use specplan_runtime::cpu::{audit_bucket, synthetic_weights, Audit, AuditError, AuditLimits};

/// magic, version, reserved, body length, SHA-256 (codec.rs).
const HEADER: usize = 8 + 4 + 4 + 8 + 32;

/// Inputs seen, sealed bodies that validated, audited runs that ran every launch.
static COUNTS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

fn count(i: usize) {
    let n = COUNTS[i].fetch_add(1, Relaxed) + 1;
    if i == 0 && n.is_power_of_two() && n >= 1 << 14 {
        let [_, v, r] = COUNTS.each_ref().map(|c| c.load(Relaxed));
        eprintln!("decode_validate: {n} inputs, {v} validated, {r} ran on the CPU executor");
    }
}

/// `body` behind a valid header: what `encode` would have written for it.
fn seal(body: &[u8]) -> Vec<u8> {
    let mut words = Vec::with_capacity(16);
    words.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    words.extend_from_slice(&0u32.to_le_bytes());
    words.extend_from_slice(&(body.len() as u64).to_le_bytes());
    let sum = Sha256::new().chain_update(&words).chain_update(body).finalize();
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&words);
    out.extend_from_slice(&sum);
    out.extend_from_slice(body);
    out
}

fuzz_target!(|data: &[u8]| {
    count(0);
    let _ = decode(data);
    let Some(body) = data.get(HEADER..) else { return };
    let Ok(plan) = decode(&seal(body)) else { return };
    count(1);
    // Small bounds: the fuzzer runs this on every accepted input.
    let limits = AuditLimits {
        max_weight_elems: 1 << 22,
        max_arena_bytes: 16 << 20,
        max_pool_elems: 1 << 22,
    };
    let Ok(weights) = synthetic_weights(&plan, &limits) else {
        return;
    };
    match audit_bucket(&plan, &weights, 0, &limits) {
        Ok(Audit::Ran) => count(2),
        Err(e @ AuditError::Write { .. }) => panic!("{e}"),
        _ => {}
    }
});
