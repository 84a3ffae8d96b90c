"""Replay real benchmark runs through the twin and score it (twin.md §8.2).

Each row of a runs CSV (schema of ``shared/data/real-runs/*.csv``) is rebuilt as the real benchmark did:
``n_adapters`` adapters with ranks from ``rank_counts`` and rates from ``rate_counts``, the rank<->rate
pairing and the registration order shuffled by the seed, the row's pool mean lengths, its window and
server flags, and the client-saturation cap on (it is part of the measured system, twin.md §2.6).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from .errors import DataError, LorapackError, ProfileError

REQUIRED = ("run_id", "model", "n_adapters", "max_loras", "max_lora_rank", "rank_counts", "rate_counts",
            "status")
NOISY_RATIO = (0.85, 0.95)  # real labels with a throughput ratio in here are noise (data README §6)


def _num(row: dict, key: str, default: float | None = None) -> float | None:
    v = (row.get(key) or "").strip()
    if v == "":
        return default
    try:
        return float(v)
    except ValueError:
        return default


def parse_counts(text: str, kind: type = float) -> list:
    """``"8:64 16:64"`` -> ``[8]*64 + [16]*64``; a malformed pair raises ``DataError``."""
    out: list = []
    for part in (text or "").split():
        value, sep, count = part.partition(":")
        try:
            if not sep:
                raise ValueError
            v = float(value)
            n = int(count)
            if not math.isfinite(v) or v < 0 or n < 0 or (kind is int and v != int(v)):
                raise ValueError
        except ValueError:
            what = "a non-negative integer" if kind is int else "a finite number >= 0"
            raise DataError(f"malformed count '{part}' in '{text}': expected value:count with value "
                            f"{what} and count an integer >= 0, e.g. '8:64 16:64'") from None
        out.extend([int(v) if kind is int else kind(value)] * n)
    return out


def read_runs(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"runs file not found: {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{path}: missing column(s) {', '.join(missing)}; expected the real-runs schema "
                            f"(see shared/data/README.md §4)")
        return list(reader)


def build_workload(row: dict, seed: int, lengths: str = "lognormal", cv: float | None = None):
    """The row's workload: shuffled rank/rate assignment, pool-mean lengths, Poisson arrivals.

    ``cv``: post-filter CV of log-normal lengths (None = the spec default); a profile's fitted
    ``runs_lengths.cv`` is passed here by the validation."""
    from .spec import Adapter, LengthsSpec, PoissonArrivals, Workload

    n = int(float(row["n_adapters"]))
    ranks = parse_counts(row["rank_counts"], int)
    rates = parse_counts(row["rate_counts"], float)
    if len(ranks) != n or len(rates) != n:
        raise DataError(f"run {row['run_id']}: rank_counts/rate_counts do not add up to n_adapters={n}")
    rng = np.random.default_rng([seed, 0x5EED])
    ranks = np.array(ranks)[rng.permutation(n)]
    rates = np.array(rates)[rng.permutation(n)]
    mi = _num(row, "mean_input_tokens", 223.0)
    mo = _num(row, "mean_output_tokens", 197.0)
    adapters = [Adapter(adapter_id=f"adapter-{i}", rank=int(ranks[i]), rate_rps=float(rates[i]))
                for i in range(n)]
    extra = {"cv": float(cv)} if cv is not None and lengths == "lognormal" else {}
    return Workload(adapters=adapters, lengths=LengthsSpec(kind=lengths, mean_input_tokens=mi,
                                                           mean_output_tokens=mo, **extra),
                    arrivals=PoissonArrivals(), duration_s=_num(row, "window_s", 3600.0))


def _int_field(row: dict, key: str, where: str, minimum: int = 1) -> int:
    v = _num(row, key)
    if v is None or not math.isfinite(v) or v != int(v) or v < minimum:
        raise DataError(f"{where}: column {key} = {row.get(key)!r}; expected an integer >= {minimum}")
    return int(v)


def _check_row(row: dict, where: str) -> None:
    """Fail early, naming the row, on a row the validation cannot rebuild (instead of inside a worker)."""
    status = (row.get("status") or "").strip()
    if status not in ("ok", "oom"):
        raise DataError(f"{where}: status {row.get('status')!r}; expected ok or oom")
    _int_field(row, "max_loras", where)
    _int_field(row, "max_lora_rank", where)
    if status == "oom":  # scored on the start-up rule only; oom rows carry no rates
        return
    n = _int_field(row, "n_adapters", where)
    try:
        ranks = parse_counts(row.get("rank_counts") or "", int)
        rates = parse_counts(row.get("rate_counts") or "", float)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    if (ranks or rates) and (len(ranks) != n or len(rates) != n):
        raise DataError(f"{where}: rank_counts/rate_counts ({len(ranks)}/{len(rates)} adapters) do not add up "
                        f"to n_adapters={n}")


def _simulate_row(row: dict, seed: int, lengths: str, gpu: str) -> dict:
    try:
        return _simulate_row_inner(row, seed, lengths, gpu)
    except LorapackError as e:  # name the run: the error surfaces from a worker process
        raise DataError(f"run {row.get('run_id')}: {e}") from None


def _simulate_row_inner(row: dict, seed: int, lengths: str, gpu: str) -> dict:
    from .profile import find_profile
    from .twin.run import REAL_CLIENT_CAP, ServerFlags, simulate

    prof = find_profile(row["model"], gpu)
    wl = build_workload(row, seed, lengths, prof.runs_lengths.cv if prof.runs_lengths else None)
    flags = ServerFlags(
        max_loras=int(float(row["max_loras"])), max_lora_rank=int(float(row["max_lora_rank"])),
        max_cpu_loras=int(_num(row, "max_cpu_loras", float(row["n_adapters"]))),
        max_num_batched_tokens=int(_num(row, "max_num_batched_tokens", prof.max_num_batched_tokens)),
        max_num_seqs=int(_num(row, "max_num_seqs", prof.max_num_seqs)), client_cap=REAL_CLIENT_CAP)
    out, _ = simulate(prof, wl, flags, wl.duration_s, seed)
    keep = ("oom", "error_type", "throughput_tok_s", "itl_mean_ms", "ttft_mean_ms", "starved",
            "throughput_ratio", "incoming_tok_s", "wall_s", "preemptions", "running_mean", "waiting_max")
    return {k: out.get(k) for k in keep}


ENGINES = ("twin", "surrogate", "tree")


def _row_candidate(row: dict, profile):
    """The GPU of a real run as an oracle question (features depend on the multisets, not the order)."""
    from .oracle import GpuCandidate

    ranks = np.array(parse_counts(row["rank_counts"], int))
    rates = np.array(parse_counts(row["rate_counts"], float))
    return GpuCandidate(
        profile=profile, ranks=ranks, rates_rps=rates, max_loras=int(float(row["max_loras"])),
        max_lora_rank=int(float(row["max_lora_rank"])),
        max_cpu_loras=int(_num(row, "max_cpu_loras", float(row["n_adapters"]))),
        max_num_seqs=int(_num(row, "max_num_seqs", profile.max_num_seqs)),
        max_num_batched_tokens=int(_num(row, "max_num_batched_tokens", profile.max_num_batched_tokens)),
        mean_input_tokens=_num(row, "mean_input_tokens", 223.0), mean_output_tokens=_num(row, "mean_output_tokens",
                                                                                        197.0))


def _learned_outputs(rows: list[dict], todo: list[int], profiles: dict, engine: str, models_dir) -> dict[int, list]:
    """Answers of the learned oracle (one per row: it is deterministic), in the twin's output keys."""
    from .surrogate import load_oracle, model_path

    oracles = {}
    out: dict[int, list] = {}
    models = sorted({rows[i]["model"] for i in todo})
    for m in models:
        prof = profiles[m]
        if models_dir is not None and not model_path(models_dir, prof.gpu, prof.model, engine).is_file():
            continue  # --models holds other profiles only: this model's runs count as skipped
        oracles[m] = load_oracle(prof, engine, models_dir)
    if models and not oracles:  # nothing to answer with: say what is missing
        load_oracle(profiles[models[0]], engine, models_dir)
    for m, oracle in oracles.items():
        idx = [i for i in todo if rows[i]["model"] == m]
        preds = oracle.predict([_row_candidate(rows[i], profiles[m]) for i in idx])
        for i, p in zip(idx, preds, strict=True):
            out[i] = [{"oom": not p.fits, "error_type": p.error_type, "throughput_tok_s": p.throughput_tok_s,
                       "itl_mean_ms": p.itl_ms, "ttft_mean_ms": p.ttft_s * 1000.0, "starved": p.starved >= 0.5,
                       "throughput_ratio": p.throughput_ratio, "incoming_tok_s": p.incoming_tok_s,
                       "in_range": p.in_range, "out_of_range": p.out_of_range}]
    return out


