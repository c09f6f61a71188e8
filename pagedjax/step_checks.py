"""The host-side checks a step runs before anything is traced.

`prefill_step` and `decode_step` (`pagedjax.decode`, which re-exports `check_cache`)
call `_check_step` (the params, the `StepInput`'s kind, shapes and dtypes, the backend
and top-k knobs) and then `check_cache` (the cache against the params and the geometry
the input was built for, the ids in the input's numpy arrays against both, and each
row's tokens against its context length and page table) on every call, so that a wrong
argument fails with a message naming it rather than deep in tracing, or, worse, runs:
slots of another page size, page ids past the pool, a token written into another
sequence's page.
`generate` checks its params with `_check_params`.

They are apart from `pagedjax.decode` because they are plain host code over types,
shapes, dtypes and placements, with nothing traced: they read a `StepInput`'s fields and
the model's config and mesh, and none of the step's math.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pagedjax import cache as cache_lib
from pagedjax import model as model_lib
from pagedjax import sampling, sharding
from pagedjax.step_input import StepInput, is_int
from pagedjax.step_input_checks import _first
from pallas_kernels.dispatch import resolve_backend
from pallas_kernels.validation import check_dtypes


def check_cache(
    params: model_lib.Params, cache: cache_lib.PagedKVCache, inp: StepInput | None = None
) -> None:
    """Raises unless `cache` fits `params` and the geometry `inp` was built for.

    The steps call it on the host before tracing: a cache made for another model, page
    size or page count, or not split over the params' mesh, would otherwise fail deep in
    tracing or, worse, run: slots of another page size, page ids past the pool.

    Raises:
      ValueError: layers, kv heads, head dim, page size or page count differ; `inp`'s
        numpy arrays hold a token id outside the vocabulary (history and bias ids too),
        a position past max_position_embeddings, a page id or slot outside the cache, a
        context length outside [0, what its page-table row holds], a row index outside
        the step's tokens, a feed index outside the feed, copy pairs whose outcome hangs
        on their order, a 64-bit int past int32 (seeds: uint32), or a row whose written
        tokens are not at the positions and slots its context length and page table
        say, or padding that writes (`_check_rows`); its pools differ from one another
        in shape or dtype (any layer's K or V), or one array is two of them; a
        tensor-parallel model's cache is not split over kv heads on its mesh
        (`sharding.create_cache`), or a single-device model's is spread; the cache was
        donated to an earlier step (its arrays are deleted: use the cache that step
        returned).
      TypeError: `params` is not a `Params` (`model.split_model`), `cache` is not a
        `PagedKVCache`, or its storage dtype is one the model's attention cannot read
        (`CacheConfig`).
    """
    _check_params(params)
    cfg = params.config
    if not isinstance(cache, cache_lib.PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    tp = sharding.tensor_parallel_size(params.mesh)
    k, v = cache.k, cache.v
    if len(k) != cfg.num_layers or len(v) != cfg.num_layers:
        raise ValueError(
            f"the cache has {len(k)} K and {len(v)} V layers; the model has {cfg.num_layers}"
        )
    arrays = _device_arrays((*k, *v))
    if any(x.is_deleted() for x in arrays):  # (one: a cache assembled from a donated one's)
        raise ValueError(
            "the cache's arrays are deleted: it was donated to an earlier step; pass the "
            "cache that step returned (`out, cache = step(params, cache, inp)`)"
        )
    shape, kv_heads = k[0].shape, sharding.cache_kv_heads(cfg, tp)
    if len(shape) != 4 or shape[0] != kv_heads or shape[3] != cfg.head_dim:
        over = f" over {tp} devices" if tp > 1 else ""
        # K < tp replicates kv heads to one row per device: a cache made for another tp
        other = len(shape) == 4 and shape[3] == cfg.head_dim and shape[0] > cfg.num_kv_heads
        hint = (
            f" (a cache made for tensor_parallel={shape[0]}, whose {cfg.num_kv_heads} kv "
            "heads are replicated to one per device; make it for this model's mesh)"
            if other
            else ""
        )
        raise ValueError(
            f"cache pools must be [K, P, S, D] with K={kv_heads} kv heads and "
            f"D={cfg.head_dim} for this model{over}, got {shape}{hint}"
        )
    _check_pools(k, v, arrays)
    try:
        check_dtypes(cfg.jnp_dtype, k[0].dtype)
    except TypeError as e:
        raise TypeError(f"a {k[0].dtype} cache for a {cfg.dtype} model: {e}") from None
    if inp is not None:
        for name, built, got in (
            ("page_size", inp.page_size, shape[2]),
            ("num_pages", inp.num_pages, shape[1]),
        ):
            if built and built != got:
                raise ValueError(
                    f"the step was built for {name}={built}, but the cache has {name}={got}"
                )
        _check_input_values(cfg, inp, num_pages=shape[1], page_size=shape[2])
    leaf = k[0]
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
        return  # under an outer trace, or numpy: placement is jit's
    devices = leaf.sharding.device_set
    if params.mesh is None:
        if len(devices) > 1:
            raise ValueError(
                f"the cache is spread over {len(devices)} devices but the model has no "
                "mesh; shard both (LLM(tensor_parallel=...), sharding.shard_params and "
                "sharding.create_cache) or neither"
            )
    elif not leaf.sharding.is_equivalent_to(sharding.cache_sharding(params.mesh), leaf.ndim):
        n = len(devices)
        other = f" (it is on {n} device{'s' * (n > 1)}, the model on {tp})" if n != tp else ""
        raise ValueError(
            f"the cache is placed as {leaf.sharding}, not split over kv heads on the model's "
            f"mesh {dict(params.mesh.shape)}{other}; create it with "
            "sharding.create_cache(cfg, cache_cfg, params.mesh)"
        )


def _device_arrays(pools) -> list:
    """The pools that are concrete jax arrays (none under an outer trace, or numpy).
    (Their type taken from the first: `isinstance(x, jax.Array)` per pool cost 80 us a
    step for 80 layers.)"""
    first = pools[0]
    if not isinstance(first, jax.Array) or isinstance(first, jax.core.Tracer):
        return [
            x for x in pools[1:] if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        ]
    kind = type(first)
    return [x for x in pools if type(x) is kind]


def _check_pools(k, v, arrays) -> None:
    """Every layer's K and V pools alike (layer 0's K shape and dtype), and no device
    array (of `arrays`) twice: the steps check layer 0 against the model, and a layer of
    another page count or dtype ran (its page ids clamped, its tokens dropped, or read
    at another precision); one array as two pools (`PagedKVCache(k=(z,) * L, ...)`) was
    XLA's "Attempt to donate the same buffer twice", after a whole compile."""
    aval = arrays[0].aval if arrays else None
    alike = len(arrays) == 2 * len(k) and all(x.aval == aval for x in arrays)  # (fast path)
    shape, dtype = k[0].shape, k[0].dtype
    for name, pools in () if alike else (("K", k), ("V", v)):
        for i, x in enumerate(pools):
            if x.shape != shape or x.dtype != dtype:
                raise ValueError(
                    f"{name} pools {x.shape} {x.dtype} differ from K pools {shape} {dtype} "
                    f"(layer {i}): every pool of a cache is alike"
                )
    ids = {id(x) for x in arrays}
    if len(ids) < len(arrays):  # (the names only once one is found)
        names = [f"layer {i} {name}" for name in ("K", "V") for i in range(len(k))]
        first = {}
        for name, x in zip(names, (*k, *v), strict=True):
            if id(x) in first:
                raise ValueError(
                    f"the cache's {first[id(x)]} and {name} pools are one array: each pool "
                    "needs its own, as `cache.create` makes them (the steps donate every pool)"
                )
            if id(x) in ids:
                first[id(x)] = name


