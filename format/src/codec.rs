//! The binary container: a fixed header, then a postcard body.
//!
//! Layout (all integers little-endian):
//! `magic "SPECPLAN" | format version u32 | reserved u32 (0) | body length u64 |
//! SHA-256(version ‖ reserved ‖ body length ‖ body) | body`.
//! The body is the postcard encoding of [`Plan`]; postcard writes fields in declaration
//! order and the plan holds no maps, so the same plan always gives the same bytes.
//! Decoding checks magic, version, the reserved word, length, size cap and checksum before
//! it parses anything, and [`crate::validate`] runs before anything uses the parsed plan.
//! The checksum detects corruption; it is not a signature (see ARCHITECTURE.md, "Trust").

use std::io::Read as _;

use sha2::{Digest, Sha256};

use crate::types::Plan;
use crate::validate::{validate, ValidatedPlan};
use crate::PlanError;

pub const MAGIC: [u8; 8] = *b"SPECPLAN";
/// 2: entries named by enum, arguments in field order without names, binaries bound to
/// their source hash, the header covered by the checksum. 3: EAGLE-3 heads (head kind, draft
/// vocabulary, the `embed_norm_concat`/`select_norm` entries, engine-memory `admit`/`emit`).
/// 4: the `fill` entry (every plan carries it). 5: logits outputs, engine K/V geometry. 6: 16
/// status words (`admit`'s alias rule and write set, `emit`'s non-finite flag, 4-word mirror
/// slots): the runtime and a plan's `admit`/`emit` must agree on them. 7: phases (`Plan.phases`,
/// each with its kind, rows per request and buckets) instead of one bucket list. 8: YaRN and
/// LongRoPE (`RopeScaling`), `rope_append`'s `ROPE_SCALE` constant, `Packing::LeadingRows`.
/// 9: the draft-decode phase (`PhaseKind::DraftDecode { steps }`, the `tree.cu` entries),
/// the `LANE_STEPS`/`STEP` constants of `rope_append` and the attention. 10: the verify inputs
/// (`CaptureDesc.decode_verify`, `tree_verify`). 11: draft decode's engine-memory prologue and
/// epilogue (`admit_decode`, `emit_decode`; every plan carries them). 12: `GemmDesc.lda`. 13:
/// tensor parallelism (`CaptureDesc.tp`, `WeightDesc.shard`, `LaunchKind::Collective`). 14: a
/// bucket's `attn_cluster` and a kernel launch's `cluster` (the split merge in a thread block
/// cluster). 15: the fp32 residual stream of the draft-extend phase (the `stream_t` constant
/// of the norm, select and embed templates, whose stream arguments are f32 there; the
/// `cast_rows` entry). 16: the top-K refinement in `topk_merge` (its x, norm_w, lm_w
/// arguments; `topk_partial` no longer takes them). 17: `skinny_gemm`, a runtime-launched
/// entry every plan carries. 18: the sample entries' `CANDS` constant (the refinement's
/// candidates past TOPK; chunk records of 2 + 2·CANDS floats). 19: `topk_fused` and the
/// runtime's arrival counters (`ArgValue::Counters`). 20: `stage_in`, a runtime-launched entry
/// every plan carries (the owned-memory graphs' input prologue). 21: `l2_prefetch`, a
/// runtime-launched entry every plan carries (captured graphs' L2 prefetch branches). 22:
/// `GemmDesc.rounded` (a GEMM's f32 output also written rounded) and `gemm_round`, a
/// runtime-launched entry every plan carries. 23: the attention over the selected query rows
/// (its `SELECT_FROM` constant and `accept_lens` argument) and `select_norm`'s residual addend
/// (`add`). 24: a bucket's `attn_last_cta` and the `attn_fused` entry (the splits' merge in
/// each group's last CTA).
pub const FORMAT_VERSION: u32 = 24;
/// Largest plan file accepted (a plan with kernels is a few MiB).
pub const MAX_PLAN_BYTES: u64 = 256 << 20;
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 32;

