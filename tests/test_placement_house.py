"""Placement's house (issue 26 item 0): one method registry, one objective type, one placement config from which
``lorapack place``'s options come, and no library function with more than 8 parameters."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import numpy as np
import pytest
import typer
from pydantic import BaseModel
from typer.testing import CliRunner

import lorapack
from lorapack.errors import SpecError
from lorapack.objective import Objective
from lorapack.placement import Method, PlaceConfig, place, register
from lorapack.placement.baselines import least_adapters
from lorapack.placement.registry import get_method, method_names, report_baselines, unregister
from placement_helpers import LLAMA, instance, toy_kwargs

MAX_PARAMETERS = 8
# Outside placement and evaluate, functions this change did not convert yet: the count each takes today, a
# ceiling that may only fall (a function converted must leave the list). Not an allowance for new code.
NOT_YET_CONVERTED: dict[str, int] = {}


def _is_record(cls: type) -> bool:
    """A class whose constructor takes its fields (a dataclass, a pydantic model, a named tuple)."""
    return dataclasses.is_dataclass(cls) or issubclass(cls, BaseModel) or hasattr(cls, "_fields")


def _public_functions() -> dict[str, int]:
    """``module.function`` (or ``module.Class.method``) -> parameter count (no self / cls / *args / **kw), for
    every public function and method defined in the library (the CLI's command functions excepted: their
    parameters are its options)."""
    counts: dict[str, int] = {}
    for info in pkgutil.walk_packages(lorapack.__path__, "lorapack."):
        if info.name.startswith("lorapack.cli"):
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            found = []
            if inspect.isfunction(obj):
                found.append((name, obj))
            elif inspect.isclass(obj):
                for attr, f in vars(obj).items():
                    f = f.__func__ if isinstance(f, staticmethod | classmethod) else f
                    generated = attr == "__init__" and _is_record(obj)
                    if inspect.isfunction(f) and (not attr.startswith("_") or attr == "__init__") and not generated:
                        found.append((f"{name}.{attr}", f))
            for qual, f in found:
                params = [p for p in inspect.signature(f).parameters.values() if p.name not in ("self", "cls")
                          and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                counts[f"{mod.__name__}.{qual}"] = len(params)
    return counts


def test_no_library_function_takes_more_than_8_parameters() -> None:
    counts = _public_functions()
    too_many = {f: n for f, n in counts.items() if n > MAX_PARAMETERS and n > NOT_YET_CONVERTED.get(f, 0)}
    assert not too_many, f"functions with more than {MAX_PARAMETERS} parameters: {too_many}"
    done = [f for f in NOT_YET_CONVERTED if counts.get(f, 0) <= MAX_PARAMETERS]
    assert not done, f"converted (or gone): drop them from NOT_YET_CONVERTED: {done}"
    assert counts["lorapack.placement.api.place"] <= 5  # it took 24


@pytest.fixture
def toy_method():
    """A pool method registered for one test: every adapter on the GPU with the fewest so far."""
    m = register(Method("toy-fewest", "pool", "a test's own method", baseline=True, in_demo=True,
                        run=lambda inst, ctx, gpus: least_adapters(inst, gpus)))
    yield m
    unregister(m.name)


def test_a_method_is_added_in_one_place(toy_method) -> None:
    from lorapack.cli.place import place_command
    from lorapack.evaluate.placement_api import PlacementPlacer
    from lorapack.evaluate.placers import check_methods

    # place(): on a given pool and by its own smallest-pool search
    inst = instance(np.full(6, 0.5))
    plan = place(inst, LLAMA, PlaceConfig(method="toy-fewest", gpus=2, objective=Objective.throughput(),
                                          verify=False, workers=1), toy_overrides(5.0))
    assert plan.method == "toy-fewest" and plan.gpus_used == 2
    searched = place(inst, LLAMA, PlaceConfig(method="toy-fewest", objective=Objective.throughput(), workers=1),
                     toy_overrides(5.0))
    assert searched.gpus_used == 1 and searched.diagnostics["search"]["validated_gpus"] == 1
    # lorapack place --help (the command is built from the registry)
    app = typer.Typer()
    app.command("place")(place_command())
    app.command("other")(lambda: None)
    out = CliRunner().invoke(app, ["place", "--help"], env={"COLUMNS": "200"}).stdout
    text = " ".join(out.replace("│", " ").split())
    assert "toy-fewest (a test's own method)" in text
    # evaluate: its method list, its check of names, its report's baselines; the demo's methods
    placer = PlacementPlacer()
    assert "toy-fewest" in placer.methods() and not placer.sizes_itself("toy-fewest")
    check_methods(["toy-fewest"], placer)
    assert report_baselines()[-2:] == ("toy-fewest", "proposed-lat")  # baselines first, then our pool methods
    from lorapack.placement.registry import methods

    assert "toy-fewest" in [m.name for m in methods() if m.in_demo]
    # and gone again
    unregister("toy-fewest")
    assert "toy-fewest" not in method_names()
    with pytest.raises(SpecError, match="--method 'toy-fewest'"):
        PlaceConfig(method="toy-fewest")
    register(toy_method)  # for the fixture's own unregister


def toy_overrides(cap_rps: float):
    from lorapack.placement import OracleOverrides

    kw = toy_kwargs(cap_rps)
    kw.pop("workers")
    return OracleOverrides(**kw)


def test_a_method_is_checked_when_registered() -> None:
    with pytest.raises(SpecError, match="is registered already"):
        register(get_method("dlora"))
    with pytest.raises(SpecError, match="greedy method is its oracle"):
        Method("x", "greedy", "", run=lambda inst, ctx, g: least_adapters(inst, g))
    with pytest.raises(SpecError, match="needs its run function"):
        Method("x", "pool", "")
    with pytest.raises(SpecError, match="oracle 'gpt'"):
        Method("x", "greedy", "", oracle="gpt")


def test_the_place_command_is_generated_from_the_config() -> None:
    from lorapack.cli.place import config_from_options, config_options

    options = config_options()
    fields = [f.name for f in dataclasses.fields(PlaceConfig)]
    limits = list(Objective.keys())
    assert [p.name for p in options] == [n for f in fields for n in ([f, *limits] if f == "objective" else [f])]
    # the command's defaults are the library's
    assert config_from_options({p.name: p.default for p in options}) == PlaceConfig()
    infos = {p.name: p.annotation.__metadata__[0] for p in options}  # typer.Option("--flag", ...): its default
    flags = {name: o.default for name, o in infos.items()}
    assert flags["models_dir"] == "--models" and flags["verify"] == "--verify/--no-verify"
    assert flags["max_ttft_p99_s"] == "--max-ttft-p99-s"


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "best-fit"}, "--method 'best-fit'"),
    ({"gpus": 0}, "--gpus 0"),
    ({"headroom": -1.0}, "--headroom -1.0"),
    ({"verify_seeds": 0}, "--verify-seeds 0"),
    ({"n_max": 0}, "--n-max 0"),
    ({"workers": -1}, "--workers -1"),
    ({"mean_input_tokens": 0.5}, "--mean-input-tokens 0.5"),
    ({"verify_arrivals": "nope.csv"}, "--verify-arrivals nope.csv"),
    ({"models_dir": "nowhere"}, "--models nowhere: not a directory"),
])
def test_a_bad_setting_is_refused_naming_its_flag(kwargs, match) -> None:
    with pytest.raises(SpecError, match=match):
        PlaceConfig(**kwargs)


def test_one_objective_type() -> None:
    from lorapack.evaluate.replay import violations

    assert Objective.of("latency") == Objective() and Objective.of("throughput") == Objective.throughput()
    assert Objective.of("throughput", max_itl_ms=60.0).limits() == {"max_itl_ms": 60.0}
    # a scenario's mapping sets only its own limits
    custom = Objective.limits_only({"max_itl_p99_ms": 80, "max_ttft_s": 3})
    assert custom.limits() == {"max_ttft_s": 3, "max_itl_p99_ms": 80}
    assert custom.label() == "ttft_s3+itl_p99_ms80" and custom.describe() == "mean TTFT <= 3 s, p99 ITL <= 80 ms"
    for bad, match in (({"max_ttf_s": 2}, "unknown field 'max_ttf_s'"), ({"max_itl_ms": -1}, "max_itl_ms: expected"),
                       ({}, "at least one")):
        with pytest.raises(SpecError, match=match):
            Objective.limits_only(bad)

    class Gpu:  # a replayed GPU that completed nothing: every limit it has is broken
        ttft_mean_s = ttft_p99_s = itl_mean_ms = itl_p99_ms = float("nan")

    assert violations(custom, Gpu()) == ["ttft", "itl_p99"]
    assert violations(Objective.throughput(), Gpu()) == []
