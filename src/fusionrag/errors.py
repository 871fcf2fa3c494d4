"""User-facing errors.

Anything raised as :class:`FusionRAGError` is printed by the CLI as one clear line
(and a non-zero exit status) instead of a traceback: it means "your input or setup
is wrong", not "fusionrag has a bug".
"""


class FusionRAGError(Exception):
    """An error caused by input, configuration or environment, with a message for the user."""


class UnsupportedModelError(FusionRAGError):
    """The model's positional scheme does not allow KV re-positioning by rotation."""


class CacheIntegrityError(FusionRAGError):
    """A stored KV cache is corrupted, truncated or belongs to another model/prompt."""
