"""The newest peers in the same engine: APE as a plugin, and its hyper-parameter sweep as study methods.

``prophetkv`` lives in the package. APE lives here (:mod:`studies.peers.ape`): importing this package
registers ``ape`` (APE's released default T = S = 0.9) through the engine's generic placement hook;
:func:`register` adds the sweep's other settings, ``ape-t{T}-s{S}``, for ``python -m studies.quality_cli``.
"""

from __future__ import annotations

from studies.peers.ape import register_ape

#: APE's search space (its section 4.4: T and S in [0.1, 1.0]), thinned to what a short sweep affords.
TEMPERATURES = (0.5, 0.7, 0.9, 1.0)
SCALES = (0.7, 0.9, 1.0)


def ape_name(temperature: float, scale: float) -> str:
    return f"ape-t{temperature:g}-s{scale:g}"


def register() -> None:
    """Register every sweep setting (idempotent)."""
    for t in TEMPERATURES:
        for s in SCALES:
            register_ape(ape_name(t, s), t, s)


def sweep_methods() -> list[str]:
    return [ape_name(t, s) for t in TEMPERATURES for s in SCALES]
