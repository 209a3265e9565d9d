//! The engine-memory check of draft decode: an engine-like pool and page table in one of
//! the engines' layouts ([`Layout`]), rows in scattered order, device inputs. A step of each
//! tier on engine memory (`step_decode_device`) must equal the same requests run by the
//! tier's owned-memory graph (`run_phase`) bit for bit — trees, verify inputs, and the whole
//! pool afterwards (so exactly the lanes' slots changed) — leave the table alone, refuse a
//! request breaking a device rule (no K/V written, zero rows, reported by `last_error` with
//! its index and rule) while computing the others, and report nothing on a good step.
//! Each good case replays twice, the second time with every integer input in int32 (the
//! replay path after the first launch); a batch above the largest bucket runs in chunks.

use specplan_format::{io, Phase, PhaseKind, ValidatedPlan};
use specplan_kernels::facts::{decode_reach, lane_offset, parent_width};
use specplan_runtime::bits::to_act_bits;
use specplan_runtime::gpu::{
    DecodeOutputs, DeviceDecode, DeviceInts, DeviceRule, EngineMemory, GemmPolicy, GpuOptions, GpuRuntime, StepInfo,
};
use specplan_runtime::gpu::{KvGeometry, TableMode};
use specplan_runtime::registration::{KvRegistration, TableRegistration};

use super::fixture::{device_weights, download, err, upload, Layout};
use crate::gpu::DeviceBuf;
use crate::Rng;

/// One case's verdict line and its failures.
pub struct DecodeEngineReport {
    pub line: String,
    pub failures: Vec<String>,
}

/// The requests of one case: prefixes, pages (owned page ids = engine blocks), inputs.
struct Reqs {
    l: Vec<usize>,
    pages: Vec<Vec<i32>>,
    probs: Vec<f32>,
    ids: Vec<i64>,
    hidden: Vec<u16>,
    bonus: Vec<i64>,
}

