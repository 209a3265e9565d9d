//! Bucket rules of validation (rules 6–8 of `validate.rs`): buffers, the named inputs and
//! outputs, every launch, and the data flow through the arena.

use std::collections::HashSet;

use specplan_kernels::abi::{Access, FieldKind};
use specplan_kernels::facts::{KernelFacts, MAX_ATTN_SPLITS};

use super::common::{printable, Errors};
use super::gemm::gemm;
use super::rules::{kernel_launch, Touched};
use crate::limits::{ADMIT_MAX_ROWS, ALIGN, MAX_BATCH, MAX_REGION_BYTES};
use crate::location::Location;
use crate::signature::{self, IoTensor};
use crate::types::*;

/// Where a bucket is: its phase, its index in the phase, and the phase's rows per request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct At {
    pub phase: PhaseKind,
    pub index: usize,
    pub rows_per_request: u32,
}

impl At {
    /// `draft_extend.buckets[2] (batch 4)`: how messages name the bucket.
    pub fn tag(self, batch: u32) -> String {
        format!("{}.buckets[{}] (batch {batch})", self.phase.label(), self.index)
    }
}

/// One use of a buffer by a launch.
struct Use {
    buf: u32,
    access: Access,
    launch: usize,
}

/// One use of a layer's K or V pool by a launch (argument `arg`).
struct KvUse {
    layer: u32,
    kind: KvKind,
    access: Access,
    launch: usize,
    arg: usize,
}

