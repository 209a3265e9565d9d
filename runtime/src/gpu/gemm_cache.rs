//! A cache of GEMM algorithm choices, so loading a plan does not time cuBLASLt's candidates
//! again (that costs 0.1–0.6 s per load). cuBLASLt documents `cublasLtMatmulAlgo_t` as plain
//! data that can be stored and reused with the same library version; the cache is one
//! file per device, driver, cuBLASLt version and skinny GEMM source (the plan's own
//! candidate, `skinny.rs`), one line per GEMM shape, and every entry is confirmed with
//! `cublasLtMatmulAlgoCheck` before use.
//!
//! Location: `$SPECPLAN_CACHE_DIR/gemm/` (default `~/.cache/specplan/gemm/`;
//! `SPECPLAN_CACHE_DIR=off` disables it). A missing, unreadable or foreign file only costs
//! a re-tune; writes go through a temporary file renamed into place.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::lt::{GemmChoice, GemmShape};

pub(crate) struct GemmCache {
    path: Option<PathBuf>,
    entries: BTreeMap<String, ([u64; 8], GemmChoice)>,
    dirty: bool,
}

fn key(s: &GemmShape) -> String {
    format!(
        "m{} n{} k{} lda{} acc{}{} w{} a{} c{} al{}",
        s.m,
        s.n,
        s.k,
        s.lda,
        s.accumulate as u8,
        if s.rounded { " rounded" } else { "" },
        s.w.name(),
        s.a.name(),
        s.c.name(),
        s.align
    )
}

/// The cache folder, from the environment (`None`: disabled or no home).
pub(crate) fn cache_dir() -> Option<PathBuf> {
    match std::env::var("SPECPLAN_CACHE_DIR") {
        Ok(v) if v == "off" => None,
        Ok(v) if !v.is_empty() => Some(PathBuf::from(v).join("gemm")),
        _ => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/specplan/gemm")),
    }
}

fn parse_line(line: &str) -> Option<(String, [u64; 8], GemmChoice)> {
    let mut parts = line.split('\t');
    let k = parts.next()?.to_string();
    let words: Vec<u64> = parts
        .next()?
        .split(',')
        .map(|w| u64::from_str_radix(w, 16).ok())
        .collect::<Option<_>>()?;
    let algo: [u64; 8] = words.try_into().ok()?;
    let nums: Vec<&str> = parts.next()?.split(' ').collect();
    let choice = GemmChoice {
        first_us: nums.first()?.parse().ok()?,
        best_us: nums.get(1)?.parse().ok()?,
        rank: nums.get(2)?.parse().ok()?,
        candidates: nums.get(3)?.parse().ok()?,
        ours: nums.get(4)? == &"ours",
        // Read from the algorithm when it is adopted (`Lt::adopt`).
        split: 1,
    };
    Some((k, algo, choice))
}

/// One entry as a line (what `parse_line` reads): the key, the algorithm's words in hex, the
/// choice's numbers and whether the skinny GEMM was kept (`ours`) or cuBLASLt (`lt`).
fn line(k: &str, algo: &[u64; 8], c: &GemmChoice) -> String {
    let words: Vec<String> = algo.iter().map(|w| format!("{w:x}")).collect();
    format!(
        "{k}\t{}\t{} {} {} {} {}",
        words.join(","),
        c.first_us,
        c.best_us,
        c.rank,
        c.candidates,
        if c.ours { "ours" } else { "lt" }
    )
}

/// The rule that chose the cached algorithms (`lt.rs`); a new rule starts a new file, so
/// choices made by an old one are not reused. 2: graph nodes beyond the kernel charged;
/// 3: twelve candidates, each run timed with the L2 flushed; 4: the plan's skinny GEMM a
/// candidate too (a line's fifth number: `ours` when it was kept).
const RULE: u32 = 4;

impl GemmCache {
    /// The cache for this device (its name), driver and cuBLASLt version.
    /// The cache of `device` with this driver and cuBLASLt version, for plans whose skinny
    /// GEMM has source hash `skinny` (its choices were timed against that kernel: another
    /// kernel source starts another file).
    pub fn open(device: &str, driver: i32, lt_version: usize, skinny: &str) -> GemmCache {
        let safe = |s: &str| -> String {
            s.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                .collect()
        };
        let (slug, kernel) = (safe(device), safe(&skinny.chars().take(12).collect::<String>()));
        let path = cache_dir().map(|d| {
            d.join(format!(
                "{slug}-driver{driver}-cublaslt{lt_version}-rule{RULE}-skinny{kernel}.tsv"
            ))
        });
        let mut entries = BTreeMap::new();
        if let Some(text) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
            for (k, algo, choice) in text.lines().filter_map(parse_line) {
                entries.insert(k, (algo, choice));
            }
        }
        GemmCache {
            path,
            entries,
            dirty: false,
        }
    }

    pub fn get(&self, s: &GemmShape) -> Option<([u64; 8], GemmChoice)> {
        self.entries.get(&key(s)).copied()
    }

    pub fn put(&mut self, s: &GemmShape, algo: [u64; 8], choice: GemmChoice) {
        self.entries.insert(key(s), (algo, choice));
        self.dirty = true;
    }

    /// Writes the cache when it changed. A failure is reported, never fatal.
    pub fn save(&self) -> Result<(), String> {
        let (Some(path), true) = (&self.path, self.dirty) else {
            return Ok(());
        };
        let mut text = String::new();
        for (k, (algo, c)) in &self.entries {
            text.push_str(&line(k, algo, c));
            text.push('\n');
        }
        let dir = path.parent().ok_or("no cache folder")?;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let tmp = path.with_extension(format!("tsv.{}.partial", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("{}: {e}", path.display())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specplan_format::DType;

    #[test]
    fn entries_round_trip_through_a_line() {
        let s = GemmShape {
            m: 16,
            n: 4096,
            k: 8192,
            lda: 8192,
            accumulate: true,
            rounded: false,
            w: DType::Bf16,
            a: DType::Bf16,
            c: DType::F32,
            align: 256,
        };
        let c = GemmChoice {
            first_us: 10.5,
            best_us: 9.25,
            rank: 3,
            candidates: 8,
            ours: true,
            split: 1,
        };
        let algo = [1, 2, 3, u64::MAX, 0, 5, 6, 0xdead_beef];
        let (k, a, back) = parse_line(&line(&key(&s), &algo, &c)).expect("parses");
        assert_eq!((k, a), (key(&s), algo));
        assert_eq!(
            (back.best_us, back.rank, back.candidates, back.ours),
            (9.25, 3, 8, true)
        );
        let lt = GemmChoice { ours: false, ..c };
        assert!(!parse_line(&line(&key(&s), &algo, &lt)).expect("parses").2.ours);
        assert!(parse_line("m1 n1\tnot,hex\t1 2 3 4 lt").is_none());
        assert!(parse_line("m1\t1,2\t1 2 3 4 lt").is_none(), "eight words or nothing");
        assert!(
            parse_line(&line(&key(&s), &algo, &c).replace(" ours", "")).is_none(),
            "five numbers or nothing"
        );
    }
}
