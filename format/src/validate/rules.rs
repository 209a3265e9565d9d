//! The kernel rules of validation: each kernel against its entry's declaration in the
//! kernels crate, and each kernel launch against the shape that declaration gives for the
//! bucket (rules 5 and 7 of `validate.rs`).

use std::collections::HashMap;

use specplan_kernels::abi::{Extent, FieldKind, Slot};
use specplan_kernels::facts::{BucketFacts, KernelFacts};
use specplan_kernels::source::{full_source, mangled_name, source_hash};
use specplan_kernels::ConstValue;

use super::common::{facts_for_window, printable, Errors};
use crate::location::Location;
use crate::types::*;

/// The facts a kernel of phase `kind` may be specialized for: the phase's, at each of its
/// steps (multi-step phases specialize some instances per forward).
pub(crate) fn candidates(p: &Plan, kind: PhaseKind) -> Vec<KernelFacts> {
    let f = crate::facts::phase_facts_of(p, kind);
    let steps = (0..kind.steps().max(1)).map(|s| f.at_step(s));
    // After each step's facts (so an instance over every row matches them first), the
    // selected rows' instances (one row per request: the draft-extend head's last layer
    // past its K/V append), then its attention's over the selected query rows (told apart
    // by their SELECT_FROM constant).
    let selected = (0..kind.steps().max(1)).map(|s| f.at_step(s).selected_rows());
    let mut all: Vec<KernelFacts> = steps.chain(selected).collect();
    if kind == PhaseKind::DraftExtend {
        all.push(f.selected_query());
    }
    all
}

/// Every phase's candidates.
fn all_candidates(p: &Plan) -> Vec<KernelFacts> {
    p.phases.iter().flat_map(|ph| candidates(p, ph.kind)).collect()
}

/// The window a kernel's WINDOW constant names (attention instances).
fn window_of(k: &KernelDesc) -> Option<u32> {
    k.constants.iter().find_map(|(n, v)| match (n.as_str(), v) {
        ("WINDOW", ConstValue::U32(w)) => Some(*w),
        _ => None,
    })
}

/// The candidate facts (with the window its WINDOW constant names, when that is a layer's)
/// whose template constants are exactly the kernel's: what it was specialized for. `None`
/// when no candidate gives its constants.
pub(crate) fn instance_facts(p: &Plan, cands: &[KernelFacts], k: &KernelDesc) -> Option<KernelFacts> {
    let template = k.entry.template();
    cands.iter().find_map(|f| {
        let kf = match window_of(k) {
            Some(w) => facts_for_window(p, f, w)?,
            None => f.clone(),
        };
        same_constants(&template.constants(&kf), &k.constants).then_some(kf)
    })
}

fn same_constants(want: &[(String, ConstValue)], got: &[(String, ConstValue)]) -> bool {
    want.len() == got.len()
        && want
            .iter()
            .zip(got)
            .all(|((wn, wv), (n, v))| wn == n && wv.same_bits(v))
}

/// The facts `f` (with the window a kernel's WINDOW constant names, when a layer has it):
/// what a kernel whose constants no candidate gives is compared and launched against.
fn fallback_facts(p: &Plan, f: &KernelFacts, k: &KernelDesc) -> Option<KernelFacts> {
    match window_of(k) {
        Some(w) => facts_for_window(p, f, w),
        None => Some(f.clone()),
    }
}

/// The full NVRTC source of a validated plan's kernel: the template with the prelude its
/// constants give (what its `source_hash` names). For rebuilding kernels locally instead of
/// running the binaries a plan file carries.
pub fn kernel_source(p: &crate::ValidatedPlan, k: &KernelDesc) -> Option<String> {
    let kf = instance_facts(p, &all_candidates(p), k)?;
    Some(full_source(k.entry.template(), &k.constants, &kf))
}

