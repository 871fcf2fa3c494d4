"""Sub-commands added by the knowledge-base, online, evaluation and serving layers."""

from __future__ import annotations

import argparse


def register_commands(sub: argparse._SubParsersAction) -> None:
    return None
