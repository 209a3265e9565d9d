//! Kernel specialization: which template and constants each op needs, the generated
//! prelude, and the deduplicated kernel table of a plan.
//!
//! Constants are bucket independent (model, spec and capture facts), so one table serves
//! every bucket; per-bucket values (rows, batch, KV splits) travel as launch arguments.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use specplan_kernels::abi::FieldKind;
use specplan_kernels::params::params_for;
use specplan_kernels::{full_source, geometry, source_hash, template};
use specplan_runtime::format::{ConstValue, DType, KernelDesc, ParamField, ParamKind};

use crate::config::Config;
use crate::graph::OpKind;

/// A kernel instance before compilation.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelSpec {
    pub template: &'static str,
    pub entry: &'static str,
    pub constants: Vec<(String, ConstValue)>,
}

impl KernelSpec {
    /// Stable, readable, unique name: entry plus the constants that vary between configs.
    pub fn mangled_name(&self) -> String {
        let mut s = self.entry.to_string();
        for (k, v) in &self.constants {
            let short = match v {
                ConstValue::U32(x) => x.to_string(),
                ConstValue::Bool(b) => (*b as u8).to_string(),
                ConstValue::Type(t) => {
                    let _ = write!(s, "_{}", if t == "__half" { "f16" } else { "bf16" });
                    continue;
                }
                // Float constants and tables are covered by the source hash.
                ConstValue::F32(_) | ConstValue::F32Array(_) => continue,
            };
            let _ = write!(s, "_{}{short}", k.to_ascii_lowercase().replace('_', ""));
        }
        s
    }
}

pub fn act_type(d: DType) -> &'static str {
    match d {
        DType::F16 => "__half",
        _ => "__nv_bfloat16",
    }
}

/// Attention tiling fixed at plan time: (KV_TILE, STAGES). STAGES K/V tiles are resident
/// (STAGES - 1 loads in flight while one tile is computed); the tile is the largest of 64,
/// 32, 16 keys whose shared memory fits.
///
/// Measured on the H200 (docs/perf-notes.md, 2026-11-30): 3 stages of 64 keys matched or
/// beat 2×64, 3×32 and 4×32 on the large MHA shapes (4.15–4.22 TB/s at B 32–64, L 4096)
/// and on B 8, L 4096 (3.58 against 3.08 TB/s for 2×64); 3×32 was better only for GQA at
/// B 8 and 14–36% slower at B 32–64; 2×64 was 15% faster only at B 1, L 1024 (20 µs).
pub fn attn_geometry(cfg: &Config) -> Option<(u32, u32)> {
    const STAGES: u32 = 3;
    let m = &cfg.model.desc;
    let rows = cfg.spec.num_draft_tokens * (m.heads / m.kv_heads);
    [(64u32, STAGES), (32, STAGES), (16, STAGES), (16, 2)]
        .into_iter()
        .find(|&(t, st)| {
            geometry::attn_smem_bytes(rows, m.head_dim, t, st, cfg.capture.dtype.size() as u32)
                <= specplan_runtime::format::MAX_SMEM_BYTES as u64
        })
}

/// The kernels an op lowers to (empty for GEMMs, which are cuBLAS calls).
pub fn kernel_specs(kind: &OpKind, cfg: &Config) -> Vec<KernelSpec> {
    let m = &cfg.model.desc;
    let c = &cfg.capture;
    let act = ("act_t".to_string(), ConstValue::Type(act_type(c.dtype).into()));
    let u = |k: &str, v: u32| (k.to_string(), ConstValue::U32(v));
    let spec = |template, entry, mut consts: Vec<(String, ConstValue)>| {
        consts.insert(0, act.clone());
        KernelSpec {
            template,
            entry,
            constants: consts,
        }
    };
    let n = cfg.spec.num_draft_tokens;
    // The geometry every kernel that walks the paged KV cache shares.
    let paged_kv = || {
        vec![
            u("HEADS", m.heads),
            u("KV_HEADS", m.kv_heads),
            u("HEAD_DIM", m.head_dim),
            u("N", n),
            u("PAGE_SIZE", c.page_size),
            u("MAX_PAGES", c.pages_per_request()),
            u("SLOTS", c.max_requests + 1),
        ]
    };
    match kind {
        OpKind::EmbedConcat { bias } => vec![spec(
            "embed.cu",
            "embed_concat",
            vec![
                u("HIDDEN", m.hidden),
                u("VOCAB", m.vocab),
                ("HAS_BIAS".into(), ConstValue::Bool(*bias)),
            ],
        )],
        OpKind::RmsNorm => vec![spec(
            "norm.cu",
            "rmsnorm",
            vec![u("HIDDEN", m.hidden), ("EPS".into(), ConstValue::F32(m.rms_norm_eps))],
        )],
        OpKind::RopeAppend { .. } => vec![spec("rope_append.cu", "rope_append", {
            let mut v = paged_kv();
            v.push(("INV_FREQ".into(), ConstValue::F32Array(crate::config::rope_inv_freq(m))));
            v
        })],
        OpKind::Attention { window, .. } => {
            // Both entries come from one source, so they share every constant (and one
            // prelude declaring both parameter structs).
            let (tile, stages) = attn_geometry(cfg).unwrap_or((16, 2));
            let mut consts = paged_kv();
            consts.extend([
                u("WINDOW", window.unwrap_or(0)),
                ("SCALE".into(), ConstValue::F32(1.0 / (m.head_dim as f32).sqrt())),
                u("KV_TILE", tile),
                u("STAGES", stages),
            ]);
            vec![
                spec("attention.cu", "attn_partial", consts.clone()),
                spec("attention.cu", "attn_merge", consts),
            ]
        }
        OpKind::SiluMul => vec![spec("mlp.cu", "silu_mul", vec![u("INTER", m.intermediate)])],
        OpKind::SelectRows => vec![spec("select.cu", "select_rows", vec![u("HIDDEN", m.hidden), u("N", n)])],
        OpKind::SoftmaxTopK { k, hot_map } => {
            let cols = c.hot_vocab_size.unwrap_or(m.vocab);
            let consts = vec![
                u("COLS", cols),
                u("TOPK", *k),
                ("HOT_MAP".into(), ConstValue::Bool(*hot_map)),
                u("FULL_VOCAB", m.vocab),
            ];
            // Long rows are split across CTAs (partial + merge); one CTA per row otherwise.
            if geometry::topk_chunks(cols) > 1 {
                vec![
                    spec("sample.cu", "topk_partial", consts.clone()),
                    spec("sample.cu", "topk_merge", consts),
                ]
            } else {
                vec![spec("sample.cu", "softmax_topk", consts)]
            }
        }
        // GEMMs go to cuBLAS; unfused ops never reach scheduling (verified before).
        _ => Vec::new(),
    }
}

