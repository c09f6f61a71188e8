"""KV cache capacity: the formula, and how many sequences fit in a memory budget.

    bytes = 2 (K and V) x bytes_per_element x layers x kv_heads x head_dim x seq_len x batch

`plan()` compares, for sequences of `seq_len` tokens (prompt + output), the engine's
paged cache with contiguous preallocation. Both count the K/V a sequence writes:
`seq_len - 1` tokens (its last token is sampled, never fed). Paged: the most pages the
scheduler lets one sequence hold at once (`peak_pages`, the bound `Scheduler.add` and
admission use; with a sliding window, `window_pages`), out of the pages left once the
block manager's watermark is kept free. Contiguous: `max_seq_len - 1` slots per
sequence whatever its real length; with a window, a ring of at most W slots.

`step_peak_bytes` estimates the working memory of one engine step (activations, logits
and sampling temporaries), which `resources.plan_num_pages` keeps out of the KV budget.

Run `python -m pagedjax.planner --help`.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from dataclasses import asdict, dataclass

from pagedjax.config import PRESETS, ModelConfig, dtype_name, dtype_size

GIB = 1024**3
# The engine's defaults (`LLM`'s kwargs; tests/test_planner.py checks they still are).
MAX_NUM_BATCHED_TOKENS = 1024
WATERMARK = 0.01
# [B, V] float32 arrays one step's head holds at its peak: the logits, then the sampler's
# sort, softmax, cumulative sum, noise and log-softmax (XLA:CPU's buffer assignment of
# `sampling.sample` + `top_logprobs` keeps 6 besides the logits; 1 more for the GPU's
# sort scratch). tests/test_planner.py checks it against XLA's count.
HEAD_ROW_COPIES = 8
# A prompt-logprobs step scores its tokens through the LM head `SCORE_ROWS` rows at a
# time (`decode._score_targets`), holding float32 [SCORE_ROWS, V] arrays: the logits and
# their log-softmax (XLA:CPU's buffer assignment of the step keeps 1.4-1.8 such arrays
# besides the rest; 1 more for the GPU's top-k scratch). tests/test_planner_review.py
# checks the real step against the estimate.
SCORE_ROWS = 256
SCORE_ROW_COPIES = 3
# Top-k logprob columns are padded to a power of two of at least this many
# (`logprob_columns`, which `batch.StepBatch` pads with), so a step with `logprobs=k`
# compiles once per bucket.
LOGPROB_COLUMNS_FLOOR = 8


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


def logprob_columns(max_logprobs: int, vocab_size: int) -> int:
    """The most top-k columns a step returns for an engine whose requests may ask for
    `max_logprobs` logprobs or prompt logprobs per token (-1: the whole vocabulary):
    the count padded as a step pads it, at most `vocab_size`."""
    k, v = _int("max_logprobs", max_logprobs), _int("vocab_size", vocab_size)
    if k < -1 or v < 1:
        raise ValueError(f"need max_logprobs >= -1 and vocab_size >= 1, got {k=}, {v=}")
    k = v if k == -1 else k
    return min(1 << (max(k, LOGPROB_COLUMNS_FLOOR) - 1).bit_length(), v)


def step_peak_bytes(
    cfg: ModelConfig,
    num_tokens: int,
    num_rows: int,
    *,
    lora_columns: int = 0,
    logprob_columns: int = 0,
) -> int:
    """Estimated peak working memory of one step of `num_tokens` tokens that samples
    `num_rows` rows (the padded sizes the step is compiled for), on one device.

    The largest of one layer's phases, whose buffers the next layer reuses: attention
    (the residual stream [T, E] and its norm, q/k/v as projected and as rotated, the
    output [T, H * D]) or the MLP (residual, norm, gate and up [T, F] and their product),
    in the model's dtype, plus the norm's float32 copy [T, E]; then the head's
    `HEAD_ROW_COPIES` float32 [B, V] arrays, and a prompt-logprobs step's scoring of its
    tokens, `SCORE_ROWS` at a time: `SCORE_ROW_COPIES` float32 [min(T, SCORE_ROWS), V]
    arrays (any request may ask for prompt logprobs, so this is always counted). The
    parts are added, not maxed, for margin.

    `lora_columns`: with LoRA slots (`max_loras * max_lora_rank`; 0: none), a step with
    adapters also holds, per token, the slots' mask and the low-rank product (float32
    [T, columns] each) and one projection's update at a time: float32 and cast to the
    model's dtype, as wide as the phase's widest output (F in the MLP, max(H * D, E) in
    attention; `lora.LoRAWeights.delta`). XLA:CPU's buffers for such a step exceeded the
    estimate without them by 1.7 [T, F] float32 arrays.

    Not counted: the paged attention kernels' scratch (on chip; `backend="xla"`'s
    reference gathers every sequence's pages, far more), the LoRA slots' weights, and
    tensor parallelism's split of H, F and V (the estimate is then an upper bound).

    `logprob_columns`: the most top-k logprob columns a step returns
    (`logprob_columns()`; 0: none counted). Each is an int32 id and a float32 logprob
    per prompt token and per sampled row, and XLA keeps a scoring chunk's and the
    rows' again while it computes them: 8 bytes x columns x (T + min(T, SCORE_ROWS) +
    2B). Negligible at vLLM's default cap of 20; at `max_logprobs=-1` (the whole
    vocabulary) they are the largest part of a long prompt-logprobs step (8 GiB at
    8,192 tokens of Llama-3's vocabulary).
    """
    t, b = _int("num_tokens", num_tokens), _int("num_rows", num_rows)
    if t < 0 or b < 0:
        raise ValueError(f"num_tokens and num_rows must be >= 0, got {num_tokens=}, {num_rows=}")
    cols = _int("lora_columns", lora_columns)
    if cols < 0:
        raise ValueError(f"lora_columns must be >= 0, got {lora_columns=}")
    top = _int("logprob_columns", logprob_columns)
    if top < 0:
        raise ValueError(f"logprob_columns must be >= 0, got {logprob_columns=}")
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, k = cfg.num_heads, cfg.num_kv_heads
    size = dtype_size(cfg.dtype)
    attention = size * (2 * e + 3 * (h + k) * d)  # per token, in bytes
    mlp = size * (2 * e + 3 * f)
    if cols:  # one update at a time, float32 then cast; the mask and x @ a, float32
        attention += (4 + size) * max(h * d, e) + 8 * cols
        mlp += (4 + size) * f + 8 * cols
    body = t * (max(attention, mlp) + 4 * e)
    head = (b * HEAD_ROW_COPIES + min(t, SCORE_ROWS) * SCORE_ROW_COPIES) * cfg.vocab_size * 4
    top_k = 8 * top * (t + min(t, SCORE_ROWS) + 2 * b)
    return body + head + top_k


def pages_needed(seq_len: int, page_size: int) -> int:
    """Pages that hold `seq_len` tokens' K/V (a sequence of N tokens holds N - 1)."""
    seq_len, page_size = _int("seq_len", seq_len), _int("page_size", page_size)
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len=}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size=}")
    return -(-seq_len // page_size)


def _window_args(sliding_window, max_num_batched_tokens) -> tuple[int | None, int]:
    w = None if sliding_window is None else _int("sliding_window", sliding_window)
    budget = _int("max_num_batched_tokens", max_num_batched_tokens)
    if w is not None and w < 1:
        raise ValueError(f"sliding_window must be None or positive, got sliding_window={w}")
    if budget < 1:
        raise ValueError(
            f"max_num_batched_tokens must be positive, got max_num_batched_tokens={budget}"
        )
    return w, budget


def window_pages(
    sliding_window: int, page_size: int, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
) -> int:
    """Most pages a sequence holds at once under a sliding window of W tokens.

    The engine's own bound (`Scheduler.window_pages` returns it): the W - 1 positions a
    prefill chunk's first query sees, then the chunk of up to `max_num_batched_tokens`
    tokens, span at most ceil((max(W, 2) - 2 + max_num_batched_tokens) / page_size) + 1
    pages (W = 1: the last page is kept too).
    """
    w, budget = _window_args(sliding_window, max_num_batched_tokens)
    if w is None:
        raise ValueError("sliding_window must be a positive int, got sliding_window=None")
    return pages_needed(max(w, 2) - 2 + budget, page_size) + 1


def held_pages(
    kv_tokens: int,
    page_size: int,
    *,
    sliding_window: int | None = None,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
) -> int:
    """Most pages a sequence holds at once while its K/V fills up to `kv_tokens` slots:
    ceil(kv_tokens / page_size), with a window at most `window_pages` of them (the
    scheduler's bound: `Scheduler.max_pages_needed` counts with it)."""
    pages = pages_needed(kv_tokens, page_size)
    w, budget = _window_args(sliding_window, max_num_batched_tokens)
    return pages if w is None else min(pages, window_pages(w, page_size, budget))


def peak_pages(
    seq_len: int,
    page_size: int,
    *,
    sliding_window: int | None = None,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
) -> int:
    """Most pages a sequence of `seq_len` tokens (prompt + output) holds at once.

    What `Scheduler.max_pages_needed` admits a one-sample request of
    `max_num_tokens = seq_len` by: its K/V fills at most `seq_len - 1` slots (its last
    token is sampled, never fed), so `held_pages(seq_len - 1)`.
    """
    seq_len = _int("seq_len", seq_len)
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len=}")
    return held_pages(
        max(seq_len - 1, 0),
        page_size,
        sliding_window=sliding_window,
        max_num_batched_tokens=max_num_batched_tokens,
    )


