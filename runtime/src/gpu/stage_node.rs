//! The `stage_in` node at the head of an owned-memory draft-extend graph (`staging.rs` has
//! the host side): captured with the bucket's integer inputs' addresses, its hidden-state
//! source set per step only when it changes (`cuGraphExecKernelNodeSetParams`, the call an
//! engine-memory step makes for `admit`).
//!
//! Why: host prep of an owned step made three driver calls before the launch (the inputs'
//! copy, the device hidden states' copy, the staging event), about 2–3 µs each on the H200's
//! host; the node makes none in the common case (the same hidden buffer every step), and on
//! the device it replaces two copies queued ahead of the graph (perf-notes item 45).

use std::cell::Cell;
use std::time::Instant;

use cudarc::driver::{result, sys};
use specplan_format::{bucket_facts, kernel_facts_of, PhaseKind};
use specplan_kernels::abi::{Abi, Kernel, KernelParams};
use specplan_kernels::entries::io::{StageInParams, StageInPtrs, StageInScalars};
use specplan_kernels::Entry;

use super::device::{cuda, GpuError};
use super::launch::{launch_packed, pack_slots};
use super::owned::{Hidden, StepInfo, StepRequest};
use super::staging::StageRows;
use super::{engine, engine_decode, graph, GpuRuntime, Mode};

/// A bucket graph's `stage_in` node and the per-step values its parameters hold now.
pub(crate) struct StageNode {
    node: sys::CUgraphNode,
    /// `(src_hidden, hidden_vecs, ints_words)` as last set (at capture: `(0, 0, ints)`).
    set: Cell<(u64, u32, u32)>,
}

impl GpuRuntime {
    /// Bucket `bi`'s `stage_in` parameters for a step whose hidden states are `hidden_vecs`
    /// 16-byte vectors at `src_hidden` (0, 0: none to copy) and that copies `ints_words`
    /// words of integer inputs (0: none, the inputs in place). `None`: the bucket cannot
    /// stage in its graph (not a draft-extend bucket of owned memory, or integer inputs in
    /// more than one range).
    fn stage_params(&self, bi: usize, src_hidden: u64, hidden_vecs: u32, ints_words: u32) -> Option<Vec<u8>> {
        let Mode::Owned(s) = &self.mode else { return None };
        let (src, off, _) = s.staging().graph_ints(bi)?;
        let hidden = self.mem.arena.ptr + s.staging().layout(bi).hidden_range().0 as u64;
        let args = StageInParams::assemble(
            StageInPtrs {
                src,
                dst: self.mem.arena.ptr + off as u64,
                ctl: s.staging().graph_ctl_dev(),
                src_hidden,
                hidden,
            },
            StageInScalars {
                ints_words,
                hidden_vecs,
            },
        );
        Some(pack_slots(&Abi::of::<StageInParams>(), &args))
    }

    /// Words of bucket `bi`'s staged integer inputs (0 when it cannot stage in its graph).
    pub(crate) fn stage_words(&self, bi: usize) -> u32 {
        let Mode::Owned(s) = &self.mode else { return 0 };
        s.staging().graph_ints(bi).map_or(0, |(_, _, bytes)| (bytes / 4) as u32)
    }

    fn stage_shape(&self, bi: usize) -> Result<(sys::CUfunction, [u32; 3], u32), GpuError> {
        let func = self.funcs[engine::kernel_of(&self.plan, Entry::StageIn)? as usize];
        let b = bucket_facts(&self.plan.buckets()[bi]);
        let f = kernel_facts_of(&self.plan);
        let (grid, _) = StageInParams::launch(&b, &f);
        Ok((func, grid, StageInParams::threads(&f)))
    }

    /// Whether bucket `bi`'s graph (flat index) stages its inputs: an owned draft-extend
    /// bucket whose integer inputs are one range.
    pub(crate) fn can_stage(&self, bi: usize) -> bool {
        bi < self.plan.buckets().len() && self.stage_words(bi) > 0
    }

    /// Under capture of a bucket that `can_stage`: its `stage_in` launch, with the bucket's
    /// integer inputs and no hidden states.
    pub(crate) fn issue_stage_in(&self, bi: usize, stream: sys::CUstream) -> Result<(), GpuError> {
        let mut blob = self
            .stage_params(bi, 0, 0, self.stage_words(bi))
            .ok_or(GpuError::Mode("an owned-memory capture"))?;
        let (func, grid, threads) = self.stage_shape(bi)?;
        launch_packed(func, grid, [threads, 1, 1], 0, &mut blob, stream)
    }