def _check_params(params) -> None:
    if not isinstance(params, model_lib.Params):
        raise TypeError(
            "params must be a split model, pagedjax.model.Params (model.split_model(m), "
            f"model.init_params, weights.load_checkpoint), got {type(params).__name__}"
        )


def _check_step(
    params, inp, decode, backend, num_top_logprobs, num_prompt_top_logprobs, **flags
) -> None:
    """The host-side checks of a step's input kind and knobs, before anything is traced.

    `flags` (interpret, return_logits) are static arguments of the jitted step: a
    non-bool would be taken for its truth value and compile a program of its own
    (interpret may also be a `pltpu.InterpretParams`, which the TPU kernels take).
    """
    _check_params(params)
    resolve_backend(backend)  # a name in BACKENDS, else a ValueError naming it
    for name, value in flags.items():
        # (interpret may also be the TPU interpreter's settings, which its kernels take)
        params_ok = name == "interpret" and isinstance(value, pltpu.InterpretParams)
        if not isinstance(value, (bool, np.bool_)) and not params_ok:
            also = " (or pltpu.InterpretParams)" if name == "interpret" else ""
            raise ValueError(f"{name} must be a bool{also}, got {name}={value!r:.80}")
    if not isinstance(inp, StepInput):
        raise TypeError(f"inp must be a StepInput (build_step_input), got {type(inp).__name__}")
    v = params.config.vocab_size
    for name, k in (
        ("num_top_logprobs", num_top_logprobs),
        ("num_prompt_top_logprobs", num_prompt_top_logprobs),
    ):
        if not is_int(k) or not 0 <= k <= v:
            raise ValueError(
                f"{name} must be an int in [0, {v}] (the vocabulary), got {name}={k!r}"
            )
    _check_input_shapes(inp)
    if inp.decode != decode:
        raise ValueError(
            f"{'decode' if decode else 'prefill'}_step got a StepInput built with "
            f"decode={inp.decode}; use {'prefill' if decode else 'decode'}_step or `step`"
        )
    if num_prompt_top_logprobs and inp.target_ids is None:
        raise ValueError("num_prompt_top_logprobs needs a StepInput with target_ids")
    if (inp.feed is None) != (inp.token_src is None):
        raise ValueError("StepInput.feed and token_src go together (both or neither)")
    if inp.feed is not None:
        b, f = inp.context_lens.shape[0], inp.feed.shape[0]
        if f < b:
            raise ValueError(f"StepInput.feed holds {f} tokens, fewer than the {b} rows")