pub(crate) fn bucket(p: &Plan, f: &KernelFacts, bi: At, b: &BucketPlan, touched: &mut Touched, e: &mut Errors) {
    let n = bi.rows_per_request;
    let loc = || Location::bucket(bi.phase, bi.index, b.batch);
    let tag = bi.tag(b.batch);
    let at = |what: String| (loc(), format!("{tag}.{what}"));
    e.check(b.batch > 0 && b.batch <= MAX_BATCH, || {
        at(format!("batch: {} is outside [1, {MAX_BATCH}]", b.batch))
    });
    let max_rows = ADMIT_MAX_ROWS;
    e.check(b.rows <= max_rows, || {
        at(format!(
            "rows: {} exceed {max_rows}, the rows one replay's device admission checks",
            b.rows
        ))
    });
    e.check(b.rows as u64 == b.batch as u64 * n as u64, || {
        at(format!(
            "rows: {} != batch · rows_per_request = {}",
            b.rows,
            b.batch as u64 * n as u64
        ))
    });
    e.check(b.qo_indptr.len() as u64 == b.batch as u64 + 1, || {
        at(format!("qo_indptr: {} entries, expected batch + 1", b.qo_indptr.len()))
    });
    for (i, &v) in b.qo_indptr.iter().enumerate() {
        e.check(v as u64 == i as u64 * n as u64, || {
            at(format!(
                "qo_indptr[{i}]: {v}, expected {i} · rows_per_request = {}",
                i as u64 * n as u64
            ))
        });
    }
    e.check((1..=MAX_ATTN_SPLITS).contains(&b.attn_splits), || {
        at(format!(
            "attn_splits: {} is outside [1, {MAX_ATTN_SPLITS}]",
            b.attn_splits
        ))
    });
    // Clusters exist from sm_90; a cluster of one split would be no merge at all.
    e.check(!b.attn_cluster || (b.attn_splits > 1 && p.target.sm >= 90), || {
        at(format!(
            "attn_cluster: set with {} split(s) on sm_{} (needs more than one split and sm_90+)",
            b.attn_splits, p.target.sm
        ))
    });
    // The last-CTA merge counts arrivals per (request, kv head) in the runtime's words.
    let groups = b.batch as u64 * p.model.kv_heads as u64;
    let fits = specplan_kernels::facts::attn_last_cta_fits(b.batch, p.model.kv_heads, b.attn_splits, b.attn_cluster);
    e.check(!b.attn_last_cta || fits, || {
            at(format!(
                "attn_last_cta: set with {} split(s){} and {groups} (request, kv head) groups (needs more than one split, no cluster, at most {} groups)",
                b.attn_splits,
                if b.attn_cluster { " in clusters" } else { "" },
                specplan_kernels::kv::COUNTER_WORDS
            ))
    });
    e.check(b.arena_bytes <= MAX_REGION_BYTES, || {
        at(format!("arena_bytes: {} exceeds {MAX_REGION_BYTES}", b.arena_bytes))
    });
    if !buffers(p, bi, b, e) {
        return;
    }
    let bf = crate::facts::bucket_facts(b);
    let cands = super::rules::candidates(p, bi.phase);
    let mut buf_touched = vec![0u64; b.buffers.len()];
    let mut uses: Vec<Use> = Vec::new();
    let mut kv_uses: Vec<KvUse> = Vec::new();
    for (li, l) in b.launches.iter().enumerate() {
        let lat = |arg: Option<u32>, what: String| {
            (
                Location::Bucket {
                    phase: bi.phase,
                    index: bi.index as u32,
                    batch: b.batch,
                    buffer: None,
                    launch: Some(li as u32),
                    arg,
                },
                format!("{tag}.launches[{li}] ({}){what}", l.op),
            )
        };
        e.check(printable(&l.op, 256), || lat(None, ".op: not a printable name".into()));
        let before = uses.len();
        match &l.kind {
            LaunchKind::Kernel {
                kernel,
                grid,
                block,
                smem,
                cluster,
                args,
            } => {
                let bufs = kernel_launch(
                    p,
                    f,
                    &cands,
                    b,
                    &bf,
                    *kernel,
                    [*grid, *block],
                    *smem,
                    *cluster,
                    args,
                    &lat,
                    touched,
                    &mut buf_touched,
                    e,
                );
                let fields = p.kernels.get(*kernel as usize).map(|k| k.entry.abi().fields);
                for (arg, (a, field)) in args.iter().zip(fields.unwrap_or(&[])).enumerate() {
                    if let (ArgValue::KvCache { layer, kind }, FieldKind::Ptr(pf)) = (a, field.kind) {
                        kv_uses.push(KvUse {
                            layer: *layer,
                            kind: *kind,
                            access: pf.access,
                            launch: li,
                            arg,
                        });
                    }
                }
                for (buf, fi) in bufs {
                    if let Some(FieldKind::Ptr(pf)) = fields.and_then(|fs| fs.get(fi)).map(|x| x.kind) {
                        uses.push(Use {
                            buf,
                            access: pf.access,
                            launch: li,
                        });
                    }
                }
            }
            LaunchKind::Collective(c) => {
                collective(p, b, c, &lat, &mut buf_touched, e);
                let pairs: &[(u32, Access)] = match c.op {
                    CollectiveOp::AllReduceSum => &[(c.send, Access::ReadWrite)],
                    CollectiveOp::AllGather => &[(c.send, Access::Read), (c.recv, Access::Write)],
                };
                let pairs = pairs.iter().copied();
                for (buf, access) in pairs {
                    if (buf as usize) < b.buffers.len() {
                        uses.push(Use {
                            buf,
                            access,
                            launch: li,
                        });
                    }
                }
            }
            LaunchKind::Gemm(g) => {
                gemm(p, b, g, &lat, touched, &mut buf_touched, e);
                let c = if g.accumulate { Access::ReadWrite } else { Access::Write };
                let rounded = g.rounded.map(|r| (r, Access::Write));
                for (buf, access) in [(g.a, Access::Read), (g.c, c)].into_iter().chain(rounded) {
                    if (buf as usize) < b.buffers.len() {
                        uses.push(Use {
                            buf,
                            access,
                            launch: li,
                        });
                    }
                }
            }
        }
        // A launch that writes a buffer names it once (no aliasing between its arguments).
        let mine = &uses[before..];
        for (i, u) in mine.iter().enumerate() {
            let dup = mine[i + 1..]
                .iter()
                .any(|v| v.buf == u.buf && (u.access.writes() || v.access.writes()));
            e.check(!dup, || {
                lat(
                    None,
                    format!(
                        ": buffer %{} is passed twice and written",
                        b.buffers[u.buf as usize].name
                    ),
                )
            });
        }
    }
    data_flow(b, &tag, bi, &uses, &buf_touched, e);
    kv_flow(p, b, &tag, bi, &kv_uses, e);
}