def macro_f1(y: list[bool], yhat: list[bool]) -> float:
    """Macro-averaged F1 of a binary label (both classes; a class absent from both counts as 1)."""
    y_arr, p_arr = np.asarray(y, bool), np.asarray(yhat, bool)
    if len(y_arr) == 0:
        return float("nan")
    f1s = []
    for c in (True, False):
        tp = float(np.sum((p_arr == c) & (y_arr == c)))
        fp = float(np.sum((p_arr == c) & (y_arr != c)))
        fn = float(np.sum((p_arr != c) & (y_arr == c)))
        f1s.append(1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(f1s))


def smape(y: np.ndarray, yhat: np.ndarray, factor: float = 1.0) -> float:
    """``100 * mean(factor * |y - yhat| / (|y| + |yhat|))``; factor 1 = paper convention, 2 = usual."""
    y, yhat = np.asarray(y, float), np.asarray(yhat, float)
    ok = np.isfinite(y) & np.isfinite(yhat) & ((np.abs(y) + np.abs(yhat)) > 0)
    if not ok.any():
        return float("nan")
    return float(100.0 * np.mean(factor * np.abs(y[ok] - yhat[ok]) / (np.abs(y[ok]) + np.abs(yhat[ok]))))


def _mean(vals: list) -> float | None:
    xs = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(xs)) if xs else float("nan")