# StepInput's index fields by their shape: [T] per token, [B] per row; feed is [F].
_PER_TOKEN = ("token_ids", "positions", "slot_mapping", "target_ids", "token_src", "lora_slots")
_PER_ROW = (
    "context_lens", "logits_indices", "temperature", "top_k", "top_p", "seeds", "sample_steps",
    "min_p",
)  # fmt: skip
_INTS = _PER_TOKEN + (
    "page_table", "context_lens", "query_start_loc", "logits_indices", "copy_src", "copy_dst",
    "top_k", "seeds", "sample_steps", "feed",
)  # fmt: skip


def _array_fields(cls) -> tuple[str, ...]:
    nested = ("penalties", "logit_bias")
    fields = dataclasses.fields(cls)
    return tuple(f.name for f in fields if not f.metadata.get("static") and f.name not in nested)


# (StepInput's attribute, that pytree's class, its array fields)
_ARRAYS = tuple(
    (owner, _array_fields(cls))
    for owner, cls in (
        ("", StepInput),
        ("penalties", sampling.Penalties),
        ("logit_bias", sampling.LogitBias),
    )
)


def _check_arrays(inp: StepInput) -> None:
    """Every field of `inp` (and of its penalties and logit bias) a numpy or jax array,
    or None where optional: jit takes a list as a pytree of scalars, so one put in by
    hand (`dataclasses.replace(inp, token_ids=[...])`) failed inside tracing ("'list'
    object has no attribute 'dtype'"), or compiled a program of its own."""
    for owner, names in _ARRAYS:
        value = getattr(inp, owner) if owner else inp
        if value is None:
            continue
        for name in names:
            x = getattr(value, name)
            if x is not None and not isinstance(x, (np.ndarray, jax.Array)):
                where = f"{owner}.{name}" if owner else name
                raise TypeError(
                    f"StepInput.{where} must be a numpy or jax array, got "
                    f"{type(x).__name__} {x!r:.60}"
                )


