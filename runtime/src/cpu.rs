//! The CPU reference executor: runs a plan's launch list for one bucket in f32.
//!
//! It interprets exactly what the GPU runtime replays — the same launches, the same
//! arguments, the same arena offsets — with plain loops, so it is the oracle for GPU tests
//! and it exercises the memory plan itself: the arena is one array in which every buffer
//! lives at its planned offset (one f64 cell per 2 bytes, so bf16, f32, i32 and i64
//! values are all held exactly), and two buffers that wrongly share bytes while live
//! corrupt each other here just as they would on the device.
//!
//! Math is f32 as the kernels do it (reductions accumulate in f64, a slightly better
//! oracle); activations are not rounded to bf16 between ops.

use crate::format::{
    Access, ArgValue, BucketPlan, ConstValue, GemmDesc, KernelArg, KernelDesc, KvKind, LaunchKind, Plan, ValidatedPlan,
};
use crate::step::{BucketInputs, PageTable};

/// A weight in host memory (floats as f32; the FR-Spec id map as i64).
#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// The K/V pool: per layer, `[pages, page_size, kv_heads, head_dim]` as f32.
#[derive(Clone, Debug, PartialEq)]
pub struct KvPool {
    pub pages: usize,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// Outputs for the bucket's rows (the caller slices the real requests).
#[derive(Clone, Debug, PartialEq)]
pub struct BucketOutputs {
    pub hidden_out: Vec<f32>,
    pub topk_probs: Vec<f32>,
    pub topk_ids: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error("launch {launch} ({op}): {message}")]
    Launch { launch: usize, op: String, message: String },
    #[error("weights: {0}")]
    Weights(String),
}

pub struct CpuExecutor<'p> {
    plan: &'p Plan,
    weights: Vec<WeightData>,
}

struct Arena {
    cells: Vec<f64>,
}

struct Ctx<'a> {
    plan: &'a Plan,
    bucket: &'a BucketPlan,
    weights: &'a [WeightData],
    arena: &'a mut Arena,
    kv: &'a mut KvPool,
    table: &'a PageTable,
}

impl<'p> CpuExecutor<'p> {
    /// `weights[i]` is the plan's weight `i`, already packed (see `contract::pack_weights`).
    pub fn new(plan: &'p ValidatedPlan, weights: Vec<WeightData>) -> Result<Self, ExecError> {
        if weights.len() != plan.weights.len() {
            return Err(ExecError::Weights(format!(
                "{} weights given, the plan has {}",
                weights.len(),
                plan.weights.len()
            )));
        }
        for (w, d) in plan.weights.iter().zip(&weights) {
            let n: u64 = w.shape.iter().product();
            let len = match d {
                WeightData::F32(v) => v.len(),
                WeightData::I64(v) => v.len(),
            };
            if len as u64 != n {
                return Err(ExecError::Weights(format!(
                    "{}: {len} elements, expected {:?}",
                    w.name, w.shape
                )));
            }
        }
        Ok(CpuExecutor { plan, weights })
    }

    /// Runs one bucket on padded inputs, updating `kv` in place.
    pub fn run(
        &self,
        bucket: &BucketPlan,
        inputs: &BucketInputs,
        table: &PageTable,
        kv: &mut KvPool,
    ) -> Result<BucketOutputs, ExecError> {
        // Poison: every cell starts NaN, so a read of anything no launch wrote shows up.
        let mut arena = Arena {
            cells: vec![f64::NAN; (bucket.arena_bytes as usize).div_ceil(2)],
        };
        let mut ctx = Ctx {
            plan: self.plan,
            bucket,
            weights: &self.weights,
            arena: &mut arena,
            kv,
            table,
        };
        ctx.store_input("input_ids", inputs.input_ids.iter().map(|&x| x as f64));
        ctx.store_input("hidden_states", inputs.hidden_states.iter().map(|&x| x as f64));
        ctx.store_input("prefix_lens", inputs.prefix_lens.iter().map(|&x| x as f64));
        ctx.store_input("accept_lens", inputs.accept_lens.iter().map(|&x| x as f64));
        ctx.store_input("req_slots", inputs.req_slots.iter().map(|&x| x as f64));
        for (li, launch) in bucket.launches.iter().enumerate() {
            let err = |message: String| ExecError::Launch {
                launch: li,
                op: launch.op.clone(),
                message,
            };
            match &launch.kind {
                LaunchKind::Gemm(g) => ctx.gemm(g),
                LaunchKind::Kernel { kernel, grid, args, .. } => {
                    let k = &self.plan.kernels[*kernel as usize];
                    ctx.kernel(k, *grid, args).map_err(err)?
                }
            }
        }
        Ok(BucketOutputs {
            hidden_out: ctx.load_named("hidden_out").into_iter().map(|x| x as f32).collect(),
            topk_probs: ctx.load_named("topk_probs").into_iter().map(|x| x as f32).collect(),
            topk_ids: ctx.load_named("topk_ids").into_iter().map(|x| x as i64).collect(),
        })
    }
}