pub(crate) fn kernels(p: &Plan, e: &mut Errors) {
    let cands = all_candidates(p);
    let mut names = std::collections::HashSet::new();
    for (i, k) in p.kernels.iter().enumerate() {
        let at = |msg: String| (Location::Kernel(i as u32), format!("kernels[{i}] ({}): {msg}", k.name));
        e.check(
            printable(&k.name, 256) && k.name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_'),
            || at("the name must be 1–256 characters of [A-Za-z0-9_]".into()),
        );
        e.check(names.insert(k.name.as_str()), || at("duplicate name".into()));
        let template = k.entry.template();
        let found = instance_facts(p, &cands, k);
        let same = found.is_some();
        // The message compares with the first phase's facts (the window's, when a layer has it).
        let Some(first) = cands.first() else { continue };
        let Some(kf) = found.or_else(|| fallback_facts(p, first, k)) else {
            e.check(false, || at("constant WINDOW matches no layer's window".into()));
            continue;
        };
        let want = template.constants(&kf);
        e.check(same, || {
            let diff = want
                .iter()
                .zip(k.constants.iter().map(Some).chain(std::iter::repeat(None)))
                .find(|((wn, wv), got)| !got.is_some_and(|(n, v)| n == wn && wv.same_bits(v)))
                .map(|((wn, wv), got)| match got {
                    Some((n, v)) => format!("constant {n} = {v:?}, expected {wn} = {wv:?}"),
                    None => format!("constant {wn} missing (expected {wv:?})"),
                })
                .unwrap_or_else(|| format!("{} constants, expected {}", k.constants.len(), want.len()));
            at(format!(
                "{diff} (constants are fixed by {} and the plan's facts)",
                template.file()
            ))
        });
        if !same {
            continue;
        }
        // Admission checks the prefix entries from the oldest position any layer reads: a
        // narrower window would leave a hole some layer reads unreported.
        let read = crate::facts::read_window(p.layers.iter().map(|l| l.window));
        e.check(template != specplan_kernels::Template::Io || kf.window == read, || {
            at(format!(
                "constant WINDOW = {}, expected the layers' read window {read} (0: some layer reads its whole prefix)",
                kf.window
            ))
        });
        // The name is the instance's mangled name (suffixed `_vN` when two instances differ
        // only in float constants), so a plan cannot relabel what `show` and `diff` print.
        let base = mangled_name(k.entry, &k.constants);
        let suffix = k.name.strip_prefix(base.as_str()).map(|r| r.strip_prefix("_v"));
        let named = match suffix {
            Some(None) => k.name == base,
            Some(Some(n)) => !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()),
            None => false,
        };
        e.check(named, || {
            at(format!(
                "the name is not the instance's mangled name {base} (or {base}_vN)"
            ))
        });
        let hash = source_hash(&full_source(template, &k.constants, &kf));
        e.check(k.source_hash == hash, || {
            at(format!(
                "source_hash {} is not the hash of the source its constants give ({})",
                short(&k.source_hash),
                &hash[..12]
            ))
        });
        if let Some(b) = &k.binary {
            let want = format!("sm_{}", p.target.sm);
            e.check(b.arch == want, || {
                at(format!("binary for {}, plan targets {want}", b.arch))
            });
            e.check(b.source_hash == k.source_hash, || {
                at("the binary was compiled from another source (its source_hash differs)".into())
            });
            // The driver reads the image's header tables without a length.
            e.check(cubin_ok(&b.cubin), || {
                at("the CUBIN is not a well-formed ELF image".into())
            });
            e.check(b.ptx.is_ascii() && !b.ptx.contains('\0'), || {
                at("the PTX is not NUL-free ASCII text".into())
            });
        }
    }
    // Every plan carries one instance of each runtime-launched entry (the compiler interns
    // them whatever the buckets hold): a plan without `admit` could not run on engine
    // memory, one without `fill` would keep its GEMMs' memsets in every graph.
    for entry in specplan_kernels::Entry::ALL.iter().filter(|e| e.runtime_launched()) {
        let n = p.kernels.iter().filter(|k| k.entry == *entry).count();
        e.field(n == 1, "kernels", || {
            format!("{n} kernels of {entry}, the runtime launches exactly one")
        });
    }
    e.field(p.target.sm >= 80 && p.target.sm < 1000, "target.sm", || {
        format!("sm_{} is not a supported architecture (≥ sm_80)", p.target.sm)
    });
}

