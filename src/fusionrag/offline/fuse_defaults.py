"""The offline stage's default settings, without importing torch (the command line's help reads them)."""

from __future__ import annotations

NEIGHBOUR_ORDERS = ("nearest_last", "nearest_first")
#: Measured on TriviaQA (decision 005): the most similar neighbour first, right after S.
DEFAULT_NEIGHBOUR_ORDER = "nearest_first"
DEFAULT_TOP_N = 10
