//! io.cu: the engine-memory step's prologue and epilogue. The runtime launches these itself
//! (they are in a plan's kernel table, never in its buckets' launch lists): `admit` copies
//! the caller's device inputs into the bucket's input buffers and checks every request on
//! the device (`kv::DeviceRule`), `emit` copies the real requests' outputs to the caller's
//! tensors. Their caller pointers and `b` change every step (the runtime updates the
//! captured `admit` node's parameters before each replay).

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{BucketFacts, KernelFacts};
use crate::io;
use crate::source::Constants;
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, u};

/// `admit`: CTA i < batch fills request i's rows of the input buffers — the caller's values
/// when i < b and request i passes every rule, else a padded request (row −1: no K/V read
/// or written, prefix 0, accept N, token 0, zero hidden states) — and records a failing
/// request in the status words.
#[derive(KernelParams)]
#[repr(C)]
pub struct AdmitParams {
    /// `[b, N]` i64 token ids.
    #[arg(caller)]
    pub src_ids: DevPtr<i64>,
    /// `[b, N, H_in]` hidden states of the target (H_in: `KernelFacts::hidden_in`).
    #[arg(caller)]
    pub src_hidden: DevPtr<Act>,
    /// `[b]` request rows of the page table (i64, or i32 with flag bit 0).
    #[arg(caller)]
    pub src_req: DevPtr<i64>,
    /// `[b]` prefix lengths (i64, or i32 with flag bit 1), plus `prefix_bias`.
    #[arg(caller)]
    pub src_prefix: DevPtr<i64>,
    /// `[b]` accept lengths (i64, or i32 with flag bit 2).
    #[arg(caller)]
    pub src_accept: DevPtr<i64>,
    /// Where `emit` copies the outputs (null: not copied).
    #[arg(caller)]
    pub out_probs: DevPtr<f32>,
    #[arg(caller)]
    pub out_ids: DevPtr<i64>,
    #[arg(caller)]
    pub out_hidden: DevPtr<Act>,
    #[arg(caller)]
    pub out_logits: DevPtr<f32>,
    #[arg(input = io::INPUT_IDS, rw)]
    pub ids: DevPtrMut<i64>,
    #[arg(input = io::HIDDEN_STATES, rw)]
    pub hidden: DevPtrMut<Act>,
    #[arg(input = io::REQ_SLOTS, rw)]
    pub req_slots: DevPtrMut<i32>,
    #[arg(input = io::PREFIX_LENS, rw)]
    pub prefix_lens: DevPtrMut<i32>,
    #[arg(input = io::ACCEPT_LENS, rw)]
    pub accept_lens: DevPtrMut<i32>,
    #[arg(table)]
    pub page_table: DevPtr<i32>,
    #[arg(layout)]
    pub kv_layout: DevPtr<i64>,
    #[arg(status, rw)]
    pub status: DevPtrMut<i64>,
    /// Real requests of the step (≤ batch).
    pub b: u32,
    pub batch: u32,
    /// Bit 0/1/2: `src_req` / `src_prefix` / `src_accept` hold i32.
    pub flags: u32,
    /// Added to every prefix length, as an i32 (−N when the caller passes `seq_lens`).
    pub prefix_bias: u32,
    /// The step-wide index of request 0 (a chunk of a batch above the largest bucket
    /// starts past 0): refused requests are reported by their index in the whole step.
    pub base: u32,
    /// The step's tag in the status words: a word tagged with another step is stale and is
    /// overwritten, not merged, so no reset is needed between steps.
    pub epoch: u32,
}

/// `emit`: CTA (i, y), i < b, copies request i's output rows to the caller's tensors when it
/// was admitted, or writes them as zeros when it was refused (no stale row of another step
/// reaches the caller), and flags an admitted request with a non-finite output; the logits
/// row is split over `EMIT_Y` CTAs. The last CTA to finish counts the flagged requests into
/// the status words and copies the step's refusal words to the host-mapped mirror.
#[derive(KernelParams)]
#[repr(C)]
pub struct EmitParams {
    /// `[batch]` rows as `admit` wrote them (−1: refused or padding); `emit` marks a
    /// request with non-finite outputs here (`kv::NON_FINITE_MARK`).
    #[arg(input = io::REQ_SLOTS, rw)]
    pub req_slots: DevPtrMut<i32>,
    #[arg(buffer)]
    pub probs: DevPtr<f32>,
    #[arg(buffer)]
    pub ids: DevPtr<i64>,
    #[arg(buffer)]
    pub hidden: DevPtr<Act>,
    #[arg(buffer)]
    pub logits: DevPtr<f32>,
    #[arg(status, rw)]
    pub status: DevPtrMut<i64>,
    pub batch: u32,
}

