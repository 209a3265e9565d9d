//! Semantic diff of two plans, fact by fact (see `text.rs` for what a fact is).
//!
//! Facts are matched by key, so a launch that moved, a buffer whose offset changed or a
//! kernel whose constants changed shows up as one changed line, not as a shifted block.

use std::collections::BTreeMap;

use super::text::{facts, Fact};
use super::types::{PhaseKind, Plan};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiffEntry {
    Added(Fact),
    Removed(Fact),
    Changed {
        phase: Option<PhaseKind>,
        key: String,
        old: String,
        new: String,
    },
}

impl DiffEntry {
    pub fn key(&self) -> &str {
        match self {
            DiffEntry::Added(f) | DiffEntry::Removed(f) => &f.key,
            DiffEntry::Changed { key, .. } => key,
        }
    }

    /// The phase the fact belongs to (`None`: a plan-wide fact).
    pub fn phase(&self) -> Option<PhaseKind> {
        match self {
            DiffEntry::Added(f) | DiffEntry::Removed(f) => f.phase,
            DiffEntry::Changed { phase, .. } => *phase,
        }
    }

    /// The part of the plan a fact belongs to: config, weights, kernels, buckets,
    /// layouts, buffers or launches.
    pub fn category(&self) -> &'static str {
        let words: Vec<&str> = self.key().split(' ').collect();
        match words.as_slice() {
            ["phase", _] => "phases",
            ["bucket", _] => "buckets",
            ["bucket", _, "qo_indptr", ..] | ["bucket", _, "kv", ..] => "layouts",
            ["bucket", _, "buffer", ..] => "buffers",
            ["bucket", _, "launch", ..] => "launches",
            ["kernel", ..] => "kernels",
            ["weight", ..] => "weights",
            ["fusion", ..] => "fusions",
            _ => "config",
        }
    }
}

impl std::fmt::Display for DiffEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Facts of a phase are named by it: `~ draft_extend: bucket 4 launch ...`.
        let ph = self.phase().map_or(String::new(), |p| format!("{}: ", p.label()));
        match self {
            DiffEntry::Added(x) => write!(f, "+ {ph}{x}"),
            DiffEntry::Removed(x) => write!(f, "- {ph}{x}"),
            DiffEntry::Changed { key, old, new, .. } => write!(f, "~ {ph}{key}: {old}  =>  {new}"),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanDiff {
    pub entries: Vec<DiffEntry>,
}

impl PlanDiff {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// `category: N changed` lines, in a fixed category order.
    pub fn summary(&self) -> Vec<String> {
        let mut counts: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
        for e in &self.entries {
            let c = counts.entry(e.category()).or_default();
            match e {
                DiffEntry::Added(_) => c.0 += 1,
                DiffEntry::Removed(_) => c.1 += 1,
                DiffEntry::Changed { .. } => c.2 += 1,
            }
        }
        counts
            .into_iter()
            .map(|(k, (a, r, c))| format!("{k}: {a} added, {r} removed, {c} changed"))
            .collect()
    }
}

/// Facts of `b` compared with those of `a`: removed and changed in `a`'s order, then added.
pub fn diff(a: &Plan, b: &Plan) -> PlanDiff {
    let fa = facts(a);
    let fb = facts(b);
    let id = |f: &Fact| (f.phase, f.key.clone());
    let in_b: BTreeMap<(Option<PhaseKind>, String), &Fact> = fb.iter().map(|f| (id(f), f)).collect();
    let in_a: BTreeMap<(Option<PhaseKind>, String), &Fact> = fa.iter().map(|f| (id(f), f)).collect();
    let mut entries = Vec::new();
    for f in &fa {
        match in_b.get(&id(f)) {
            None => entries.push(DiffEntry::Removed(f.clone())),
            Some(g) if g.value != f.value => entries.push(DiffEntry::Changed {
                phase: f.phase,
                key: f.key.clone(),
                old: f.value.clone(),
                new: g.value.clone(),
            }),
            Some(_) => {}
        }
    }
    for f in &fb {
        if !in_a.contains_key(&id(f)) {
            entries.push(DiffEntry::Added(f.clone()));
        }
    }
    PlanDiff { entries }
}
