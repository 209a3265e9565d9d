//! Host prep of an owned-memory step: the bucket's inputs written into pinned staging that
//! mirrors the arena's first bytes.
//!
//! A graph step (`GraphStaging`) writes them into one host-mapped block that its graph's
//! first node, `stage_in`, copies in on the device: the host makes no copy call and records
//! no event, and the device copies the caller's device hidden states in the same node. The
//! block is reused once `stage_in` has written the step's sequence number back into it: a
//! step issued while the previous one is still queued waits until that one's first node has
//! run (one block, one graph per bucket; perf-notes item 45).
//!
//! An eager step (and a graph without `stage_in`) copies them with as few asynchronous
//! copies as the layout allows (`Staging`). Two blocks alternate; the one about to be
//! overwritten was last read by the copies of the step before the previous one, which an
//! event query finds done (so host prep never waits on the GPU's compute).

use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use specplan_format::PhaseKind;
use specplan_format::{io, BucketPlan, BufferRole, Plan};

use super::device::{cuda, cuda_rc, Event, GpuError, Mapped, Pinned};
use crate::bits::as_bytes;

/// How long a graph step waits for the previous graph's `stage_in` before it reports an
/// error instead.
const STAGE_WAIT: Duration = Duration::from_secs(30);

/// Where a bucket's inputs sit in the arena, and the copies that move them. The compiler
/// places the inputs contiguously; gaps are merged only where no other buffer lives.
#[derive(Clone, Default)]
pub(crate) struct StageLayout {
    ids: usize,
    prefix: usize,
    accept: usize,
    slots: usize,
    pub hidden: usize,
    hidden_bytes: usize,
    /// Copy ranges (offset, bytes) for the integer inputs alone (hidden from the device).
    ints: Vec<(usize, usize)>,
    /// Copy ranges for every input (hidden from the host).
    all: Vec<(usize, usize)>,
}

impl StageLayout {
    /// The integer inputs as one range `(offset, bytes)`, when they are one (every plan the
    /// compiler emits: they are placed first and contiguously), else `None`.
    pub fn ints_range(&self) -> Option<(usize, usize)> {
        match self.ints[..] {
            [r] => Some(r),
            _ => None,
        }
    }

    /// The hidden states' range `(offset, bytes)` of the bucket.
    pub fn hidden_range(&self) -> (usize, usize) {
        (self.hidden, self.hidden_bytes)
    }
}

pub(crate) fn stage_layout(b: &BucketPlan) -> StageLayout {
    let find = |name: &str| b.buffer(name).map(|(_, x)| (x.offset as usize, x.bytes as usize));
    let (mut l, mut ranges) = (StageLayout::default(), Vec::new());
    for (name, slot) in [
        (io::INPUT_IDS, &mut l.ids),
        (io::PREFIX_LENS, &mut l.prefix),
        (io::ACCEPT_LENS, &mut l.accept),
        (io::REQ_SLOTS, &mut l.slots),
    ] {
        if let Some((off, len)) = find(name) {
            *slot = off;
            ranges.push((off, len));
        }
    }
    if let Some((off, len)) = find(io::HIDDEN_STATES) {
        l.hidden = off;
        l.hidden_bytes = len;
    }
    // Merge sorted ranges across gaps that no non-input buffer touches; the integer ranges
    // also never across the hidden states (a graph step's device copy of them comes first).
    let free = |lo: usize, hi: usize, hidden: bool| {
        b.buffers.iter().all(|x| {
            let clear = x.offset as usize >= hi || (x.offset + x.bytes) as usize <= lo;
            clear || (x.role == BufferRole::Input && (hidden || x.name != io::HIDDEN_STATES))
        })
    };
    let merge = |mut v: Vec<(usize, usize)>, hidden: bool| -> Vec<(usize, usize)> {
        v.sort_unstable();
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (off, len) in v {
            match out.last_mut() {
                Some((o, l)) if *o + *l <= off && free(*o + *l, off, hidden) => *l = off + len - *o,
                _ => out.push((off, len)),
            }
        }
        out
    };
    l.ints = merge(ranges.clone(), false);
    ranges.push((l.hidden, l.hidden_bytes));
    l.all = merge(ranges, true);
    l
}

