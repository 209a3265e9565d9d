//! NVRTC at plan time: every kernel of every preset compiles (with and without a sliding
//! window and FR-Spec, bf16 and fp16), the PTX is ISA 9.0, the cache makes a warm compile
//! fast, and a compile error shows the log with numbered source lines.
//!
//! Built without the pinned NVRTC (not under `.ci/with-nvrtc`: `tests/build.rs`), the tests
//! are ignored and the summary says so; built with it, a missing NVRTC is a failure: CI must
//! not silently skip kernel compilation.

use std::time::Instant;

use specplan_compiler::config::{resolve, Overrides, Source, PRESETS};
use specplan_compiler::jit::{Jit, JitError};
use specplan_compiler::{compile, Target};
use specplan_kernels::source::full_source;
use specplan_kernels::Entry;

fn jit() -> Option<Jit> {
    Some(Jit::from_env().unwrap_or_else(|e| panic!("NVRTC was provided at build time but is unusable: {e}")))
}

#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn every_preset_kernel_compiles_to_sm90_and_ptx_9_0() {
    let Some(jit) = jit() else { return };
    let variants: Vec<(&str, Overrides)> = vec![
        ("plain", Overrides::default()),
        (
            "window+hot",
            Overrides {
                sliding_window: Some(256),
                hot_vocab_size: Some(512),
                draft_decode_steps: Some("auto".into()),
                ..Overrides::default()
            },
        ),
        (
            "draft-decode",
            Overrides {
                draft_decode_steps: Some("auto".into()),
                draft_decode_outputs: Some("tree,verify".into()),
                ..Overrides::default()
            },
        ),
        (
            "fp16",
            Overrides {
                dtype: Some("fp16".into()),
                ..Overrides::default()
            },
        ),
    ];
    let mut total = 0;
    for p in PRESETS {
        for (label, o) in &variants {
            // EAGLE-3 heads map ids through d2t: FR-Spec's hot rows are refused for them.
            let o = &match (p.name.contains("eagle3"), o.hot_vocab_size) {
                (true, Some(_)) => Overrides {
                    hot_vocab_size: None,
                    ..o.clone()
                },
                _ => o.clone(),
            };
            let cfg = resolve(&Source::Preset(p.name.into()), o).unwrap_or_else(|e| panic!("{} {label}: {e}", p.name));
            let c = compile(&cfg, &Target::default(), Some(&jit), &|_, _| {})
                .unwrap_or_else(|e| panic!("{} {label}: {e}", p.name));
            for k in &c.plan.kernels {
                let b = k.binary.as_ref().unwrap_or_else(|| panic!("{}: no binary", k.name));
                assert_eq!(b.arch, "sm_90");
                assert_eq!(&b.cubin[..4], b"\x7fELF", "{}: CUBIN is not an ELF image", k.name);
                let version = b
                    .ptx
                    .lines()
                    .find_map(|l| l.trim().strip_prefix(".version "))
                    .unwrap_or("");
                assert_eq!(
                    version.trim(),
                    "9.0",
                    "{}: PTX ISA must be 9.0 for the 580 driver",
                    k.name
                );
                assert!(
                    b.ptx.contains(&format!(".entry {}", k.entry)),
                    "{}: PTX lacks entry {}",
                    k.name,
                    k.entry
                );
                total += 1;
            }
            assert_eq!(c.plan.target.nvrtc.as_deref(), Some(jit.version.as_str()));
        }
    }
    println!("compiled {total} kernel instances");
}

#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn warm_recompile_hits_the_cache() {
    let Some(jit) = jit() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let jit = jit.with_cache_dir(Some(dir.path().to_path_buf()));
    for p in PRESETS {
        let cfg = resolve(&Source::Preset(p.name.into()), &Overrides::default()).expect("config");
        let t0 = Instant::now();
        let cold = compile(&cfg, &Target::default(), Some(&jit), &|_, _| {}).expect("cold compile");
        let cold_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let warm = compile(&cfg, &Target::default(), Some(&jit), &|_, _| {}).expect("warm compile");
        let warm_s = t1.elapsed().as_secs_f64();
        let (cs, ws) = (cold.jit.expect("stats"), warm.jit.expect("stats"));
        println!(
            "{}: {} kernels, cold {:.3} s ({} compiled), warm {:.3} s ({} cached)",
            p.name,
            cold.plan.kernels.len(),
            cold_s,
            cs.compiled,
            warm_s,
            ws.cached
        );
        assert_eq!(ws.compiled, 0, "{}: warm compile missed the cache", p.name);
        assert_eq!(cold.plan.plan(), warm.plan.plan(), "{}: cached binaries differ", p.name);
        assert!(warm_s < 1.0, "{}: warm compile took {warm_s:.3} s", p.name);
    }
}

