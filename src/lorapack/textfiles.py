"""Text formats in and out: the files users hand lorapack (YAML, CSV) read with line numbers, pydantic
validation errors as one line naming the file, the line and what was expected (e.g.
``demo.yaml:14: adapters[2].rate_rps: expected a finite number >= 0 (got -1)``), and values made safe for JSON.

A leaf module: it knows no lorapack model. The spec's models live in ``lorapack.spec``; loading a workload
(which uses both) is ``lorapack.workload.files``.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .errors import SpecError

NO_FIELD_MODELS: Mapping[Any, type[BaseModel]] = MappingProxyType({})


# ---------------------------------------------------------------------------------------------------------
# validation errors as one line


def loc_str(loc: tuple) -> str:
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


def _fields_hint(err: dict, root: type[BaseModel], field_models: Mapping[Any, type[BaseModel]]) -> str:
    """', expected one of: ...' listing the fields allowed where an unknown field was found: those of ``root``
    at the top level, else of ``field_models[key]`` for the key (or union tag) just above the unknown field."""
    loc = err["loc"]
    model = None
    if len(loc) == 1:
        model = root
    elif len(loc) >= 2 and loc[-2] in field_models:
        model = field_models[loc[-2]]
    return f"; expected one of: {', '.join(model.model_fields)}" if model is not None else ""


def error_text(err: dict, root: type[BaseModel],
               field_models: Mapping[Any, type[BaseModel]] = NO_FIELD_MODELS) -> str:
    """One pydantic error as 'what is expected', without newlines."""
    kind = err["type"]
    loc = err["loc"]
    if kind == "missing":
        return f"missing field '{loc[-1]}'" if loc else "missing field"
    if kind == "extra_forbidden":
        return f"unknown field '{loc[-1]}'{_fields_hint(err, root, field_models)}"
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


def validation_error(exc: ValidationError, file: str, lines: dict[tuple, int], data: Any, root: type[BaseModel],
                     base_line: int = 1, field_models: Mapping[Any, type[BaseModel]] = NO_FIELD_MODELS) -> SpecError:
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
    where = loc_str(tuple(path))
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    prefix = f"{file}:{line}: " + (f"{where}: " if where else "")
    return SpecError(prefix + error_text(err, root, field_models) + more)


# ---------------------------------------------------------------------------------------------------------
# YAML with line numbers


def yaml_with_lines(text: str, file: str) -> tuple[Any, dict[tuple, int]]:
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


# ---------------------------------------------------------------------------------------------------------
# YAML files validated as a model


def validate_yaml_file(path: Path, model: type[BaseModel], expected: str,
                       field_models: Mapping[Any, type[BaseModel]] = NO_FIELD_MODELS) -> tuple[Any, dict[tuple, int]]:
    """Read a YAML mapping and validate it as ``model``; every problem is a one-line ``SpecError`` with the
    file and line. ``expected`` describes the top level for the "not a mapping" message; ``field_models``
    names the models below the top (``spec.FIELD_MODELS``) for the "expected one of" hint. Returns
    ``(validated model, line numbers by key path)``."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read file ({' '.join(str(exc).split())})") from None
    data, lines = yaml_with_lines(text, file)
    if not isinstance(data, dict):
        raise SpecError(f"{file}:{lines.get((), 1)}: expected a mapping with {expected}")
    try:
        return model.model_validate(data), lines
    except ValidationError as exc:
        raise validation_error(exc, file, lines, data, model, field_models=field_models) from None


# ---------------------------------------------------------------------------------------------------------
# values out: JSON-safe, and numbers for tables


def json_safe(x: Any) -> Any:
    """NaN/inf become null; numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, str):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def fmt(v: Any, digits: int = 1) -> str:
    """A value for a table: numbers with thousands separators, "-" for missing or non-finite ones."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)
