"""User-facing errors: one hierarchy for every door.

Anything raised as :class:`FusionRAGError` is printed by the CLI as one clear line
(and a non-zero exit status) instead of a traceback: it means "your input or setup
is wrong", not "fusionrag has a bug". Each class also says what it is over HTTP (status,
OpenAI error type and code), which ``fusionrag.serve.api_errors`` reads in one place; a
fault of the server's own files or disk is answered with :meth:`public_message` (no paths)
and its detail goes to the server log.
"""


class FusionRAGError(Exception):
    """An error caused by input, configuration or environment, with a message for the user."""

    exit_code = 2  # the CLI's exit status for it (see EXIT_CODES)
    http_status = 400
    api_type = "invalid_request_error"
    api_code = "invalid_request"
    param: str | None = None
    operator_fault = False  # the server's own data or disk: logged, answered without the message's detail

    def public_message(self) -> str:
        """What an HTTP client is told."""
        return str(self)


class QueueFullError(FusionRAGError):
    """Too many requests are waiting for prefill (the server answers 429)."""

    http_status, api_type, api_code = 429, "rate_limit_error", "queue_full"


class PromptTooLongError(FusionRAGError):
    """The prompt (``S`` + passages + question) is longer than the configured limit."""

    api_code = "context_length_exceeded"


class SchedulerClosedError(FusionRAGError):
    """The scheduler is shutting down or its engine failed to load (the server answers 503)."""

    http_status, api_type, api_code = 503, "server_error", "unavailable"


class RequestCancelledError(FusionRAGError):
    """The request was cancelled (e.g. the client went away) before it finished."""

    http_status, api_code = 499, "cancelled"


class _StoreFault(FusionRAGError):
    """The server's own store cannot be used right now: 503, no file paths in what the client sees."""

    http_status, api_type, api_code = 503, "server_error", "store_unavailable"
    operator_fault = True

    def public_message(self) -> str:
        return ("the knowledge store has a damaged or busy file; the operator has been told (server log); "
                "retry later")


class UnsupportedModelError(FusionRAGError):
    """The model's positional scheme does not allow KV re-positioning by rotation."""


class CacheIntegrityError(_StoreFault):
    """A stored KV cache is corrupted, truncated or belongs to another model/prompt."""

    exit_code = 4


class StoreCorruptedError(_StoreFault):
    """A store file failed its integrity check (the message says which and what to do)."""

    exit_code = 4


class StoreBusyError(_StoreFault):
    """Another process holds the store's writer lock."""

    exit_code = 2


class StoreMismatchError(CacheIntegrityError):
    """The store was built by another model or with another system prompt: a usage error, not damage."""

    exit_code = 2


class StorageError(FusionRAGError):
    """The disk refused: out of space, no permission / read-only, or an I/O error. Nothing is corrupted."""

    exit_code = 3
    http_status, api_type, api_code = 503, "server_error", "storage_io_error"
    operator_fault = True
    what = "the disk reported an I/O error"

    def public_message(self) -> str:
        return f"{self.what}; nothing already stored was lost; the operator has been told (server log)"


class StorageFullError(StorageError):
    """Out of disk space (ENOSPC, or SQLite's "database or disk is full")."""

    http_status, api_code, what = 507, "insufficient_storage", "out of disk space"


class StoragePermissionError(StorageError):
    """Not allowed to write there: permission denied or read-only media."""

    http_status, api_code, what = 409, "store_read_only", "the store cannot be written (read-only or no permission)"


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
