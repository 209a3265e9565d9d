//! Where a runtime's tensors live on the device. Both modes resolve every launch argument
//! here, so the launches are issued by one code path:
//! - owned memory (`GpuRuntime::new`): the runtime allocates the weight region (uploaded
//!   from the host), a K/V pool of the plan's pages and its own page table (page ids);
//! - engine memory (`GpuRuntime::with_engine_memory`): the caller's registration
//!   ([`crate::registration`]: its K/V pool, page table and weights, checked once) is used
//!   in place; the graphs are captured against those addresses, and no byte of them is ever
//!   copied.
//!
//! Either way the kernels see the cache through the layout words (`specplan_kernels::kv`),
//! written once at load into the runtime's small `meta` allocation beside the step status.

use specplan_format::{ArgValue, BucketPlan, KvKind, Plan};

use specplan_kernels::kv;

use super::device::DevMem;
pub use crate::registration::{
    bind_weights, check_kv, check_table, layout_words, DeviceTensor, EngineMemory, KvGeometry, KvRegistration,
    TableRegistration, WeightBinding,
};

/// The device memory a runtime launches against.
pub(crate) struct Memory {
    pub arena: DevMem,
    /// Device address of each plan weight.
    pub weights: Vec<u64>,
    pub kv: KvRegistration,
    pub table: TableRegistration,
    /// Layout words, then status words (i64), then the arrival counters (u32).
    pub meta: DevMem,
    /// Host-mapped copy of the refusal words, written by `emit` (engine memory).
    pub mirror: super::device::Mapped,
    /// Allocations the runtime owns behind `weights`, `kv` and `table` (owned mode, packed
    /// weights); kept alive, never read directly.
    pub _owned: Vec<DevMem>,
}

impl Memory {
    pub fn layout_ptr(&self) -> u64 {
        self.meta.ptr
    }

    pub fn status_ptr(&self) -> u64 {
        self.meta.ptr + (kv::KV_WORDS * 8) as u64
    }

    /// The arrival counters, after the status words (zeroed with them at load).
    pub fn counters_ptr(&self) -> u64 {
        self.meta.ptr + ((kv::KV_WORDS + kv::STATUS_WORDS) * 8) as u64
    }

    /// The device address an argument names (0 for null and `u32`s).
    pub fn arg_ptr(&self, plan: &Plan, b: &BucketPlan, v: &ArgValue) -> u64 {
        match v {
            ArgValue::Buffer(id) => self.arena.ptr + b.buffers.get(*id as usize).map_or(0, |x| x.offset),
            ArgValue::Weight(id) => self.weights.get(*id as usize).copied().unwrap_or(0),
            ArgValue::KvCache { layer, kind } => {
                let pools = if *kind == KvKind::K { &self.kv.k } else { &self.kv.v };
                pools.get(*layer as usize).copied().unwrap_or(0)
            }
            ArgValue::PageTable => self.table.ptr,
            ArgValue::KvLayout => self.layout_ptr(),
            ArgValue::Counters => self.counters_ptr(),
            ArgValue::Null | ArgValue::U32(_) => {
                let _ = plan;
                0
            }
        }
    }
}
