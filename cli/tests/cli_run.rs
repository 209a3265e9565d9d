//! `specplan run`'s contract (issue 14, classes 4, 5 and 7): non-finite caches and
//! weights, hidden states that overflow the activation type, mixed KV dtypes and outputs
//! that are inputs are refused, each with one message naming the tensor and the index,
//! and nothing is written.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use safetensors::tensor::Dtype;
use specplan_tests::contract_files::{input_tensors, weight_tensors, write_safetensors, FileTensor};

struct Files {
    dir: tempfile::TempDir,
    plan: PathBuf,
    weights: Vec<FileTensor>,
    inputs: Vec<FileTensor>,
}

/// `tiny` (with `extra` compile flags), its weights and a 3-request step's inputs.
fn files(extra: &[&str]) -> Files {
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("p.plan");
    compile_tiny(&plan, extra);
    let p = specplan_format::load_file(&plan).expect("load plan");
    Files {
        weights: weight_tensors(&p, 7).expect("weights"),
        inputs: input_tensors(&p, 7, 3, 20).expect("inputs"),
        dir,
        plan,
    }
}

impl Files {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn tensor<'a>(list: &'a mut [FileTensor], name: &str) -> &'a mut FileTensor {
        list.iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// Writes the files and runs the step into `out`.
    fn run(&self, out: &Path) -> std::process::Output {
        write_safetensors(&self.path("w.safetensors"), &self.weights).expect("write weights");
        write_safetensors(&self.path("i.safetensors"), &self.inputs).expect("write inputs");
        specplan(&[
            "run",
            "--plan",
            &s(&self.plan),
            "--weights",
            &s(&self.path("w.safetensors")),
            "--inputs",
            &s(&self.path("i.safetensors")),
            "--out",
            &s(out),
        ])
    }

    /// Runs and asserts a refusal saying `what` once, with no output file written.
    fn refused(&self, what: &str) {
        let out = self.path("o.safetensors");
        let o = self.run(&out);
        assert_refused(&o, what);
        assert_eq!(names(self.dir.path()), ["i.safetensors", "p.plan", "w.safetensors"]);
    }
}

/// Sets element `at` (flat) of a 16-bit float tensor to the bits `v`.
fn set16(t: &mut FileTensor, at: usize, v: u16) {
    t.bytes[2 * at..2 * at + 2].copy_from_slice(&v.to_le_bytes());
}

/// The flat index of `idx` in `shape`.
fn flat(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |a, (i, d)| a * d + i)
}

const BF16_NAN: u16 = 0x7fc0;
const BF16_INF: u16 = 0x7f80;

#[test]
fn a_valid_step_runs() {
    let f = files(&[]);
    let out = f.path("o.safetensors");
    let o = f.run(&out);
    assert!(o.status.success(), "{}", text(&o));
    assert!(out.exists());
}

#[test]
fn non_finite_caches_are_refused_with_the_first_bad_index() {
    for (name, bits, shown) in [("k_cache", BF16_NAN, "NaN"), ("v_cache", BF16_INF, "inf")] {
        let mut f = files(&[]);
        let t = Files::tensor(&mut f.inputs, name);
        let shape = t.shape.clone();
        set16(t, flat(&[1, 2, 3, 1, 5], &shape), bits);
        set16(t, flat(&[1, 2, 3, 1, 9], &shape), bits);
        f.refused(&format!("{name}[1][2][3][1][5]: {shown} is not finite"));
    }
}

#[test]
fn non_finite_weights_are_refused_with_the_first_bad_index() {
    let mut f = files(&[]);
    let t = Files::tensor(&mut f.weights, "layers.0.mlp.down_proj.weight");
    let shape = t.shape.clone();
    set16(t, flat(&[7, 9], &shape), BF16_NAN);
    f.refused("layers.0.mlp.down_proj.weight[7][9]: NaN is not finite");

    // A source of a packed (concatenated) weight is named by its own index.
    let mut f = files(&[]);
    let t = Files::tensor(&mut f.weights, "layers.1.self_attn.k_proj.weight");
    let shape = t.shape.clone();
    set16(t, flat(&[3, 0], &shape), BF16_INF);
    f.refused("layers.1.self_attn.k_proj.weight[3][0]: inf is not finite");
}

