//! rope_append.cu: RoPE of q and k, and the append of k and v to the paged cache.

use crate::abi::{Act, DevPtr, DevPtrMut, Extent, Kernel};
use crate::facts::{row_parts, BucketFacts, KernelFacts};
use crate::io;
use crate::source::{ConstValue, Constants};
use crate::Entry;
use specplan_kernel_derive::KernelParams;

use super::{act, u};

/// `rope_append`: rotates q in place inside the fused qkv rows, writes rotated k and v to
/// the request's cache slots.
#[derive(KernelParams)]
#[repr(C)]
pub struct RopeAppendParams {
    #[arg(buffer, rw)]
    pub qkv: DevPtrMut<Act>,
    #[arg(input = io::PREFIX_LENS)]
    pub prefix_lens: DevPtr<i32>,
    #[arg(input = io::REQ_SLOTS)]
    pub req_slots: DevPtr<i32>,
    #[arg(table)]
    pub page_table: DevPtr<i32>,
    /// The registered cache geometry (`kv.rs`).
    #[arg(layout)]
    pub kv_layout: DevPtr<i64>,
    #[arg(k_cache)]
    pub k_cache: DevPtrMut<Act>,
    #[arg(v_cache)]
    pub v_cache: DevPtrMut<Act>,
    pub rows: u32,
}

pub const ROPE_THREADS: u32 = 128;

impl Kernel for RopeAppendParams {
    const ENTRY: Entry = Entry::RopeAppend;
    fn threads(_: &KernelFacts) -> u32 {
        ROPE_THREADS
    }
    fn launch(b: &BucketFacts, f: &KernelFacts) -> ([u32; 3], RopeAppendScalars) {
        // 16-byte units of the half heads rotated (q and k heads).
        let units = (f.heads + f.kv_heads) as u64 * (f.head_dim as u64 / 2).div_ceil(8);
        (
            [b.rows, row_parts(b.rows, units, ROPE_THREADS), 1],
            RopeAppendScalars { rows: b.rows },
        )
    }
    fn extents(s: &RopeAppendScalars, f: &KernelFacts) -> RopeAppendPtrs<Extent> {
        let rows = s.rows as u64;
        let batch = rows.div_ceil(f.n.max(1) as u64);
        RopeAppendPtrs {
            qkv: Extent::Elems(rows * f.qkv_cols() as u64),
            prefix_lens: Extent::Elems(batch),
            req_slots: Extent::Elems(batch),
            // The table and the pools are registered with the runtime: the kernel bounds
            // every index it computes by the layout words.
            page_table: Extent::Elems(0),
            kv_layout: Extent::Elems(crate::kv::KV_WORDS as u64),
            k_cache: Extent::Elems(0),
            v_cache: Extent::Elems(0),
        }
    }
}

/// The paged-cache geometry shared by the templates that walk the cache.
pub(crate) fn paged_kv(f: &KernelFacts) -> Constants {
    vec![
        u("HEADS", f.heads),
        u("KV_HEADS", f.kv_heads),
        u("HEAD_DIM", f.head_dim),
        u("N", f.n),
        u("PAGE_SIZE", f.page_size),
        // Draft decode's lanes (0: draft-extend's causal rows) and the forward an instance
        // serves: positions and slots are compile-time functions of both.
        u("LANE_STEPS", f.lanes),
        u("STEP", f.step),
    ]
}

pub fn constants(f: &KernelFacts) -> Constants {
    let mut c = vec![act(f)];
    c.extend(paged_kv(f));
    c.push(("INV_FREQ".into(), ConstValue::F32Array(f.inv_freq.clone())));
    c.push(("ROPE_SCALE".into(), ConstValue::F32(f.rope_scale)));
    c
}
