"""The safetensors file format, read by hand: a header's tensors checked against the
file, and one tensor read into an aligned buffer.

`pagedjax.weights` loads HF checkpoints with these, one tensor at a time (its docstring
says why no file is memory mapped), and `pagedjax.lora_adapter` reads PEFT adapters; this module
imports neither jax nor the model, so reading an adapter's header stays light.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np

__all__ = ["DTYPES", "TensorInfo", "read_header", "read_tensor"]

DTYPES = {  # the floating-point dtypes read into arrays; the others are refused by name
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
}
_ITEMSIZE = {  # every safetensors dtype, so that byte ranges of refused ones check too
    **{k: 1 for k in ("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2")},
    **{k: 2 for k in ("I16", "U16", "F16", "BF16")},
    **{k: 4 for k in ("I32", "U32", "F32")},
    **{k: 8 for k in ("I64", "U64", "F64")},
}
LFS_POINTER = b"version https://git-lfs"  # a git-lfs pointer file starts so
_MAX_HEADER = 100_000_000  # bytes; safetensors' own limit (MAX_HEADER_SIZE)
_ALIGN = 64  # XLA's CPU buffer alignment: an aligned numpy array becomes a jax.Array uncopied


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    stop: int


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor names -> info from a safetensors header (8-byte length, JSON, data).

    Checks what safetensors itself checks on opening, before any tensor is read: the
    header is at most `_MAX_HEADER` bytes, every entry has a string dtype, non-negative
    integer dims and two data offsets, every byte range fits its dtype and shape, and the
    ranges cover the data exactly, back to back (no tensor reads another's bytes, and a
    download cut short fails here).
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if (head + f.read(len(LFS_POINTER) - 8)).startswith(LFS_POINTER):
            raise ValueError(
                f"{file.name} is a git-lfs pointer, not the weights: fetch them with "
                "`git lfs pull` (or download the checkpoint with huggingface-cli)"
            )
        try:
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header length {n} > the file's {size - 8} bytes after it")
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} > safetensors' limit of {_MAX_HEADER}")
            f.seek(8)
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
            infos = {
                name: _entry(name, v, file, 8 + n)
                for name, v in header.items()
                if name != "__metadata__"
            }
        except (struct.error, ValueError, RecursionError) as e:
            raise ValueError(f"{file.name} is not a valid safetensors file ({e})") from None
    for info in infos.values():
        nbytes = math.prod(info.shape) * _ITEMSIZE.get(info.dtype, 0)
        if info.stop < info.start or (info.dtype in _ITEMSIZE and info.stop - info.start != nbytes):
            raise ValueError(
                f"{file.name} is corrupt: {info.name}: its header gives "
                f"{info.stop - info.start} bytes for {info.dtype} {list(info.shape)}, "
                f"which takes {nbytes}"
            )
    end, before = 8 + n, "the header"
    for info in sorted(infos.values(), key=lambda i: (i.start, i.stop)):
        if info.start != end:
            where = (
                f"overlaps {before}'s bytes"
                if info.start < end
                else f"starts {info.start - end} bytes after {before} ends"
            )
            raise ValueError(
                f"{file.name} is corrupt: {info.name}: its byte range "
                f"[{info.start - 8 - n}, {info.stop - 8 - n}) {where}"
            )
        end, before = info.stop, info.name
    if end > size:
        raise ValueError(
            f"{file.name} is truncated: its header needs {end} bytes, the file has {size} "
            "(an interrupted download? download it again)"
        )
    if end < size:
        raise ValueError(f"{file.name} is corrupt: {size - end} bytes after its last tensor")
    return infos


def _entry(name: str, v, file: Path, data_start: int) -> TensorInfo:
    """One header entry as a `TensorInfo`; a ValueError naming the tensor if malformed."""
    shape, offsets = (v.get(k) if isinstance(v, dict) else None for k in ("shape", "data_offsets"))
    if not (
        isinstance(v, dict)
        and isinstance(v.get("dtype"), str)
        and isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int and o >= 0 for o in offsets)
    ):
        raise ValueError(
            f"{name}: expected a dtype string, a shape and two data_offsets of "
            f"non-negative integers, got {json.dumps(v)[:200]}"
        )
    return TensorInfo(
        name, file, v["dtype"], tuple(shape), data_start + offsets[0], data_start + offsets[1]
    )


def read_tensor(f: BinaryIO, info: TensorInfo) -> np.ndarray:
    """Reads one tensor from its header byte range in `f` (its file) into a new array.

    The buffer is `_ALIGN`-byte aligned: JAX's CPU client then makes the array a device
    array without copying it, so on the CPU a loaded tensor is never held twice.
    """
    nbytes = info.stop - info.start
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    buf = raw[start : start + nbytes]
    f.seek(info.start)
    got = f.readinto(memoryview(buf))
    if got != nbytes:  # the header check passed, so the file changed since
        raise ValueError(f"{info.file.name}: {info.name}: read {got} of {nbytes} bytes")
    return buf.view(DTYPES[info.dtype]).reshape(info.shape)
