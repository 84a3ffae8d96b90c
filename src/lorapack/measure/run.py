"""``lorapack measure``: identify a live vLLM server, run the experiments within a time budget, write a
measurement directory that ``lorapack calibrate --profiling DIR --runs DIR/runs.csv`` fits.

The directory (docs/profile-your-gpu.md): ``measure.json`` (the server's identity, the settings, which
experiments are done), one CSV per experiment (``decode``, ``prefill``, ``lora``, ``loading``, ``runs``). Every
file is written atomically when its experiment (for ``runs``: each run) ends, so a measurement killed at any
moment resumes where it stopped: same command, same ``--out``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from .. import __version__
from ..checks import check_input_file, check_output_dir, write_text_atomic
from . import experiments as ex
from .fit import (
    FORMAT,
    MEASURE_JSON,
    decode_itl_ms,
    fit_decode,
    fit_lora,
    fit_prefill,
    model_label,
    read_rows,
)
from .probe import (
    Http,
    Identity,
    MeasureError,
    check_url,
    parse_server_args,
    read_log,
    scrape,
    served,
    version,
)
from .runs import RunAdapter, RunSpec, run_once, run_row

# shares of the budget per experiment (the runs get the most: they are what calibrate refines against)
SHARES = {"decode": 0.17, "prefill": 0.05, "lora": 0.17, "loading": 0.06, "runs": 0.50}
ORDER = ("decode", "prefill", "lora", "loading", "runs")
MIN_BUDGET_MIN = 2.0
DEFAULT_MEAN_INPUT, DEFAULT_MEAN_OUTPUT = 128.0, 128.0
# (adapters as a multiple of --max-loras, load as a fraction of the estimated capacity): above and below the
# slots, light to starving; the first three are what a short budget gets
RUN_DESIGNS = ((1.0, 0.5), (2.0, 0.8), (0.5, 1.5), (3.0, 0.6), (1.0, 1.1), (2.0, 1.6), (0.5, 0.3), (3.0, 1.3),
               (1.5, 0.9), (4.0, 0.4), (1.0, 0.75), (2.0, 1.2))
SETTLE_S = 3.0  # after a run: the cancelled requests leave, the server goes idle
# A run's window should be this many times a request's time alone (the mean lengths): "starved" compares the
# tokens completed in the window with those an idle server could complete, and a batched request in flight at
# the end, slower than alone, counts against the ratio. On a CPU testbed ~3x slower than usual (a request 2.8 s
# alone) 27 s windows read ratios 0.74-0.79 at 0.5 x capacity with nothing waiting (docs/testbed.md).
WINDOW_PER_SOLO = 15.0
MIN_WINDOW_S, MAX_WINDOW_S = 15.0, 120.0


def read_adapters(path: str | Path) -> list[tuple[str, int, str | None]]:
    """``adapter_id,rank[,path]`` rows (a header line is required)."""
    p = check_input_file(path, "--adapters file", MeasureError)
    text = p.read_text(errors="replace")
    reader = csv.DictReader(io.StringIO(text))
    cols = [c.strip() for c in (reader.fieldnames or [])]
    if "adapter_id" not in cols or "rank" not in cols:
        raise MeasureError(f"--adapters {p}: expected a header adapter_id,rank[,path]; found {','.join(cols) or 'none'}")
    out = []
    seen = set()
    for line, row in enumerate(reader, start=2):
        row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
        aid, rank = row.get("adapter_id", ""), row.get("rank", "")
        if not aid:
            raise MeasureError(f"--adapters {p}:{line}: empty adapter_id")
        if aid in seen:
            raise MeasureError(f"--adapters {p}:{line}: adapter {aid!r} listed twice")
        seen.add(aid)
        try:
            r = int(rank)
            if r < 1:
                raise ValueError
        except ValueError:
            raise MeasureError(f"--adapters {p}:{line}: rank {rank!r}; expected an integer >= 1") from None
        out.append((aid, r, row.get("path") or None))
    if not out:
        raise MeasureError(f"--adapters {p}: no adapters listed")
    return out


def identify(http: Http, adapters: Sequence[tuple[str, int, str | None]], log: Path | None, server_args: str | None,
             log_fn: Callable[[str], None]) -> tuple[Identity, list[str]]:
    """The server's identity; loads the listed adapters it does not serve (when a path is given and the server
    allows runtime loading) and returns their ids (to unload at the end)."""
    ver = version(http)
    base, mml, served_ids = served(http)
    from_log = read_log(log) if log is not None else {}
    from_args = parse_server_args(server_args) if server_args else {}
    if not served_ids and not any(path for _a, _r, path in adapters):
        raise MeasureError(f"--url {http.url}: the server serves no LoRA adapter; start it with --enable-lora "
                           "--lora-modules NAME=PATH ...")
    loaded = []
    for aid, _r, path in adapters:
        if aid in served_ids:
            continue
        if path is None:
            raise MeasureError(f"--adapters: adapter {aid!r} is not served at {http.url} (served: "
                               f"{', '.join(served_ids[:8]) or 'no LoRA adapters'}) and has no path to load it from")
        status, body = http.json("/v1/load_lora_adapter", {"lora_name": aid, "lora_path": path})
        if status != 200:
            why = ("the server does not allow runtime LoRA loading (start it with "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)" if status == 404 else f"HTTP {status}: {body}")
            raise MeasureError(f"--adapters: cannot load adapter {aid!r} from {path}: {why}")
        loaded.append(aid)
        served_ids.append(aid)
    if not served_ids:
        raise MeasureError(f"--url {http.url}: the server serves no LoRA adapter; start it with --enable-lora "
                           "--lora-modules NAME=PATH ...")
    # one LoRA request: vllm:lora_requests_info (and so --max-loras) exists from then on
    probe = http.json("/v1/completions", {"model": adapters[0][0], "prompt": [5, 6, 7, 8], "max_tokens": 1,
                                          "ignore_eos": True})
    if probe[0] != 200:
        raise MeasureError(f"--url {http.url}: a request to adapter {adapters[0][0]!r} failed: HTTP {probe[0]} "
                           f"{str(probe[1])[:200]}")
    per_request_metrics = isinstance(probe[1].get("metrics"), dict)
    sc = scrape(http)
    sources: dict[str, str] = {}

    def pick(key: str, metric=None, default=None, required: bool = False):
        for src, val in (("--server-args", from_args.get(key)), ("--log", from_log.get(key)),
                         ("/metrics", metric)):
            if val is not None:
                sources[key] = src
                return val
        if required and default is None:
            raise MeasureError(f"the server's --{key.replace('_', '-')} is unknown: pass --log FILE (its start-up "
                               f"log) or --server-args '--{key.replace('_', '-')} N ...'")
        sources[key] = "vLLM default" if default is not None else "unknown"
        return default

    max_loras = int(pick("max_loras", sc.max_lora, required=True))
    max_lora_rank = int(pick("max_lora_rank", None, 16))
    kv = sc.kv_cache_tokens or from_log.get("kv_cache_tokens")
    if kv is None:
        raise MeasureError(f"--url {http.url}: neither vllm:cache_config_info nor --log gives the KV cache size")
    cache = sc.cache
    ident = Identity(
        url=http.url, vllm_version=ver, model=base,
        max_model_len=int(pick("max_model_len", mml, required=True)), served_adapters=list(served_ids),
        max_loras=max_loras, max_lora_rank=max_lora_rank,
        max_cpu_loras=int(pick("max_cpu_loras", None, max_loras)),
        max_num_seqs=int(pick("max_num_seqs", None, required=True)),
        max_num_batched_tokens=int(pick("max_num_batched_tokens", None, required=True)),
        kv_cache_tokens=int(kv), block_size=int(float(cache.get("block_size", 16))),
        gpu_memory_utilization=float(pick("gpu_memory_utilization", _num(cache.get("gpu_memory_utilization")))
                                     or 0.9),
        prefix_caching=bool(pick("enable_prefix_caching", _bool(cache.get("enable_prefix_caching")), False)),
        device=from_log.get("device"), tensor_parallel_size=int(pick("tensor_parallel_size", None, 1)),
        per_request_metrics=per_request_metrics, sources=sources)
    too_big = [a for a, r, _ in adapters if r > ident.max_lora_rank]
    if too_big:
        raise MeasureError(f"--adapters: {too_big[0]} has a rank above the server's --max-lora-rank "
                           f"{ident.max_lora_rank}")
    return ident, loaded


def _num(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "", "None") else None
    except ValueError:
        return None


def _bool(v: str | None) -> bool | None:
    return None if v in (None, "", "None") else v == "True"


def _write_csv(path: Path, rows: list[dict]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()})
    write_text_atomic(path, buf.getvalue())


class Store:
    """The measurement directory: ``measure.json`` and the experiments' CSV files."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.meta_path = out / MEASURE_JSON
        self.meta: dict = json.loads(self.meta_path.read_text()) if self.meta_path.is_file() else {}

    def begin(self, ident: Identity, settings: dict, fresh: bool) -> bool:
        """Start or resume; True when resuming."""
        if self.meta and not fresh:
            old = self.meta.get("identity", {})
            key = ident.key()
            diff = [k for k, v in key.items() if old.get(k) != v]
            if diff:
                raise MeasureError(f"--out {self.out}: holds a measurement of another server ({diff[0]} "
                                   f"{old.get(diff[0])!r}, now {key[diff[0]]!r}); use another --out or --fresh")
            if self.meta.get("settings", {}).get("seed") != settings["seed"]:
                raise MeasureError(f"--out {self.out}: was measured with --seed {self.meta['settings'].get('seed')}; "
                                   "give the same seed to resume, or --fresh")
            self.meta["identity"] = asdict(ident)
            self.save()
            return True
        self.meta = {"format": FORMAT, "format_version": 1, "lorapack_version": __version__,
                     "started": datetime.now(UTC).replace(microsecond=0).isoformat(),
                     "identity": asdict(ident), "settings": settings, "experiments": {}}
        self.save()
        return False

    def save(self) -> None:
        write_text_atomic(self.meta_path, json.dumps(self.meta, indent=2, default=str) + "\n")

    def done(self, name: str) -> bool:
        return self.meta.get("experiments", {}).get(name, {}).get("status") == "done"

    def finish(self, name: str, rows: list[dict], wall_s: float, note: str = "") -> None:
        if rows:
            _write_csv(self.out / f"{name}.csv", rows)
        self.meta["experiments"][name] = {"status": "done", "rows": len(rows), "wall_s": round(wall_s, 1),
                                          **({"note": note} if note else {})}
        self.save()