#[test]
fn hidden_states_must_be_finite_after_the_cast() {
    // f32 hidden states for an fp16 plan: 70000 is finite in f32, infinite in fp16.
    let mut f = files(&["--dtype", "fp16"]);
    let t = Files::tensor(&mut f.inputs, "hidden_states");
    let vals: Vec<f32> = t
        .bytes
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    let shape = t.shape.clone();
    let mut v32 = vals;
    v32[flat(&[1, 2, 3], &shape)] = 70000.0;
    t.dtype = Dtype::F32;
    t.bytes = v32.iter().flat_map(|x| x.to_le_bytes()).collect();
    f.refused("hidden_states[1][2][3]: 70000 is not finite in fp16, the plan's activation type (|x| ≤ 65504)");
}

#[test]
fn the_kv_caches_are_in_the_plans_dtype() {
    let to_f32 = |t: &mut FileTensor| {
        t.bytes = t
            .bytes
            .chunks_exact(2)
            .flat_map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes())
            .collect();
        t.dtype = Dtype::F32;
    };
    // bf16 keys with f32 values: once accepted and written back as bf16.
    let mut f = files(&[]);
    to_f32(Files::tensor(&mut f.inputs, "v_cache"));
    f.refused("v_cache: has dtype f32, expected bf16 (the plan's activation type");
    let mut f = files(&[]);
    to_f32(Files::tensor(&mut f.inputs, "k_cache"));
    to_f32(Files::tensor(&mut f.inputs, "v_cache"));
    f.refused("k_cache: has dtype f32, expected bf16");
}

#[test]
fn an_output_that_is_an_input_is_refused_before_any_work() {
    let f = files(&[]);
    write_safetensors(&f.path("w.safetensors"), &f.weights).expect("write weights");
    write_safetensors(&f.path("i.safetensors"), &f.inputs).expect("write inputs");
    let before: Vec<Vec<u8>> = ["p.plan", "w.safetensors", "i.safetensors"]
        .iter()
        .map(|n| std::fs::read(f.path(n)).expect("read"))
        .collect();
    for (flag, name) in [
        ("--plan", "p.plan"),
        ("--weights", "w.safetensors"),
        ("--inputs", "i.safetensors"),
    ] {
        let o = f.run(&f.path(name));
        assert_refused(&o, &format!("is the same file as the input {flag}"));
    }
    let after: Vec<Vec<u8>> = ["p.plan", "w.safetensors", "i.safetensors"]
        .iter()
        .map(|n| std::fs::read(f.path(n)).expect("read"))
        .collect();
    assert!(before == after, "an input changed");
    assert_eq!(names(f.dir.path()), ["i.safetensors", "p.plan", "w.safetensors"]);
}

#[test]
fn run_outputs_stream_into_a_fifo() {
    let f = files(&[]);
    let fifo = f.path("pipe");
    mkfifo(&fifo);
    let reader = FifoReader::start(&fifo);
    let o = f.run(&fifo);
    let got = reader.finish();
    assert!(o.status.success(), "{}", text(&o));
    assert!(is_fifo(&fifo), "the FIFO was replaced");
    let st = safetensors::SafeTensors::deserialize(&got).expect("streamed outputs");
    let mut names_out: Vec<String> = st.names().into_iter().map(|n| n.to_string()).collect();
    names_out.sort();
    assert_eq!(
        names_out,
        ["hidden_out", "k_cache", "topk_ids", "topk_probs", "v_cache"]
    );
    // A read-only output is refused (before the step runs).
    let ro = f.path("ro.safetensors");
    std::fs::write(&ro, b"x").expect("write");
    std::fs::set_permissions(&ro, std::os::unix::fs::PermissionsExt::from_mode(0o444)).expect("chmod");
    let o = f.run(&ro);
    assert_refused(&o, "it is read-only");
    assert_eq!(std::fs::read(&ro).expect("read"), b"x");
}

