"""``lorapack measure --launch 'vllm serve … {flags}'``: lorapack starts the server itself, on loopback, and stops it
with its whole process tree (``testbed.guard``): once per point of a ``--max-loras`` × ``--max-lora-rank`` grid, to
record the KV capacity each setting starts with or why it is refused (``startup.csv``: the start-up/memory
rule, ``fit.fit_memory``), then once with the command's own flags for the experiments.

``{flags}`` in the command is replaced by ``--host 127.0.0.1 --port P`` (and the grid point's ``--max-loras A
--max-lora-rank S``); without it they are appended. vLLM's parser lets the last occurrence of a flag win, so the
grid's values override the command's own.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .probe import Http, MeasureError, scrape

PLACEHOLDER = "{flags}"
DEFAULT_START_TIMEOUT_S = 900.0
# vLLM's start-up refusals, by the words of its error (shared/data/README.md §2 names the kinds)
REFUSALS = (
    ("kv_cache_insufficient", re.compile(r"larger than the available KV cache memory|KV cache is needed", re.I)),
    ("no_cache_blocks", re.compile(r"No available memory for the cache blocks|no available (KV )?cache", re.I)),
    ("cuda_oom", re.compile(r"CUDA out of memory|OutOfMemoryError", re.I)),
    ("adapter_rank_above_max_lora_rank", re.compile(r"LoRA rank \d+ is greater than max_lora_rank", re.I)),
    ("invalid_argument", re.compile(r"max_lora_rank \(\d+\) must be one of|ValidationError|invalid choice|"
                                    r"error: argument", re.I)),
)


def command_words(template: str, flags: Sequence[str]) -> list[str]:
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise MeasureError(f"--launch {template!r}: not a command line ({e})") from None
    if not words:
        raise MeasureError("--launch: empty command; expected e.g. 'vllm serve MODEL --enable-lora ... {flags}'")
    if PLACEHOLDER in words:
        i = words.index(PLACEHOLDER)
        return words[:i] + list(flags) + words[i + 1:]
    return words + list(flags)


@dataclass
class Launched:
    url: str
    proc: object
    log: Path

    def stop(self) -> None:
        from ..testbed.server import stop_tree

        stop_tree(self.proc)  # type: ignore[arg-type]


def refusal(log: Path) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    for kind, pattern in REFUSALS:
        if pattern.search(text):
            return kind
    return "failed"


def start(template: str, extra: Sequence[str], log: Path, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> Launched:
    """Start the command on a free loopback port; wait until ``/health`` answers. Raises ``MeasureError`` (with the
    refusal kind first) when it exits or does not become healthy."""
    from ..testbed.env import TestbedError
    from ..testbed.server import free_port, guarded, wait_healthy

    port = free_port()
    cmd = command_words(template, ["--host", "127.0.0.1", "--port", str(port), *extra])
    import shutil

    if shutil.which(cmd[0]) is None:
        raise MeasureError(f"--launch: cannot start {cmd[0]!r}: no such program")
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = guarded(cmd, log=log)
    except OSError as e:
        raise MeasureError(f"--launch: cannot start {cmd[0]!r} ({e.strerror or e})") from None
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout_s)
    except TestbedError:
        launched = Launched(url, proc, log)
        launched.stop()
        from ..testbed.server import why_it_failed

        lines = [ln.strip() for ln in why_it_failed(log, tail=3) if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        reason = (errors or lines or ["no output"])[-1]
        raise MeasureError(f"{refusal(log)}: the server did not start: {reason[:200]} (log {log})") from None
    except BaseException:
        Launched(url, proc, log).stop()
        raise
    return Launched(url, proc, log)


def startup_grid(template: str, grid: Sequence[tuple[int, int]], log_dir: Path, timeout_s: float,
                 say: Callable[[str], None], done: Sequence[dict] = (),
                 save: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One start per (max_loras, max_lora_rank): ``status`` ok with the KV capacity, or failed with the kind.
    ``done``: rows of an earlier, interrupted grid (not started again); ``save``: called after every point."""
    rows = list(done)
    seen = {(int(r["max_loras"]), int(r["max_lora_rank"])) for r in rows}
    for a, s in grid:
        if (a, s) in seen:
            continue
        t0 = time.monotonic()
        log = log_dir / f"startup-{a}-{s}.log"
        row = {"max_loras": a, "max_lora_rank": s, "status": "ok", "error_type": "", "kv_cache_tokens": "",
               "start_s": ""}
        try:
            server = start(template, ["--max-loras", str(a), "--max-lora-rank", str(s)], log, timeout_s)
        except MeasureError as e:
            row.update(status="failed", error_type=str(e).split(":", 1)[0])
        else:
            try:
                row["kv_cache_tokens"] = scrape(Http(server.url)).kv_cache_tokens or ""
            finally:
                server.stop()
        row["start_s"] = round(time.monotonic() - t0, 1)
        say(f"startup: --max-loras {a} --max-lora-rank {s}: {row['status']}"
            + (f" ({row['error_type']})" if row["error_type"] else f", KV cache {row['kv_cache_tokens']} tokens"))
        rows.append(row)
        if save is not None:
            save(rows)
    return rows


def parse_grid(max_loras: str, ranks: str) -> list[tuple[int, int]]:
    def ints(text: str, name: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
            if not vals or min(vals) < 1:
                raise ValueError
        except ValueError:
            raise MeasureError(f"{name} {text!r}: expected positive integers separated by commas, e.g. 1,4,16")\
                from None
        return vals

    return [(a, s) for s in ints(ranks, "--grid-max-lora-rank") for a in ints(max_loras, "--grid-max-loras")]
