//! The binary container: a fixed header, then a postcard body.
//!
//! Layout (all integers little-endian):
//! `magic "SPECPLAN" | format version u32 | reserved u32 | body length u64 | SHA-256(body) | body`.
//! The body is the postcard encoding of [`Plan`]; postcard writes fields in declaration
//! order and the plan holds no maps, so the same plan always gives the same bytes.
//! Decoding checks magic, version, length and checksum before it parses anything, and
//! [`crate::format::validate`] runs before anything uses the parsed plan.

use sha2::{Digest, Sha256};

use super::types::Plan;
use super::validate::{validate, ValidatedPlan};
use super::PlanError;

pub const MAGIC: [u8; 8] = *b"SPECPLAN";
pub const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 32;

/// Encodes a plan (validated or not: the compiler validates before it writes).
pub fn encode(plan: &Plan) -> Result<Vec<u8>, PlanError> {
    let body = postcard::to_allocvec(plan).map_err(|e| PlanError::Encode(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&body));
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes and validates a plan file's bytes.
pub fn decode(bytes: &[u8]) -> Result<ValidatedPlan, PlanError> {
    if bytes.len() < HEADER_LEN {
        return Err(PlanError::Truncated {
            what: "header",
            expected: HEADER_LEN as u64,
            found: bytes.len() as u64,
        });
    }
    if bytes[..8] != MAGIC {
        return Err(PlanError::BadMagic);
    }
    let version = u32::from_le_bytes(word(&bytes[8..12]));
    if version != FORMAT_VERSION {
        return Err(PlanError::Version {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let body_len = u64::from_le_bytes(dword(&bytes[16..24]));
    let body = &bytes[HEADER_LEN..];
    if body.len() as u64 != body_len {
        return Err(PlanError::Truncated {
            what: "body",
            expected: body_len,
            found: body.len() as u64,
        });
    }
    if Sha256::digest(body).as_slice() != &bytes[24..56] {
        return Err(PlanError::Checksum);
    }
    let plan: Plan = postcard::from_bytes(body).map_err(|e| PlanError::Decode(e.to_string()))?;
    validate(plan)
}

/// Reads and decodes a plan file.
pub fn load_file(path: &std::path::Path) -> Result<ValidatedPlan, PlanError> {
    let bytes = std::fs::read(path).map_err(|e| PlanError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    decode(&bytes)
}

fn word(b: &[u8]) -> [u8; 4] {
    let mut w = [0u8; 4];
    w.copy_from_slice(b);
    w
}

fn dword(b: &[u8]) -> [u8; 8] {
    let mut w = [0u8; 8];
    w.copy_from_slice(b);
    w
}
