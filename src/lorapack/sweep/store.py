"""The sweep's output directory: append-only Parquet parts plus one metadata file.

    DIR/_sweep.json              grid, twin version, profile hash, shortcuts (written once, checked on resume)
    DIR/part-<time>-<pid>-<k>.parquet   rows; each part is written to a hidden temporary file, fsynced and
                                         renamed, so a crash (even SIGKILL) leaves whole parts or nothing

Readers (``read_rows``, ``pyarrow.dataset``, pandas) see only complete parts: temporary files start with a dot
and the metadata file with an underscore, which dataset discovery skips.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError, SpecError

META_FILE = "_sweep.json"
LOCK_FILE = ".lock"
PART_GLOB = "part-*.parquet"
FORMAT_VERSION = 3  # 2: max_rate column (oracle.features); 3: twin_fingerprint, adapter_labels_exact, rate laws

SCHEMA = pa.schema([
    ("config_id", pa.string()),
    ("series_id", pa.string()),
    ("seed", pa.int64()),
    ("model", pa.string()),
    ("gpu", pa.string()),
    # surrogate features
    ("served_adapters", pa.int32()),
    ("adapter_slots", pa.int32()),
    ("sum_rate", pa.float64()),
    ("std_rate", pa.float64()),
    ("max_rate", pa.float64()),
    ("max_size", pa.int32()),
    ("mean_size", pa.float64()),
    ("std_size", pa.float64()),
    ("mean_input_tokens", pa.float64()),
    ("mean_output_tokens", pa.float64()),
    ("lengths_kind", pa.string()),
    ("max_lora_rank", pa.int32()),
    ("duration_s", pa.float64()),
    ("rate_tuple", pa.list_(pa.float64())),
    ("rank_tuple", pa.list_(pa.int32())),
    ("rate_law", pa.string()),  # kind:low:high:param:draw for non-tuple rate vectors (grid rate_laws)
    ("pad_fraction", pa.float64()),  # share of real adapters in a padded config (0 = not padded)
    # labels and metrics
    ("oom", pa.bool_()),
    ("error_type", pa.string()),
    ("kv_cache_tokens", pa.int64()),
    ("starved", pa.bool_()),
    ("adapter_starved", pa.bool_()),
    ("throughput_tok_s", pa.float64()),
    ("input_tok_s", pa.float64()),
    ("output_tok_s", pa.float64()),
    ("incoming_tok_s", pa.float64()),
    ("incoming_expected_tok_s", pa.float64()),
    ("throughput_ratio", pa.float64()),
    ("itl_mean_ms", pa.float64()),
    ("tpot_mean_ms", pa.float64()),
    ("ttft_mean_ms", pa.float64()),
    ("ttft_median_ms", pa.float64()),
    ("ttft_p99_ms", pa.float64()),
    ("ttft_penalised_mean_ms", pa.float64()),
    ("busy_frac", pa.float64()),
    ("waiting_max", pa.float64()),
    ("n_arrived", pa.int64()),
    ("n_completed", pa.int64()),
    ("preemptions", pa.int64()),
    ("adapter_loads", pa.int64()),
    ("adapters_starved", pa.int64()),
    ("adapter_labels_exact", pa.bool_()),
    # how the row was obtained
    ("obtained", pa.string()),
    ("stop_reason", pa.string()),
    ("simulated_s", pa.float64()),
    # provenance and timing
    ("twin_version", pa.string()),
    ("profile_hash", pa.string()),
    ("twin_fingerprint", pa.string()),
    ("wall_s", pa.float64()),
])
COLUMNS = tuple(SCHEMA.names)
TIMING_COLUMNS = ("wall_s",)


def rows_to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({c: [r.get(c) for r in rows] for c in COLUMNS}, schema=SCHEMA)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class PartWriter:
    """Writes row batches as new Parquet parts, each atomically (tmp + fsync + rename)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
        self.k = 0
        self.rows_written = 0
        self.parts: list[Path] = []

    def write(self, rows: list[dict]) -> Path | None:
        if not rows:
            return None
        table = rows_to_table(rows)
        while True:
            name = f"part-{self.stamp}-{os.getpid()}-{self.k:05d}.parquet"
            self.k += 1
            path = self.out / name
            if not path.exists():
                break
        tmp = self.out / f".{name}.tmp"
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.out)
        self.rows_written += len(rows)
        self.parts.append(path)
        return path