@dataclass(frozen=True)
class Plan:
    """Answers of `plan()`; all byte and page counts exact integers.

    `pages_per_sequence`: `peak_pages`. `num_pages`: pages in the budget, of which
    `watermark_pages` admission keeps free (`BlockManager.watermark_pages`).
    `max_seqs_paged`: sequences that fit in the rest each at its peak, what
    `Scheduler.add` accepts as one request of that many samples: so many never preempt
    one another (the engine also runs at most `max_num_seqs`; a windowed sequence holds
    its peak while its prompt is prefilled, fewer pages after, so more may run then).
    `contiguous_slots_per_sequence`: what contiguous preallocation reserves a sequence.
    `paged_waste_fraction`: share of the slots of a sequence's peak pages that hold no
    K/V at that peak.
    """

    bytes_per_token: int
    kv_cache_bytes: int
    memory_bytes: int | None
    page_size: int
    sliding_window: int | None
    max_num_batched_tokens: int
    window_pages: int | None
    pages_per_sequence: int
    bytes_per_page: int
    num_pages: int | None
    watermark_pages: int | None
    max_seqs_paged: int | None
    contiguous_slots_per_sequence: int
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
    sliding_window: int | None = None,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    watermark: float = WATERMARK,
) -> Plan:
    """Capacity plan for a cache.

    Args:
      layers, kv_heads, head_dim, dtype: the model's KV shape.
      seq_len: tokens per sequence (prompt + output).
      batch: sequences for the `kv_cache_bytes` figure.
      memory_bytes: KV memory budget; None skips the capacity answers.
      page_size: tokens per page for paged allocation.
      max_seq_len: contiguous preallocation's longest sequence (default seq_len); it
        reserves `max_seq_len - 1` K/V slots a sequence.
      sliding_window: the model's window W (None: full attention). A paged sequence then
        holds at most `window_pages`; contiguous preallocation a ring of
        min(W, max_seq_len - 1) slots.
      max_num_batched_tokens: the engine's token budget of one step, which bounds a
        prefill chunk (`LLM(max_num_batched_tokens=)`, default 1024); matters only with
        a window.
      watermark: fraction of the pages admission keeps free (`LLM(watermark=)`, 0.01).

    Returns:
      A Plan (see its docstring).
    """
    seq_len, page_size = _int("seq_len", seq_len), _int("page_size", page_size)
    if memory_bytes is not None:
        memory_bytes = _int("memory_bytes", memory_bytes)
    if max_seq_len is not None:
        max_seq_len = _int("max_seq_len", max_seq_len)
    w, budget = _window_args(sliding_window, max_num_batched_tokens)
    if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real):
        raise TypeError(f"watermark must be a number, got watermark={watermark!r}")
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be in [0, 1), got {watermark=}")
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, dtype)
    total = kv_cache_bytes(layers, kv_heads, head_dim, seq_len, batch, dtype)
    max_seq_len = seq_len if max_seq_len is None else max_seq_len
    if max_seq_len < seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} < seq_len {seq_len}")
    pages = peak_pages(seq_len, page_size, sliding_window=w, max_num_batched_tokens=budget)
    win = None if w is None else window_pages(w, page_size, budget)
    held = max(seq_len - 1, 0)  # K/V tokens at the peak: with a window, W - 1 + a chunk
    held = held if w is None else min(held, w - 1 + budget)
    waste = 0.0 if pages == 0 else 1.0 - held / (pages * page_size)
    slots = max(max_seq_len - 1, 0)  # a ring of W slots serves every query's window
    slots = slots if w is None else min(slots, w)
    page_bytes = per_token * page_size
    num_pages = kept = paged = contiguous = ratio = None
    if memory_bytes is not None:
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes=}")
        num_pages = memory_bytes // page_bytes
        kept = int(watermark * num_pages)  # as BlockManager.watermark_pages
        paged = (num_pages - kept) // pages if pages else None
        contiguous = memory_bytes // (per_token * slots) if slots else None
        if paged is not None and contiguous:
            ratio = paged / contiguous
    return Plan(
        bytes_per_token=per_token,
        kv_cache_bytes=total,
        memory_bytes=memory_bytes,
        page_size=page_size,
        sliding_window=w,
        max_num_batched_tokens=budget,
        window_pages=win,
        pages_per_sequence=pages,
        bytes_per_page=page_bytes,
        num_pages=num_pages,
        watermark_pages=kept,
        max_seqs_paged=paged,
        contiguous_slots_per_sequence=slots,
        max_seqs_contiguous=contiguous,
        capacity_ratio=ratio,
        paged_waste_fraction=waste,
    )


