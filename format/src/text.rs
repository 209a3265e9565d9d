//! The canonical text form: one fact per line, in a stable order.
//!
//! Every line is `KEY VALUE`, where KEY identifies the fact (it is unique in a plan) and
//! VALUE is what may change. Snapshots capture this text and `specplan diff` compares
//! plans fact by fact, so a compiler change shows up as a small, reviewable set of lines.
//! Binary payloads (CUBIN, PTX) appear only as sizes and hashes.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};
use specplan_kernels::abi::{Access, FieldKind};

use crate::types::*;
use crate::FORMAT_VERSION;

/// One line of the text form. Facts of a phase (its header and its buckets) carry the
/// phase: their keys are unique within it, and `diff` names it. The text form groups them
/// under the phase's `phase <kind>` header line instead of repeating it on every line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fact {
    pub phase: Option<PhaseKind>,
    pub key: String,
    pub value: String,
}

impl std::fmt::Display for Fact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.key, self.value)
    }
}

/// The plan as text (the facts joined by newlines).
pub fn to_text(plan: &Plan) -> String {
    let mut s = String::new();
    for f in facts(plan) {
        let _ = writeln!(s, "{f}");
    }
    s
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    match v {
        Some(x) => x.to_string(),
        None => "none".into(),
    }
}

fn dims(shape: &[u64]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(","))
}

fn rope(r: &RopeScaling) -> String {
    match r {
        RopeScaling::None => "none".into(),
        RopeScaling::Linear { factor } => format!("linear(factor={factor})"),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => format!(
            "llama3(factor={factor},low_freq_factor={low_freq_factor},high_freq_factor={high_freq_factor},original_max_position_embeddings={original_max_position_embeddings})"
        ),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => format!(
            "yarn(factor={factor},original_max_position_embeddings={original_max_position_embeddings},beta_fast={beta_fast},beta_slow={beta_slow},mscale={},mscale_all_dim={},truncate={truncate})",
            opt(mscale),
            opt(mscale_all_dim)
        ),
        RopeScaling::LongRope {
            short_factor,
            original_max_position_embeddings,
            short_mscale,
        } => format!(
            "longrope(short_factor={},original_max_position_embeddings={original_max_position_embeddings},short_mscale={})",
            const_value(&ConstValue::F32Array(short_factor.clone())),
            opt(short_mscale)
        ),
    }
}

fn const_value(v: &ConstValue) -> String {
    match v {
        ConstValue::U32(x) => x.to_string(),
        ConstValue::F32(x) => format!("{x:?}f"),
        ConstValue::Bool(x) => x.to_string(),
        ConstValue::Type(t) => escape(t),
        ConstValue::F32Array(xs) => {
            let mut h = Sha256::new();
            for x in xs {
                h.update(x.to_le_bytes());
            }
            format!("f32[{}]#{}", xs.len(), &hex(&h.finalize())[..12])
        }
    }
}

use specplan_kernels::source::hex;

/// A plan string as one safe line: printable characters as they are, anything else (a
/// newline, a control character, a quote or backslash) escaped, so no name can forge a
/// line of `show` or `diff` or break `dot`.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

fn access_text(a: Access) -> &'static str {
    match a {
        Access::Read => "r",
        Access::Write => "w",
        Access::ReadWrite => "rw",
        Access::WriteRead => "wr",
    }
}

fn role(r: BufferRole) -> &'static str {
    match r {
        BufferRole::Input => "input",
        BufferRole::Output => "output",
        BufferRole::Scratch => "scratch",
    }
}

/// Human form of a replay verdict.
pub fn replay_text(r: &Replay) -> String {
    match r {
        Replay::Graph => "graph".into(),
        Replay::Eager(ReplayBlocker::PoolTooSmall { need_pages, pool_pages }) => {
            format!("eager(pool too small: a full bucket needs {need_pages} pages, the pool has {pool_pages})")
        }
        Replay::Eager(ReplayBlocker::IndexOverflow { what, value, limit }) => {
            format!("eager({what} = {value} overflows the 32-bit index limit {limit})")
        }
        Replay::Eager(ReplayBlocker::HostSync { op }) => format!("eager({op} needs a host synchronization)"),
    }
}

