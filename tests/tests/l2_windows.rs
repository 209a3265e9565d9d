//! Where a captured graph's L2 prefetch branches fork (runtime/src/gpu/prefetch.rs), over
//! real plans' launch lists: one branch per GEMM that a non-GEMM launch precedes since the
//! last GEMM, forked at the first of those launches, sized min(cap, the weight) in whole
//! 4 KiB chunks; none for a GEMM right after another, none at all when off. The GPU check
//! (`l2_branch.rs`) finds these in the graphs and the outputs unchanged.

mod common;

use common::compile_preset;
use specplan_compiler::config::Overrides;
use specplan_format::LaunchKind;
use specplan_runtime::gpu::{l2_forks, l2_windows, L2Prefetch};

fn is_gemm(k: &LaunchKind) -> bool {
    matches!(k, LaunchKind::Gemm(_))
}

#[test]
fn branches_fork_where_the_small_launches_before_a_gemm_begin() {
    let o = Overrides {
        buckets: Some("1,8,64".into()),
        ..Overrides::default()
    };
    let cap = L2Prefetch::parse("32").expect("32 MiB");
    for preset in ["llama2-7b-eagle", "llama3.1-8b-eagle3", "tiny"] {
        let plan = compile_preset(preset, &o);
        for bi in 0..plan.bucket_count() {
            let b = plan.flat_bucket(bi).expect("bucket");
            assert!(l2_windows(&plan, b, L2Prefetch::OFF).is_empty(), "{preset}: off");
            let w = l2_windows(&plan, b, cap);
            let kinds: Vec<bool> = b.launches.iter().map(|l| is_gemm(&l.kind)).collect();
            // Every GEMM with a non-GEMM launch since the previous GEMM (or the start).
            let want: Vec<usize> = (0..kinds.len())
                .filter(|&i| kinds[i] && i > 0 && !kinds[i - 1])
                .collect();
            assert_eq!(
                w.iter().map(|x| x.gemm).collect::<Vec<_>>(),
                want,
                "{preset} bucket {bi}"
            );
            for x in &w {
                let LaunchKind::Gemm(g) = &b.launches[x.gemm].kind else {
                    panic!("{preset}: window {x:?} names a non-GEMM launch")
                };
                assert_eq!(x.weight, g.w, "{preset}: the GEMM's own weight");
                assert!(
                    x.at < x.gemm && (x.at == 0 || kinds[x.at - 1]),
                    "{preset}: {x:?} forks after a GEMM"
                );
                assert!(
                    kinds[x.at..x.gemm].iter().all(|&k| !k),
                    "{preset}: only small launches in {x:?}"
                );
                let weight = g.n * g.k * plan.weights[g.w as usize].dtype.size();
                assert_eq!(x.bytes, weight.min(32 << 20) / 4096 * 4096, "{preset}: {x:?}");
                assert!(x.bytes > 0);
            }
            if preset == "llama2-7b-eagle" && b.batch == 1 {
                // fc, o_proj, gate_up, down: each behind a small launch (qkv follows fc and
                // lm_head follows down directly: their roundings are the GEMMs' own).
                let names: Vec<&str> = w.iter().map(|x| b.launches[x.gemm].op.as_str()).collect();
                assert_eq!(
                    names,
                    ["fc", "l0.o_proj", "l0.gate_up_proj", "l0.down_proj"],
                    "{preset} B 1"
                );
                let mib: Vec<u64> = w.iter().map(|x| x.bytes >> 20).collect();
                assert_eq!(mib, [32, 32, 32, 32], "{preset} B 1");
            }
        }
    }
}

#[test]
fn a_small_cap_bounds_every_branch() {
    let plan = compile_preset("tiny", &Overrides::default());
    let cap = L2Prefetch::parse("1x4").expect("1 MiB");
    let b = plan.flat_bucket(0).expect("bucket 0");
    let w = l2_windows(&plan, b, cap);
    assert!(!w.is_empty());
    assert!(w.iter().all(|x| x.bytes <= 1 << 20 && x.bytes % 4096 == 0));
}

#[test]
fn partial_and_filtered_lists_fork_only_for_the_gemms_they_run() {
    let o = Overrides {
        buckets: Some("1".into()),
        ..Overrides::default()
    };
    let plan = compile_preset("llama2-7b-eagle", &o);
    let b = plan.flat_bucket(0).expect("bucket 1");
    let cap = L2Prefetch::parse("32").expect("32 MiB");
    let all = |_: &str| true;
    let w = l2_windows(&plan, b, cap);
    let n = b.launches.len();
    // The whole list: every window at its own first launch.
    let f = l2_forks(&plan, b, cap, 0..n, &all);
    assert_eq!(
        f.iter().map(|(at, x)| (*at, x.at)).collect::<Vec<_>>(),
        w.iter().map(|x| (x.at, x.at)).collect::<Vec<_>>()
    );
    // A range that starts inside a window forks it at the range's first launch; one that
    // ends before a GEMM leaves that GEMM's branch out.
    let o_proj = w[1];
    assert_eq!(b.launches[o_proj.gemm].op, "l0.o_proj");
    let mid = o_proj.at + 1;
    let f = l2_forks(&plan, b, cap, mid..o_proj.gemm, &all);
    assert!(f.is_empty(), "o_proj itself is not issued: {f:?}");
    let f = l2_forks(&plan, b, cap, mid..o_proj.gemm + 1, &all);
    assert_eq!(
        f.iter().map(|(at, x)| (*at, x.gemm)).collect::<Vec<_>>(),
        [(mid, o_proj.gemm)]
    );
    // A filter that skips a window's first launch forks at the next one it keeps; one that
    // skips the GEMM drops the branch.
    let first_op = b.launches[o_proj.at].op.clone();
    let skip_first = |op: &str| op != first_op;
    let f = l2_forks(&plan, b, cap, 0..n, &skip_first);
    assert!(
        f.iter().any(|&(at, x)| x.gemm == o_proj.gemm && at == o_proj.at + 1),
        "{f:?}"
    );
    let gemm_op = b.launches[o_proj.gemm].op.clone();
    let skip_gemm = |op: &str| op != gemm_op;
    let f = l2_forks(&plan, b, cap, 0..n, &skip_gemm);
    assert!(
        f.iter().all(|(_, x)| x.gemm != o_proj.gemm) && f.len() == w.len() - 1,
        "{f:?}"
    );
}

#[test]
fn branches_stop_above_the_largest_bucket_asked_for() {
    let o = Overrides {
        buckets: Some("1,8,64".into()),
        ..Overrides::default()
    };
    let plan = compile_preset("llama2-7b-eagle", &o);
    let small = L2Prefetch::parse("32/8").expect("up to bucket 8");
    for bi in 0..plan.buckets().len() {
        let b = &plan.buckets()[bi];
        let w = l2_windows(&plan, b, small);
        assert_eq!(w.is_empty(), b.batch > 8, "bucket {}: {w:?}", b.batch);
    }
}
