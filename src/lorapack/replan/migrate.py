"""The migration from a previous plan to its re-plan (``place --previous``): ``migrate.json`` (the steps, as data)
and ``migrate.sh`` (the same steps against running vLLM servers), written beside the new plan.

GPU ``g`` of both plans is the same server (a re-plan keeps GPU indices; both plans are assumed served at the
same ``--base-port`` / ``--gpus-per-node`` / ``--host-pattern``). The order, chosen so that the traffic only
ever follows one of two plans -- the previous one, then the new one -- and a server never loses an adapter that
requests may still reach:

1. ``start`` each GPU the new plan adds (``$SERVER_CTL start``, the new plan's ``vllm serve`` line) and wait for
   its ``/health``;
2. ``load`` each adapter a running server gains (vLLM's ``POST /v1/load_lora_adapter``; the servers need
   ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: ``RUNTIME_LORA=1 ./serve.sh``), and, for a server that restarts,
   each of its adapters on a *temporary* host (the least-loaded server that keeps running, rank permitting);
3. ``route``: one switch of every adapter to the new plan's GPUs (a restarting server's adapters to their
   temporary hosts) -- ``$ROUTES_FILE`` (routes.json's form) and ``$LITELLM_CONFIG`` (litellm.yaml) rewritten
   and ``$ROUTE_RELOAD`` run, and the workers of a vllm-router at ``$ROUTER_URL`` registered (vllm-router
   removes workers by URL only: a server losing an adapter is removed and its other adapters registered again);
4. ``drain`` (poll the server's ``/metrics`` until ``vllm:lora_requests_info`` lists none of the adapters as
   running or waiting, after ``$DRAIN_GRACE_S`` for requests already on their way) then ``unload`` each adapter
   a running server loses (``POST /v1/unload_lora_adapter``); a released server is drained and stopped
   (``$SERVER_CTL stop``);
5. each restart: drain the server, ``$SERVER_CTL restart`` with the new flags and adapters, wait for
   ``/health``, route its adapters back, drain and unload the temporary copies.

Every state the traffic passes through is judged in ``states``: before the switch it is the previous plan under
the new rates (the GPUs the re-plan found failing are named), after it the new plan (verified, or tested by the
method's oracle without ``--verify``); a temporary host carrying a restarting server's adapters is a state no
one judged, and ``states`` says so with its step.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import replace

from .. import __version__
from ..oracle import default_slot_rank
from ..placement.export import Endpoints, plan_measured, routes, serve_args, server_env
from ..placement.plan import Plan
from ..placement.routers import litellm_config, server_url
from .replan import identity_matching, needs_restart

MIGRATE_JSON = "migrate.json"
MIGRATE_SH = "migrate.sh"
MIGRATE_FILES = (MIGRATE_JSON, MIGRATE_SH)


def _lookup(plan: Plan, g: int, adapter: str) -> int | None:
    gp = plan.gpus[g]
    if gp.ranks and adapter in gp.adapters:
        return int(gp.ranks[gp.adapters.index(adapter)])
    return None


def _rank_of(previous: Plan, plan: Plan, adapter: str) -> int | None:
    for p in (plan, previous):
        for g in range(len(p.gpus)):
            r = _lookup(p, g, adapter)
            if r is not None:
                return r
    return None


def _table(plan: Plan, endpoints: Endpoints) -> dict[str, list[dict]]:
    return {a: [dict(t) for t in ts] for a, ts in routes(plan, endpoints).items()}


def migration(previous: Plan, plan: Plan, paths: Mapping[str, str], endpoints: Endpoints = Endpoints()) -> dict:
    """migrate.json's content: ``steps`` (in order, numbered from 1), ``states`` (which traffic state each
    stretch of steps leaves the GPUs in, and whether it is known to pass) and the counts."""
    endpoints = replace(endpoints, devices_per_server=plan_measured(plan)[2])
    n = max(len(previous.gpus), len(plan.gpus))

    def url(g: int) -> str:  # the server's address (its OpenAI routes are under /v1)
        return server_url(endpoints.url(g, n))

    matching = identity_matching(previous, plan)
    started = [q for p, q in matching if p is None and q is not None]
    released = [p for p, q in matching if q is None and p is not None]
    kept = [q for p, q in matching if p is not None and q is not None]
    restarting = [g for g in kept if needs_restart(previous.gpus[g].server, plan.gpus[g].server,
                                                   len(plan.gpus[g].adapters))]
    running = [g for g in kept if g not in restarting] + started  # serving throughout the restarts
    final = _table(plan, endpoints)
    load_of = {g: plan.gpus[g].incoming_tok_s for g in range(len(plan.gpus))}
    steps: list[dict] = []

    def add(kind: str, **kw) -> int:
        steps.append({"step": len(steps) + 1, "kind": kind, **kw})
        return len(steps)

    for g in started:
        add("start", gpu=g, url=url(g), args=serve_args(plan, g, dict(paths), endpoints))
        add("health", gpu=g, url=url(g))
    for g in kept:
        if g in restarting:
            continue
        for a in plan.gpus[g].adapters:
            if a not in previous.gpus[g].adapters:
                add("load", gpu=g, url=url(g), adapter=a, path=paths.get(a), rank=_rank_of(previous, plan, a),
                    temporary=False)
    # a restarting server's adapters: other GPUs of the new plan if they have some, else a temporary host
    temp: dict[int, list[tuple[str, int]]] = {}
    unserved: list[dict] = []
    switch = {a: list(ts) for a, ts in final.items()}
    chosen = (plan.replan or {}).get("restart_hosts") or {}  # the re-plan's hosts, judged there
    for x in restarting:
        for a in plan.gpus[x].adapters:
            others = [t for t in final[a] if t["gpu"] not in restarting]
            if others:
                tot = sum(t["weight"] for t in others)
                switch[a] = [{**t, "weight": t["weight"] / tot} for t in others]
                continue
            rank = default_slot_rank(_rank_of(previous, plan, a) or 1)
            hosts = [g for g in running if (plan.gpus[g].max_lora_rank or 0) >= rank and a not in plan.gpus[g].adapters]
            pick = (chosen.get(str(x)) or {}).get("hosts", {}).get(a)
            if pick in hosts:
                hosts = [pick]
            if not hosts:
                unserved.append({"adapter": a, "gpu": x})
                switch.pop(a, None)
                continue
            h = min(hosts, key=lambda g: (load_of.get(g, 0.0), g))
            load_of[h] = load_of.get(h, 0.0) + plan.gpus[x].incoming_tok_s / max(len(plan.gpus[x].adapters), 1)
            temp.setdefault(x, []).append((a, h))
            add("load", gpu=h, url=url(h), adapter=a, path=paths.get(a), rank=_rank_of(previous, plan, a),
                temporary=True)
            switch[a] = [{"gpu": h, "url": url(h), "weight": 1.0}]
    before_switch = len(steps)
    if switch != _table(previous, endpoints):  # nothing to switch when no route changes
        add("route", routes=switch, note="every adapter to the new plan's GPUs"
            + (" (a restarting server's to a temporary host)" if restarting else ""))
    switch_step = len(steps)
    for g in kept:
        if g in restarting:
            continue
        gone = [a for a in previous.gpus[g].adapters if a not in plan.gpus[g].adapters]
        if gone:
            add("drain", gpu=g, url=url(g), adapters=gone)
            for a in gone:
                add("unload", gpu=g, url=url(g), adapter=a)
    for g in released:
        add("drain", gpu=g, url=url(g), adapters=list(previous.gpus[g].adapters))
        add("stop", gpu=g, url=url(g))
    current = switch
    restart_states = []
    last_route = switch_step
    for x in restarting:
        add("drain", gpu=x, url=url(x), adapters=list(previous.gpus[x].adapters))
        add("restart", gpu=x, url=url(x), args=serve_args(plan, x, dict(paths), endpoints))
        add("health", gpu=x, url=url(x))
        later = set(restarting[restarting.index(x) + 1:])  # still to restart: their adapters stay away
        back = {**current}
        for a in plan.gpus[x].adapters:
            if not any(t["gpu"] in later for t in final[a]):
                back[a] = final[a]
        last_route = add("route", routes=back, note=f"GPU {x}'s adapters back to it")
        current = back
        mine = temp.get(x, [])
        hosts = sorted({h for _a, h in mine})
        for h in hosts:
            names = [a for a, hh in mine if hh == h]
            add("drain", gpu=h, url=url(h), adapters=names)
            for a in names:
                add("unload", gpu=h, url=url(h), adapter=a)
        if mine:  # the temporary hosts carry GPU x's traffic from the switch until its adapters are routed back
            judged = chosen.get(str(x))
            where = f"GPU {x} restarts: GPU(s) {', '.join(map(str, hosts))} carry its adapters meanwhile"
            if judged is None or any(h not in judged.get("hosts", {}).values() for h in hosts):
                state = {"passes": None, "why": f"{where}, a state nobody judged"}
            elif judged["passes"]:
                by = "verified by the twin" if judged["judged_by"] == "twin" else "tested by the method's oracle"
                state = {"passes": True, "why": f"{where}, a state {by}"}
            else:
                state = {"passes": False, "why": f"{where}; GPU(s) {', '.join(map(str, judged['failing']))} fail "
                                                 f"in that state ({judged['judged_by']})"}
            restart_states.append({"from_step": switch_step, "to_step": last_route, "gpus": hosts, **state})
    r = plan.replan or {}
    failing = list(r.get("failing_before") or [])
    verified = bool(plan.verification) and bool(plan.verification.get("passed"))
    states = [{"from_step": 0, "to_step": before_switch, "gpus": failing, "passes": not failing,
               "why": ("the previous plan's traffic under the new rates: GPU(s) " + ", ".join(map(str, failing))
                       + " fail the TEST (the reason for the moves)") if failing else
                      "the previous plan's traffic: its GPUs pass under the new rates (the re-plan's TEST)"},
              {"from_step": last_route, "to_step": len(steps), "gpus": [], "passes": True,
               "why": "the new plan's traffic: " + ("verified by the twin" if verified else
                                                   "tested by the method's oracle (not verified: --no-verify)")}]
    states[1:1] = restart_states
    for u in unserved:
        states.append({"from_step": switch_step, "to_step": len(steps), "gpus": [u["gpu"]], "passes": False,
                       "why": f"adapter {u['adapter']!r} has no server while GPU {u['gpu']} restarts "
                              "(no server that keeps running takes its rank)"})
    body = json.dumps(steps, sort_keys=True)
    return {"lorapack": __version__, "migration_id": hashlib.sha256(body.encode()).hexdigest()[:16],
            "started": started, "released": released, "restarts": restarting,
            "loads": sum(s["kind"] == "load" for s in steps), "unloads": sum(s["kind"] == "unload" for s in steps),
            "steps": steps, "states": states, "previous_routes": _table(previous, endpoints)}


# --------------------------------------------------------------------------------------------------------
# migrate.sh

_HELPERS = r"""
json_escape() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\n'/\\n}; printf '%s' "$s"; }
LORA_DIR_JSON=$(json_escape "$LORA_DIR")
auth=()
if [ -n "${VLLM_API_KEY:-}" ]; then auth=(-H "Authorization: Bearer $VLLM_API_KEY"); fi
router_auth=()
if [ -n "${ROUTER_API_KEY:-}" ]; then router_auth=(-H "Authorization: Bearer $ROUTER_API_KEY"); fi
tmp=$(mktemp) || exit 1
trap 'rm -f "$tmp"' EXIT

