"""KV cache capacity: the formula, and how many sequences fit in a memory budget.

    bytes = 2 (K and V) x bytes_per_element x layers x kv_heads x head_dim x seq_len x batch

Paged allocation reserves whole pages per sequence (at most one partly used page
each); contiguous preallocation reserves `max_seq_len` slots per sequence whatever
its real length. `plan()` compares the two for a mean sequence length.

Run `python -m pagedjax.planner --help`.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from dataclasses import asdict, dataclass

from pagedjax.config import PRESETS, dtype_name, dtype_size

GIB = 1024**3


def _int(name: str, value) -> int:
    """`value` as an int; TypeError naming it unless it is an integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    return int(value)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype="bfloat16") -> int:
    """Bytes of K and V one token occupies across all layers."""
    layers, kv_heads, head_dim = (
        _int("layers", layers),
        _int("kv_heads", kv_heads),
        _int("head_dim", head_dim),
    )
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {name}={value}")
    return 2 * dtype_size(dtype) * layers * kv_heads * head_dim


def kv_cache_bytes(
    layers: int, kv_heads: int, head_dim: int, seq_len: int, batch: int, dtype="bfloat16"
) -> int:
    """Exact bytes of a KV cache holding `batch` sequences of `seq_len` tokens."""
    seq_len, batch = _int("seq_len", seq_len), _int("batch", batch)
    if seq_len < 0 or batch < 0:
        raise ValueError(f"seq_len and batch must be >= 0, got {seq_len=}, {batch=}")
    return kv_bytes_per_token(layers, kv_heads, head_dim, dtype) * seq_len * batch


def pages_needed(seq_len: int, page_size: int) -> int:
    """Pages a sequence of `seq_len` tokens occupies."""
    seq_len, page_size = _int("seq_len", seq_len), _int("page_size", page_size)
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len=}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size=}")
    return -(-seq_len // page_size)


@dataclass(frozen=True)
class Plan:
    """Answers of `plan()`; all byte counts exact integers."""

    bytes_per_token: int
    kv_cache_bytes: int
    memory_bytes: int | None
    page_size: int
    pages_per_sequence: int
    bytes_per_page: int
    max_seqs_paged: int | None
    max_seqs_contiguous: int | None
    capacity_ratio: float | None
    paged_waste_fraction: float


def plan(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch: int = 1,
    dtype="bfloat16",
    memory_bytes: int | None = None,
    page_size: int = 16,
    max_seq_len: int | None = None,
) -> Plan:
    """Capacity plan for a cache.

    Args:
      layers, kv_heads, head_dim, dtype: the model's KV shape.
      seq_len: mean tokens per sequence (prompt + output).
      batch: sequences for the `kv_cache_bytes` figure.
      memory_bytes: KV memory budget; None skips the capacity answers.
      page_size: tokens per page for paged allocation.
      max_seq_len: what contiguous preallocation reserves per sequence (default seq_len).

    Returns:
      A Plan. `max_seqs_paged` counts sequences of `seq_len` tokens that fit in
      `memory_bytes` with paged allocation; `max_seqs_contiguous` with
      `max_seq_len` slots preallocated each.
    """
    seq_len, page_size = _int("seq_len", seq_len), _int("page_size", page_size)
    if memory_bytes is not None:
        memory_bytes = _int("memory_bytes", memory_bytes)
    if max_seq_len is not None:
        max_seq_len = _int("max_seq_len", max_seq_len)
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, dtype)
    total = kv_cache_bytes(layers, kv_heads, head_dim, seq_len, batch, dtype)
    max_seq_len = seq_len if max_seq_len is None else max_seq_len
    if max_seq_len < seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} < mean seq_len {seq_len}")
    pages = pages_needed(seq_len, page_size)
    page_bytes = per_token * page_size
    waste = 0.0 if pages == 0 else 1.0 - seq_len / (pages * page_size)
    paged = contiguous = ratio = None
    if memory_bytes is not None:
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes=}")
        num_pages = memory_bytes // page_bytes
        paged = num_pages // pages if pages else None
        contiguous = memory_bytes // (per_token * max_seq_len) if max_seq_len else None
        if paged is not None and contiguous:
            ratio = paged / contiguous
    return Plan(
        bytes_per_token=per_token,
        kv_cache_bytes=total,
        memory_bytes=memory_bytes,
        page_size=page_size,
        pages_per_sequence=pages,
        bytes_per_page=page_bytes,
        max_seqs_paged=paged,
        max_seqs_contiguous=contiguous,
        capacity_ratio=ratio,
        paged_waste_fraction=waste,
    )


