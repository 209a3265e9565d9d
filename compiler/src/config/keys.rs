//! What a TOML config may contain: the known tables and keys (an unknown one is an error
//! naming its `table.key` path, with a "did you mean" for near misses, because a misspelt
//! key that is ignored silently compiles a different plan), and only finite numbers.
//!
//! Hugging Face `config.json` files carry many keys the draft head does not use, so their
//! keys are not checked; JSON has no NaN or infinity literals, and [`json_error`] names a
//! non-finite number that a Python writer put there anyway.

use super::Errors;

// The `[speculative]` and `[capture]` keys are the flag table's (`flags::table_keys`).

/// `[model]` keys (Hugging Face names) that the model reader uses.
pub const MODEL_KEYS: &[&str] = &[
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    // Read into YaRN's and LongRoPE's training length, as SGLang's Llama layers do.
    "original_max_position_embeddings",
    "bias",
    "torch_dtype",
    "dtype",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    // EAGLE-3 (config/eagle3.rs)
    "head",
    "architectures",
    "target_hidden_size",
    "draft_vocab_size",
    "eagle_config",
    "norm_before_residual",
    "tie_word_embeddings",
];

/// `[model.rope_scaling]` keys.
pub const ROPE_SCALING_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "mrope_section",
    // YaRN (`model.rs::read_yarn`).
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "attention_factor",
    "attn_factor",
    "extrapolation_factor",
    // LongRoPE (`model.rs::read_longrope`).
    "short_factor",
    "long_factor",
    "short_mscale",
    "long_mscale",
];

/// The tables and their known keys: the model reader's, and the flag table's for the rest.
fn tables() -> [(&'static str, Vec<&'static str>); 3] {
    [
        ("model", MODEL_KEYS.to_vec()),
        ("speculative", super::flags::table_keys("speculative")),
        ("capture", super::flags::table_keys("capture")),
    ]
}

/// Checks a parsed TOML config: known tables and keys, finite numbers. Every problem is
/// pushed with its path; non-finite numbers are also remembered so that the readers do not
/// report the same key again as missing.
pub fn check_toml(root: &toml::Table, e: &mut Errors) {
    for (path, x) in non_finite(root) {
        e.push(
            path.clone(),
            format!("{x} is not a finite number (nan and inf are not accepted)"),
        );
        e.non_finite.push(path);
    }
    for (key, v) in root {
        let tables = tables();
        match tables.iter().find(|(t, _)| t == key) {
            Some((table, known)) => match v.as_table() {
                Some(t) => check_table(table, t, known, e),
                // The model reader reports a [model] that is not a table.
                None if *table == "model" => {}
                None => e.push(key.clone(), format!("expected a [{key}] table, got {}", v.type_str())),
            },
            None => {
                let hint = match home_of(key) {
                    Some(t) => format!(" (`{key}` belongs in the [{t}] table)"),
                    None => did_you_mean(key, &["model", "speculative", "capture"]),
                };
                e.push(
                    key.clone(),
                    format!("unknown top-level key or table{hint}; expected the tables [model], [speculative] and [capture]"),
                );
            }
        }
    }
}

fn check_table(name: &str, t: &toml::Table, known: &[&str], e: &mut Errors) {
    for (key, v) in t {
        let path = format!("{name}.{key}");
        if known.contains(&key.as_str()) {
            if name == "model" && key == "rope_scaling" {
                if let Some(rs) = v.as_table() {
                    check_table(&path, rs, ROPE_SCALING_KEYS, e);
                }
            }
            continue;
        }
        let hint = match home_of(key) {
            Some(other) if other != name => format!(" (`{key}` belongs in the [{other}] table)"),
            _ => did_you_mean(key, known),
        };
        e.push(
            path,
            format!("unknown key in [{name}]{hint}; known keys: {}", known.join(", ")),
        );
    }
}

/// The table a key belongs in, when it is a known key of one.
fn home_of(key: &str) -> Option<&'static str> {
    tables()
        .into_iter()
        .find(|(_, keys)| keys.contains(&key))
        .map(|(t, _)| t)
}

/// " (did you mean `x`?)" for the closest known key within a small edit distance (also
/// used for the Python package's keyword arguments).
pub fn did_you_mean(key: &str, known: &[&str]) -> String {
    let lower = key.to_lowercase();
    let best = known
        .iter()
        .map(|k| (levenshtein(&lower, k), *k))
        .min_by_key(|(d, k)| (*d, *k));
    match best {
        // A third of the key's length, at least 1 and at most 3 edits: `page_sise`,
        // `Page_Size`, `num_draft_token` are near misses; `foo` is not near `topk`.
        Some((d, k)) if d <= (key.chars().count() / 3).clamp(1, 3) => format!(" (did you mean `{k}`?)"),
        _ => String::new(),
    }
}

