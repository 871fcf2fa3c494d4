"""The ``fusionrag`` command line: a thin layer over the Python API.

Every error is one line on stderr and an exit code, never a traceback (``--debug`` adds it):
2 bad input or state, 3 a storage fault (out of space, permission or read-only, I/O error),
4 a store that failed an integrity check, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

from fusionrag.errors import FusionRAGError, exit_code, storage_error
from fusionrag.models.options import DEFAULT_MODEL, KNOWN_NAMES, add_device_args

MODEL_HELP = f"short name ({', '.join(KNOWN_NAMES)}) or a local HF checkpoint folder; default {DEFAULT_MODEL}"


def _cmd_doctor(args: argparse.Namespace) -> int:
    from fusionrag.doctor import run_checks
    from fusionrag.models.options import device_options

    report = run_checks(args.model, **device_options(args))
    if args.table:
        from fusionrag.models.family_report import table

        print(table(report))
    else:
        print(json.dumps(report, indent=None if args.compact else 2))
    return 0 if report["ok"] else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from fusionrag.demo import run_demo
    from fusionrag.models.options import device_options

    run_demo(model=args.model, max_new_tokens=args.max_new_tokens, limit=args.limit, **device_options(args))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fusionrag")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusionrag",
        description="Fast RAG prefill by reusing precomputed, similarity-fused chunk KV caches.",
    )
    parser.add_argument("--version", action="version", version=f"fusionrag {_version()}")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    parser.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="check the exactness invariants on a real model, in float32 and in the compute "
                                          "dtype auto chooses (JSON report)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--compact", action="store_true", help="print the JSON on one line")
    p.add_argument("--table", action="store_true", help="print one readable table (the family, each check per dtype)")
    add_device_args(p)
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("demo", help="answer the bundled sample questions, Full Attention vs reuse, with TTFT")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--limit", type=int, default=None, help="only the first N sample questions")
    add_device_args(p)
    p.set_defaults(func=_cmd_demo)

    from fusionrag.cli_commands import register_commands

    register_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Nothing heavy (torch, transformers) is imported here: each command imports what it needs after its
    # checks, so --help, --version and a wrong argument or store answer at once.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Loading weights" bars: noise; ours stay
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        return func(args)
    except FusionRAGError as exc:
        return _fail(args, exc)
    except BrokenPipeError:  # the reader of our output went away (`fusionrag documents | head -1`): as other CLIs
        return _quiet_broken_pipe()
    except OSError as exc:  # a disk fault no layer named: still one line, with what it is
        return _fail(args, storage_error(exc, f"running 'fusionrag {args.command}'"), exc)
    except sqlite3.Error as exc:  # the store's SQLite refused: space, permission, I/O or a damaged file
        from fusionrag.retrieval.store_files import sqlite_fault

        return _fail(args, sqlite_fault(exc, Path(getattr(args, "store", None) or "store.sqlite"),
                                        f"running 'fusionrag {args.command}'"), exc)
    except KeyboardInterrupt:
        print("fusionrag: interrupted", file=sys.stderr)
        return 130


def _quiet_broken_pipe() -> int:
    """Stop without a word when stdout's reader closed the pipe (not a disk fault): stdout is pointed at
    /dev/null so the interpreter's final flush cannot fail again; exit 141 (128 + SIGPIPE), as a shell's."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def _fail(args: argparse.Namespace, exc: FusionRAGError, cause: BaseException | None = None) -> int:
    """One line on stderr and the documented exit code (``--debug``: the traceback too)."""
    if getattr(args, "debug", False):
        import traceback

        traceback.print_exception(cause or exc)
    print(f"fusionrag: error: {exc}", file=sys.stderr)
    return exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