/// Each layer's K and V pools are appended by as many launches of the bucket as the phase
/// appends per layer (`PhaseKind::kv_appends_per_layer`: draft-extend one), and read
/// only after it (a launch reading another layer's pools, or a missing or repeated append,
/// would attend over keys this step did not write).
fn kv_flow(p: &Plan, b: &BucketPlan, tag: &str, bi: At, uses: &[KvUse], e: &mut Errors) {
    let lat = |launch: Option<usize>, arg: Option<usize>, msg: String| {
        (
            Location::Bucket {
                phase: bi.phase,
                index: bi.index as u32,
                batch: b.batch,
                buffer: None,
                launch: launch.map(|l| l as u32),
                arg: arg.map(|a| a as u32),
            },
            format!("{tag}.{msg}"),
        )
    };
    for layer in 0..p.model.layers {
        for kind in [KvKind::K, KvKind::V] {
            let mine: Vec<&KvUse> = uses.iter().filter(|u| u.layer == layer && u.kind == kind).collect();
            let writers: Vec<&&KvUse> = mine.iter().filter(|u| u.access.writes()).collect();
            let appends = bi.phase.kv_appends_per_layer() as usize;
            e.check(writers.len() == appends, || {
                let at = writers.get(1).map(|w| (w.launch, w.arg));
                lat(
                    at.map(|x| x.0),
                    at.map(|x| x.1),
                    format!(
                        "launches: layer {layer}'s {kind:?} pool is appended by {} launches, expected {appends} ({})",
                        writers.len(),
                        bi.phase.label()
                    ),
                )
            });
            let Some(w) = writers.first() else { continue };
            if let Some(r) = mine.iter().find(|u| !u.access.writes() && u.launch < w.launch) {
                e.check(false, || {
                    lat(
                        Some(r.launch),
                        Some(r.arg),
                        format!(
                            "launches[{}].args[{}]: reads layer {layer}'s {kind:?} pool before launch {} appends to it",
                            r.launch, r.arg, w.launch
                        ),
                    )
                });
            }
        }
    }
}

/// Buffer rules; false when the buffers are too broken to look at launches.
fn buffers(p: &Plan, bi: At, b: &BucketPlan, e: &mut Errors) -> bool {
    let before = e.0.len();
    let tag = bi.tag(b.batch);
    let bat = |i: usize, msg: String| {
        (
            Location::Bucket {
                phase: bi.phase,
                index: bi.index as u32,
                batch: b.batch,
                buffer: Some(i as u32),
                launch: None,
                arg: None,
            },
            format!("{tag}.buffers[{i}] ({}): {msg}", b.buffers[i].name),
        )
    };
    let sig = signature::phase_io(p, bi.phase, b.batch);
    let mut names = HashSet::new();
    let mut end = 0u64;
    for (i, buf) in b.buffers.iter().enumerate() {
        e.check(printable(&buf.name, 256) && names.insert(buf.name.as_str()), || {
            bat(i, "the name must be printable and unique in the bucket".into())
        });
        let elems = buf.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        e.check(
            !buf.shape.is_empty()
                && elems.and_then(|x| x.checked_mul(buf.dtype.size())) == Some(buf.bytes)
                && buf.bytes > 0,
            || {
                bat(
                    i,
                    format!(
                        "{} bytes do not match shape {:?} of {}",
                        buf.bytes,
                        buf.shape,
                        buf.dtype.name()
                    ),
                )
            },
        );
        e.check(buf.offset % ALIGN == 0, || {
            bat(i, format!("offset {} not aligned", buf.offset))
        });
        let fits = buf.offset.checked_add(buf.bytes).filter(|&x| x <= b.arena_bytes);
        e.check(fits.is_some(), || {
            bat(
                i,
                format!(
                    "[{}, +{}) outside the arena of {} bytes",
                    buf.offset, buf.bytes, b.arena_bytes
                ),
            )
        });
        end = end.max(fits.unwrap_or(0));
        let named_input = sig.iter().any(|t| t.role == BufferRole::Input && t.name == buf.name);
        let named_output = sig.iter().any(|t| t.role == BufferRole::Output && t.name == buf.name);
        e.check((buf.role == BufferRole::Input) == named_input, || {
            bat(
                i,
                format!(
                    "only the staged inputs of the {} signature have the input role, and they have it",
                    bi.phase.label()
                ),
            )
        });
        e.check((buf.role == BufferRole::Output) == named_output, || {
            bat(
                i,
                format!(
                    "only the outputs of capture.outputs = {} (the signature) have the output role, and they have it",
                    p.capture.outputs.name()
                ),
            )
        });
    }
    // First-fit packing puts a buffer at most at the sum of the (aligned) buffers placed
    // before it, so an arena past that sum holds a hole no buffer needs — memory the runtime
    // would allocate for nothing (one buffer moved to a high offset).
    let unshared = b.buffers.iter().fold(0u64, |a, x| {
        a.saturating_add(x.bytes.div_ceil(ALIGN).saturating_mul(ALIGN))
    });
    e.check(b.arena_bytes <= unshared, || {
        (
            Location::bucket(bi.phase, bi.index, b.batch),
            format!(
                "{tag}.arena_bytes: {}, more than the {unshared} bytes its buffers take even unshared (a hole no buffer needs)",
                b.arena_bytes
            ),
        )
    });
    e.check(b.arena_bytes.div_ceil(ALIGN) <= end.div_ceil(ALIGN), || {
        (
            Location::bucket(bi.phase, bi.index, b.batch),
            format!(
                "{tag}.arena_bytes: {}, but the last buffer ends at {end}",
                b.arena_bytes
            ),
        )
    });
    for t in &sig {
        e.check(b.buffer(t.name).is_some(), || {
            (
                Location::bucket(bi.phase, bi.index, b.batch),
                format!("{tag}.buffers: {} missing", t.name),
            )
        });
    }
    io_shapes(bi, b, &tag, &sig, e);
    e.0.len() == before
}