fn c_u32(k: &KernelDesc, name: &str) -> Result<usize, String> {
    match k.constants.iter().find(|(n, _)| n == name) {
        Some((_, ConstValue::U32(v))) => Ok(*v as usize),
        Some((_, ConstValue::Bool(b))) => Ok(*b as usize),
        _ => Err(format!("kernel {} has no constant {name}", k.name)),
    }
}

/// (HEADS, KV_HEADS, HEAD_DIM, N) of a kernel that walks the paged cache.
fn heads(k: &KernelDesc) -> Result<(usize, usize, usize, usize), String> {
    Ok((
        c_u32(k, "HEADS")?,
        c_u32(k, "KV_HEADS")?,
        c_u32(k, "HEAD_DIM")?,
        c_u32(k, "N")?,
    ))
}

fn c_f32(k: &KernelDesc, name: &str) -> Result<f32, String> {
    match k.constants.iter().find(|(n, _)| n == name) {
        Some((_, ConstValue::F32(v))) => Ok(*v),
        _ => Err(format!("kernel {} has no float constant {name}", k.name)),
    }
}

fn c_table<'k>(k: &'k KernelDesc, name: &str) -> Result<&'k [f32], String> {
    match k.constants.iter().find(|(n, _)| n == name) {
        Some((_, ConstValue::F32Array(v))) => Ok(v),
        _ => Err(format!("kernel {} has no table {name}", k.name)),
    }
}

/// A resolved pointer argument.
#[derive(Clone, Copy)]
enum Ptr {
    Buf(usize),
    Weight(usize),
    Kv(usize, KvKind),
    Table,
    Null,
}