/// Writes a step's rows into `s`, a block mirroring the arena's first bytes: the integer
/// inputs padded to the bucket's `bb` requests of `n` rows (padded requests on the scratch
/// slot), and the host's hidden states when given.
fn fill(s: &mut [u8], lay: &StageLayout, rows: &StageRows, (bb, n): (usize, usize), scratch_slot: i32) {
    let b = rows.slots.len();
    let put = |s: &mut [u8], at: usize, bytes: &[u8]| s[at..at + bytes.len()].copy_from_slice(bytes);
    put(s, lay.ids, as_bytes(rows.input_ids));
    s[lay.ids + b * n * 8..lay.ids + bb * n * 8].fill(0);
    for i in 0..bb {
        let (l, a, slot) = if i < b {
            (rows.prefix_lens[i], rows.accept_lens[i], rows.slots[i])
        } else {
            (0, n as i32, scratch_slot)
        };
        put(s, lay.prefix + i * 4, &l.to_le_bytes());
        put(s, lay.accept + i * 4, &a.to_le_bytes());
        put(s, lay.slots + i * 4, &slot.to_le_bytes());
    }
    // Padded rows keep whatever the staging held (an earlier step's rows, or
    // uninitialized pinned memory): rows never mix, so those values cannot reach a
    // real request, whatever they are.
    if let Some(v) = rows.hidden {
        put(s, lay.hidden, as_bytes(v));
    }
}

/// One step's rows as host prep writes them (padded rows use the scratch slot).
pub(crate) struct StageRows<'a> {
    pub slots: &'a [i32],
    pub input_ids: &'a [i64],
    pub prefix_lens: &'a [i32],
    pub accept_lens: &'a [i32],
    /// Raw activation bits of `[b, N, H]` from the host, or `None` (copied on the device).
    pub hidden: Option<&'a [u16]>,
}

pub(crate) struct Staging {
    blocks: [Pinned; 2],
    done: [Event; 2],
    layouts: Vec<StageLayout>,
    next: usize,
    /// The graph steps' host-mapped block (`GraphStaging`).
    graph: GraphStaging,
}

impl Staging {
    pub fn new(plan: &Plan) -> Result<Staging, GpuError> {
        let layouts: Vec<StageLayout> = plan.buckets().iter().map(stage_layout).collect();
        let bytes = layouts.iter().map(|l| l.hidden + l.hidden_bytes).max().unwrap_or(0);
        Ok(Staging {
            blocks: [Pinned::new(bytes)?, Pinned::new(bytes)?],
            done: [Event::new(false)?, Event::new(false)?],
            layouts,
            next: 0,
            graph: GraphStaging::new(bytes)?,
        })
    }

    /// Bucket `bi`'s staged integer inputs in the graph steps' block: (device address,
    /// arena offset, bytes), when they are one range.
    pub fn graph_ints(&self, bi: usize) -> Option<(u64, usize, usize)> {
        let (off, bytes) = self.layouts.get(bi)?.ints_range()?;
        Some((self.graph.block.dev + off as u64, off, bytes))
    }

    /// The graph steps' control words' device address.
    pub fn graph_ctl_dev(&self) -> u64 {
        self.graph.block.dev + 8 * self.graph.ctl as u64
    }

    /// A graph step: waits until `stage_in` has consumed the block's last step (at once
    /// unless that step's graph has not started yet), then writes this step's rows and the
    /// next sequence number. The caller launches the graph and then calls `graph_launched`.
    pub fn graph_write(
        &mut self,
        plan: &Plan,
        bi: usize,
        rows: &StageRows,
        stream: sys::CUstream,
    ) -> Result<(), GpuError> {
        let g = &mut self.graph;
        g.wait_consumed(stream)?;
        // The block's writes after the read that found it consumed (a weakly ordered host).
        fence(Ordering::Acquire);
        let lay = &self.layouts[bi];
        let bb = plan.buckets()[bi].batch as usize;
        let n = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
        let end = lay.hidden + lay.hidden_bytes;
        fill(
            g.block.bytes_mut(end),
            lay,
            rows,
            (bb, n),
            plan.capture.max_requests as i32,
        );
        g.written += 1;
        // The rows before the sequence number that names them.
        fence(Ordering::Release);
        g.block.write(g.ctl, g.written);
        Ok(())
    }

    /// The graph carrying the sequence number `graph_write` set was launched.
    pub fn graph_launched(&mut self) {
        self.graph.issued = self.graph.written;
    }

    /// Issues the copy of bucket `bi`'s hidden states from the graph steps' block (a step
    /// whose hidden states came from the host) into the arena at `arena`, before the graph
    /// on `stream`: `stage_in`, after it in stream order, marks the block consumed.
    pub fn graph_copy_hidden(&self, bi: usize, arena: u64, stream: sys::CUstream) -> Result<(), GpuError> {
        let (off, len) = self.layouts[bi].hidden_range();
        // SAFETY: [off, off + len) lies inside the block (sized for every bucket's mirror)
        // and inside the arena's input buffers; the block is not rewritten before
        // `stage_in` (later on the stream) marks it consumed.
        cuda("cuMemcpyHtoDAsync", unsafe {
            let src = std::slice::from_raw_parts(self.graph.block.host_ptr().add(off), len);
            result::memcpy_htod_async(arena + off as u64, src, stream)
        })
    }

