//! Plan validation: every index, offset and size is checked before anything uses it.
//!
//! Rules (each violation is reported with the path of the field that broke it):
//! 1. Model: dimensions positive, `heads % kv_heads == 0`, even `head_dim`,
//!    `rope_inv_freq` has `head_dim / 2` finite entries, one `LayerDesc` per layer.
//! 2. Spec: SGLang's topk / num_steps / num_draft_tokens rules.
//! 3. Capture: power-of-two page size, page-table width = ceil(context / page), scratch
//!    page inside the pool, hot vocabulary in `[topk, vocab]`.
//! 4. Weights: `bytes = prod(shape) · dtype`, inside the weight region, 256-byte aligned,
//!    no two overlapping.
//! 5. Kernels: unique names; binaries, when present, for the plan's target arch.
//! 6. Buckets: strictly ascending batches; `rows = batch · N`; `qo_indptr[i] = i · N`;
//!    every buffer inside the arena and sized by its shape; the named inputs and outputs
//!    present; every launch refers to existing kernels, buffers, weights and layers, with
//!    legal grid/block/shared-memory sizes and GEMM operands large enough for m, n, k;
//!    buffers that share arena bytes are never live at the same time.
//! 7. Def before use: inputs are written by host prep; every other buffer is written by a
//!    launch before any launch reads it.
//! 8. Kernels (`kernel_rules.rs`): every specialization constant equals the plan fact it
//!    encodes; every `u32` argument (rows, batch, splits) equals the bucket's; every buffer
//!    or weight argument has the dtype the entry reads and at least the bytes it touches;
//!    launch arguments match the parameter struct's names, order and kinds; CUBINs are
//!    ELF images whose header tables lie inside them.

use std::collections::HashSet;

use super::kernel_rules;
use super::types::*;
use super::PlanError;

/// Hopper's opt-in shared memory per block.
pub const MAX_SMEM_BYTES: u32 = 227 * 1024;
const ALIGN: u64 = 256;

/// A plan that passed [`validate`]. The only way to build one, so every consumer can
/// rely on the rules above.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedPlan(Plan);

impl ValidatedPlan {
    pub fn plan(&self) -> &Plan {
        &self.0
    }
    pub fn into_inner(self) -> Plan {
        self.0
    }
}

impl std::ops::Deref for ValidatedPlan {
    type Target = Plan;
    fn deref(&self) -> &Plan {
        &self.0
    }
}

struct Errors(Vec<String>);

impl Errors {
    fn check(&mut self, ok: bool, path: impl FnOnce() -> String) {
        if !ok && self.0.len() < 64 {
            self.0.push(path());
        }
    }
}

pub fn validate(plan: Plan) -> Result<ValidatedPlan, PlanError> {
    let mut e = Errors(Vec::new());
    model(&plan, &mut e);
    spec(&plan.spec, &mut e);
    capture(&plan, &mut e);
    weights(&plan, &mut e);
    kernels(&plan, &mut e);
    let mut prev = 0u32;
    for (bi, b) in plan.buckets.iter().enumerate() {
        e.check(b.batch > prev, || {
            format!(
                "buckets[{bi}].batch: {} must be greater than the previous bucket {prev}",
                b.batch
            )
        });
        prev = b.batch;
        bucket(&plan, bi, b, &mut e);
    }
    e.check(!plan.buckets.is_empty(), || {
        "buckets: a plan needs at least one bucket".into()
    });
    if e.0.is_empty() {
        Ok(ValidatedPlan(plan))
    } else {
        Err(PlanError::Invalid(e.0))
    }
}

fn model(p: &Plan, e: &mut Errors) {
    let m = &p.model;
    for (name, v) in [
        ("hidden", m.hidden),
        ("intermediate", m.intermediate),
        ("heads", m.heads),
        ("kv_heads", m.kv_heads),
        ("head_dim", m.head_dim),
        ("layers", m.layers),
        ("vocab", m.vocab),
    ] {
        e.check(v > 0, || format!("model.{name}: must be positive, got 0"));
    }
    e.check(m.kv_heads == 0 || m.heads.is_multiple_of(m.kv_heads), || {
        format!("model.heads: {} is not a multiple of kv_heads {}", m.heads, m.kv_heads)
    });
    e.check(m.head_dim.is_multiple_of(2), || {
        format!("model.head_dim: {} must be even for RoPE", m.head_dim)
    });
    e.check(m.rms_norm_eps.is_finite() && m.rms_norm_eps > 0.0, || {
        format!("model.rms_norm_eps: {} must be finite and positive", m.rms_norm_eps)
    });
    e.check(p.rope_inv_freq.len() as u64 == m.head_dim as u64 / 2, || {
        format!(
            "rope_inv_freq: {} entries, expected head_dim/2 = {}",
            p.rope_inv_freq.len(),
            m.head_dim / 2
        )
    });
    e.check(p.rope_inv_freq.iter().all(|f| f.is_finite()), || {
        "rope_inv_freq: non-finite entry".into()
    });
    e.check(p.layers.len() as u64 == m.layers as u64, || {
        format!(
            "layers: {} entries, expected model.layers = {}",
            p.layers.len(),
            m.layers
        )
    });
    for (i, l) in p.layers.iter().enumerate() {
        e.check(l.window != Some(0), || format!("layers[{i}].window: must be positive"));
    }
}

