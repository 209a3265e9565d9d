//! Graph-safety analysis: can a bucket be replayed as a CUDA graph?
//!
//! A bucket is replayable when every shape is static at that batch size (true by
//! construction: shapes are affine in B), no op needs a host round trip or a
//! data-dependent allocation, the KV pool can hold a full bucket plus the scratch page
//! that padded rows write to, and every index the kernels keep in 32 bits fits. Otherwise
//! the verdict carries the typed reason and the runtime runs that bucket eagerly.

use specplan_format::{PhaseKind, Replay, ReplayBlocker};

use crate::config::Config;
use crate::graph::OpGraph;

pub fn replay_verdict(g: &OpGraph, cfg: &Config, batch: u32, kind: PhaseKind) -> Replay {
    if let Some(op) = g.graph.node_weights().find(|op| op.kind.needs_host_sync()) {
        return Replay::Eager(ReplayBlocker::HostSync { op: op.name.clone() });
    }
    let c = &cfg.capture;
    let pool = c.kv_pool_pages as u64;
    // Page ids are stored as i32 in the page table.
    if pool > i32::MAX as u64 {
        return Replay::Eager(ReplayBlocker::IndexOverflow {
            what: "kv_pool_pages".into(),
            value: pool,
            limit: i32::MAX as u64,
        });
    }
    // R new positions (draft-extend's rows per request; draft decode's reach, its lanes'
    // runs) can straddle one more page boundary than R / page_size suggests.
    let ps = c.page_size as u64;
    let positions = match kind {
        PhaseKind::DraftExtend => kind.rows_per_request(&cfg.spec) as u64,
        PhaseKind::DraftDecode { steps } => {
            specplan_kernels::facts::decode_reach(ps - 1, steps, cfg.spec.topk, c.page_size)
        }
    };
    let pages_per_req = (positions + ps - 1).div_ceil(ps);
    let need = batch as u64 * pages_per_req + 1;
    if need > pool {
        return Replay::Eager(ReplayBlocker::PoolTooSmall {
            need_pages: need,
            pool_pages: pool,
        });
    }
    let table = (c.max_requests as u64 + 1) * c.pages_per_request() as u64;
    if table > i32::MAX as u64 {
        return Replay::Eager(ReplayBlocker::IndexOverflow {
            what: "page_table entries".into(),
            value: table,
            limit: i32::MAX as u64,
        });
    }
    Replay::Graph
}