/// hidden_out leaves in the plan's activation dtype: an fp16 plan's row is written as fp16
/// (it was bf16 for every plan before, which dropped 3 bits of an fp16 plan's result).
#[test]
fn hidden_out_is_written_in_the_plans_dtype() {
    for (extra, want) in [
        (&["--dtype", "fp16"][..], safetensors::Dtype::F16),
        (&[][..], safetensors::Dtype::BF16),
    ] {
        let f = files(extra);
        let out = f.path("o.safetensors");
        let o = f.run(&out);
        assert!(o.status.success(), "{}", text(&o));
        let bytes = std::fs::read(&out).expect("outputs");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("outputs file");
        let h = st.tensor("hidden_out").expect("hidden_out");
        assert_eq!(h.dtype(), want, "{extra:?}");
        assert_eq!(st.tensor("k_cache").expect("k_cache").dtype(), want, "{extra:?}");
        // Finite, not all zero: the row was computed and written, not just typed.
        let vals: Vec<f32> = h
            .data()
            .chunks_exact(2)
            .map(|c| match want {
                safetensors::Dtype::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
                _ => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            })
            .collect();
        assert!(
            vals.iter().all(|x| x.is_finite()) && vals.iter().any(|&x| x != 0.0),
            "{extra:?}"
        );
    }
}

/// Every file `run` and `compile` read is bounded by what the plan (or a config) can need:
/// an endless input — a character device like /dev/zero, made here in the temp folder, or a
/// FIFO a writer keeps filling — is refused once past its cap, naming the file and the cap,
/// within seconds and with nothing written.
#[test]
fn endless_and_oversized_files_are_refused_at_their_cap() {
    use std::os::unix::fs::FileTypeExt;
    let f = files(&[]);
    write_safetensors(&f.path("w.safetensors"), &f.weights).expect("write weights");
    write_safetensors(&f.path("i.safetensors"), &f.inputs).expect("write inputs");
    // Endless sources: a FIFO a writer thread keeps filling with zeros (anyone may make one),
    // and where mknod is permitted (root) a character device like /dev/zero (c 1 5), made here
    // in the temp folder, never the machine's own.
    let fifo = |name: &str| -> PathBuf {
        let p = f.path(name);
        let ok = std::process::Command::new("mkfifo")
            .arg(&p)
            .status()
            .is_ok_and(|st| st.success());
        assert!(ok, "mkfifo {}", p.display());
        let w = p.clone();
        // The writer stops at the first failed write (the reader closed: EPIPE, as Rust
        // ignores SIGPIPE); one the CLI never opens stays blocked in open until the test ends.
        std::thread::spawn(move || {
            if let Ok(mut out) = std::fs::OpenOptions::new().write(true).open(&w) {
                let zeros = vec![0u8; 1 << 16];
                while std::io::Write::write_all(&mut out, &zeros).is_ok() {}
            }
        });
        p
    };
    let zero = f.path("zero");
    let made = std::process::Command::new("mknod")
        .args([&s(&zero), "c", "1", "5"])
        .status()
        .is_ok_and(|st| st.success())
        && std::fs::metadata(&zero).is_ok_and(|m| m.file_type().is_char_device());
    let run = |weights: &Path, inputs: &Path| {
        let t0 = std::time::Instant::now();
        let o = specplan(&[
            "run",
            "--plan",
            &s(&f.plan),
            "--weights",
            &s(weights),
            "--inputs",
            &s(inputs),
            "--out",
            &s(&f.path("o.safetensors")),
        ]);
        (o, t0.elapsed())
    };
    type Source<'a> = Box<dyn Fn(&str) -> PathBuf + 'a>;
    let mut sources: Vec<Source> = vec![Box::new(fifo)];
    if made {
        sources.push(Box::new(|_: &str| zero.clone()));
    }
    for source in &sources {
        for (n, what) in [(0, "the plan's weights can need"), (1, "a step's inputs can need")] {
            let endless = source(&format!("endless-{n}"));
            let (w, i) = if n == 0 {
                (endless, f.path("i.safetensors"))
            } else {
                (f.path("w.safetensors"), endless)
            };
            let (o, took) = run(&w, &i);
            assert_refused(&o, what);
            assert!(took.as_secs() < 30, "the capped read took {took:?}");
            assert!(!f.path("o.safetensors").exists());
        }
        // A config: --hf-config of an endless file.
        let o = specplan(&[
            "compile",
            "--hf-config",
            &s(&source("endless-config")),
            "--no-kernels",
            "-o",
            &s(&f.path("x.plan")),
        ]);
        assert_refused(&o, "a config can need");
        assert!(!f.path("x.plan").exists());
        for n in ["endless-0", "endless-1", "endless-config"] {
            let _ = std::fs::remove_file(f.path(n));
        }
    }
    // A regular file past the cap is refused from its size alone, before any read.
    let big = f.path("big.safetensors");
    let file = std::fs::File::create(&big).expect("create");
    file.set_len(specplan_contract::inputs_cap(&specplan_format::load_file(&f.plan).expect("plan")) + 1)
        .expect("sparse file");
    let (o, _) = run(&f.path("w.safetensors"), &big);
    assert_refused(&o, "a step's inputs can need");
}