fn io_shapes(bi: At, b: &BucketPlan, tag: &str, sig: &[IoTensor], e: &mut Errors) {
    for t in sig {
        if let Some((id, buf)) = b.buffer(t.name) {
            e.check(buf.dtype == t.dtype && buf.shape == t.shape, || {
                (
                    Location::Bucket {
                        phase: bi.phase,
                        index: bi.index as u32,
                        batch: b.batch,
                        buffer: Some(id),
                        launch: None,
                        arg: None,
                    },
                    format!(
                        "{tag}.buffers ({}): {} {:?}, expected {} {:?}",
                        t.name,
                        buf.dtype.name(),
                        buf.shape,
                        t.dtype.name(),
                        t.shape
                    ),
                )
            });
        }
    }
}

/// A collective launch: only in a sharded plan; an all-reduce in place over a whole buffer
/// of `count` elements, an all-gather of a whole buffer into one T times its size, of the
/// declared dtype (the activation type or f32).
fn collective(
    p: &Plan,
    b: &BucketPlan,
    c: &CollectiveDesc,
    lat: &dyn Fn(Option<u32>, String) -> (Location, String),
    buf_touched: &mut [u64],
    e: &mut Errors,
) {
    let tp = p.capture.tp;
    e.check(tp.is_sharded(), || {
        lat(None, format!(": a {} in a plan of tp size {}", c.op.name(), tp.size))
    });
    let (send, recv) = (b.buffers.get(c.send as usize), b.buffers.get(c.recv as usize));
    e.check(send.is_some() && recv.is_some(), || {
        lat(
            None,
            format!(": buffer out of range (send = {}, recv = {})", c.send, c.recv),
        )
    });
    let (Some(send), Some(recv)) = (send, recv) else { return };
    e.check(c.dtype == p.capture.dtype || c.dtype == DType::F32, || {
        lat(
            None,
            format!(".dtype: {} is neither the activation type nor f32", c.dtype.name()),
        )
    });
    let elems = |d: &BufferDesc| d.bytes / d.dtype.size().max(1);
    let ranks = match c.op {
        CollectiveOp::AllReduceSum => 1,
        CollectiveOp::AllGather => tp.size as u64,
    };
    e.check((c.op == CollectiveOp::AllReduceSum) == (c.send == c.recv), || {
        lat(
            None,
            ": an all-reduce is in place (send = recv), an all-gather is not".into(),
        )
    });
    e.check(
        send.dtype == c.dtype
            && recv.dtype == c.dtype
            && c.count >= 1
            && elems(send) == c.count
            && Some(elems(recv)) == c.count.checked_mul(ranks),
        || {
            lat(
                None,
                format!(
                    ": count {} of {} does not match %{} ({} {}) and %{} ({} {})",
                    c.count,
                    c.dtype.name(),
                    send.name,
                    elems(send),
                    send.dtype.name(),
                    recv.name,
                    elems(recv),
                    recv.dtype.name()
                ),
            )
        },
    );
    buf_touched[c.send as usize] = buf_touched[c.send as usize].max(send.bytes);
    buf_touched[c.recv as usize] = buf_touched[c.recv as usize].max(recv.bytes);
}

