//! Plan-time kernel compilation with NVRTC (through cudarc), with an on-disk cache.
//!
//! Each kernel instance is compiled twice: to an `sm_<N>` CUBIN (what the runtime loads) and
//! to `compute_<N>` PTX (the fallback). Results are cached by SHA-256 of the full source,
//! the options and the NVRTC version, so a warm recompile reads files instead of compiling.
//! No GPU is needed: NVRTC comes from pip wheels (see `.ci/with-nvrtc`).

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use specplan_format::{KernelBinary, KernelDesc};

/// Highest PTX ISA the GPU machine's driver (580, CUDA 13.0) accepts.
pub const MAX_PTX_ISA: (u32, u32) = (9, 0);

pub const PROVISION: &str = "provision it with `.ci/with-nvrtc <command>` (installs the pinned pip wheels \
nvidia-cuda-nvrtc==13.0.88 and nvidia-cuda-runtime==13.0.96 into ~/.cache/specplan, where specplan \
finds them afterwards without it), `pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96` \
into the active Python environment, or set CUDA_HOME to a CUDA 13.0 toolkit; `specplan doctor` shows \
where it looked";

#[derive(Debug, thiserror::Error)]
pub enum JitError {
    #[error("NVRTC (libnvrtc.so.13 with the CUDA headers) was not found (looked at: {0}); {PROVISION}")]
    NotFound(String),
    #[error("kernel {kernel} failed to compile for {arch}:\n{log}\n{excerpt}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
        excerpt: String,
    },
    #[error("kernel {kernel}: NVRTC {what} failed: {message}{hint}")]
    Nvrtc {
        kernel: String,
        what: &'static str,
        message: String,
        hint: String,
    },
    #[error("kernel {kernel}: NVRTC emitted PTX ISA {found}, but the target driver accepts at most {}.{}; use NVRTC 13.0 ({PROVISION})", MAX_PTX_ISA.0, MAX_PTX_ISA.1)]
    PtxTooNew { kernel: String, found: String },
}

/// A configured NVRTC.
#[derive(Clone, Debug)]
pub struct Jit {
    include_dir: PathBuf,
    /// "13.0.88": the wheel's version when NVRTC comes from a wheel folder, else "13.0"
    /// from nvrtcVersion ([`wheel_version`]).
    pub version: String,
    cache_dir: Option<PathBuf>,
}

/// Counts of one `compile_all` call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JitStats {
    pub compiled: usize,
    pub cached: usize,
}

impl Jit {
    /// NVRTC and the CUDA headers from where `nvrtc_locate` finds them (no environment
    /// needed); kernels cached in `SPECPLAN_CACHE_DIR` or `~/.cache/specplan/kernels`
    /// (`SPECPLAN_CACHE_DIR=off` disables the cache).
    pub fn from_env() -> Result<Jit, JitError> {
        Self::discover(&[])
    }

