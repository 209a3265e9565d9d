//! Host prep of an owned-memory step: the bucket's inputs written into pinned staging that
//! mirrors the arena's first bytes, then copied with as few asynchronous copies as the
//! layout allows. Two staging blocks alternate; the one about to be overwritten was last
//! read by the copies of the step before the previous one, which an event query finds done
//! (so host prep never waits on the GPU's compute).

use cudarc::driver::{result, sys};
use specplan_format::PhaseKind;
use specplan_format::{io, BucketPlan, BufferRole, Plan};

use super::device::{cuda, Event, GpuError, Pinned};
use crate::bits::as_bytes;

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
    // Merge sorted ranges across gaps that no non-input buffer touches.
    let free = |lo: usize, hi: usize| {
        b.buffers
            .iter()
            .all(|x| x.role == BufferRole::Input || x.offset as usize >= hi || (x.offset + x.bytes) as usize <= lo)
    };
    let merge = |mut v: Vec<(usize, usize)>| -> Vec<(usize, usize)> {
        v.sort_unstable();
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (off, len) in v {
            match out.last_mut() {
                Some((o, l)) if *o + *l <= off && free(*o + *l, off) => *l = off + len - *o,
                _ => out.push((off, len)),
            }
        }
        out
    };
    l.ints = merge(ranges.clone());
    ranges.push((l.hidden, l.hidden_bytes));
    l.all = merge(ranges);
    l
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
        let b = rows.slots.len();
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
        let scratch_slot = plan.capture.max_requests as i32;
        let s = self.blocks[k].as_mut();
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
