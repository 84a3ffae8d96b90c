"""``PlaceConfig``: how ``place()`` plans, in one validated object.

Every field is a ``lorapack place`` flag: ``lorapack.cli.place`` generates the options from these fields (the
flag is the field's name with dashes unless ``metadata["flag"]`` names it, the help is ``metadata["help"]``;
the ``objective`` field becomes ``--objective`` and one flag per limit of ``Objective``). A new setting is one
field here: the API, the CLI and its help follow.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import check_workers
from ..errors import SpecError
from ..objective import Objective
from ..oracle import CandidateArrivals, check_candidate_arrivals
from .problem import DEFAULT_HEADROOM, check_headroom
from .registry import get_method, method_names, methods_help

DEFAULT_VERIFY_SEEDS = 3
VERIFY_CHOICES = ("workload", "poisson")
VERIFY_OWN_LAWS = ("lognormal", "modulated")  # a workload's arrival law the verifier adopts by default


def _opt(default: Any, help: str | Callable[[], str], **cli: Any) -> Any:  # noqa: A002 - typer's word
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class PlaceConfig:
    """Settings of one ``place()`` call (``PlaceConfig()``: ``proposed``, smallest pool, latency objective,
    verified). Invalid values raise ``SpecError`` naming the flag, before any work."""

    gpus: int | None = _opt(None, lambda: (
        f"GPUs: a cap for the greedy methods ({', '.join(method_names('greedy'))}: they open the GPUs they need, "
        f"at most G) and the pool size for the others (they place onto exactly G GPUs); plan.json's "
        f"settings.pool_role says which. Default: as many as needed (the pool methods search the smallest pool "
        f"the twin validates). A plan that needs more than G exits with code 2."))
    method: str = _opt("proposed", lambda: f"Placement method: {methods_help()}.")
    models_dir: Path | None = _opt(None, "Directory of learned models for proposed / proposed-fast / "
                                         "proposed-lat (default: the shipped ones).", flag="--models")
    objective: Objective = _opt(Objective(), "latency (default): every GPU keeps mean TTFT <= --max-ttft-s "
                                             "(default 2 s) and is not starved; throughput: the paper's "
                                             "criterion only (>= 90 % of the offered tokens).", metavar="<kind>")
    headroom: float = _opt(DEFAULT_HEADROOM, "Plan for the forecast rates x (1 + headroom): margin for forecast "
                                             "error. Default 0.2 (rates x 1.2); 0 plans for the forecast itself.")
    verify: bool = _opt(True, "Simulate every GPU for the full hour (--verify-seeds seeds) and repair failing "
                              "GPUs (default on).", flag="--verify/--no-verify")
    verify_seeds: int = _opt(DEFAULT_VERIFY_SEEDS, "Seeds per GPU in verification (>= 1).")
    verify_arrivals: str | CandidateArrivals = _opt(
        "workload", "Arrivals the verification simulates at the planned rates: 'workload' (default) = the "
                    "workload file's law when it is lognormal or modulated, else Poisson; 'poisson'; or a trace "
                    "CSV (arrived_at,...): Poisson whose rate follows the trace's per-minute load, as its swings "
                    "hit every adapter at once.", metavar="LAW", cli_type=str)
    split_hot: bool = _opt(False, "Split adapters too hot for one GPU into weighted replicas on several GPUs.")
    seed: int = _opt(0, "Seed of every simulation (plans are deterministic per seed).")
    n_max: int | None = _opt(None, "Hard cap on adapters per GPU for the proposed methods. Default: the greedy "
                                   "stops at 384 (the measured range) and only a twin-verified plan on fewer GPUs "
                                   "goes beyond.")
    mean_input_tokens: float | None = _opt(None, "Override the mean prompt tokens.")
    mean_output_tokens: float | None = _opt(None, "Override the mean output tokens.")
    workers: int | None = _opt(None, "Worker processes for twin runs (0 = all cores; default: up to 2).")
    force: bool = _opt(False, lambda: _force_help())
    previous: Path | None = _opt(None, "Re-plan from this plan.json (or the --out directory holding it): adapters "
                                       "stay where they are unless moving them saves a GPU or a GPU fails; also "
                                       "writes migrate.json and migrate.sh (docs/replan.md).", metavar="PLAN")
    max_moves: int | None = _opt(None, "With --previous: at most K optional moves (an adapter loaded on or "
                                       "unloaded from one server), those that save GPUs; moves a failing GPU "
                                       "needs are always made. Default: no cap.", metavar="K")

    def __post_init__(self) -> None:
        get_method(self.method)
        if self.gpus is not None and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1):
            raise SpecError(f"--gpus {self.gpus}: expected a positive integer")
        if self.models_dir is not None and not Path(self.models_dir).is_dir():
            raise SpecError(f"--models {self.models_dir}: not a directory")
        if not isinstance(self.objective, Objective):
            raise SpecError(f"objective {self.objective!r}: expected a lorapack.objective.Objective")
        check_headroom(self.headroom)
        if isinstance(self.verify_seeds, bool) or not isinstance(self.verify_seeds, int) or self.verify_seeds < 1:
            raise SpecError(f"--verify-seeds {self.verify_seeds}: expected an integer >= 1")
        if isinstance(self.verify_arrivals, str):
            if self.verify_arrivals not in VERIFY_CHOICES and not Path(self.verify_arrivals).is_file():
                raise SpecError(f"--verify-arrivals {self.verify_arrivals}: expected 'workload', 'poisson' or an "
                                f"existing trace CSV")
        else:
            check_candidate_arrivals(self.verify_arrivals)
        if self.n_max is not None and (isinstance(self.n_max, bool) or not isinstance(self.n_max, int)
                                       or self.n_max < 1):
            raise SpecError(f"--n-max {self.n_max}: expected an integer >= 1")
        for name in ("mean_input_tokens", "mean_output_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                                  or v < 1):
                raise SpecError(f"--{name.replace('_', '-')} {v}: expected a finite number of tokens >= 1")
        if self.workers is not None:
            check_workers(self.workers)
        if not isinstance(self.force, bool):
            raise SpecError(f"force {self.force!r}: expected True or False")
        self._check_replan()

    def _check_replan(self) -> None:
        if self.previous is not None:
            prev = Path(self.previous)
            if not (prev.is_file() or (prev / "plan.json").is_file()):
                raise SpecError(f"--previous {prev}: expected a plan.json (or the --out directory holding one)")
            if self.split_hot:
                raise SpecError("--previous with --split-hot: expected one of them (a re-plan keeps the previous "
                                "plan's split adapters as they were)")
        if self.max_moves is not None:
            if isinstance(self.max_moves, bool) or not isinstance(self.max_moves, int) or self.max_moves < 0:
                raise SpecError(f"--max-moves {self.max_moves}: expected an integer >= 0")
            if self.previous is None:
                raise SpecError(f"--max-moves {self.max_moves}: expected with --previous (it caps a re-plan's moves)")

    def worker_count(self) -> int:
        """Processes for twin runs: ``workers`` (0 = all cores), by default up to 2."""
        from .oracles import default_workers

        if self.workers is None:
            return default_workers()
        return self.workers or (os.cpu_count() or 1)

    def verify_law(self, adapters: object) -> CandidateArrivals | None:
        """The arrival law the verifier simulates (None: Poisson): ``verify_arrivals`` resolved against the
        adapters (a ``Workload``'s own law when it is lognormal or modulated; an ``Instance`` has none)."""
        choice = self.verify_arrivals
        if not isinstance(choice, str):
            return choice
        if choice == "poisson":
            return None
        if choice == "workload":
            return workload_verify_law(adapters)
        return trace_load_law(Path(choice))


def _force_help() -> str:
    from ..guards import DEFAULT_MAX_PLACE_ENTRIES, DEFAULT_MAX_PLACE_TWIN_REQUESTS

    return (f"Place anyway past the soft resource limits of a placement, estimated before any work: "
            f"{DEFAULT_MAX_PLACE_ENTRIES:,} adapters and --split-hot replicas, {DEFAULT_MAX_PLACE_TWIN_REQUESTS:,} "
            f"requests simulated by the twin (verification, the twin as the oracle, the pool search), half of "
            f"this machine's memory. All of the memory stays a hard limit.")


def workload_verify_law(workload: object) -> CandidateArrivals | None:
    """The arrival law verification adopts from a workload by default: its own when lognormal or modulated."""
    arrivals = getattr(workload, "arrivals", None)
    return arrivals if getattr(arrivals, "kind", None) in VERIFY_OWN_LAWS else None


def trace_load_law(path: Path) -> CandidateArrivals:
    """Poisson arrivals whose rate follows a trace's per-minute load (``--verify-arrivals TRACE.csv``)."""
    from ..spec import ModulatedArrivals
    from ..workload import load_trace
    from ..workload.derive import RATE_PROFILE_PERIOD_S, load_profile, trace_span_s

    trace = load_trace(path)
    prof = load_profile(trace.t_s, trace_span_s(trace), RATE_PROFILE_PERIOD_S)
    return ModulatedArrivals(period_s=RATE_PROFILE_PERIOD_S, multipliers=[float(m) for m in prof])
