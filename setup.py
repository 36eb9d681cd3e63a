"""The one thing pyproject.toml cannot say without an experimental table: the C extensions.

Both are part of the build: a compile or link error fails the install, and the package
refuses to import without them (``tokcache/native.py``). The Python code they accelerate
stays the reference the tests compare them with (``TOKCACHE_PURE_PYTHON=1`` runs it):

- ``tokcache.store._speedups``: index probes, slot writes and record writes
  (``tokcache/store/_index.py``, ``_log.py``), and ``Hasher``, SHA-256 for keys and record
  checks from OpenSSL's libcrypto (Debian: ``libssl-dev`` to build, ``libssl3`` to run);
- ``tokcache.engine._speedups``: the added-token scan and the key stream of a request
  (``tokcache/engine/boundaries.py``, ``tokcache/store/keys.py``); it hashes through the
  store extension's ``Hasher`` (a capsule: one hasher type in the process).
"""

from setuptools import Extension, setup

STORE = "client/tokcache/store"
ENGINE = "client/tokcache/engine"

# -fvisibility=hidden: only PyInit_* is exported (the modules share code through a capsule,
# not through symbols).
FLAGS = ["-O2", "-fvisibility=hidden"]
HEADERS = [f"{STORE}/_index.h", f"{STORE}/_hasher.h", f"{STORE}/_walk.h"]

setup(ext_modules=[
    Extension("tokcache.store._speedups", [f"{STORE}/_speedups.c", f"{STORE}/_hasher.c", f"{STORE}/_walk.c"],
              libraries=["crypto"], extra_compile_args=FLAGS, include_dirs=[STORE], depends=HEADERS),
    Extension("tokcache.engine._speedups", [f"{ENGINE}/_speedups.c", f"{ENGINE}/_ids.c"],
              extra_compile_args=FLAGS, include_dirs=[STORE, ENGINE],
              depends=[*HEADERS, f"{ENGINE}/_pyint.h", f"{ENGINE}/_ids.h"]),
])
