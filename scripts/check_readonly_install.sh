#!/usr/bin/env bash
# Acceptance check (issue 11): lorapack works from a read-only install and writes nothing into it.
#
#   scripts/check_readonly_install.sh            # picks a python3.11+; PY=python3.12 to choose one
#
# The interpreter must be one the unprivileged user can run, worker processes included (when started as
# root): the first python3.11+ among the system's (/usr/bin, /usr/local/bin), then PATH's, that passes that
# test. pyenv's, under /root, does not (its workers die at launch).
# 1. `pip install .` into a fresh virtual environment (a temporary directory, removed at the end);
# 2. `chmod -R a-w` its site-packages;
# 3. runs `lorapack demo` and `lorapack simulate ... --json` from outside the repository, as an unprivileged
#    user when started as root (root ignores permission bits), twice: without any writable cache directory
#    (the engine is compiled in the process, nothing is cached), then with LORAPACK_CACHE_DIR set (compiled
#    machine code goes there, keyed by the engine's source hash; the second process reuses it);
# 4. fails if any file below site-packages is new or changed.
# Takes a few minutes (mostly `pip install`), so it is a script rather than a test.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
AS=()
if [ "$(id -u)" = 0 ]; then  # run as nobody: root would write through the permission bits
  AS=(setpriv --reuid=65534 --regid=65534 --clear-groups)
fi
WHO=${AS[*]:+uid 65534 (nobody)}
WHO=${WHO:-this user}
usable() {  # usable PY: a Python >= 3.11 with venv whose worker processes start for that user (spawned)
  local py
  py=$(command -v "$1") || return 1
  (cd / && timeout 60 env -i PATH=/usr/bin:/bin HOME=/nonexistent "${AS[@]}" "$py" -c '
import sys
if sys.version_info < (3, 11):
    sys.exit(1)
import ensurepip, multiprocessing, venv
from concurrent.futures import ProcessPoolExecutor
with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
    sys.exit(pool.submit(abs, 0).result())') >/dev/null 2>&1
}
if [ -n "${PY:-}" ]; then
  usable "$PY" || { echo "PY=$PY: not a Python >= 3.11 with venv that $WHO can run, workers included; set PY= to one" >&2; exit 2; }
else
  for c in /usr/bin/python3.1{1,2,3,4} /usr/local/bin/python3.1{1,2,3,4} \
           $(command -v python3.11 python3.12 python3.13 python3.14 python3 2>/dev/null || true); do
    if [ -x "$c" ] && usable "$c"; then PY=$c; break; fi
  done
  [ -n "${PY:-}" ] || { echo "no Python >= 3.11 with venv that $WHO can run, workers included (a system one;" \
                              "pyenv's under /root is not): install one or set PY=/path/to/python3.11+" >&2; exit 2; }
fi
echo "== interpreter $PY ($("$PY" -c 'import platform; print(platform.python_version())'))"
TMP=$(mktemp -d /tmp/lorapack-ro-XXXXXX)
cleanup() { chmod -R u+w "$TMP" 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT

echo "== pip install $REPO into $TMP/venv"
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q --disable-pip-version-check "$REPO"
SITE=$("$TMP/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
find "$SITE" -name '__pycache__' -prune -o -type f -print | sort > "$TMP/files.before"
touch "$TMP/stamp"
sleep 1
chmod -R a-w "$SITE"
echo "== site-packages read-only: $SITE"

[ ${#AS[@]} = 0 ] || chmod 755 "$TMP"
mkdir -p "$TMP/cache" "$TMP/work"
chown 65534:65534 "$TMP/cache" "$TMP/work" 2>/dev/null || true
WL="$SITE/lorapack/examples/demo.yaml"
run() {  # run LABEL ENV... -- ARGS...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "== $label" >&2
  (cd "$TMP/work" && env -i PATH=/usr/bin:/bin HOME=/nonexistent "${envs[@]}" \
      "${AS[@]}" "$TMP/venv/bin/lorapack" "$@")
}
run "demo, no writable cache directory" -- demo
run "simulate, no writable cache directory" -- simulate "$WL" -m llama-3.1-8b-instruct -a 8 --duration-s 60 --json \
  > "$TMP/sim1.json"
run "simulate, cache in LORAPACK_CACHE_DIR (first: compiles)" LORAPACK_CACHE_DIR="$TMP/cache" -- \
  simulate "$WL" -m llama-3.1-8b-instruct -a 8 --duration-s 60 --json > "$TMP/sim2.json"
run "simulate, cache in LORAPACK_CACHE_DIR (second: reuses)" LORAPACK_CACHE_DIR="$TMP/cache" -- \
  simulate "$WL" -m llama-3.1-8b-instruct -a 8 --duration-s 60 --json > "$TMP/sim3.json"
"$TMP/venv/bin/python" - "$TMP" <<'EOF'
import json, sys
from pathlib import Path
tmp = Path(sys.argv[1])
runs = [json.loads((tmp / f"sim{i}.json").read_text()) for i in (1, 2, 3)]
for r in runs:
    r.pop("wall_s"), r.pop("compile_s")
assert runs[0] == runs[1] == runs[2], "results differ between the cached and uncached engine"
cached = list((tmp / "cache").rglob("*.nbi"))
assert cached, "nothing was cached in LORAPACK_CACHE_DIR"
print(f"same results in all three runs; {len(cached)} cache index files in {tmp / 'cache'}")
EOF

chmod -R u+w "$SITE"
find "$SITE" -name '__pycache__' -prune -o -type f -print | sort > "$TMP/files.after"
NEW=$(find "$SITE" -newer "$TMP/stamp" -type f | head -5)
if ! cmp -s "$TMP/files.before" "$TMP/files.after" || [ -n "$NEW" ]; then
  echo "FAIL: files in site-packages changed:"; diff "$TMP/files.before" "$TMP/files.after" || true; echo "$NEW"
  exit 1
fi
echo "OK: lorapack ran from a read-only site-packages and wrote nothing into it"
