"""Model files: one ``.npz`` per (profile, kind) holding the flat tree arrays of every target and a JSON
header — no pickle anywhere (``np.load(allow_pickle=False)``).

The header records the format, the kind (``surrogate`` = the compiled ensemble, ``tree`` = the shallow
trees), the feature order, the profile (model, gpu, vLLM version, profile hash), the twin fingerprint of
the training rows, the training-data hash, the training ranges of every feature, and per target the
family, hyper-parameters, output transform and scores. ``content_sha256`` covers the header and every array:
a file changed after it was written (or written by something else) is refused with one line.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..oracle import FEATURE_NAMES
from .forest import FlatForest

FORMAT = "lorapack-model/1"
KINDS = ("surrogate", "tree")
TARGETS = ("throughput", "starved", "itl", "ttft")
META_KEY = "__meta__"


@dataclass
class ModelFile:
    """Every target's compiled model for one profile and kind, with its provenance."""

    kind: str
    profile: dict  # model, gpu, vllm_version, profile_hash
    twin_fingerprint: str
    training_data_hash: str
    ranges: dict[str, list[float]]  # feature -> [min, max] over the training rows
    targets: dict[str, FlatForest]
    target_info: dict[str, dict]  # family, params, transform, scores, rows, ...
    feature_names: tuple[str, ...] = FEATURE_NAMES
    extra: dict = field(default_factory=dict)  # training report summary, datasets, timings

    @property
    def key(self) -> str:
        return f"{self.profile['gpu']}__{self.profile['model']}"

    def header(self) -> dict:
        return {
            "format": FORMAT, "kind": self.kind, "feature_names": list(self.feature_names),
            "profile": self.profile, "twin_fingerprint": self.twin_fingerprint,
            "training_data_hash": self.training_data_hash, "ranges": self.ranges,
            "targets": {t: {**self.target_info.get(t, {}), "forest": f.header()} for t, f in self.targets.items()},
            "extra": self.extra,
        }


def _digest(header: dict, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(k.encode())
        h.update(str(a.dtype).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save_model(mf: ModelFile, path: str | Path) -> Path:
    """Write ``mf`` atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for t, f in mf.targets.items():
        arrays.update(f.arrays(t))
    # compact storage: float32 is not enough for thresholds (exactness), int32 indices
    header = mf.header()
    header["content_sha256"] = _digest(header, arrays)
    meta = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays, **{META_KEY: meta})
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return path


UNPACKED_DIR = "models"  # below the user cache directory (``twin.jitcache.cache_root``)


def _unpacked_path(path: Path) -> Path | None:
    """Where an uncompressed copy of model file ``path`` is kept: named after the file's identity (path, size,
    modification time), so a changed file gets a fresh copy. None without a cache directory."""
    from ..twin.jitcache import cache_root

    try:
        st = path.stat()
    except OSError:
        return None
    ident = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / UNPACKED_DIR / f"{_copy_prefix(path)}-{ident}.npz"


def _copy_prefix(path: Path) -> str:
    """``<directory>__<name>``: the shipped models of each profile sit in their own directory."""
    return f"{path.resolve().parent.name}__{path.stem}"


def _read_arrays(path: Path) -> tuple[dict[str, np.ndarray], bool]:
    """The file's arrays, from its uncompressed copy when there is one (zlib costs ~0.1-0.2 s per model, paid
    by every cold ``lorapack place``); ``(arrays, from_copy)``. The content checksum is verified either way."""
    copy = _unpacked_path(path)
    if copy is not None and copy.is_file():
        try:
            with np.load(copy, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}, True
        except Exception:  # a damaged copy: read the file itself (and write the copy anew)
            pass
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}, False
    except Exception as e:  # not a zip / npz, or object arrays (would need pickle)
        raise DataError(f"{path}: not a lorapack model file ({type(e).__name__}); expected a file written by "
                        f"lorapack train or refine") from None


def _keep_unpacked(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write the verified arrays uncompressed beside the other cached copies (older copies of the same file
    name removed); an unwritable cache only costs time."""
    copy = _unpacked_path(path)
    if copy is None:
        return
    try:
        copy.parent.mkdir(parents=True, exist_ok=True)
        for old in copy.parent.glob(f"{_copy_prefix(path)}-*.npz"):
            if old != copy:
                old.unlink(missing_ok=True)
        tmp = copy.with_name(f".{copy.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            np.savez(f, **arrays)
        tmp.replace(copy)
    except OSError:
        pass


def load_model(path: str | Path) -> ModelFile:
    """Read and verify a model file; anything unexpected raises ``DataError`` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"model file not found: {path}")
    arrays, from_copy = _read_arrays(path)
    mf = _model_from_arrays(path, dict(arrays))
    if not from_copy:
        _keep_unpacked(path, arrays)
    return mf


def _model_from_arrays(path: Path, arrays: dict[str, np.ndarray]) -> ModelFile:
    if META_KEY not in arrays:
        raise DataError(f"{path}: not a lorapack model file (no header)")
    try:
        header = json.loads(arrays.pop(META_KEY).tobytes().decode())
    except (UnicodeDecodeError, ValueError):
        raise DataError(f"{path}: unreadable model header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{path}: format {header.get('format') if isinstance(header, dict) else None!r}; "
                        f"expected {FORMAT} (a file written by lorapack train or refine)")
    claimed = header.pop("content_sha256", None)
    if claimed != _digest(header, arrays):
        raise DataError(f"{path}: content does not match its checksum (modified or damaged); re-run "
                        f"lorapack train / refine or restore the file")
    if header.get("kind") not in KINDS:
        raise DataError(f"{path}: kind {header.get('kind')!r}; expected one of {', '.join(KINDS)}")
    if tuple(header.get("feature_names", ())) != FEATURE_NAMES:
        raise DataError(f"{path}: trained on features {header.get('feature_names')}; this lorapack computes "
                        f"{list(FEATURE_NAMES)} (retrain with lorapack train)")
    targets = {}
    for t, info in header["targets"].items():
        targets[t] = FlatForest.from_arrays(t, arrays, info["forest"])
        if targets[t].n_features != len(FEATURE_NAMES):
            raise DataError(f"{path}: target {t} expects {targets[t].n_features} features")
    missing = [t for t in ("throughput", "starved") if t not in targets]
    if missing:
        raise DataError(f"{path}: no model for {', '.join(missing)}")
    info = {t: {k: v for k, v in i.items() if k != "forest"} for t, i in header["targets"].items()}
    return ModelFile(kind=header["kind"], profile=header["profile"], twin_fingerprint=header["twin_fingerprint"],
                     training_data_hash=header["training_data_hash"], ranges=header["ranges"], targets=targets,
                     target_info=info, feature_names=tuple(header["feature_names"]), extra=header.get("extra", {}))


def model_path(models_dir: str | Path, gpu: str, model: str, kind: str) -> Path:
    return Path(models_dir) / f"{gpu}__{model}" / f"{kind}.npz"
