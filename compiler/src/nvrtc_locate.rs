//! Finding NVRTC and the CUDA headers without environment variables.
//!
//! cudarc opens `libnvrtc.so.13` by name through the loader. When the library is not on the
//! loader path, we look in the usual places and load it (and the `libnvrtc-builtins` it
//! opens itself) by full path first, with `RTLD_GLOBAL`: the loader then resolves cudarc's
//! open by name to the copy already loaded (it matches loaded objects by their soname).
//!
//! Places, in order (the first with both the library and `cuda_bf16.h` wins):
//! 1. the loader path + `SPECPLAN_CUDA_INCLUDE` (what `.ci/with-nvrtc` sets),
//! 2. roots given by the caller (the Python package passes its environment's `nvidia`
//!    folders),
//! 3. the folder `.ci/with-nvrtc` fills (`SPECPLAN_NVRTC_ROOT` or
//!    `~/.cache/specplan/nvrtc-13.0.88`),
//! 4. an active Python environment's `nvidia` wheels (`VIRTUAL_ENV`, `CONDA_PREFIX`, the
//!    user site),
//! 5. `CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The NVRTC wheel `.ci/with-nvrtc` installs (the driver on the GPU machine takes PTX ISA
/// ≤ 9.0, which NVRTC 13.0 emits).
pub const PINNED_NVRTC: &str = "13.0.88";

/// One place NVRTC may live: where it came from, its library folder and its headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub origin: String,
    pub lib_dir: PathBuf,
    pub include_dir: PathBuf,
}

impl Candidate {
    /// The NVRTC library file in `lib_dir`, if any.
    pub fn library(&self) -> Option<PathBuf> {
        ["libnvrtc.so.13", "libnvrtc.so"]
            .iter()
            .map(|n| self.lib_dir.join(n))
            .find(|p| p.is_file())
    }

    /// Whether both the library and the headers are there.
    pub fn complete(&self) -> bool {
        self.library().is_some() && self.include_dir.join("cuda_bf16.h").is_file()
    }
}

/// Library and header folders under a wheel's `nvidia` folder (CUDA 13 wheels put both
/// under `cu13/`; CUDA 12 wheels split them by package).
fn wheel_layouts(nvidia: &Path, origin: &str, out: &mut Vec<Candidate>) {
    out.push(Candidate {
        origin: origin.to_string(),
        lib_dir: nvidia.join("cu13/lib"),
        include_dir: nvidia.join("cu13/include"),
    });
    out.push(Candidate {
        origin: origin.to_string(),
        lib_dir: nvidia.join("cuda_nvrtc/lib"),
        include_dir: nvidia.join("cuda_runtime/include"),
    });
}

/// `site-packages/nvidia` folders under a Python prefix (`lib/python3.*/site-packages`).
fn site_nvidia(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages/nvidia"))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out
}

/// Every place to look, in order, after the loader path (see the module header). `extra`:
/// `nvidia` folders the caller knows of (the Python package's environment).
pub fn candidates(extra: &[PathBuf]) -> Vec<Candidate> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let mut out = Vec::new();
    for nv in extra {
        wheel_layouts(nv, &format!("python package ({})", nv.display()), &mut out);
    }
    let pinned = env("SPECPLAN_NVRTC_ROOT")
        .or_else(|| env("HOME").map(|h| h.join(format!(".cache/specplan/nvrtc-{PINNED_NVRTC}"))));
    if let Some(root) = pinned {
        wheel_layouts(&root.join("nvidia"), ".ci/with-nvrtc cache", &mut out);
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env(var) {
            for nv in site_nvidia(&prefix) {
                wheel_layouts(&nv, &format!("{var} ({})", nv.display()), &mut out);
            }
        }
    }
    if let Some(home) = env("HOME") {
        for nv in site_nvidia(&home.join(".local")) {
            wheel_layouts(&nv, &format!("user site ({})", nv.display()), &mut out);
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env(var) {
            out.push(Candidate {
                origin: var.to_string(),
                lib_dir: root.join("lib64"),
                include_dir: root.join("include"),
            });
        }
    }
    out.push(Candidate {
        origin: "/usr/local/cuda".into(),
        lib_dir: PathBuf::from("/usr/local/cuda/lib64"),
        include_dir: PathBuf::from("/usr/local/cuda/include"),
    });
    out
}

/// What `locate` settled on.
#[derive(Clone, Debug)]
pub struct Located {
    pub origin: String,
    /// The library loaded by path (`None`: found on the loader path).
    pub library: Option<PathBuf>,
    pub include_dir: PathBuf,
}

