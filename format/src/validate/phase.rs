//! Phase rules (rule 6 of `mod.rs`): which phases a plan holds, their rows per request, and
//! each phase's bucket list (the buckets themselves: `bucket.rs`).

use specplan_kernels::facts::KernelFacts;

use super::bucket::{bucket, At};
use super::common::Errors;
use super::rules::Touched;
use crate::location::Location;
use crate::types::*;

/// Kinds ascending and unique, the draft-extend phase present, rows per request the kind's.
pub(crate) fn phases(p: &Plan, e: &mut Errors) {
    for (i, pair) in p.phases.windows(2).enumerate() {
        e.field(pair[0].kind < pair[1].kind, &format!("phases[{}]", i + 1), || {
            format!(
                "{} follows {}: phases are ascending by kind, one per kind",
                pair[1].kind.label(),
                pair[0].kind.label()
            )
        });
    }
    e.field(p.phase(PhaseKind::DraftExtend).is_some(), "phases", || {
        "the draft_extend phase is missing".into()
    });
    for ph in &p.phases {
        let want = ph.kind.rows_per_request(&p.spec);
        let what = match ph.kind {
            PhaseKind::DraftExtend => "num_draft_tokens",
            PhaseKind::DraftDecode { .. } => "topk",
        };
        e.field(
            ph.rows_per_request == want,
            &format!("{}.rows_per_request", ph.kind.label()),
            || format!("{}, expected {want} ({what})", ph.rows_per_request),
        );
        if let PhaseKind::DraftDecode { steps } = ph.kind {
            if let Some(why) = crate::limits::decode_tier_rule(&p.spec, steps) {
                e.field(false, &format!("{}.kind", ph.kind.label()), || why);
            }
        }
        e.field(!ph.buckets.is_empty(), &format!("{}.buckets", ph.kind.label()), || {
            "a phase needs at least one bucket".into()
        });
    }
}

/// Every bucket of `ph`: ascending batches, then the bucket rules.
pub(crate) fn buckets(p: &Plan, ph: &Phase, f: &KernelFacts, touched: &mut Touched, e: &mut Errors) {
    let mut prev = 0u32;
    for (index, b) in ph.buckets.iter().enumerate() {
        let at = At {
            phase: ph.kind,
            index,
            rows_per_request: ph.rows_per_request,
        };
        e.check(b.batch > prev, || {
            (
                Location::bucket(ph.kind, index, b.batch),
                format!(
                    "{}.batch: {} must be greater than the previous bucket {prev}",
                    at.tag(b.batch),
                    b.batch
                ),
            )
        });
        prev = b.batch;
        bucket(p, f, at, b, touched, e);
    }
}
