//! `tests/peer/report.py --previous`: the benchmark targets judged on a benchmark run
//! (`tests/peer/criteria.py`). Synthetic specbench, peer and previous-report files, small enough
//! to work out by hand, so the verdict a real run prints is known to count what it says:
//! the floor targets (1.1× at B 1, 1.2× elsewhere), shapes slower than the previous report, a
//! shape the previous report had and this run lacks, the equal-output checks, a previous
//! report from another GPU (not compared), of several the one of this run's GPU, or unreadable
//! (an error, the report still written),
//! the engine-memory figure (`gpucheck engine-memory`'s file: within its bound, over it, a
//! failed load, absent or unreadable), and an output that is a FIFO (refused). Needs python3
//! (standard library only).

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::{json, Value};

const H200: &str = "name, driver_version, memory.total [MiB], clocks.max.sm [MHz]\n\
                    NVIDIA H200, 580.159.04, 143771 MiB, 1980 MHz\n";
const H100: &str = "name, driver_version, memory.total [MiB], clocks.max.sm [MHz]\n\
                    NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 1980 MHz\n";

/// One specbench row: (plan, batch, step µs, floor µs).
fn spec_row(plan: &str, batch: u32, step: f64, floor: f64) -> Value {
    json!({"plan": plan, "batch": batch, "prefix": 1024, "prep_us": 5.0, "replay_us": step - 5.0,
           "full_us": step, "eager_us": step * 2.0, "floor_us": floor, "attn_us": 10.0, "attn_tb_s": 1.0})
}

/// One previous-report row (report.json's keys).
fn prev_row(model: &str, n: u32, batch: u32, step: f64) -> Value {
    json!({"model": model, "n": n, "prefix": 1024, "batch": batch, "specplan_step_us": step})
}

/// The run most tests judge. m-n4: B 1 at 1.05× the floor (met), B 8 at 1.25× (missed: 1.2×);
/// m-n8: B 1 at 1.15× (missed: 1.1×).
fn mixed_run() -> Vec<Value> {
    vec![
        spec_row("m-n4", 1, 105.0, 100.0),
        spec_row("m-n4", 8, 250.0, 200.0),
        spec_row("m-n8", 1, 115.0, 100.0),
    ]
}

/// Its previous report: m-n4 B 1 was 104 (now 0.96% slower), B 8 was 260 (now faster), m-n8
/// B 1 was 110 (now 4.5% slower); m-n8 B 8 is in the previous report only.
fn mixed_previous() -> Vec<Value> {
    vec![
        prev_row("m", 4, 1, 104.0),
        prev_row("m", 4, 8, 260.0),
        prev_row("m", 8, 1, 110.0),
        prev_row("m", 8, 8, 300.0),
    ]
}

/// `python3 tests/peer/report.py --specbench DIR/specbench.json ... --out DIR/out`, each
/// `--flag names` pair naming files in `dir` (names split at spaces).
fn report_py(dir: &Path, flags: &[(&str, &str)]) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("peer/report.py");
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg("--specbench").arg(dir.join("specbench.json"));
    for (flag, names) in flags {
        cmd.arg(flag);
        for name in names.split(' ') {
            cmd.arg(dir.join(name));
        }
    }
    cmd.arg("--out")
        .arg(dir.join("out"))
        .output()
        .unwrap_or_else(|e| panic!("python3 report.py could not start: {e}"))
}

/// A specbench.json of one row (m-n4, B 1, at 1.05× its floor) in `dir`.
fn one_row_run(dir: &Path) {
    let spec = json!({"ceilings": {"copy_bytes_per_s": 4.0e12, "bf16_flops_per_s": 7.0e14},
                      "rows": [spec_row("m-n4", 1, 105.0, 100.0)]});
    fs::write(dir.join("specbench.json"), spec.to_string()).expect("write specbench.json");
}

const MIB: u64 = 1 << 20;

/// One engine-memory load as `gpucheck engine-memory` writes it (its own record function and
/// type, so the reader is tested against the writer): `added` MiB in all.
fn memory_load(name: &str, added_mib: u64) -> Value {
    let m = specplan_tests::engine::AddedMemory {
        measured_bytes: added_mib * MIB,
        arena_bytes: 36 * MIB,
        workspace_bytes: 6 * MIB,
    };
    specplan_tests::engine::load_record(&format!("/b/{name}.plan"), name, 27, 200.0, 15.0, &m)
}

