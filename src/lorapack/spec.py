"""Workload spec: which adapters a server registers, how requests arrive and how long they are.

A workload is loaded from YAML or from a bare adapters CSV (``load_workload``). Every malformed input raises a
``SpecError`` whose one-line message names the file, the line and what was expected, e.g.
``demo.yaml:14: adapters[2].rate_rps: expected a finite number >= 0 (got -1)``.

YAML layout (all sections but the adapters are optional)::

    adapters:                      # registration order = list order (twin.md §2.5)
      - {adapter_id: chat, rank: 16, rate_rps: 0.5, path: /lora/chat}
      - {count: 32, rank: 8, rate_rps: 0.1, id_prefix: r8}   # group -> r8-0 ... r8-31
    # or:  adapters_csv: adapters.csv   (relative to this file)
    lengths:  {kind: lognormal, mean_input_tokens: 223, mean_output_tokens: 197}
    arrivals: {kind: poisson}
    duration_s: 3600

Group ids are ``<id_prefix>-<k>`` with ``k`` counting from 0 per prefix across the whole list, so several
groups may share the default prefix ``adapter``. Relative data paths (``lengths.path``, ``arrivals.path``,
``adapters_csv``) are resolved against the YAML file's directory; an adapter's own ``path`` (its weights, for
``vllm serve --lora-modules``) is passed through untouched.

In ``trace`` arrival mode the adapters' ``rate_rps`` are ignored: the trace fixes the aggregate arrivals and
the adapters only receive requests through the assignment weights (``uniform``/``zipf``/``dirichlet``).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import SpecError

EXAMPLES_DIR = Path(__file__).parent / "examples"
ADAPTER_COLUMNS = ("adapter_id", "rank", "rate_rps")
ADAPTER_OPTIONAL_COLUMNS = ("path",)
DEFAULT_MEAN_INPUT_TOKENS = 223.0
DEFAULT_MEAN_OUTPUT_TOKENS = 197.0
DEFAULT_LENGTHS_CV = 1.1  # post-filter CV implied by the published runs (twin.md §5, an inference)
MAX_TOKENS = 2**31 - 1  # token counts are int32 in the engine's inputs
# log-normal gaps keep their mean 1/rate, but their median is exp(-sigma^2/2)/rate: past sigma ~6 nearly every
# gap is ~0 and a window's count is set by a handful of huge draws (sigma 50: the run never ends)
MAX_ARRIVAL_SIGMA = 6.0
MAX_ADAPTERS = 1_000_000  # per workload; loading and generating a million adapters already takes minutes


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _no_bool(value: Any) -> Any:
    # pydantic's lax mode turns True into 1; a boolean rank or rate is always a typo
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got a boolean ({value})")
    return value


def _positive_int(value: int) -> int:
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


def _rate(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a finite number >= 0")
    return value


def _finite_positive(value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError("expected a finite number > 0")
    return value


def _finite_nonnegative(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a finite number >= 0")
    return value


def _arrival_sigma(value: float) -> float:
    if not math.isfinite(value) or not 0 < value <= MAX_ARRIVAL_SIGMA:
        raise ValueError(f"expected a number in (0, {MAX_ARRIVAL_SIGMA:g}]: larger sigmas make almost every gap "
                         f"~0 s and a window's count depend on a few huge draws")
    return value


def _identifier(value: Any) -> Any:
    # YAML reads `adapter_id: 7` as an int; ids are names, so accept numbers as their text
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        value = value.strip()
        if not value or any(ch.isspace() for ch in value):
            raise ValueError("expected a non-empty name without spaces")
    return value


# ---------------------------------------------------------------------------------------------------------
# adapters


class Adapter(_Frozen):
    """One served adapter. Its position in ``Workload.adapters`` is its registration index."""

    adapter_id: str
    rank: int
    rate_rps: float
    path: str | None = None  # weights location, passed through to the vLLM command line

    _id = field_validator("adapter_id", mode="before")(_identifier)
    _nb = field_validator("rank", "rate_rps", mode="before")(_no_bool)
    _r = field_validator("rank")(_positive_int)
    _rt = field_validator("rate_rps")(_rate)

    @field_validator("path", mode="before")
    @classmethod
    def _empty_path(cls, value: Any) -> Any:
        # an empty CSV cell means "no path"
        return None if isinstance(value, str) and not value.strip() else value


class AdapterGroup(_Frozen):
    """``count`` identical adapters, expanded to ids ``<id_prefix>-<k>`` (YAML shorthand)."""

    count: int
    rank: int
    rate_rps: float
    id_prefix: str = "adapter"

    _nb = field_validator("count", "rank", "rate_rps", mode="before")(_no_bool)
    _c = field_validator("count", "rank")(_positive_int)
    _rt = field_validator("rate_rps")(_rate)
    _id = field_validator("id_prefix", mode="before")(_identifier)

    @field_validator("count")
    @classmethod
    def _not_too_many(cls, value: int) -> int:
        if value > MAX_ADAPTERS:
            raise ValueError(f"expected at most {MAX_ADAPTERS:,} adapters")
        return value


def expand_adapters(entries: list[Adapter | AdapterGroup]) -> list[Adapter]:
    """Flatten groups in order; group ids count from 0 per prefix over the whole list."""
    next_k: dict[str, int] = {}
    out: list[Adapter] = []
    for entry in entries:
        if isinstance(entry, Adapter):
            out.append(entry)
            continue
        k0 = next_k.get(entry.id_prefix, 0)
        out.extend(
            Adapter(adapter_id=f"{entry.id_prefix}-{k}", rank=entry.rank, rate_rps=entry.rate_rps)
            for k in range(k0, k0 + entry.count)
        )
        next_k[entry.id_prefix] = k0 + entry.count
    return out


def _entry_kind(value: Any) -> str:
    if isinstance(value, dict) and "count" in value:
        return "group"
    if isinstance(value, AdapterGroup):
        return "group"
    return "adapter"


AdapterEntry = Annotated[
    Annotated[Adapter, Tag("adapter")] | Annotated[AdapterGroup, Tag("group")],
    Discriminator(_entry_kind),
]


# ---------------------------------------------------------------------------------------------------------
# lengths


class LengthsSpec(_Frozen):
    """Prompt / output token counts of the requests.

    * ``fixed``: every request has ``round(mean_input_tokens)`` / ``round(mean_output_tokens)`` tokens.
    * ``lognormal``: the ShareGPT-like fallback of twin.md §5 -- independent log-normals truncated by the
      ShareGPT filter (``P >= 4, O >= 4, P <= 1024, P + O <= 2048``) whose post-filter means equal the
      targets and whose post-filter CV is ``cv``. An approximation of real lengths; say so in reports.
    * ``empirical``: ``(P, O)`` pairs bootstrapped (with replacement) from a CSV ``input_tokens,output_tokens``
      at ``path``; the means are then ignored.
    """

    kind: Literal["fixed", "lognormal", "empirical"] = "lognormal"
    mean_input_tokens: float = DEFAULT_MEAN_INPUT_TOKENS
    mean_output_tokens: float = DEFAULT_MEAN_OUTPUT_TOKENS
    cv: float = DEFAULT_LENGTHS_CV
    path: str | None = None

    _nb = field_validator("mean_input_tokens", "mean_output_tokens", "cv", mode="before")(_no_bool)

    @field_validator("mean_input_tokens", "mean_output_tokens")
    @classmethod
    def _mean(cls, value: float) -> float:
        if not math.isfinite(value) or not 1 <= value <= MAX_TOKENS:
            raise ValueError(f"expected a finite number of tokens between 1 and {MAX_TOKENS:,}")
        return value

    _cv = field_validator("cv")(_finite_positive)

    @model_validator(mode="after")
    def _consistent(self) -> LengthsSpec:
        if self.kind == "empirical" and not self.path:
            raise ValueError("kind 'empirical' expects 'path' (a CSV with columns input_tokens,output_tokens)")
        if self.kind != "empirical" and self.path:
            raise ValueError(f"'path' is only used by kind 'empirical', not '{self.kind}'")
        return self


# ---------------------------------------------------------------------------------------------------------
# arrivals


class PoissonArrivals(_Frozen):
    """Each adapter: a Poisson process at ``rate_rps`` (exponential gaps)."""

    kind: Literal["poisson"] = "poisson"


class LognormalArrivals(_Frozen):
    """Each adapter: log-normal gaps with mean ``1/rate_rps`` (``mu = -ln(rate) - sigma^2/2``)."""

    kind: Literal["lognormal"] = "lognormal"
    sigma: float = 1.0

    _s = field_validator("sigma")(_arrival_sigma)


class UnpredictableArrivals(_Frozen):
    """The paper's perturbed process (placement.md §6.5).

    Time is cut into ``period_s`` periods. Each adapter starts at its nominal rate (multiplier 1); at every
    period start it picks Poisson or log-normal gaps with equal probability, and from the second period on it
    also multiplies or divides its multiplier by ``factor`` (equal probability), clipped to
    ``[1/clip, clip]``. A gap that crosses a period boundary is discarded and arrivals restart at the
    boundary with the new law.
    """

    kind: Literal["unpredictable"] = "unpredictable"
    period_s: float = 300.0
    factor: float = 2.0
    clip: float = 8.0
    sigma: float = 1.0

    _p = field_validator("period_s")(_finite_positive)
    _s = field_validator("sigma")(_arrival_sigma)

    @field_validator("factor", "clip")
    @classmethod
    def _at_least_one(cls, value: float) -> float:
        if not math.isfinite(value) or value < 1:
            raise ValueError("expected a finite number >= 1")
        return value


class TraceArrivals(_Frozen):
    """Replay a trace CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (data/README.md §5).

    Requests at ``arrived_at >= start_s`` are replayed shifted by ``-start_s`` with their exact times and (if
    ``trace_lengths``) their exact token counts. ``load_scale`` k: the integer part by replication (copies
    after the first get uniform ``±jitter_s`` jitter, clipped at 0, re-sorted), the fractional part by
    Bernoulli thinning of one more jittered copy (for k < 1: thinning of the original). Then each request in
    the window gets an adapter: one request per adapter first when there are at least as many requests as
    adapters, the rest multinomial over ``assignment`` weights, then shuffled. The adapters' ``rate_rps`` are
    ignored in this mode. With ``trace_lengths: false`` lengths come from the workload's ``lengths`` spec.
    A relative ``path`` is relative to the YAML file when loaded by ``load_workload``, else to the working
    directory.
    """

    kind: Literal["trace"] = "trace"
    path: str
    assignment: Literal["uniform", "zipf", "dirichlet"] = "uniform"
    zipf_s: float = 1.0  # weight of the j-th adapter of a seeded permutation ∝ j^-zipf_s
    dirichlet_alpha: float = 0.5  # weights ~ Dirichlet(alpha, ..., alpha); the paper's default
    load_scale: float = 1.0
    jitter_s: float = 5.0
    start_s: float = 0.0
    trace_lengths: bool = True

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        # placement.md writes assignments as "zipf:1.2" / "dirichlet:0.3"; accept that spelling too
        if isinstance(data, dict) and isinstance(data.get("assignment"), str) and ":" in data["assignment"]:
            name, _, param = data["assignment"].partition(":")
            key = {"zipf": "zipf_s", "dirichlet": "dirichlet_alpha"}.get(name.strip())
            if key is not None and key not in data:
                data = {**data, "assignment": name.strip(), key: param.strip()}
        return data

    _nb = field_validator("zipf_s", "dirichlet_alpha", "load_scale", "jitter_s", "start_s", mode="before")(
        _no_bool
    )
    _pos = field_validator("dirichlet_alpha", "load_scale")(_finite_positive)
    _nonneg = field_validator("zipf_s", "jitter_s", "start_s")(_finite_nonnegative)


ArrivalsSpec = Annotated[
    PoissonArrivals | LognormalArrivals | UnpredictableArrivals | TraceArrivals,
    Field(discriminator="kind"),
]


def _default_kind(value: Any, kind: str) -> Any:
    # `arrivals: poisson` is shorthand for `{kind: poisson}`; a mapping without kind gets the default
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": kind, **value}
    return value


def _lengths_kind(value: Any) -> Any:
    return _default_kind(value, "lognormal")


def _arrivals_kind(value: Any) -> Any:
    return _default_kind(value, "poisson")


# ---------------------------------------------------------------------------------------------------------
# workload


class Workload(_Frozen):
    """Adapters (registration order), length and arrival laws, and an optional default window."""

    adapters: list[Adapter] = Field(min_length=1)
    lengths: LengthsSpec = LengthsSpec()
    arrivals: ArrivalsSpec = PoissonArrivals()
    duration_s: float | None = None

    _lk = field_validator("lengths", mode="before")(_lengths_kind)
    _ak = field_validator("arrivals", mode="before")(_arrivals_kind)

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, value: float | None) -> float | None:
        return None if value is None else _finite_positive(value)

    @model_validator(mode="after")
    def _unique_ids(self) -> Workload:
        seen: set[str] = set()
        for i, a in enumerate(self.adapters):
            if a.adapter_id in seen:
                raise ValueError(f"duplicate adapter_id '{a.adapter_id}' (adapter {i}); expected unique ids")
            seen.add(a.adapter_id)
        return self

    @property
    def n_adapters(self) -> int:
        return len(self.adapters)

    @property
    def adapter_ids(self) -> list[str]:
        return [a.adapter_id for a in self.adapters]

    @property
    def ranks(self) -> np.ndarray:
        """int32 [n_adapters], registration order."""
        return np.fromiter((a.rank for a in self.adapters), dtype=np.int32, count=len(self.adapters))

    @property
    def rates_rps(self) -> np.ndarray:
        """float64 [n_adapters], registration order (nominal; ignored by trace arrivals)."""
        return np.fromiter((a.rate_rps for a in self.adapters), dtype=np.float64, count=len(self.adapters))


class _WorkloadFile(_Frozen):
    """The YAML file as written: adapters may be groups, or come from a CSV."""

    adapters: list[AdapterEntry] | None = None
    adapters_csv: str | None = None
    lengths: LengthsSpec = LengthsSpec()
    arrivals: ArrivalsSpec = PoissonArrivals()
    duration_s: float | None = None

    _lk = field_validator("lengths", mode="before")(_lengths_kind)
    _ak = field_validator("arrivals", mode="before")(_arrivals_kind)
    _nb = field_validator("duration_s", mode="before")(_no_bool)

    @field_validator("adapters")
    @classmethod
    def _non_empty(cls, value: list | None) -> list | None:
        if value is not None and not value:
            raise ValueError("expected at least one adapter")
        return value

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, value: float | None) -> float | None:
        return None if value is None else _finite_positive(value)

    @model_validator(mode="after")
    def _one_source(self) -> _WorkloadFile:
        if (self.adapters is None) == (self.adapters_csv is None):
            raise ValueError("expected exactly one of 'adapters' (a list) or 'adapters_csv' (a path)")
        n = sum(e.count if isinstance(e, AdapterGroup) else 1 for e in self.adapters or ())
        if n > MAX_ADAPTERS:
            raise ValueError(f"{n:,} adapters; expected at most {MAX_ADAPTERS:,} per workload")
        return self


# ---------------------------------------------------------------------------------------------------------
# error formatting


def _loc_str(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields_hint(err: dict, root: type[BaseModel]) -> str:
    """', expected one of: ...' listing the fields allowed where an unknown field was found."""
    loc = err["loc"]
    models: dict[Any, type[BaseModel]] = {
        "adapter": Adapter, "group": AdapterGroup, "poisson": PoissonArrivals, "lognormal": LognormalArrivals,
        "unpredictable": UnpredictableArrivals, "trace": TraceArrivals,
    }
    model = None
    if len(loc) == 1:
        model = root
    elif loc[:-1] == ("lengths",):
        model = LengthsSpec
    elif len(loc) >= 2 and loc[-2] in models:
        model = models[loc[-2]]
    return f"; expected one of: {', '.join(model.model_fields)}" if model is not None else ""


def _error_text(err: dict, root: type[BaseModel]) -> str:
    """One pydantic error as 'what is expected', without newlines."""
    kind = err["type"]
    loc = err["loc"]
    if kind == "missing":
        return f"missing field '{loc[-1]}'" if loc else "missing field"
    if kind == "extra_forbidden":
        return f"unknown field '{loc[-1]}'{_fields_hint(err, root)}"
    if kind == "union_tag_invalid":
        ctx = err.get("ctx", {})
        return f"expected kind one of {ctx.get('expected_tags', '?')} (got {_short(ctx.get('tag'))})"
    if kind == "union_tag_not_found":
        return "expected a mapping with a 'kind' field"
    msg = err["msg"].removeprefix("Value error, ")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = "expected a mapping"
    elif kind == "list_type":
        msg = "expected a list"
    inp = err.get("input")
    if not isinstance(inp, dict | list) and "(got" not in msg:
        msg += f" (got {_short(inp)})"
    return " ".join(msg.split())


def _spec_error(exc: ValidationError, file: str, lines: dict[tuple, int], data: Any,
                root: type[BaseModel], base_line: int = 1) -> SpecError:
    """The first validation error as ``file:line: where: expected ...`` (one line)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = err["loc"]
    key_error = err["type"] in ("extra_forbidden", "missing")
    # Walk the error location through the data; skip pydantic's union tags, which are not data keys.
    path: list = []
    node = data
    line = lines.get((), base_line)
    for j, part in enumerate(loc):
        if key_error and j == len(loc) - 1:
            # the message names the key; point at its own line when it is in the file (unknown keys are)
            line = lines.get((*path, part), line)
            break
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            continue
        path.append(part)
        line = lines.get(tuple(path), line)
    where = _loc_str(tuple(path))
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    prefix = f"{file}:{line}: " + (f"{where}: " if where else "")
    return SpecError(prefix + _error_text(err, root) + more)


