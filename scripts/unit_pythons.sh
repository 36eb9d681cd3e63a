#!/usr/bin/env bash
# The suite's portable part (pytest -m "not once", see tests/conftest.py) on each extra Python,
# side by side: usage `scripts/unit_pythons.sh PYENV_ROOT VERSION...` (from `make unit-pythons`).
#
# Why side by side: each run is one pytest process, mostly busy on one core, and the three one
# after another took 29 of CI's 90 minutes on 2 cores. Each writes its own log under .test-logs/;
# every two minutes a line says how far each has got (pytest's own percentage), and each log is
# printed whole once its run ends. Every version runs even when another fails; the exit status
# says whether all passed. pytest's exit 5 (no test collected) is a failure here: the same
# selection collects hundreds of tests on the default Python. A version pyenv does not have here
# (no .venv-pyXY/.installed) is skipped with a loud warning.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pyenv_root=$1
shift
logs=.test-logs
mkdir -p "$logs"
begin=$(date +%s)
versions=()
pids=()
for v in "$@"; do
    venv=.venv-py$(echo "$v" | cut -d. -f1,2 | tr -d .)
    if [ ! -f "$venv/.installed" ]; then
        echo "########################################################################"
        echo "## WARNING: Python $v is not installed ($pyenv_root/versions/$v): the"
        echo "## unit suite was NOT run on it (pyenv install $v, then make unit-pythons)"
        echo "########################################################################"
        continue
    fi
    rm -f "$logs/py$v.rc" "$logs/py$v.s"
    echo "== unit suite (not once) on Python $v ($venv), log $logs/py$v.log"
    (
        start=$(date +%s)
        rc=0
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not once" >"$logs/py$v.log" 2>&1 || rc=$?
        echo $(( $(date +%s) - start )) >"$logs/py$v.s"
        echo "$rc" >"$logs/py$v.rc"  # last: its presence says the run ended
    ) &
    versions+=("$v")
    pids+=("$!")
done

failed=""
declare -A reported=()
last_tick=$(date +%s)
while [ "${#reported[@]}" -lt "${#versions[@]}" ]; do
    for i in "${!versions[@]}"; do
        v=${versions[$i]}
        if [ -z "${reported[$v]:-}" ] && [ ! -f "$logs/py$v.rc" ] && ! kill -0 "${pids[$i]}" 2>/dev/null \
                && [ ! -f "$logs/py$v.rc" ]; then
            echo 1 >"$logs/py$v.rc"; echo "?" >"$logs/py$v.s"  # its shell ended without saying how
        fi
        if [ -z "${reported[$v]:-}" ] && [ -f "$logs/py$v.rc" ]; then
            reported[$v]=1
            rc=$(cat "$logs/py$v.rc")
            echo "== Python $v: its log ($logs/py$v.log)"
            cat "$logs/py$v.log"
            echo "== Python $v: pytest exit $rc in $(cat "$logs/py$v.s") s"
            if [ "$rc" = 5 ]; then echo "== Python $v: pytest collected no tests"; fi
            if [ "$rc" != 0 ]; then failed="$failed $v"; fi
        fi
    done
    if [ "${#reported[@]}" -lt "${#versions[@]}" ]; then
        sleep 5
        if [ $(( $(date +%s) - last_tick )) -ge 120 ]; then
            last_tick=$(date +%s)
            line="== $(( last_tick - begin )) s:"
            for v in "${versions[@]}"; do
                at=$(grep -o '\[ *[0-9]*%\]' "$logs/py$v.log" 2>/dev/null | tail -1 | tr -d '[] ')
                line="$line Python $v ${reported[$v]:+done}${reported[$v]:-${at:-starting}}"
            done
            echo "$line"
        fi
    fi
done
wait "${pids[@]}" 2>/dev/null
echo "== the portable suites took $(( $(date +%s) - begin )) s side by side"
if [ -n "$failed" ]; then
    echo "== unit suite failed on Python$failed"
    exit 1
fi