fn c_float(x: f32) -> String {
    // `{:?}` is the shortest representation that round-trips, always with a '.' or 'e'.
    format!("{x:?}f")
}

/// The generated prelude: headers, the activation type and one declaration per constant.
pub fn prelude(spec: &KernelSpec) -> String {
    prelude_for(&spec.constants, spec.entry)
}

/// The prelude for constants and an entry: headers, `act_t`, one declaration per constant,
/// then the entry's parameter struct as the kernels crate's `KernelParams` derive wrote it.
pub fn prelude_for(constants: &[(String, ConstValue)], entry: &str) -> String {
    let mut s = String::from("// Generated by specplan: specialization constants of this kernel instance.\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n");
    for (name, v) in constants {
        let _ = match v {
            ConstValue::Type(t) => writeln!(s, "using {name} = {t};"),
            ConstValue::U32(x) => writeln!(s, "constexpr unsigned {name} = {x}u;"),
            ConstValue::F32(x) => writeln!(s, "constexpr float {name} = {};", c_float(*x)),
            ConstValue::Bool(b) => writeln!(s, "constexpr bool {name} = {b};"),
            ConstValue::F32Array(xs) => {
                let items: Vec<String> = xs.iter().map(|x| c_float(*x)).collect();
                writeln!(s, "__constant__ float {name}[{}] = {{{}}};", xs.len(), items.join(", "))
            }
        };
    }
    // Every entry of the template is compiled from this source, so declare each one's
    // parameter struct.
    let entries = specplan_kernels::TEMPLATES
        .iter()
        .find(|t| t.entries.contains(&entry))
        .map_or(&[][..], |t| t.entries);
    for e in entries {
        if let Some(p) = params_for(e) {
            let _ = writeln!(
                s,
                "// {} (from specplan_kernels::params, #[derive(KernelParams)]).",
                p.c_name
            );
            s.push_str(p.c_decl);
        }
    }
    s
}

/// Deduplicated kernel table, in first-use order.
#[derive(Default)]
pub struct KernelTable {
    pub kernels: Vec<KernelDesc>,
    index: BTreeMap<String, u32>,
}

impl KernelTable {
    /// Index of the kernel for `spec`, adding it on first use.
    pub fn intern(&mut self, spec: &KernelSpec) -> u32 {
        let name = spec.mangled_name();
        let prelude = prelude(spec);
        let source = template(spec.template)
            .map(|t| full_source(&prelude, t))
            .unwrap_or_default();
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
        let abi = params_for(spec.entry);
        self.kernels.push(KernelDesc {
            name: unique,
            template: spec.template.into(),
            entry: spec.entry.into(),
            constants: spec.constants.clone(),
            source_hash: hash,
            params_name: abi.map_or_else(String::new, |p| p.c_name.to_string()),
            params_size: abi.map_or(0, |p| p.size),
            params: abi.map_or_else(Vec::new, |p| {
                p.fields
                    .iter()
                    .map(|f| ParamField {
                        name: f.name.into(),
                        offset: f.offset,
                        kind: match f.kind {
                            FieldKind::Ptr => ParamKind::Ptr,
                            FieldKind::U32 => ParamKind::U32,
                        },
                    })
                    .collect()
            }),
            binary: None,
        });
        self.index.insert(key, i);
        i
    }
}

/// The full NVRTC source of a kernel in a plan (prelude rebuilt from its constants).
pub fn kernel_source(k: &KernelDesc) -> Option<String> {
    Some(full_source(
        &prelude_for(&k.constants, &k.entry),
        template(&k.template)?,
    ))
}
