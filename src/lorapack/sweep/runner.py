"""``run_sweep``: select configs, skip what a previous run wrote, run the rest, append Parquet parts."""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..checks import check_limit, check_output_dir, check_workers
from ..errors import SpecError
from ..executor import BACKENDS, Executor, RaySession, default_workers
from ..fingerprint import twin_fingerprint
from ..guards import Limits, check
from ..profile import Profile, find_profile
from .grid import GridSpec, SweepConfig, boundary_configs, group_series, select_configs
from .store import (
    FORMAT_VERSION,
    META_FILE,
    PartWriter,
    check_resumable,
    clean_temporaries,
    done_config_ids,
    lock_dir,
    part_files,
    read_rows,
    write_meta,
)
from .work import (
    OBTAINED_OOM,
    OBTAINED_PRUNED,
    Shortcuts,
    WorkBatch,
    WorkUnit,
    arrivals_group,
    early_stop_available,
    oom_row,
    run_batch,
)

FLUSH_ROWS = 2000
FLUSH_S = 20.0


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs (``run_sweep``, ``estimate_sweep``; ``lorapack sweep``'s flags), checked when made.

    ``backend``/``address``/``workers``: the executor (``lorapack.executor``; ``address`` only with ``ray``,
    ``workers`` 0 = all cores); ``limit``: whole N-series of the grid's seeded shuffle until at least K configs
    (``grid.select_configs``); ``resume``: continue the sweep already in the output directory; ``shortcuts``:
    early stop and N-series pruning; ``limits``: resource limits per config (``guards``; None = the defaults);
    ``flush_rows``/``flush_s``: a Parquet part after this many rows or seconds (whole units only)."""

    backend: str = "local"
    address: str | None = None
    workers: int = 0
    limit: int | None = None
    resume: bool = False
    shortcuts: Shortcuts = field(default_factory=Shortcuts)
    limits: Limits | None = None
    flush_rows: int = FLUSH_ROWS
    flush_s: float = FLUSH_S

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise SpecError(f"--backend {self.backend}: expected one of {', '.join(BACKENDS)}")
        check_workers(self.workers)
        if self.backend == "local" and self.address is not None:
            raise SpecError("--address is only used with --backend ray")
        check_limit(self.limit)


def check_resources(configs: list[SweepConfig], profile: Profile, limits: Limits | None = None) -> None:
    """Cost of the most expensive config (``guards``), before the sweep creates anything.

    A config's requests are the sum of its N adapters' rates (its rate tuple round-robin, a rate law's draw, padding
    or an explicit vector: ``SweepConfig.rates_rps``) x duration_s."""
    from ..guards import Estimate, min_step_ms, profile_step_coef

    if not configs:
        return
    step_ms = min_step_ms(profile_step_coef(profile))
    worst: dict[tuple, SweepConfig] = {}
    for c in configs:  # one per (rates, N, duration, lengths): the rest do not change the cost
        worst.setdefault((c.rate_tuple, c.rate_law, c.pad_fraction, c.explicit_rates, c.seed, c.served_adapters,
                          c.duration_s, c.mean_input_tokens, c.mean_output_tokens, c.lengths_kind), c)
    for c in worst.values():
        rate = float(c.rates_rps().sum())
        tokens = (max(1, round(c.mean_input_tokens)) + max(1, round(c.mean_output_tokens))
                  if c.lengths_kind == "fixed" else c.mean_input_tokens + c.mean_output_tokens)
        check(Estimate(requests=rate * c.duration_s, duration_s=c.duration_s, n_adapters=c.served_adapters,
                       requests_from=f"grid config N={c.served_adapters} ("
                                     f"{f'rate tuple {list(c.rate_tuple)}' if c.rate_tuple else 'drawn rates'}, "
                                     f"{rate:g} req/s in all) over duration_s {c.duration_s:g} s",
                       tokens_per_request=tokens, min_step_ms=step_ms), limits)


def build_units(configs: list[SweepConfig], prune: bool, limits: Limits | None = None) -> list[WorkUnit]:
    """One unit per config, or (``prune``) one per N-series with N increasing.

    Units are ordered by (seed, rate tuple), so that the configs sharing arrivals run close together and
    hit the workers' request cache (``work.config_requests``), then largest first; rows do not depend on it.
    """
    if not prune:
        units = [WorkUnit([c], limits=limits) for c in configs]
    else:
        units = [WorkUnit(cs, prune=True, limits=limits) for cs in group_series(configs)]
    first = {}
    for u in units:
        first.setdefault((u.configs[0].seed, u.configs[0].rate_tuple), len(first))
    units.sort(key=lambda u: (first[(u.configs[0].seed, u.configs[0].rate_tuple)], -len(u.configs),
                              u.configs[0].served_adapters))
    return units


# at least this many tasks per worker, so that the last ones leave no worker idle for long: a group larger
# than its share is split (its arrival sets are then generated once per share)
BATCHES_PER_WORKER = 8


def build_batches(units: list[WorkUnit], workers: int, timed: bool = False) -> list[WorkBatch]:
    """The units in tasks: one per arrivals group (``work.arrivals_group``, in order of first appearance), a
    group of more than ``len(units) / (BATCHES_PER_WORKER * workers)`` units cut into shares of about that
    size. Rows do not depend on it."""
    groups: dict[tuple, list[WorkUnit]] = {}
    for u in units:
        groups.setdefault(arrivals_group(u.configs[0]), []).append(u)
    cap = max(1, math.ceil(len(units) / (BATCHES_PER_WORKER * max(1, workers))))
    batches = []
    for us in groups.values():
        n_shares = math.ceil(len(us) / cap)
        bounds = [round(k * len(us) / n_shares) for k in range(n_shares + 1)]  # shares of equal size +- 1
        batches += [WorkBatch(us[lo:hi], timed) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    return batches


def _worker_warm_up() -> None:
    """Compile (or load) the engine once per worker, so that rows' ``wall_s`` exclude it."""
    from ..twin.engine import warm_up

    warm_up()


def execute(units: list[WorkUnit], profile: Profile, shortcuts: Shortcuts, backend: str = "local",
            workers: int = 0, address: str | None = None, session: RaySession | None = None,
            timed: bool = False) -> Iterator[tuple[WorkUnit, list[dict]]]:
    """Run ``units`` with the executor (``lorapack.executor``) in batches (``build_batches``); yields
    ``(unit, rows)`` as batches complete. ``timed``: rows also carry their CPU and arrivals-generation seconds
    (``WorkBatch.timed``; ``--estimate``)."""
    with Executor(workers, backend, address, initializer=_worker_warm_up, session=session) as ex:
        batches = build_batches(units, ex.workers, timed)
        for i, rows in ex.imap(run_batch, ((b, profile, shortcuts) for b in batches)):
            yield from zip(batches[i].units, rows, strict=True)


def sweep_meta(grid: GridSpec, profile: Profile, shortcuts: Shortcuts) -> dict:
    return {
        "format": FORMAT_VERSION, "grid_name": grid.name, "grid": grid.canonical(), "grid_hash": grid.grid_hash(),
        "twin_version": __version__, "profile_hash": profile.file_hash(),
        "twin_fingerprint": twin_fingerprint(profile), "model": profile.model,
        "gpu": profile.gpu, "vllm_version": profile.vllm_version, "shortcuts": shortcuts.as_dict(),
        "early_stop_active": bool(shortcuts.early_stop and early_stop_available()),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "notes": "one row per config; see lorapack.sweep.work for columns, 'obtained' for how a row was made",
    }


def run_sweep(grid: GridSpec, out: str | Path, options: SweepOptions = SweepOptions(),
              configs: list[SweepConfig] | None = None, progress: bool = False,
              on_unit: Callable[[WorkUnit, list[dict]], None] | None = None, timings: dict | None = None,
              timed: bool = False) -> dict:
    """Run (or continue) a sweep of ``grid`` into ``out`` as ``options`` say (``SweepOptions``: backend,
    workers, limit, resume, shortcuts, limits, flushing); returns the summary dict.

    ``configs`` replaces the grid's selection (benches and ``--estimate`` use it to run a sample); ``limit``
    takes whole N-series of the grid's fixed seeded shuffle of series until at least K configs
    (``grid.select_configs``). ``timings`` (a dict, filled in; seconds since the start): ``setup_s`` (until the
    workers start), ``oom_rows_s`` (building OOM rows, part of the setup), ``phases`` (``[start, end]`` of each
    executor run: the grid, then the boundary seeds); ``timed``: rows also carry CPU and arrivals seconds (see
    ``execute``).

    Rows are appended as atomic Parquet parts after every ``flush_rows`` rows or ``flush_s`` seconds (whole
    units only), and once more at the end or on an error.

    Before anything is created: ``out`` must be (or be creatable as) a writable directory, and every config
    must fit ``limits`` (``guards``). A sweep that fails before writing its first part removes what it
    created (``_sweep.json``, the directory), so the next run starts afresh instead of asking for --resume.
    """
    backend, address, workers, limit, resume = (options.backend, options.address, options.workers, options.limit,
                                                options.resume)
    shortcuts, limits, flush_rows, flush_s = options.shortcuts, options.limits, options.flush_rows, options.flush_s
    t0 = time.perf_counter()
    out = Path(out)
    profile = find_profile(grid.model, grid.gpu)
    meta = sweep_meta(grid, profile, shortcuts)
    old = check_resumable(out, meta, resume)
    if configs is None:
        configs = select_configs(grid, limit)
    check_output_dir(out, "--out")
    check_resources(configs, profile, limits)
    finished = False
    with contextlib.ExitStack() as stack:
        session = None
        if backend == "ray":  # connect before anything is written: a bad --address leaves no directory behind
            session = RaySession(workers if workers > 0 else default_workers(), address).start()
            stack.callback(session.stop)
        created = not out.exists()
        out.mkdir(exist_ok=True)

        def tidy() -> None:  # runs last (after the lock is gone): no half-initialised store after a failure
            if finished or old is not None or part_files(out):
                return
            (out / META_FILE).unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):
                    out.rmdir()

        stack.callback(tidy)
        stack.enter_context(lock_dir(out))
        if old is None:
            write_meta(out, meta)
        clean_temporaries(out)
        done = done_config_ids(out) if resume else set()
        todo = [c for c in configs if c.config_id not in done]
        n_done_before = len(configs) - len(todo)

        oom = [c for c in todo if not profile.startup(c.adapter_slots, c.max_lora_rank)[0]]
        oom_ids = {c.config_id for c in oom}
        units = build_units([c for c in todo if c.config_id not in oom_ids], shortcuts.prune, limits)

        writer = PartWriter(out)
        counts = {"rows": 0, "simulated": 0, "skipped_oom": 0, "pruned": 0, "early_stopped": 0, "boundary": 0}
        buffer: list[dict] = []
        last_flush = time.perf_counter()

        def flush() -> None:
            nonlocal buffer, last_flush
            writer.write(buffer)
            buffer = []
            last_flush = time.perf_counter()

        def take(rows: list[dict]) -> None:
            for r in rows:
                counts["rows"] += 1
                if r["obtained"] == OBTAINED_OOM:
                    counts["skipped_oom"] += 1
                elif r["obtained"] == OBTAINED_PRUNED:
                    counts["pruned"] += 1
                else:
                    counts["simulated"] += 1
                    if r["obtained"].startswith("early_"):
                        counts["early_stopped"] += 1
            buffer.extend(rows)

        bar = None
        if progress and todo:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            # on stderr: stdout stays clean for the summary (and for pipes)
            bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                           "configs", TimeElapsedColumn(), "ETA", TimeRemainingColumn(), transient=True,
                           console=Console(stderr=True))
            bar.start()
            task = bar.add_task(f"sweep {grid.name}", total=len(todo))
        tm = timings if timings is not None else {}
        tm["phases"] = []
        try:
            t_oom = time.perf_counter()
            take([oom_row(c, profile) for c in oom])
            tm["oom_rows_s"] = time.perf_counter() - t_oom
            if bar is not None:
                bar.advance(task, len(oom))
            if buffer:
                flush()
            tm["setup_s"] = time.perf_counter() - t0

            def run_units(units: list[WorkUnit]) -> None:
                start = time.perf_counter() - t0
                for unit, rows in execute(units, profile, shortcuts, backend, workers, address, session, timed):
                    take(rows)
                    if on_unit is not None:
                        on_unit(unit, rows)
                    if bar is not None:
                        bar.advance(task, len(rows))
                    if len(buffer) >= flush_rows or time.perf_counter() - last_flush >= flush_s:
                        flush()
                tm["phases"].append([start, time.perf_counter() - t0])

            run_units(units)
            if grid.boundary_seeds and configs:
                # extra seeds for the configs near the 0.9 label boundary (known only once they ran)
                flush()
                got = read_rows(out, columns=["config_id", "throughput_ratio", "obtained"]).to_pylist()
                ratios = {r["config_id"]: r["throughput_ratio"] for r in got
                          if r["obtained"] not in (OBTAINED_OOM, OBTAINED_PRUNED)}
                done_ids = {r["config_id"] for r in got}
                extra = [c for c in boundary_configs(configs, ratios, grid.boundary_seeds)
                         if c.config_id not in done_ids]
                counts["boundary"] = len(extra)
                if bar is not None and extra:
                    bar.update(task, total=bar.tasks[0].total + len(extra))
                run_units([WorkUnit([c], limits=limits) for c in extra])
        finally:
            if buffer:
                flush()  # completed units only: everything in the buffer is whole
            if bar is not None:
                bar.stop()
        wall = time.perf_counter() - t0
        finished = True
        return {
            "rows": counts["rows"], "simulated": counts["simulated"], "skipped_oom": counts["skipped_oom"],
            "grid_size": grid.size, "configs_per_s": counts["rows"] / wall if wall > 0 else 0.0, "out": str(out),
            "pruned": counts["pruned"], "early_stopped": counts["early_stopped"], "already_done": n_done_before,
            "boundary_rows": counts["boundary"],
            "selected": len(configs), "rows_total": n_done_before + counts["rows"], "wall_s": wall,
            "backend": backend, "workers": workers if workers > 0 else default_workers(),
            "parts_written": len(writer.parts), "parts_total": len(part_files(out)),
            "early_stop_active": meta["early_stop_active"],
        }


__all__ = ["SweepOptions", "build_batches", "build_units", "read_rows", "run_sweep", "sweep_meta"]
