"""``place()``: the one call for a plan -- from scratch (``api.place``), or a re-plan of a previous plan when
``config.previous`` is set (``lorapack.replan.replan``: adapters stay where they are, moves capped by
``config.max_moves``). The re-plan is imported when asked for: it builds on ``api`` (its from-scratch plan is the
comparison), so ``api`` cannot import it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from . import api
from .config import PlaceConfig
from .plan import Plan

if TYPE_CHECKING:
    from ..profile import Profile
    from ..spec import Workload
    from .problem import Instance


def place(adapters: Instance | Workload, profile: Profile, config: PlaceConfig | None = None,
          overrides: api.OracleOverrides | None = None, progress: api.Progress | None = None) -> Plan:
    """``api.place`` (see there), or with ``config.previous`` the re-plan of that plan (docs/replan.md)."""
    if config is None or config.previous is None:
        return api.place(adapters, profile, config, overrides, progress)
    from ..replan.replan import load_previous, replan

    previous = load_previous(config.previous)  # a bad file is refused before any work
    law = config.verify_law(adapters)  # resolved against the workload: the instance carries no arrival law
    config = replace(config, verify_arrivals="poisson" if law is None else law)
    return replan(api.instance_of(adapters, profile, config), profile, config, previous, overrides, progress)
