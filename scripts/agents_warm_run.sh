#!/usr/bin/env bash
# The real Claude Code and Codex CLIs warm from their first request, end to end on 127.0.0.1:
# a kvsnap server records their prefixes (--record-agents), `kvsnap build` snapshots them, a
# fresh server starts from the store, and the CLIs run again in the same HOME and folder
# (scripts/agents_cli.sh --workdir). Prints each run's reused tokens and the build report.
#
#   scripts/agents_warm_run.sh [--model DIR] [--work DIR] [--port P]
#
# Default model: scripts/hi_model.py's (a tiny Qwen3 with the real Qwen3 tokenizer and
# template that answers "Hi"), made in the work folder. Exit 1 when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=/tmp/kvsnap-agents-warm
MODEL=""
PORT=18457
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --work) WORK="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        *) echo "agents_warm_run.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
rm -rf "$WORK/rec.json" "$WORK/snaps" "$WORK/cli"
mkdir -p "$WORK"
export KVSNAP_CACHE_DIR="$WORK/cache"
if [ -z "$MODEL" ]; then
    MODEL="$WORK/hi-qwen3"
    [ -f "$MODEL/model.safetensors" ] || python scripts/hi_model.py "$MODEL" >/dev/null
fi
URL="http://127.0.0.1:$PORT"
PID=""
stop() {
    if [ -n "$PID" ]; then
        kill "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true  # 143: it ended on our SIGTERM
    fi
    PID=""
}
trap stop EXIT
serve() {
    timeout -k 5 1800 kvsnap serve "$MODEL" --port "$PORT" --served-model-name kvsnap-model \
        --max-tokens 16 "$@" >"$WORK/serve.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 600); do
        curl -sf "$URL/health" >/dev/null && return 0
        kill -0 "$PID" 2>/dev/null || { tail -5 "$WORK/serve.log" >&2; return 1; }
        sleep 1
    done
    return 1
}
echo "== 1. cold, recording the agents' prefixes (--record-agents)"
serve --record-agents "$WORK/rec.json"
scripts/agents_cli.sh --timeout 600 --url "$URL" --model kvsnap-model --workdir "$WORK/cli"
stop
echo "== 2. kvsnap build of the recorded entries"
kvsnap build "$WORK/rec.json" --model "$MODEL" --out "$WORK/snaps"
echo "== 3. a fresh server from the store; the same CLIs, HOME and folder"
serve --warm-prompts "$WORK/rec.json" --kv-snapshots "$WORK/snaps"
curl -s "$URL/v1/status" | python3 -c "import json, sys; print('warm-up:', json.load(sys.stdin)['warmup'])"
scripts/agents_cli.sh --timeout 600 --url "$URL" --model kvsnap-model --workdir "$WORK/cli"