/// The outputs of a step, per name, `[b, w]` i64 (the mask as i64 too).
type Trees = Vec<(&'static str, usize, Vec<i64>)>;
/// A pool's K and V, dense slot-major per layer.
type Pool = (Vec<u16>, Vec<u16>);

fn out_widths(plan: &ValidatedPlan, kind: PhaseKind) -> Vec<(&'static str, usize)> {
    let (k, s) = (plan.spec.topk, kind.steps());
    let nodes = kind.draft_tokens(&plan.spec) as usize - 1;
    let n = nodes + 1;
    let mut v = vec![
        (io::PARENT_LIST, parent_width(k, s) as usize),
        (io::TOP_SCORES_INDEX, nodes),
        (io::DRAFT_TOKENS, nodes),
    ];
    if plan.capture.decode_verify {
        v.extend([
            (io::VERIFY_TOKENS, n),
            (io::VERIFY_POSITIONS, n),
            (io::RETRIEVE_INDEX, n),
            (io::RETRIEVE_NEXT_TOKEN, n),
            (io::RETRIEVE_NEXT_SIBLING, n),
            (io::TREE_MASK, n * n),
        ]);
    }
    v
}

/// The lane positions of a request with prefix `l`.
fn lane_positions(plan: &ValidatedPlan, kind: PhaseKind, l: usize) -> Vec<usize> {
    let (k, s, ps) = (plan.spec.topk, kind.steps(), plan.capture.page_size);
    (0..k)
        .flat_map(|lane| {
            let base = l + lane_offset(l as u64, lane, s, k, ps) as usize;
            (0..s as usize - 1).map(move |i| base + i)
        })
        .collect()
}

/// Runs the requests `keep` of `r` through the tier's owned graph, chunk by chunk (the
/// others as padding), and returns the trees `[b, w]` (zeros for the others) and the pool.
fn owned_run(
    own: &mut GpuRuntime,
    plan: &ValidatedPlan,
    kind: PhaseKind,
    r: &Reqs,
    keep: &[bool],
    kv0: &Pool,
    pool_pages: usize,
) -> Result<(Trees, Pool), String> {
    own.write_kv(&kv0.0, &kv0.1, pool_pages).map_err(err)?;
    let phase = plan.phase(kind).ok_or("no phase")?;
    let max_b = phase.buckets.last().map_or(1, |x| x.batch as usize);
    let b = r.l.len();
    let (k, h) = (plan.spec.topk as usize, plan.model.hidden as usize);
    let widths = out_widths(plan, kind);
    let mut trees: Trees = widths.iter().map(|&(n, w)| (n, w, vec![0i64; b * w])).collect();
    for start in (0..b).step_by(max_b) {
        let end = (start + max_b).min(b);
        let bb = phase
            .buckets
            .iter()
            .find(|x| x.batch as usize == end - start)
            .ok_or("chunk sizes are buckets in this check")?
            .batch;
        for c in 0..end - start {
            own.set_pages(c, &r.pages[start + c]).map_err(err)?;
        }
        let ch = start..end;
        let cell = |i: usize| keep[i];
        let f32s: Vec<u8> = ch
            .clone()
            .flat_map(|i| (0..k).map(move |j| if cell(i) { r.probs[i * k + j] } else { 0.0 }))
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let ids: Vec<u8> = ch
            .clone()
            .flat_map(|i| (0..k).map(move |j| if cell(i) { r.ids[i * k + j] } else { 0 }))
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let hid: Vec<u8> = ch
            .clone()
            .flat_map(|i| (0..h).map(move |j| if cell(i) { r.hidden[i * h + j] } else { 0 }))
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let lens: Vec<u8> = ch
            .clone()
            .flat_map(|i| (if cell(i) { r.l[i] as i32 } else { 0 }).to_le_bytes())
            .collect();
        let slots: Vec<u8> = ch
            .clone()
            .enumerate()
            .flat_map(|(c, i)| (if cell(i) { c as i32 } else { -1 }).to_le_bytes())
            .collect();
        let mut inputs = vec![
            (io::TOPK_PROBS, f32s),
            (io::TOPK_IDS, ids),
            (io::HIDDEN_STATES, hid),
            (io::PREFIX_LENS, lens),
            (io::REQ_SLOTS, slots),
        ];
        if plan.capture.decode_verify {
            let bonus = ch
                .clone()
                .flat_map(|i| (if cell(i) { r.bonus[i] } else { 0 }).to_le_bytes())
                .collect();
            inputs.push((io::BONUS_TOKENS, bonus));
        }
        for (n, bytes) in &inputs {
            own.write_phase_buffer(kind, bb, n, bytes).map_err(err)?;
        }
        own.run_phase(kind, bb, false).map_err(err)?;
        for (name, w, dst) in trees.iter_mut() {
            let bytes = own.read_phase_buffer(kind, bb, name).map_err(err)?;
            let vals: Vec<i64> = if *name == io::TREE_MASK {
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                    .collect()
            } else {
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect()
            };
            for i in ch.clone().filter(|&i| keep[i]) {
                let c = i - start;
                dst[i * *w..(i + 1) * *w].copy_from_slice(&vals[c * *w..(c + 1) * *w]);
            }
        }
    }
    let kv = own.read_kv(pool_pages).map_err(err)?;
    Ok((trees, kv))
}

/// An engine's K/V pool in one layout: where dense slot t's K and V of each layer lie.
struct EnginePool {
    geom: KvGeometry,
    slots: usize,
    hk: usize,
    d: usize,
    /// Elements of one layer of the dense pool (slots × kv heads × head dim).
    per_layer: usize,
    /// Elements of one plane (K, or K and V interleaved per block when `packed`).
    span: usize,
    /// V's element offset from K's.
    v_at: usize,
    /// K and V share one buffer per layer (vLLM's blocks).
    packed: bool,
}

impl EnginePool {
    /// Elements of one layer's buffer.
    fn image_len(&self) -> usize {
        if self.packed {
            self.span
        } else {
            2 * self.span
        }
    }

    /// Every (dense index, buffer offset) of one layer's K (V lies `v_at` further).
    fn each(&self, layer: usize, mut f: impl FnMut(usize, usize)) -> Result<(), String> {
        for t in 0..self.slots as u64 {
            for g in 0..self.hk as u64 {
                for e in 0..self.d as u64 {
                    let at = self.geom.offset(t, g, e).ok_or("geometry overflow")? as usize;
                    f(
                        layer * self.per_layer + ((t as usize * self.hk + g as usize) * self.d + e as usize),
                        at,
                    );
                }
            }
        }
        Ok(())
    }

    /// Layer `layer` of the dense pool `kv` placed in this layout.
    fn image(&self, kv: &Pool, layer: usize) -> Result<Vec<u16>, String> {
        let mut image = vec![0u16; self.image_len()];
        self.each(layer, |src, at| {
            image[at] = kv.0[src];
            image[at + self.v_at] = kv.1[src];
        })?;
        Ok(image)
    }

    /// Values of layer `layer`'s buffer `got` that differ from the dense pool `want`.
    fn diffs(&self, got: &[u16], want: &Pool, layer: usize) -> Result<usize, String> {
        let mut n = 0usize;
        self.each(layer, |src, at| {
            n += (got[at] != want.0[src]) as usize + (got[at + self.v_at] != want.1[src]) as usize;
        })?;
        Ok(n)
    }
}

/// `b` requests with prefixes up to `max_l`, each on its own pages of a pool of `pool_pages`
/// (its last page spare), and random draft-extend outputs.
fn random_reqs(
    plan: &ValidatedPlan,
    kind: PhaseKind,
    rng: &mut Rng,
    b: usize,
    max_l: usize,
    pool_pages: usize,
) -> Reqs {
    let (k, h, vocab) = (
        plan.spec.topk as usize,
        plan.model.hidden as usize,
        plan.model.vocab as usize,
    );
    let ps = plan.capture.page_size as usize;
    let reach = |l: usize| decode_reach(l as u64, kind.steps(), plan.spec.topk, ps as u32) as usize;
    let perm = rng.permutation(pool_pages - 1);
    let mut next = 0usize;
    let hidden: Vec<f32> = (0..b * h).map(|_| rng.uniform()).collect();
    let mut r = Reqs {
        l: Vec::new(),
        pages: Vec::new(),
        probs: Vec::new(),
        ids: Vec::new(),
        hidden: to_act_bits(&hidden, plan.capture.dtype),
        bonus: (0..b).map(|_| rng.below(vocab) as i64).collect(),
    };
    for _ in 0..b {
        let l = 1 + rng.below(max_l);
        let n = (l + reach(l)).div_ceil(ps);
        r.pages.push(perm[next..next + n].iter().map(|&p| p as i32).collect());
        next += n;
        r.l.push(l);
        let mut p: Vec<f32> = (0..k).map(|_| rng.uniform().abs() + 0.05).collect();
        let s: f32 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= s);
        p.sort_by(|a, b| b.total_cmp(a));
        r.probs.extend(p);
        r.ids.extend((0..k).map(|_| rng.below(vocab) as i64));
    }
    r
}