def _check_input_shapes(inp: StepInput) -> None:
    """A StepInput's fields fit one another ([T] tokens, [B] rows, [C] copies; T == B for
    decode) and its index fields hold ints: one changed by hand (`dataclasses.replace`)
    would otherwise fail inside tracing with jax's message, or index with floats. Shapes
    only, so it holds under an outer trace too."""
    _check_arrays(inp)
    shapes = {
        name: None if getattr(inp, name) is None else np.shape(getattr(inp, name))
        for name in (*_INTS, "temperature", "top_p", "min_p")
    }
    t_shape, table = shapes["token_ids"], shapes["page_table"]
    if len(t_shape) != 1 or len(table) != 2:
        raise ValueError(
            f"StepInput.token_ids must be [T] and page_table [B, max_pages], got shapes "
            f"{t_shape} and {table}"
        )
    (t,), b = t_shape, table[0]
    want = {name: (t,) for name in _PER_TOKEN} | {name: (b,) for name in _PER_ROW}
    want |= {"query_start_loc": (b + 1,), "copy_dst": shapes["copy_src"]}
    for name, shape in want.items():
        if shapes[name] is not None and shapes[name] != shape:
            what = "token_ids' [T]" if name in _PER_TOKEN else "page_table's [B]"
            raise ValueError(
                f"StepInput.{name} has shape {shapes[name]}, expected {shape} (from {what}: "
                f"T={t}, B={b})"
            )
    for name in ("copy_src", "feed"):
        if shapes[name] is not None and len(shapes[name]) != 1:
            raise ValueError(f"StepInput.{name} must be 1-D, got shape {shapes[name]}")
    if inp.decode and t != b:
        raise ValueError(
            f"a decode StepInput has one token per row, but token_ids has {t} tokens and "
            f"page_table {b} rows"
        )
    for name in _INTS:
        x = getattr(inp, name)
        dtype = None if x is None else getattr(x, "dtype", None)
        dtype = np.asarray(x).dtype if x is not None and dtype is None else dtype
        if dtype is not None and np.dtype(dtype).kind not in "iu":
            raise TypeError(f"StepInput.{name} must hold ints, got dtype {dtype}")


def _check_input_values(cfg, inp: StepInput, num_pages: int, page_size: int) -> None:
    """The ids a StepInput's host (numpy) arrays hold are inside the vocabulary, the model's
    positions and the cache, its context lengths inside what its page-table rows hold,
    and its row offsets inside its tokens: gathers clamp and scatters drop what is not,
    without a word. `build_step_input` checked them against its configs; this catches an
    input changed by hand (a reused page table, a context advanced past it) or built for
    another model. Also: each row's tokens where its context says (`_check_rows`), copy
    pairs whose outcome does not hang on their order, and no 64-bit int past int32
    (uint32 for seeds), which jax without x64 would wrap. Device arrays are left unread
    (no sync)."""
    _check_int32(inp)
    v, m = cfg.vocab_size, cfg.max_position_embeddings
    f = 0 if inp.feed is None else np.shape(inp.feed)[0]
    pen, bias = inp.penalties, inp.logit_bias
    for name, x, what, lo, hi, where in (
        ("token_ids", inp.token_ids, "token id", 0, v, "the vocabulary"),
        ("target_ids", inp.target_ids, "token id", -1, v, "the vocabulary (-1: none)"),
        ("positions", inp.positions, "position", 0, m, f"the model's max_position_embeddings={m}"),
        ("page_table", inp.page_table, "page id", 0, num_pages, "the cache's pages"),
        (
            "slot_mapping", inp.slot_mapping, "slot", -1, num_pages * page_size,
            "the cache's slots (-1: padding)",
        ),
        ("copy_src", inp.copy_src, "page id", 0, num_pages, "the cache's pages"),
        ("copy_dst", inp.copy_dst, "page id", -1, num_pages, "the cache's pages (-1: padding)"),
        (
            "token_src", inp.token_src, "feed index", -1, f,
            f"the feed's {f} tokens (-1: its own token)",
        ),
        (
            "penalties.ids", None if pen is None else pen.ids, "token id", -1, v,
            "the vocabulary (-1: padding)",
        ),
        (
            "logit_bias.ids", None if bias is None else bias.ids, "token id", -1, v,
            "the vocabulary (-1: padding)",
        ),
        (
            "logit_bias.allowed", None if bias is None else bias.allowed, "token id", -1, v,
            "the vocabulary (-1: padding)",
        ),
    ):  # fmt: skip
        if not isinstance(x, np.ndarray) or not x.size:
            continue
        if x.min() < lo or x.max() >= hi:  # (two reductions: no temporaries on this path)
            bad = (x < lo) | (x >= hi)
            raise ValueError(
                f"StepInput.{name} holds {what} {int(x[bad][0])}, outside {where} [{lo}, {hi})"
            )
    # Row lengths and offsets: past the page table a kernel's page gather clamps (a
    # context one token longer than its row's pages read another page for that token),
    # and past the tokens the logits' row gather does.
    t, max_pages = np.shape(inp.token_ids)[0], np.shape(inp.page_table)[1]
    capacity = f"what a page-table row of {max_pages} pages of {page_size} tokens holds"
    for name, hi, where in (
        ("context_lens", max_pages * page_size, capacity),
        ("query_start_loc", t, f"the step's {t} tokens"),
        ("logits_indices", t - 1, f"the step's {t} token rows"),
    ):
        x = getattr(inp, name)
        if isinstance(x, np.ndarray) and x.size and (x.min() < 0 or x.max() > hi):
            j = _first((x < 0) | (x > hi))
            raise ValueError(f"StepInput.{name}[{j}] is {int(x[j])}, outside [0, {hi}] ({where})")
    _check_copy_pairs(inp.copy_src, inp.copy_dst)
    _check_rows(inp, page_size)