def run_validation(runs_path: str | Path, seeds: int = 1, gpu: str = "h100-64gb", lengths: str = "lognormal",
                   workers: int = 0, limit: int | None = None, progress: bool = True, engine: str = "twin",
                   models_dir: str | Path | None = None) -> dict:
    """Simulate every row (x seeds) — or ask the learned ``engine`` ("surrogate", "tree") — and compare.
    Returns ``{"models": {...}, "rows": {column: list}}``."""
    from .profile import available_profiles

    if engine not in ENGINES:
        raise LorapackError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    if models_dir is not None and engine == "twin":
        raise LorapackError("--models applies to --engine surrogate or tree")

    if seeds < 1:
        raise LorapackError(f"--seeds {seeds}: expected an integer >= 1")
    if lengths not in ("fixed", "lognormal"):
        raise LorapackError(f"--lengths {lengths}: expected fixed or lognormal")
    if limit is not None and limit < 0:
        raise LorapackError(f"--limit {limit}: expected an integer >= 0")
    rows = read_runs(runs_path)
    if limit is not None:
        rows = rows[:limit]
    from .profile import find_profile

    avail = available_profiles()
    if gpu not in {g for g, _, _ in avail}:
        raise ProfileError(f"unknown gpu '{gpu}': shipped profiles exist for "
                           f"{', '.join(sorted({g for g, _, _ in avail})) or 'none'}")
    have = {m for g, m, _ in avail if g == gpu}
    profiles = {m: find_profile(m, gpu) for m in have}
    results: dict[int, list[dict]] = {}
    todo = []
    for i, r in enumerate(rows):
        r["model"] = (r.get("model") or "").strip()
        if r["model"] not in have:
            continue
        _check_row(r, f"{runs_path}: row {i + 1} (run {r.get('run_id')})")
        # the start-up rule needs no simulation; real oom rows are scored on it alone (they carry no rates)
        starts, _kv, err = profiles[r["model"]].startup(int(float(r["max_loras"])), int(float(r["max_lora_rank"])))
        if not starts:
            results[i] = [{"oom": True, "error_type": err}]
        elif r["status"].strip() == "oom":
            results[i] = [{"oom": False, "error_type": None}]
        elif (r.get("rate_counts") or "").strip() and (r.get("rank_counts") or "").strip():
            todo.extend((i, s) for s in range(seeds))

    if engine != "twin":
        results.update(_learned_outputs(rows, sorted({i for i, _s in todo}), profiles, engine, models_dir))
        todo = []

    from joblib import Parallel, delayed

    n_jobs = workers if workers > 0 else -1
    tasks = (delayed(_simulate_row)(rows[i], s, lengths, gpu) for i, s in todo)
    gen = Parallel(n_jobs=n_jobs, return_as="generator")(tasks)
    if progress and todo:
        from rich.progress import BarColumn, Progress, TimeRemainingColumn

        with Progress("[progress.description]{task.description}", BarColumn(),
                      "{task.completed}/{task.total}", TimeRemainingColumn(), transient=True) as bar:
            task = bar.add_task("simulating runs", total=len(todo))
            for (i, _s), out in zip(todo, gen, strict=True):
                results.setdefault(i, []).append(out)
                bar.advance(task)
    else:
        for (i, _s), out in zip(todo, gen, strict=True):
            results.setdefault(i, []).append(out)

    per_row: dict[str, list] = {c: [] for c in (
        "run_id", "model", "status", "measured_oom", "predicted_oom", "measured_throughput_tok_s",
        "predicted_throughput_tok_s", "measured_itl_ms", "predicted_itl_ms", "measured_ttft_ms",
        "predicted_ttft_ms", "measured_starved", "predicted_starved", "measured_throughput_ratio",
        "predicted_throughput_ratio", "predicted_in_range")}
    models: dict[str, dict] = {}
    for i, r in enumerate(rows):
        m = r["model"]
        st = models.setdefault(m, {"n_ok": 0, "n_oom": 0, "n_skipped": 0, "_rows": []})
        if i not in results:
            st["n_skipped"] += 1
            continue
        outs = results[i]
        pred_oom = outs[0]["oom"]
        real_oom = r["status"].strip() == "oom"
        st["n_oom" if real_oom else "n_ok"] += 1
        if pred_oom or real_oom:  # real oom rows were not simulated (start-up rule only)
            thr = itl = ttft = ratio = float("nan")
            starved = None
        else:
            thr = _mean([o["throughput_tok_s"] for o in outs])
            itl = _mean([o["itl_mean_ms"] for o in outs])
            ttft = _mean([o["ttft_mean_ms"] for o in outs])
            ratio = _mean([o["throughput_ratio"] for o in outs])
            starved = bool(np.mean([bool(o["starved"]) for o in outs]) >= 0.5)
        real_starved = _num(r, "starved")
        rec = {"run_id": r["run_id"], "model": m, "status": r["status"], "measured_oom": real_oom,
               "predicted_oom": pred_oom, "measured_throughput_tok_s": _num(r, "throughput_tok_s"),
               "predicted_throughput_tok_s": thr, "measured_itl_ms": _num(r, "itl_mean_ms"),
               "predicted_itl_ms": itl, "measured_ttft_ms": _num(r, "ttft_mean_ms"), "predicted_ttft_ms": ttft,
               "measured_starved": None if real_starved is None else bool(real_starved),
               "predicted_starved": starved, "measured_throughput_ratio": _num(r, "throughput_ratio"),
               "predicted_throughput_ratio": ratio,
               "predicted_in_range": None if pred_oom or real_oom else all(o.get("in_range", True) for o in outs)}
        st["_rows"].append(rec)
        for k, v in rec.items():
            per_row[k].append(v)

    summary = {}
    for m, st in models.items():
        recs = st.pop("_rows")
        ok = [x for x in recs if not x["measured_oom"] and not x["predicted_oom"]]

        def arr(key: str, rs: list = ok) -> np.ndarray:
            return np.array([np.nan if x[key] is None else x[key] for x in rs], float)

        lab = [x for x in ok if x["measured_starved"] is not None]
        clear = [x for x in lab if x["measured_throughput_ratio"] is not None
                 and not (NOISY_RATIO[0] <= x["measured_throughput_ratio"] <= NOISY_RATIO[1])]
        agree = [x["measured_starved"] == x["predicted_starved"] for x in lab]
        agree_clear = [x["measured_starved"] == x["predicted_starved"] for x in clear]
        oom_agree = [x["measured_oom"] == x["predicted_oom"] for x in recs]
        summary[m] = {
            **st,
            "smape_throughput": smape(arr("measured_throughput_tok_s"), arr("predicted_throughput_tok_s")),
            "smape_itl": smape(arr("measured_itl_ms"), arr("predicted_itl_ms")),
            "smape_ttft": smape(arr("measured_ttft_ms"), arr("predicted_ttft_ms")),
            "smape_throughput_2x": smape(arr("measured_throughput_tok_s"), arr("predicted_throughput_tok_s"), 2),
            "smape_itl_2x": smape(arr("measured_itl_ms"), arr("predicted_itl_ms"), 2),
            "smape_ttft_2x": smape(arr("measured_ttft_ms"), arr("predicted_ttft_ms"), 2),
            "starved_agreement": float(np.mean(agree)) if agree else float("nan"),
            "starved_agreement_clear": float(np.mean(agree_clear)) if agree_clear else float("nan"),
            "starved_f1": macro_f1([x["measured_starved"] for x in lab], [bool(x["predicted_starved"]) for x in lab]),
            "n_out_of_range": int(sum(x["predicted_in_range"] is False for x in recs)),
            "n_clear": len(clear),
            "oom_agreement": float(np.mean(oom_agree)) if oom_agree else float("nan"),
            "oom_false_accept": int(sum(x["measured_oom"] and not x["predicted_oom"] for x in recs)),
            "oom_false_reject": int(sum(not x["measured_oom"] and x["predicted_oom"] for x in recs)),
        }
    return {"models": summary, "rows": per_row, "engine": engine}