/// SGLang's rules for the speculative parameters; shared with the compiler's config check.
pub fn spec_rule_violation(s: &SpecDesc) -> Option<String> {
    let (k, st, n) = (s.topk as u64, s.num_steps as u64, s.num_draft_tokens as u64);
    if k == 0 {
        return Some("topk must be at least 1".into());
    }
    if st == 0 {
        return Some("num_steps must be at least 1".into());
    }
    if k == 1 {
        if n != st + 1 {
            return Some(format!(
                "with topk = 1, num_draft_tokens must equal num_steps + 1 = {} (got {n})",
                st + 1
            ));
        }
    } else {
        let max = (st - 1).saturating_mul(k).saturating_mul(k).saturating_add(1 + k);
        if n < 2 || n > max {
            return Some(format!(
                "with topk = {k} and num_steps = {st}, num_draft_tokens must be in [2, 1 + topk + (num_steps - 1)·topk² = {max}] (got {n})"
            ));
        }
    }
    None
}

fn spec(s: &SpecDesc, e: &mut Errors) {
    if let Some(msg) = spec_rule_violation(s) {
        e.check(false, || format!("spec: {msg}"));
    }
}

fn capture(p: &Plan, e: &mut Errors) {
    let c = &p.capture;
    e.check(c.page_size.is_power_of_two(), || {
        format!("capture.page_size: {} is not a power of two", c.page_size)
    });
    e.check(c.max_context_len > 0, || {
        "capture.max_context_len: must be positive".into()
    });
    let pages = (c.max_context_len as u64).div_ceil(c.page_size.max(1) as u64);
    e.check(c.max_pages_per_request as u64 == pages, || {
        format!(
            "capture.max_pages_per_request: {}, expected ceil(max_context_len / page_size) = {pages}",
            c.max_pages_per_request
        )
    });
    e.check(c.max_requests >= p.buckets.last().map_or(0, |b| b.batch), || {
        format!("capture.max_requests: {} is below the largest bucket", c.max_requests)
    });
    e.check(c.scratch_page < c.kv_pool_pages, || {
        format!(
            "capture.scratch_page: {} outside the pool of {} pages",
            c.scratch_page, c.kv_pool_pages
        )
    });
    e.check(matches!(c.dtype, DType::Bf16 | DType::F16), || {
        format!(
            "capture.dtype: {} is not an activation type (bf16 or f16)",
            c.dtype.name()
        )
    });
    if let Some(v) = c.hot_vocab_size {
        e.check(v >= p.spec.topk && v <= p.model.vocab, || {
            format!(
                "capture.hot_vocab_size: {v} must be in [topk = {}, vocab = {}]",
                p.spec.topk, p.model.vocab
            )
        });
    }
}

