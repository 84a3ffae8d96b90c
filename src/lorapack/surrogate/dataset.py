"""Training rows from sweep directories: features, per-target labels, groups and provenance.

Features are read from the sweep rows, which ``oracle.features`` computed (this module computes none).
Each target is trained and scored only on the rows that carry its label exactly enough
(``LABEL_ROWS``; ``bench/sweep_shortcuts.py`` measures the early-stopped rows against full runs):

| target | rows | why |
|---|---|---|
| throughput (ratio to the offered tokens) | full + every early stop | early throughput is extrapolated: SMAPE ~0.2 % vs full runs |
| starved | full + every early stop | run-level label agreement 100 % on the bench |
| itl | full + healthy early stops | ITL of a converged healthy run is stationary (SMAPE ~0.4 % vs full runs); a starved run's ITL still drifts at the stop |
| ttft | full + healthy early stops | a healthy run's TTFT is near-stationary (SMAPE ~1.9 %, paper convention, on 182 rows); starved stops miss the backlog's growth (21-27 %) |

Healthy early stops carry TTFT because they are the light configs: without them no light GPU has a TTFT label
(nearly every light config stops early), and a latency objective (mean TTFT <= 2 s) is decided exactly there.

Pruned rows (nothing simulated) and OOM rows (the start-up rule answers them exactly) are excluded everywhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..oracle import FEATURE_NAMES

EARLY = ("early_healthy_converged", "early_certain_starved", "early_likely_starved")
LABEL_ROWS: dict[str, tuple[str, ...]] = {
    "throughput": ("full", *EARLY),
    "starved": ("full", *EARLY),
    "itl": ("full", "early_healthy_converged"),
    "ttft": ("full", "early_healthy_converged"),
}
LABEL_COLUMNS = ("throughput_tok_s", "incoming_expected_tok_s", "throughput_ratio", "starved", "itl_mean_ms",
                 "ttft_mean_ms", "obtained", "series_id", "config_id", "twin_fingerprint", "profile_hash",
                 "model", "gpu")


@dataclass
class Dataset:
    """The simulated rows of one profile."""

    model: str
    gpu: str
    X: np.ndarray  # [n, len(FEATURE_NAMES)]
    cols: dict[str, np.ndarray]
    sources: list[str]

    def __len__(self) -> int:
        return len(self.X)

    @property
    def fingerprint(self) -> str:
        return str(self.cols["twin_fingerprint"][0])

    @property
    def profile_hash(self) -> str:
        return str(self.cols["profile_hash"][0])

    def data_hash(self) -> str:
        """sha256 of the rows (sorted by config_id): features, labels and how each row was obtained."""
        order = np.argsort(self.cols["config_id"], kind="stable")
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.X[order]).tobytes())
        for c in ("config_id", "obtained"):
            h.update("\x00".join(map(str, self.cols[c][order])).encode())
        for c in ("throughput_tok_s", "starved", "itl_mean_ms", "ttft_mean_ms"):
            h.update(np.ascontiguousarray(self.cols[c][order].astype(np.float64)).tobytes())
        return h.hexdigest()[:16]

    def target(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(row mask, y)`` of a target on its label rows (``y`` is the transformed label, see
        ``TRANSFORMS``)."""
        ok = np.isin(self.cols["obtained"], LABEL_ROWS[name])
        c = self.cols
        if name == "throughput":
            inc = c["incoming_expected_tok_s"]
            ok &= np.isfinite(c["throughput_tok_s"]) & (inc > 0)
            y = np.where(ok, c["throughput_tok_s"] / np.where(inc > 0, inc, 1.0), np.nan)
        elif name == "starved":
            y = c["starved"].astype(float)
        else:
            v = c["itl_mean_ms" if name == "itl" else "ttft_mean_ms"]
            ok &= np.isfinite(v) & (v > 0)
            y = np.log(np.where(ok, v, 1.0))
        return ok, y[ok]


# how a model's raw output maps back to the label: throughput = ratio x offered tokens; latencies on a log scale
TRANSFORMS = {"throughput": "ratio_of_incoming_expected", "starved": "probability", "itl": "log_ms",
              "ttft": "log_ms"}


def read_datasets(paths: list[str | Path]) -> dict[tuple[str, str], Dataset]:
    """Simulated rows of one or more sweep directories, per ``(gpu, model)``.

    Refuses rows of one profile that come from twins with different fingerprints (or without one)."""
    from ..sweep import read_rows
    from ..sweep.store import part_files

    tables = []
    for p in paths:
        p = Path(p)
        if not p.is_dir() or not part_files(p):
            raise DataError(f"{p}: not a sweep directory (no part-*.parquet); expected the --out of lorapack sweep")
        tables.append((str(p), read_rows(p, columns=list(dict.fromkeys(FEATURE_NAMES + LABEL_COLUMNS)))))
    by: dict[tuple[str, str], list] = {}
    for src, t in tables:
        d = {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}
        sim = np.isin(d["obtained"], ("full", *EARLY))
        for key in sorted({(g, m) for g, m in zip(d["gpu"][sim], d["model"][sim], strict=True)}):
            m = sim & (d["gpu"] == key[0]) & (d["model"] == key[1])
            by.setdefault(key, []).append((src, {c: v[m] for c, v in d.items()}))
    out = {}
    for (gpu, model), parts in by.items():
        cols = {c: np.concatenate([p[c] for _s, p in parts]) for c in parts[0][1]}
        fps = sorted({str(x) for x in cols["twin_fingerprint"]})
        if len(fps) != 1 or fps[0] in ("None", ""):
            raise DataError(f"rows for {model} on {gpu} come from twins with different fingerprints ({', '.join(fps)}); "
                            f"train on rows of one twin: re-run the sweep(s) with the current lorapack")
        X = np.column_stack([cols[f].astype(np.float64) for f in FEATURE_NAMES])
        labels = {c: cols[c] for c in LABEL_COLUMNS}
        labels["starved"] = labels["starved"].astype(bool)
        for c in ("throughput_tok_s", "incoming_expected_tok_s", "throughput_ratio", "itl_mean_ms", "ttft_mean_ms"):
            labels[c] = labels[c].astype(np.float64)
        out[(gpu, model)] = Dataset(model=model, gpu=gpu, X=X, cols=labels, sources=[s for s, _ in parts])
    if not out:
        raise DataError(f"no simulated rows in {', '.join(map(str, paths))}")
    return out
