//! Owned memory's admission of a step whose requests share cache pages (on the GPU
//! machine: an owned runtime needs a device). Two requests, one page of prefix each:
//! - rows on pages of their own: admitted;
//! - both rows list the page both write: refused (rule 7, two writers of one cache slot);
//! - one row's prefix page is the page the other writes: refused (the aliasing rule);
//! - both rows list one prefix page that neither writes (a shared prompt): admitted.
//!
//! A refused step writes nothing (the cache is compared before and after). The shared pages
//! are what the check's fast path (pages no other row lists skip the write set and the
//! aliasing scan) must still catch.

use specplan_format::{PhaseKind, ValidatedPlan};
use specplan_runtime::gpu::{GpuRuntime, Hidden, StepRequest};

/// A case: what it is, the two requests' page-table rows, and the refusal's words (`None`:
/// admitted).
type Case = (&'static str, [Vec<i32>; 2], Option<&'static str>);

/// Runs the four cases on `rt` (owned memory, a plan with at least two request slots);
/// `Err` names the first case that went the wrong way.
pub fn owned_refusals(plan: &ValidatedPlan, rt: &mut GpuRuntime) -> Result<(), String> {
    let g = |e: specplan_runtime::gpu::GpuError| e.to_string();
    let (n, ps) = (
        plan.rows_per_request(PhaseKind::DraftExtend) as usize,
        plan.capture.page_size as usize,
    );
    let h = plan.model.hidden_in() as usize;
    // Prefix one page; the step writes positions [ps, ps + n): columns 1..=ceil(n/ps).
    let cols = 1 + n.div_ceil(ps);
    if plan.capture.max_requests < 2 || (plan.capture.max_pages_per_request as usize) < cols {
        return Err("needs two request slots and rows of 1 + ceil(N/page) pages".into());
    }
    // Pages 1.. (0 stays unused); request r's own pages start at 1 + r·cols.
    let own = |r: usize| -> Vec<i32> { (0..cols).map(|c| (1 + r * cols + c) as i32).collect() };
    let ids = vec![1i64; 2 * n];
    let hidden = vec![0x3c00u16; 2 * n * h];
    let (prefix, accept) = ([ps as i32; 2], [n as i32; 2]);
    let used = 1 + 2 * cols;
    let step = |rt: &mut GpuRuntime, rows: [Vec<i32>; 2]| -> Result<(), String> {
        for (slot, row) in rows.iter().enumerate() {
            rt.set_pages(slot, row).map_err(g)?;
        }
        let req = StepRequest {
            slots: &[0, 1],
            input_ids: &ids,
            hidden: Hidden::Host(&hidden),
            prefix_lens: &prefix,
            accept_lens: &accept,
        };
        rt.step(&req, false).map(|_| ()).map_err(g)
    };
    let cases: [Case; 4] = [
        ("own pages", [own(0), own(1)], None),
        (
            "one written page in both rows",
            [own(0), [vec![own(1)[0], own(0)[1]], own(1)[2..].to_vec()].concat()],
            Some("also writes"),
        ),
        (
            "a prefix page the other request writes",
            [own(0), [vec![own(0)[1]], own(1)[1..].to_vec()].concat()],
            Some("would race"),
        ),
        (
            "a shared prefix page",
            [own(0), [vec![own(0)[0]], own(1)[1..].to_vec()].concat()],
            None,
        ),
    ];
    for (what, rows, refusal) in cases {
        let before = rt.read_kv(used).map_err(g)?;
        let got = step(rt, rows);
        match (refusal, got) {
            (None, Ok(())) => {}
            (None, Err(e)) => return Err(format!("{what}: refused ({e})")),
            (Some(want), Ok(())) => return Err(format!("{what}: admitted (want a refusal saying {want:?})")),
            (Some(want), Err(e)) => {
                if !e.contains(want) {
                    return Err(format!("{what}: refused, but the error does not say {want:?}: {e}"));
                }
                if rt.read_kv(used).map_err(g)? != before {
                    return Err(format!("{what}: refused, but the cache changed"));
                }
            }
        }
    }
    Ok(())
}