/// engine-memory.json with these loads (null: a load that failed), as gpucheck writes it.
fn memory_file(loads: Vec<Value>) -> Value {
    specplan_tests::engine::memory_file(loads)
}

/// Runs report.py over these rows in `dir` and returns (its stdout, report.json's "criteria"),
/// with an engine-memory file of two loads within the bound.
fn report(dir: &Path, rows: Vec<Value>, prev: Vec<Value>, previous_gpu: &str, checks_ok: bool) -> (String, Value) {
    let memory = memory_file(vec![
        memory_load("llama3-8b-eagle", 46),
        memory_load("llama3.1-8b-eagle3", 50),
    ]);
    report_with(dir, rows, prev, previous_gpu, checks_ok, Some(&memory))
}

/// As `report`, with this engine-memory file (None: no `--engine-memory`).
fn report_with(
    dir: &Path,
    rows: Vec<Value>,
    prev: Vec<Value>,
    previous_gpu: &str,
    checks_ok: bool,
    memory: Option<&Value>,
) -> (String, Value) {
    let spec = json!({"ceilings": {"copy_bytes_per_s": 4.0e12, "bf16_flops_per_s": 7.0e14}, "rows": rows});
    let previous = json!({"device": previous_gpu, "commit": "abc1234", "rows": prev});
    let peer = json!({"rows": [], "checks": [{"plan": "m-n4", "ok": true}, {"plan": "m-n8", "ok": checks_ok}]});
    let write = |name: &str, v: &Value| fs::write(dir.join(name), v.to_string()).expect("write a test file");
    write("specbench.json", &spec);
    write("previous.json", &previous);
    write("peer.json", &peer);
    fs::write(dir.join("device.txt"), H200).expect("write device.txt");
    let mut flags = vec![
        ("--peer", "peer.json"),
        ("--device", "device.txt"),
        ("--previous", "previous.json"),
    ];
    if let Some(m) = memory {
        write("engine-memory.json", m);
        flags.push(("--engine-memory", "engine-memory.json"));
    }
    let out = report_py(dir, &flags);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "report.py failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_str(&fs::read_to_string(dir.join("out/report.json")).expect("report.json"))
        .expect("report.json parses");
    (stdout, doc["criteria"].clone())
}

#[test]
fn the_criteria_count_floor_targets_slower_shapes_and_missing_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (stdout, c) = report(dir.path(), mixed_run(), mixed_previous(), H200, true);
    assert_eq!(c["shapes"], 3);
    assert_eq!(
        c["floor_met"], 1,
        "only m-n4 B 1 (1.05× ≤ 1.1×) meets its floor target: {c}"
    );
    assert_eq!(
        (c["b1_shapes"].as_u64(), c["b1_floor_met"].as_u64()),
        (Some(2), Some(1))
    );
    let p = &c["previous"];
    assert_eq!(p["comparable"], true);
    assert_eq!(p["compared"], 3);
    assert_eq!(p["slower"], 2, "m-n4 B 1 and m-n8 B 1 are slower: {p}");
    assert_eq!(p["slower_1pct"], 1, "only m-n8 B 1 by more than 1%: {p}");
    assert_eq!(p["missing"], json!(["m N8 L1024 B8"]));
    let worst = p["worst"].as_f64().expect("worst");
    assert!((worst - 115.0 / 110.0).abs() < 1e-9, "worst {worst}");
    assert_eq!(c["met"], false);
    assert!(
        stdout.contains("floor targets: 1/3 shapes within 1.2x (B 1: 1/2 within 1.1x)"),
        "{stdout}"
    );
    assert!(stdout.contains("2/3 shapes slower (1 by more than 1%)"), "{stdout}");
    assert!(stdout.trim_end().ends_with("benchmark targets: not met"), "{stdout}");
    let md = fs::read_to_string(dir.path().join("out/report.md")).expect("report.md");
    assert!(md.contains("## The benchmark targets in this run"), "{md}");
    // The table lists the three shapes that miss something, not m-n4 B 8's faster step alone.
    assert!(
        md.contains("| m | 8 | 1024 | 1 | 115.0 | 1.15× | 1.1× | 110.0 | 1.045× |"),
        "{md}"
    );
}