def _format(p: Plan, args) -> str:
    unused = p.pages_per_sequence * p.page_size - args.seq_len
    lines = [
        f"model          {args.model or 'custom'}: layers={args.layers} kv_heads={args.kv_heads} "
        f"head_dim={args.head_dim} dtype={args.dtype}",
        f"per token      {p.bytes_per_token:,} bytes",
        f"KV cache       {p.kv_cache_bytes:,} bytes ({p.kv_cache_bytes / GIB:.2f} GiB) "
        f"for batch {args.batch} x seq_len {args.seq_len}",
        f"per page       {p.bytes_per_page:,} bytes (page_size {p.page_size}); "
        f"{p.pages_per_sequence} pages per sequence, {unused} of its last page's "
        f"{p.page_size} slots unused ({100 * p.paged_waste_fraction:.2f}% of its slots)",
    ]
    if p.memory_bytes is not None:
        lines += [
            f"budget         {p.memory_bytes / GIB:.2f} GiB",
            f"paged          {p.max_seqs_paged} sequences of {args.seq_len} tokens",
            f"contiguous     {p.max_seqs_contiguous} sequences preallocated at "
            f"{args.max_seq_len or args.seq_len} tokens",
        ]
        if p.capacity_ratio is not None:
            lines.append(
                f"ratio          paging fits {p.capacity_ratio:.2f}x as many sequences as "
                "contiguous preallocation"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedjax.planner", description="KV cache capacity planner."
    )
    parser.add_argument("--model", choices=sorted(PRESETS), help="a preset model shape")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096, help="mean tokens per sequence")
    parser.add_argument("--max-seq-len", type=int, help="contiguous preallocation per sequence")
    parser.add_argument(
        "--dtype", default=None, help="KV dtype: bfloat16 | float32 | float16 | fp8"
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--memory-gb", type=float, help="KV memory budget in GiB")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        if args.model:
            cfg = PRESETS[args.model]
            for field, value in (
                ("layers", cfg.num_layers),
                ("kv_heads", cfg.num_kv_heads),
                ("head_dim", cfg.head_dim),
                ("dtype", cfg.dtype),
            ):
                if getattr(args, field) is None:  # (a given 0 is checked, not replaced)
                    setattr(args, field, value)
        missing = [f for f in ("layers", "kv_heads", "head_dim") if getattr(args, f) is None]
        if missing:
            parser.error(
                "give --model or all of --layers --kv-heads --head-dim (missing: "
                + ", ".join("--" + m.replace("_", "-") for m in missing)
                + ")"
            )
        args.dtype = dtype_name(args.dtype or "bfloat16", kv=True)
        gb = args.memory_gb
        if gb is not None and not (math.isfinite(gb) and gb >= 0):
            raise ValueError(f"--memory-gb must be a finite number >= 0, got --memory-gb {gb}")
        memory = None if gb is None else int(gb * GIB)
        p = plan(
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            seq_len=args.seq_len,
            batch=args.batch,
            dtype=args.dtype,
            memory_bytes=memory,
            page_size=args.page_size,
            max_seq_len=args.max_seq_len,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"model": args.model, "dtype": args.dtype, "batch": args.batch}
        out.update(seq_len=args.seq_len, layers=args.layers, kv_heads=args.kv_heads)
        out.update(head_dim=args.head_dim, **asdict(p))
        out["kv_cache_gib"] = p.kv_cache_bytes / GIB
        print(json.dumps(out))
    else:
        print(_format(p, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
