"""Loading a workload from files: YAML (the full spec) or a bare adapters CSV, with every referenced data file
(lengths table, trace) read and checked at load time.

Every malformed input raises a ``SpecError`` whose one-line message names the file, the line and what was
expected (``lorapack.textfiles``); data files raise ``DataError`` naming their own file and line. The YAML
layout is described in ``lorapack.spec``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from ..checks import input_file_problem
from ..errors import SpecError
from ..spec import (
    FIELD_MODELS,
    Adapter,
    AdapterGroup,
    LengthsSpec,
    TraceArrivals,
    Workload,
    WorkloadFile,
    expand_adapters,
)
from ..textfiles import error_text, iter_csv_rows, loc_str, validate_yaml_file, validation_error
from .lengths import check_lognormal_reachable, load_lengths_table
from .trace import load_trace

EXAMPLES_DIR = Path(__file__).parent.parent / "examples"
ADAPTER_COLUMNS = ("adapter_id", "rank", "rate_rps")
ADAPTER_OPTIONAL_COLUMNS = ("path",)


def load_adapters_csv(path: str | Path) -> list[Adapter]:
    """Adapters from a CSV ``adapter_id,rank,rate_rps[,path]`` (registration order = row order)."""
    return read_adapter_table(path, ADAPTER_COLUMNS, ADAPTER_OPTIONAL_COLUMNS)


def read_adapter_table(path: str | Path, columns: tuple[str, ...], optional: tuple[str, ...] = (),
                       fill: dict[str, object] | None = None) -> list[Adapter]:
    """Adapters from a CSV with ``columns`` (+ any of ``optional``), each row checked as an ``Adapter`` with
    ``fill`` replacing its fields (e.g. a rate the file need not give); ids unique, at least one row. Errors
    name the file and line."""
    path = Path(path)
    adapters: list[Adapter] = []
    first_line: dict[str, int] = {}
    for line, row in iter_csv_rows(path, columns, optional):
        data = {**row, **(fill or {})}
        try:
            adapter = Adapter.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc, str(path), {(): line}, data, Adapter, base_line=line) from None
        if adapter.adapter_id in first_line:
            raise SpecError(f"{path}:{line}: adapter_id: duplicate id '{adapter.adapter_id}' (first on line "
                            f"{first_line[adapter.adapter_id]}); expected unique ids")
        first_line[adapter.adapter_id] = line
        adapters.append(adapter)
    if not adapters:
        raise SpecError(f"{path}:2: no adapters; expected at least one row after the header")
    return adapters


def _resolve(base: Path, value: str) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _load_yaml(path: Path) -> Workload:
    file = str(path)
    spec, lines = validate_yaml_file(
        path, WorkloadFile, "'adapters' or 'adapters_csv' (and optional lengths, arrivals, duration_s)", FIELD_MODELS)

    base = path.parent
    if spec.adapters_csv is not None:
        csv_path = Path(_resolve(base, spec.adapters_csv))
        _check_data_file(csv_path, file, lines[("adapters_csv",)], "adapters_csv")
        adapters = load_adapters_csv(csv_path)
    else:
        assert spec.adapters is not None
        # expand in one pass so group numbering runs across the whole list, then check ids with lines
        adapters = expand_adapters(spec.adapters)
        owner = [i for i, e in enumerate(spec.adapters) for _ in range(e.count if isinstance(e, AdapterGroup) else 1)]
        first: dict[str, int] = {}
        for a, i in zip(adapters, owner, strict=True):
            line = lines.get(("adapters", i), 1)
            if a.adapter_id in first:
                raise SpecError(f"{file}:{line}: adapters[{i}]: duplicate adapter_id '{a.adapter_id}' "
                                f"(first on line {first[a.adapter_id]}); expected unique ids")
            first[a.adapter_id] = line

    lengths = spec.lengths
    if lengths.path is not None:
        lengths = lengths.model_copy(update={"path": _resolve(base, lengths.path)})
        _check_data_file(Path(lengths.path), file, lines.get(("lengths", "path"), 1), "lengths.path")
    arrivals = spec.arrivals
    if isinstance(arrivals, TraceArrivals):
        arrivals = arrivals.model_copy(update={"path": _resolve(base, arrivals.path)})
        _check_data_file(Path(arrivals.path), file, lines.get(("arrivals", "path"), 1), "arrivals.path")
    # lengths only when the file gives them: a workload without ``lengths:`` says nothing about its requests'
    # lengths, and ``place`` then assumes the profile's law (``"lengths" in workload.model_fields_set``)
    given = {"lengths": lengths} if "lengths" in spec.model_fields_set else {}
    workload = Workload(adapters=adapters, arrivals=arrivals, duration_s=spec.duration_s, **given)
    _load_data_files(workload, f"{file}:{lines.get(('lengths',), 1)}")
    return workload


def _check_data_file(path: Path, file: str, line: int, where: str) -> None:
    problem = input_file_problem(path)
    if problem == "file not found":
        raise SpecError(f"{file}:{line}: {where}: file not found: {path}")
    if problem is not None:
        raise SpecError(f"{file}:{line}: {where}: {path}: {problem}")


def _load_data_files(workload: Workload, where: str | None) -> None:
    """Parse referenced data files (and solve the length model) now, so a bad trace fails at load time.

    Data files raise ``DataError`` naming their own file and line; an unreachable length target raises a
    ``SpecError`` prefixed with ``where`` (``file:line``).
    """
    if workload.lengths.kind == "empirical":
        assert workload.lengths.path is not None
        load_lengths_table(workload.lengths.path)
    if isinstance(workload.arrivals, TraceArrivals):
        load_trace(workload.arrivals.path)
    if workload.lengths.kind == "lognormal" and not (
        isinstance(workload.arrivals, TraceArrivals) and workload.arrivals.trace_lengths
    ):
        try:
            check_lognormal_reachable(
                workload.lengths.mean_input_tokens, workload.lengths.mean_output_tokens, workload.lengths.cv
            )
        except SpecError as exc:
            if where is None:
                raise
            raise SpecError(f"{where}: {exc}") from None


def load_workload(path: str | Path) -> Workload:
    """Load a workload from ``.yaml``/``.yml`` (full spec) or ``.csv`` (adapters only, defaults for the rest)."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: file not found")
    if not path.is_file():
        raise SpecError(f"{path}: not a file")
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return _load_yaml(path)
    if suffix == ".csv":
        workload = Workload(adapters=load_adapters_csv(path))
        _load_data_files(workload, str(path))
        return workload
    raise SpecError(f"{path}: unknown workload file type '{path.suffix}'; expected .yaml, .yml or .csv")