def _check_int32(inp: StepInput) -> None:
    """No 64-bit int array of `inp` holds a value past int32 (seeds: uint32): jax without
    x64 packs it as 32 bits, so a seed of 2**32 + 5 sampled as seed 5."""
    for name in _INTS:
        x = getattr(inp, name)
        if isinstance(x, np.ndarray) and x.dtype.itemsize == 8 and x.size:
            lo, hi = (0, 2**32) if name == "seeds" else (-(2**31), 2**31)
            if x.min() < lo or x.max() >= hi:
                bad = int(x[(x < lo) | (x >= hi)][0])
                raise ValueError(
                    f"StepInput.{name} holds {bad}, outside [{lo}, {hi}): its {x.dtype} array is "
                    f"packed as {'uint32' if lo == 0 else 'int32'} (jax without x64), where "
                    "it would wrap"
                )


def _check_copy_pairs(src, dst) -> None:
    """Numpy copy pairs (`cache.copy_pages` checks them only where concrete, never inside
    the step): `cache.check_copy_pairs`, or their outcome hung on the order XLA applied
    them in."""
    if isinstance(src, np.ndarray) and isinstance(dst, np.ndarray):
        cache_lib.check_copy_pairs(src, dst, f"StepInput copy_src {src}, copy_dst {dst}: ")


def _check_rows(inp: StepInput, page_size: int) -> None:
    """Each row's tokens are where its context says, for numpy inputs: the kernels put row
    b's query i at cache position c = context_lens[b] - q_len + i (q_len its tokens, from
    query_start_loc, which starts at 0 and never decreases; decode: token b is row b's
    last, or padding where context_lens[b] is 0) and read position c of a row from slot
    `page_table[b, c // S] * S + c % S`. So a real token that writes (slot >= 0) must be at
    position c and write that slot, and a padding token's slot must be -1; a token that
    writes nothing (-1: the engine's row of a sequence gone before its step) is not
    checked, as its output is the caller's to drop. Otherwise the step ran:
    its K/V written into a page of another row (overwriting that row's tokens), or its
    row's tokens read at positions other than those written. (int32, one pass over the
    tokens: 10 us a decode step of 256 rows; the error is looked for only on a failure.)"""
    names = ("positions", "slot_mapping", "page_table", "context_lens", "query_start_loc")
    if not all(isinstance(getattr(inp, n), np.ndarray) for n in names):
        return
    pos, slots, table = inp.positions, inp.slot_mapping, inp.page_table
    ctx = inp.context_lens.astype(np.int32, copy=False)
    b, width = table.shape
    if inp.decode:  # (T == B)
        rows = np.arange(b, dtype=np.int32)
        c = ctx - 1
        real = ctx > 0
        end, past = b, "of a padding row (context_lens 0)"
    else:
        qsl = inp.query_start_loc.astype(np.int32, copy=False)
        q = qsl[1:] - qsl[:-1]
        _check_row_offsets(qsl, q, ctx)
        end = int(qsl[-1])
        rows = np.repeat(np.arange(b, dtype=np.int32), q)
        c = np.arange(end, dtype=np.int32)
        c += (ctx - qsl[1:])[rows]
        real = None
        past = f"past the rows' tokens (query_start_loc[{b}]={end})"
    page, offset = np.divmod(np.maximum(c, 0), page_size)
    want = np.take(table, rows * width + page) * page_size + offset
    got = slots[:end]
    ok = ((pos[:end] == c) & (got == want)) | (got == -1)
    if real is not None:
        ok = np.where(real, ok, got == -1)
    if ok.all() and (slots[end:] == -1).all():
        return
    tokens = np.arange(slots.shape[0])
    padding = tokens >= end if real is None else np.concatenate([~real, tokens[end:] >= 0])
    bad = padding & (slots != -1)
    if bad.any():
        i = _first(bad)
        raise ValueError(
            f"StepInput.slot_mapping[{i}] is {int(slots[i])} for a padding token {past}: "
            "padding writes nothing (-1)"
        )
    live = np.ones(end, bool) if real is None else real
    bad = live & (got != -1) & (pos[:end] != c)
    if bad.any():
        i = _first(bad)
        r = int(rows[i])
        raise ValueError(
            f"StepInput.positions[{i}] is {int(pos[i])}, but the kernels put token {i} at "
            f"position {int(c[i])} (row {r}: context_lens[{r}]={int(ctx[r])}, less the row's "
            "tokens from this one on): positions, context_lens and query_start_loc must agree"
        )
    i = _first(live & ~ok)
    r, p = int(rows[i]), int(c[i])
    raise ValueError(
        f"StepInput.slot_mapping[{i}] is {int(got[i])}, but token {i} (row {r}, position {p}) "
        f"belongs in slot {int(want[i])} (page_table[{r}, {p // page_size}] * {page_size} + "
        f"{p % page_size}; -1: not written): a slot outside the row's own page overwrites "
        "another's tokens, and the row reads its own slot"
    )


