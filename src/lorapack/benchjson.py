"""Result files of ``vllm bench serve`` (vLLM >= 0.10, ``vllm/benchmarks/serve.py``) and of the older
``benchmarks/benchmark_serving.py`` (``--save-result``) as real runs: one result -> one row of the runs schema
(``shared/data/README.md`` §4), so ``realruns.check_row``, ``build_workload`` and the scores work unchanged.
``read_run_files`` is where ``validate`` and ``calibrate --runs`` read runs: ``.json`` paths here, anything else
with ``realruns.read_runs`` (a runs CSV).

What a result file records (docs/bench-json.md has the full list per version):

* the load: ``num_prompts`` requests at ``request_rate`` (``"inf"``, or a JSON ``Infinity``, = all at t = 0)
  with ``burstiness`` (1 = Poisson gaps, else gamma gaps) and ``max_concurrency`` (a client-side limit);
* the outcome: ``duration``, ``completed`` (and ``failed`` in newer versions), ``total_input_tokens``,
  ``total_output_tokens``, ``request_throughput``, ``output_throughput``, ``total_token_throughput`` and the
  ``mean/median/std/p99_{ttft,tpot,itl}_ms`` statistics; the request goodput as ``request_goodput`` (in
  older versions ``"request_goodput:"``, with the colon; ignored here);
* with ``--save-detailed`` (and always in some older copies of ``benchmark_serving.py``) the per-request
  lists ``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``errors`` (``start_times``, ``latencies``
  in the newest versions);
* ``--metadata KEY=VALUE`` pairs as top-level keys (string values).

What it does not record -- the server's flags and which LoRA adapters were served -- comes from the
command line (``BenchOptions``) or from these ``--metadata`` keys: ``max_loras``, ``max_lora_rank``,
``max_cpu_loras``, ``max_num_seqs``, ``max_num_batched_tokens``, ``lora_ranks`` (``rank:count`` pairs, e.g.
``16:8``), ``model`` (a lorapack model key) and ``vllm_version``.

The rebuild: ``vllm bench serve --lora-modules a b c`` draws the adapter of each request uniformly at random
(``--lora-assignment round-robin`` cycles through them; the file does not say which), so the run becomes
``N`` adapters of ``request_rate / N`` req/s each, Poisson arrivals over ``window_s = requests /
request_rate`` (the span over which the client sends them; the newest client rescales its gaps to exactly
that), lengths around the completed requests' means. An unlimited rate, ``burstiness != 1``, a
``max_concurrency`` limit or a rate ramp-up are refused with one line: the twin rebuilds open-loop Poisson
arrivals at a finite rate only.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .errors import DataError, SpecError
from .realruns import parse_counts, read_runs

# server flags a result file may carry as --metadata keys (same names as the runs schema's columns)
FLAG_KEYS = ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "max_num_batched_tokens")
# every --metadata key lorapack reads
METADATA_KEYS = (*FLAG_KEYS, "lora_ranks", "model", "vllm_version")
STARVED_RATIO = 0.9  # as the runs schema: starved = throughput_ratio < 0.9
INF_WORDS = ("inf", "+inf", "infinity", "+infinity")


@dataclass(frozen=True)
class BenchOptions:
    """The command line's share of a JSON run: server flags and the adapters' ranks (``None`` = not given).

    A file's ``--metadata`` key of the same meaning fills what is not given; both given and different is an
    error. ``adapter_ranks``: ``rank:count`` pairs, e.g. ``"8:4 16:4"`` (``N`` = the sum of the counts).
    ``model``: the model key when the file's ``model_id`` maps to no known one (``calibrate`` passes its
    ``--model``)."""

    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    adapter_ranks: str | None = None
    model: str | None = None

    def given_flags(self) -> list[str]:
        """The command-line spellings of the options that were given (``model`` excluded)."""
        return [f"--{f.name.replace('_', '-')}" for f in fields(self)
                if f.name != "model" and getattr(self, f.name) is not None]


def is_bench_json(path: str | Path) -> bool:
    """A ``.json`` path (a ``vllm bench serve`` result); anything else is read as a runs CSV."""
    return Path(path).suffix.lower() == ".json"


# ---------------------------------------------------------------------------------------------------------
# reading


def load_results(path: Path) -> list[dict]:
    """The result object(s) of a file: one, or several when ``--append-result`` appended runs (one JSON object
    per line). Python's JSON reader takes the ``Infinity``/``NaN`` tokens ``json.dump`` writes."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a text file; expected a vllm bench serve result JSON") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); expected a "
                            f"vllm bench serve result file") from None
        out.append(obj)
    if not out:
        raise DataError(f"{path}: empty file; expected a vllm bench serve result JSON")
    for k, obj in enumerate(out):
        if not isinstance(obj, dict):
            what = "a list (a .pytorch.json record file?)" if isinstance(obj, list) else type(obj).__name__
            where = f" (object {k + 1})" if len(out) > 1 else ""
            raise DataError(f"{path}{where}: {what}, not a result object; expected the JSON object that "
                            f"vllm bench serve --save-result writes")
    return out


