//! Which phases a config compiles besides draft-extend: the draft-decode tiers
//! (`capture.draft_decode_steps`).

use serde_json::Value;
use specplan_format::SpecDesc;

use super::{flags, Errors, Overrides};

/// `capture.draft_decode_outputs`: "tree" (the default) or "tree,verify"; verify needs a
/// draft-decode phase.
pub(super) fn read_decode_outputs(v: &Value, o: &Overrides, has_phase: bool, e: &mut Errors) -> bool {
    let label = flags::label("draft_decode_outputs");
    let text = match (&o.draft_decode_outputs, v.get("draft_decode_outputs")) {
        (Some(t), _) => t.clone(),
        (None, None | Some(Value::Null)) => return false,
        (None, Some(Value::String(t))) => t.clone(),
        (None, Some(Value::Array(a))) => a
            .iter()
            .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string))
            .collect::<Vec<_>>()
            .join(","),
        (None, Some(x)) => {
            e.push(label, format!("expected \"tree\" or \"tree,verify\", got {x}"));
            return false;
        }
    };
    let mut verify = false;
    for part in text.split([',', '+']) {
        match part.trim() {
            "tree" => {}
            "verify" => verify = true,
            other => {
                e.push(label, format!("\"{other}\" is not an output (tree, verify)"));
                return false;
            }
        }
    }
    if verify && !has_phase {
        e.push(
            label,
            "verify needs a draft-decode phase (set draft_decode_steps)".to_string(),
        );
        return false;
    }
    verify
}

/// `capture.draft_decode_steps`: "none" (the default), "auto" (num_steps) or a list of tiers,
/// each allowed by `limits::decode_tier_rule`, ascending and unique.
pub(super) fn read_decode_steps(v: &Value, o: &Overrides, s: &SpecDesc, e: &mut Errors) -> Vec<u32> {
    let label = flags::label("draft_decode_steps");
    let text = match (&o.draft_decode_steps, v.get("draft_decode_steps")) {
        (Some(t), _) => t.clone(),
        (None, None | Some(Value::Null)) => return Vec::new(),
        (None, Some(Value::String(t))) => t.clone(),
        (None, Some(Value::Number(n))) => n.to_string(),
        (None, Some(Value::Array(a))) => a.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","),
        (None, Some(x)) => {
            e.push(
                label,
                format!("expected \"none\", \"auto\" or a list of step counts, got {x}"),
            );
            return Vec::new();
        }
    };
    match text.trim() {
        "none" | "" => return Vec::new(),
        "auto" => return vec![s.num_steps],
        _ => {}
    }
    let mut tiers = Vec::new();
    for part in text.split(',') {
        match part.trim().parse::<u32>() {
            Ok(n) => tiers.push(n),
            Err(_) => {
                e.push(label, format!("\"{}\" is not a step count", part.trim()));
                return Vec::new();
            }
        }
    }
    if tiers.windows(2).any(|w| w[0] >= w[1]) {
        e.push(label, format!("{text}: tiers must be ascending and unique"));
        return Vec::new();
    }
    for &t in &tiers {
        if let Some(why) = specplan_format::limits::decode_tier_rule(s, t) {
            e.push(label.clone(), why);
        }
    }
    tiers
}