def _check_row_offsets(qsl, q, ctx) -> None:
    """query_start_loc starts at 0 and never decreases, and no row has more tokens this
    step than its context holds."""
    if qsl[0] != 0 or (q < 0).any():
        j = 0 if qsl[0] != 0 else _first(q < 0) + 1
        raise ValueError(
            f"StepInput.query_start_loc must start at 0 and never decrease (row b's tokens "
            f"are query_start_loc[b]:query_start_loc[b + 1]), got query_start_loc[{j}]="
            f"{int(qsl[j])} in {qsl}"
        )
    if (ctx < q).any():
        j = _first(ctx < q)
        raise ValueError(
            f"StepInput.context_lens[{j}] is {int(ctx[j])}, fewer than row {j}'s {int(q[j])} "
            f"tokens this step (query_start_loc[{j}:{j + 2}] = {qsl[j : j + 2].tolist()}): "
            "a context counts the row's cached tokens, this step's included"
        )


def check_lora(params, inp: StepInput, lora) -> None:
    """`lora` (LoRAWeights or None) against the model and `inp.lora_slots`, on the host:
    weights shaped for this model, and every slot in [0, lora.num_slots] (checked where
    the slots are concrete, not under an outer trace)."""
    from pagedjax.lora import LoRAWeights, module_dims

    if lora is None:
        if inp.lora_slots is not None:
            raise ValueError("StepInput.lora_slots given without LoRA weights (lora=None)")
        return
    if not isinstance(lora, LoRAWeights):
        raise TypeError(f"lora must be a pagedjax.lora.LoRAWeights or None, got {lora!r:.80}")
    cfg = params.config
    cols = lora.num_slots * lora.rank
    for module, a in lora.a.items():
        n_in, n_out = module_dims(cfg, module)
        got = ([tuple(x.shape) for x in a], [tuple(x.shape) for x in lora.b[module]])
        want = ([(n_in, cols)] * cfg.num_layers, [(cols, n_out)] * cfg.num_layers)
        if got != want:
            raise ValueError(
                f"LoRA weights of {module}: per layer a {got[0][:1]}, b {got[1][:1]} "
                f"({len(got[0])} layers) do not fit the model: expected {cfg.num_layers} "
                f"layers of {want[0][0]} and {want[1][0]}"
            )
    slots = inp.lora_slots
    if slots is not None and not isinstance(slots, jax.core.Tracer):
        slots = np.asarray(jax.device_get(slots))
        top, low = int(slots.max(initial=0)), int(slots.min(initial=0))
        if low < 0 or top > lora.num_slots:
            bad = low if low < 0 else top
            raise ValueError(
                f"StepInput.lora_slots holds slot {bad}; the LoRA weights have slots "
                f"1..{lora.num_slots} (0: none)"
            )
