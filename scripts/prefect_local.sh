#!/usr/bin/env bash
# A local Prefect server (SQLite), a process work pool, the deployments and a worker.
# Usage: scripts/prefect_local.sh {server|pool|deploy|worker|workers N|run NAME [--param k=v ...]|stop|demo}
# Environment (set by the Makefile): PREFECT_HOME, PREFECT_API_URL, KVCOMPRESS_HOME, VENV.
# PREFECT_SERVER_HOST: the address the server binds, 127.0.0.1 (this machine only) by default;
# 0.0.0.0 (or one interface's address) serves workers on other machines, and then the server refuses
# to start without PREFECT_SERVER_API_AUTH_STRING (Prefect's basic auth, "user:password"): every
# client, workers and `kvcompress` included, passes the same value as PREFECT_API_AUTH_STRING
# (this script sets it from the server's when only that one is set).
set -euo pipefail
cd "$(dirname "$0")/.."
export KVCOMPRESS_HOME=${KVCOMPRESS_HOME:-$PWD}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}
export PREFECT_API_URL=${PREFECT_API_URL:-http://127.0.0.1:4200/api}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
if [ -n "${PREFECT_SERVER_API_AUTH_STRING:-}" ] && [ -z "${PREFECT_API_AUTH_STRING:-}" ]; then
  export PREFECT_API_AUTH_STRING=$PREFECT_SERVER_API_AUTH_STRING  # this machine's clients: the server's own
fi
venv=${VENV:-.venv}
case $venv in /*) ;; *) venv=$PWD/$venv ;; esac
export PATH="$venv/bin:$PATH"
port=$(python -c "import urllib.parse,os; print(urllib.parse.urlparse(os.environ['PREFECT_API_URL']).port or 4200)")
pool=kvcompress
mkdir -p "$PREFECT_HOME"

healthy() { python -c "import urllib.request,os,sys; urllib.request.urlopen(os.environ['PREFECT_API_URL']+'/health', timeout=2)" 2>/dev/null; }

server() {
  if healthy; then  # ours (its PREFECT_HOME is ours), or refused: another checkout's server would run our deployments
    python -m kvcompress_flows.local_server check-home "$PREFECT_API_URL" "$PREFECT_HOME" || exit 2
    echo "prefect server: already up at $PREFECT_API_URL"; return
  fi
  python -m kvcompress_flows.local_server check-bind "${PREFECT_SERVER_HOST:-127.0.0.1}" || exit 2  # no auth string, no remote bind
  # the dashboard's JavaScript calls the API at PREFECT_UI_API_URL
  PREFECT_UI_API_URL=${PREFECT_UI_API_URL:-$PREFECT_API_URL} \
    nohup prefect server start --host "${PREFECT_SERVER_HOST:-127.0.0.1}" --port "$port" >"$PREFECT_HOME/server.log" 2>&1 &
  echo $! >"$PREFECT_HOME/server.pid"
  disown $!  # not a job of this shell: `stop` (from `demo`) kills it without bash printing "Killed"
  for _ in $(seq 180); do
    healthy && { echo "prefect server: up at $PREFECT_API_URL (bound to ${PREFECT_SERVER_HOST:-127.0.0.1}); dashboard: ${PREFECT_API_URL%/api}"; return; }
    kill -0 "$(cat "$PREFECT_HOME/server.pid")" 2>/dev/null || break
    sleep 1
  done
  echo "prefect server did not become healthy; see $PREFECT_HOME/server.log:" >&2; tail -n 20 "$PREFECT_HOME/server.log" >&2; exit 1
}

pool() {  # `kvcompress` runs sweep flows; `kvcompress-shards` runs the shards of distributed sweeps
  for p in "$pool" "$pool-shards"; do
    prefect work-pool inspect "$p" >/dev/null 2>&1 || prefect work-pool create "$p" --type process >/dev/null
  done
  echo "work pools: $pool, $pool-shards"
}

deploy() {
  prefect --no-prompt deploy --all >"$PREFECT_HOME/deploy.log" 2>&1 || { cat "$PREFECT_HOME/deploy.log"; exit 1; }
  echo "deployed: sweep/default, sweep/nightly, sweep-shard/shard"
}

worker() {
  nohup prefect worker start --pool "$pool" >>"$PREFECT_HOME/worker.log" 2>&1 &
  echo $! >>"$PREFECT_HOME/worker.pid"
  disown $!
  echo "worker started (log: $PREFECT_HOME/worker.log)"
}

workers() {  # N shard workers, one shard at a time each (run on any machine that shares the server)
  local n=${1:-2}
  for i in $(seq "$n"); do
    nohup prefect worker start --pool "$pool-shards" --limit 1 --name "shard-worker-$i-$$" \
      >>"$PREFECT_HOME/shard-worker-$i.log" 2>&1 &
    echo $! >>"$PREFECT_HOME/worker.pid"
    disown $!
  done
  echo "$n shard workers started (logs: $PREFECT_HOME/shard-worker-*.log)"
}

run() {  # run a deployment to completion, its log lines shown as they come; fail, saying why, unless it completed
  local name=$1; shift
  local out id
  out=$(prefect deployment run "sweep/$name" "$@" 2>&1) || { echo "$out" >&2; exit 1; }
  id=$(echo "$out" | sed -n 's/.*UUID: *\([0-9a-f-]\{36\}\).*/\1/p' | head -n 1)
  [ -n "$id" ] || { echo "$out" >&2; echo "no flow run id in the output above" >&2; exit 1; }
  python -m kvcompress_flows.watch "$id" || exit 1
}

stop() {  # SIGTERM, then SIGKILL: a Prefect worker's first SIGTERM only starts a drain that can hang
  local pids
  for f in worker server; do
    [ -f "$PREFECT_HOME/$f.pid" ] || continue
    pids=$(cat "$PREFECT_HOME/$f.pid")
    kill $pids 2>/dev/null || true
    for _ in $(seq 20); do kill -0 $pids 2>/dev/null || break; sleep 1; done
    kill -9 $pids 2>/dev/null || true
    rm -f "$PREFECT_HOME/$f.pid"
  done
  echo "stopped worker and server"
}

demo() {
  server; pool; deploy; worker
  local start=$SECONDS
  run default
  echo "sweep/default finished in $((SECONDS - start)) s"
  kvcompress report
  if [ "${KEEP_SERVER:-0}" = 1 ]; then
    echo "dashboard: ${PREFECT_API_URL%/api} (flow runs, logs, the sweep's report artifacts); \`make stop\` ends it"
  else
    stop
  fi
}

cmd=${1:-demo}; shift || true
"$cmd" "$@"
