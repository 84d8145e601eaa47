#!/usr/bin/env bash
# Drive the real agent CLIs, Claude Code (Anthropic Messages) and Codex (OpenAI Responses),
# against a kvsnap server on this machine, one "Say hi" turn each, and print how many input
# tokens each CLI's first request reused (the server's own usage report).
#
#   scripts/agents_cli.sh --url http://127.0.0.1:8000 --model NAME [--api-key KEY]
#                         [--cache DIR] [--timeout S] [--out DIR] [--prompt TEXT]
#                         [--workdir DIR]
#
# Arguments fall back on KVSNAP_URL, KVSNAP_MODEL, KVSNAP_API_KEY, AGENTS_CLI_CACHE,
# AGENTS_CLI_TIMEOUT. The CLIs come from npm, pinned (CLAUDE_CODE_VERSION, CODEX_VERSION), into
# the cache folder (default ~/.cache/kvsnap/agents-cli), once. Each runs with a fresh HOME and
# working folder, so nothing of this machine's own configuration reaches the request;
# tests/fixtures/agents/README.md shows what each sends. --workdir DIR keeps that HOME and
# folder in DIR from one run to the next: an agent's prefix names them (Claude Code's memory
# path), so a run that records agents (serve --record-agents) and a later run that should
# start warm from them use the same DIR. Only 127.0.0.1/localhost is accepted.
#
# Claude Code: reused = usage.cache_read_input_tokens of `claude -p --output-format json`,
# with --max-turns 1 so that usage is the first request's alone (a model that calls a tool ends
# the run at its turn limit, which still counts as a completed request here).
# Codex: reused = usage.cached_input_tokens of `codex exec --json`'s turn.completed event; Codex
# sums a turn's requests, so a turn that ran tools says so. Codex sends no max_output_tokens:
# the server's --max-tokens bounds its answer.
# Exit status: 0 when both CLIs completed a request and reported usage, 1 otherwise, 2 on usage.
set -euo pipefail

CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.332}"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
URL="${KVSNAP_URL:-}"
MODEL="${KVSNAP_MODEL:-}"
API_KEY="${KVSNAP_API_KEY:-kvsnap}"
CACHE="${AGENTS_CLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvsnap/agents-cli}"
TIMEOUT="${AGENTS_CLI_TIMEOUT:-300}"
OUT=""
PROMPT="Say hi"
WORKDIR=""

usage() {
    sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-2}"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --url) URL="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --api-key) API_KEY="$2"; shift 2 ;;
        --cache) CACHE="$2"; shift 2 ;;
        --timeout) TIMEOUT="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --prompt) PROMPT="$2"; shift 2 ;;
        --workdir) WORKDIR="$2"; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "agents_cli.sh: unknown argument $1" >&2; usage ;;
    esac
done

