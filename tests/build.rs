//! Which of the tests that need a GPU or NVRTC can run where these tests are built (they run
//! on the same machine: `cargo test`): `specplan_gpu` when a CUDA driver library is present,
//! `specplan_nvrtc` when the pinned NVRTC is provided (`.ci/with-nvrtc` sets
//! SPECPLAN_NVRTC_VERSION). A test that cannot run is then marked ignored with the reason, so
//! the test summary says it did not run instead of printing `ok` for a check it did not make.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(specplan_gpu)");
    println!("cargo::rustc-check-cfg=cfg(specplan_nvrtc)");
    println!("cargo::rerun-if-env-changed=SPECPLAN_NVRTC_VERSION");
    println!("cargo::rerun-if-env-changed=SPECPLAN_CUDA_INCLUDE");
    let driver: Vec<&str> = [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
        "/usr/lib/libcuda.so.1",
        "/usr/local/cuda/compat/libcuda.so.1",
        "/usr/lib/wsl/lib/libcuda.so.1",
    ]
    .into_iter()
    .filter(|p| std::path::Path::new(p).exists())
    .collect();
    // Only paths that exist are watched: cargo treats a missing watched path as always stale.
    for p in &driver {
        println!("cargo::rerun-if-changed={p}");
    }
    if !driver.is_empty() && std::path::Path::new("/dev/nvidiactl").exists() {
        println!("cargo::rustc-cfg=specplan_gpu");
    }
    if std::env::var_os("SPECPLAN_NVRTC_VERSION").is_some() || std::env::var_os("SPECPLAN_CUDA_INCLUDE").is_some() {
        println!("cargo::rustc-cfg=specplan_nvrtc");
    }
}