fn checksum(header_words: &[u8], body: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(header_words);
    h.update(body);
    h.finalize().into()
}

/// Encodes a plan (validated or not: the compiler validates before it writes).
pub fn encode(plan: &Plan) -> Result<Vec<u8>, PlanError> {
    let body = postcard::to_allocvec(plan).map_err(|e| PlanError::Encode(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    let sum = checksum(&out[8..24], &body);
    out.extend_from_slice(&sum);
    out.extend_from_slice(&body);
    Ok(out)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[..4]);
    u32::from_le_bytes(w)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
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
    let version = le_u32(&bytes[8..12]);
    if version != FORMAT_VERSION {
        return Err(PlanError::Version {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let reserved = le_u32(&bytes[12..16]);
    if reserved != 0 {
        return Err(PlanError::Reserved { found: reserved });
    }
    let body_len = le_u64(&bytes[16..24]);
    if body_len > MAX_PLAN_BYTES {
        return Err(PlanError::TooLarge {
            bytes: body_len,
            limit: MAX_PLAN_BYTES,
        });
    }
    let body = &bytes[HEADER_LEN..];
    if body.len() as u64 > body_len {
        return Err(PlanError::Trailing {
            expected: body_len,
            found: body.len() as u64,
        });
    }
    if body.len() as u64 != body_len {
        return Err(PlanError::Truncated {
            what: "body",
            expected: body_len,
            found: body.len() as u64,
        });
    }
    if checksum(&bytes[8..24], body) != bytes[24..56] {
        return Err(PlanError::Checksum);
    }
    let plan: Plan = postcard::from_bytes(body).map_err(|e| PlanError::Decode(e.to_string()))?;
    validate(plan)
}

/// Largest config file (TOML or Hugging Face `config.json`) any reader takes: real ones are a
/// few KiB.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// A file read that stopped at its cap (`TooLarge`) or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {path}: {message}")]
    Io { path: String, message: String },
    #[error(
        "cannot read {path}: it holds more than the {limit} bytes {what} can need; refused before reading further"
    )]
    TooLarge { path: String, limit: u64, what: String },
}

/// Reads at most `limit` bytes of `path` (`what` names the file's role in the error): a
/// larger file — or an endless one, `/dev/zero`, a FIFO that keeps writing — is refused
/// once `limit + 1` bytes have arrived, so no read grows past the cap.
pub fn read_capped(path: &std::path::Path, limit: u64, what: &str) -> Result<Vec<u8>, ReadError> {
    let io = |e: std::io::Error| ReadError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let f = std::fs::File::open(path).map_err(io)?;
    if let Ok(m) = f.metadata() {
        if m.is_file() && m.len() > limit {
            return Err(ReadError::TooLarge {
                path: path.display().to_string(),
                limit,
                what: what.into(),
            });
        }
    }
    let mut bytes = Vec::new();
    f.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge {
            path: path.display().to_string(),
            limit,
            what: what.into(),
        });
    }
    Ok(bytes)
}

/// A config file's text, at most [`MAX_CONFIG_BYTES`].
pub fn read_config(path: &std::path::Path) -> Result<String, ReadError> {
    let bytes = read_capped(path, MAX_CONFIG_BYTES, "a config")?;
    String::from_utf8(bytes).map_err(|e| ReadError::Io {
        path: path.display().to_string(),
        message: format!("not UTF-8 text ({e})"),
    })
}

/// Reads (at most [`MAX_PLAN_BYTES`] plus the header) and decodes a plan file.
pub fn load_file(path: &std::path::Path) -> Result<ValidatedPlan, PlanError> {
    let io = |e: std::io::Error| PlanError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let limit = MAX_PLAN_BYTES + HEADER_LEN as u64;
    let mut bytes = Vec::new();
    f.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(PlanError::TooLarge {
            bytes: bytes.len() as u64,
            limit,
        });
    }
    decode(&bytes)
}