fn weights(p: &Plan, e: &mut Errors) {
    let mut spans: Vec<(u64, u64, usize)> = Vec::new();
    for (i, w) in p.weights.iter().enumerate() {
        e.check(!w.shape.is_empty() && w.shape.len() <= 2, || {
            format!(
                "weights[{i}] ({}): rank {} (weights are vectors or matrices)",
                w.name,
                w.shape.len()
            )
        });
        let elems = w.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let want = elems.and_then(|n| n.checked_mul(w.dtype.size()));
        e.check(want == Some(w.bytes) && w.bytes > 0, || {
            format!(
                "weights[{i}] ({}): bytes {} do not match shape {:?} of {}",
                w.name,
                w.bytes,
                w.shape,
                w.dtype.name()
            )
        });
        e.check(w.offset % ALIGN == 0, || {
            format!(
                "weights[{i}] ({}): offset {} not {ALIGN}-byte aligned",
                w.name, w.offset
            )
        });
        e.check(
            w.offset.checked_add(w.bytes).is_some_and(|end| end <= p.weight_bytes),
            || {
                format!(
                    "weights[{i}] ({}): [{}, +{}) outside the weight region of {} bytes",
                    w.name, w.offset, w.bytes, p.weight_bytes
                )
            },
        );
        let arity_ok = match w.packing {
            Packing::Single => w.sources.len() == 1,
            Packing::ConcatRows => !w.sources.is_empty(),
            Packing::GatherRows => w.sources.len() == 2,
        };
        e.check(arity_ok, || {
            format!(
                "weights[{i}] ({}): {} sources do not fit packing {:?}",
                w.name,
                w.sources.len(),
                w.packing
            )
        });
        spans.push((w.offset, w.offset.saturating_add(w.bytes), i));
    }
    spans.sort();
    for pair in spans.windows(2) {
        e.check(pair[0].1 <= pair[1].0, || {
            format!(
                "weights[{}] and weights[{}] overlap in the weight region",
                pair[0].2, pair[1].2
            )
        });
    }
}

fn kernels(p: &Plan, e: &mut Errors) {
    let mut names = HashSet::new();
    for (i, k) in p.kernels.iter().enumerate() {
        e.check(names.insert(k.name.as_str()), || {
            format!("kernels[{i}]: duplicate name {}", k.name)
        });
        let mut end = 0u32;
        for f in &k.params {
            let size = if f.kind == ParamKind::Ptr { 8 } else { 4 };
            e.check(
                f.offset >= end
                    && f.offset % size == 0
                    && f.offset.checked_add(size).is_some_and(|x| x <= k.params_size),
                || {
                    format!(
                        "kernels[{i}] ({}): parameter {} at offset {} breaks the C layout",
                        k.name, f.name, f.offset
                    )
                },
            );
            end = f.offset.saturating_add(size);
        }
        e.check(k.params_size <= 4096, || {
            format!(
                "kernels[{i}] ({}): parameter struct of {} bytes exceeds 4 KiB",
                k.name, k.params_size
            )
        });
        if let Some(b) = &k.binary {
            let want = format!("sm_{}", p.target.sm);
            e.check(b.arch == want, || {
                format!("kernels[{i}] ({}): binary for {}, plan targets {want}", k.name, b.arch)
            });
            // The driver reads the image's header tables without a length.
            e.check(kernel_rules::cubin_ok(&b.cubin), || {
                format!("kernels[{i}] ({}): the CUBIN is not a well-formed ELF image", k.name)
            });
        }
        e.check(
            k.source_hash.len() == 64 && k.source_hash.bytes().all(|c| c.is_ascii_hexdigit()),
            || format!("kernels[{i}] ({}): source_hash is not 64 hex digits", k.name),
        );
        for msg in kernel_rules::kernel_constants(p, k) {
            e.check(false, || msg);
        }
    }
}