/// All facts of a plan in canonical order.
pub fn facts(p: &Plan) -> Vec<Fact> {
    let mut out = Vec::new();
    let mut phase = None;
    let mut fact = |key: String, value: String| out.push(Fact { phase, key, value });
    let m = &p.model;
    let c = &p.capture;
    fact(
        "plan".into(),
        format!(
            "name={} format={FORMAT_VERSION} compiler={}",
            escape(&p.name),
            escape(&p.compiler)
        ),
    );
    fact(
        "target".into(),
        format!("sm_{} nvrtc={}", p.target.sm, escape(&opt(&p.target.nvrtc))),
    );
    fact(
        "model".into(),
        format!(
            "head={} hidden={} intermediate={} heads={} kv_heads={} head_dim={} layers={} vocab={} draft_vocab={} target_hidden={} rms_norm_eps={:?} rope_theta={:?} rope_scaling={} max_position_embeddings={} fc_bias={}",
            m.head.name(), m.hidden, m.intermediate, m.heads, m.kv_heads, m.head_dim, m.layers, m.vocab,
            opt(&m.draft_vocab), m.target_hidden, m.rms_norm_eps,
            m.rope_theta, rope(&m.rope_scaling), m.max_position_embeddings, m.fc_bias
        ),
    );
    fact(
        "spec".into(),
        format!(
            "topk={} num_steps={} num_draft_tokens={}",
            p.spec.topk, p.spec.num_steps, p.spec.num_draft_tokens
        ),
    );
    fact(
        "capture".into(),
        format!(
            "page_size={} max_context_len={} pages_per_request={} kv_pool_pages={} scratch_page={} max_requests={} dtype={} hot_vocab_size={} outputs={}",
            c.page_size, c.max_context_len, c.max_pages_per_request, c.kv_pool_pages, c.scratch_page, c.max_requests, c.dtype.name(),
            opt(&c.hot_vocab_size), c.outputs.name()
        ) + if c.decode_verify { " decode_verify=true" } else { "" },
    );
    if c.tp.is_sharded() {
        fact(
            "tensor_parallel".into(),
            format!(
                "size={} rank={} embedding={} (model heads, kv_heads, intermediate and the lm_head rows are this rank's share)",
                c.tp.size,
                c.tp.rank,
                if c.tp.vocab_embedding { "vocab" } else { "replicated" }
            ),
        );
    }
    fact(
        "memory".into(),
        format!(
            "weights={} kv_pool={} kv_page={} arena_max={}",
            p.weight_bytes,
            p.kv_pool_bytes(),
            p.kv_page_bytes(),
            p.arena_bytes()
        ),
    );
    fact(
        "rope inv_freq".into(),
        const_value(&ConstValue::F32Array(p.rope_inv_freq.clone())),
    );
    for (i, l) in p.layers.iter().enumerate() {
        let w = match l.window {
            Some(w) => format!("window={w} (row at position p sees keys in [max(0, p-{}), p])", w - 1),
            None => "window=none (full causal)".into(),
        };
        fact(format!("layer {i}"), w);
    }
    for (i, w) in p.weights.iter().enumerate() {
        let packing = match w.packing {
            Packing::Single => "",
            Packing::ConcatRows => " concat_rows",
            Packing::GatherRows => " gather_rows",
            Packing::LeadingRows => " leading_rows",
        };
        let sources: Vec<String> = w.sources.iter().map(|s| escape(s)).collect();
        let shard = if w.shard.is_empty() {
            String::new()
        } else {
            let each: Vec<String> = w
                .shard
                .iter()
                .map(|sh| {
                    format!(
                        "{}/{}:{}",
                        sh.index,
                        sh.parts,
                        if sh.axis == 0 { "rows" } else { "cols" }
                    )
                })
                .collect();
            format!(" shard={}", each.join(","))
        };
        fact(
            format!("weight w{i}"),
            format!(
                "{} {} {} @{:#x} +{}{packing} from {}{shard}",
                escape(&w.name),
                w.dtype.name(),
                dims(&w.shape),
                w.offset,
                w.bytes,
                sources.join(",")
            ),
        );
    }
    for (i, f) in p.fusions.iter().enumerate() {
        fact(
            format!("fusion {i}"),
            format!(
                "{}: {} -> {} launches_saved={} bytes_saved_per_request={}",
                escape(&f.rule),
                f.fused.iter().map(|x| escape(x)).collect::<Vec<_>>().join(" + "),
                escape(&f.into),
                f.launches_saved,
                f.bytes_saved_per_request
            ),
        );
    }
    for (i, k) in p.kernels.iter().enumerate() {
        fact(
            format!("kernel k{i}"),
            format!(
                "{} template={} entry={} source=#{}",
                escape(&k.name),
                k.entry.template().file(),
                k.entry.name(),
                escape(short(&k.source_hash))
            ),
        );
        for (name, v) in &k.constants {
            fact(format!("kernel k{i} const {}", escape(name)), const_value(v));
        }
        let bin = match &k.binary {
            Some(b) => format!(
                "{} cubin={}B#{} ptx={}B",
                escape(&b.arch),
                b.cubin.len(),
                &hex(&Sha256::digest(&b.cubin))[..12],
                b.ptx.len()
            ),
            None => "none".into(),
        };
        fact(format!("kernel k{i} binary"), bin);
    }
    for ph in &p.phases {
        phase = Some(ph.kind);
        let mut fact = |key: String, value: String| out.push(Fact { phase, key, value });
        let batches: Vec<String> = ph.buckets.iter().map(|b| b.batch.to_string()).collect();
        fact(
            format!("phase {}", ph.kind.label()),
            format!(
                "rows_per_request={} buckets={} signature={}",
                ph.rows_per_request,
                batches.join(","),
                crate::signature::describe(p, ph.kind).join(" ")
            ),
        );
        for b in &ph.buckets {
            bucket_facts(p, ph, b, &mut fact);
        }
    }
    out
}

