//! Corrupted, truncated and inconsistent plans are rejected with a clear error before
//! anything uses them.

mod common;

use specplan_compiler::config::Overrides;
use specplan_format::{decode, encode, validate, ArgValue, LaunchKind, PlanError};

fn tiny_bytes() -> (Vec<u8>, specplan_format::Plan) {
    let plan = common::compile_preset("tiny", &Overrides::default()).into_inner();
    (encode(&plan).expect("encode"), plan)
}

#[test]
fn round_trip_is_exact() {
    let (bytes, plan) = tiny_bytes();
    assert_eq!(decode(&bytes).expect("decode").plan(), &plan);
}

#[test]
fn every_truncation_is_rejected() {
    let (bytes, _) = tiny_bytes();
    for len in (0..bytes.len()).step_by(97).chain([bytes.len() - 1]) {
        let err = decode(&bytes[..len]).expect_err("truncated plan accepted");
        assert!(matches!(err, PlanError::Truncated { .. }), "len {len}: {err}");
        assert!(err.to_string().contains("truncated"), "{err}");
    }
    // A byte too many is said as such, not as a truncation.
    let mut longer = bytes.clone();
    longer.push(0);
    let err = decode(&longer).expect_err("a plan with a trailing byte accepted");
    assert!(matches!(err, PlanError::Trailing { .. }), "{err}");
    assert!(err.to_string().contains("trailing bytes"), "{err}");
}

#[test]
fn flipped_bytes_are_rejected() {
    let (bytes, _) = tiny_bytes();
    for at in (56..bytes.len()).step_by(131) {
        let mut b = bytes.clone();
        b[at] ^= 0x5a;
        assert_eq!(
            decode(&b).expect_err("corrupted body accepted"),
            PlanError::Checksum,
            "byte {at}"
        );
    }
    let mut b = bytes.clone();
    b[0] = b'X';
    assert_eq!(decode(&b).expect_err("bad magic"), PlanError::BadMagic);
    let mut b = bytes.clone();
    let future = specplan_format::FORMAT_VERSION + 1;
    b[8] = future as u8;
    let e = decode(&b).expect_err("future version");
    assert!(
        e.to_string().contains(&format!("version {future} is not supported")),
        "{e}"
    );
    let mut b = bytes;
    b[30] ^= 1; // inside the stored checksum
    assert_eq!(decode(&b).expect_err("bad checksum"), PlanError::Checksum);
}