fn bucket(p: &Plan, bi: usize, b: &BucketPlan, e: &mut Errors) {
    let n = p.spec.num_draft_tokens;
    let at = |what: &str| format!("buckets[{bi}] (batch {}).{what}", b.batch);
    e.check(b.batch > 0, || at("batch: must be positive"));
    e.check(b.rows as u64 == b.batch as u64 * n as u64, || {
        at(&format!(
            "rows: {} != batch · num_draft_tokens = {}",
            b.rows,
            b.batch as u64 * n as u64
        ))
    });
    e.check(b.qo_indptr.len() as u64 == b.batch as u64 + 1, || {
        at(&format!("qo_indptr: {} entries, expected batch + 1", b.qo_indptr.len()))
    });
    for (i, &v) in b.qo_indptr.iter().enumerate() {
        e.check(v as u64 == i as u64 * n as u64, || {
            at(&format!(
                "qo_indptr[{i}]: {v}, expected {i} · N = {}",
                i as u64 * n as u64
            ))
        });
    }
    e.check(b.attn_splits >= 1, || at("attn_splits: must be at least 1"));
    for (i, buf) in b.buffers.iter().enumerate() {
        let elems = buf.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        e.check(
            elems.and_then(|x| x.checked_mul(buf.dtype.size())) == Some(buf.bytes),
            || {
                at(&format!(
                    "buffers[{i}] ({}): {} bytes do not match shape {:?} of {}",
                    buf.name,
                    buf.bytes,
                    buf.shape,
                    buf.dtype.name()
                ))
            },
        );
        e.check(buf.offset % ALIGN == 0, || {
            at(&format!(
                "buffers[{i}] ({}): offset {} not aligned",
                buf.name, buf.offset
            ))
        });
        e.check(
            buf.offset.checked_add(buf.bytes).is_some_and(|x| x <= b.arena_bytes),
            || {
                at(&format!(
                    "buffers[{i}] ({}): [{}, +{}) outside the arena of {} bytes",
                    buf.name, buf.offset, buf.bytes, b.arena_bytes
                ))
            },
        );
    }
    for name in io::INPUTS {
        e.check(b.buffer(name).is_some_and(|(_, x)| x.role == BufferRole::Input), || {
            at(&format!("buffers: input {name} missing"))
        });
    }
    for name in io::OUTPUTS {
        e.check(
            b.buffer(name).is_some_and(|(_, x)| x.role == BufferRole::Output),
            || at(&format!("buffers: output {name} missing")),
        );
    }
    io_shapes(p, b, &at, e);
    let nbuf = b.buffers.len() as u32;
    // Per buffer: first and last launch that touches it, and whether a read precedes any write.
    let mut first = vec![usize::MAX; b.buffers.len()];
    let mut last = vec![0usize; b.buffers.len()];
    let mut written = vec![false; b.buffers.len()];
    let mut use_buf = |id: u32, access: Access, li: usize, path: &dyn Fn() -> String, e: &mut Errors| {
        e.check(id < nbuf, || {
            format!("{}: buffer id {id} out of range ({nbuf} buffers)", path())
        });
        let Some(buf) = b.buffers.get(id as usize) else { return };
        let i = id as usize;
        if access.reads() && buf.role != BufferRole::Input {
            e.check(written[i], || {
                format!("{}: reads {} before any launch writes it", path(), buf.name)
            });
        }
        if access.writes() {
            written[i] = true;
        }
        first[i] = first[i].min(li);
        last[i] = last[i].max(li);
    };
    for (li, l) in b.launches.iter().enumerate() {
        let lat = |f: &str| at(&format!("launches[{li}] ({}){f}", l.op));
        match &l.kind {
            LaunchKind::Kernel {
                kernel,
                grid,
                block,
                smem,
                args,
            } => {
                e.check((*kernel as usize) < p.kernels.len(), || {
                    lat(&format!(".kernel: {kernel} out of range ({} kernels)", p.kernels.len()))
                });
                e.check(
                    grid.iter().all(|&g| g >= 1) && grid[1] <= 65535 && grid[2] <= 65535 && grid[0] < (1 << 31),
                    || lat(&format!(".grid: {grid:?} outside the CUDA limits")),
                );
                let threads = block.iter().map(|&x| x as u64).product::<u64>();
                e.check(
                    block.iter().all(|&x| x >= 1) && threads <= 1024 && block[2] <= 64,
                    || lat(&format!(".block: {block:?} outside the CUDA limits (1..=1024 threads)")),
                );
                e.check(*smem <= MAX_SMEM_BYTES, || {
                    lat(&format!(".smem: {smem} bytes exceeds {MAX_SMEM_BYTES}"))
                });
                if let Some(k) = p.kernels.get(*kernel as usize) {
                    let names: Vec<&str> = args.iter().map(|a| a.name.as_str()).collect();
                    let want: Vec<&str> = k.params.iter().map(|f| f.name.as_str()).collect();
                    e.check(names == want, || {
                        lat(&format!(
                            ".args: {names:?} do not match {}'s parameter struct {want:?}",
                            k.name
                        ))
                    });
                    for (a, f) in args.iter().zip(&k.params) {
                        let is_u32 = matches!(a.value, ArgValue::U32(_));
                        e.check(is_u32 == (f.kind == ParamKind::U32), || {
                            lat(&format!(
                                ".args ({}): value kind does not match the field's {:?}",
                                a.name, f.kind
                            ))
                        });
                    }
                }
                if let Some(k) = p.kernels.get(*kernel as usize) {
                    for msg in kernel_rules::launch_args(p, b, k, args) {
                        e.check(false, || lat(&format!(".{msg}")));
                    }
                    for msg in kernel_rules::launch_shape(p, k, *block, *smem) {
                        e.check(false, || lat(&format!(".{msg}")));
                    }
                }
                for (ai, a) in args.iter().enumerate() {
                    let apath = || lat(&format!(".args[{ai}] ({})", a.name));
                    match &a.value {
                        ArgValue::Buffer { id, access } => use_buf(*id, *access, li, &apath, e),
                        ArgValue::Weight { id } => e.check((*id as usize) < p.weights.len(), || {
                            format!("{}: weight id {id} out of range", apath())
                        }),
                        ArgValue::KvCache { layer, .. } => e.check(*layer < p.model.layers, || {
                            format!("{}: layer {layer} out of range", apath())
                        }),
                        ArgValue::U32(_) | ArgValue::Null | ArgValue::PageTable => {}
                    }
                }
            }
            LaunchKind::Gemm(g) => {
                let gpath = || lat("");
                use_buf(g.a, Access::Read, li, &gpath, e);
                use_buf(
                    g.c,
                    if g.accumulate { Access::ReadWrite } else { Access::Write },
                    li,
                    &gpath,
                    e,
                );
                gemm_shapes(p, b, g, &lat, e);
            }
        }
    }
    // Buffers sharing arena bytes must have disjoint live ranges.
    for i in 0..b.buffers.len() {
        for j in i + 1..b.buffers.len() {
            let (x, y) = (&b.buffers[i], &b.buffers[j]);
            let overlap = x.offset < y.offset.saturating_add(y.bytes) && y.offset < x.offset.saturating_add(x.bytes);
            if !overlap {
                continue;
            }
            let span = |k: usize| {
                let buf = &b.buffers[k];
                let lo = if buf.role == BufferRole::Input { 0 } else { first[k] };
                let hi = if buf.role == BufferRole::Scratch {
                    last[k]
                } else {
                    usize::MAX
                };
                (lo, hi)
            };
            let ((a0, a1), (b0, b1)) = (span(i), span(j));
            let unused = first[i] == usize::MAX || first[j] == usize::MAX;
            e.check(unused || a1 < b0 || b1 < a0, || {
                at(&format!(
                    "buffers {} and {} share arena bytes while both are live",
                    x.name, y.name
                ))
            });
        }
    }
}