def part_files(out: Path) -> list[Path]:
    return sorted(Path(out).glob(PART_GLOB))


def clean_temporaries(out: Path) -> int:
    """Remove temporary files a killed sweep left behind; returns how many."""
    n = 0
    for p in Path(out).glob(".part-*.parquet.tmp"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def done_config_ids(out: Path) -> set[str]:
    ids: set[str] = set()
    for p in part_files(out):
        try:
            col = pq.read_table(p, columns=["config_id"]).column("config_id")
        except Exception as exc:  # a part is only ever written whole; anything else is outside damage
            raise DataError(f"{p}: unreadable sweep part ({' '.join(str(exc).split())}); move it away and "
                            f"resume to recompute its rows") from None
        ids.update(col.to_pylist())
    return ids


def read_rows(out: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All rows of a sweep directory as one table (order: part by part)."""
    out = Path(out)
    parts = part_files(out)
    if not parts:
        return SCHEMA.empty_table() if columns is None else SCHEMA.empty_table().select(columns)
    return pa.concat_tables([pq.read_table(p, columns=columns, schema=SCHEMA) for p in parts])


def read_meta(out: Path) -> dict | None:
    path = Path(out) / META_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable sweep metadata ({' '.join(str(exc).split())})") from None


def write_meta(out: Path, meta: dict) -> None:
    path = Path(out) / META_FILE
    tmp = Path(out) / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(Path(out))


# what must match for --resume to append to an existing directory
RESUME_KEYS = ("format", "grid_hash", "twin_version", "profile_hash", "twin_fingerprint", "shortcuts",
               "early_stop_active")


def check_resumable(out: Path, meta: dict, resume: bool) -> dict | None:
    """Validate ``out`` for a new sweep (empty) or a resume (same grid, twin, profile, shortcuts).

    Returns the existing metadata (resume) or None (fresh directory).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out {out}: exists and is not a directory")
    old = read_meta(out) if out.is_dir() else None
    has_parts = out.is_dir() and bool(part_files(out))
    if not resume:
        if old is not None or has_parts:
            raise SpecError(f"--out {out} already holds a sweep; pass --resume to continue it or choose a new "
                            f"directory")
        return None
    if old is None:
        if has_parts:
            raise SpecError(f"--out {out}: parts without {META_FILE}; not a lorapack sweep directory")
        return None
    for k in RESUME_KEYS:
        if old.get(k) != meta.get(k):
            raise SpecError(f"--resume {out}: {k} differs from the sweep already there ({_short(old.get(k))} vs "
                            f"{_short(meta.get(k))}); resume with the same settings or use a new --out")
    return old


def _short(v) -> str:
    t = json.dumps(v, sort_keys=True)
    return t if len(t) <= 60 else t[:57] + "..."


@contextlib.contextmanager
def lock_dir(out: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``out`` for the block (released if the process dies, too).

    Two sweeps into one directory would duplicate rows. The lock file is removed when the block ends (while
    still held), so a finished or failed sweep leaves no ``.lock`` behind; a sweep that locked a file another
    one removed meanwhile sees that its file is no longer ``out/.lock`` and treats it as held.
    """
    path = Path(out) / LOCK_FILE
    busy = SpecError(f"--out {out}: another sweep is writing to this directory; wait for it or stop it first")
    f = open(path, "a+")
    try:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise busy from None
            try:
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
            except OSError:
                same = False
            if not same:  # the previous holder removed it between our open and our lock
                raise busy
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
    finally:
        f.close()