/// Finite values whose forward overflows: request 1's hidden states at 3.3e38 (finite in
/// bf16, so the input check passes) make its outputs non-finite. The step is refused naming
/// the tensor and the request, with nothing written.
#[test]
fn outputs_that_overflow_are_refused_naming_the_request() {
    let mut f = files(&[]);
    let t = Files::tensor(&mut f.inputs, "hidden_states");
    let per = t.shape[1] * t.shape[2];
    let big = half::bf16::from_f32(3.3e38).to_bits();
    for at in per..2 * per {
        set16(t, at, big);
    }
    let out = f.path("o.safetensors");
    let o = f.run(&out);
    assert_refused(&o, "no outputs were written");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("[1]: element"), "request 1 is named: {err}");
    assert!(!out.exists());
}

/// A request whose prefix page is a page another request writes in the same step (their
/// K/V would race), or that names one of its own pages twice, is refused naming both
/// requests and the page-table entry.
#[test]
fn a_request_reading_a_page_another_writes_is_refused_naming_both() {
    let p = {
        let dir = tempfile::tempdir().expect("tempdir");
        let plan = dir.path().join("p.plan");
        compile_tiny(&plan, &[]);
        specplan_format::load_file(&plan).expect("load plan")
    };
    let (ps, n) = (p.capture.page_size as usize, p.spec.num_draft_tokens as usize);
    let i32s = |t: &FileTensor| -> Vec<i32> {
        t.bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    // A seed whose request 1 has a whole prefix page (entry 0 is then only read).
    let mut f = files(&[]);
    let seed = (1..200)
        .find(|&seed| {
            let t = input_tensors(&p, seed, 3, 20).expect("inputs");
            i32s(t.iter().find(|t| t.name == "prefix_lens").expect("prefix_lens"))[1] as usize >= ps
        })
        .expect("a seed with a full prefix page");
    f.inputs = input_tensors(&p, seed, 3, 20).expect("inputs");
    let prefix = i32s(Files::tensor(&mut f.inputs, "prefix_lens"));
    let table = Files::tensor(&mut f.inputs, "page_table");
    let cols = table.shape[1];
    let mut rows = i32s(table);
    let (l0, l1) = (prefix[0] as usize, prefix[1] as usize);
    let cases = [
        // Request 0's first write page as request 1's first page.
        (rows[l0 / ps], "which request 0 writes in this step"),
        // Request 1's own write page as its first page.
        (
            rows[cols + (l1 + n - 1) / ps],
            "which it also writes at another position",
        ),
    ];
    for (page, what) in cases {
        rows[cols] = page;
        let t = Files::tensor(&mut f.inputs, "page_table");
        t.bytes = rows.iter().flat_map(|x| x.to_le_bytes()).collect();
        f.refused(what);
    }
    // The message names the entry and the reader.
    rows[cols] = rows[l0 / ps];
    Files::tensor(&mut f.inputs, "page_table").bytes = rows.iter().flat_map(|x| x.to_le_bytes()).collect();
    let o = f.run(&f.path("o.safetensors"));
    assert_refused(&o, "page_table[1][0]: request 1 reads position");
}