fn io_shapes(p: &Plan, b: &BucketPlan, at: &dyn Fn(&str) -> String, e: &mut Errors) {
    let (bb, rows) = (b.batch as u64, b.rows as u64);
    let h = p.model.hidden as u64;
    let k = p.spec.topk as u64;
    let act = p.capture.dtype;
    let want: [(&str, DType, Vec<u64>); 8] = [
        (io::INPUT_IDS, DType::I64, vec![rows]),
        (io::HIDDEN_STATES, act, vec![rows, h]),
        (io::PREFIX_LENS, DType::I32, vec![bb]),
        (io::ACCEPT_LENS, DType::I32, vec![bb]),
        (io::REQ_SLOTS, DType::I32, vec![bb]),
        (io::HIDDEN_OUT, act, vec![bb, h]),
        (io::TOPK_PROBS, DType::F32, vec![bb, k]),
        (io::TOPK_IDS, DType::I64, vec![bb, k]),
    ];
    for (name, dtype, shape) in want {
        if let Some((_, buf)) = b.buffer(name) {
            e.check(buf.dtype == dtype && buf.shape == shape, || {
                at(&format!(
                    "buffers ({name}): {} {:?}, expected {} {shape:?}",
                    buf.dtype.name(),
                    buf.shape,
                    dtype.name()
                ))
            });
        }
    }
}

fn gemm_shapes(p: &Plan, b: &BucketPlan, g: &GemmDesc, lat: &dyn Fn(&str) -> String, e: &mut Errors) {
    let two_d = |shape: &[u64]| -> Option<(u64, u64)> {
        match shape {
            [r, c] => Some((*r, *c)),
            _ => None,
        }
    };
    let a = b.buffers.get(g.a as usize).and_then(|x| two_d(&x.shape));
    let c = b.buffers.get(g.c as usize).and_then(|x| two_d(&x.shape));
    let w = p.weights.get(g.w as usize).and_then(|x| two_d(&x.shape));
    e.check(a == Some((g.m, g.k)), || {
        lat(&format!(".a: shape {a:?} does not match m×k = {}×{}", g.m, g.k))
    });
    e.check(c == Some((g.m, g.n)), || {
        lat(&format!(".c: shape {c:?} does not match m×n = {}×{}", g.m, g.n))
    });
    e.check(w == Some((g.n, g.k)), || {
        lat(&format!(".w: shape {w:?} does not match n×k = {}×{}", g.n, g.k))
    });
}