/// Rule 8 over a bucket's uses, in launch order.
fn data_flow(b: &BucketPlan, tag: &str, bi: At, uses: &[Use], touched: &[u64], e: &mut Errors) {
    let nb = b.buffers.len();
    let bat = |i: usize, msg: String| {
        (
            Location::Bucket {
                phase: bi.phase,
                index: bi.index as u32,
                batch: b.batch,
                buffer: Some(i as u32),
                launch: None,
                arg: None,
            },
            format!("{tag}.buffers[{i}] ({}): {msg}", b.buffers[i].name),
        )
    };
    let mut first = vec![usize::MAX; nb];
    let mut last = vec![0usize; nb];
    let mut written = vec![false; nb];
    // The launch whose write no launch has read yet: a value written and never read (or
    // overwritten unread) means a launch whose result is lost.
    let mut unread: Vec<Option<usize>> = vec![None; nb];
    // A launch-local workspace (`Access::WriteRead`): the launch that uses it so.
    let mut local: Vec<Option<usize>> = vec![None; nb];
    for u in uses {
        let i = u.buf as usize;
        let buf = &b.buffers[i];
        if buf.role == BufferRole::Input {
            e.check(!u.access.writes(), || {
                bat(i, format!("launch {} writes an input (inputs are read-only)", u.launch))
            });
        } else if u.access.reads_before() {
            e.check(written[i], || {
                bat(i, format!("launch {} reads it before any launch writes it", u.launch))
            });
            unread[i] = None;
        }
        if u.access.writes() {
            if let (Access::Write | Access::WriteRead, Some(w)) = (u.access, unread[i]) {
                e.check(false, || {
                    bat(
                        i,
                        format!(
                            "launch {} overwrites what launch {w} wrote before any launch reads it",
                            u.launch
                        ),
                    )
                });
            }
            written[i] = true;
            // A launch-local workspace is consumed by the launch that wrote it.
            unread[i] = (u.access != Access::WriteRead).then_some(u.launch);
        }
        if u.access == Access::WriteRead {
            local[i] = Some(u.launch);
        }
        first[i] = first[i].min(u.launch);
        last[i] = last[i].max(u.launch);
    }
    for (i, buf) in b.buffers.iter().enumerate() {
        e.check(first[i] != usize::MAX, || bat(i, "no launch uses it".into()));
        if buf.role == BufferRole::Output {
            e.check(written[i], || bat(i, "an output no launch writes".into()));
        }
        // A workspace one launch writes and reads back is that launch's alone: scratch, and no
        // other launch touches it (its bytes mean nothing outside the launch).
        if let Some(l) = local[i] {
            e.check(buf.role == BufferRole::Scratch && first[i] == l && last[i] == l, || {
                bat(
                    i,
                    format!(
                        "launch {l}'s own workspace must be scratch that no other launch uses ({:?}, launches {}..={})",
                        buf.role, first[i], last[i]
                    ),
                )
            });
        }
        if let (BufferRole::Scratch, Some(w)) = (buf.role, unread[i]) {
            e.check(false, || {
                bat(i, format!("launch {w} writes it, and no later launch reads it"))
            });
        }
        e.check(buf.bytes <= touched[i] || first[i] == usize::MAX, || {
            bat(
                i,
                format!("{} bytes, but its uses touch only {}", buf.bytes, touched[i]),
            )
        });
    }
    // Buffers sharing arena bytes must have disjoint live ranges. Inputs are live from host
    // prep to the end of the step, outputs from their first write to the end (the caller
    // reads them after the replay).
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
    let mut order: Vec<usize> = (0..nb).collect();
    order.sort_by_key(|&i| b.buffers[i].offset);
    for (x, &i) in order.iter().enumerate() {
        let bi_end = b.buffers[i].offset.saturating_add(b.buffers[i].bytes);
        for &j in &order[x + 1..] {
            if b.buffers[j].offset >= bi_end {
                break;
            }
            let ((a0, a1), (b0, b1)) = (span(i), span(j));
            e.check(a1 < b0 || b1 < a0, || {
                bat(
                    i,
                    format!("shares arena bytes with {} while both are live", b.buffers[j].name),
                )
            });
        }
    }
}