fn short(s: &str) -> String {
    s.chars().take(12).collect()
}

/// An ELF image whose header tables lie inside it (the driver reads them unchecked).
pub(crate) fn cubin_ok(c: &[u8]) -> bool {
    if c.len() < 64 || &c[..4] != b"\x7fELF" || c[4] != 2 {
        return false;
    }
    let u64_at = |o: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&c[o..o + 8]);
        u64::from_le_bytes(w)
    };
    let u16_at = |o: usize| u16::from_le_bytes([c[o], c[o + 1]]) as u64;
    let (phoff, shoff) = (u64_at(0x20), u64_at(0x28));
    let (phentsize, phnum, shentsize, shnum) = (u16_at(0x36), u16_at(0x38), u16_at(0x3a), u16_at(0x3c));
    let within = |off: u64, size: u64, num: u64| off.checked_add(size * num).is_some_and(|end| end <= c.len() as u64);
    within(phoff, phentsize, phnum) && within(shoff, shentsize, shnum)
}

/// Bytes each weight is touched by (its largest use) and which kernels are launched,
/// over every bucket; filled by the launch rules and checked by [`usage`].
#[derive(Default)]
pub(crate) struct Touched {
    pub weights: HashMap<u32, u64>,
    pub kernels: Vec<bool>,
}

