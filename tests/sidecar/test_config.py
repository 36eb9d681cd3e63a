"""Config precedence (defaults < file < env < CLI) and validation messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokcache.sidecar.config import Config, ConfigError, ModelSpec, load_config, parse_size


def test_sizes() -> None:
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("65536") == 65536
    assert parse_size("1.5k") == 1536
    with pytest.raises(ConfigError, match="not a size"):
        parse_size("lots")


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('listen = "127.0.0.1:9000"\nshm_size = "8MiB"\nshm_prefix = "fromfile"\n'
                 '[models]\na = "/m/a"\nb = "/m/b"\n')
    env = {"TOKCACHE_CONFIG": str(f), "TOKCACHE_SHM_SIZE": "16MiB", "TOKCACHE_TTL_AR": "60"}
    cfg = load_config({"shm_prefix": "fromcli", "models": None}, env)
    assert cfg.listen == "127.0.0.1:9000"
    assert cfg.shm_size == 16 << 20
    assert cfg.shm_prefix == "fromcli"
    assert cfg.ttl_ar == 60.0
    assert cfg.models == (ModelSpec("a", Path("/m/a")), ModelSpec("b", Path("/m/b")))
    cfg = load_config({"models": ["x=/m/x"]}, {"TOKCACHE_MODELS": "y=/m/y,z=/m/z"})
    assert [m.name for m in cfg.models] == ["x"]
    cfg = load_config({}, {"TOKCACHE_MODELS": "y=/m/y,z=/m/z"})
    assert [m.name for m in cfg.models] == ["y", "z"]


@pytest.mark.parametrize("kwargs,field", [
    ({"listen": "nowhere"}, "listen"),
    ({"shm_size": 10}, "shm_size"),
    ({"shm_prefix": "bad/prefix"}, "shm_prefix"),
    ({"default_mode": "fast"}, "default_mode"),
    ({"backends": ("magic",)}, "backends"),
    ({"models": (ModelSpec("a", Path("/x")), ModelSpec("a", Path("/y")))}, "models"),
    ({"ttl_l0": -1.0}, "ttl_l0"),
])
def test_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        Config(**kwargs)  # type: ignore[arg-type]


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected NAME=DIR"):
        load_config({"models": ["nodir"]}, {})
    f = tmp_path / "c.toml"
    f.write_text("nonsense = 1\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config({"config": str(f)}, {})
    with pytest.raises(ConfigError, match="TOKCACHE_MAX_MESSAGES"):
        load_config({}, {"TOKCACHE_MAX_MESSAGES": "many"})
