//! `capture.buckets`: SGLang's automatic capture list or an explicit one, and the bounds a
//! plan puts on it.

use serde_json::Value;
use specplan_format::SpecDesc;

use super::flags;
use super::limits::MAX_BATCH;
use super::{Errors, Overrides};

/// SGLang's speculative capture list: 1–8, 10–32 step 2, 40–64 step 4, 72–256 step 8,
/// then step 16, up to `max_bs`.
pub fn auto_buckets(max_bs: u32) -> Vec<u32> {
    let mut v: Vec<u32> = (1..=8).collect();
    v.extend((10..=32).step_by(2));
    v.extend((40..=64).step_by(4));
    v.extend((72..=256).step_by(8));
    v.extend((272..=max_bs.max(272)).step_by(16));
    v.retain(|&b| b <= max_bs);
    v
}

pub(super) fn read_buckets(v: &Value, o: &Overrides, max_bs: u32, e: &mut Errors) -> Option<Vec<u32>> {
    let buckets_label = &flags::label("buckets");
    let text = match (&o.buckets, v.get("buckets")) {
        (Some(s), _) => s.clone(),
        (None, Some(Value::String(s))) => s.clone(),
        (None, Some(Value::Array(a))) => a.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","),
        (None, None | Some(Value::Null)) => "auto".into(),
        (None, Some(x)) => {
            e.push(
                buckets_label.into(),
                format!("expected \"auto\" or a list of batch sizes, got {x}"),
            );
            return None;
        }
    };
    parse_buckets(&text, max_bs, e)
}

/// The bounds validation puts on a bucket list, as config errors naming `capture.buckets`:
/// at most `MAX_BUCKETS` buckets, and `batch · N` rows of the largest within what one
/// replay's `admit` checks on the device.
pub(super) fn check_bucket_bounds(list: &[u32], spec: Option<&SpecDesc>, e: &mut Errors) {
    const BUCKETS: &str = "capture.buckets (--buckets, --max-bs)";
    let max_buckets = specplan_format::limits::MAX_BUCKETS;
    if list.len() > max_buckets {
        e.push(
            BUCKETS.into(),
            format!(
                "{} buckets exceed the {max_buckets} a plan may have (give a smaller --max-bs or an explicit --buckets list)",
                list.len()
            ),
        );
    }
    let max_rows = specplan_kernels::entries::io::ADMIT_MAX_ROWS;
    if let (Some(s), Some(&largest)) = (spec, list.last()) {
        let rows = largest as u64 * s.num_draft_tokens as u64;
        if rows > max_rows as u64 {
            e.push(
                BUCKETS.into(),
                format!(
                    "the largest bucket {largest} × num_draft_tokens {} = {rows} rows exceed {max_rows}, the rows one replay's device admission checks (give a largest bucket of at most {})",
                    s.num_draft_tokens,
                    max_rows / s.num_draft_tokens.max(1)
                ),
            );
        }
    }
}

/// "auto" or an explicit list, taken as given: every entry in `[1, MAX_BATCH]`, strictly
/// ascending (an unsorted or repeated list is refused, never sorted or deduplicated).
fn parse_buckets(text: &str, max_bs: u32, e: &mut Errors) -> Option<Vec<u32>> {
    let buckets_label = &flags::label("buckets");
    if text.trim() == "auto" {
        return Some(auto_buckets(max_bs));
    }
    let mut out: Vec<u32> = Vec::new();
    for part in text.split(',') {
        let b = match part.trim().parse::<u32>() {
            Ok(b) if (1..=MAX_BATCH).contains(&b) => b,
            _ => {
                e.push(
                    buckets_label.into(),
                    format!(
                        "\"{}\" is not a batch size in [1, {MAX_BATCH}] (expected \"auto\" or e.g. 1,2,4,8)",
                        part.trim()
                    ),
                );
                return None;
            }
        };
        if let Some(&prev) = out.last() {
            if b <= prev {
                let what = if b == prev { "repeats" } else { "is below" };
                e.push(
                    buckets_label.into(),
                    format!(
                        "\"{text}\": {b} {what} the bucket before it ({prev}); give distinct batch sizes in ascending order"
                    ),
                );
                return None;
            }
        }
        out.push(b);
    }
    Some(out)
}
