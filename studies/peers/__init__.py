"""The newest peers in the same engine: APE's hyper-parameter sweep, registered as study methods.

``ape`` (the product's baseline, APE's released default T = S = 0.9) and ``prophetkv`` live in the
package; this registers the sweep's other settings, ``ape-t{T}-s{S}``, for ``python -m studies.quality_cli``.
"""

from __future__ import annotations

from fusionrag.online.methods import register_parallel

#: APE's search space (its section 4.4: T and S in [0.1, 1.0]), thinned to what a short sweep affords.
TEMPERATURES = (0.5, 0.7, 0.9, 1.0)
SCALES = (0.7, 0.9, 1.0)


def ape_name(temperature: float, scale: float) -> str:
    return f"ape-t{temperature:g}-s{scale:g}"


def register() -> None:
    """Register every sweep setting (idempotent)."""
    for t in TEMPERATURES:
        for s in SCALES:
            register_parallel(ape_name(t, s), t, s, description=f"APE with temperature {t}, scale {s}")


def sweep_methods() -> list[str]:
    return [ape_name(t, s) for t in TEMPERATURES for s in SCALES]
