"""On-disk KV entries: one safetensors file per (chunk, kind), verified on every load.

A reused cache that silently belongs to another model, another system prompt or other
tokens gives wrong answers with no error, so every entry carries in its header the
model fingerprint, the system-prompt hash, the sha256 of its token ids, its base
position and dtype, and a checksum over the tensor bytes *and* that metadata. Loading
checks all of them and raises :class:`CacheIntegrityError` (never returns a doubtful
cache). Files are written to a temp file in the same folder, fsynced, then renamed over
the final name, so an interrupted write leaves either the old entry or none.

Tensors: ``keys``/``values`` ``[L, H, T, D]`` (as :class:`~fusionrag.kvcache.kv.KV`) in the
storage dtype (fp16 halves the disk and memory; re-rotation always happens in fp32 in
``KV.moved_to`` / ``assemble``), and optionally ``scores`` ``[T]`` fp32. No pickles.

int8 entries (``dtype`` int8, :mod:`fusionrag.kvcache.quant`) store int8 codes plus
``key_scales``/``value_scales`` and record the scheme in the header (``quant``); they use
their own ``format`` string, so a reader that predates int8 refuses them instead of reading
codes as KV. Loading dequantises them to fp16; the checksum covers codes and scales alike.
The entry's bytes are self-verifying, which is what lets a shared tier (Redis) hold the same
bytes as the disk: :func:`decode_entry` checks them wherever they came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fusionrag.errors import CacheIntegrityError, FusionRAGError
from fusionrag.files import atomic_write, remove_temp_files
from fusionrag.kvcache.kv import KV
from fusionrag.kvcache.quant import INT8_SCHEME, check_int8, dequantize_kv, quantize_kv
from fusionrag.kvcache.storage_dtypes import DEFAULT_KV_DTYPE as DEFAULT_KV_DTYPE  # re-exported
from fusionrag.kvcache.storage_dtypes import STORAGE_DTYPES as STORAGE_DTYPES  # re-exported
from fusionrag.models.fingerprint import same_weights

FORMAT = "fusionrag-kv/1"
FORMAT_INT8 = "fusionrag-kv/1+int8"
FORMATS = (FORMAT, FORMAT_INT8)
KINDS = ("plain", "fused", "system")
CHUNK_KINDS = ("plain", "fused")
DTYPES = {"float16": torch.float16, "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32,
          "int8": torch.int8}
_MAX_HEADER = 16 << 20
#: The largest entry a store reads (header and tensors). A 4K-token chunk of a 7B-class model in fp32
#: is ~2 GiB of KV; anything claiming more is refused before a byte of it is read.
MAX_ENTRY_BYTES = 4 << 30


def _entry_file(path: Path, what: str, max_bytes: int = MAX_ENTRY_BYTES) -> tuple[int, bytes]:
    """``(file size, header bytes)`` of an entry file, checked before its tensors are read.

    Only a regular file (not a symlink, FIFO or device: opening a FIFO would block forever) whose
    size equals what its header describes, within ``max_bytes``, is read; anything else raises
    :class:`CacheIntegrityError` without reading the rest, so memory stays bounded."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CacheIntegrityError(f"{what} is missing ({path})") from None
    except OSError as exc:
        raise CacheIntegrityError(f"{what}: cannot read {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CacheIntegrityError(f"{what}: {path} is not a regular file (a link, FIFO or device); not read")
    if st.st_size < 8:
        raise CacheIntegrityError(f"{what}: {path} is truncated or corrupted ({st.st_size} bytes)")
    if st.st_size > max_bytes:
        raise CacheIntegrityError(f"{what}: {path} has {st.st_size} bytes, more than an entry can be; not read")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(_MAX_HEADER, st.st_size - 8):
                raise CacheIntegrityError(f"{what}: {path} is truncated or corrupted (header length {n})")
            header = f.read(n)
    except OSError as exc:
        raise CacheIntegrityError(f"{what}: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        tensors = json.loads(header)
        end = max((int(v["data_offsets"][1]) for k, v in tensors.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CacheIntegrityError(f"{what}: {path} is truncated or corrupted (unreadable header)") from None
    if 8 + n + end != st.st_size:
        raise CacheIntegrityError(f"{what}: {path} is truncated or corrupted ({st.st_size} bytes, its header "
                                  f"describes {8 + n + end})")
    return st.st_size, head + header


def canonical_dtype(name: str) -> str:
    """``float16``, ``float32`` or ``int8`` (accepting ``fp16``/``fp32``); anything else is a user error."""
    if name not in DTYPES:
        raise FusionRAGError(f"unsupported KV storage dtype '{name}' (choose float16, float32 or int8)")
    return str(DTYPES[name]).removeprefix("torch.")


def tokens_hash(token_ids) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in token_ids]).encode()).hexdigest()


@dataclass
class KVEntry:
    kv: KV
    scores: torch.Tensor | None
    metadata: dict[str, str]
    #: Set on an int8 entry read as stored (``dequantize=False``): ``kv`` then holds the int8 codes and these
    #: the fp16 key / value scales, half an fp16 entry's bytes (a host tier under the GPU tier keeps them so);
    #: :meth:`dequantized` makes it usable, on whatever device it is by then.
    scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Memory held (what a memory tier budgets)."""
        extra = [t for t in (self.scores, *(self.scales or ())) if t is not None]
        return self.kv.nbytes + sum(t.numel() * t.element_size() for t in extra)

    def dequantized(self) -> KVEntry:
        """The entry with fp16 KV (itself unless it holds int8 codes)."""
        if self.scales is None:
            return self
        keys, values = dequantize_kv({"keys": self.kv.keys, "values": self.kv.values,
                                      "key_scales": self.scales[0], "value_scales": self.scales[1]})
        return KVEntry(replace(self.kv, keys=keys, values=values), self.scores, self.metadata)

    @property
    def extra(self) -> dict[str, Any]:
        return json.loads(self.metadata.get("extra", "{}"))


#: A chunk entry's file name: ``<chunk id>.<kind>.safetensors``.
ENTRY_NAME = re.compile(r"(\d+)\.(plain|fused)\.safetensors")


class KVStore:
    """The ``kv/`` folder of a knowledge base, bound to one model and one system prompt."""

    def __init__(self, root: Path, fingerprint: str, system_hash: str, dtype: str = "float16") -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.system_hash = system_hash
        self.dtype = canonical_dtype(dtype)

    # ------------------------------------------------------------ layout

    def path(self, chunk_id: int | None, kind: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown KV kind '{kind}' (one of {', '.join(KINDS)})")
        if kind == "system":
            return self.root / "system.safetensors"
        # Sharded folders keep directory listings short for large corpora.
        return self.root / f"{int(chunk_id) // 1000:05d}" / f"{int(chunk_id)}.{kind}.safetensors"

    def exists(self, chunk_id: int | None, kind: str) -> bool:
        """Whether a regular file is there (a link, FIFO or device is not an entry; not verified)."""
        try:
            return stat.S_ISREG(os.lstat(self.path(chunk_id, kind)).st_mode)
        except OSError:
            return False

    def entries(self, kind: str) -> list[Path]:
        return sorted(self.root.glob(f"*/*.{kind}.safetensors")) if self.root.is_dir() else []

    def orphans(self, chunk_ids: set[int]) -> list[Path]:
        """Entry files of chunks not in ``chunk_ids`` (a removal killed between its commit and its unlinks)."""
        if not self.root.is_dir():
            return []
        return [p for p in sorted(self.root.glob("*/*.safetensors"))
                if (m := ENTRY_NAME.fullmatch(p.name)) and int(m[1]) not in chunk_ids]

    def remove_temp_files(self) -> int:
        """Delete temp files left by an interrupted writer (never valid entries)."""
        return remove_temp_files(self.root)

    # ------------------------------------------------------------ write

    def save(self, chunk_id: int | None, kind: str, kv: KV, token_ids, scores: torch.Tensor | None = None,
             extra: dict[str, Any] | None = None, dtype: str | None = None) -> Path:
        """Write one entry atomically (temp file, fsync, rename)."""
        if len(kv) != len(token_ids):
            raise ValueError(f"KV has {len(kv)} tokens but {len(token_ids)} token ids were given")
        dtype = canonical_dtype(dtype or self.dtype)
        if dtype == "int8":
            for name, t in (("keys", kv.keys), ("values", kv.values)):
                if not torch.isfinite(t).all():
                    raise FusionRAGError(f"chunk {chunk_id}: KV {name} are not finite")
            tensors = quantize_kv(kv.keys, kv.values)
        else:
            tdtype = DTYPES[dtype]
            tensors = {
                "keys": kv.keys.detach().to(tdtype).contiguous(),
                "values": kv.values.detach().to(tdtype).contiguous(),
            }
            for name in ("keys", "values"):
                if not torch.isfinite(tensors[name]).all():
                    raise FusionRAGError(
                        f"chunk {chunk_id}: KV {name} are not finite in {dtype} (values beyond the fp16 range?); "
                        "store this knowledge base with kv dtype float32"
                    )
        if scores is not None:
            tensors["scores"] = scores.detach().to(torch.float32).reshape(-1).contiguous()
            if tensors["scores"].numel() != len(kv):
                raise ValueError(f"{tensors['scores'].numel()} scores for {len(kv)} tokens")
        meta = {
            "format": FORMAT_INT8 if dtype == "int8" else FORMAT,
            "kind": kind,
            "chunk_id": "" if chunk_id is None else str(int(chunk_id)),
            "fingerprint": self.fingerprint,
            "system_hash": self.system_hash,
            "tokens_sha256": tokens_hash(token_ids),
            "n_tokens": str(len(kv)),
            "base_position": str(int(kv.base_position)),
            "dtype": dtype,
            "extra": json.dumps(extra or {}, sort_keys=True),
        }
        if dtype == "int8":
            meta["quant"] = INT8_SCHEME
        meta["checksum"] = _checksum(tensors, meta)
        data = st_save(tensors, metadata=meta)
        path = self.path(chunk_id, kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
        return path

    def remove(self, chunk_id: int, kind: str) -> bool:
        """Delete one entry (e.g. plain KV of a fused-only store); whether it existed."""
        path = self.path(chunk_id, kind)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        return existed

    # ------------------------------------------------------------ read

    def header(self, chunk_id: int | None, kind: str) -> dict[str, str] | None:
        """The entry's metadata without reading its tensors (``None`` if absent or unreadable).

        Cheap enough for resume checks; not a verification (use :meth:`load` for that).
        """
        path = self.path(chunk_id, kind)
        try:
            _, head = _entry_file(path, _what(chunk_id, kind))
            meta = json.loads(head[8:]).get("__metadata__")
        except (CacheIntegrityError, ValueError, AttributeError):
            return None
        return meta if isinstance(meta, dict) else None

    def read_bytes(self, chunk_id: int | None, kind: str) -> bytes:
        """The entry's file as stored (what a shared tier copies); :class:`CacheIntegrityError` if unreadable."""
        path = self.path(chunk_id, kind)
        size, _ = _entry_file(path, _what(chunk_id, kind))  # what it is and how big, before reading it
        try:
            with open(path, "rb") as f:
                data = f.read(size + 1)
        except OSError as exc:
            raise CacheIntegrityError(f"{_what(chunk_id, kind)}: cannot read {path}: {exc.strerror or exc}") from exc
        if len(data) != size:
            raise CacheIntegrityError(f"{_what(chunk_id, kind)}: {path} changed size while it was read")
        return data

    def load(self, chunk_id: int | None, kind: str, token_ids=None, dequantize: bool = True) -> KVEntry:
        """Read and verify one entry; :class:`CacheIntegrityError` says what is wrong. ``dequantize=False``
        keeps an int8 entry's codes and scales (:attr:`KVEntry.scales`)."""
        data = self.read_bytes(chunk_id, kind)
        return self.decode(data, chunk_id, kind, token_ids, where=str(self.path(chunk_id, kind)),
                           dequantize=dequantize)

    def decode(self, data: bytes, chunk_id: int | None, kind: str, token_ids=None, where: str = "",
               dequantize: bool = True) -> KVEntry:
        """Verify an entry's bytes (from disk or a shared tier) against this store's model, ``S`` and tokens."""
        return decode_entry(data, chunk_id, kind, self.fingerprint, self.system_hash, token_ids, where, dequantize)


def _what(chunk_id: int | None, kind: str) -> str:
    return "system prompt KV" if kind == "system" else f"{kind} KV of chunk {chunk_id}"


def decode_entry(data: bytes, chunk_id: int | None, kind: str, fingerprint: str, system_hash: str,
                 token_ids=None, where: str = "", dequantize: bool = True) -> KVEntry:
    """Parse and verify one entry's bytes; :class:`CacheIntegrityError` says what is wrong.

    Checks, in order: safetensors framing, format, checksum (tensors and metadata), model
    fingerprint, ``S`` hash, token hash, kind/chunk id, shape. int8 entries are dequantised
    to fp16 after verification (``dequantize=False``: kept as codes and scales, checked for shape).
    """
    what, path = _what(chunk_id, kind), where or "<bytes>"
    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 or n <= 0 or n > min(_MAX_HEADER, len(data) - 8):
            raise ValueError("header length out of range")
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        tensors = st_load(data)
    except (SafetensorError, ValueError, AttributeError, RuntimeError) as exc:
        raise CacheIntegrityError(
            f"{what} is truncated or corrupted ({path}: {exc}); delete it and re-run ingest/preprocess"
        ) from exc
    if meta.get("format") not in FORMATS or "keys" not in tensors or "values" not in tensors:
        raise CacheIntegrityError(f"{what}: {path} is not a fusionrag KV entry")
    if _checksum(tensors, meta) != meta.get("checksum"):
        raise CacheIntegrityError(
            f"{what}: checksum mismatch in {path} (the file was corrupted or modified); "
            "delete it and re-run ingest/preprocess"
        )
    if not same_weights(str(meta.get("fingerprint")), fingerprint):  # the compute dtype may differ (decision 052)
        raise CacheIntegrityError(
            f"{what} was computed by model {meta.get('fingerprint')}, not by the loaded model "
            f"{fingerprint}; refusing to reuse it"
        )
    if meta.get("system_hash") != system_hash:
        raise CacheIntegrityError(
            f"{what} was computed after another system prompt ({meta.get('system_hash')} != "
            f"{system_hash}); refusing to reuse it"
        )
    if token_ids is not None and meta.get("tokens_sha256") != tokens_hash(token_ids):
        raise CacheIntegrityError(f"{what} was computed for other tokens than the chunk's; refusing to reuse it")
    if meta.get("kind") != kind or (chunk_id is not None and meta.get("chunk_id") != str(int(chunk_id))):
        raise CacheIntegrityError(f"{what}: {path} holds {meta.get('kind')} KV of chunk {meta.get('chunk_id')}")
    scales = None
    try:
        if meta["format"] == FORMAT_INT8:
            if meta.get("quant") != INT8_SCHEME:
                raise ValueError(f"unknown int8 scheme {meta.get('quant')!r}")
            if dequantize:
                keys, values = dequantize_kv(tensors)
            else:
                check_int8(tensors)
                keys, values, scales = tensors["keys"], tensors["values"], (tensors["key_scales"],
                                                                           tensors["value_scales"])
        else:
            keys, values = tensors["keys"], tensors["values"]
        kv = KV(keys, values, int(meta["base_position"]))
    except (ValueError, KeyError) as exc:
        raise CacheIntegrityError(f"{what}: malformed entry {path}: {exc}") from exc
    if str(len(kv)) != meta.get("n_tokens"):
        raise CacheIntegrityError(f"{what}: {path} has {len(kv)} tokens, header says {meta.get('n_tokens')}")
    return KVEntry(kv, tensors.get("scores"), meta, scales)


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 over the tensor bytes (in a fixed order) and every metadata field but itself."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype!s}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())  # buffer protocol: no copy
    h.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    return h.hexdigest()