def plan(budget_s: float) -> dict[str, float]:
    return {k: SHARES[k] * budget_s for k in ORDER}


def capacity_rps(ctx: ex.Context, store: Store, n_adapters: int, mean_in: float, mean_out: float) -> float:
    """Requests/s the server sustains at full batch, from the fits so far (decode, prefill, LoRA)."""
    c0, c1, a3, _ = fit_decode(read_rows(store.out, "decode.csv"))
    p1, _ = fit_prefill(read_rows(store.out, "prefill.csv"), c0, c1)
    (e0, e1, e2), _ = fit_lora(read_rows(store.out, "lora.csv"))
    b = ctx.concurrency_cap()
    lora = min(n_adapters, ctx.identity.max_loras)
    step = decode_itl_ms(c0, c1, a3, b, mean_in + mean_out / 2) + e0 + e1 * b + e2 * lora
    per_request_ms = mean_out * step / b + mean_in * (p1 + e1)
    return 1000.0 / per_request_ms


def idle_service(mdir: Path | Store, budget_tokens: int) -> Callable[[int, int], float]:
    """A request's time alone on the server (s), from the decode and prefill fits of a measurement."""
    out = mdir.out if isinstance(mdir, Store) else Path(mdir)
    c0, c1, _a3, _ = fit_decode(read_rows(out, "decode.csv"))
    p1, _ = fit_prefill(read_rows(out, "prefill.csv"), c0, c1)
    (e0, e1, e2), _ = fit_lora(read_rows(out, "lora.csv"))
    step = c0 + c1 + e0 + e1 + e2  # one request of one adapter (the twin's idle_service_s)

    def solo(prompt: int, output: int) -> float:
        return (math.ceil(prompt / budget_tokens) * step + prompt * (p1 + e1) + max(output - 1, 0) * step) / 1000

    return solo


