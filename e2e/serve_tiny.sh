#!/usr/bin/env bash
# Start vLLM (CPU) on the tiny random Qwen3 model and wait until /health answers.
#   e2e/serve_tiny.sh PORT [extra vllm args...]      -> prints "pid=... ready_s=..." ; log in /tmp/vllm-PORT.log
# Stop with: kill $(cat /tmp/vllm-PORT.pid)   (the API server takes its EngineCore/worker children along)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${1:?port}"; shift
MODEL_DIR="${MODEL_DIR:-/tmp/tokcache-tiny-qwen3}"
PY="${VENV_VLLM:-$ROOT/.venv-vllm}/bin/python"
[[ -f "$MODEL_DIR/config.json" ]] || "$PY" "$ROOT/e2e/make_tiny_model.py" "$MODEL_DIR" >/dev/null
LOG="/tmp/vllm-$PORT.log"
t0=$(date +%s.%N)
VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
  "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --load-format dummy \
  --dtype bfloat16 --max-model-len 4096 --enable-prefix-caching --gpu-memory-utilization 0.3 \
  --host 127.0.0.1 --port "$PORT" "$@" >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"/tmp/vllm-$PORT.pid"
for _ in $(seq 1 "${READY_TIMEOUT:-300}"); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
    echo "pid=$PID ready_s=$(python3 -c "import time;print(round(time.time()-$t0,1))") log=$LOG"
    exit 0
  fi
  if ! kill -0 "$PID" 2>/dev/null; then echo "server exited; tail of $LOG:"; tail -30 "$LOG"; exit 1; fi
  sleep 1
done
echo "not ready in time"; kill "$PID"; exit 1