def read_bench_json(path: str | Path, options: BenchOptions | None = None,
                    log: Callable[[str], None] | None = None) -> list[dict]:
    """The runs of one result file (one row per result object), in the runs schema; ``DataError`` (one
    line naming the file) when the file lacks what the twin needs. ``log`` receives the notices (the
    uniform adapter draw, defaulted flags)."""
    from .checks import check_input_file

    path = check_input_file(path, "runs file", DataError)
    results = load_results(path)
    rows = []
    for k, res in enumerate(results, start=1):
        run_id, src = (path.stem, str(path)) if len(results) == 1 else (f"{path.stem}#{k}", f"{path} (run {k})")
        rows.append(bench_row(res, run_id, src, options or BenchOptions(), log))
    return rows


# ---------------------------------------------------------------------------------------------------------
# values


def _number(d: dict, key: str, src: str) -> float | None:
    """``d[key]`` as a float (None when absent or null); a string that is no number is an error."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool):
        raise DataError(f"{src}: {key} = {v!r}; expected a number")
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in INF_WORDS:
            return math.inf
        try:
            return float(s)
        except ValueError:
            pass
    raise DataError(f"{src}: {key} = {v!r}; expected a number")


def _positive(d: dict, key: str, src: str) -> float | None:
    v = _number(d, key, src)
    if v is not None and not (math.isfinite(v) and v > 0):
        raise DataError(f"{src}: {key} = {d.get(key)!r}; expected a finite number > 0")
    return v


def _int_value(v: Any, what: str, src: str) -> int:
    """A metadata or option value as an integer >= 1 (metadata values are strings: ``"16"``)."""
    try:
        if isinstance(v, bool):
            raise ValueError
        f = float(v.strip()) if isinstance(v, str) else float(v)
        if not math.isfinite(f) or f != int(f) or f < 1:
            raise ValueError
    except (TypeError, ValueError):
        raise DataError(f"{src}: {what} = {v!r}; expected an integer >= 1") from None
    return int(f)


def _num_list(d: dict, key: str, src: str) -> list[float] | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
        raise DataError(f"{src}: {key} is not a list of numbers; expected the per-request list of "
                        f"vllm bench serve --save-detailed")
    return [float(x) for x in v]


def _g(x: float) -> str:
    """A float as the runs CSV would hold it (shortest repr that reads back the same)."""
    return repr(float(x))


def model_key(result: dict, src: str, default: str | None = None) -> str:
    """The lorapack model key of a result: ``--metadata model=KEY``, else the key whose Hugging Face id is
    ``model_id`` (also as the last part of a local path, case-insensitive), else ``default``, else the last
    part of ``model_id`` in lower case (a model no profile knows is then skipped by ``validate``)."""
    from .placement.export import HF_MODEL_IDS

    meta = result.get("model")
    if meta is not None:
        if not isinstance(meta, str) or not meta.strip():
            raise DataError(f"{src}: model = {meta!r}; expected a model key, e.g. llama-3.1-8b-instruct")
        return meta.strip()
    model_id = result.get("model_id")
    name = str(model_id).rstrip("/").rsplit("/", 1)[-1].lower() if model_id else ""
    for key, hf in HF_MODEL_IDS.items():
        if model_id == hf or name in (hf.rsplit("/", 1)[-1].lower(), key):
            return key
    if default:
        return default
    if not name:
        raise DataError(f"{src}: no model_id; give --metadata model=KEY (e.g. llama-3.1-8b-instruct)")
    return name


# ---------------------------------------------------------------------------------------------------------
# one result -> one row


def _lengths(result: dict, src: str) -> tuple[int | None, float | None, float | None, list[bool] | None]:
    """(requests sent, mean input, mean output of the completed requests, completed mask) from the
    per-request lists; all None without them."""
    ins, outs = _num_list(result, "input_lens", src), _num_list(result, "output_lens", src)
    if ins is None or outs is None:
        return None, None, None, None
    if len(ins) != len(outs) or not ins:
        raise DataError(f"{src}: input_lens and output_lens have {len(ins)} and {len(outs)} entries; expected "
                        f"one per request, the same number")
    errors = result.get("errors")
    if isinstance(errors, list) and len(errors) == len(ins):  # a failed request has an error text, output 0
        ok = [not e and o > 0 for e, o in zip(errors, outs, strict=True)]
    else:
        ok = [o > 0 for o in outs]
    n_ok = sum(ok)
    if n_ok == 0:
        return len(ins), None, None, ok
    mi = sum(x for x, k in zip(ins, ok, strict=True) if k) / n_ok
    mo = sum(x for x, k in zip(outs, ok, strict=True) if k) / n_ok
    return len(ins), mi, mo, ok


def _stat_ms(result: dict, stat: str, metric: str, src: str, per_request: list[float] | None) -> float | None:
    """``<stat>_<metric>_ms`` of the file, else computed from the per-request values (seconds)."""
    v = _number(result, f"{stat}_{metric}_ms", src)
    if v is not None or not per_request:
        return v
    import numpy as np

    x = np.asarray(per_request, float) * 1000.0
    return float({"mean": np.mean, "median": np.median}[stat](x)) if stat != "p99" else float(np.percentile(x, 99))


def _per_request_latencies(result: dict, ok: list[bool] | None) -> tuple[list[float] | None, list[float] | None]:
    """TTFTs and all inter-token gaps (seconds) of the completed requests, when the file has them."""
    if ok is None:
        return None, None
    ttfts, itls = result.get("ttfts"), result.get("itls")
    t = None
    if isinstance(ttfts, list) and len(ttfts) == len(ok):
        t = [float(x) for x, k in zip(ttfts, ok, strict=True) if k and isinstance(x, int | float)]
    gaps = None
    if isinstance(itls, list) and len(itls) == len(ok):
        gaps = [float(g) for req, k in zip(itls, ok, strict=True) if k and isinstance(req, list)
                for g in req if isinstance(g, int | float)]
    return t, gaps


def _refuse_arrivals(result: dict, src: str, n_requests: int) -> float:
    """The finite request rate of a run the twin can rebuild; one ``DataError`` line otherwise."""
    raw = result.get("request_rate")
    rate = _number(result, "request_rate", src)
    if rate is None:
        raise DataError(f"{src}: missing key request_rate; expected a vllm bench serve result file")
    if math.isinf(rate) and rate > 0:
        raise DataError(f"{src}: request_rate is {raw!r}: vllm bench serve sent all {n_requests} requests at "
                        f"t = 0, and the twin rebuilds a run as Poisson arrivals at a finite rate (it has no "
                        f"burst arrival); rerun with --request-rate R")
    if not (math.isfinite(rate) and rate > 0):
        raise DataError(f"{src}: request_rate = {raw!r}; expected a positive number of requests/s")
    b = _number(result, "burstiness", src)
    if b is not None and b != 1.0:
        law = "constant gaps" if math.isinf(b) else "gamma-distributed gaps"
        raise DataError(f"{src}: burstiness {result.get('burstiness')!r} ({law}): the twin rebuilds runs with "
                        f"Poisson arrivals (burstiness 1) only")
    conc = result.get("max_concurrency")
    if conc is not None:
        raise DataError(f"{src}: max_concurrency {conc!r}: the client kept at most {conc} requests in flight "
                        f"(a closed loop), and the twin rebuilds open-loop Poisson arrivals; rerun without "
                        f"--max-concurrency")
    if result.get("ramp_up_strategy") is not None:
        raise DataError(f"{src}: ramp_up_strategy {result['ramp_up_strategy']!r}: the request rate changed "
                        f"during the run, and the twin rebuilds a constant rate only")
    return rate


def _setting(result: dict, key: str, option: Any, flag: str, src: str) -> Any:
    """A value given by the option (``flag``) and/or the file's ``--metadata`` key; both and different is an
    error (no silent override)."""
    meta = result.get(key)
    if meta is None:
        return option
    if option is None:
        return meta
    same = str(option).split() == str(meta).split() if key == "lora_ranks" else (
        _int_value(meta, key, src) == option)
    if not same:
        raise DataError(f"{src}: {flag} {option} but the file's --metadata {key}={meta}; give one of them, or "
                        f"the same value")
    return option


def bench_row(result: dict, run_id: str, src: str, options: BenchOptions | None = None,
              log: Callable[[str], None] | None = None) -> dict[str, str]:
    """One result object as a row of the runs schema (string values, as read from a CSV). ``src`` names the
    file in messages; ``DataError`` (one line) on anything the twin cannot rebuild."""
    opts = options or BenchOptions()
    # 1. what the twin needs from the file itself
    n_req, mean_in, mean_out, ok = _lengths(result, src)
    completed = _number(result, "completed", src)
    tot_in, tot_out = _number(result, "total_input_tokens", src), _number(result, "total_output_tokens", src)
    missing = [k for k in ("duration", "completed", "request_rate") if result.get(k) is None]
    if n_req is None and result.get("num_prompts") is None:
        missing.append("num_prompts")
    if mean_in is None and (tot_in is None or tot_out is None):
        missing += [k for k in ("total_input_tokens", "total_output_tokens") if result.get(k) is None]
    if missing:
        lens = " (or the per-request input_lens, output_lens)" if any(k.startswith("total_") for k in missing) else ""
        raise DataError(f"{src}: missing key(s) {', '.join(missing)}{lens}; the twin needs the request rate, the "
                        f"number of requests and their lengths; expected a vllm bench serve --save-result file")
    duration = _positive(result, "duration", src)
    assert duration is not None and completed is not None
    if not (math.isfinite(completed) and completed == int(completed) and completed >= 0):
        raise DataError(f"{src}: completed = {result.get('completed')!r}; expected a count of requests")
    if completed == 0:
        raise DataError(f"{src}: completed 0: every request failed, there is nothing to compare with")
    if n_req is None:
        n_req = _int_value(result.get("num_prompts"), "num_prompts", src)
    if mean_in is None:
        if tot_in is None or tot_out is None:
            raise DataError(f"{src}: no completed request in input_lens/output_lens and no total_input_tokens, "
                            f"total_output_tokens; the twin needs the requests' lengths")
        mean_in, mean_out = tot_in / completed, tot_out / completed
    assert mean_out is not None
    rate = _refuse_arrivals(result, src, n_req)

    # 2. what the command line or the --metadata pairs add: the adapters and the server's flags
    ranks_text = _setting(result, "lora_ranks", opts.adapter_ranks, "--adapter-ranks", src)
    flags = {k: _setting(result, k, getattr(opts, k), f"--{k.replace('_', '-')}", src) for k in FLAG_KEYS}
    need = []
    if ranks_text is None:
        need.append("the adapters' ranks (--adapter-ranks, e.g. 16:8, or --metadata lora_ranks=16:8)")
    need += [f"--{k.replace('_', '-')} (or --metadata {k}=...)" for k in ("max_loras", "max_lora_rank")
             if flags[k] is None]
    if need:
        raise DataError(f"{src}: the file does not record {'; '.join(need)}: give them on the command line or "
                        f"as --metadata pairs of vllm bench serve")
    try:
        ranks = parse_counts(str(ranks_text), int)
    except DataError as e:
        raise DataError(f"{src}: lora_ranks / --adapter-ranks: {e}") from None
    if not ranks or min(ranks) < 1:
        raise DataError(f"{src}: lora_ranks / --adapter-ranks {ranks_text!r}: expected at least one adapter of "
                        f"rank >= 1 as rank:count pairs, e.g. 16:8")
    n = len(ranks)
    ints = {k: (None if v is None else _int_value(v, k, src)) for k, v in flags.items()}
    notes = [f"the adapter of each request drawn uniformly at random from {n} (the benchmark's --lora-modules): "
             f"rebuilt as {n} Poisson stream(s) of {rate:g}/{n} = {rate / n:.4g} req/s over {n_req / rate:g} s "
             f"({n_req} requests / request_rate)"]
    if ints["max_cpu_loras"] is None:
        ints["max_cpu_loras"] = ints["max_loras"]
        notes.append(f"max_cpu_loras = max_loras = {ints['max_loras']} (vLLM's default)")
    dflt = [k for k in ("max_num_seqs", "max_num_batched_tokens") if ints[k] is None]
    if dflt:
        notes.append(f"{' and '.join(dflt)}: the profile's")
    if ok is not None and sum(ok) > 1:
        ins = {x for x, k in zip(result["input_lens"], ok, strict=True) if k}
        outs = {x for x, k in zip(result["output_lens"], ok, strict=True) if k}
        if len(ins) == 1 and len(outs) == 1:
            notes.append(f"every request has {ins.pop():g} input and {outs.pop():g} output tokens (the random "
                         f"dataset?): --lengths fixed rebuilds them exactly")
    if log is not None:
        log(f"{src}: " + "; ".join(notes))

    # 3. the measured side, as the runs schema defines it
    ttfts, gaps = _per_request_latencies(result, ok)
    thr = _number(result, "total_token_throughput", src)
    if thr is None and tot_in is not None and tot_out is not None:
        thr = (tot_in + tot_out) / duration
    in_s = None if tot_in is None else tot_in / duration
    out_s = _number(result, "output_throughput", src)
    if out_s is None and tot_out is not None:
        out_s = tot_out / duration
    incoming_tok_s = rate * (mean_in + mean_out)
    ratio = None if thr is None or incoming_tok_s <= 0 else thr / incoming_tok_s
    vllm_version = result.get("vllm_version")

    def cell(v: float | None) -> str:
        return "" if v is None or not math.isfinite(v) else _g(v)

    counts = Counter(ranks)
    return {
        "run_id": run_id, "model": model_key(result, src, opts.model), "engine": "",
        "vllm_version": "" if vllm_version is None else str(vllm_version).strip(),
        "n_adapters": str(n), "max_loras": str(ints["max_loras"]), "max_lora_rank": str(ints["max_lora_rank"]),
        "max_cpu_loras": str(ints["max_cpu_loras"]),
        "max_num_seqs": "" if ints["max_num_seqs"] is None else str(ints["max_num_seqs"]),
        "max_num_batched_tokens": "" if ints["max_num_batched_tokens"] is None else str(ints["max_num_batched_tokens"]),
        "rank_counts": " ".join(f"{r}:{c}" for r, c in sorted(counts.items())),
        "rate_counts": f"{_g(rate / n)}:{n}",
        "window_s": _g(n_req / rate), "num_prompts": str(n_req), "duration_s": _g(duration),
        "mean_input_tokens": _g(mean_in), "mean_output_tokens": _g(mean_out),
        "status": "ok", "error_type": "", "kv_cache_tokens": "",
        "incoming_req_s": _g(rate), "incoming_tok_s": _g(incoming_tok_s),
        "n_completed": str(int(completed)), "input_tok_s": cell(in_s), "output_tok_s": cell(out_s),
        "throughput_tok_s": cell(thr), "throughput_ratio": cell(ratio),
        "starved": "" if ratio is None else str(int(ratio < STARVED_RATIO)),
        "ttft_mean_ms": cell(_stat_ms(result, "mean", "ttft", src, ttfts)),
        "ttft_median_ms": cell(_stat_ms(result, "median", "ttft", src, ttfts)),
        "ttft_p99_ms": cell(_stat_ms(result, "p99", "ttft", src, ttfts)),
        "tpot_mean_ms": cell(_number(result, "mean_tpot_ms", src)),
        "itl_mean_ms": cell(_stat_ms(result, "mean", "itl", src, gaps)),
        "itl_median_ms": cell(_stat_ms(result, "median", "itl", src, gaps)),
        "itl_p99_ms": cell(_stat_ms(result, "p99", "itl", src, gaps)),
        "running_mean": "", "running_max": "", "waiting_max": "", "waiting_end": "", "kv_usage_mean": "",
        "source": src,
    }


# ---------------------------------------------------------------------------------------------------------
# where runs are read: a runs CSV (``realruns.read_runs``) or result JSONs


def read_runs_file(path: str | Path, options: BenchOptions | None = None,
                   log: Callable[[str], None] | None = None) -> list[dict]:
    """The runs of one file: a ``.json`` path is a result file (``read_bench_json``), anything else a runs CSV
    (``realruns.read_runs``; ``options`` and ``log`` are not used)."""
    return read_bench_json(path, options, log) if is_bench_json(path) else read_runs(path)


def read_run_files(paths: str | Path | Sequence[str | Path], options: BenchOptions | None = None,
                   log: Callable[[str], None] | None = None) -> tuple[list[dict], list[str]]:
    """The runs of one or several files (runs CSVs and/or result JSONs), in order, and where each row comes
    from, for messages (``"runs.csv: row 3"``, ``"a.json"``). Options for JSON runs given with CSV files
    only are an error (they would be ignored)."""
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    if not paths:
        raise DataError("no runs file given; expected a runs CSV or vllm bench serve result JSON files")
    check_options_used(paths, options)
    rows: list[dict] = []
    where: list[str] = []
    for p in paths:
        mine = read_runs_file(p, options, log)
        rows += mine
        where += [r.get("source") or str(p) for r in mine] if is_bench_json(p) else \
            [f"{p}: row {k}" for k in range(1, len(mine) + 1)]
    return rows, where


def runs_label(paths: str | Path | Sequence[str | Path]) -> str:
    """The runs files for a title or a message: the path, or the paths joined by commas."""
    return str(paths) if isinstance(paths, str | Path) else ", ".join(str(p) for p in paths)


def check_options_used(paths: Sequence[str | Path], options: BenchOptions | None) -> None:
    """Options for JSON runs given with CSV files only: an error (they would be ignored silently)."""
    if options is None or any(is_bench_json(p) for p in paths):
        return
    given = options.given_flags()
    if given:
        raise SpecError(f"{', '.join(given)}: these describe vllm bench serve JSON runs; a runs CSV carries its own "
                        f"server flags and adapters")
