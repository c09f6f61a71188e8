"""On a CUDA GPU: the compiled Pallas kernels against the float32 reference, and the engine.

Skipped unless JAX's default backend is a GPU. `PAGEDJAX_GPU_TESTS_INTERPRET=1` runs
the same tests on any machine with the kernels in the Pallas interpreter
(`interpret=True`) on a reduced case list (long contexts and big batches shrunk,
page size 128 dropped), so that the test logic itself is checked where there is no
GPU; the device-memory test is skipped there. `scripts/device_check.sh` runs this
file on the GPU.

* Decode kernel (`paged_decode_attention(backend="gpu")`): GQA 1/4/8 and MQA, head
  dims 64/128/256 and the padded 80/100 (split and not), page sizes 8-128, bf16 and
  f32, lengths 1, a page boundary, the maximum and random ones, shuffled page tables,
  soft cap, sliding window, a batch of 37, a 32,768-token context at B=1 (split-K)
  and B=256.
* Ragged kernel (`ragged_paged_attention(backend="gpu")`): a prefill in one go and in
  random chunks; 3 decode rows + 2 chunks (one starting and ending mid-page) + q_len 0
  rows + padding rows past `query_start_loc[B]` (which must be zero); a 512-token chunk
  beside 64 decode rows; soft cap and window; head dims 80 and 8 (padded).
* Every kernel pool is poisoned: slots no query may read hold NaN (helpers of
  tests/test_paged_decode_gpu.py and tests/test_ragged_gpu.py), so an out-of-bounds
  read shows as NaN, which never passes.
* Both kernels read a pool of exactly `validation.GPU_MAX_POOL_ELEMENTS` elements (the
  int32 offsets' limit) to its last element.
* `backend="auto"` runs the GPU kernels; the engine (`LLM`, demo model, bf16) gives
  the same greedy tokens with backend="gpu" as with "xla"; `kv_memory_fraction`
  sizes a cache that fits the device.

The reference runs in float32 with `jax.default_matmul_precision("float32")`: on a
GPU, XLA's default float32 matmul may use TF32, which would make the oracle itself
~1e-3 off. `PAGEDJAX_GPU_TESTS_LOG=path` appends one JSON line per check (test,
relative error, tolerance; the engine's first divergences) so that a GPU run brings
back its numbers, not only pass/fail.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_paged_decode_gpu as decode_tests  # helpers only: its tests are not collected here
import test_ragged_gpu as ragged_tests

from pallas_kernels import dispatch, paged_decode_attention, ragged_paged_attention, reference

INTERPRET = os.environ.get("PAGEDJAX_GPU_TESTS_INTERPRET") == "1"
ON_GPU = jax.default_backend() == "gpu"
LOG = os.environ.get("PAGEDJAX_GPU_TESTS_LOG")

pytestmark = pytest.mark.skipif(
    not ON_GPU and not INTERPRET,
    reason="needs a CUDA GPU (or PAGEDJAX_GPU_TESTS_INTERPRET=1 for the interpret-mode run)",
)

# bf16 against a float32 reference: bf16 rounding of q, p and the output (~3e-3).
# float32: the kernels ask Triton for IEEE dots (Precision.HIGHEST), expected ~1e-6;
# but Triton's float32 dot may use TF32 (10-bit mantissa, ~1e-3 relative) where a
# lowering does not honour that request, so on a GPU the bound is 3e-3 and the
# logged errors say which it was. In the interpreter the dots are exact: 1e-4.
TOL = {"bfloat16": 1e-2, "float32": 1e-4 if INTERPRET else 3e-3}
F32_MATMULS = functools.partial(jax.default_matmul_precision, "float32")


def record(**row) -> None:
    """Appends `row` (with the running test's id) to $PAGEDJAX_GPU_TESTS_LOG, if set."""
    if not LOG:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    with open(LOG, "a") as f:
        f.write(json.dumps(dict(test=test, **row), default=str) + "\n")


def assert_close(out, ref, dtype: str, /, **context) -> float:
    """Relative error of `out` vs the float32 `ref`; NaN (a poisoned read) fails."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    nans = int(np.isnan(out).sum())
    err = float(np.linalg.norm(np.nan_to_num(out) - ref) / np.linalg.norm(ref))
    record(err=err, tol=TOL[dtype], nans=nans, **context)
    assert nans == 0, f"{nans} NaN outputs: a read outside the live tokens"
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:g}"
    return err


def cases(*specs):
    """pytest params from (id, kwargs, interpret) specs.

    `interpret`: True keeps the case as is in the interpret run, a dict overrides
    some of its kwargs there (smaller shapes), None drops it there.
    """
    params = []
    for case_id, kwargs, interp in specs:
        if INTERPRET and interp is None:
            continue
        if INTERPRET and isinstance(interp, dict):
            kwargs = {**kwargs, **interp}
        params.append(pytest.param(kwargs, id=case_id))
    return params


# ---------------------------------------------------------------- decode kernel

LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3-8B attention


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_pages: int
    dtype: str
    lengths: tuple[int, ...] | None = None  # default: 1, S, the maximum, 2S, random
    scale: float | None = None
    soft_cap: float | None = None
    sliding_window: int | None = None


DECODE_CASES = cases(
    ("llama-bf16", dict(batch=6, **LLAMA, page_size=16, max_pages=8, dtype="bfloat16"), True),
    ("mha-f32", dict(batch=5, num_heads=8, num_kv_heads=8, head_dim=128, page_size=16,
                     max_pages=6, dtype="float32"), True),
    ("gqa8-bf16", dict(batch=5, num_heads=16, num_kv_heads=2, head_dim=128, page_size=16,
                       max_pages=6, dtype="bfloat16"), True),
    ("mqa-f32", dict(batch=4, num_heads=8, num_kv_heads=1, head_dim=128, page_size=16,
                     max_pages=6, dtype="float32"), True),
    ("d64-page8-bf16", dict(batch=5, num_heads=8, num_kv_heads=2, head_dim=64, page_size=8,
                            max_pages=12, dtype="bfloat16"), True),
    ("d64-page64-f32", dict(batch=4, num_heads=16, num_kv_heads=2, head_dim=64, page_size=64,
                            max_pages=3, dtype="float32"), True),
    ("d256-page16-bf16", dict(batch=4, num_heads=8, num_kv_heads=2, head_dim=256, page_size=16,
                              max_pages=6, dtype="bfloat16"), True),
    ("d256-page128-f32", dict(batch=3, num_heads=4, num_kv_heads=1, head_dim=256,
                              page_size=128, max_pages=2, dtype="float32"), None),
    ("page128-gqa8-2k-bf16", dict(batch=4, num_heads=64, num_kv_heads=8, head_dim=128,
                                  page_size=128, max_pages=16, dtype="bfloat16"), None),
    ("softcap-scale-bf16", dict(batch=5, **LLAMA, page_size=16, max_pages=8, dtype="bfloat16",
                                soft_cap=2.0, scale=0.3), True),
    ("window-bf16", dict(batch=5, num_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                         max_pages=16, dtype="bfloat16", sliding_window=40), True),
    ("softcap-window-f32", dict(batch=4, num_heads=8, num_kv_heads=2, head_dim=64,
                                page_size=32, max_pages=8, dtype="float32", soft_cap=5.0,
                                sliding_window=50), True),
    ("batch37-bf16", dict(batch=37, **LLAMA, page_size=16, max_pages=12, dtype="bfloat16"),
     dict(batch=11, num_heads=8, num_kv_heads=2, max_pages=4)),
    # B * K = 8 programs: the default tuning splits the context (split-K).
    ("long32k-bf16", dict(batch=1, **LLAMA, page_size=16, max_pages=2048, dtype="bfloat16",
                          lengths=(32768,)),
     dict(num_heads=8, num_kv_heads=2, max_pages=64, lengths=(1024,))),
    ("batch256-bf16", dict(batch=256, **LLAMA, page_size=16, max_pages=8, dtype="bfloat16"),
     dict(batch=24, num_heads=8, num_kv_heads=2, max_pages=2)),
    # Head dims padded inside the kernel (tiles of 128): split-K at B * K = 64, and not.
    ("d80-split-bf16", dict(batch=2, num_heads=32, num_kv_heads=32, head_dim=80,
                            page_size=16, max_pages=128, dtype="bfloat16"),
     dict(num_heads=8, num_kv_heads=8, max_pages=8)),
    ("d100-f32", dict(batch=6, num_heads=32, num_kv_heads=32, head_dim=100, page_size=16,
                      max_pages=8, dtype="float32"), dict(num_heads=4, num_kv_heads=4)),
)  # fmt: skip


def decode_inputs(case: DecodeCase, seed: int = 0):
    """(q, clean k, clean v, poisoned k, poisoned v, lengths, page_table)."""
    return decode_tests.make_case(
        seed,
        case.batch,
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        case.page_size,
        case.max_pages,
        jnp.dtype(case.dtype),
        None if case.lengths is None else list(case.lengths),
        case.sliding_window,
    )


def decode_reference(case: DecodeCase, q, k, v, lengths, page_table):
    f32 = jnp.float32
    opts = dict(scale=case.scale, soft_cap=case.soft_cap, sliding_window=case.sliding_window)
    with F32_MATMULS():
        ref = decode_tests.ref_decode(
            q.astype(f32), k.astype(f32), v.astype(f32), lengths, page_table, **opts
        )
    return np.asarray(ref)


@pytest.mark.parametrize("spec", DECODE_CASES)
def test_decode_kernel_matches_reference(spec):
    case = DecodeCase(**spec)
    q, k, v, k_bad, v_bad, lengths, page_table = decode_inputs(case)
    out = paged_decode_attention(
        q,
        k_bad,
        v_bad,
        lengths,
        page_table,
        scale=case.scale,
        soft_cap=case.soft_cap,
        sliding_window=case.sliding_window,
        backend="gpu",
        interpret=INTERPRET,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_reference(case, q, k, v, lengths, page_table)
    assert_close(out, ref, case.dtype, kernel="decode", **spec)


# ---------------------------------------------------------------- ragged kernel


def mixed_lens(page_size: int):
    """3 decode rows, 2 chunks (the first starts and ends mid-page), 2 q_len 0 rows.

    Context lengths include 1, exactly a page boundary and the table's maximum (4 pages).
    """
    s = page_size
    q_lens = [1, s + 3, 1, 0, 2 * s, 1, 0]
    ctx_lens = [2 * s + 1, 3 * s + s // 2, 1, 5, 4 * s, s, 0]
    return q_lens, ctx_lens


MIXED_CASES = cases(
    ("llama-page16-bf16", dict(heads=(32, 8), head_dim=128, page_size=16, dtype="bfloat16"),
     dict(heads=(8, 2))),
    ("mha-d64-page8-f32", dict(heads=(8, 8), head_dim=64, page_size=8, dtype="float32"), True),
    ("gqa8-d256-page32-bf16", dict(heads=(16, 2), head_dim=256, page_size=32,
                                   dtype="bfloat16"), dict(page_size=8)),
    ("mqa-d128-page128-f32", dict(heads=(8, 1), head_dim=128, page_size=128, dtype="float32"),
     None),
    ("g3-d64-page64-bf16", dict(heads=(6, 2), head_dim=64, page_size=64, dtype="bfloat16"),
     dict(page_size=16)),
    ("gqa4-d256-page16-f32", dict(heads=(8, 2), head_dim=256, page_size=16, dtype="float32"),
     True),
    ("softcap-bf16", dict(heads=(32, 8), head_dim=128, page_size=16, dtype="bfloat16",
                          opts=dict(soft_cap=5.0)), dict(heads=(8, 2))),
    ("window-softcap-scale-f32", dict(heads=(8, 2), head_dim=64, page_size=8, dtype="float32",
                                      opts=dict(sliding_window=19, soft_cap=4.0, scale=0.3)),
     True),
    ("d80-page16-bf16", dict(heads=(32, 32), head_dim=80, page_size=16, dtype="bfloat16"),
     dict(heads=(4, 4))),
    ("d8-mqa-f32", dict(heads=(8, 1), head_dim=8, page_size=8, dtype="float32"), True),
)  # fmt: skip


@pytest.mark.parametrize("spec", MIXED_CASES)
def test_ragged_mixed_batch(spec):
    """Decode rows, chunks, q_len 0 and padding rows in one call, pages shuffled and poisoned."""
    spec = dict(spec)
    opts = spec.pop("opts", {})
    dtype = spec.pop("dtype")
    q_lens, ctx_lens = mixed_lens(spec["page_size"])
    args, dense = ragged_tests._batch(
        np.random.default_rng(0),
        q_lens,
        ctx_lens,
        **spec,
        max_pages=4,
        dtype=jnp.dtype(dtype),
        pad_rows=5,
        poison=True,
        window=opts.get("sliding_window"),
    )
    out = ragged_paged_attention(*args, backend="gpu", interpret=INTERPRET, **opts)
    with F32_MATMULS():
        ref = ragged_tests._dense_ref(dense, args[0].shape[0], **opts)
    assert_close(out, ref, dtype, kernel="ragged", case="mixed", dtype=dtype, **spec, **opts)
    assert not np.asarray(out[sum(q_lens) :]).any(), "padding rows must be zero"


def test_ragged_chunk_beside_many_decode_rows():
    """A 512-token chunk over a 1,536-token prefix beside 64 decode rows (Llama shape)."""
    n, rows = (64, 8) if INTERPRET else (512, 64)
    heads = (8, 2) if INTERPRET else (32, 8)
    rng = np.random.default_rng(1)
    ctx_lens = [4 * n, *rng.integers(1, 4 * n + 1, rows).tolist()]
    q_lens = [n] + [1] * rows
    args, dense = ragged_tests._batch(
        rng, q_lens, ctx_lens, heads=heads, head_dim=128, page_size=16, dtype=jnp.bfloat16,
        pad_rows=3, poison=True,
    )  # fmt: skip
    out = ragged_paged_attention(*args, backend="gpu", interpret=INTERPRET)
    with F32_MATMULS():  # per group of equal q_len: one padded batch would be tens of GB
        ref = np.concatenate(
            [ragged_tests._dense_ref(dense[:1], n), ragged_tests._dense_ref(dense[1:], rows + 3)]
        )
    assert_close(out, ref, "bfloat16", kernel="ragged", case=f"chunk {n} + {rows} decode")
    assert not np.asarray(out[n + rows :]).any(), "padding rows must be zero"


PREFILL_CASES = cases(
    ("llama-700-page16-bf16", dict(n=700, heads=(32, 8), head_dim=128, page_size=16,
                                   dtype="bfloat16"),
     dict(n=77, heads=(8, 2), head_dim=64, page_size=8)),
    ("gqa4-77-page8-f32", dict(n=77, heads=(8, 2), head_dim=64, page_size=8, dtype="float32"),
     True),
)  # fmt: skip


@pytest.mark.parametrize("spec", PREFILL_CASES)
def test_ragged_prefill_in_one_go_and_in_chunks(spec):
    """One prompt prefilled whole, then in 6 random chunks over the pages earlier ones wrote.

    Slots not written yet are NaN. Every call pads to the same T (one compiled kernel).
    """
    n, (h, kh), d, s, dtype = (spec[k] for k in ("n", "heads", "head_dim", "page_size", "dtype"))
    rng = np.random.default_rng(2)

    def rnd(*shape):  # as the kernel sees them: rounded to dtype
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))

    q, k, v = rnd(n, h, d), rnd(n, kh, d), rnd(n, kh, d)
    with F32_MATMULS():
        dense = np.asarray(reference.causal_prefill(q[None], k[None], v[None])[0])
    max_pages = -(-n // s)
    table = rng.permutation(max_pages + 2)[:max_pages].astype(np.int32)
    bucket = n + 3

    def run(pools, start, end):
        for pool, x in zip(pools, (k, v), strict=True):
            t = np.arange(start, end)
            pool[:, table[t // s], t % s] = x[start:end].transpose(1, 0, 2)
        rows = np.concatenate([q[start:end], rnd(bucket - (end - start), h, d)])
        args = (
            jnp.asarray(rows, dtype),
            jnp.asarray(pools[0], dtype),
            jnp.asarray(pools[1], dtype),
            jnp.asarray(table[None]),
            jnp.asarray([end], jnp.int32),
            jnp.asarray([0, end - start], jnp.int32),
        )
        out = ragged_paged_attention(*args, backend="gpu", interpret=INTERPRET)
        assert not np.asarray(out[end - start :]).any(), "padding rows must be zero"
        return out[: end - start]

    def fresh_pools():
        return [np.full((kh, max_pages + 2, s, d), np.nan, np.float32) for _ in "kv"]

    one_go = run(fresh_pools(), 0, n)
    assert_close(one_go, dense, dtype, kernel="ragged", case="prefill one go", **spec)
    bounds = [0, *np.sort(rng.choice(np.arange(1, n), 5, replace=False)).tolist(), n]
    pools = fresh_pools()
    chunked = jnp.concatenate(
        [run(pools, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    )
    assert_close(chunked, dense, dtype, kernel="ragged", case="prefill chunks", **spec)


# ---------------------------------------------------------------- backend="auto"


@contextlib.contextmanager
def kernel_spy():
    """Counts calls of the GPU kernels' entry points (made at trace time under jit)."""
    calls = collections.Counter()
    with pytest.MonkeyPatch.context() as mp:
        for name, module, attr in [
            ("decode", "pallas_kernels.paged_decode.gpu", "paged_decode_gpu"),
            ("ragged", "pallas_kernels.ragged.gpu", "ragged_paged_attention_gpu"),
        ]:
            mod = importlib.import_module(module)
            real = getattr(mod, attr)

            def spy(*args, _real=real, _name=name, **kwargs):
                calls[_name] += 1
                return _real(*args, **kwargs)

            mp.setattr(mod, attr, spy)
        yield calls


def test_auto_backend_runs_the_gpu_kernels(monkeypatch):
    if INTERPRET and not ON_GPU:  # "auto" decides from the platform: pretend it is a GPU
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve_backend("auto") == "gpu"
    case = DecodeCase(**DECODE_CASES[0].values[0])  # same shape: no new compile
    q, k, v, k_bad, v_bad, lengths, page_table = decode_inputs(case, seed=1)
    q_lens, ctx_lens = mixed_lens(16)
    args, dense = ragged_tests._batch(
        np.random.default_rng(3), q_lens, ctx_lens, heads=(8, 2), head_dim=64, page_size=16,
        max_pages=4, pad_rows=5, poison=True,
    )  # fmt: skip
    with kernel_spy() as calls:
        out = paged_decode_attention(
            q, k_bad, v_bad, lengths, page_table, backend="auto", interpret=INTERPRET
        )
        ragged_out = ragged_paged_attention(*args, backend="auto", interpret=INTERPRET)
    assert calls == {"decode": 1, "ragged": 1}
    assert_close(out, decode_reference(case, q, k, v, lengths, page_table), case.dtype)
    with F32_MATMULS():
        ref = ragged_tests._dense_ref(dense, args[0].shape[0])
    assert_close(ragged_out, ref, "float32")


@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_invalid_page_table_padding_is_never_read(kind):
    """-1 and out-of-range ids in the page-table entries a call does not read (past each
    length, wholly before each window), called eagerly: the compiled kernel gives the
    same bits as with valid ids there (a load through a padding entry would fault, read
    the NaN that poisons every page no read entry names, or differ)."""
    rng = np.random.default_rng(21)
    page_size, max_pages, num_pages, window = 16, 8, 56, 40
    ctx = np.array([0, 1, 17, 128, 100, 64])  # 128: pages 0-4 wholly before the window
    q_lens = np.array([0, 1, 1, 1, 30, 64]) if kind == "ragged" else np.ones_like(ctx)
    lo = np.maximum(ctx - q_lens - window + 1, 0)
    first, end = lo // page_size, -(-ctx // page_size)
    valid = rng.permutation(num_pages)[: len(ctx) * max_pages].reshape(len(ctx), max_pages)
    bad = valid.copy()
    for b in range(len(ctx)):
        unread = [i for i in range(max_pages) if not first[b] <= i < end[b]]
        bad[b, unread] = np.resize([-1, 1 << 20, num_pages], len(unread))
    read = {int(valid[b, i]) for b in range(len(ctx)) for i in range(first[b], end[b])}
    k, v = (rng.standard_normal((2, num_pages, page_size, 64)).astype(np.float32) for _ in "kv")
    k_bad, v_bad = k.copy(), v.copy()
    dead = [p for p in range(num_pages) if p not in read]
    k_bad[:, dead], v_bad[:, dead] = np.nan, np.nan
    k, v, k_bad, v_bad = (jnp.asarray(x, jnp.bfloat16) for x in (k, v, k_bad, v_bad))
    valid, bad = (jnp.asarray(t, jnp.int32) for t in (valid, bad))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    opts = dict(sliding_window=window, backend="gpu", interpret=INTERPRET)
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()), 8, 64)), jnp.bfloat16)
    ctx_j = jnp.asarray(ctx, jnp.int32)
    if kind == "decode":
        out, same = (
            paged_decode_attention(q, k_bad, v_bad, ctx_j, t, **opts) for t in (bad, valid)
        )
        with F32_MATMULS():
            want = reference.paged_attention_xla(
                f32(q), f32(k), f32(v), ctx_j, valid, sliding_window=window
            )
    else:
        loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        out, same = (
            ragged_paged_attention(q, k_bad, v_bad, t, ctx_j, loc, **opts) for t in (bad, valid)
        )
        with F32_MATMULS():
            want = reference.ragged_paged_attention_xla(
                f32(q), f32(k), f32(v), valid, ctx_j, loc, sliding_window=window
            )
    np.testing.assert_array_equal(np.asarray(f32(out)), np.asarray(f32(same)))
    assert_close(out, want, "bfloat16", kind=kind)


