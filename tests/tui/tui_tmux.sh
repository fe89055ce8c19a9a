#!/usr/bin/env bash
# Run the chat TUI in a real terminal (tmux), type a question, wait for the streamed answer,
# capture the screen, quit with Ctrl+Q and check the chat was saved.
#
# Usage: tests/tui/tui_tmux.sh [--real MODEL] [OUT]
#   default   the app on the scripted fake engine (tests/tui/tui_fakes.py): fast, no model needed
#   --real    `localmoe chat -m MODEL -c 192` (the real engine; slow on a CPU)
#   OUT       file for the captured screen (default: stdout)
# Exit status: 0 ok, 77 tmux missing (a "skip"), anything else a failure.
# Uses a private tmux server socket in a temp dir and LOCALMOE_HOME there: it never touches the
# user's tmux sessions or chats.
set -euo pipefail

REAL=""
if [[ "${1:-}" == "--real" ]]; then REAL="$2"; shift 2; fi
OUT="${1:-/dev/stdout}"
command -v tmux >/dev/null 2>&1 || { echo "tmux is not installed" >&2; exit 77; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python}"
WORK="$(mktemp -d)"
SOCK="$WORK/tmux.sock"
S=tui
export LOCALMOE_HOME="$WORK/home"
cleanup() { tmux -S "$SOCK" kill-server >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT

if [[ -n "$REAL" ]]; then
  CMD="$PY -m localmoe chat -m '$REAL' -c 192"
  ANSWER_MARK="tokens"        # the answer's header note "TTFT .. · N tokens" once it is done
  LIMIT=400
else
  CMD="$PY '$ROOT/tests/tui/tui_fakes.py'"
  ANSWER_MARK="15 tokens"     # the answer header note, shown when the fake answer is done
  LIMIT=60
fi

tmux -S "$SOCK" -f /dev/null new-session -d -s "$S" -x 100 -y 30 \
  "cd '$ROOT' && TERM=xterm-256color LOCALMOE_HOME='$LOCALMOE_HOME' $CMD; echo EXITED \$?; sleep 60"

screen() { tmux -S "$SOCK" capture-pane -p -t "$S"; }
wait_for() {  # wait_for TEXT SECONDS
  local end=$((SECONDS + $2))
  while (( SECONDS < end )); do
    if screen | grep -qF -- "$1"; then return 0; fi
    sleep 0.2
  done
  echo "timed out after $2 s waiting for: $1" >&2
  screen >&2
  return 1
}

wait_for "Ask anything" "$LIMIT"          # the UI is up
wait_for "ctx " "$LIMIT"                  # the model is loaded (stats bar shows the context)
tmux -S "$SOCK" send-keys -t "$S" -l "What is 2+3? Answer briefly."
tmux -S "$SOCK" send-keys -t "$S" Enter
wait_for "What is 2+3? Answer briefly." 20 # the question is in the chat log
wait_for "$ANSWER_MARK" "$LIMIT"          # the answer has streamed
sleep 0.5
screen > "$OUT"
tmux -S "$SOCK" send-keys -t "$S" C-q
wait_for "EXITED 0" 30                    # clean exit

# The conversation was saved.
"$PY" - "$LOCALMOE_HOME/chats.sqlite3" <<'PYEOF'
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute(
    "SELECT role, content, finish_reason FROM messages ORDER BY id").fetchall()
assert [r[0] for r in rows] == ["user", "assistant"], rows
assert rows[0][1] == "What is 2+3? Answer briefly.", rows
assert rows[1][1].strip() and rows[1][2] in ("stop", "length"), rows
PYEOF
echo "tui_tmux: ok" >&2