    /// As `from_env`, also looking in `nvidia` wheel folders the caller knows of (the
    /// Python package passes its environment's).
    pub fn discover(extra: &[PathBuf]) -> Result<Jit, JitError> {
        let found = crate::nvrtc_locate::locate(extra).map_err(JitError::NotFound)?;
        let include = found.include_dir.to_string_lossy().into_owned();
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is present (checked above); the out-pointers are valid locals.
        let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(JitError::NotFound(format!("{}: nvrtcVersion failed", found.origin)));
        }
        let version = wheel_version(&found.include_dir, major, minor);
        let cache_dir = match std::env::var("SPECPLAN_CACHE_DIR") {
            Ok(v) if v == "off" => None,
            Ok(v) if !v.is_empty() => Some(PathBuf::from(v)),
            _ => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/specplan/kernels")),
        };
        Ok(Jit {
            include_dir: PathBuf::from(include),
            version,
            cache_dir,
        })
    }

    /// Replaces the cache directory (tests use a fresh one to measure cold compiles).
    pub fn with_cache_dir(mut self, dir: Option<PathBuf>) -> Jit {
        self.cache_dir = dir;
        self
    }

    fn options(&self, arch: &str) -> Vec<String> {
        vec![
            format!("--gpu-architecture={arch}"),
            "-std=c++17".into(),
            format!("--include-path={}", self.include_dir.display()),
        ]
    }

    /// Compiles (or loads from the cache) every kernel of a plan for `sm`, in parallel;
    /// `sources[i]` is the full source of `kernels[i]`.
    pub fn compile_all(&self, kernels: &mut [KernelDesc], sources: &[String], sm: u32) -> Result<JitStats, JitError> {
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 8);
        let chunk = kernels.len().div_ceil(workers).max(1);
        let results: Vec<Result<JitStats, JitError>> = std::thread::scope(|s| {
            let handles: Vec<_> = kernels
                .chunks_mut(chunk)
                .zip(sources.chunks(chunk))
                .map(|(part, srcs)| {
                    s.spawn(move || {
                        let mut st = JitStats::default();
                        for (k, src) in part.iter_mut().zip(srcs) {
                            let (bin, cached) = self.compile_one(k, src, sm)?;
                            k.binary = Some(bin);
                            if cached {
                                st.cached += 1;
                            } else {
                                st.compiled += 1;
                            }
                        }
                        Ok(st)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(JitError::Nvrtc {
                            kernel: "(worker)".into(),
                            what: "compile thread",
                            message: "panicked".into(),
                            hint: String::new(),
                        })
                    })
                })
                .collect()
        });
        let mut total = JitStats::default();
        for r in results {
            let st = r?;
            total.compiled += st.compiled;
            total.cached += st.cached;
        }
        Ok(total)
    }

    /// One kernel from its full source: from the cache when the key matches, else NVRTC
    /// (CUBIN + PTX). The binary is bound to the source's hash.
    pub fn compile_one(&self, k: &KernelDesc, source: &str, sm: u32) -> Result<(KernelBinary, bool), JitError> {
        let source = source.to_string();
        let (real, virt) = (format!("sm_{sm}"), format!("compute_{sm}"));
        let mut h = Sha256::new();
        h.update(source.as_bytes());
        for o in self.options(&real).iter().chain(self.options(&virt).iter()) {
            h.update(o.as_bytes());
            h.update([0]);
        }
        h.update(self.version.as_bytes());
        let key: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if let Some(bin) = self
            .cache_dir
            .as_ref()
            .and_then(|d| read_cache(&d.join(format!("{key}.bin")), &real, &k.source_hash))
            .filter(|b| check_ptx_version(&k.name, &b.ptx).is_ok())
        {
            return Ok((bin, true));
        }
        // The program is named after its source, not the kernel: the name lands in the
        // binary's internal symbols, and kernels of one source (the entries of a template)
        // share one cached binary, so a per-kernel name would make a plan's bytes depend on
        // which entry was compiled first.
        let program = format!("k{}", &k.source_hash[..k.source_hash.len().min(16)]);
        let cubin = self.nvrtc(&k.name, &program, &source, &real, Output::Cubin)?;
        let ptx_bytes = self.nvrtc(&k.name, &program, &source, &virt, Output::Ptx)?;
        let ptx = String::from_utf8_lossy(&ptx_bytes).trim_end_matches('\0').to_string();
        check_ptx_version(&k.name, &ptx)?;
        let bin = KernelBinary {
            arch: real,
            source_hash: k.source_hash.clone(),
            cubin,
            ptx,
        };
        if let Some(d) = &self.cache_dir {
            // A failed cache write only costs a recompile next time.
            let _ = write_cache(d, &format!("{key}.bin"), &bin);
        }
        Ok((bin, false))
    }

    fn nvrtc(&self, kernel: &str, program: &str, source: &str, arch: &str, out: Output) -> Result<Vec<u8>, JitError> {
        use cudarc::nvrtc::{result, sys};
        let fail = |what: &'static str, e: &dyn std::fmt::Debug| {
            let message = format!("{e:?}");
            let hint = if message.contains("BUILTIN") {
                format!(" (libnvrtc-builtins.so must sit next to libnvrtc.so; {PROVISION})")
            } else {
                String::new()
            };
            JitError::Nvrtc {
                kernel: kernel.into(),
                what,
                message,
                hint,
            }
        };
        let src = CString::new(source).map_err(|e| fail("source", &e))?;
        let name = CString::new(format!("{program}.cu")).map_err(|e| fail("name", &e))?;
        let prog = result::create_program(&src, Some(&name)).map_err(|e| fail("create", &e))?;
        let opts = self.options(arch);
        // SAFETY: `prog` was just created and is destroyed exactly once below; `src` and
        // `name` outlive it.
        let compiled = unsafe { result::compile_program(prog, &opts) };
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        let out = match compiled {
            Err(_) => Err(JitError::Compile {
                kernel: kernel.into(),
                arch: arch.into(),
                excerpt: excerpt(source, &log),
                log,
            }),
            Ok(()) => match out {
                // SAFETY: compiled successfully; sizes come from NVRTC itself.
                Output::Ptx => unsafe { result::get_ptx(prog) }
                    .map(|p| p.iter().map(|&c| c as u8).collect())
                    .map_err(|e| fail("get PTX", &e)),
                Output::Cubin => {
                    let mut size = 0usize;
                    // SAFETY: compiled for a real arch, so a CUBIN exists; `size` is a valid out-pointer.
                    let rc = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
                    let mut buf = vec![0u8; size];
                    // SAFETY: `buf` has exactly the size NVRTC reported.
                    let rc2 = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) };
                    if rc != sys::nvrtcResult::NVRTC_SUCCESS || rc2 != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                        Err(fail("get CUBIN", &(rc, rc2)))
                    } else {
                        Ok(buf)
                    }
                }
            },
        };
        // SAFETY: destroyed once, after its last use.
        let _ = unsafe { result::destroy_program(prog) };
        out
    }
}