static LOCATED: OnceLock<Result<Located, String>> = OnceLock::new();

/// Finds NVRTC and its headers once per process and makes the library loadable by cudarc.
/// `Err` lists every place looked at.
pub fn locate(extra: &[PathBuf]) -> Result<Located, String> {
    LOCATED.get_or_init(|| locate_uncached(extra)).clone()
}

fn locate_uncached(extra: &[PathBuf]) -> Result<Located, String> {
    let include_env = std::env::var("SPECPLAN_CUDA_INCLUDE").ok().filter(|s| !s.is_empty());
    // SAFETY: probing dlopen candidates has no preconditions; it only loads libraries.
    let on_path = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if on_path {
        if let Some(inc) = &include_env {
            if Path::new(inc).join("cuda_bf16.h").is_file() {
                return Ok(Located {
                    origin: "loader path + SPECPLAN_CUDA_INCLUDE".into(),
                    library: None,
                    include_dir: PathBuf::from(inc),
                });
            }
        }
    }
    let all = candidates(extra);
    let mut tried = Vec::new();
    for c in &all {
        let Some(lib) = c.library() else {
            tried.push(format!("{}: no libnvrtc in {}", c.origin, c.lib_dir.display()));
            continue;
        };
        if !c.include_dir.join("cuda_bf16.h").is_file() {
            tried.push(format!("{}: no cuda_bf16.h in {}", c.origin, c.include_dir.display()));
            continue;
        }
        if !on_path {
            if let Err(e) = preload(&c.lib_dir, &lib) {
                tried.push(format!("{}: {e}", c.origin));
                continue;
            }
        }
        return Ok(Located {
            origin: c.origin.clone(),
            library: (!on_path).then_some(lib),
            include_dir: include_env
                .as_ref()
                .map(PathBuf::from)
                .filter(|p| p.join("cuda_bf16.h").is_file())
                .unwrap_or_else(|| c.include_dir.clone()),
        });
    }
    Err(tried.join("; "))
}

/// Loads `libnvrtc-builtins` (when beside it) and NVRTC by full path, globally, for the
/// rest of the process (the handles are leaked on purpose: cudarc keeps using them).
fn preload(dir: &Path, lib: &Path) -> Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut builtins: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("libnvrtc-builtins.so"))
            })
            .collect();
        builtins.sort();
        if let Some(b) = builtins.last() {
            // SAFETY: loading NVIDIA's builtins library runs no initializers we depend on;
            // it is what NVRTC itself would open.
            let h = unsafe { Library::open(Some(b), RTLD_NOW | RTLD_GLOBAL) }
                .map_err(|e| format!("cannot load {}: {e}", b.display()))?;
            std::mem::forget(h);
        }
    }
    // SAFETY: as above, for NVRTC itself.
    let h = unsafe { Library::open(Some(lib), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("cannot load {}: {e}", lib.display()))?;
    std::mem::forget(h);
    // SAFETY: probing as in `locate_uncached`; now it must find the loaded copy.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(format!(
            "loaded {}, but cudarc still cannot open NVRTC by name",
            lib.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_folders_come_before_system_cuda() {
        let extra = vec![PathBuf::from("/tmp/site/nvidia")];
        let c = candidates(&extra);
        assert_eq!(c[0].lib_dir, PathBuf::from("/tmp/site/nvidia/cu13/lib"));
        assert_eq!(c[0].include_dir, PathBuf::from("/tmp/site/nvidia/cu13/include"));
        assert_eq!(c.last().map(|c| c.origin.as_str()), Some("/usr/local/cuda"));
    }

    #[test]
    fn a_folder_without_the_library_is_incomplete() {
        let dir = std::env::temp_dir().join(format!("specplan-locate-{}", std::process::id()));
        let (lib, inc) = (dir.join("lib"), dir.join("include"));
        std::fs::create_dir_all(&lib).expect("temp lib dir");
        std::fs::create_dir_all(&inc).expect("temp include dir");
        let c = Candidate {
            origin: "t".into(),
            lib_dir: lib.clone(),
            include_dir: inc.clone(),
        };
        assert!(!c.complete());
        std::fs::write(inc.join("cuda_bf16.h"), "").expect("header");
        assert!(!c.complete());
        std::fs::write(lib.join("libnvrtc.so.13"), "").expect("library stand-in");
        assert!(c.complete());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
