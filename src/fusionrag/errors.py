"""User-facing errors.

Anything raised as :class:`FusionRAGError` is printed by the CLI as one clear line
(and a non-zero exit status) instead of a traceback: it means "your input or setup
is wrong", not "fusionrag has a bug".
"""


class FusionRAGError(Exception):
    """An error caused by input, configuration or environment, with a message for the user."""

    exit_code = 2  # the CLI's exit status for it (see EXIT_CODES)


class UnsupportedModelError(FusionRAGError):
    """The model's positional scheme does not allow KV re-positioning by rotation."""


class CacheIntegrityError(FusionRAGError):
    """A stored KV cache is corrupted, truncated or belongs to another model/prompt."""

    exit_code = 4


class StoreMismatchError(CacheIntegrityError):
    """The store was built by another model or with another system prompt: a usage error, not damage."""

    exit_code = 2


class StorageError(FusionRAGError):
    """The disk refused: out of space, no permission / read-only, or an I/O error. Nothing is corrupted."""

    exit_code = 3


class StorageFullError(StorageError):
    """Out of disk space (ENOSPC, or SQLite's "database or disk is full")."""


class StoragePermissionError(StorageError):
    """Not allowed to write there: permission denied or read-only media."""


class StorageIOError(StorageError):
    """The device failed a read or write (EIO)."""


#: Exit codes of the CLI: what a script can branch on.
EXIT_CODES = {"bad input or state": 2, "storage (space, permission, I/O)": 3, "corrupted store": 4,
              "interrupted": 130}


def exit_code(exc: FusionRAGError) -> int:
    """2 for bad input or state, 3 for a storage fault, 4 for a store that failed an integrity check."""
    return int(getattr(exc, "exit_code", 2))


def storage_error(exc: OSError, what: str) -> StorageError:
    """The :class:`StorageError` an ``OSError`` stands for, with a message that says what to do.

    ``what`` names the operation ("writing the KV of chunk 5 to /kb/kv/...")."""
    import errno

    path = exc.filename or ""
    where = f" ({path})" if path and str(path) not in what else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"out of disk space while {what}{where}: nothing already written was lost; free some "
                                "space and run the same command again (it resumes where it stopped)")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "the file system is read-only" if exc.errno == errno.EROFS else "permission denied"
        return StoragePermissionError(f"cannot write while {what}{where}: {why}; commands that only read "
                                      "(ask, store info, store verify, serve) still work")
    return StorageIOError(f"I/O error while {what}{where}: {exc.strerror or exc}; the disk or its driver "
                          "reported a failure (check it, then run 'fusionrag store verify')")