/// `stage_in`: an owned-memory step's inputs into the bucket's buffers, as the first node of
/// its graph (the host then makes no copy call). CTA 0 copies the integer inputs, which the
/// host wrote into the runtime's host-mapped staging block before the launch, and then
/// writes the step's sequence number (`ctl[0]`, the host's) into `ctl[1]`: the host reuses
/// the block once it reads it there. Every CTA copies its share of the caller's device
/// hidden states (`hidden_vecs` 16-byte vectors; 0 when they came from the host by a copy
/// before the launch). Its pointers and sizes are the runtime's, set per step on the
/// captured node.
#[derive(KernelParams)]
#[repr(C)]
pub struct StageInParams {
    /// The staged integer inputs (host-mapped runtime memory): `ints_words` 4-byte words.
    #[arg(scratch)]
    pub src: DevPtr<i32>,
    /// Where they go: the bucket's integer input buffers, one range of the arena.
    #[arg(buffer, rw)]
    pub dst: DevPtrMut<i32>,
    /// The block's control words (host-mapped): `[0]` the step's sequence number, `[1]` the
    /// last one this kernel consumed.
    #[arg(scratch, rw)]
    pub ctl: DevPtrMut<i64>,
    /// The caller's `[b, N, H_in]` hidden states on the device.
    #[arg(caller)]
    pub src_hidden: DevPtr<Act>,
    #[arg(input = io::HIDDEN_STATES, rw)]
    pub hidden: DevPtrMut<Act>,
    pub ints_words: u32,
    pub hidden_vecs: u32,
}

/// CTAs of a `stage_in` launch for a bucket whose hidden states are `vecs` 16-byte vectors:
/// four vectors a thread, at most 256 CTAs (the kernel loops over the rest).
pub fn stage_in_ctas(vecs: u64) -> u32 {
    vecs.div_ceil(4 * IO_THREADS as u64).clamp(1, 256) as u32
}

impl Kernel for StageInParams {
    const ENTRY: Entry = Entry::StageIn;
    fn threads(_: &KernelFacts) -> u32 {
        IO_THREADS
    }
    /// The runtime sets the pointers and sizes per step; the grid covers the bucket's
    /// hidden states.
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], StageInScalars) {
        let vecs = (b.batch as u64 * f.n as u64 * f.hidden_in as u64 * f.act.size()) / 16;
        (
            [stage_in_ctas(vecs), 1, 1],
            StageInScalars {
                ints_words: 0,
                hidden_vecs: 0,
            },
        )
    }
    fn extents(s: &StageInScalars, f: &KernelFacts) -> StageInPtrs<Extent> {
        let act = f.act.size();
        let hidden = s.hidden_vecs as u64 * 16 / act;
        StageInPtrs {
            src: Extent::Elems(s.ints_words as u64),
            dst: Extent::Elems(s.ints_words as u64),
            ctl: Extent::Elems(2),
            src_hidden: Extent::Elems(hidden),
            hidden: Extent::Elems(hidden),
        }
    }
}

/// Bytes one thread of `l2_prefetch` asks L2 for at a time: one bulk prefetch.
pub const L2_PREFETCH_CHUNK: u64 = 4096;
pub const L2_PREFETCH_THREADS: u32 = 128;