/// The layers whose attention launches in bucket `b` run over the selected query rows (their
/// kernel's `SELECT_FROM` constant is not 0), named by the K pool they read.
fn selecting_layers(p: &Plan, b: &BucketPlan) -> Vec<u32> {
    let mut out = Vec::new();
    for l in &b.launches {
        let LaunchKind::Kernel { kernel, args, .. } = &l.kind else {
            continue;
        };
        let Some(k) = p.kernels.get(*kernel as usize) else {
            continue;
        };
        let selects = k
            .constants
            .iter()
            .any(|(c, v)| c == "SELECT_FROM" && !matches!(v, specplan_kernels::ConstValue::U32(0)));
        for a in args {
            if let (true, ArgValue::KvCache { layer, .. }) = (selects, a) {
                if !out.contains(layer) {
                    out.push(*layer);
                }
            }
        }
    }
    out
}

fn short(hash: &str) -> &str {
    let end = hash.char_indices().nth(12).map_or(hash.len(), |(i, _)| i);
    &hash[..end]
}

fn bucket_facts(p: &Plan, ph: &Phase, b: &BucketPlan, fact: &mut dyn FnMut(String, String)) {
    let tag = format!("bucket {}", b.batch);
    let n = ph.rows_per_request;
    fact(
        tag.clone(),
        format!(
            "rows={} arena={} attn_splits={}{}{} replay={}",
            b.rows,
            b.arena_bytes,
            b.attn_splits,
            if b.attn_cluster { " attn_cluster" } else { "" },
            if b.attn_last_cta { " attn_last_cta" } else { "" },
            replay_text(&b.replay)
        ),
    );
    let qo: Vec<String> = b.qo_indptr.iter().map(|x| x.to_string()).collect();
    fact(format!("{tag} qo_indptr"), qo.join(","));
    let selecting = selecting_layers(p, b);
    for (i, l) in p.layers.iter().enumerate() {
        let start = match l.window {
            Some(w) => format!("start[i][j]=max(0,prefix_len[i]+j-{})", w - 1),
            None => "start[i][j]=0".into(),
        };
        // A layer whose attention runs over the selected query rows: row j = A_i − 1 only.
        let rows = if selecting.contains(&(i as u32)) {
            " query j=accept_len[i]-1"
        } else {
            ""
        };
        fact(
            format!("{tag} kv layer {i}"),
            format!("kv_len[i]=prefix_len[i]+{n} {start} causal_end[i][j]=prefix_len[i]+j{rows}"),
        );
    }
    for b2 in &b.buffers {
        fact(
            format!("{tag} buffer %{}", escape(&b2.name)),
            format!(
                "{} {} @{:#x} +{} {}",
                b2.dtype.name(),
                dims(&b2.shape),
                b2.offset,
                b2.bytes,
                role(b2.role)
            ),
        );
    }
    let bname = |id: u32| {
        b.buffers
            .get(id as usize)
            .map_or_else(|| format!("?{id}"), |x| format!("%{}", escape(&x.name)))
    };
    let wname = |id: u32| {
        p.weights
            .get(id as usize)
            .map_or_else(|| format!("?w{id}"), |x| escape(&x.name))
    };
    for (li, l) in b.launches.iter().enumerate() {
        let v = match &l.kind {
            LaunchKind::Kernel {
                kernel,
                grid,
                block,
                smem,
                cluster,
                args,
            } => {
                let fields = p
                    .kernels
                    .get(*kernel as usize)
                    .map_or(&[][..], |k| k.entry.abi().fields);
                let args: Vec<String> = args
                    .iter()
                    .enumerate()
                    .map(|(ai, a)| {
                        let (name, access) = match fields.get(ai) {
                            Some(f) => (
                                f.name.to_string(),
                                match f.kind {
                                    FieldKind::Ptr(pf) => pf.access,
                                    FieldKind::U32 => Access::Read,
                                },
                            ),
                            None => (format!("?{ai}"), Access::Read),
                        };
                        let v = match a {
                            ArgValue::Buffer(id) => format!("{}:{}", bname(*id), access_text(access)),
                            ArgValue::Weight(id) => format!("{}:r", wname(*id)),
                            ArgValue::KvCache { layer, kind } => format!(
                                "{}_cache[{layer}]:{}",
                                if *kind == KvKind::K { "k" } else { "v" },
                                access_text(access)
                            ),
                            ArgValue::U32(x) => x.to_string(),
                            ArgValue::PageTable => "page_table:r".into(),
                            ArgValue::KvLayout => "kv_layout:r".into(),
                            ArgValue::Counters => "counters:rw".into(),
                            ArgValue::Null => "null".into(),
                        };
                        format!("{name}={v}")
                    })
                    .collect();
                let kname = p.kernels.get(*kernel as usize).map_or("?".into(), |k| escape(&k.name));
                format!(
                    "#{li} kernel k{kernel} {kname} grid=({},{},{}) block=({},{},{}) smem={smem}{} {}",
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    if *cluster > 1 {
                        format!(" cluster=(1,1,{cluster})")
                    } else {
                        String::new()
                    },
                    args.join(" ")
                )
            }
            LaunchKind::Gemm(g) => format!(
                "#{li} gemm m={} n={} k={}{} a={} w={} c={}{}{}",
                g.m,
                g.n,
                g.k,
                if g.lda != g.k {
                    format!(" lda={}", g.lda)
                } else {
                    String::new()
                },
                bname(g.a),
                wname(g.w),
                bname(g.c),
                if g.accumulate { " accumulate" } else { "" },
                g.rounded.map_or(String::new(), |r| format!(" rounded={}", bname(r)))
            ),
            LaunchKind::Collective(c) => format!(
                "#{li} {} {} count={} send={} recv={}",
                c.op.name(),
                c.dtype.name(),
                c.count,
                bname(c.send),
                bname(c.recv)
            ),
        };
        fact(format!("{tag} launch {}", escape(&l.op)), v);
    }
}