def short_window_note(window_s: float, solo_s: float, n_runs: int) -> str | None:
    """One line when the runs' windows are short against a request's time alone on the server (``solo_s``, the
    mean lengths): their "starved" labels then read low; it names the ``--budget-min`` that would do."""
    want_s = WINDOW_PER_SOLO * solo_s
    if not (solo_s > 0) or window_s >= want_s:
        return None
    head = (f"runs: note: a request of the mean lengths takes {solo_s:.1f} s alone on this server, so "
            f"{window_s:.0f} s windows are short ({WINDOW_PER_SOLO:g}x that is {want_s:.0f} s): the requests in "
            f"flight at a window's end lower its throughput ratio and can mark a light run starved; ")
    if want_s > MAX_WINDOW_S:
        return head + f"windows stop at {MAX_WINDOW_S:.0f} s, so read the runs' starved labels with care"
    need_min = (want_s + SETTLE_S) * n_runs / SHARES["runs"] / 60.0
    return head + f"--budget-min {math.ceil(need_min)} --runs {n_runs} would give windows that long"


def run_designs(ctx: ex.Context, n_runs: int) -> list[tuple[int, float]]:
    a = ctx.identity.max_loras
    n_avail = len(ctx.adapters)
    out = []
    for mult, load in RUN_DESIGNS[:n_runs]:
        n = int(min(n_avail, max(1, round(mult * a))))
        out.append((n, load))
    return out