[ -n "$URL" ] && [ -n "$MODEL" ] || { echo "agents_cli.sh: --url and --model are required" >&2; usage; }
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || { echo "agents_cli.sh: --timeout takes seconds" >&2; exit 2; }
URL="${URL%/}"
URL="${URL%/v1}"
if ! [[ "$URL" =~ ^http://(127\.0\.0\.1|localhost)(:[0-9]+)?$ ]]; then
    echo "agents_cli.sh: $URL is not http://127.0.0.1[:PORT] (or localhost): refused" >&2
    exit 2
fi
for tool in npm node python3 timeout; do
    command -v "$tool" >/dev/null || { echo "agents_cli.sh: $tool is not installed" >&2; exit 1; }
done

# --- the CLIs, from npm, once per version ------------------------------------------------
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"  # absolute: the CLIs run from other folders
BIN="$CACHE/node_modules/.bin"
installed() {
    [ -x "$BIN/claude" ] && [ -x "$BIN/codex" ] \
        && "$BIN/claude" --version 2>/dev/null | grep -qF "$CLAUDE_CODE_VERSION" \
        && "$BIN/codex" --version 2>/dev/null | grep -qF "$CODEX_VERSION"
}
if ! installed; then
    echo "installing @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION and @openai/codex@$CODEX_VERSION into $CACHE" >&2
    timeout 600 npm install --prefix "$CACHE" --no-audit --no-fund --loglevel=error \
        "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" >&2
    # Claude Code's postinstall puts the native binary in place; run it where npm did not.
    if ! "$BIN/claude" --version >/dev/null 2>&1; then
        (cd "$CACHE/node_modules/@anthropic-ai/claude-code" && timeout 120 node install.cjs) >&2
    fi
    installed || { echo "agents_cli.sh: the CLIs did not install" >&2; exit 1; }
fi

# --- is anything answering? (Codex waits out its whole timeout on a refused connection) --
if ! python3 - "$URL/v1/models" <<'PY'
import sys, urllib.error, urllib.request
try:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: direct
    opener.open(sys.argv[1], timeout=10).close()
except urllib.error.HTTPError:
    pass  # it answered
except OSError as e:
    print(f"agents_cli.sh: nothing answers at {sys.argv[1]}: {e}", file=sys.stderr)
    sys.exit(1)
PY
then
    exit 1
fi

# --- a fresh HOME and working folder per CLI --------------------------------------------
if [ -n "$WORKDIR" ]; then
    mkdir -p "$WORKDIR" && WORK="$(cd "$WORKDIR" && pwd)"
    rm -f "$WORK"/claude.json "$WORK"/claude.err "$WORK"/codex.jsonl "$WORK"/codex.err
else
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvsnap-agents.XXXXXX")"
fi
FAILED=0
cleanup() {
    [ -n "$WORKDIR" ] && return  # the caller's folder: kept for the next run
    if [ -n "$OUT" ]; then
        mkdir -p "$OUT" && cp -r "$WORK"/. "$OUT"/ && echo "outputs kept in $OUT" >&2
    elif [ "$FAILED" != 0 ]; then
        echo "outputs kept in $WORK" >&2
        return
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
mkdir -p "$WORK/claude/home" "$WORK/claude/project" "$WORK/codex/home/.codex" "$WORK/codex/project"
BASE_PATH="$BIN:$(dirname "$(command -v node)"):/usr/local/bin:/usr/bin:/bin"

# --- Claude Code: POST /v1/messages -----------------------------------------------------
rc=0
(
    cd "$WORK/claude/project"
    exec env -i PATH="$BASE_PATH" HOME="$WORK/claude/home" TERM=dumb \
        ANTHROPIC_BASE_URL="$URL" ANTHROPIC_API_KEY="$API_KEY" \
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=16 CLAUDE_CODE_MAX_RETRIES=1 \
        API_TIMEOUT_MS=$((TIMEOUT * 1000)) \
        timeout "$TIMEOUT" claude -p "$PROMPT" --model "$MODEL" --output-format json --max-turns 1
) </dev/null >"$WORK/claude.json" 2>"$WORK/claude.err" || rc=$?
if ! python3 - "$WORK/claude.json" "$rc" "$CLAUDE_CODE_VERSION" <<'PY'
import json, sys
path, rc, version = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    result = json.loads(open(path).read().strip().splitlines()[-1])
    usage = result["usage"]
    reused = usage["cache_read_input_tokens"]
except (IndexError, ValueError, KeyError, TypeError):
    print(f"claude-code {version}: FAILED (exit {rc}), no JSON result with usage", file=sys.stderr)
    sys.exit(1)
max_turns = result.get("subtype") == "error_max_turns"
if not max_turns and (rc != 0 or result.get("is_error") or result.get("subtype") != "success"):
    detail = result.get("result") or result.get("api_error") or result.get("subtype")
    print(f"claude-code {version}: FAILED (exit {rc}): {detail}", file=sys.stderr)
    sys.exit(1)
note = " (the model called a tool: stopped at 1 turn)" if max_turns else ""
print(
    f"claude-code {version}: first request reused {reused} tokens "
    f"(usage.cache_read_input_tokens; input_tokens={usage.get('input_tokens')}, "
    f"output_tokens={usage.get('output_tokens')}){note}"
)
PY
then
    FAILED=1
    tail -n 20 "$WORK/claude.err" >&2 || true
fi

# --- Codex: POST /v1/responses ----------------------------------------------------------
cat >"$WORK/codex/home/.codex/config.toml" <<TOML
model = "$MODEL"
model_provider = "kvsnap"

[model_providers.kvsnap]
name = "kvsnap"
base_url = "$URL/v1"
wire_api = "responses"
env_key = "KVSNAP_AGENTS_API_KEY"
request_max_retries = 1
stream_max_retries = 1
stream_idle_timeout_ms = $((TIMEOUT * 1000))
TOML
rc=0
(
    cd "$WORK/codex/project"
    exec env -i PATH="$BASE_PATH" HOME="$WORK/codex/home" CODEX_HOME="$WORK/codex/home/.codex" \
        TERM=dumb KVSNAP_AGENTS_API_KEY="$API_KEY" \
        timeout "$TIMEOUT" codex exec --json --skip-git-repo-check "$PROMPT"
) </dev/null >"$WORK/codex.jsonl" 2>"$WORK/codex.err" || rc=$?
if ! python3 - "$WORK/codex.jsonl" "$rc" "$CODEX_VERSION" <<'PY'
import json, sys
path, rc, version = sys.argv[1], int(sys.argv[2]), sys.argv[3]
events = []
for line in open(path):
    try:
        events.append(json.loads(line))
    except ValueError:
        pass
done = [e for e in events if e.get("type") == "turn.completed"]
failed = [e for e in events if e.get("type") in ("turn.failed", "error")]
if rc != 0 or not done or failed or "cached_input_tokens" not in done[-1].get("usage", {}):
    why = json.dumps(failed[-1])[:500] if failed else "no turn.completed with usage"
    print(f"codex {version}: FAILED (exit {rc}): {why}", file=sys.stderr)
    sys.exit(1)
usage = done[-1]["usage"]
tools = sum(
    1
    for e in events
    if e.get("type") == "item.completed"
    and e.get("item", {}).get("type") not in ("agent_message", "reasoning", "error")
)
what = f"its {tools + 1}+ requests (the turn ran {tools} tool calls)" if tools else "first request"
print(
    f"codex {version}: {what} reused {usage['cached_input_tokens']} tokens "
    f"(turn.completed usage.cached_input_tokens; input_tokens={usage.get('input_tokens')}, "
    f"output_tokens={usage.get('output_tokens')})"
)
PY
then
    FAILED=1
    tail -n 20 "$WORK/codex.err" >&2 || true
fi

exit "$FAILED"