def with_mean_lengths(workload: Workload, mean_input_tokens: float | None = None,
                      mean_output_tokens: float | None = None) -> Workload:
    """A copy of ``workload`` with its length means overridden (None keeps the current value)."""
    lengths = workload.lengths
    if mean_input_tokens is None and mean_output_tokens is None:
        return workload
    if lengths.kind == "empirical":
        raise SpecError("mean token overrides apply to fixed or lognormal lengths, not 'empirical' ones")
    update = lengths.model_dump()
    if mean_input_tokens is not None:
        update["mean_input_tokens"] = mean_input_tokens
    if mean_output_tokens is not None:
        update["mean_output_tokens"] = mean_output_tokens
    try:
        new_lengths = LengthsSpec.model_validate(update)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise SpecError(f"lengths.{loc_str(err['loc'])}: {error_text(err, LengthsSpec, FIELD_MODELS)}") from None
    out = workload.model_copy(update={"lengths": new_lengths})
    _load_data_files(out, None)
    return out


def example_workload(name: str = "demo.yaml") -> Path:
    """Path of a shipped example workload (``demo.yaml``, ``adapters.csv``)."""
    path = EXAMPLES_DIR / name
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in EXAMPLES_DIR.glob("*") if p.suffix in (".yaml", ".csv")))
        raise SpecError(f"no shipped example '{name}'; expected one of: {shipped}")
    return path