def test_the_largest_pool_the_int32_guard_allows_is_read_to_its_last_element():
    """A Llama-3-8B pool of exactly `GPU_MAX_POOL_ELEMENTS` elements (131,072 pages of
    16 tokens, 4 GiB per bf16 array), the most `validation.check_gpu_pool` lets the GPU
    kernels take: sequences whose pages are the pool's last ones (kv head 7's last page
    ends at element 2**31 - 1) and its first, both kernels, against the reference on the
    pages they name copied into a small pool. An offset computed past int32 would read
    the wrong page (or fault). Interpreted: the same logic on a 48-page pool."""
    from pallas_kernels.validation import GPU_MAX_POOL_ELEMENTS, check_gpu_pool

    k_heads, page_size, d, heads = (2, 16, 64, 8) if INTERPRET else (8, 16, 128, 32)
    num_pages = 48 if INTERPRET else GPU_MAX_POOL_ELEMENTS // (k_heads * page_size * d)
    shape = (k_heads, num_pages, page_size, d)
    check_gpu_pool(shape)
    if not INTERPRET:
        with pytest.raises(ValueError, match="int32 offsets"):
            check_gpu_pool((k_heads, num_pages + 1, page_size, d))
    max_pages, lengths = 6, np.array([6 * page_size, 5 * page_size - 3, 1, 70])
    rng = np.random.default_rng(5)
    table = np.stack(
        [
            num_pages - 1 - np.arange(max_pages),  # the last pages, the very last first
            num_pages - 1 - rng.permutation(40)[:max_pages],
            np.arange(max_pages),
            np.r_[num_pages - 1, 0, num_pages // 2, num_pages - 2, 1, 2],
        ]
    ).astype(np.int32)
    used = np.unique(table)
    small_table = jnp.asarray(np.searchsorted(used, table), jnp.int32)
    kk, kv, kq = jax.random.split(jax.random.key(3), 3)
    # (a kv head at a time: 2**28 elements per draw, far from any int32 limit of its own)
    k, v = (
        jnp.stack(
            [jax.random.normal(h, shape[1:], jnp.bfloat16) for h in jax.random.split(x, k_heads)]
        )
        for x in (kk, kv)
    )
    q = jax.random.normal(kq, (len(lengths), heads, d), jnp.bfloat16)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    k_small, v_small = (f32(x[:, jnp.asarray(used)]) for x in (k, v))
    table_j, lens_j = jnp.asarray(table), jnp.asarray(lengths, jnp.int32)
    with F32_MATMULS():
        want = reference.paged_attention_xla(f32(q), k_small, v_small, lens_j, small_table)
    opts = dict(backend="gpu", interpret=INTERPRET)
    out = paged_decode_attention(q, k, v, lens_j, table_j, **opts)
    assert_close(out, want, "bfloat16", kernel="decode", num_pages=num_pages)
    loc = jnp.arange(len(lengths) + 1, dtype=jnp.int32)  # one query token per sequence
    out = ragged_paged_attention(q, k, v, table_j, lens_j, loc, **opts)
    assert_close(out, want, "bfloat16", kernel="ragged", num_pages=num_pages)


# ---------------------------------------------------------------- the engine

PROMPTS = ("def main():\n", "import os\n", "class Config:\n    def __init__(self")
NUM_PROMPTS, NUM_TOKENS = (2, 6) if INTERPRET else (3, 64)
NEAR_TIE = 2e-2  # top-two logit gap / max(1, |top logit|) below which bf16 paths may fork


def engine(backend: str, **kwargs):
    from pagedjax import decode
    from pagedjax.engine import LLM

    # 72 pages: a geometry no other test uses, so the kernel spy sees this engine's traces.
    geometry = dict(page_size=16, num_pages=72, max_num_seqs=4)
    if INTERPRET:  # the interpreter pays for every padded grid cell
        geometry["buckets"] = decode.Buckets(min_tokens=8, min_seqs=1, min_pages=1)
    interpret = INTERPRET and backend != "xla"
    return LLM(backend=backend, interpret=interpret, **geometry, **kwargs)


def greedy_tokens(llm, num_tokens: int) -> list[list[int]]:
    from pagedjax.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outs = llm.generate(list(PROMPTS[:NUM_PROMPTS]), params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def xla_tokens():
    return greedy_tokens(engine("xla"), NUM_TOKENS)


def check_greedy_equal(llm, got, want) -> list[dict]:
    """Tokens equal, or they fork where the dense model's top two are a near tie.

    Returns one dict per prompt: where it forked (None: never) and, there, the dense
    model's relative top-two margin and its logprob gap between the two choices.
    """
    from pagedjax import model

    forward = jax.jit(model.forward)
    report = []
    for prompt, g, w in zip(PROMPTS, got, want, strict=False):
        assert len(g) == len(w)
        fork = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        row = dict(prompt=prompt, tokens=len(g), first_divergence=fork)
        if fork is not None:
            ids = llm.tokenizer.encode(prompt)
            seq = [*ids, *w[:fork]]
            buf = np.zeros((1, llm.config.max_position_embeddings), np.int32)
            buf[0, : len(seq)] = seq
            logits = np.asarray(forward(llm.params, jnp.asarray(buf))[0, len(seq) - 1])
            top2 = np.sort(logits)[-2:]
            logp = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
            row.update(
                margin=float((top2[1] - top2[0]) / max(1.0, abs(float(top2[1])))),
                logprob_gap=float(logp[w[fork]] - logp[g[fork]]),
            )
        record(kind="engine", **row)
        report.append(row)
    for row in report:
        assert row["first_divergence"] is None or row["margin"] < NEAR_TIE, (
            f"greedy tokens fork at a clear margin: {row}"
        )
    return report


def test_engine_gpu_backend_equals_xla(xla_tokens):
    """The demo model (bf16, as shipped): greedy tokens with the Pallas kernels == XLA."""
    with kernel_spy() as calls:
        llm = engine("gpu")
        got = greedy_tokens(llm, NUM_TOKENS)
    assert calls["ragged"] > 0 and calls["decode"] > 0, f"kernels traced: {dict(calls)}"
    assert [len(t) for t in got] == [NUM_TOKENS] * NUM_PROMPTS
    check_greedy_equal(llm, got, xla_tokens)


def test_engine_weight_update_compiles_nothing():
    """A warm engine's `update_params` with new weights as `init_params` makes them
    (uncommitted) compiles no program on the device: XLA compiles a program again for
    inputs committed where they were not, and the engine's first update recompiled every
    step program before it committed its weights, cache and feed (`compile_counts`
    counts compiles without a trace too)."""
    from pagedjax import decode, model

    llm = engine("gpu")
    greedy_tokens(llm, 4)
    before = decode.compile_counts()
    llm.update_params(model.init_params(llm.config, seed=1))
    greedy_tokens(llm, 4)
    record(kind="compiles", before=before, after_update=decode.compile_counts())
    assert decode.compile_counts() == before


def test_engine_fp8_kv_gpu_backend_equals_xla():
    """FP8 KV pages (float8_e4m3fn): the Pallas kernels upcast them as the XLA path does."""
    want = greedy_tokens(engine("xla", kv_cache_dtype="fp8"), NUM_TOKENS)
    with kernel_spy() as calls:
        llm = engine("gpu", kv_cache_dtype="fp8")
        got = greedy_tokens(llm, NUM_TOKENS)
    assert llm.cache.k[0].dtype == jnp.float8_e4m3fn
    assert calls["ragged"] > 0 and calls["decode"] > 0, f"kernels traced: {dict(calls)}"
    check_greedy_equal(llm, got, want)


def test_engine_prompt_logprobs_gpu_backend_equals_xla():
    """Prompt logprobs of one step longer than a scoring chunk (`planner.SCORE_ROWS`
    rows of the LM head at a time): with the Pallas kernels as on the XLA path."""
    from pagedjax import planner
    from pagedjax.engine import SamplingParams

    n, per = (2, 12) if INTERPRET else (3, 200)  # 600 tokens: 3 chunks of 256 rows
    llm_x = engine("xla")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, llm_x.config.vocab_size, per).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    want = llm_x.generate(prompts, params)
    with kernel_spy() as calls:
        llm = engine("gpu")
        got = llm.generate(prompts, params)
    assert calls["ragged"] > 0, f"kernels traced: {dict(calls)}"
    assert INTERPRET or n * per > planner.SCORE_ROWS
    worst = 0.0
    for prompt, g, w in zip(prompts, got, want, strict=True):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(prompt)
        pairs = zip(prompt[1:], g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True)
        for tok, eg, ew in pairs:
            a, b = eg[tok].logprob, ew[tok].logprob  # the prompt token's own
            assert np.isfinite(a)
            worst = max(worst, abs(a - b) / max(1.0, abs(b)))
    record(kind="prompt_logprobs", tokens=n * per, worst_rel_diff=worst)
    assert worst < 5e-2, f"prompt logprobs differ by up to {worst:.3g} (relative)"


@pytest.mark.skipif(INTERPRET, reason="device memory planning needs a GPU's memory_stats()")
def test_kv_memory_fraction_fits_device_memory(xla_tokens):
    """LLM() sizes its cache from kv_memory_fraction (0.8 of free memory) and runs."""
    from pagedjax.engine import LLM, SamplingParams

    llm = LLM(max_num_seqs=8)  # neither num_pages nor kv_memory_fraction: the fraction
    stats = jax.devices()[0].memory_stats()
    pages = llm.cache_config.num_pages
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.cache))
    per_page = cache_bytes // pages
    record(kind="kv_memory", pages=pages, cache_bytes=cache_bytes, **stats)
    assert pages > 8 * math.ceil(llm.max_model_len / llm.cache_config.page_size)
    assert cache_bytes <= 0.8 * stats["bytes_limit"] + per_page
    assert stats["bytes_in_use"] <= stats["bytes_limit"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]], params)]
    check_greedy_equal(llm, got, [xla_tokens[0][:8]])