#[derive(Clone, Copy)]
enum Output {
    Cubin,
    Ptx,
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The numbered source lines around each line the log points at (`name.cu(123): error`).
fn excerpt(source: &str, log: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let mut wanted: Vec<usize> = log
        .lines()
        .filter_map(|l| {
            let open = l.find(".cu(")?;
            let rest = &l[open + 4..];
            rest[..rest.find(')')?].parse::<usize>().ok()
        })
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    let mut out = String::new();
    let mut shown_to = 0usize;
    for w in wanted.into_iter().take(8) {
        let lo = w.saturating_sub(3).max(1).max(shown_to + 1);
        let hi = (w + 2).min(lines.len());
        if lo > hi {
            continue;
        }
        out.push_str("  ...\n");
        for n in lo..=hi {
            let mark = if n == w { ">" } else { " " };
            out.push_str(&format!("{mark}{n:5} | {}\n", lines[n - 1]));
        }
        shown_to = hi;
    }
    out
}

/// The NVRTC version a plan records: the `nvidia-cuda-nvrtc` wheel's own version when the
/// headers come from a wheel folder (`<root>/nvidia/cu13/include` beside
/// `<root>/nvidia_cuda_nvrtc-X.dist-info`), else `major.minor` from `nvrtcVersion`. It
/// depends only on the NVRTC found, never on how it was found (`.ci/with-nvrtc` or a plain
/// run), so both give byte-identical plans and share one kernel cache.
fn wheel_version(include_dir: &std::path::Path, major: i32, minor: i32) -> String {
    let short = format!("{major}.{minor}");
    let root = include_dir.ancestors().nth(3);
    let from_wheel = root.and_then(|r| std::fs::read_dir(r).ok()).and_then(|entries| {
        let mut found: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let v = name
                    .strip_prefix("nvidia_cuda_nvrtc-")?
                    .strip_suffix(".dist-info")?
                    .to_string();
                v.starts_with(&format!("{short}.")).then_some(v)
            })
            .collect();
        found.sort();
        found.pop()
    });
    from_wheel.unwrap_or(short)
}

/// Rejects PTX newer than the driver accepts (reads the `.version X.Y` directive).
pub fn check_ptx_version(kernel: &str, ptx: &str) -> Result<(), JitError> {
    let found = ptx
        .lines()
        .find_map(|l| l.trim().strip_prefix(".version "))
        .map(|v| v.trim().to_string())
        .unwrap_or_default();
    let parsed = found
        .split_once('.')
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)));
    match parsed {
        Some(v) if v <= MAX_PTX_ISA => Ok(()),
        _ => Err(JitError::PtxTooNew {
            kernel: kernel.into(),
            found,
        }),
    }
}

/// Bytes of a cache entry's trailer: the SHA-256 of the postcard before it.
const CACHE_DIGEST: usize = 32;

/// Cache entry: postcard of the binary, then its SHA-256. An entry that is not a regular
/// file, does not match its digest (a flipped byte would otherwise go into the plan, and the
/// plan's checksum would cover it), does not decode, or was built for another arch or source
/// counts as a miss: the kernel is compiled again and the entry rewritten.
fn read_cache(path: &Path, arch: &str, source_hash: &str) -> Option<KernelBinary> {
    // A FIFO or device node in the cache folder would block or never end a read.
    if !std::fs::symlink_metadata(path).ok()?.is_file() {
        return None;
    }
    let bytes = std::fs::read(path).ok()?;
    let (body, digest) = bytes.split_at_checked(bytes.len().checked_sub(CACHE_DIGEST)?)?;
    if Sha256::digest(body).as_slice() != digest {
        return None;
    }
    let bin: KernelBinary = postcard::from_bytes(body).ok()?;
    (bin.arch == arch && bin.source_hash == source_hash && !bin.cubin.is_empty()).then_some(bin)
}

fn write_cache(dir: &Path, file: &str, bin: &KernelBinary) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut bytes = postcard::to_allocvec(bin).map_err(std::io::Error::other)?;
    let digest = Sha256::digest(&bytes);
    bytes.extend_from_slice(&digest);
    let tmp = tempfile::NamedTempFile::new_in(dir)?;
    std::fs::write(tmp.path(), bytes)?;
    tmp.persist(dir.join(file)).map_err(|e| e.error)?;
    Ok(())
}
