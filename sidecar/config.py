"""Server configuration: defaults < config file (TOML) < TOKCACHE_* env < CLI flags.

Every field can come from each of the four sources; names map 1:1
(``shm_size`` ↔ ``--shm-size`` ↔ ``TOKCACHE_SHM_SIZE`` ↔ ``shm_size = …``).
``models`` is a table in TOML (``[models] qwen3 = "/models/qwen3"``), a
comma-separated ``NAME=DIR,NAME=DIR`` list in the environment, and repeated
``--model NAME=DIR`` flags on the command line.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["Config", "ConfigError", "ENV", "ModelSpec", "flag", "load_config", "parse_size"]

DEFAULT_LISTEN = "unix:///run/tokcache/tokcache.sock"
DEFAULT_SHM_SIZE = 256 << 20
DEFAULT_SHM_PREFIX = "tokcache"
DEFAULT_MODE = "kv-stable"
MODES = ("kv-stable", "exact")
BACKENDS = ("fastokens", "tokenizers")

# The environment variables, declared once.
ENV = {
    "config": "TOKCACHE_CONFIG",
    "listen": "TOKCACHE_LISTEN",
    "models": "TOKCACHE_MODELS",
    "shm_size": "TOKCACHE_SHM_SIZE",
    "shm_prefix": "TOKCACHE_SHM_PREFIX",
    "default_mode": "TOKCACHE_MODE",
    "max_text_bytes": "TOKCACHE_MAX_TEXT_BYTES",
    "max_messages": "TOKCACHE_MAX_MESSAGES",
    "max_request_bytes": "TOKCACHE_MAX_REQUEST_BYTES",
    "ttl_l0": "TOKCACHE_TTL_L0",
    "ttl_l1": "TOKCACHE_TTL_L1",
    "ttl_ar": "TOKCACHE_TTL_AR",
    "backends": "TOKCACHE_BACKENDS",
    "log_level": "TOKCACHE_LOG_LEVEL",
    "grace_seconds": "TOKCACHE_GRACE_SECONDS",
    "metrics_port": "TOKCACHE_METRICS_PORT",
    "metrics_addr": "TOKCACHE_METRICS_ADDR",
    "log_format": "TOKCACHE_LOG_FORMAT",
    "workers": "TOKCACHE_WORKERS",
    "pressure_interval": "TOKCACHE_PRESSURE_INTERVAL",
    "pressure_low_watermark": "TOKCACHE_PRESSURE_LOW_WATERMARK",
    "pressure_cgroup_ratio": "TOKCACHE_PRESSURE_CGROUP_RATIO",
    "pressure_psi_avg10": "TOKCACHE_PRESSURE_PSI_AVG10",
    "pressure_min_available": "TOKCACHE_PRESSURE_MIN_AVAILABLE",
    "ar_store": "TOKCACHE_AR_STORE",
    "ar_store_timeout_ms": "TOKCACHE_AR_STORE_TIMEOUT_MS",
}

# Fields whose command-line flag is not ``--`` + the field name with dashes.
_FLAGS = {"models": "--model", "default_mode": "--mode"}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """Invalid configuration; the message names the field and the source."""


def flag(name: str) -> str:
    """The command-line flag of field ``name`` (``models`` → ``--model``)."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def parse_size(value: str | int) -> int:
    """``"256MiB"``, ``"1G"``, ``"65536"`` or an int → bytes (K/M/G/T are powers of 1024)."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise ConfigError(f"not a size: {value!r} (e.g. 256MiB, 1G, 65536)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


@dataclass(frozen=True)
class ModelSpec:
    """A served model: its name in requests, and its tokenizer directory.

    ``source`` says where it was given (``--model``, ``TOKCACHE_MODELS`` or a config file),
    for error messages; it takes no part in comparisons.
    """

    name: str
    path: Path
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"models: invalid model name {self.name!r}")

    @classmethod
    def parse(cls, spec: str, source: str = "") -> ModelSpec:
        """``NAME=DIR`` → ModelSpec."""
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"models: expected NAME=DIR, got {spec!r}")
        return cls(name.strip(), Path(path.strip()).expanduser(), source)

    def describe(self) -> str:
        """The model as the user gave it: ``--model q=/m/q``, ``TOKCACHE_MODELS q=/m/q``,
        ``models.q in /etc/tokcache.toml``."""
        if self.source.startswith(("--", "TOKCACHE_")):
            return f"{self.source} {self.name}={self.path}"
        if self.source:
            return f"models.{self.name} in {self.source}"
        return f"model {self.name!r} ({self.path})"

    def check(self) -> None:
        """Raise ConfigError (naming where the model was given) unless its directory exists and
        holds a readable ``tokenizer.json``. Cheap: run before binding anything."""
        where = self.describe()
        if not self.path.exists():
            raise ConfigError(f"{where}: directory {self.path} does not exist")
        if not self.path.is_dir():
            raise ConfigError(f"{where}: {self.path} is not a directory")
        tokenizer_json = self.path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ConfigError(f"{where}: {tokenizer_json} not found (a model directory holds the tokenizer's "
                              "tokenizer.json, as on the Hugging Face hub)")
        try:
            with tokenizer_json.open("rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {tokenizer_json}: {exc.strerror or exc}") from exc


@dataclass(frozen=True)
class Config:
    """Validated server settings."""

    listen: str = DEFAULT_LISTEN
    models: tuple[ModelSpec, ...] = ()
    shm_size: int = DEFAULT_SHM_SIZE
    shm_prefix: str = DEFAULT_SHM_PREFIX
    default_mode: str = DEFAULT_MODE
    max_text_bytes: int = 8 << 20
    max_messages: int = 10_000
    max_request_bytes: int = 64 << 20
    ttl_l0: float = 0.0
    ttl_l1: float = 0.0
    ttl_ar: float = 0.0
    backends: tuple[str, ...] = BACKENDS
    log_level: str = "info"
    grace_seconds: float = 10.0
    metrics_port: int = 0
    metrics_addr: str = "0.0.0.0"
    log_format: str = "json"
    # --workers N: N server processes on one segment sharing a TCP port (SO_REUSEPORT).
    workers: int = 1
    # Memory pressure (tokcache.sidecar.pressure): seconds between checks (0 = off), the share of
    # the arena kept under pressure, and the thresholds that mean pressure.
    pressure_interval: float = 1.0
    pressure_low_watermark: float = 0.25
    pressure_cgroup_ratio: float = 0.90
    pressure_psi_avg10: float = 10.0
    pressure_min_available: float = 0.05
    # The cluster tier for recorded outputs (tokcache.sidecar.tier): a Redis/Valkey URL ("" = off)
    # and the deadline of a read on the Tokenize path.
    ar_store: str = field(default="", repr=False)  # may hold a password: never printed
    ar_store_timeout_ms: float = 20.0
    config_file: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not (self.listen.startswith("unix://") or re.match(r"^[\w.\-\[\]:]+:\d+$", self.listen)):
            raise ConfigError(f"listen: expected unix:///path.sock or HOST:PORT, got {self.listen!r}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"models: duplicate model names in {names}")
        if self.shm_size < 1 << 20:
            raise ConfigError(f"shm_size: {self.shm_size} bytes is below the 1 MiB minimum")
        if not _PREFIX_RE.match(self.shm_prefix):
            raise ConfigError(f"shm_prefix: invalid {self.shm_prefix!r} (letters, digits, _ . -)")
        if self.default_mode not in MODES:
            raise ConfigError(f"default_mode: {self.default_mode!r} is not one of {MODES}")
        for name in ("max_text_bytes", "max_messages", "max_request_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive")
        for name in ("ttl_l0", "ttl_l1", "ttl_ar", "grace_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0")
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or not self.backends:
            raise ConfigError(f"backends: {self.backends} must be a non-empty subset of {BACKENDS}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level: {self.log_level!r}")
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"log_format: {self.log_format!r} is not json or text")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not a port (0 = off)")
        if not 1 <= self.workers <= 256:
            raise ConfigError(f"workers: {self.workers} is not in [1, 256]")
        if self.workers > 1 and self.listen.startswith("unix://"):
            raise ConfigError("workers: several server processes share a HOST:PORT listen address "
                              "(SO_REUSEPORT), not a unix socket; give --listen 127.0.0.1:PORT")
        if self.pressure_interval < 0:
            raise ConfigError("pressure_interval: must be >= 0 (0 = off)")
        for name in ("pressure_low_watermark", "pressure_cgroup_ratio"):
            if not 0.1 < getattr(self, name) <= 1:
                raise ConfigError(f"{name}: must be a fraction in (0.1, 1]")
        if not 0 < self.pressure_psi_avg10 <= 100:
            raise ConfigError("pressure_psi_avg10: must be a percentage in (0, 100]")
        if not 0 <= self.pressure_min_available < 0.5:
            raise ConfigError("pressure_min_available: must be a fraction in [0, 0.5)")
        if self.ar_store:
            from tokcache.sidecar.tier import TierUrl, TierUrlError

            try:
                TierUrl.parse(self.ar_store)
            except TierUrlError as exc:
                raise ConfigError(f"ar_store ({flag('ar_store')}): {exc}") from None
        if not 0 < self.ar_store_timeout_ms <= 10_000:
            raise ConfigError("ar_store_timeout_ms: must be in (0, 10000] milliseconds")


_INT_FIELDS = {"max_text_bytes", "max_messages", "max_request_bytes", "metrics_port", "workers"}
_FLOAT_FIELDS = {"ttl_l0", "ttl_l1", "ttl_ar", "grace_seconds", "pressure_interval", "pressure_low_watermark",
                 "pressure_cgroup_ratio", "pressure_psi_avg10", "pressure_min_available", "ar_store_timeout_ms"}


def _coerce(name: str, value: Any, source: str) -> Any:
    try:
        if name == "models":
            if isinstance(value, Mapping):
                return tuple(ModelSpec(str(k), Path(str(v)).expanduser(), source) for k, v in value.items())
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            return tuple(v if isinstance(v, ModelSpec) else ModelSpec.parse(str(v), source) for v in value)
        if name == "shm_size":
            return parse_size(value)
        if name in _INT_FIELDS:
            return parse_size(value) if name.endswith("bytes") else int(value)
        if name in _FLOAT_FIELDS:
            return float(value)
        if name == "backends":
            return tuple(v.strip() for v in value.split(",")) if isinstance(value, str) else tuple(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        reason = str(exc).removeprefix(f"{name}: ")
        raise ConfigError(f"{name} (from {source}): {reason}") from exc


def _toml() -> Any:
    """The TOML parser, imported only when a config file is read.

    On 3.10 it is the ``tomli`` backport; importing it lazily keeps the package
    importable (``--version``, the missing-extra message) where only our own
    wheel is installed.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib


def load_config(cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Merge the sources; ``cli`` holds only flags the user gave (None = absent)."""
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    env = os.environ if env is None else env
    names = {f.name for f in fields(Config)} - {"config_file"}
    values: dict[str, Any] = {}
    path_s = cli.get("config") or env.get(ENV["config"])
    config_file = Path(path_s) if path_s else None
    if config_file is not None:
        tomllib = _toml()
        try:
            data = tomllib.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config: cannot read {config_file}: {exc}") from exc
        bad = set(data) - names
        if bad:
            raise ConfigError(f"config {config_file}: unknown keys {sorted(bad)}")
        values.update({k: _coerce(k, v, str(config_file)) for k, v in data.items()})
    for name in names:
        var = ENV.get(name)
        if var and env.get(var):
            values[name] = _coerce(name, env[var], var)
    for name, value in cli.items():
        if name in names:
            values[name] = _coerce(name, value, flag(name))
    cfg = Config(**values, config_file=config_file)
    return replace(cfg)
