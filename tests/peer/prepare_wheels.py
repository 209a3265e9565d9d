#!/usr/bin/env python3
"""Downloads the FlashInfer peer's wheels into DIR (default .whl) and slims flashinfer's so
they travel to the GPU machine together with our bundle (a device call carries 64 MiB).

The FA2 batch-prefill JIT module needs flashinfer's Python package, data/include, cutlass,
cccl, spdlog and the batch-prefill sources in data/csrc; the slimmed wheel drops only
data/csrc sources of unrelated kernels (MoE, sampling, Blackwell, experimental), about
26 MB compressed, and rewrites RECORD to match.

  python3 tests/peer/prepare_wheels.py [DIR]     # here (PyPI is reachable here only)
  echo /.whl/ >> .git/info/exclude               # keep the wheels out of git
On the device: pip install --no-index --no-deps --target /tmp/site DIR/*.whl
"""
import os
import subprocess
import sys
import zipfile

DROP = (
    "flashinfer/data/csrc/cake_",
    "flashinfer/data/csrc/kda/",
    "flashinfer/data/csrc/fused_moe/",
    "flashinfer/data/csrc/gdn/",
    "flashinfer/data/csrc/experimental/",
    "flashinfer/data/csrc/blackwell_",
    "flashinfer/data/csrc/nv_internal/",
    "flashinfer/data/csrc/alphamoe",
)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else ".whl"
    os.makedirs(out, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
         "-d", out, "flashinfer-python==0.7.2.post1", "apache-tvm-ffi>=0.1.11,<0.2"],
        check=True,
    )
    src = os.path.join(out, "flashinfer_python-0.7.2.post1-py3-none-any.whl")
    tmp = src + ".slim"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.startswith(DROP):
                continue
            data = zin.read(name)
            if name.endswith(".dist-info/RECORD"):
                lines = [l for l in data.decode().splitlines() if not l.startswith(DROP)]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, data)
    os.replace(tmp, src)
    for f in sorted(os.listdir(out)):
        print(f"{os.path.getsize(os.path.join(out, f)) / 1e6:7.1f} MB  {f}")


if __name__ == "__main__":
    main()