@dataclass(frozen=True)
class MeasureTarget:
    """The server ``measure`` measures: a running one at ``url``, or ``launch``: a ``vllm serve`` command that
    lorapack starts itself (``measure.launch``), first once per ``grid`` point (--max-loras x --max-lora-rank,
    ``startup.csv``; at most ``start_timeout_s`` per start), then once for the experiments. ``log`` (its start-up
    log) and ``server_args`` (its ``vllm serve`` flags) tell the flags ``/metrics`` does not; ``api_key`` is sent
    as a bearer token. Invalid values raise ``MeasureError`` naming the flag."""

    url: str | None = None
    launch: str | None = None
    grid: tuple[tuple[int, int], ...] = ()
    start_timeout_s: float | None = None
    log: Path | None = None
    server_args: str | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(tuple(g) for g in self.grid))
        if self.launch is not None:
            if self.url:
                raise MeasureError("--url and --launch: give one (with --launch lorapack starts the server on "
                                   "127.0.0.1 itself)")
        else:
            if self.grid:
                raise MeasureError("--grid-max-loras: a start-up grid needs --launch (lorapack starts the server "
                                   "per point)")
            if not self.url:
                raise MeasureError("--url: missing; give the server's base address, or --launch 'vllm serve ...'")
            object.__setattr__(self, "url", check_url(self.url))
        object.__setattr__(self, "log", Path(self.log) if self.log else None)


@dataclass(frozen=True)
class MeasureOptions:
    """How ``measure`` measures: the wall-time budget (minutes; the experiments scale their repetitions to it),
    the seed of every prompt, length and arrival, the traffic limits (``Caps``), the runs' mean request lengths
    and number (None: as many as the budget allows, at least 3); ``force``: measure a busy server; ``fresh``:
    start over instead of resuming. Invalid values raise ``MeasureError`` naming the flag."""

    budget_min: float = 20.0
    seed: int = 0
    caps: ex.Caps = field(default_factory=ex.Caps)
    mean_input_tokens: float = DEFAULT_MEAN_INPUT
    mean_output_tokens: float = DEFAULT_MEAN_OUTPUT
    n_runs: int | None = None
    force: bool = False
    fresh: bool = False

    def __post_init__(self) -> None:
        b = self.budget_min
        if not (isinstance(b, int | float) and math.isfinite(b) and b >= MIN_BUDGET_MIN):
            raise MeasureError(f"--budget-min {b}: expected a number of minutes >= {MIN_BUDGET_MIN:g}")
        caps = self.caps
        for name, v in (("--max-concurrency", caps.max_concurrency), ("--max-rate", caps.max_rate_rps),
                        ("--max-prompt-tokens", caps.max_prompt_tokens),
                        ("--max-output-tokens", caps.max_output_tokens),
                        ("--mean-input-tokens", self.mean_input_tokens),
                        ("--mean-output-tokens", self.mean_output_tokens)):
            if not (math.isfinite(v) and v >= 1):
                raise MeasureError(f"{name} {v}: expected a number >= 1")
        if self.n_runs is not None and self.n_runs < 1:
            raise MeasureError(f"--runs {self.n_runs}: expected an integer >= 1")