    pub fn layout(&self, bi: usize) -> &StageLayout {
        &self.layouts[bi]
    }

    /// Writes bucket `bi`'s inputs (padded to its batch) into the next staging block and
    /// issues their copies into the arena at `arena` on `stream`.
    pub fn stage(
        &mut self,
        plan: &Plan,
        bi: usize,
        rows: &StageRows,
        arena: u64,
        stream: sys::CUstream,
    ) -> Result<(), GpuError> {
        let bucket = &plan.buckets()[bi];
        let (bb, n) = (
            bucket.batch as usize,
            plan.rows_per_request(PhaseKind::DraftExtend) as usize,
        );
        let lay = &self.layouts[bi];
        let k = self.next;
        self.next ^= 1;
        // SAFETY: the event is live.
        if unsafe { result::event::query(self.done[k].0) }.is_err() {
            // SAFETY: as above.
            cuda("cuEventSynchronize", unsafe {
                result::event::synchronize(self.done[k].0)
            })?;
        }
        fill(
            self.blocks[k].as_mut(),
            lay,
            rows,
            (bb, n),
            plan.capture.max_requests as i32,
        );
        let base = self.blocks[k].ptr;
        let ranges = if rows.hidden.is_some() { &lay.all } else { &lay.ints };
        for &(off, len) in ranges {
            // SAFETY: the staging block mirrors the arena's first bytes and [off, off + len)
            // lies inside both (ranges come from this bucket's input buffers, merged only
            // across gaps no other buffer occupies).
            cuda("cuMemcpyHtoDAsync", unsafe {
                let src = std::slice::from_raw_parts(base.add(off), len);
                result::memcpy_htod_async(arena + off as u64, src, stream)
            })?;
        }
        Ok(())
    }

    /// Marks the staging block just used as in flight (after every copy that reads it).
    pub fn fence(&self, stream: sys::CUstream) -> Result<(), GpuError> {
        let k = self.next ^ 1;
        // SAFETY: event and stream are live.
        cuda("cuEventRecord", unsafe {
            result::event::record(self.done[k].0, stream)
        })
    }
}

/// The host-mapped block of the graph steps and its two control words (`stage_in`'s `ctl`):
/// `[0]` the sequence number of the step whose rows it holds, `[1]` the last one `stage_in`
/// consumed. Its rows sit at the arena's offsets, as the eager blocks' do.
struct GraphStaging {
    block: Mapped,
    /// Word index of `ctl[0]`, past every bucket's mirror of the arena.
    ctl: usize,
    /// The last sequence number written into `ctl[0]` (every write takes a new one, so a
    /// number a failed launch left behind is never reused).
    written: u64,
    /// The sequence number of the last launched graph's rows: the block is free once
    /// `ctl[1]` reaches it.
    issued: u64,
}

impl GraphStaging {
    /// A block mirroring `bytes` of the arena, then the control words.
    fn new(bytes: usize) -> Result<GraphStaging, GpuError> {
        let ctl = bytes.div_ceil(16) * 2;
        let block = Mapped::new(ctl + 2)?;
        block.write(ctl, 0);
        block.write(ctl + 1, 0);
        Ok(GraphStaging {
            block,
            ctl,
            written: 0,
            issued: 0,
        })
    }

    fn wait_consumed(&self, stream: sys::CUstream) -> Result<(), GpuError> {
        let (mut polls, t0) = (0u32, Instant::now());
        while self.block.read(self.ctl + 1) < self.issued {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(256) {
                // Never a silent hang: a graph that cannot start (say, a collective waiting
                // for a rank this thread has not stepped yet) is reported.
                if t0.elapsed() > STAGE_WAIT {
                    return Err(GpuError::Step(format!(
                        "the previous step's graph has not consumed its staged inputs after {} s (a graph waiting on work not yet issued?)",
                        STAGE_WAIT.as_secs()
                    )));
                }
                // SAFETY: the runtime's live stream.
                match unsafe { sys::cuStreamQuery(stream) } {
                    sys::cudaError_enum::CUDA_ERROR_NOT_READY => std::thread::yield_now(),
                    // Idle: stage_in ran (its write lands before the stream completes).
                    sys::cudaError_enum::CUDA_SUCCESS => {
                        if self.block.read(self.ctl + 1) < self.issued {
                            return Err(GpuError::Step(
                                "the staging block was not consumed by its graph's stage_in, and the stream is idle"
                                    .into(),
                            ));
                        }
                    }
                    rc => cuda_rc("cuStreamQuery", rc)?,
                }
            }
            std::hint::spin_loop();
        }
        Ok(())
    }
}
