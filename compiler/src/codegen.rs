//! Kernel instances of a plan: each entry an op needs, specialized by the plan's facts and
//! deduplicated by its source.
//!
//! Constants are bucket independent (model, spec and capture facts, the layer's window),
//! so one table serves every bucket; per-bucket values (rows, batch, KV splits) travel as
//! launch arguments. The constants, the prelude and the source all come from the kernels
//! crate's declarations, the same functions the validator checks plans with.

use std::collections::BTreeMap;

use specplan_format::{KernelDesc, KernelFacts};
use specplan_kernels::source::{full_source, mangled_name, source_hash};
use specplan_kernels::Entry;

/// Deduplicated kernel table, in first-use order, with each kernel's full source.
#[derive(Default)]
pub struct KernelTable {
    pub kernels: Vec<KernelDesc>,
    /// The NVRTC source of `kernels[i]`.
    pub sources: Vec<String>,
    index: BTreeMap<String, u32>,
}

impl KernelTable {
    /// Index of `entry` specialized for `f`, adding it on first use.
    pub fn intern(&mut self, entry: Entry, f: &KernelFacts) -> u32 {
        let template = entry.template();
        let constants = template.constants(f);
        let name = mangled_name(entry, &constants);
        let source = full_source(template, &constants, f);
        let hash = source_hash(&source);
        // The name alone misses float constants; key on the hash so distinct sources
        // never share a slot, and suffix the name when two differ only in floats.
        let key = format!("{name}#{hash}");
        if let Some(&i) = self.index.get(&key) {
            return i;
        }
        let taken = self
            .kernels
            .iter()
            .filter(|k| k.name == name || k.name.starts_with(&format!("{name}_v")))
            .count();
        let unique = if taken == 0 { name } else { format!("{name}_v{taken}") };
        let i = self.kernels.len() as u32;
        self.kernels.push(KernelDesc {
            name: unique,
            entry,
            constants,
            source_hash: hash,
            binary: None,
        });
        self.sources.push(source);
        self.index.insert(key, i);
        i
    }
}
