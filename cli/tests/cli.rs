//! The `specplan` binary end to end: exit codes, atomic output, show/diff/dot.

use std::path::Path;
use std::process::{Command, Output};

fn specplan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specplan"))
        .args(args)
        .output()
        .expect("run specplan")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn compile(dir: &Path, name: &str, extra: &[&str]) -> String {
    let out = dir.join(name);
    let out_s = out.to_string_lossy().into_owned();
    let mut args = vec!["compile", "--no-kernels", "--preset", "tiny", "-o", &out_s];
    args.extend_from_slice(extra);
    let o = specplan(&args);
    assert!(o.status.success(), "{}", text(&o));
    out_s
}

#[test]
fn compile_show_diff_dot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = compile(dir.path(), "a.plan", &[]);
    let b = compile(dir.path(), "b.plan", &[]);
    let c = compile(
        dir.path(),
        "c.plan",
        &["--sliding-window", "8", "--hot-vocab-size", "300"],
    );

    let show = specplan(&["show", &a]);
    assert!(show.status.success());
    let s = String::from_utf8_lossy(&show.stdout);
    assert!(s.contains("bucket 8 rows=32 arena="), "{s}");
    assert!(s.contains("layer 1 window=none"), "{s}");

    let same = specplan(&["diff", &a, &b]);
    assert_eq!(same.status.code(), Some(0), "{}", text(&same));
    let differ = specplan(&["diff", &a, &c]);
    assert_eq!(differ.status.code(), Some(1), "{}", text(&differ));
    let d = text(&differ);
    assert!(d.contains("~ layer 0: window=none (full causal)  =>  window=8"), "{d}");
    assert!(d.contains("launches:"), "{d}");
    assert!(d.contains("kernels:"), "{d}");

    let dot = specplan(&["dot", &a, "--bucket", "2"]);
    assert!(dot.status.success());
    assert!(String::from_utf8_lossy(&dot.stdout).starts_with("digraph"));
    let bad_bucket = specplan(&["dot", &a, "--bucket", "3"]);
    assert_eq!(bad_bucket.status.code(), Some(2));
    assert!(text(&bad_bucket).contains("no such bucket (buckets: 1,2,4,8)"));
}

#[test]
fn invalid_config_exits_2_and_leaves_the_old_plan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = compile(dir.path(), "p.plan", &[]);
    let before = std::fs::read(&out).expect("read plan");
    let o = specplan(&[
        "compile",
        "--preset",
        "tiny",
        "--speculative-num-draft-tokens",
        "99",
        "-o",
        &out,
    ]);
    assert_eq!(o.status.code(), Some(2));
    let msg = text(&o);
    assert!(
        msg.contains("speculative.num_draft_tokens (--speculative-num-draft-tokens): 99"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read(&out).expect("read plan"),
        before,
        "a failed compile touched the plan"
    );
    let fresh = dir.path().join("never.plan");
    let o = specplan(&[
        "compile",
        "--preset",
        "tiny",
        "--page-size",
        "3",
        "-o",
        &fresh.to_string_lossy(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!fresh.exists());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").collect();
    assert_eq!(leftovers.len(), 1, "temporary files left behind");
}

#[test]
fn corrupted_plans_exit_2_with_a_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = compile(dir.path(), "p.plan", &[]);
    let mut bytes = std::fs::read(&out).expect("read plan");
    let n = bytes.len();
    bytes[n / 2] ^= 0xff;
    std::fs::write(&out, &bytes).expect("write");
    let o = specplan(&["show", &out]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("checksum mismatch"), "{}", text(&o));
    std::fs::write(&out, &bytes[..100]).expect("write");
    let o = specplan(&["diff", &out, &out]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("truncated"), "{}", text(&o));
    let o = specplan(&["show", &dir.path().join("missing.plan").to_string_lossy()]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn hf_config_needs_the_speculative_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 1,
            "vocab_size": 500, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "some_unknown_key": [1, 2]}"#,
    )
    .expect("write");
    let out = dir.path().join("p.plan");
    let (cfg_s, out_s) = (cfg.to_string_lossy().into_owned(), out.to_string_lossy().into_owned());
    let o = specplan(&["compile", "--no-kernels", "--hf-config", &cfg_s, "-o", &out_s]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("speculative.topk (--speculative-eagle-topk): missing"),
        "{}",
        text(&o)
    );
    let o = specplan(&[
        "compile",
        "--no-kernels",
        "--hf-config",
        &cfg_s,
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-steps",
        "3",
        "--speculative-num-draft-tokens",
        "4",
        "--buckets",
        "1,4",
        "-o",
        &out_s,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(out.exists());
}

#[test]
fn presets_are_listed() {
    let o = specplan(&["presets"]);
    assert!(o.status.success());
    let s = String::from_utf8_lossy(&o.stdout);
    for p in ["llama2-7b-eagle", "llama3-8b-eagle", "tiny"] {
        assert!(s.contains(p), "{s}");
    }
}
