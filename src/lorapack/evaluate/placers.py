"""Which placement methods ``lorapack evaluate`` runs: the default ``Placer`` (``lorapack.placement``, through
``placement_api``) and the check of method names. Apart from ``methods`` (the ``Placer`` protocol) so that
the protocol does not import its implementation."""

from __future__ import annotations

from ..errors import SpecError
from .methods import Placer


def check_methods(names: list[str] | tuple[str, ...], placer: Placer | None = None) -> None:
    """Raise ``SpecError`` naming the first unknown method."""
    known = (placer or default_placer()).methods()
    for m in names:
        if m not in known:
            raise SpecError(f"unknown method '{m}'; expected one of: {', '.join(known)}")


def default_placer(workers: int = 1) -> Placer:
    """lorapack's placement methods (``lorapack.placement``); ``workers`` processes for their twin runs."""
    try:
        from .placement_api import PlacementPlacer
    except ImportError as exc:  # placement methods not installed in this build
        raise SpecError(f"the placement methods are not available ({exc})") from None
    return PlacementPlacer(workers=workers)