/// Edit distance (insertions, deletions, substitutions) between two short strings.
pub fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = Vec::with_capacity(b.len() + 1);
        cur.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Every non-finite float in a TOML document, with its path (`model.rope_theta`,
/// `capture.buckets[2]`), in document key order.
fn non_finite(root: &toml::Table) -> Vec<(String, f64)> {
    fn walk(path: String, v: &toml::Value, out: &mut Vec<(String, f64)>) {
        match v {
            toml::Value::Float(x) if !x.is_finite() => out.push((path, *x)),
            toml::Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(format!("{path}[{i}]"), x, out);
                }
            }
            toml::Value::Table(t) => {
                for (k, x) in t {
                    walk(format!("{path}.{k}"), x, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (k, v) in root {
        walk(k.clone(), v, &mut out);
    }
    out
}

/// A `config.json` parse error, naming a NaN or Infinity literal where serde_json stopped
/// at one (Python's `json.dump` writes them; JSON has no such numbers).
pub fn json_error(text: &str, err: &serde_json::Error) -> String {
    let at = text
        .lines()
        .nth(err.line().saturating_sub(1))
        .and_then(|l| l.get(err.column().saturating_sub(1)..))
        .unwrap_or("");
    let line = text.lines().nth(err.line().saturating_sub(1)).unwrap_or("");
    let col = err.column().saturating_sub(1);
    // serde_json stops at the literal, or just past a leading minus sign.
    let signed = col > 0 && line.get(col - 1..col) == Some("-");
    let literal = ["NaN", "Infinity"]
        .into_iter()
        .find(|lit| at.starts_with(lit))
        .map(|lit| if signed { format!("-{lit}") } else { lit.to_string() });
    match literal {
        Some(lit) => format!(
            "{lit} at line {} column {} is not a finite number (JSON numbers must be finite)",
            err.line(),
            err.column()
        ),
        None => format!("not valid JSON: {err}"),
    }
}

/// A JSON document walked only to find a key that one object repeats: serde_json's `Value`
/// keeps the last silently, where TOML refuses the file; a `config.json` naming
/// `hidden_size` twice would otherwise compile with whichever came last.
struct NoRepeats;

impl<'de> serde::Deserialize<'de> for NoRepeats {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NoRepeatsVisitor)
    }
}

struct NoRepeatsVisitor;

impl<'de> serde::de::Visitor<'de> for NoRepeatsVisitor {
    type Value = NoRepeats;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<NoRepeats, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!(
                    "key \"{key}\" appears twice in one object"
                )));
            }
            map.next_value::<NoRepeats>()?;
        }
        Ok(NoRepeats)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<NoRepeats, A::Error> {
        while seq.next_element::<NoRepeats>()?.is_some() {}
        Ok(NoRepeats)
    }

    fn visit_bool<E>(self, _: bool) -> Result<NoRepeats, E> {
        Ok(NoRepeats)
    }
    fn visit_i64<E>(self, _: i64) -> Result<NoRepeats, E> {
        Ok(NoRepeats)
    }
    fn visit_u64<E>(self, _: u64) -> Result<NoRepeats, E> {
        Ok(NoRepeats)
    }
    fn visit_f64<E>(self, _: f64) -> Result<NoRepeats, E> {
        Ok(NoRepeats)
    }
    fn visit_str<E>(self, _: &str) -> Result<NoRepeats, E> {
        Ok(NoRepeats)
    }
    fn visit_unit<E>(self) -> Result<NoRepeats, E> {
        Ok(NoRepeats)
    }
}

/// The first key an object of the JSON `text` repeats, with where (`None`: none, or the text
/// is not JSON, which the parse itself reports).
pub fn json_repeated_key(text: &str) -> Option<String> {
    serde_json::from_str::<NoRepeats>(text)
        .err()
        .filter(|e| e.to_string().contains("appears twice"))
        .map(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance() {
        assert_eq!(levenshtein("page_sise", "page_size"), 1);
        assert_eq!(levenshtein("", "abc"), 3);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("topk", "topk"), 0);
    }

    #[test]
    fn near_misses_get_a_hint() {
        assert_eq!(
            did_you_mean("page_sise", &super::super::flags::table_keys("capture")),
            " (did you mean `page_size`?)"
        );
        assert_eq!(
            did_you_mean("Max_BS", &super::super::flags::table_keys("capture")),
            " (did you mean `max_bs`?)"
        );
        assert_eq!(did_you_mean("colour", &super::super::flags::table_keys("capture")), "");
    }

    #[test]
    fn json_non_finite_literals_are_named() {
        let text = "{\"rope_theta\": NaN}";
        let Err(err) = serde_json::from_str::<serde_json::Value>(text) else {
            panic!("NaN parsed as JSON");
        };
        assert_eq!(
            json_error(text, &err),
            "NaN at line 1 column 16 is not a finite number (JSON numbers must be finite)"
        );
    }

    #[test]
    fn json_repeated_keys_are_found() {
        let e = json_repeated_key("{\"a\": 1, \"b\": {\"c\": 2, \"c\": 3}}").expect("repeat found");
        assert!(e.contains("key \"c\" appears twice") && e.contains("line 1"), "{e}");
        assert_eq!(
            json_repeated_key("{\"a\": [{\"c\": 1}, {\"c\": 2}], \"b\": null}"),
            None
        );
        assert_eq!(json_repeated_key("not json"), None);
    }
}