/// `l2_prefetch`: asks L2 for `chunks` × [`L2_PREFETCH_CHUNK`] bytes from `src` (a GEMM's
/// weight, from its first byte), one bulk prefetch per chunk spread over the grid, and
/// returns without waiting for them. It writes nothing. The runtime adds it to a captured
/// graph as a branch that forks where the small launches before a GEMM begin and that no
/// launch waits on, so the weight streams in while those launches keep DRAM idle
/// (`runtime/src/gpu/prefetch.rs`); its pointer, size and grid are the runtime's.
#[derive(KernelParams)]
#[repr(C)]
pub struct L2PrefetchParams {
    /// The weight's first byte (16-byte aligned: every weight offset is).
    #[arg(weight)]
    pub src: DevPtr<Act>,
    /// 4 KiB chunks to ask for.
    pub chunks: u32,
}

impl Kernel for L2PrefetchParams {
    const ENTRY: Entry = Entry::L2Prefetch;
    fn threads(_: &KernelFacts) -> u32 {
        L2_PREFETCH_THREADS
    }
    /// Nothing per bucket: the runtime sets the region and the grid of each branch.
    fn launch(_: &BucketFacts, _: &KernelFacts) -> ([u32; 3], L2PrefetchScalars) {
        ([1, 1, 1], L2PrefetchScalars { chunks: 0 })
    }
    fn extents(s: &L2PrefetchScalars, f: &KernelFacts) -> L2PrefetchPtrs<Extent> {
        L2PrefetchPtrs {
            src: Extent::Elems(s.chunks as u64 * L2_PREFETCH_CHUNK / f.act.size()),
        }
    }
}

/// Slots of `admit`'s write set for a bucket of `batch` requests of `n` rows: a power of two
/// at least twice the rows (linear probing stays short).
pub fn admit_hash_slots(batch: u32, n: u32) -> u32 {
    (2 * batch.max(1) * n.max(1)).next_power_of_two().max(32)
}

/// Rows of one replay `admit`'s write set can index (16-bit owners, 0xffff = none) and that
/// fit its shared memory: the bound validation puts on `bucket · N`.
pub const ADMIT_MAX_ROWS: u32 = 8192;

/// `admit`'s dynamic shared memory for a bucket of `batch` requests: the write set (a u32
/// key and a u32 pair of owners per slot), then one rule byte per request.
pub fn admit_smem_bytes(batch: u32, n: u32) -> u32 {
    8 * admit_hash_slots(batch, n) + batch.div_ceil(8) * 8
}

/// CTAs per request row of `emit` (the logits row is split across them).
pub fn emit_y(f: &KernelFacts) -> u32 {
    if f.out_logits {
        f.logits_cols().div_ceil(8192).clamp(1, 32)
    } else {
        1
    }
}

/// `fill`: sets `height` rows of `width` elements of `elem_bytes` bytes (1, 2 or 4), rows
/// `pitch` bytes apart from `dst`, to the low `elem_bytes` bytes of `value`: a memset as a
/// kernel. The runtime launches it in place of the memset nodes a GEMM library leaves in a
/// captured graph (a memset node makes each graph launch cost the host 1–2 µs more than a
/// kernel node does, measured by specbench's engine rows on the H200).
#[derive(KernelParams)]
#[repr(C)]
pub struct FillParams {
    /// The region's first byte (typed as words for the ABI; the kernel addresses bytes).
    #[arg(scratch)]
    pub dst: DevPtrMut<i32>,
    pub value: u32,
    pub elem_bytes: u32,
    pub width: u32,
    pub height: u32,
    pub pitch: u32,
}

pub const IO_THREADS: u32 = 256;
/// CTAs of a `fill` launch at most: the kernel loops over the rest.
pub const FILL_MAX_CTAS: u32 = 1024;

impl FillParams {
    /// Grid of a launch over `s`'s region.
    pub fn grid(s: &FillScalars) -> [u32; 3] {
        let n = s.width as u64 * s.height as u64;
        [
            n.div_ceil(IO_THREADS as u64).clamp(1, FILL_MAX_CTAS as u64) as u32,
            1,
            1,
        ]
    }
}