/// One kernel launch against its entry's declaration. Returns the access of every
/// buffer argument (id, field index) for the data-flow rules.
#[allow(clippy::too_many_arguments)]
pub(crate) fn kernel_launch(
    p: &Plan,
    f: &KernelFacts,
    cands: &[KernelFacts],
    b: &BucketPlan,
    bf: &BucketFacts,
    kernel: u32,
    [grid, block]: [[u32; 3]; 2],
    smem: u32,
    cluster: u32,
    args: &[ArgValue],
    at: &dyn Fn(Option<u32>, String) -> (Location, String),
    touched: &mut Touched,
    buf_touched: &mut [u64],
    e: &mut Errors,
) -> Vec<(u32, usize)> {
    let mut bufs = Vec::new();
    let Some(k) = p.kernels.get(kernel as usize) else {
        e.check(false, || {
            at(
                None,
                format!(".kernel: {kernel} out of range ({} kernels)", p.kernels.len()),
            )
        });
        return bufs;
    };
    if let Some(t) = touched.kernels.get_mut(kernel as usize) {
        *t = true;
    }
    if k.entry.runtime_launched() {
        e.check(false, || {
            at(
                None,
                format!(".kernel: {} is launched by the runtime, never by a plan", k.entry),
            )
        });
        return bufs;
    }
    let kf = match instance_facts(p, cands, k) {
        Some(kf) => kf,
        // Another phase's kernel: its launch shape here would be meaningless.
        None if instance_facts(p, &all_candidates(p), k).is_some() => {
            e.check(false, || {
                at(
                    None,
                    format!(
                        ".kernel: {} serves another phase (its constants are no step's facts of this one)",
                        k.name
                    ),
                )
            });
            return bufs;
        }
        // Constants no phase gives (the kernel rule names them): the launch is still checked
        // against this phase's facts.
        None => match fallback_facts(p, f, k) {
            Some(kf) => kf,
            None => return bufs,
        },
    };
    let shape = k.entry.shape(bf, &kf);
    let name = k.entry.name();
    // The last CTA merges the records it can see: one rank's (a sharded row's meet after the
    // all-gather, in topk_merge).
    e.check(k.entry != specplan_kernels::Entry::TopkFused || kf.tp_size <= 1, || {
        at(
            None,
            format!(
                ".kernel: {name} merges one rank's records, but the plan has {} ranks",
                kf.tp_size
            ),
        )
    });
    // The fused attention merges in a CTA whose shared memory holds at most 16 rows' split
    // lse, counted per (request, kv head) in the runtime's words: where the bucket says so.
    e.check(
        k.entry != specplan_kernels::Entry::AttnFused
            || specplan_kernels::entries::attention::AttnFusedParams::serves(bf, &kf),
        || {
            at(
                None,
                format!(
                    ".kernel: {name} needs attn_last_cta and at most {} packed rows a CTA (the bucket: attn_last_cta {}, {} splits; the instance: {} rows)",
                    specplan_kernels::facts::ATTN_LAST_CTA_ROWS,
                    bf.attn_last_cta,
                    bf.splits,
                    kf.n * kf.group()
                ),
            )
        },
    );
    e.check(grid == shape.grid, || {
        at(
            None,
            format!(".grid: {grid:?}, but {name} in this bucket launches {:?}", shape.grid),
        )
    });
    e.check(block == shape.block, || {
        at(
            None,
            format!(".block: {block:?}, but {name} runs with {:?}", shape.block),
        )
    });
    e.check(smem as u64 == shape.smem, || {
        at(
            None,
            format!(".smem: {smem} bytes, but {name} needs exactly {}", shape.smem),
        )
    });
    e.check(cluster == shape.cluster, || {
        at(
            None,
            format!(
                ".cluster: {cluster}, but {name} in this bucket runs clusters of {}",
                shape.cluster
            ),
        )
    });
    let fields = k.entry.abi().fields;
    e.check(args.len() == fields.len(), || {
        at(
            None,
            format!(
                ".args: {} values, {name}'s parameter struct has {} fields",
                args.len(),
                fields.len()
            ),
        )
    });
    for (ai, ((a, field), want)) in args.iter().zip(fields).zip(&shape.args).enumerate() {
        let fat = |msg: String| at(Some(ai as u32), format!(".args[{ai}] ({}): {msg}", field.name));
        match (field.kind, want, a) {
            (FieldKind::U32, Slot::U32(w), ArgValue::U32(x)) => {
                e.check(x == w, || fat(format!("{x}, but {name} in this bucket takes {w}")));
            }
            (FieldKind::Ptr(pf), Slot::Ptr(extent), v) => {
                let check = ptr_arg(p, b, &kf, k, pf, *extent, v, touched, buf_touched);
                if let Err(msg) = check {
                    e.check(false, || fat(msg));
                } else if let ArgValue::Buffer(id) = v {
                    bufs.push((*id, ai));
                }
            }
            _ => e.check(false, || {
                fat("value kind does not match the field (pointer or u32)".into())
            }),
        }
    }
    // Both pools of a launch belong to one layer, and an attention instance serves only
    // layers with its window.
    let layers: Vec<u32> = args
        .iter()
        .filter_map(|a| match a {
            ArgValue::KvCache { layer, .. } => Some(*layer),
            _ => None,
        })
        .collect();
    e.check(layers.windows(2).all(|w| w[0] == w[1]), || {
        at(None, ".args: the K and V pools belong to different layers".into())
    });
    if let Some(&l) = layers.first() {
        let window = p.layers.get(l as usize).and_then(|x| x.window).unwrap_or(0);
        e.check(
            kf.window == window || k.entry.template() != specplan_kernels::Template::Attention,
            || {
                at(
                    None,
                    format!(
                        ".kernel: WINDOW {} serves layer {l}, whose window is {window}",
                        kf.window
                    ),
                )
            },
        );
    }
    bufs
}