def measure(target: MeasureTarget, adapters_csv: str | Path, out: str | Path, options: MeasureOptions | None = None,
            say: Callable[[str], None] = print, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Measure the server ``target`` names (``MeasureTarget``: at its url, or launched by lorapack) into ``out``
    as ``options`` says (``MeasureOptions``; see the module docstring); returns a summary. ``say`` receives
    the messages, ``progress(experiment, done, total)`` the progress."""
    t_start = time.monotonic()
    options = options or MeasureOptions()
    if target.launch is not None:
        return _measure_launched(target, adapters_csv, out, options, say, progress, t_start)
    url = target.url
    assert url is not None  # MeasureTarget: a url or a launch command
    caps = options.caps
    budget_min, seed = options.budget_min, options.seed
    mean_input_tokens, mean_output_tokens = options.mean_input_tokens, options.mean_output_tokens
    adapters = read_adapters(adapters_csv)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MeasureError(f"--out {out}: exists and is not a directory")
    http = Http(url, target.api_key)
    version(http)  # a vLLM server answers there (one line otherwise), before anything else is asked of it
    sc = scrape(http)  # before the one probe request identify sends: a busy server gets none
    if sc.running + sc.waiting > 0 and not options.force:
        raise MeasureError(f"--url {url}: the server is busy ({sc.running:.0f} running, {sc.waiting:.0f} "
                           "waiting requests); measure an idle server, or pass --force")
    ident, loaded = identify(http, adapters, target.log, target.server_args, say)
    try:
        out = check_output_dir(out, "--out", create=True)  # created once the server answered
        budget_s = 60.0 * budget_min
        settings = {"seed": seed, "budget_min": budget_min, "caps": asdict(caps),
                    "mean_input_tokens": mean_input_tokens, "mean_output_tokens": mean_output_tokens}
        store = Store(out)
        resumed = store.begin(ident, settings, options.fresh)
        scale = min(1.0, budget_min / 20.0)
        ctx = ex.Context(http, ident, [(a, r) for a, r, _ in adapters], caps, seed, scale, say)
        shares = plan(budget_s)
        todo = [k for k in ORDER if not store.done(k)]
        say(f"measuring {ident.model} on vLLM {ident.vllm_version} at {url}: --max-loras {ident.max_loras}, "
            f"--max-lora-rank {ident.max_lora_rank}, --max-cpu-loras {ident.max_cpu_loras}, --max-num-seqs "
            f"{ident.max_num_seqs}, --max-num-batched-tokens {ident.max_num_batched_tokens}, KV cache "
            f"{ident.kv_cache_tokens:,} tokens" + (" (resuming)" if resumed else ""))
        est = sum(shares[k] for k in todo)
        say(f"estimated duration: {est / 60:.1f} min ({', '.join(f'{k} {shares[k] / 60:.1f}' for k in todo)} min)")
        ex.warm_up(ctx)
        # distinct prompts across resumptions: start the indices past what earlier sessions used
        ctx.next_index[0] += 10_000_000 * len(store.meta.get("experiments", {}))
        runners = {"decode": ex.run_decode, "prefill": ex.run_prefill, "lora": ex.run_lora,
                   "loading": ex.run_loading}
        for name in todo:
            t0 = time.monotonic()
            say(f"{name}: up to {shares[name] / 60:.1f} min")

            def prog(i: int, n: int, name: str = name) -> None:
                if progress is not None:
                    progress(name, i, n)

            if name == "runs":
                rows = _runs(ctx, store, shares[name], options.n_runs, mean_input_tokens, mean_output_tokens, say,
                             prog)
            else:
                rows = runners[name](ctx, shares[name], prog)
            store.finish(name, rows, time.monotonic() - t0)
    finally:
        for aid in loaded:
            http.json("/v1/unload_lora_adapter", {"lora_name": aid})
    wall = time.monotonic() - t_start
    cmd = f"lorapack calibrate --profiling {out} --runs {out / 'runs.csv'}"
    say(f"done in {wall / 60:.1f} min; next: {cmd}")
    return {"out": str(out), "wall_s": wall, "identity": asdict(ident), "calibrate": cmd}


def _measure_launched(target: MeasureTarget, adapters_csv, out, options: MeasureOptions,
                      say: Callable[[str], None], progress, t_start: float) -> dict:
    from . import launch as ln

    template, grid = target.launch, target.grid
    assert template is not None
    ln.command_words(template, [])  # a bad command line is an error before anything starts
    read_adapters(adapters_csv)
    timeout = ln.DEFAULT_START_TIMEOUT_S if target.start_timeout_s is None else float(target.start_timeout_s)
    out = check_output_dir(out, "--out", create=True)
    if options.fresh:
        (out / "startup.csv").unlink(missing_ok=True)
    rows: list[dict] = []
    if grid:
        say(f"startup: {len(grid)} start(s) of the server, one per --max-loras x --max-lora-rank point")
        done = read_rows(out, "startup.csv", required=False)
        rows = ln.startup_grid(template, list(grid), out / "logs", timeout, say, done=done,
                               save=lambda r: _write_csv(out / "startup.csv", r))
    say("starting the server for the experiments")
    server = ln.start(template, [], out / "logs" / "server.log", timeout)
    try:
        running = MeasureTarget(url=server.url, log=server.log, server_args=target.server_args,
                                api_key=target.api_key)
        summary = measure(running, adapters_csv, out, options, say, progress)
    finally:
        server.stop()
    if rows:
        store = Store(out)
        store.meta["experiments"]["startup"] = {"status": "done", "rows": len(rows)}
        store.save()
    summary["wall_s"] = time.monotonic() - t_start
    summary["startup"] = rows
    return summary


def _runs(ctx: ex.Context, store: Store, seconds: float, n_runs: int | None, mean_in: float, mean_out: float,
          say: Callable[[str], None], prog: Callable[[int, int], None]) -> list[dict]:
    ident = ctx.identity
    if n_runs is None:
        n_runs = int(np.clip(seconds // 75, 3, len(RUN_DESIGNS)))
    window = float(np.clip(seconds / n_runs - SETTLE_S, MIN_WINDOW_S, MAX_WINDOW_S))
    solo = idle_service(store, ident.max_num_batched_tokens)
    note = short_window_note(window, solo(round(mean_in), round(mean_out)), n_runs)
    if note:
        say(note)
    designs = run_designs(ctx, n_runs)
    done_rows = read_rows(store.out, "runs.csv", required=False)
    state = store.meta.setdefault("runs_progress", {"done": 0})
    rows: list[dict] = [dict(r) for r in done_rows][: state["done"]]
    label = model_label(ident.model)
    for k, (n, load) in enumerate(designs):
        if k < len(rows):
            continue
        chosen = ctx.adapters[:n]
        cap = capacity_rps(ctx, store, n, mean_in, mean_out)
        total = min(ctx.caps.max_rate_rps, load * cap)
        run_adapters = [RunAdapter(a, r, total / n) for a, r in chosen]
        run_id = f"measure__{label}__load_{load:g}___{ident.max_loras}_{n}_{ident.max_lora_rank}_{k}"
        say(f"runs: {k + 1}/{len(designs)}: {n} adapters, {total:.2f} req/s ({load:g} x the estimated "
            f"capacity), {window:.0f} s")
        run = RunSpec(run_id, tuple(run_adapters), window, ctx.seed + k, mean_in, mean_out)
        arrivals, res = run_once(ctx.url, ident.model, run, api_key=ctx.http.api_key,
                                 stream=not ident.per_request_metrics)
        row = run_row(run, label, ident, arrivals, res,
                      idle_service_s=idle_service(store, ident.max_num_batched_tokens))
        if row["n_failed"]:
            raise MeasureError(f"runs: {row['n_failed']} requests of run {run_id} failed")
        rows.append(row)
        ex.wait_idle(ctx.http)
        _write_csv(store.out / "runs.csv", rows)
        state["done"] = len(rows)
        store.save()
        prog(k + 1, len(designs))
    return rows