    /// After the capture: the graph's `stage_in` node.
    pub(crate) fn stage_node(&self, bi: usize, g: &graph::Exec) -> Result<StageNode, GpuError> {
        let (func, _, _) = self.stage_shape(bi)?;
        Ok(StageNode {
            node: engine_decode::kernel_node(g, func, Entry::StageIn)?,
            set: Cell::new((0, 0, self.stage_words(bi))),
        })
    }

    /// Sets bucket `bi`'s `stage_in` node to `(src_hidden, hidden_vecs, ints_words)` unless it
    /// holds them already (`ints_words` 0 with `hidden_vecs` 0: the node copies nothing, for a
    /// replay on the inputs in place).
    pub(crate) fn set_stage(&self, bi: usize, want: (u64, u32, u32)) -> Result<(), GpuError> {
        let Some(g) = self.graphs.get(bi).and_then(|g| g.as_ref()) else {
            return Ok(());
        };
        let Some(st) = g.stage.as_ref() else { return Ok(()) };
        if st.set.get() == want {
            return Ok(());
        }
        let mut blob = self
            .stage_params(bi, want.0, want.1, want.2)
            .ok_or(GpuError::Mode("an owned-memory graph step"))?;
        let (func, grid, threads) = self.stage_shape(bi)?;
        engine_decode::set_node(&g.graph, st.node, func, (grid, threads, 0), &mut blob)?;
        st.set.set(want);
        Ok(())
    }

    /// Whether bucket `bi`'s graph stages its own inputs.
    pub(crate) fn stages_in_graph(&self, bi: usize) -> bool {
        self.graphs
            .get(bi)
            .and_then(|g| g.as_ref())
            .is_some_and(|g| g.stage.is_some())
    }

    /// Before a replay on the inputs already in place (`replay_only`, `run_phase`): the
    /// bucket's `stage_in` copies nothing.
    pub(crate) fn quiet_stage(&self, kind: PhaseKind, bi: usize) -> Result<(), GpuError> {
        if kind != PhaseKind::DraftExtend || !self.stages_in_graph(bi) {
            return Ok(());
        }
        self.set_stage(bi, (0, 0, 0))
    }

    /// A graph step of bucket `bi` whose graph stages its inputs (`stage_node.rs`): the rows
    /// into the host-mapped block, the `stage_in` node's hidden source set if it changed,
    /// the launch. No copy call but a host hidden-state copy or an unaligned device one.
    pub(crate) fn step_staged(
        &mut self,
        req: &StepRequest,
        (bi, rows): (usize, &StageRows),
        t0: Instant,
    ) -> Result<StepInfo, GpuError> {
        let b = req.slots.len();
        let (n, h) = (
            self.plan.rows_per_request(PhaseKind::DraftExtend) as usize,
            self.plan.model.hidden_in() as usize,
        );
        let bytes = b * n * h * self.plan.capture.dtype.size() as usize;
        let (stream, arena) = (self.stream.cu_stream(), self.mem.arena.ptr);
        // The caller's device rows are copied by the node when they are whole 16-byte
        // vectors (every preset's), else by a copy before the launch.
        let (src_hidden, vecs) = match req.hidden {
            Hidden::Device(p)
                if bytes.is_multiple_of(16) && p.is_multiple_of(16) && bytes / 16 <= u32::MAX as usize =>
            {
                (p, (bytes / 16) as u32)
            }
            _ => (0, 0),
        };
        let Mode::Owned(s) = &mut self.mode else {
            return Err(GpuError::Mode("step with host inputs"));
        };
        s.staging_mut().graph_write(&self.plan, bi, rows, stream)?;
        match req.hidden {
            Hidden::Host(_) => s.staging().graph_copy_hidden(bi, arena, stream)?,
            Hidden::Device(p) if vecs == 0 => {
                let at = arena + s.staging().layout(bi).hidden_range().0 as u64;
                // SAFETY: as in `step_one`: the caller's b·N·H activations into the arena's
                // B·N·H, before the graph on the stream.
                cuda("cuMemcpyDtoDAsync", unsafe {
                    result::memcpy_dtod_async(at, p, bytes, stream)
                })?;
            }
            Hidden::Device(_) => {}
        }
        s.last_batch = b;
        self.set_stage(bi, (src_hidden, vecs, self.stage_words(bi)))?;
        let prep_us = t0.elapsed().as_secs_f64() * 1e6;
        if let Some(g) = &self.graphs[bi] {
            if let Err(e) = g.graph.launch() {
                // A host hidden-state copy may be queued from the block, which the next step
                // rewrites: let it finish (an error path, off the replay path).
                let _ = self.stream.synchronize();
                return Err(e);
            }
        }
        if let Mode::Owned(s) = &mut self.mode {
            s.staging_mut().graph_launched();
        }
        Ok(StepInfo {
            bucket: self.plan.buckets()[bi].batch,
            graph: true,
            prep_us,
        })
    }
}
