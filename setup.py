"""The one thing pyproject.toml cannot say without an experimental table: the C extensions.

Both are optional: where they cannot be compiled (no compiler, no Python headers) the
install goes on and the pure-Python code they accelerate -- the reference the tests
compare them with -- serves instead:

- ``tokcache.store._speedups``: index probes and slot writes (``tokcache/store/_index.py``);
- ``tokcache.engine._speedups``: the added-token scan and the key stream of a request
  (``tokcache/engine/boundaries.py``, ``tokcache/store/keys.py``).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(name, [source], optional=True, extra_compile_args=["-O2"], include_dirs=["client/tokcache/store"],
              depends=["client/tokcache/store/_index.h"])
    for name, source in (("tokcache.store._speedups", "client/tokcache/store/_speedups.c"),
                         ("tokcache.engine._speedups", "client/tokcache/engine/_speedups.c"))
])