/// One pointer argument: allowed kind, input name, null exactly where nothing is touched,
/// dtype and size.
#[allow(clippy::too_many_arguments)]
fn ptr_arg(
    p: &Plan,
    b: &BucketPlan,
    f: &KernelFacts,
    k: &KernelDesc,
    pf: specplan_kernels::abi::PtrField,
    extent: Extent,
    v: &ArgValue,
    touched: &mut Touched,
    buf_touched: &mut [u64],
) -> Result<(), String> {
    let elems = match (extent, v) {
        (Extent::Unused, ArgValue::Null) => return Ok(()),
        (Extent::Unused, _) => {
            return Err(format!(
                "{} touches nothing here: the argument must be null",
                k.entry.name()
            ))
        }
        (Extent::Elems(_), ArgValue::Null) => {
            return Err(format!(
                "{} reads or writes it here: null is not allowed",
                k.entry.name()
            ))
        }
        (Extent::Elems(n), _) => n,
    };
    let want_dtype = pf.elem.dtype(f);
    let a = pf.allowed;
    let (have_bytes, have_dtype) = match v {
        ArgValue::Buffer(id) if a.buffer => {
            let buf = b
                .buffers
                .get(*id as usize)
                .ok_or_else(|| format!("buffer id {id} out of range ({} buffers)", b.buffers.len()))?;
            if let Some(input) = pf.input {
                if buf.name != input || buf.role != BufferRole::Input {
                    return Err(format!("must be the input {input}, is %{}", buf.name));
                }
            }
            (buf.bytes, buf.dtype)
        }
        ArgValue::Weight(id) if a.weight => {
            let w = p
                .weights
                .get(*id as usize)
                .ok_or_else(|| format!("weight id {id} out of range ({} weights)", p.weights.len()))?;
            (w.bytes, w.dtype)
        }
        ArgValue::PageTable if a.table => return Ok(()),
        ArgValue::KvLayout if a.layout => return Ok(()),
        // The runtime's counter words: one a group, at most COUNTER_WORDS of them.
        ArgValue::Counters if a.counters => {
            let words = specplan_kernels::kv::COUNTER_WORDS as u64;
            return if elems <= words {
                Ok(())
            } else {
                Err(format!(
                    "{} counts {elems} groups, the runtime has {words} counter words",
                    k.entry.name()
                ))
            };
        }
        ArgValue::KvCache { layer, kind } if (a.k_cache && *kind == KvKind::K) || (a.v_cache && *kind == KvKind::V) => {
            return if *layer < p.model.layers {
                Ok(())
            } else {
                Err(format!("layer {layer} out of range ({} layers)", p.model.layers))
            };
        }
        other => return Err(format!("{other:?} is not what this field may name ({a:?})")),
    };
    if have_dtype != want_dtype {
        return Err(format!(
            "{} where {} reads {}",
            have_dtype.name(),
            k.entry.name(),
            want_dtype.name()
        ));
    }
    let want_bytes = elems.saturating_mul(want_dtype.size());
    if have_bytes < want_bytes {
        return Err(format!("{have_bytes} bytes, {} touches {want_bytes}", k.entry.name()));
    }
    match v {
        ArgValue::Buffer(id) => {
            if let Some(t) = buf_touched.get_mut(*id as usize) {
                *t = (*t).max(want_bytes);
            }
        }
        ArgValue::Weight(id) => {
            let t = touched.weights.entry(*id).or_default();
            *t = (*t).max(want_bytes);
        }
        _ => {}
    }
    Ok(())
}

/// Rule 4/5 tails: every weight and kernel is used, no weight larger than its uses touch.
pub(crate) fn usage(p: &Plan, touched: &Touched, e: &mut Errors) {
    for (i, used) in touched.kernels.iter().enumerate() {
        let runtime = p.kernels[i].entry.runtime_launched();
        e.check(*used || runtime, || {
            (
                Location::Kernel(i as u32),
                format!("kernels[{i}] ({}): no launch uses it", p.kernels[i].name),
            )
        });
    }
    for (i, w) in p.weights.iter().enumerate() {
        let at = || Location::Weight(i as u32);
        match touched.weights.get(&(i as u32)) {
            None => e.check(false, || {
                (at(), format!("weights[{i}] ({}): no launch uses it", w.name))
            }),
            Some(&t) => e.check(w.bytes <= t, || {
                (
                    at(),
                    format!(
                        "weights[{i}] ({}): {} bytes, but its uses touch only {t}",
                        w.name, w.bytes
                    ),
                )
            }),
        }
    }
}