# ---------------------------------------------------------------------------------------------------------
# YAML with line numbers


def _yaml_with_lines(text: str, file: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML; also return the 1-based line of every value (keyed by its path of keys / indices)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "syntax error"
        raise SpecError(f"{file}:{line}: malformed YAML: {' '.join(str(problem).split())}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{file}:1: malformed YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()

    lines: dict[tuple, int] = {}

    def walk(n: yaml.Node, path: tuple) -> None:
        lines[path] = n.start_mark.line + 1
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in n.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = key_node.value
                if key in seen:  # PyYAML silently keeps the last one; a repeated key is a mistake
                    raise SpecError(f"{file}:{key_node.start_mark.line + 1}: duplicate key '{key}'")
                seen.add(key)
                walk(value_node, (*path, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                walk(item, (*path, i))

    if node is not None:
        walk(node, ())
    return data, lines


# ---------------------------------------------------------------------------------------------------------
# CSV with line numbers


def iter_csv_rows(path: Path, expected: tuple[str, ...], optional: tuple[str, ...] = (),
                  error: type[Exception] = SpecError) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line, row)`` of a CSV whose header names exactly ``expected`` (+ any of ``optional``).

    Blank lines and lines starting with ``#`` are skipped. Raises ``error`` with ``file:line`` on a wrong
    header, a wrong number of fields or a CSV syntax error.
    """
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: spreadsheet exports start with a BOM
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read file ({' '.join(str(exc).split())})") from None
    want = ",".join(expected) + "".join(f"[,{c}]" for c in optional)
    reader = csv.reader(io.StringIO(text), strict=True)
    header: list[str] | None = None
    try:
        for fields in reader:
            line = reader.line_num
            if not fields or all(not f.strip() for f in fields) or fields[0].lstrip().startswith("#"):
                continue
            fields = [f.strip() for f in fields]
            if header is None:
                names = set(fields)
                if (len(names) != len(fields) or not set(expected) <= names
                        or not names <= set(expected) | set(optional)):
                    raise error(f"{path}:{line}: expected header columns {want}, got {','.join(fields)}")
                header = fields
                continue
            if len(fields) != len(header):
                raise error(f"{path}:{line}: expected {len(header)} fields ({','.join(header)}), got {len(fields)}")
            yield line, dict(zip(header, fields, strict=True))
    except csv.Error as exc:
        raise error(f"{path}:{reader.line_num}: malformed CSV: {' '.join(str(exc).split())}") from None
    if header is None:
        raise error(f"{path}:1: empty file; expected header columns {want}")


def load_adapters_csv(path: str | Path) -> list[Adapter]:
    """Adapters from a CSV ``adapter_id,rank,rate_rps[,path]`` (registration order = row order)."""
    path = Path(path)
    adapters: list[Adapter] = []
    first_line: dict[str, int] = {}
    for line, row in iter_csv_rows(path, ADAPTER_COLUMNS, ADAPTER_OPTIONAL_COLUMNS):
        try:
            adapter = Adapter.model_validate(row)
        except ValidationError as exc:
            raise _spec_error(exc, str(path), {(): line}, row, Adapter, base_line=line) from None
        if adapter.adapter_id in first_line:
            raise SpecError(f"{path}:{line}: adapter_id: duplicate id '{adapter.adapter_id}' (first on line "
                            f"{first_line[adapter.adapter_id]}); expected unique ids")
        first_line[adapter.adapter_id] = line
        adapters.append(adapter)
    if not adapters:
        raise SpecError(f"{path}:2: no adapters; expected at least one row after the header")
    return adapters


# ---------------------------------------------------------------------------------------------------------
# loading


def _resolve(base: Path, value: str) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def validate_yaml_file(path: Path, model: type[BaseModel], expected: str) -> tuple[Any, dict[tuple, int]]:
    """Read a YAML mapping and validate it as ``model``; every problem is a one-line ``SpecError`` with the
    file and line. ``expected`` describes the top level for the "not a mapping" message. Returns
    ``(validated model, line numbers by key path)``."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read file ({' '.join(str(exc).split())})") from None
    data, lines = _yaml_with_lines(text, file)
    if not isinstance(data, dict):
        raise SpecError(f"{file}:{lines.get((), 1)}: expected a mapping with {expected}")
    try:
        return model.model_validate(data), lines
    except ValidationError as exc:
        raise _spec_error(exc, file, lines, data, model) from None


def _load_yaml(path: Path) -> Workload:
    file = str(path)
    spec, lines = validate_yaml_file(
        path, _WorkloadFile, "'adapters' or 'adapters_csv' (and optional lengths, arrivals, duration_s)")

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
    workload = Workload(adapters=adapters, lengths=lengths, arrivals=arrivals, duration_s=spec.duration_s)
    _load_data_files(workload, f"{file}:{lines.get(('lengths',), 1)}")
    return workload


def _check_data_file(path: Path, file: str, line: int, where: str) -> None:
    from .checks import input_file_problem

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
    from .workload.lengths import load_lengths_table  # lazy: the workload package imports this module
    from .workload.trace import load_trace

    if workload.lengths.kind == "empirical":
        assert workload.lengths.path is not None
        load_lengths_table(workload.lengths.path)
    if isinstance(workload.arrivals, TraceArrivals):
        load_trace(workload.arrivals.path)
    if workload.lengths.kind == "lognormal" and not (
        isinstance(workload.arrivals, TraceArrivals) and workload.arrivals.trace_lengths
    ):
        from .workload.lengths import solve_lognormal_lengths

        try:
            solve_lognormal_lengths(
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
        raise SpecError(f"lengths.{_loc_str(err['loc'])}: {_error_text(err, LengthsSpec)}") from None
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