/// A cache entry with a flipped byte, cut short, or replaced by a FIFO is a miss: the kernel
/// is compiled again (never a corrupted binary into the plan, never a blocked read), and the
/// plan equals the cold one.
#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn a_damaged_cache_entry_is_compiled_again() {
    let Some(jit) = jit() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let jit = jit.with_cache_dir(Some(dir.path().to_path_buf()));
    let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("config");
    let cold = compile(&cfg, &Target::default(), Some(&jit), &|_, _| {}).expect("cold compile");
    let mut entries: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path())
        .expect("cache folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    entries.sort();
    assert!(entries.len() >= 3, "cache entries: {entries:?}");
    // A byte flipped in the middle (inside the CUBIN), one cut short, one a FIFO (made here,
    // in the temp folder).
    let mut bytes = std::fs::read(&entries[0]).expect("entry");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&entries[0], &bytes).expect("flip");
    let cut = std::fs::read(&entries[1]).expect("entry");
    std::fs::write(&entries[1], &cut[..cut.len() - 7]).expect("cut");
    std::fs::remove_file(&entries[2]).expect("remove");
    let made = std::process::Command::new("mkfifo")
        .arg(&entries[2])
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let warm = compile(&cfg, &Target::default(), Some(&jit), &|_, _| {}).expect("warm compile");
    let ws = warm.jit.expect("stats");
    assert_eq!(
        ws.compiled, 3,
        "the three damaged entries are compiled again ({} cached)",
        ws.cached
    );
    assert_eq!(cold.plan.plan(), warm.plan.plan(), "a damaged entry reached the plan");
}

#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn compile_errors_show_the_kernel_and_numbered_source() {
    let Some(jit) = jit() else { return };
    let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("config");
    let c = compile(&cfg, &Target::default(), None, &|_, _| {}).expect("compile");
    let mut k = c
        .plan
        .kernels
        .iter()
        .find(|k| k.entry == Entry::RmsNorm)
        .expect("rmsnorm kernel")
        .clone();
    // Drop a constant the template needs: the generated prelude no longer declares it.
    k.constants.retain(|(n, _)| n != "HIDDEN");
    let facts = specplan_format::kernel_facts_of(&c.plan);
    let source = full_source(k.entry.template(), &k.constants, &facts);
    let err = jit
        .with_cache_dir(None)
        .compile_one(&k, &source, 90)
        .expect_err("must fail");
    let msg = err.to_string();
    assert!(matches!(err, JitError::Compile { .. }), "{msg}");
    assert!(msg.contains(&k.name), "{msg}");
    assert!(msg.contains("HIDDEN"), "{msg}");
    assert!(
        msg.lines().any(|l| l.starts_with('>') && l.contains(" | ")),
        "no numbered source line marked:\n{msg}"
    );
}

/// `rebuild_kernels` replaces the binaries a plan file carries by ones compiled here from
/// the plan's validated constants: a plan whose kernels carry machine code of the same
/// entries compiled for other constants (well-formed ELF with the right symbols, which
/// validation cannot tell from the honest code) gets the honest binaries back.
#[test]
#[cfg_attr(not(specplan_nvrtc), ignore = "needs the pinned NVRTC: run under .ci/with-nvrtc")]
fn rebuilt_kernels_replace_the_binaries_a_plan_carries() {
    let Some(jit) = jit() else { return };
    let cfg = resolve(&Source::Preset("tiny".into()), &Overrides::default()).expect("tiny");
    let honest = compile(&cfg, &Target::default(), Some(&jit), &|_, _| {})
        .expect("compile")
        .plan;
    let other = resolve(
        &Source::Preset("tiny".into()),
        &Overrides {
            num_draft_tokens: Some(8),
            ..Overrides::default()
        },
    )
    .expect("tiny n8");
    let other = compile(&other, &Target::default(), Some(&jit), &|_, _| {})
        .expect("compile")
        .plan;
    let mut forged = honest.plan().clone();
    let mut swapped = 0;
    for k in &mut forged.kernels {
        let Some(o) = other
            .kernels
            .iter()
            .find(|o| o.entry == k.entry && o.source_hash != k.source_hash)
        else {
            continue;
        };
        if let (Some(b), Some(ob)) = (&mut k.binary, &o.binary) {
            b.cubin = ob.cubin.clone();
            b.ptx = ob.ptx.clone();
            swapped += 1;
        }
    }
    assert!(swapped > 0, "some entries differ between N 4 and N 8");
    let forged = specplan_format::validate(forged).expect("foreign machine code of the right entries validates");
    let rebuilt = specplan_compiler::rebuild_kernels(&forged, &jit).expect("rebuild");
    for (a, b) in rebuilt.kernels.iter().zip(&honest.kernels) {
        assert_eq!(
            a.binary, b.binary,
            "kernel {}: the rebuilt binary is the honest one",
            a.name
        );
    }
    println!("{swapped} kernels carried another instance's machine code; the rebuild restored all");
}