#[test]
fn a_previous_report_from_another_gpu_is_not_compared() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (stdout, c) = report(dir.path(), mixed_run(), mixed_previous(), H100, false);
    let p = &c["previous"];
    assert_eq!(p["comparable"], false);
    assert_eq!(p["gpu"], "NVIDIA H100 80GB HBM3");
    assert_eq!(p["this_gpu"], "NVIDIA H200");
    assert!(p.get("slower").is_none(), "no step compared across GPUs: {p}");
    assert_eq!((c["checks"].as_u64(), c["checks_passed"].as_u64()), (Some(2), Some(1)));
    assert!(
        stdout.contains("previous report (NVIDIA H100 80GB HBM3) not compared: this run is on NVIDIA H200"),
        "{stdout}"
    );
    assert!(stdout.contains("equal-output checks: 1/2 passed"), "{stdout}");
    assert_eq!(c["met"], false);
}

#[test]
fn of_several_previous_reports_the_one_of_this_gpu_is_judged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // Written first by `report` (an H200 run against an H100 report), then given after another
    // card's report and before an older H200 one: the first H200 report is the one compared.
    let (_, c) = report(d, mixed_run(), mixed_previous(), H100, true);
    assert_eq!(c["previous"]["comparable"], false);
    let write = |name: &str, gpu: &str, commit: &str, step: f64| {
        let v = json!({"device": gpu, "commit": commit, "rows": [prev_row("m", 4, 1, step)]});
        fs::write(d.join(name), v.to_string()).expect("write a previous report");
    };
    write("h200-new.json", H200, "new2000", 100.0);
    write("h200-old.json", H200, "old2000", 200.0);
    let out = report_py(
        d,
        &[
            ("--peer", "peer.json"),
            ("--device", "device.txt"),
            ("--previous", "previous.json h200-new.json h200-old.json"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_str(&fs::read_to_string(d.join("out/report.json")).expect("report.json"))
        .expect("report.json parses");
    let p = &doc["criteria"]["previous"];
    assert_eq!(p["comparable"], true, "{p}");
    assert_eq!(p["commit"], "new2000", "the first report of this run's GPU: {p}");
    // m-n4 B 1: 105 µs now against 100 then.
    assert_eq!(p["slower"], 1, "{p}");
}

#[test]
fn a_run_within_every_target_is_met() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = vec![spec_row("m-n4", 1, 109.0, 100.0), spec_row("m-n4", 8, 239.0, 200.0)];
    let prev = vec![prev_row("m", 4, 1, 109.0), prev_row("m", 4, 8, 300.0)];
    let (stdout, c) = report(dir.path(), rows, prev, H200, true);
    assert_eq!((c["floor_met"].as_u64(), c["shapes"].as_u64()), (Some(2), Some(2)));
    assert_eq!(c["previous"]["slower"], 0, "an equal step is not slower: {c}");
    assert_eq!(c["met"], true, "{c}");
    assert!(stdout.trim_end().ends_with("benchmark targets: MET"), "{stdout}");
    // Without the equal-output checks the same times are not enough.
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = vec![spec_row("m-n4", 1, 109.0, 100.0)];
    let (_, c) = report(dir.path(), rows, vec![prev_row("m", 4, 1, 109.0)], H200, false);
    assert_eq!(c["met"], false, "{c}");
}

#[test]
fn the_engine_memory_figure_is_reported_and_judged() {
    let met = || vec![spec_row("m-n4", 1, 109.0, 100.0)];
    let prev = || vec![prev_row("m", 4, 1, 109.0)];
    // Within the bound: listed in the summary and in report.md's table, and the targets met.
    let dir = tempfile::tempdir().expect("tempdir");
    let (stdout, c) = report(dir.path(), met(), prev(), H200, true);
    assert_eq!(c["memory"]["met"], true, "{c}");
    assert_eq!(c["met"], true, "{c}");
    assert!(
        stdout.contains(
            "engine memory: 2/2 loads within 64 MiB (llama3-8b-eagle (27 buckets) 46.0 MiB, llama3.1-8b-eagle3 (27 buckets) 50.0 MiB)"
        ),
        "{stdout}"
    );
    let md = fs::read_to_string(dir.path().join("out/report.md")).expect("report.md");
    assert!(
        md.contains("| llama3-8b-eagle | 27 | 46.0 | 36.0 | 6.0 | 4.0 | yes |"),
        "{md}"
    );
    let doc: Value = serde_json::from_str(&fs::read_to_string(dir.path().join("out/report.json")).expect("json"))
        .expect("report.json parses");
    assert_eq!(doc["engine_memory"]["bound_bytes"], 64 * MIB);
    // One load a byte over the bound, or a load that failed: not met, and said.
    for (loads, said) in [
        (
            vec![
                memory_load("a", 46),
                json!({"name": "b", "buckets": 27, "added_memory": {"measured_bytes": 64 * MIB + 1, "arena_bytes": 0, "workspace_bytes": 0}}),
            ],
            "engine memory: 1/2 loads within 64 MiB (a (27 buckets) 46.0 MiB, b (27 buckets) 64.0 MiB)",
        ),
        (
            vec![memory_load("a", 46), Value::Null],
            "engine memory: 1/2 loads within 64 MiB (a (27 buckets) 46.0 MiB, a plan whose load failed)",
        ),
        (vec![], "engine memory: 0/0 loads within 64 MiB (no load)"),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let memory = memory_file(loads);
        let (stdout, c) = report_with(dir.path(), met(), prev(), H200, true, Some(&memory));
        assert_eq!(c["memory"]["met"], false, "{c}");
        assert_eq!(c["met"], false, "{c}");
        assert!(stdout.contains(said), "{said}:\n{stdout}");
        assert!(stdout.trim_end().ends_with("benchmark targets: not met"), "{stdout}");
    }
    // Not measured (no file): the same times do not meet the targets.
    let dir = tempfile::tempdir().expect("tempdir");
    let (stdout, c) = report_with(dir.path(), met(), prev(), H200, true, None);
    assert!(c["memory"].is_null(), "{c}");
    assert_eq!(c["met"], false, "{c}");
    assert!(stdout.contains("engine memory: not measured in this run"), "{stdout}");
    // A file whose shape gpucheck never writes: an error named, the report written, "not
    // measured", not met (the same run with a good file is met, above).
    for bad in [
        json!([1]),
        json!({"bound_bytes": 64 * MIB, "load": 5}),
        json!({"bound_bytes": 64 * MIB, "load": [5]}),
        json!({"bound_bytes": 64 * MIB, "load": [{"added_memory": [1]}]}),
        json!({"bound_bytes": true, "load": []}),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (stdout, c) = report_with(dir.path(), met(), prev(), H200, true, Some(&bad));
        assert!(stdout.contains("error: engine memory"), "{bad}: {stdout}");
        assert!(
            stdout.contains("engine memory: not measured in this run"),
            "{bad}: {stdout}"
        );
        assert_eq!(c["met"], false, "{bad}: {c}");
        assert!(
            dir.path().join("out/report.md").exists(),
            "{bad}: the report is written"
        );
    }
    // Exactly the bound is within it; a boolean is not a byte count.
    for (added, within) in [(json!(64 * MIB), true), (json!(true), false)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let load = json!({"name": "a", "buckets": 27,
                          "added_memory": {"measured_bytes": added, "arena_bytes": 0, "workspace_bytes": 0}});
        let (_, c) = report_with(dir.path(), met(), prev(), H200, true, Some(&memory_file(vec![load])));
        assert_eq!(c["memory"]["met"], within, "{added}: {c}");
        assert_eq!(c["met"], within, "{added}: {c}");
    }
}

#[test]
fn an_unreadable_previous_report_is_an_error_not_a_lost_report() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    one_row_run(d);
    fs::write(d.join("previous.json"), "[1, 2]").expect("write previous.json");
    let out = report_py(d, &[("--previous", "previous.json")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        stdout.contains("error: previous report"),
        "the error is named: {stdout}"
    );
    assert!(stdout.trim_end().ends_with("benchmark targets: not met"), "{stdout}");
    assert!(d.join("out/report.md").exists() && d.join("out/report.json").exists());
}

#[test]
fn report_py_refuses_to_write_through_a_fifo() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    one_row_run(d);
    fs::create_dir(d.join("out")).expect("mkdir out");
    // A FIFO made here, in the temp folder (never one of the machine's own nodes).
    let fifo = d.join("out/report.json");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", fifo.display());
    let out = report_py(d, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("report.json exists and is not a regular file"));
    let kind = fs::symlink_metadata(&fifo)
        .expect("the FIFO is still there")
        .file_type();
    use std::os::unix::fs::FileTypeExt;
    assert!(kind.is_fifo(), "the FIFO was replaced");
    assert!(!d.join("out/report.md").exists(), "nothing written before the refusal");
}