impl Ctx<'_> {
    fn cell(&self, buf: usize, elem: usize) -> usize {
        let b = &self.bucket.buffers[buf];
        (b.offset as usize + elem * b.dtype.size() as usize) / 2
    }
    fn ld(&self, buf: usize, elem: usize) -> f64 {
        self.arena.cells[self.cell(buf, elem)]
    }
    fn st(&mut self, buf: usize, elem: usize, v: f64) {
        let c = self.cell(buf, elem);
        self.arena.cells[c] = v;
    }
    fn store_input(&mut self, name: &str, values: impl Iterator<Item = f64>) {
        if let Some((id, _)) = self.bucket.buffer(name) {
            for (e, v) in values.enumerate() {
                self.st(id as usize, e, v);
            }
        }
    }
    fn load_named(&self, name: &str) -> Vec<f64> {
        match self.bucket.buffer(name) {
            Some((id, b)) => (0..b.shape.iter().product::<u64>() as usize)
                .map(|e| self.ld(id as usize, e))
                .collect(),
            None => Vec::new(),
        }
    }
    fn wf(&self, w: usize, i: usize) -> f64 {
        match &self.weights[w] {
            WeightData::F32(v) => v[i] as f64,
            WeightData::I64(v) => v[i] as f64,
        }
    }

    fn gemm(&mut self, g: &GemmDesc) {
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (a, c, w) = (g.a as usize, g.c as usize, g.w as usize);
        let WeightData::F32(wv) = &self.weights[w] else { return };
        let a_rows: Vec<f64> = (0..m * k).map(|i| self.ld(a, i)).collect();
        // Output columns split across threads: the big heads' GEMMs would otherwise make
        // the oracle the slowest part of a GPU check.
        let threads = std::thread::available_parallelism()
            .map_or(1, |t| t.get())
            .min(n.div_ceil(64))
            .max(1);
        let per = n.div_ceil(threads);
        let mut out = vec![0f64; m * n];
        let parts: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (a_rows, wv) = (&a_rows, &wv);
                    s.spawn(move || {
                        let (lo, hi) = (t * per, ((t + 1) * per).min(n));
                        let mut part = vec![0f64; m * hi.saturating_sub(lo)];
                        for r in 0..m {
                            let ar = &a_rows[r * k..(r + 1) * k];
                            for col in lo..hi {
                                let wr = &wv[col * k..(col + 1) * k];
                                part[r * (hi - lo) + col - lo] = ar.iter().zip(wr).map(|(x, y)| x * *y as f64).sum();
                            }
                        }
                        part
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
        });
        for (t, part) in parts.iter().enumerate() {
            let (lo, hi) = (t * per, ((t + 1) * per).min(n));
            for r in 0..m {
                for col in lo..hi {
                    out[r * n + col] = part.get(r * (hi - lo) + col - lo).copied().unwrap_or(f64::NAN);
                }
            }
        }
        for (i, v) in out.into_iter().enumerate() {
            let prev = if g.accumulate { self.ld(c, i) } else { 0.0 };
            // fp32 result, as cuBLAS writes it before the output cast.
            self.st(c, i, (prev + v) as f32 as f64);
        }
    }

    fn kernel(&mut self, k: &KernelDesc, grid: [u32; 3], args: &[KernelArg]) -> Result<(), String> {
        let ptr = |name: &str| -> Result<Ptr, String> {
            match args.iter().find(|a| a.name == name).map(|a| &a.value) {
                Some(ArgValue::Buffer { id, .. }) => Ok(Ptr::Buf(*id as usize)),
                Some(ArgValue::Weight { id }) => Ok(Ptr::Weight(*id as usize)),
                Some(ArgValue::KvCache { kind, layer, access }) => {
                    let _ = access == &Access::Read;
                    Ok(Ptr::Kv(*layer as usize, *kind))
                }
                Some(ArgValue::Null) => Ok(Ptr::Null),
                Some(ArgValue::PageTable) => Ok(Ptr::Table),
                _ => Err(format!("argument {name} is missing or not a pointer")),
            }
        };
        let scalar = |name: &str| -> Result<usize, String> {
            match args.iter().find(|a| a.name == name).map(|a| &a.value) {
                Some(ArgValue::U32(v)) => Ok(*v as usize),
                _ => Err(format!("argument {name} is missing or not a u32")),
            }
        };
        let buf = |p: Ptr, name: &str| match p {
            Ptr::Buf(b) => Ok(b),
            _ => Err(format!("argument {name} must be a buffer")),
        };
        let weight = |p: Ptr, name: &str| match p {
            Ptr::Weight(w) => Ok(w),
            _ => Err(format!("argument {name} must be a weight")),
        };
        match k.entry.as_str() {
            "embed_concat" => {
                let (h, vocab) = (c_u32(k, "HIDDEN")?, c_u32(k, "VOCAB")? as i64);
                let (ids, table, hid, out) = (
                    buf(ptr("ids")?, "ids")?,
                    weight(ptr("table")?, "table")?,
                    buf(ptr("hidden")?, "hidden")?,
                    buf(ptr("out")?, "out")?,
                );
                let bias = match (ptr("bias")?, ptr("bias_out")?) {
                    (Ptr::Weight(w), Ptr::Buf(o)) => Some((w, o)),
                    (Ptr::Null, Ptr::Null) => None,
                    _ => return Err("bias and bias_out must both be set or both null".into()),
                };
                for r in 0..scalar("rows")? {
                    if let Some((w, o)) = bias {
                        for c in 0..h {
                            let b = self.wf(w, c);
                            self.st(o, r * h + c, b);
                        }
                    }
                    let id = self.ld(ids, r) as i64;
                    let id = if (0..vocab).contains(&id) { id as usize } else { 0 };
                    for c in 0..h {
                        let e = self.wf(table, id * h + c);
                        self.st(out, r * 2 * h + c, e);
                        let x = self.ld(hid, r * h + c);
                        self.st(out, r * 2 * h + h + c, x);
                    }
                }
            }
            "rmsnorm" => {
                let (h, eps) = (c_u32(k, "HIDDEN")?, c_f32(k, "EPS")? as f64);
                let (x, w, out) = (
                    buf(ptr("x")?, "x")?,
                    weight(ptr("weight")?, "weight")?,
                    buf(ptr("out")?, "out")?,
                );
                for r in 0..scalar("rows")? {
                    let row: Vec<f64> = (0..h).map(|c| self.ld(x, r * h + c)).collect();
                    let ms = row.iter().map(|v| v * v).sum::<f64>() / h as f64;
                    let inv = 1.0 / (ms + eps).sqrt();
                    for (c, v) in row.iter().enumerate() {
                        let y = v * inv * self.wf(w, c);
                        self.st(out, r * h + c, y);
                    }
                }
            }
            "rope_append" => self.rope_append(k, &ptr, &scalar)?,
            "attn_partial" => self.attn_partial(k, grid, &ptr, &scalar)?,
            "attn_merge" => {
                let (heads, d) = (c_u32(k, "HEADS")?, c_u32(k, "HEAD_DIM")?);
                let (po, pl, out) = (
                    buf(ptr("part_o")?, "part_o")?,
                    buf(ptr("part_lse")?, "part_lse")?,
                    buf(ptr("out")?, "out")?,
                );
                let (rows, splits) = (scalar("rows")?, scalar("splits")?);
                for r in 0..rows {
                    for hh in 0..heads {
                        let lse: Vec<f64> = (0..splits).map(|s| self.ld(pl, (s * rows + r) * heads + hh)).collect();
                        let m = lse.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let w: Vec<f64> = lse
                            .iter()
                            .map(|&l| if l == f64::NEG_INFINITY { 0.0 } else { (l - m).exp() })
                            .collect();
                        let total: f64 = w.iter().sum();
                        for dd in 0..d {
                            let acc: f64 = (0..splits)
                                .map(|s| w[s] * self.ld(po, ((s * rows + r) * heads + hh) * d + dd))
                                .sum();
                            self.st(out, r * heads * d + hh * d + dd, acc / total);
                        }
                    }
                }
            }
            "silu_mul" => {
                let inter = c_u32(k, "INTER")?;
                let (gu, out) = (buf(ptr("gate_up")?, "gate_up")?, buf(ptr("out")?, "out")?);
                for r in 0..scalar("rows")? {
                    for c in 0..inter {
                        let g = self.ld(gu, r * 2 * inter + c);
                        let u = self.ld(gu, r * 2 * inter + inter + c);
                        self.st(out, r * inter + c, g / (1.0 + (-g).exp()) * u);
                    }
                }
            }
            "select_rows" => {
                let (h, n) = (c_u32(k, "HIDDEN")?, c_u32(k, "N")?);
                let (x, acc, out) = (
                    buf(ptr("x")?, "x")?,
                    buf(ptr("accept_lens")?, "accept_lens")?,
                    buf(ptr("out")?, "out")?,
                );
                for i in 0..scalar("batch")? {
                    let a = (self.ld(acc, i) as i64).clamp(1, n as i64) as usize;
                    for c in 0..h {
                        let v = self.ld(x, (i * n + a - 1) * h + c);
                        self.st(out, i * h + c, v);
                    }
                }
            }
            "softmax_topk" => {
                let (cols, topk, hot) = (c_u32(k, "COLS")?, c_u32(k, "TOPK")?, c_u32(k, "HOT_MAP")? == 1);
                let (logits, probs, ids) = (
                    buf(ptr("logits")?, "logits")?,
                    buf(ptr("probs")?, "probs")?,
                    buf(ptr("ids")?, "ids")?,
                );
                let map = ptr("hot_ids")?;
                for i in 0..scalar("batch")? {
                    let row: Vec<f64> = (0..cols).map(|c| self.ld(logits, i * cols + c)).collect();
                    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
                    let mut order: Vec<usize> = (0..cols).collect();
                    // Descending by logit; ties to the lower column (a stable sort keeps them).
                    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                    for (slot, &c) in order.iter().take(topk).enumerate() {
                        self.st(probs, i * topk + slot, ((row[c] - m).exp() / s) as f32 as f64);
                        let id = match (hot, map) {
                            (true, Ptr::Weight(w)) => self.wf(w, c),
                            _ => c as f64,
                        };
                        self.st(ids, i * topk + slot, id);
                    }
                }
            }
            "topk_partial" => {
                let (cols, topk) = (c_u32(k, "COLS")?, c_u32(k, "TOPK")?);
                let (logits, part) = (buf(ptr("logits")?, "logits")?, buf(ptr("part")?, "part")?);
                let chunks = scalar("chunks")?;
                let rec = 2 + 2 * topk;
                // Chunk ch: columns [ch·W, min(cols, (ch+1)·W)), W = ceil(cols/chunks)
                // rounded up to a multiple of 4 (sample.cu's contract).
                let width = cols.div_ceil(chunks.max(1)).div_ceil(4) * 4;
                for i in 0..scalar("batch")? {
                    for ch in 0..chunks {
                        let (c0, c1) = ((ch * width).min(cols), ((ch + 1) * width).min(cols));
                        let vals: Vec<f64> = (c0..c1).map(|c| self.ld(logits, i * cols + c)).collect();
                        let m = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let sum: f64 = if m == f64::NEG_INFINITY {
                            0.0
                        } else {
                            vals.iter().map(|x| (x - m).exp()).sum()
                        };
                        let mut order: Vec<usize> = (0..vals.len()).collect();
                        order.sort_by(|&a, &b| vals[b].total_cmp(&vals[a])); // stable: ties to lower column
                        let base = (i * chunks + ch) * rec;
                        self.st(part, base, m as f32 as f64);
                        self.st(part, base + 1, sum as f32 as f64);
                        for slot in 0..topk {
                            let (v, c) = match order.get(slot) {
                                Some(&j) => (vals[j], (c0 + j) as f64),
                                None => (f64::NEG_INFINITY, -1.0),
                            };
                            self.st(part, base + 2 + slot, v);
                            self.st(part, base + 2 + topk + slot, c);
                        }
                    }
                }
            }
            "topk_merge" => {
                let (topk, hot) = (c_u32(k, "TOPK")?, c_u32(k, "HOT_MAP")? == 1);
                let (part, probs, ids) = (
                    buf(ptr("part")?, "part")?,
                    buf(ptr("probs")?, "probs")?,
                    buf(ptr("ids")?, "ids")?,
                );
                let map = ptr("hot_ids")?;
                let chunks = scalar("chunks")?;
                let rec = 2 + 2 * topk;
                for i in 0..scalar("batch")? {
                    let base = |ch: usize| (i * chunks + ch) * rec;
                    let m = (0..chunks)
                        .map(|ch| self.ld(part, base(ch)))
                        .fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = (0..chunks)
                        .map(|ch| (self.ld(part, base(ch)), self.ld(part, base(ch) + 1)))
                        .filter(|&(mc, _)| mc != f64::NEG_INFINITY)
                        .map(|(mc, sc)| sc * (mc - m).exp())
                        .sum();
                    // Every chunk's candidates with a column, best first (ties: lower column).
                    let mut cand: Vec<(f64, f64)> = (0..chunks)
                        .flat_map(|ch| (0..topk).map(move |s| (ch, s)))
                        .map(|(ch, s)| (self.ld(part, base(ch) + 2 + s), self.ld(part, base(ch) + 2 + topk + s)))
                        .filter(|&(_, c)| c >= 0.0)
                        .collect();
                    cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.total_cmp(&b.1)));
                    for slot in 0..topk {
                        let (p, id) = match cand.get(slot) {
                            Some(&(v, c)) if sum > 0.0 => {
                                let id = match (hot, map) {
                                    (true, Ptr::Weight(w)) => self.wf(w, c as usize),
                                    _ => c,
                                };
                                (((v - m).exp() / sum) as f32 as f64, id)
                            }
                            _ => (0.0, -1.0),
                        };
                        self.st(probs, i * topk + slot, p);
                        self.st(ids, i * topk + slot, id);
                    }
                }
            }
            other => return Err(format!("no CPU implementation of kernel entry {other}")),
        }
        Ok(())
    }

    /// Pool page of column `col` of request `i`'s row, through its slot.
    fn page(&self, slots: usize, i: usize, col: usize) -> Result<usize, String> {
        let slot = self.ld(slots, i) as i64;
        if slot < 0 || slot as usize >= self.table.rows || col >= self.table.cols {
            return Err(format!("request {i}: slot {slot} column {col} outside the page table"));
        }
        let page = self.table.data[slot as usize * self.table.cols + col];
        if page < 0 || page as usize >= self.kv.pages {
            return Err(format!(
                "request {i}: page {page} outside the pool of {}",
                self.kv.pages
            ));
        }
        Ok(page as usize)
    }

    fn kv_index(&self, page: usize, slot: usize, head: usize, d: usize) -> usize {
        let m = &self.plan.model;
        ((page * self.plan.capture.page_size as usize + slot) * m.kv_heads as usize + head) * m.head_dim as usize + d
    }

    fn rope_append(
        &mut self,
        k: &KernelDesc,
        ptr: &dyn Fn(&str) -> Result<Ptr, String>,
        scalar: &dyn Fn(&str) -> Result<usize, String>,
    ) -> Result<(), String> {
        let (hq, hkv, d, n) = heads(k)?;
        let (ps, max_pages) = (c_u32(k, "PAGE_SIZE")?, c_u32(k, "MAX_PAGES")?);
        let inv_freq = c_table(k, "INV_FREQ")?.to_vec();
        let (Ptr::Buf(qkv), Ptr::Buf(prefix), Ptr::Buf(slots), Ptr::Table) =
            (ptr("qkv")?, ptr("prefix_lens")?, ptr("req_slots")?, ptr("page_table")?)
        else {
            return Err("qkv, prefix_lens and req_slots must be buffers, page_table the page table".into());
        };
        let (Ptr::Kv(layer, KvKind::K), Ptr::Kv(vlayer, KvKind::V)) = (ptr("k_cache")?, ptr("v_cache")?) else {
            return Err("k_cache and v_cache must be the K and V pools".into());
        };
        let stride = (hq + 2 * hkv) * d;
        let half = d / 2;
        for r in 0..scalar("rows")? {
            let (i, j) = (r / n, r % n);
            let pos = self.ld(prefix, i) as i64 + j as i64;
            let rotate = |x: &[f64]| -> Vec<f64> {
                let mut y = vec![0.0; d];
                for t in 0..half {
                    // f32 angle, as Hugging Face computes freqs in fp32.
                    let angle = (pos as f32 * inv_freq[t]) as f64;
                    let (s, c) = angle.sin_cos();
                    y[t] = x[t] * c - x[t + half] * s;
                    y[t + half] = x[t + half] * c + x[t] * s;
                }
                y
            };
            for h in 0..hq {
                let x: Vec<f64> = (0..d).map(|t| self.ld(qkv, r * stride + h * d + t)).collect();
                for (t, v) in rotate(&x).into_iter().enumerate() {
                    self.st(qkv, r * stride + h * d + t, v);
                }
            }
            if pos < 0 || pos as usize / ps >= max_pages {
                continue;
            }
            let pos = pos as usize;
            let page = self.page(slots, i, pos / ps)?;
            if page >= self.kv.pages {
                return Err(format!("row {r}: page {page} outside the pool of {}", self.kv.pages));
            }
            for h in 0..hkv {
                let kx: Vec<f64> = (0..d).map(|t| self.ld(qkv, r * stride + (hq + h) * d + t)).collect();
                for (t, v) in rotate(&kx).into_iter().enumerate() {
                    let at = self.kv_index(page, pos % ps, h, t);
                    self.kv.k[layer][at] = v as f32;
                }
                for t in 0..d {
                    let v = self.ld(qkv, r * stride + (hq + hkv + h) * d + t);
                    let at = self.kv_index(page, pos % ps, h, t);
                    self.kv.v[vlayer][at] = v as f32;
                }
            }
        }
        Ok(())
    }

    fn attn_partial(
        &mut self,
        k: &KernelDesc,
        grid: [u32; 3],
        ptr: &dyn Fn(&str) -> Result<Ptr, String>,
        scalar: &dyn Fn(&str) -> Result<usize, String>,
    ) -> Result<(), String> {
        let (hq, hkv, d, n) = heads(k)?;
        let (ps, window) = (c_u32(k, "PAGE_SIZE")?, c_u32(k, "WINDOW")?);
        let (scale, tile) = (c_f32(k, "SCALE")? as f64, c_u32(k, "KV_TILE")?);
        let (Ptr::Buf(q), Ptr::Buf(slots), Ptr::Table, Ptr::Buf(prefix)) =
            (ptr("q")?, ptr("req_slots")?, ptr("page_table")?, ptr("prefix_lens")?)
        else {
            return Err("q, req_slots and prefix_lens must be buffers, page_table the page table".into());
        };
        let Ptr::Kv(layer, _) = ptr("k_cache")? else {
            return Err("k_cache must be the K pool".into());
        };
        let (batch, splits, q_stride) = (scalar("batch")?, scalar("splits")?, scalar("q_stride")?);
        if grid[2] as usize != splits {
            return Err(format!("grid.z {} != splits {splits}", grid[2]));
        }
        let rows = batch * n;
        let g = hq / hkv;
        for i in 0..batch {
            let l = self.ld(prefix, i) as usize;
            let kv_len = l + n;
            let kv_start = if window > 0 { (l + 1).saturating_sub(window) } else { 0 };
            let total = kv_len - kv_start;
            let chunk = total.div_ceil(splits).div_ceil(tile) * tile;
            for s in 0..splits {
                let lo = (kv_start + s * chunk).min(kv_len);
                let hi = (kv_start + (s + 1) * chunk).min(kv_len);
                for kvh in 0..hkv {
                    for j in 0..n {
                        let r = i * n + j;
                        for hh in 0..g {
                            let head = kvh * g + hh;
                            let qv: Vec<f64> = (0..d).map(|t| self.ld(q, r * q_stride + head * d + t)).collect();
                            let first = if window > 0 {
                                (l + j + 1).saturating_sub(window)
                            } else {
                                0
                            };
                            let visible: Vec<usize> = (lo.max(first)..hi.min(l + j + 1)).collect();
                            let mut scores = Vec::with_capacity(visible.len());
                            for &p in &visible {
                                let page = self.page(slots, i, p / ps)?;
                                let dot: f64 = (0..d)
                                    .map(|t| qv[t] * self.kv.k[layer][self.kv_index(page, p % ps, kvh, t)] as f64)
                                    .sum();
                                scores.push((dot * scale, page, p % ps));
                            }
                            let m = scores.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                            let den: f64 = scores.iter().map(|x| (x.0 - m).exp()).sum();
                            let mut o = vec![0.0f64; d];
                            for &(sc, page, slot) in &scores {
                                let w = (sc - m).exp() / den;
                                for (t, ot) in o.iter_mut().enumerate() {
                                    *ot += w * self.kv.v[layer][self.kv_index(page, slot, kvh, t)] as f64;
                                }
                            }
                            let lse = if scores.is_empty() {
                                f64::NEG_INFINITY
                            } else {
                                m + den.ln()
                            };
                            if splits == 1 {
                                let Ptr::Buf(out) = ptr("out")? else {
                                    return Err("out must be a buffer".into());
                                };
                                for (t, v) in o.into_iter().enumerate() {
                                    self.st(out, r * hq * d + head * d + t, v);
                                }
                            } else {
                                let (Ptr::Buf(po), Ptr::Buf(pl)) = (ptr("part_o")?, ptr("part_lse")?) else {
                                    return Err("part_o and part_lse must be buffers when splits > 1".into());
                                };
                                for (t, v) in o.into_iter().enumerate() {
                                    self.st(po, ((s * rows + r) * hq + head) * d + t, v);
                                }
                                self.st(pl, (s * rows + r) * hq + head, lse);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