/// What an engine step of a case is given: the requests, their ids, rows and prefixes as
/// the engine passes them (the bad request broken there only), in int32 or int64.
struct EngineInputs<'a> {
    r: &'a Reqs,
    ids: &'a [i64],
    rows: &'a [i64],
    prefix: &'a [i64],
    i32s: bool,
}

/// Uploads a step's inputs and its outputs (poisoned: -1) and runs the tier on engine
/// memory; returns the step's info and the outputs' addresses, in `widths`' order.
fn device_step(
    rt: &mut GpuRuntime,
    plan: &ValidatedPlan,
    kind: PhaseKind,
    given: &EngineInputs,
    widths: &[(&'static str, usize)],
    bufs: &mut Vec<DeviceBuf>,
) -> Result<(StepInfo, Vec<u64>), String> {
    let b = given.r.l.len();
    let ints = |v: &[i64], bufs: &mut Vec<DeviceBuf>| -> Result<DeviceInts, String> {
        Ok(if given.i32s {
            let w: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            DeviceInts {
                ptr: upload(bufs, &w)?,
                i32: true,
            }
        } else {
            DeviceInts {
                ptr: upload(bufs, v)?,
                i32: false,
            }
        })
    };
    let ids = ints(given.ids, bufs)?;
    let outs: Vec<u64> = widths
        .iter()
        .map(|&(name, w)| {
            if name == io::TREE_MASK {
                upload(bufs, &vec![-1i32; b * w])
            } else {
                upload(bufs, &vec![-1i64; b * w])
            }
        })
        .collect::<Result<_, _>>()?;
    let at = |name: &str| widths.iter().position(|&(n, _)| n == name).map_or(0, |i| outs[i]);
    let step = DeviceDecode {
        b,
        topk_p: upload(bufs, &given.r.probs)?,
        topk_index: ids.ptr,
        ids_i32: ids.i32,
        hidden_states: upload(bufs, &given.r.hidden)?,
        req_pool_indices: ints(given.rows, bufs)?,
        prefix_lens: ints(given.prefix, bufs)?,
        prefix_bias: 0,
        bonus_tokens: if plan.capture.decode_verify {
            Some(ints(&given.r.bonus, bufs)?)
        } else {
            None
        },
        outputs: DecodeOutputs {
            parent_list: at(io::PARENT_LIST),
            top_scores_index: at(io::TOP_SCORES_INDEX),
            draft_tokens: at(io::DRAFT_TOKENS),
            verify: [
                at(io::VERIFY_TOKENS),
                at(io::VERIFY_POSITIONS),
                at(io::RETRIEVE_INDEX),
                at(io::RETRIEVE_NEXT_TOKEN),
                at(io::RETRIEVE_NEXT_SIBLING),
            ],
            tree_mask: at(io::TREE_MASK),
        },
        stream: rt.stream().cu_stream() as u64,
    };
    let info = rt.step_decode_device(kind, &step).map_err(err)?;
    Ok((info, outs))
}

/// The cases of one tier: its smallest and largest bucket, a batch above the largest (run in
/// chunks) where the plan allows it, and at the largest bucket each device rule broken by
/// request 2.
fn decode_cases(phase: &Phase, max_req: usize) -> Vec<(usize, Option<(usize, DeviceRule)>)> {
    let (lo, hi) = (
        phase.buckets.first().map_or(1, |x| x.batch as usize),
        phase.buckets.last().map_or(1, |x| x.batch as usize),
    );
    let mut cases: Vec<(usize, Option<(usize, DeviceRule)>)> = vec![(lo, None), (hi, None)];
    if hi + lo <= max_req {
        cases.push((hi + lo, None));
    }
    if hi >= 4 {
        for rule in [
            DeviceRule::Request,
            DeviceRule::Prefix,
            DeviceRule::Slot,
            DeviceRule::Id,
            DeviceRule::Alias,
        ] {
            cases.push((hi, Some((2, rule))));
        }
    }
    cases
}

/// Each request's rows of the step's outputs (at `outs`, in `widths`' order) against the
/// owned graph's trees `want`; a request refused on the engine step must read as zeros there.
fn compare_trees(
    outs: &[u64],
    widths: &[(&'static str, usize)],
    want: &Trees,
    refused: &[bool],
    label: &str,
    failures: &mut Vec<String>,
) -> Result<(), String> {
    let b = refused.len();
    for (j, &(name, w)) in widths.iter().enumerate() {
        let got: Vec<i64> = if name == io::TREE_MASK {
            download::<i32>(outs[j], b * w)?.into_iter().map(|x| x as i64).collect()
        } else {
            download::<i64>(outs[j], b * w)?
        };
        for i in 0..b {
            if got[i * w..(i + 1) * w] != want[j].2[i * w..(i + 1) * w] {
                failures.push(format!(
                    "{label}: request {i} ({}): {name} differs from the owned graph's",
                    if refused[i] {
                        "refused: zeros expected"
                    } else {
                        "admitted"
                    }
                ));
            }
        }
    }
    Ok(())
}

/// The engine's page table for requests `r` on rows `rows` of `rows_n`: vLLM's block ids
/// (`blocks`) or SGLang's token slots, rows longer than either phase reaches, a padded stride
/// and -1 elsewhere. Returns (the table, its columns, its row stride).
fn engine_table(
    plan: &ValidatedPlan,
    kind: PhaseKind,
    r: &Reqs,
    rows: &[i64],
    rows_n: usize,
    blocks: bool,
) -> (Vec<i32>, usize, usize) {
    let ps = plan.capture.page_size as usize;
    let reach = |l: usize| decode_reach(l as u64, kind.steps(), plan.spec.topk, ps as u32) as usize;
    // Rows longer than draft-extend's reach too (the registration asks for it).
    let n_ext = plan.rows_per_request(PhaseKind::DraftExtend) as usize;
    let cols = if blocks {
        r.pages.iter().map(|p| p.len()).max().unwrap_or(1) + n_ext.div_ceil(ps) + 1
    } else {
        r.l.iter().map(|&l| l + reach(l)).max().unwrap_or(1) + n_ext + 8
    };
    let stride = cols + 5;
    let mut table = vec![-1i32; rows_n * stride];
    for i in 0..r.l.len() {
        let row = &mut table[rows[i] as usize * stride..];
        if blocks {
            row[..r.pages[i].len()].copy_from_slice(&r.pages[i]);
        } else {
            for (p, e) in row[..r.l[i] + reach(r.l[i])].iter_mut().enumerate() {
                *e = r.pages[i][p / ps] * ps as i32 + (p % ps) as i32;
            }
        }
    }
    (table, cols, stride)
}

/// The check of one plan's every draft-decode tier in `layout`.
pub fn engine_decode_check(
    plan: &ValidatedPlan,
    rng: &mut Rng,
    layout: Layout,
) -> Result<Vec<DecodeEngineReport>, String> {
    let kinds: Vec<PhaseKind> = plan.phases.iter().map(|p| p.kind).filter(|k| k.steps() > 1).collect();
    if kinds.is_empty() {
        return Ok(Vec::new());
    }
    let m = &plan.model;
    let k = plan.spec.topk as usize;
    let ps = plan.capture.page_size as usize;
    let (hk, d, layers) = (m.kv_heads as usize, m.head_dim as usize, m.layers as usize);
    let max_req = plan.capture.max_requests as usize;
    let ctx = plan.capture.max_context_len as usize;
    let max_l = 100usize.min(ctx / 2);
    let per_req = (max_l + decode_reach(max_l as u64, 6, plan.spec.topk, ps as u32) as usize).div_ceil(ps) + 1;
    let pool_pages = max_req * per_req + 1;
    let weights = crate::random::random_weights(plan, rng);
    let opts = |pages: Option<u32>| GpuOptions {
        gemms: GemmPolicy::Heuristic,
        kv_pool_pages: pages,
        ..GpuOptions::default()
    };
    let mut own = GpuRuntime::new(plan.clone(), &weights, opts(Some(pool_pages as u32 + 1))).map_err(err)?;
    let slots = pool_pages * ps;
    let per_layer = slots * hk * d;
    let act = plan.capture.dtype;
    let bits =
        |rng: &mut Rng, n: usize| -> Vec<u16> { to_act_bits(&(0..n).map(|_| rng.uniform()).collect::<Vec<_>>(), act) };
    let mut reports = Vec::new();
    for &kind in &kinds {
        let phase = plan.phase(kind).ok_or("no phase")?;
        for (b, bad) in decode_cases(phase, max_req) {
            let mut r = random_reqs(plan, kind, rng, b, max_l, pool_pages);
            if let Some((i, DeviceRule::Alias)) = bad {
                // Request i reads and writes exactly request i − 1's positions.
                r.l[i] = r.l[i - 1];
                r.pages[i] = r.pages[i - 1].clone();
            }
            let kv0 = (bits(rng, layers * per_layer), bits(rng, layers * per_layer));
            // What the engine step is given: the bad request broken there only.
            let mut e_l: Vec<i64> = r.l.iter().map(|&l| l as i64).collect();
            let mut e_ids = r.ids.clone();
            let rows_n = 2 * b + 3;
            let row_perm = rng.permutation(rows_n);
            let mut rows: Vec<i64> = (0..b).map(|i| row_perm[i] as i64).collect();
            let blocks = layout.blocks();
            let (mut table, cols, stride) = engine_table(plan, kind, &r, &rows, rows_n, blocks);
            let mut refused = vec![false; b];
            if let Some((i, rule)) = bad {
                refused[i] = true;
                match rule {
                    DeviceRule::Request => rows[i] = rows_n as i64 + 5,
                    DeviceRule::Prefix => {
                        // Past the context; and request i + 1's one below i64::MAX, whose
                        // sum with the lanes' reach would wrap an i64.
                        e_l[i] = ctx as i64;
                        e_l[i + 1] = i64::MAX - 1;
                        refused[i + 1] = true;
                    }
                    DeviceRule::Slot => {
                        let pos = lane_positions(plan, kind, r.l[i])[0];
                        let at = rows[i] as usize * stride + if blocks { pos / ps } else { pos };
                        table[at] = -1;
                        // And request i + 1's prefix, where a layer reads it.
                        if let Some(e) = super::read_hole(plan, r.l[i + 1], blocks) {
                            table[rows[i + 1] as usize * stride + e] = -1;
                            refused[i + 1] = true;
                        }
                    }
                    DeviceRule::Id => e_ids[i * k] = m.vocab as i64,
                    DeviceRule::Alias => {
                        // Two requests on one row: each writes the lanes the other reads.
                        rows[i] = rows[i - 1];
                        refused[i - 1] = true;
                    }
                    _ => return Err(format!("no decode case for {rule:?}")),
                }
            }
            let keep: Vec<bool> = refused.iter().map(|&x| !x).collect();
            let (want, want_kv) = owned_run(&mut own, plan, kind, &r, &keep, &kv0, pool_pages)?;
            // The engine's pool: dense slot t placed by the layout's geometry.
            let mut bufs = Vec::new();
            let packed = blocks;
            let epool = EnginePool {
                geom: layout.geometry(slots as u64, ps as u64, hk as u64, d as u64),
                slots,
                hk,
                d,
                per_layer,
                span: slots * hk * d * if packed { 2 } else { 1 },
                v_at: if packed { d } else { slots * hk * d },
                packed,
            };
            let geom = epool.geom;
            let (mut kp, mut vp) = (Vec::new(), Vec::new());
            for l in 0..layers {
                let base = upload(&mut bufs, &epool.image(&kv0, l)?)?;
                kp.push(base);
                vp.push(base + (epool.v_at * 2) as u64);
            }
            let tp = upload(&mut bufs, &table)?;
            let wts = device_weights(plan, &weights, &mut bufs, 0)?;
            let mem = EngineMemory {
                kv: KvRegistration {
                    k: kp.clone(),
                    v: vp,
                    geom,
                },
                table: TableRegistration {
                    ptr: tp,
                    mode: if blocks {
                        TableMode::PageIds
                    } else {
                        TableMode::TokenSlots
                    },
                    rows: rows_n as u64,
                    cols: cols as u64,
                    stride: stride as u64,
                    page_size: if blocks { ps as u64 } else { 1 },
                },
                weights: &wts,
            };
            let mut rt = GpuRuntime::with_engine_memory(plan.clone(), mem, opts(None)).map_err(err)?;
            let widths = out_widths(plan, kind);
            let mut failures = Vec::new();
            let reps = if bad.is_none() { 2 } else { 1 };
            for rep in 0..reps {
                let i32s = rep == 1;
                let given = EngineInputs {
                    r: &r,
                    ids: &e_ids,
                    rows: &rows,
                    prefix: &e_l,
                    i32s,
                };
                let (info, outs) = device_step(&mut rt, plan, kind, &given, &widths, &mut bufs)?;
                rt.synchronize().map_err(err)?;
                if !info.graph {
                    failures.push(format!("b={b}: the step ran eagerly"));
                }
                let label = format!("b={b} rep {rep}");
                compare_trees(&outs, &widths, &want, &refused, &label, &mut failures)?;
                let tree_equal =
                    b * widths.len() - failures.iter().filter(|f| f.contains("differs from the owned")).count();
                let mut kv_diffs = 0usize;
                for (l, &base) in kp.iter().enumerate() {
                    kv_diffs += epool.diffs(&download(base, epool.image_len())?, &want_kv, l)?;
                }
                if kv_diffs != 0 {
                    failures.push(format!(
                        "b={b} rep {rep}: the pool differs from the owned run's in {kv_diffs} values"
                    ));
                }
                let t_now: Vec<i32> = download(tp, table.len())?;
                if t_now != table {
                    failures.push(format!("b={b}: the page table changed"));
                }
                let reported = rt.last_error().map_err(err)?;
                match (bad, &reported) {
                    (None, None) => {}
                    (Some((i, rule)), Some(e)) => {
                        let first = if rule == DeviceRule::Alias { i - 1 } else { i };
                        if e.rule != Some(rule) || e.request != first as u64 {
                            failures.push(format!(
                                "b={b}: reported {:?} at request {}, expected {rule:?} at {first}",
                                e.rule, e.request
                            ));
                        }
                    }
                    (want, got) => failures.push(format!("b={b}: reported {got:?}, expected {want:?}")),
                }
                reports.push(DecodeEngineReport {
                    line: format!(
                        "engine-decode {:<22} {} b {:>3}{}: {} of {} output tensors per request == owned graph's, pool == owned ({kv_diffs} diffs), prep {:.1} µs{}",
                        layout.name(),
                        kind.label(),
                        b,
                        if i32s { " (int32 inputs)" } else { "" },
                        tree_equal,
                        b * widths.len(),
                        info.prep_us,
                        match (bad, &reported) {
                            (Some((_, rule)), Some(e)) => format!("; {rule:?} refused and reported ({} request(s))", e.count),
                            _ => String::new(),
                        }
                    ),
                    failures: std::mem::take(&mut failures),
                });
            }
        }
    }
    Ok(reports)
}