# post URL PATH BODY: prints the HTTP status; the response body is in $tmp
post() {
  curl -sS -o "$tmp" -w '%{http_code}' -X POST "$1$2" -H 'content-type: application/json' \
    ${auth[@]+"${auth[@]}"} -d "$3" || echo 000
}
load() {  # URL BODY NAME: vLLM's runtime load; "already loaded" (a resumed run) counts as done
  local code; code=$(post "$1" /v1/load_lora_adapter "$2")
  [ "$code" = 200 ] && return 0
  if [ "$code" = 400 ] && grep -q 'already been loaded' "$tmp"; then return 0; fi
  echo "load_lora_adapter $3 on $1: HTTP $code $(head -c 300 "$tmp")" >&2; return 1
}
unload() {  # URL NAME: vLLM's runtime unload; "not found" (a resumed run) counts as done
  local code; code=$(post "$1" /v1/unload_lora_adapter "{\"lora_name\": \"$(json_escape "$2")\"}")
  [ "$code" = 200 ] || [ "$code" = 404 ] && return 0
  echo "unload_lora_adapter $2 on $1: HTTP $code $(head -c 300 "$tmp")" >&2; return 1
}
label() {  # NAME LINE: the value of label NAME in a Prometheus sample line
  local v=${2#*$1=\"}
  [ "$v" = "$2" ] || printf '%s' "${v%%\"*}"
}
drain() {  # URL ADAPTER...: wait until no request of these adapters runs or waits on the server
  local url=$1 deadline line busy a; shift
  sleep "$DRAIN_GRACE_S"
  deadline=$((SECONDS + DRAIN_TIMEOUT_S))
  while :; do
    if ! curl -fsS ${auth[@]+"${auth[@]}"} "$url/metrics" >"$tmp"; then echo "cannot read $url/metrics" >&2; return 1; fi
    # vLLM keeps one series per label set, valued with the time it was set: the newest is the current one
    line=$(grep '^vllm:lora_requests_info{' "$tmp" | sort -g -k2 | tail -n 1)
    busy=
    for a in "$@"; do
      case ",$(label running_lora_adapters "$line"),$(label waiting_lora_adapters "$line")," in
        *",$a,"*) busy=$a; break ;;
      esac
    done
    [ -z "$busy" ] && return 0
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "$url still has requests of $busy after $DRAIN_TIMEOUT_S s" >&2; return 1
    fi
    sleep 0.5
  done
}
health() {  # URL: wait for /health
  local deadline=$((SECONDS + HEALTH_TIMEOUT_S))
  until curl -fsS -o /dev/null "$1/health"; do
    if [ "$SECONDS" -ge "$deadline" ]; then echo "$1/health did not answer in $HEALTH_TIMEOUT_S s" >&2; return 1; fi
    sleep 1
  done
}
ctl() {  # start|stop|restart GPU PORT [COMMAND...]: the operator's server control
  if [ -z "${SERVER_CTL:-}" ]; then
    echo "set SERVER_CTL to a command that can $1 GPU $2's server (called as: \$SERVER_CTL $1 GPU PORT [COMMAND...])" >&2
    return 1
  fi
  $SERVER_CTL "$@"
}
write_file() {  # PATH: stdin to PATH atomically (a router never reads half a file)
  local t; t=$(mktemp "$1.XXXXXX") && cat >"$t" && mv -f "$t" "$1"
}
router() {  # METHOD PATH [BODY]: vllm-router's workers API
  if [ $# -gt 2 ]; then
    curl -fsS -X "$1" "$ROUTER_URL$2" -H 'content-type: application/json' ${router_auth[@]+"${router_auth[@]}"} -d "$3" >/dev/null
  else
    curl -fsS -X "$1" "$ROUTER_URL$2" ${router_auth[@]+"${router_auth[@]}"} >/dev/null
  fi
}
reload_routes() { if [ -n "$ROUTE_RELOAD" ]; then $ROUTE_RELOAD; fi; }
# step K WHAT COMMAND...: run a step unless the state file says it is done; stop at the first failure
step() {
  local k=$1 what=$2; shift 2
  if grep -qx "$k" "$STATE_FILE"; then echo "step $k/$N_STEPS: done before ($what)"; return 0; fi
  echo "step $k/$N_STEPS: $what"
  if ! "$@"; then
    echo "migrate.sh: step $k failed ($what); fix the cause and run migrate.sh again: it resumes at step $k" >&2
    exit 1
  fi
  echo "$k" >>"$STATE_FILE"
}
"""


def _body(adapter: str, path: str | None, rank: int | None) -> str:
    """The load body as one shell word; without a path, ``$LORA_DIR/<id>`` expanded by the shell."""
    tail = {} if rank is None else {"rank": rank}
    name = json.dumps(adapter, ensure_ascii=False)
    if path is not None:
        return shlex.quote(json.dumps({"lora_name": adapter, "lora_path": path, **tail}, ensure_ascii=False))
    rest = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in tail.items())
    return (shlex.quote(f'{{"lora_name": {name}, "lora_path": "') + '"$LORA_DIR_JSON"'
            + shlex.quote(f'/{name[1:-1]}"{rest}}}'))


def _route_lines(k: int, what: str, before: Mapping[str, Sequence[Mapping]], after: Mapping[str, Sequence[Mapping]]
                 ) -> list[str]:
    """A route step: the router files rewritten, the reload hook, vllm-router's workers re-registered."""
    fn = f"route_{k}"
    lines = [f"{fn}() {{", '  if [ -n "$ROUTES_FILE" ]; then', '    write_file "$ROUTES_FILE" <<\'LORAPACK_ROUTES\' || return 1',
             json.dumps(after, indent=1), "LORAPACK_ROUTES", "  fi",
             '  if [ -n "$LITELLM_CONFIG" ]; then', '    write_file "$LITELLM_CONFIG" <<\'LORAPACK_LITELLM\' || return 1',
             litellm_config(after).text.rstrip("\n"), "LORAPACK_LITELLM", "  fi", "  reload_routes || return 1",
             '  if [ -n "$ROUTER_URL" ]; then']
    def models(table: Mapping[str, Sequence[Mapping]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for a, ts in table.items():
            for t in ts:
                out.setdefault(server_url(str(t["url"])), set()).add(a)
        return out

    old, new = models(before), models(after)
    posts, resets = [], []
    for u in sorted(new):
        if old.get(u, set()) <= new[u]:
            posts += [(u, a) for a in sorted(new[u] - old.get(u, set()))]
        else:
            resets.append(u)
    for u in sorted(set(old) - set(new)):
        resets.append(u)
    for u, a in posts:
        body = json.dumps({"url": u, "model_id": a}, ensure_ascii=False)
        lines.append(f"    router POST /workers {shlex.quote(body)} || return 1")
    for u in resets:  # vllm-router removes by URL: remove the server, register what it keeps
        lines.append(f"    router DELETE /workers/{shlex.quote(urllib.parse.quote(u, safe=''))} || return 1")
        for a in sorted(new.get(u, set())):
            body = json.dumps({"url": u, "model_id": a}, ensure_ascii=False)
            lines.append(f"    router POST /workers {shlex.quote(body)} || return 1")
    lines += ["  fi", "}", f"step {k} {shlex.quote(what)} {fn}"]
    return lines


def migrate_script(mig: dict, plan: Plan, endpoints: Endpoints = Endpoints()) -> str:
    """migrate.sh: the steps of ``mig`` (``migration``) as bash, resumable (module docstring)."""
    steps = mig["steps"]
    endpoints = replace(endpoints, devices_per_server=plan_measured(plan)[2])
    env = [f"{k}={shlex.quote(v)}" for k, v in server_env(plan)]
    from ..placement.export import HF_MODEL_IDS

    model = HF_MODEL_IDS.get(plan.model, plan.model)
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by lorapack {__version__}: the migration from the previous plan to this one, {len(steps)} "
        "steps (migrate.json",
        f"# lists them and the state each leaves the GPUs in): {mig['loads']} load(s), {mig['unloads']} unload(s), "
        f"{len(mig['restarts'])} restart(s), {len(mig['started'])} server(s) started, {len(mig['released'])} "
        "stopped.",
        "# Servers: vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (RUNTIME_LORA=1 ./serve.sh) and, with an API",
        "# key, VLLM_API_KEY set here too. Stops at the first failing step; run it again to resume (STATE_FILE",
        "# lists the steps done). Environment:",
        "#   ROUTES_FILE / LITELLM_CONFIG: the live routes.json / litellm.yaml to rewrite at each route switch;",
        "#   ROUTE_RELOAD: a command run after they are written (e.g. to restart the LiteLLM proxy);",
        "#   ROUTER_URL (+ ROUTER_API_KEY): a vllm-router whose workers are re-registered at each switch;",
        "#   SERVER_CTL: a command run as `$SERVER_CTL start|stop|restart GPU PORT [COMMAND...]` (servers added,",
        "#   released or restarted with new flags); DRAIN_GRACE_S (2), DRAIN_TIMEOUT_S (600), HEALTH_TIMEOUT_S (900).",
        "set -u",
        f'MODEL="${{MODEL:-{model}}}"',
        'LORA_DIR="${LORA_DIR:-./adapters}"',
        'BIND_HOST="${BIND_HOST:-0.0.0.0}"',
        'STATE_FILE="${STATE_FILE:-$(dirname -- "$0")/migrate.state}"',
        'ROUTES_FILE="${ROUTES_FILE:-}"', 'LITELLM_CONFIG="${LITELLM_CONFIG:-}"', 'ROUTE_RELOAD="${ROUTE_RELOAD:-}"',
        'ROUTER_URL="${ROUTER_URL:-}"', 'SERVER_CTL="${SERVER_CTL:-}"',
        'DRAIN_GRACE_S="${DRAIN_GRACE_S:-2}"', 'DRAIN_TIMEOUT_S="${DRAIN_TIMEOUT_S:-600}"',
        'HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-900}"',
        f"N_STEPS={len(steps)}",
        f"MIGRATION_ID={mig['migration_id']}",
        _HELPERS,
        "# the state file belongs to one migration: a different one is refused, not resumed",
        'if [ -s "$STATE_FILE" ]; then',
        '  if [ "$(head -n 1 "$STATE_FILE")" != "migration $MIGRATION_ID" ]; then',
        '    echo "migrate.sh: $STATE_FILE belongs to another migration; remove it to start this one" >&2; exit 2',
        "  fi",
        "else",
        '  echo "migration $MIGRATION_ID" >"$STATE_FILE" || exit 1',
        "fi",
    ]
    notes = {s["from_step"]: s for s in mig["states"] if s["passes"] is not True}
    current = mig["previous_routes"]
    for s in steps:
        k, kind = s["step"], s["kind"]
        note = notes.get(k - 1)
        if note is not None:
            lines.append(f"echo {shlex.quote('note: from here to step ' + str(note['to_step']) + ': ' + note['why'])}")
        if kind == "route":
            lines += _route_lines(k, f"route: {s['note']}", current, s["routes"])
            current = s["routes"]
            continue
        url = shlex.quote(s["url"])
        gpu = s["gpu"]
        if kind == "load":
            what = f"load {s['adapter']} on GPU {gpu}" + (" (temporary)" if s["temporary"] else "")
            cmd = f"load {url} {_body(s['adapter'], s['path'], s['rank'])} {shlex.quote(s['adapter'])}"
        elif kind == "unload":
            what, cmd = f"unload {s['adapter']} from GPU {gpu}", f"unload {url} {shlex.quote(s['adapter'])}"
        elif kind == "drain":
            what = f"drain GPU {gpu} of {len(s['adapters'])} adapter(s)"
            cmd = f"drain {url} " + " ".join(shlex.quote(a) for a in s["adapters"])
        elif kind == "health":
            what, cmd = f"wait for GPU {gpu}'s /health", f"health {url}"
        elif kind == "stop":
            what, cmd = f"stop GPU {gpu}", f"ctl stop {gpu} {endpoints.port(gpu)}"
        else:  # start / restart: the new plan's serve.sh line of the GPU
            words = ["env", f"CUDA_VISIBLE_DEVICES={endpoints.devices(gpu)}", *env, "vllm", "serve", '"$MODEL"',
                     *s["args"]]
            what, cmd = f"{kind} GPU {gpu}", f"ctl {kind} {gpu} {endpoints.port(gpu)} " + " ".join(words)
        lines.append(f"step {k} {shlex.quote(what)} {cmd}")
    lines += ['echo "migrate.sh: all $N_STEPS steps done"', ""]
    return "\n".join(lines)


def migration_files(previous: Plan, plan: Plan, paths: Mapping[str, str], endpoints: Endpoints = Endpoints()
                    ) -> dict[str, str]:
    """``{file name: text}`` of migrate.json and migrate.sh."""
    mig = migration(previous, plan, paths, endpoints)
    return {MIGRATE_JSON: json.dumps(mig, indent=1) + "\n", MIGRATE_SH: migrate_script(mig, plan, endpoints)}
