"""Per-node mode (deploy/overlays/per-node = base + components/per-node-sidecar), rendered with the
real kustomize and validated against the Kubernetes schemas like the per-pod variants
(test_manifests.py), then checked for what makes it work and what bounds its exposure:

- one tokcache sidecar per node (a DaemonSet) and no sidecar in the vLLM pods;
- the DaemonSet and the vLLM pods share the node's /dev/shm/tokcache as their /dev/shm and the
  node's /run/tokcache for the socket (hostPath; no hostIPC, no host /dev/shm);
- the directories belong to uid 10001 mode 0700, set by an init container with CHOWN and FOWNER
  only; everything else runs as 10001 with the base's locked-down security context;
- both are placed by the same node label; the sidecar's memory covers its segments;
- the cluster tier's URL comes from an optional Secret, and the TOML loads through the real
  ``load_config`` with and without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate as kv
import pytest

from tests.deploy.test_manifests import (
    DEPLOY,
    RSS_FLOOR_BASE,
    RSS_FLOOR_PER_MODEL,
    UID,
    Obj,
    _schema_versions,
    arg_value,
    quantity,
    render,
)
from tokcache.sidecar.config import Config, load_config

NODE_LABEL = {"tokcache.io/node-cache": "true"}
SHM_DIR, SOCKET_DIR = "/dev/shm/tokcache", "/run/tokcache"


@pytest.fixture(scope="module")
def objs() -> list[Obj]:
    return render(DEPLOY / "overlays" / "per-node")


def _one(objs: list[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _spec(objs: list[Obj], kind: str) -> dict[str, Any]:
    return dict(_one(objs, kind)["spec"]["template"]["spec"])


def _container(spec: dict[str, Any], name: str, key: str = "containers") -> Obj:
    found = [c for c in spec.get(key, []) if c["name"] == name]
    assert len(found) == 1, f"no {key} {name}"
    return found[0]


def _volume_at(spec: dict[str, Any], container: Obj, path: str) -> Obj:
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(mounts) == 1, f"{container['name']}: nothing mounted at {path}"
    return next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])


def _config(objs: list[Obj], env: dict[str, str], tmp: Path) -> Config:
    sidecar = _container(_spec(objs, "DaemonSet"), "tokcache")
    path = arg_value(sidecar["args"], "--config")
    assert path == "/etc/tokcache/tokcache.toml"
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("tokcache-config"))
    toml = tmp / "tokcache.toml"
    toml.write_text(cm["data"]["tokcache.toml"])
    literal = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e and e["name"].startswith("TOKCACHE_")}
    return load_config({"config": str(toml)}, {**literal, **env})


@pytest.mark.parametrize("version", _schema_versions())
def test_objects_match_kubernetes_schemas(objs: list[Obj], version: str) -> None:
    for obj in objs:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} against {version}: {path}: {exc.message}")
    assert {o["kind"] for o in objs} == {"ConfigMap", "Service", "Deployment", "DaemonSet"}


def test_one_sidecar_per_node_and_none_in_the_vllm_pods(objs: list[Obj]) -> None:
    node = _spec(objs, "DaemonSet")
    pod = _spec(objs, "Deployment")
    assert not pod.get("initContainers"), "the vLLM pods must not run their own sidecar"
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    assert [c["name"] for c in node["containers"]] == ["tokcache"]
    assert node["nodeSelector"] == pod["nodeSelector"] == NODE_LABEL
    assert _one(objs, "Deployment")["spec"]["replicas"] == 8


def test_shared_memory_and_socket_are_the_same_node_directories(objs: list[Obj], tmp_path: Path) -> None:
    node, pod = _spec(objs, "DaemonSet"), _spec(objs, "Deployment")
    sidecar, vllm = _container(node, "tokcache"), _container(pod, "vllm")
    for path, host in (("/dev/shm", SHM_DIR), (SOCKET_DIR, SOCKET_DIR)):
        mine, theirs = _volume_at(node, sidecar, path), _volume_at(pod, vllm, path)
        assert mine["hostPath"]["path"] == theirs["hostPath"]["path"] == host
        assert mine["hostPath"]["type"] == "DirectoryOrCreate"
        # The vLLM pods wait for the directory the DaemonSet made (owned by 10001): one the
        # kubelet created would be root's, and vLLM could not create its own shm in it.
        assert theirs["hostPath"]["type"] == "Directory"
        assert "emptyDir" not in theirs
    assert not pod.get("hostIPC") and not node.get("hostIPC")
    assert all(v.get("hostPath", {}).get("path") != "/dev/shm" for s in (node, pod) for v in s["volumes"])
    config = _config(objs, {}, tmp_path)
    assert config.listen == f"unix://{SOCKET_DIR}/tokcache.sock"
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["TOKCACHE_ADDRESS"] == config.listen
    for probe in ("startupProbe", "livenessProbe"):
        assert sidecar[probe]["exec"]["command"] == ["tokcache-sidecar", "health", "--address", config.listen]


def test_node_directories_are_private_to_the_uid(objs: list[Obj]) -> None:
    node = _spec(objs, "DaemonSet")
    (init,) = node["initContainers"]
    script = "\n".join(init["command"])
    assert "os.chown(d, 10001, 10001)" in script and "os.chmod(d, 0o700)" in script
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/node/shm", "/node/run"}
    hosts = {v["name"]: v.get("hostPath", {}).get("path") for v in node["volumes"]}
    assert {hosts[m["name"]] for m in init["volumeMounts"]} == {SHM_DIR, SOCKET_DIR}


def test_security_context(objs: list[Obj]) -> None:
    node, pod = _spec(objs, "DaemonSet"), _spec(objs, "Deployment")
    for spec, name in ((node, "tokcache"), (pod, "vllm")):
        c = _container(spec, name)
        sc = {**{k: v for k, v in spec["securityContext"].items() if k != "fsGroup"}, **c["securityContext"]}
        assert sc["runAsNonRoot"] is True and sc.get("runAsUser", spec["securityContext"]["runAsUser"]) == UID
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert _container(node, "tokcache")["securityContext"]["readOnlyRootFilesystem"] is True


def test_memory_covers_the_segments(objs: list[Obj], tmp_path: Path) -> None:
    config = _config(objs, {}, tmp_path)
    res = _container(_spec(objs, "DaemonSet"), "tokcache")["resources"]
    limit = quantity(res["limits"]["memory"])
    assert quantity(res["requests"]["memory"]) == limit
    shm = config.shm_size * len(config.models)
    assert limit - shm >= RSS_FLOOR_BASE + RSS_FLOOR_PER_MODEL * len(config.models)


def test_metrics_move_to_the_node_sidecar(objs: list[Obj]) -> None:
    svc = _one(objs, "Service")
    assert {p["port"] for p in svc["spec"]["ports"]} == {8000}
    node_meta = _one(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    pod_meta = _one(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert node_meta["prometheus.io/scrape"] == "true" and node_meta["prometheus.io/port"] == "9464"
    assert pod_meta["prometheus.io/scrape"] == "false"
    ports = {p["name"]: p["containerPort"] for p in _container(_spec(objs, "DaemonSet"), "tokcache")["ports"]}
    assert ports == {"metrics": 9464}


def test_the_tier_url_comes_from_an_optional_secret(objs: list[Obj], tmp_path: Path) -> None:
    sidecar = _container(_spec(objs, "DaemonSet"), "tokcache")
    ref = next(e for e in sidecar["env"] if e["name"] == "TOKCACHE_AR_STORE")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "tokcache-ar-store", "key": "url", "optional": True}
    assert _config(objs, {}, tmp_path).ar_store == ""
    with_tier = _config(objs, {"TOKCACHE_AR_STORE": "rediss://:pw@valkey.llm.svc:6379/0"}, tmp_path)
    assert with_tier.ar_store.startswith("rediss://") and with_tier.ar_store_timeout_ms == 20.0


def test_the_per_pod_sidecar_stays_the_default() -> None:
    base = render(DEPLOY / "base")
    assert not [o for o in base if o["kind"] == "DaemonSet"]
    deployment = next(o for o in base if o["kind"] == "Deployment")
    assert [c["name"] for c in deployment["spec"]["template"]["spec"]["initContainers"]] == ["tokcache"]
