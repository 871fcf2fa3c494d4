"""The reuse methods a request can name, one registry for every door (CLI, server, Python, bench).

A method is ``full`` (Full Attention), ``reuse`` (Full Reuse), a selection policy, or a placement
(:func:`register_placement`: the chunks laid out by the method's own function instead of
:func:`~fusionrag.kvcache.kv.assemble`, nothing recomputed). Each
policy has a default KV kind, the stored KV it reuses unless a request says otherwise, so
``fusionrag`` means the same thing in ``ask``, ``serve``, :class:`~fusionrag.Engine` and
``bench``: query-guided selection on fused KV with the prompt's first chunk plain
(``plain-first``; right after ``S`` a chunk's plain KV is exactly Full Attention's, and it
measured closer to Full Attention: ``docs/decisions/``).

The product offers ``full``, ``reuse``, ``fusionrag`` and the published baselines
(``cacheblend``, ``cachecraft``, ``epic``, ``prophetkv``). Research variants (other scorings, controls, other
placements) register themselves with :func:`register_policy` / :func:`register_placement` from outside the
package (``studies/``);
they are usable through the Python API and ``bench quality`` once registered, and never
shown by the product's CLI or server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from fusionrag.errors import FusionRAGError

if TYPE_CHECKING:  # the registry itself imports no torch: the command line lists the methods before any loads
    from fusionrag.kvcache.kv import Placement
    from fusionrag.online.policies import Policy

#: Stored KV a request can reuse: plain (each chunk after ``S`` alone), fused (after its nearest
#: chunks, offline), or fused except the prompt's first chunk, which reads its plain KV.
KVKind = Literal["plain", "fused", "plain-first"]
KV_KINDS: tuple[str, ...] = get_args(KVKind)
Kind = Literal["product", "baseline", "study"]


@dataclass(frozen=True)
class MethodInfo:
    """What a method name means: how to build its policy and which KV it reuses by default."""

    name: str
    factory: Callable[[], Policy] | None  # None: full / reuse / auto / a placement (no selection)
    kv: str  # default KV kind ("none" for Full Attention)
    kind: Kind
    reads_stored_scores: bool = False  # Cache-Craft: scores recorded with the fused KV
    description: str = ""
    #: Lays the chunks out instead of ``assemble`` (called as it is); no selection (see :func:`register_placement`).
    placement: Placement | None = None

    @property
    def recomputes_nothing(self) -> bool:
        """Full Reuse and a placement: ratio 0 whatever a request says."""
        return self.name == "reuse" or self.placement is not None


_REGISTRY: dict[str, MethodInfo] = {}


def _register(info: MethodInfo) -> MethodInfo:
    if info.kv not in KV_KINDS:
        raise FusionRAGError(f"kv must be one of {', '.join(KV_KINDS)}, got {info.kv!r}")
    if info.name in ("full", "reuse", "auto"):
        raise FusionRAGError(f"'{info.name}' is built in and cannot be replaced")
    _REGISTRY[info.name] = info
    return info


def register_policy(name: str, factory: Callable[[], Policy], *, kv: str = "plain", kind: Kind = "study",
                    reads_stored_scores: bool = False, description: str = "") -> MethodInfo:
    """Make ``name`` a method every door accepts (``Engine.prepare(method=name)``, ``bench quality``).

    ``factory()`` returns a fresh policy (an object with ``scores(SelectionInput)``); ``kv`` is the
    KV kind it reuses by default. Registering a name again replaces it (a study re-run in one process)."""
    return _register(MethodInfo(name, factory, kv, kind, reads_stored_scores, description))


def register_placement(name: str, placement: Placement, *, kv: str = "plain", kind: Kind = "study",
                       description: str = "") -> MethodInfo:
    """Make ``name`` a method that lays a prompt's chunks out with ``placement`` and recomputes nothing.

    ``placement(prefix, chunks, inv_freq, device=, dtype=)`` is called as
    :func:`~fusionrag.kvcache.kv.assemble` is and returns what it returns: the prompt's ``S`` + chunks KV
    (slot ``i`` = the ``i``-th token, whatever position its keys were rotated to) and each chunk's span.
    The KV may carry a :class:`~fusionrag.kvcache.kv.ReadRule`: every later token of the prompt (the
    question, teacher forcing, decoding) then reads it through that rule. Such a context is read as
    stored (ratio 0) and is not kept by the whole-context cache. Registering a name again replaces it."""
    return _register(MethodInfo(name, None, kv, kind, description=description, placement=placement))


def _builtin(cls: str) -> Callable[[], Policy]:
    """A factory of the policy class ``cls`` of :mod:`fusionrag.online.policies`, imported when first called."""

    def make() -> Policy:
        from fusionrag.online import policies

        return getattr(policies, cls)()

    make.__qualname__ = make.__name__ = cls
    return make


_REGISTRY["full"] = MethodInfo("full", None, "none", "product", description="Full Attention (recompute everything)")
_REGISTRY["reuse"] = MethodInfo("reuse", None, "plain", "product", description="Full Reuse (recompute nothing)")
register_policy("fusionrag", _builtin("QueryGuided"), kv="plain-first", kind="product",
                description="FusionRAG: query-guided selection on fused KV")
#: Chosen per request by the engine (``fusionrag.online.auto``): ``fusionrag`` from the context length
#: where reuse pays, ``full`` below it. Not a policy: it never reaches ``make_policy``.
_REGISTRY["auto"] = MethodInfo("auto", None, "plain-first", "product",
                               description="fusionrag where reuse pays (long contexts), full below that")
register_policy("cacheblend", _builtin("CacheBlend"), kind="baseline",
                description="baseline: CacheBlend (layer-1 KV deviation)")
register_policy("cachecraft", _builtin("CacheCraft"), kind="baseline", reads_stored_scores=True,
                description="baseline: Cache-Craft (stored inter-chunk attention)")
register_policy("epic", _builtin("Epic"), kind="baseline", description="baseline: EPIC (each chunk's first tokens)")
register_policy("prophetkv", _builtin("ProphetKV"), kind="baseline",
                description="baseline: ProphetKV (the question's attention over the context, every layer)")


def method_info(name: str) -> MethodInfo:
    """The registered method ``name``, or a one-line error listing the choices."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise FusionRAGError(f"unknown method '{name}'; choose one of: {', '.join(methods())}") from None


def methods(*kinds: Kind) -> list[str]:
    """Registered method names (of these kinds; default: the product's and the baselines')."""
    wanted = set(kinds or ("product", "baseline"))
    return [n for n, info in _REGISTRY.items() if info.kind in wanted]


def all_methods() -> list[str]:
    """Every registered name, study variants included."""
    return list(_REGISTRY)


def make_policy(method: str) -> Policy:
    """A fresh policy object for a selection method."""
    info = method_info(method)
    if info.factory is None:
        raise FusionRAGError(f"'{method}' selects nothing (it is not a selection policy)")
    return info.factory()


def default_kv(method: str) -> str:
    """The KV kind ``method`` reuses unless a request names one."""
    return method_info(method).kv


def reads_store(method: str, kv: str) -> bool:
    """Whether a method's result depends on the store's offline stage (fused KV or stored scores).

    Plain KV is a function of the chunk alone; fused KV and Cache-Craft's scores depend on its neighbours."""
    info = _REGISTRY.get(method)  # records of methods no longer registered are still read
    return kv in ("fused", "plain-first") or (info.reads_stored_scores if info else method == "cachecraft")
