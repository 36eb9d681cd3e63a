"""The one thing pyproject.toml cannot say without an experimental table: the C extensions.

Both are optional: where they cannot be compiled (no compiler, no Python headers) the
install goes on and the pure-Python code they accelerate -- the reference the tests
compare them with -- serves instead:

- ``tokcache.store._speedups``: index probes and slot writes (``tokcache/store/_index.py``),
  and ``Hasher``, BLAKE3 for keys (the vendored official C implementation,
  ``tokcache/store/_blake3/``; else the ``blake3`` package serves);
- ``tokcache.engine._speedups``: the added-token scan and the key stream of a request
  (``tokcache/engine/boundaries.py``, ``tokcache/store/keys.py``); it hashes through the
  store extension's ``Hasher`` (a capsule: one BLAKE3 in the process).
"""

import platform

from setuptools import Extension, setup

STORE = "client/tokcache/store"
ENGINE = "client/tokcache/engine"
B3 = f"{STORE}/_blake3"
B3_SOURCES = [f"{B3}/blake3.c", f"{B3}/blake3_dispatch.c", f"{B3}/blake3_portable.c"]
B3_MACROS: list[tuple[str, str | None]] = []
if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86"):
    # Each SIMD file compiled for its instruction set (tk_*.c); chosen at run time by CPU.
    B3_SOURCES += [f"{B3}/tk_sse2.c", f"{B3}/tk_sse41.c", f"{B3}/tk_avx2.c", f"{B3}/tk_avx512.c"]
else:  # elsewhere (ARM included) the portable code: still C, no binding calls
    B3_MACROS += [("BLAKE3_USE_NEON", "0"), ("BLAKE3_NO_SSE2", None), ("BLAKE3_NO_SSE41", None),
                  ("BLAKE3_NO_AVX2", None), ("BLAKE3_NO_AVX512", None)]

# -fvisibility=hidden: the vendored BLAKE3's symbols stay inside the module (only PyInit_* is
# exported), whatever else in the process links a BLAKE3.
FLAGS = ["-O2", "-fvisibility=hidden"]
HEADERS = [f"{STORE}/_index.h", f"{STORE}/_hasher.h", f"{STORE}/_walk.h", f"{B3}/blake3.h", f"{B3}/blake3_impl.h",
           f"{B3}/blake3_sse2.c", f"{B3}/blake3_sse41.c", f"{B3}/blake3_avx2.c", f"{B3}/blake3_avx512.c"]

setup(ext_modules=[
    Extension("tokcache.store._speedups", [f"{STORE}/_speedups.c", f"{STORE}/_hasher.c", f"{STORE}/_walk.c", *B3_SOURCES], optional=True,
              extra_compile_args=FLAGS, include_dirs=[STORE], define_macros=B3_MACROS, depends=HEADERS),
    Extension("tokcache.engine._speedups", [f"{ENGINE}/_speedups.c", f"{ENGINE}/_ids.c"], optional=True,
              extra_compile_args=FLAGS, include_dirs=[STORE, ENGINE],
              depends=[*HEADERS, f"{ENGINE}/_pyint.h", f"{ENGINE}/_ids.h"]),
])