def _format(p: Plan, args) -> str:
    kv = max(args.seq_len - 1, 0)
    full = pages_needed(kv, p.page_size)
    window = "" if p.sliding_window is None else f" sliding_window={p.sliding_window}"
    lines = [
        f"model          {args.model or 'custom'}: layers={args.layers} kv_heads={args.kv_heads} "
        f"head_dim={args.head_dim} dtype={args.dtype}{window}",
        f"per token      {p.bytes_per_token:,} bytes",
        f"KV cache       {p.kv_cache_bytes:,} bytes ({p.kv_cache_bytes / GIB:.2f} GiB) "
        f"for batch {args.batch} x seq_len {args.seq_len}",
        f"per page       {p.bytes_per_page:,} bytes (page_size {p.page_size})",
    ]
    if p.pages_per_sequence < full:
        lines.append(
            f"per sequence   at most {p.pages_per_sequence} pages at once under the window "
            f"({p.sliding_window - 1} earlier positions and a prefill chunk of up to "
            f"{p.max_num_batched_tokens} tokens), not the {full} its {kv} K/V tokens fill"
        )
    else:
        unused = p.pages_per_sequence * p.page_size - kv
        lines.append(
            f"per sequence   {p.pages_per_sequence} pages for its {kv} K/V tokens "
            f"(its last token is sampled, never fed), {unused} of its last page's "
            f"{p.page_size} slots unused ({100 * p.paged_waste_fraction:.2f}% of its slots)"
        )
    if p.memory_bytes is not None:
        longest = args.max_seq_len or args.seq_len
        ring = p.contiguous_slots_per_sequence < longest - 1  # the window, not the length
        ring = f" (a ring of the {p.sliding_window}-token window)" if ring else ""
        lines += [
            f"budget         {p.memory_bytes / GIB:.2f} GiB: {p.num_pages} pages, "
            f"{p.watermark_pages} of them the watermark admission keeps free",
            f"paged          {p.max_seqs_paged} sequences of {args.seq_len} tokens at their "
            f"peak at once ({p.num_pages - p.watermark_pages} pages // {p.pages_per_sequence})",
            f"contiguous     {p.max_seqs_contiguous} sequences preallocated at "
            f"{p.contiguous_slots_per_sequence} K/V slots{ring} for up to {longest} tokens",
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
    parser.add_argument(
        "--seq-len", type=int, default=4096, help="tokens per sequence (prompt + output)"
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        help="longest sequence contiguous preallocation serves (default --seq-len)",
    )
    parser.add_argument(
        "--dtype", default=None, help="KV dtype: bfloat16 | float32 | float16 | fp8"
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--memory-gb", type=float, help="KV memory budget in GiB")
    parser.add_argument(
        "--sliding-window",
        type=int,
        help="the model's window W, 0 for none (default: the --model preset's)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        "--max-num-batched-tokens",
        dest="max_num_batched_tokens",
        type=int,
        default=MAX_NUM_BATCHED_TOKENS,
        help="the engine's token budget of one step, which bounds a prefill chunk "
        "(generate.py --max-batch-tokens; default %(default)s); matters with a window",
    )
    parser.add_argument(
        "--watermark",
        type=float,
        default=WATERMARK,
        help="fraction of the pages admission keeps free (LLM's watermark; default %(default)s)",
    )
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
                ("sliding_window", cfg.sliding_window or 0),
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
        if args.seq_len < 2:  # (the library's plan takes them: no K/V, no sequence count)
            raise ValueError(
                f"--seq-len must be >= 2, got {args.seq_len}: a sequence of N tokens writes "
                "the K/V of N - 1"
            )
        gb = args.memory_gb
        if gb is not None and not (math.isfinite(gb) and gb >= 0):
            raise ValueError(f"--memory-gb must be a finite number >= 0, got --memory-gb {gb}")
        if gb is not None and not math.isfinite(gb * GIB):
            raise ValueError(f"--memory-gb {gb} is too large")
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
            sliding_window=args.sliding_window or None,
            max_num_batched_tokens=args.max_num_batched_tokens,
            watermark=args.watermark,
        )
        if args.json:
            out = {"model": args.model, "dtype": args.dtype, "batch": args.batch}
            out.update(seq_len=args.seq_len, layers=args.layers, kv_heads=args.kv_heads)
            out.update(head_dim=args.head_dim, **asdict(p))
            out["kv_cache_gib"] = p.kv_cache_bytes / GIB
            text = json.dumps(out)
        else:
            text = _format(p, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OverflowError as e:  # (ints beyond a float's range, as GiB or a fraction)
        print(f"error: the numbers are too large to plan for: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