/// `base` changed by `m` is refused, and the error says `want` (`what` names the case).
fn check(base: &specplan_format::Plan, what: &str, want: &str, m: &dyn Fn(&mut specplan_format::Plan)) {
    let mut p = base.clone();
    m(&mut p);
    let e = match validate(p) {
        Ok(_) => panic!("{what}: accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains(want), "{what}: the error does not say {want:?}: {e}");
}

fn invalid(mutate: impl FnOnce(&mut specplan_format::Plan)) -> String {
    let (_, mut plan) = tiny_bytes();
    mutate(&mut plan);
    // Re-encoded with a correct checksum: only validation can catch these.
    let bytes = encode(&plan).expect("encode");
    match decode(&bytes) {
        Err(PlanError::Invalid(msgs)) => msgs.iter().map(|v| v.to_string()).collect::<Vec<_>>().join("\n"),
        other => panic!("expected a validation error, got {other:?}"),
    }
}

#[test]
fn inconsistent_plans_name_the_bad_field() {
    let mut out = String::new();
    let mut case = |name: &str, m: &dyn Fn(&mut specplan_format::Plan)| {
        out.push_str(&format!("## {name}\n{}\n", invalid(|p| m(p))));
    };
    case("buffer past the arena", &|p| {
        p.phases[0].buckets[1].buffers[0].offset = p.phases[0].buckets[1].arena_bytes
    });
    case("kernel index out of range", &|p| {
        if let Some(LaunchKind::Kernel { kernel, .. }) = p.phases[0].buckets[0]
            .launches
            .iter_mut()
            .map(|l| &mut l.kind)
            .find(|k| matches!(k, LaunchKind::Kernel { .. }))
        {
            *kernel = 99;
        }
    });
    case("buffer id out of range", &|p| {
        for l in &mut p.phases[0].buckets[0].launches {
            if let LaunchKind::Kernel { args, .. } = &mut l.kind {
                if let Some(a) = args.iter_mut().find(|a| matches!(a, ArgValue::Buffer(_))) {
                    *a = ArgValue::Buffer(500);
                    return;
                }
            }
        }
    });
    case("weight past the region", &|p| p.weights[2].offset = p.weight_bytes);
    case("qo layout not N rows per request", &|p| {
        p.phases[0].buckets[2].qo_indptr[1] = 3
    });
    case("aliasing live buffers", &|p| {
        let b = &mut p.phases[0].buckets[3];
        let off = b.buffer("hidden_states").map(|(_, x)| x.offset).unwrap_or(0);
        if let Some(x) = b.buffers.iter_mut().find(|x| x.name == "fc_in") {
            x.offset = off;
        }
    });
    case("spec rule broken", &|p| p.spec.num_draft_tokens = 40);
    case("buckets out of order", &|p| p.phases[0].buckets.swap(0, 1));
    case("rows per request not the phase's", &|p| {
        p.phases[0].rows_per_request = 3
    });
    case("no draft-extend phase", &|p| p.phases.clear());
    case("a phase twice", &|p| {
        let ph = p.phases[0].clone();
        p.phases.push(ph);
    });
    case("page size", &|p| p.capture.page_size = 3);
    // A theta the table was not computed from (the kernels and the CPU executor read the
    // table: both would rotate by the same wrong angles).
    case("rope_theta without its table", &|p| p.model.rope_theta *= 2.0);
    // One buffer moved past every other: a hole the runtime would allocate for nothing.
    case("arena hole", &|p| {
        let b = &mut p.phases[0].buckets[0];
        let end = b.arena_bytes.div_ceil(256) * 256 + (1 << 30);
        b.buffers[0].offset = end;
        b.arena_bytes = end + b.buffers[0].bytes.div_ceil(256) * 256;
    });
    // The runtime-launched entries: exactly one of each.
    case("admit missing, emit twice", &|p| {
        if let Some(k) = p.kernels.iter_mut().find(|k| k.entry == specplan_kernels::Entry::Admit) {
            k.entry = specplan_kernels::Entry::Emit;
        }
    });
    case("block too large", &|p| {
        if let Some(LaunchKind::Kernel { block, .. }) = p.phases[0].buckets[0]
            .launches
            .iter_mut()
            .map(|l| &mut l.kind)
            .find(|k| matches!(k, LaunchKind::Kernel { .. }))
        {
            *block = [2048, 1, 1];
        }
    });
    case("attention shared memory below its formula", &|p| {
        for l in &mut p.phases[0].buckets[0].launches {
            if let LaunchKind::Kernel { smem, .. } = &mut l.kind {
                if l.op.ends_with(specplan_format::Entry::AttnPartial.name()) || l.op.contains("attention") {
                    *smem = 1024;
                    return;
                }
            }
        }
    });
    case("top-K block not its thread count", &|p| {
        for l in &mut p.phases[0].buckets[0].launches {
            if let LaunchKind::Kernel { block, .. } = &mut l.kind {
                if l.op.contains("topk") {
                    *block = [256, 1, 1];
                    return;
                }
            }
        }
    });
    case("gemm shape", &|p| {
        if let Some(LaunchKind::Gemm(g)) = p.phases[0].buckets[0]
            .launches
            .iter_mut()
            .map(|l| &mut l.kind)
            .find(|k| matches!(k, LaunchKind::Gemm(_)))
        {
            g.k += 1;
        }
    });
    case("gemm rounded copy over its own input", &|p| {
        if let Some(LaunchKind::Gemm(g)) = p.phases[0].buckets[0]
            .launches
            .iter_mut()
            .map(|l| &mut l.kind)
            .find(|k| matches!(k, LaunchKind::Gemm(g) if g.rounded.is_some()))
        {
            g.rounded = Some(g.a);
        }
    });
    case("gemm rounded copy of an activation-typed C", &|p| {
        let b = &mut p.phases[0].buckets[0];
        let act_c = |g: &specplan_format::GemmDesc| b.buffers[g.c as usize].dtype != specplan_format::DType::F32;
        let at = b
            .launches
            .iter()
            .position(|l| matches!(&l.kind, LaunchKind::Gemm(g) if g.rounded.is_none() && act_c(g)));
        if let Some(LaunchKind::Gemm(g)) = at.map(|i| &mut b.launches[i].kind) {
            g.rounded = Some(g.a);
        }
    });
    case("rows argument past the bucket", &|p| {
        for l in &mut p.phases[0].buckets[0].launches {
            if let LaunchKind::Kernel { args, .. } = &mut l.kind {
                if let Some(a) = args.iter_mut().rev().find(|a| matches!(a, ArgValue::U32(_))) {
                    *a = ArgValue::U32(1_000_000);
                    return;
                }
            }
        }
    });
    case("kernel constant not the plan's", &|p| {
        if let Some((_, v)) = p.kernels[0].constants.iter_mut().find(|(n, _)| n == "HIDDEN") {
            *v = specplan_format::ConstValue::U32(4096);
        }
    });
    case("scratch buffer smaller than the kernel touches", &|p| {
        let b = &mut p.phases[0].buckets[1];
        if let Some(x) = b.buffers.iter_mut().find(|x| x.name == "fc_in") {
            x.shape = vec![1, 512];
            x.bytes = 1024;
        }
    });
    case("truncated CUBIN", &|p| {
        p.kernels[0].binary = Some(specplan_format::KernelBinary {
            arch: "sm_90".into(),
            source_hash: p.kernels[0].source_hash.clone(),
            cubin: b"\x7fELF\x02".to_vec(),
            ptx: String::new(),
        });
    });
    insta::assert_snapshot!(out);
}

#[test]
fn validation_accepts_what_the_compiler_emits() {
    let (_, plan) = tiny_bytes();
    assert!(validate(plan).is_ok());
}

/// Sizes at the top of u64 are reported, never overflowed (found by the mutation test:
/// rounding the end of a weight or buffer placed near 2^64 up to 256 bytes panicked).
#[test]
fn sizes_near_the_top_of_u64_are_rejected_without_overflow() {
    let msgs = invalid(|p| p.weights[2].offset = u64::MAX - 255);
    assert!(
        msgs.contains("weights[2]") && msgs.contains("outside the weight region"),
        "{msgs}"
    );
    let msgs = invalid(|p| p.weights[3].bytes = u64::MAX - 1);
    assert!(msgs.contains("weights[3]"), "{msgs}");
    let msgs = invalid(|p| {
        let b = &mut p.phases[0].buckets[0];
        b.arena_bytes = u64::MAX;
        b.buffers[0].offset = u64::MAX - 255 - b.buffers[0].bytes;
    });
    assert!(msgs.contains("buckets[0] (batch 1).arena_bytes"), "{msgs}");
    // Lists are capped before any rule walks them (the overlap rule is quadratic).
    let msgs = invalid(|p| {
        let l = p.phases[0].buckets[0].launches[0].clone();
        p.phases[0].buckets[0].launches.resize(5000, l);
    });
    assert!(msgs.contains("buckets[0].launches: 5000 entries exceed 4096"), "{msgs}");
    let msgs = invalid(|p| {
        let k = p.kernels[0].clone();
        p.kernels.resize(2000, k);
    });
    assert!(msgs.contains("kernels: 2000 entries exceed 1024"), "{msgs}");
}

/// Plans the mutation test found `validate` accepting although they compute something else.
#[test]
fn lost_results_and_foreign_pools_are_rejected() {
    fn launch(p: &mut specplan_format::Plan, op: &str) -> usize {
        p.phases[0].buckets[0]
            .launches
            .iter()
            .position(|l| l.op == op)
            .unwrap_or_else(|| panic!("tiny has a launch {op}"))
    }
    fn pools_to(p: &mut specplan_format::Plan, op: &str, layer: u32) {
        let i = launch(p, op);
        if let LaunchKind::Kernel { args, .. } = &mut p.phases[0].buckets[0].launches[i].kind {
            for a in args {
                if let ArgValue::KvCache { layer: l, .. } = a {
                    *l = layer;
                }
            }
        }
    }
    // Layer 1's keys appended into layer 0's pools: layer 0 appended twice, layer 1 never.
    let msgs = invalid(|p| pools_to(p, "l1.rope_append", 0));
    assert!(msgs.contains("layer 0's K pool is appended by 2 launches"), "{msgs}");
    assert!(msgs.contains("layer 1's V pool is appended by 0 launches"), "{msgs}");
    // Layer 0's attention over layer 1's pools, which this step has not appended yet.
    let msgs = invalid(|p| pools_to(p, "l0.attention.attn_partial", 1));
    assert!(msgs.contains("reads layer 1's K pool before launch"), "{msgs}");
    // No append at all: attention over stale keys.
    let msgs = invalid(|p| {
        let i = launch(p, "l0.rope_append");
        p.phases[0].buckets[0].launches.remove(i);
    });
    assert!(msgs.contains("layer 0's K pool is appended by 0 launches"), "{msgs}");
    // A lost result: the o_proj GEMM gone, the attention's output never read.
    let msgs = invalid(|p| {
        let i = launch(p, "l1.o_proj");
        p.phases[0].buckets[0].launches.remove(i);
    });
    assert!(
        msgs.contains("(l1.attn): launch") && msgs.contains("no later launch reads it"),
        "{msgs}"
    );
    // A launch repeated: its first result overwritten unread.
    let msgs = invalid(|p| {
        let i = launch(p, "lm_head");
        let l = p.phases[0].buckets[0].launches[i].clone();
        p.phases[0].buckets[0].launches.insert(i, l);
    });
    assert!(msgs.contains("overwrites what launch"), "{msgs}");
    // A kernel relabelled (show and diff print the name).
    let msgs = invalid(|p| p.kernels[0].name = "rmsnorm_bf16_hidden256".into());
    assert!(msgs.contains("kernels[0]") && msgs.contains("mangled name"), "{msgs}");
    // Descriptive rope facts that no kernel reads are still checked.
    let msgs = invalid(|p| p.model.rope_scaling = specplan_format::RopeScaling::Linear { factor: f32::NAN });
    assert!(msgs.contains("model.rope_scaling"), "{msgs}");
}

/// A sharded plan's facts, shards and collectives, each broken in one place, are refused
/// naming what broke (and the unbroken rank plan is valid).
#[test]
fn tensor_parallel_facts_are_validated() {
    use specplan_format::{CollectiveOp, Shard};
    let o = Overrides {
        tp_size: Some(2),
        tp_rank: Some(1),
        ..Overrides::default()
    };
    let rank = common::compile_preset("tiny", &o).into_inner();
    let single = common::compile_preset("tiny", &Overrides::default()).into_inner();
    let collective = |p: &mut specplan_format::Plan, op: CollectiveOp| -> Option<usize> {
        p.phases[0].buckets[0]
            .launches
            .iter()
            .position(|l| matches!(&l.kind, LaunchKind::Collective(c) if c.op == op))
    };
    check(&rank, "rank above size", "capture.tp.rank", &|p| p.capture.tp.rank = 2);
    check(&rank, "size 3", "capture.tp.size", &|p| p.capture.tp.size = 3);
    check(&rank, "another rank's shard", "does not fit rank 1", &|p| {
        let w = p
            .weights
            .iter_mut()
            .find(|w| !w.shard.is_empty())
            .expect("a sharded weight");
        w.shard[0].index = 0;
    });
    check(&rank, "a shard too few", "shards for", &|p| {
        let w = p
            .weights
            .iter_mut()
            .find(|w| w.shard.len() > 1)
            .expect("a packed sharded weight");
        w.shard.pop();
    });
    check(&single, "a shard in an unsharded plan", "tp size 1", &|p| {
        p.weights[0].shard = vec![Shard {
            axis: 0,
            parts: 2,
            index: 0,
        }];
    });
    check(&rank, "an all-gather of the wrong count", "does not match", &|p| {
        let i = collective(p, CollectiveOp::AllGather).expect("an all-gather");
        if let LaunchKind::Collective(c) = &mut p.phases[0].buckets[0].launches[i].kind {
            c.count += 1;
        }
    });
    check(&rank, "an all-reduce out of place", "in place", &|p| {
        let i = collective(p, CollectiveOp::AllReduceSum).expect("an all-reduce");
        if let LaunchKind::Collective(c) = &mut p.phases[0].buckets[0].launches[i].kind {
            c.recv = (c.send + 1) % 3;
        }
    });
    check(&rank, "a collective in an unsharded plan", "tp size 1", &|p| {
        p.capture.tp = specplan_format::TensorParallel::SINGLE;
    });
    // The rank's own plan is valid as compiled.
    assert!(validate(rank).is_ok());
}

/// The index of bucket 0's first launch of `entry` (the plan must have one).
fn first_launch_of(p: &specplan_format::Plan, entry: specplan_format::Entry) -> usize {
    p.phases[0].buckets[0]
        .launches
        .iter()
        .position(
            |l| matches!(&l.kind, LaunchKind::Kernel { kernel, .. } if p.kernels[*kernel as usize].entry == entry),
        )
        .unwrap_or_else(|| panic!("a {} launch", entry.name()))
}

/// A split top-K row merged in its last CTA (`topk_fused`): the counters argument names the
/// runtime's counter words and nothing else names them, its records are its own, and a
/// sharded instance is refused.
/// (Past `COUNTER_WORDS` rows the compiler launches `topk_merge`: cpu_reference.rs.)
#[test]
fn last_cta_merges_are_validated() {
    use specplan_compiler::config::{resolve, Source};
    use specplan_compiler::{compile, Target};
    use specplan_format::{Entry, Plan};
    let text = include_str!("../../compiler/presets/tiny.toml").replace("vocab_size = 1000", "vocab_size = 20000");
    let cfg = resolve(
        &Source::Toml {
            name: "tiny-v20000".into(),
            text,
        },
        &Overrides::default(),
    )
    .expect("config");
    let split = compile(&cfg, &Target::default(), None, &|_, _| {})
        .expect("compile")
        .plan
        .into_inner();
    let fused = |p: &Plan| first_launch_of(p, Entry::TopkFused);
    fn args(p: &mut Plan, i: usize) -> &mut Vec<ArgValue> {
        match &mut p.phases[0].buckets[0].launches[i].kind {
            LaunchKind::Kernel { args, .. } => args,
            _ => unreachable!("a kernel launch"),
        }
    }
    let i = fused(&split);
    let counters = specplan_kernels::Entry::TopkFused
        .abi()
        .fields
        .iter()
        .position(|f| f.name == "counters")
        .expect("a counters field");
    let probs = specplan_kernels::Entry::TopkFused
        .abi()
        .fields
        .iter()
        .position(|f| f.name == "probs")
        .expect("a probs field");
    check(
        &split,
        "counters as a buffer",
        "is not what this field may name",
        &|p| {
            let a = args(p, i);
            a[counters] = a[probs];
        },
    );
    check(
        &split,
        "probs as the counters",
        "Counters is not what this field may name",
        &|p| args(p, i)[probs] = ArgValue::Counters,
    );
    // The records are the fused launch's own: a second launch over them is refused.
    check(
        &split,
        "records shared",
        "own workspace must be scratch that no other launch uses",
        &|p| {
            let l = p.phases[0].buckets[0].launches[i].clone();
            p.phases[0].buckets[0].launches.insert(i + 1, l);
        },
    );
    // A sharded plan's records meet after the all-gather: its top-K kernel relabelled as the
    // fused entry is refused by the rank count.
    let o = Overrides {
        tp_size: Some(2),
        tp_rank: Some(1),
        ..Overrides::default()
    };
    let rank = common::compile_preset("tiny", &o).into_inner();
    check(
        &rank,
        "a sharded topk_fused",
        "merges one rank's records, but the plan has 2 ranks",
        &|p| {
            if let Some(k) = p.kernels.iter_mut().find(|k| k.entry == Entry::TopkPartial) {
                k.entry = Entry::TopkFused;
            }
        },
    );
}

/// The attention's splits merged in their group's last CTA (`attn_fused`): only where the
/// bucket says so, with more than one split and its rows within the runtime's counter words;
/// its partials are its own.
#[test]
fn fused_attention_merges_are_validated() {
    use specplan_compiler::config::{resolve, Source};
    use specplan_compiler::{compile, Target};
    use specplan_format::{Entry, Plan};
    let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("config");
    let target = Target {
        attn_last_cta: true,
        ..Target::default()
    };
    let base = compile(&cfg, &target, None, &|_, _| {})
        .expect("compile")
        .plan
        .into_inner();
    let fused = |p: &Plan| first_launch_of(p, Entry::AttnFused);
    let i = fused(&base);
    assert!(base.phases[0].buckets[0].attn_last_cta);
    check(
        &base,
        "attn_fused without attn_last_cta",
        "attn_fused needs attn_last_cta",
        &|p| p.phases[0].buckets[0].attn_last_cta = false,
    );
    check(
        &base,
        "attn_last_cta with one split",
        "attn_last_cta: set with 1 split(s)",
        &|p| p.phases[0].buckets[0].attn_splits = 1,
    );
    check(
        &base,
        "partials shared",
        "own workspace must be scratch that no other launch uses",
        &|p| {
            let l = p.phases[0].buckets[0].launches[i].clone();
            p.phases[0].buckets[0].launches.insert(i + 1, l);
        },
    );
}