impl Kernel for FillParams {
    const ENTRY: Entry = Entry::Fill;
    fn threads(_: &KernelFacts) -> u32 {
        IO_THREADS
    }
    /// Nothing per bucket: the runtime fills in the region of each memset it replaces.
    fn launch(_: &BucketFacts, _: &KernelFacts) -> ([u32; 3], FillScalars) {
        let s = FillScalars {
            value: 0,
            elem_bytes: 4,
            width: 0,
            height: 0,
            pitch: 0,
        };
        (Self::grid(&s), s)
    }
    fn extents(s: &FillScalars, _: &KernelFacts) -> FillPtrs<Extent> {
        let bytes = match s.height {
            0 => 0,
            h => (h as u64 - 1) * s.pitch as u64 + s.width as u64 * s.elem_bytes as u64,
        };
        FillPtrs {
            dst: Extent::Elems(bytes.div_ceil(4)),
        }
    }
}

impl Kernel for AdmitParams {
    const ENTRY: Entry = Entry::Admit;
    fn threads(_: &KernelFacts) -> u32 {
        IO_THREADS
    }
    fn launch(b: &BucketFacts, _: &KernelFacts) -> ([u32; 3], AdmitScalars) {
        (
            [b.batch, 1, 1],
            AdmitScalars {
                b: b.batch,
                batch: b.batch,
                flags: 0,
                prefix_bias: 0,
                base: 0,
                epoch: 0,
            },
        )
    }
    fn extents(s: &AdmitScalars, f: &KernelFacts) -> AdmitPtrs<Extent> {
        let (bb, n, h, hin) = (s.batch as u64, f.n as u64, f.hidden as u64, f.hidden_in as u64);
        let words = |w: usize| Extent::Elems(w as u64);
        AdmitPtrs {
            src_ids: Extent::Elems(s.b as u64 * n),
            src_hidden: Extent::Elems(s.b as u64 * n * hin),
            src_req: Extent::Elems(s.b as u64),
            src_prefix: Extent::Elems(s.b as u64),
            src_accept: Extent::Elems(s.b as u64),
            out_probs: Extent::Elems(s.b as u64 * f.topk as u64),
            out_ids: Extent::Elems(s.b as u64 * f.topk as u64),
            out_hidden: Extent::Elems(s.b as u64 * h),
            out_logits: Extent::Elems(if f.out_logits {
                s.b as u64 * f.logits_cols() as u64
            } else {
                0
            }),
            ids: Extent::Elems(bb * n),
            hidden: Extent::Elems(bb * n * hin),
            req_slots: Extent::Elems(bb),
            prefix_lens: Extent::Elems(bb),
            accept_lens: Extent::Elems(bb),
            page_table: Extent::Elems(0),
            kv_layout: words(crate::kv::KV_WORDS),
            status: words(crate::kv::STATUS_WORDS),
        }
    }
}

impl Kernel for EmitParams {
    const ENTRY: Entry = Entry::Emit;
    fn threads(_: &KernelFacts) -> u32 {
        IO_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], EmitScalars) {
        ([b.batch, emit_y(f), 1], EmitScalars { batch: b.batch })
    }
    fn extents(s: &EmitScalars, f: &KernelFacts) -> EmitPtrs<Extent> {
        let bb = s.batch as u64;
        let k = if f.out_topk { f.topk as u64 } else { 0 };
        EmitPtrs {
            req_slots: Extent::Elems(bb),
            probs: Extent::Elems(bb * k),
            ids: Extent::Elems(bb * k),
            hidden: Extent::Elems(bb * f.hidden as u64),
            logits: Extent::Elems(if f.out_logits { bb * f.logits_cols() as u64 } else { 0 }),
            status: Extent::Elems(crate::kv::STATUS_WORDS as u64),
        }
    }
}

pub fn constants(f: &KernelFacts) -> Constants {
    vec![
        act(f),
        u("HIDDEN", f.hidden),
        u("HIDDEN_IN", f.hidden_in),
        u("VOCAB", f.vocab),
        u("N", f.n),
        u("TOPK", f.topk),
        u("PAGE_SIZE", f.page_size),
        u("MAX_CONTEXT", f.max_context),
        // The layers' read window (0: whole prefixes), admission's bound on the prefix
        // positions whose table entries it checks (format::read_window).
        u("WINDOW", f.window),
        // The emitted logits' columns (every rank's under tensor parallelism).
        u("COLS", f.logits_cols()),
        u("OUT_TOPK", f.out_topk as u32),
        u("OUT_LOGITS", f.out_logits as u32),
    ]
}
