"""`resources.load_model`: each kind of LLM source, and the dtype override on each."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from pagedjax import decode, model, planner, resources, sharding
from pagedjax.blocks import BlockManager
from pagedjax.config import PRESETS


def test_given_params_are_cast_to_the_dtype_asked_for():
    params = model.init_params(PRESETS["tiny"], seed=3)  # float32 weights
    cfg, cast, _, desc = resources.load_model(params, dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and cast.config == cfg and "cast to bfloat16" in desc
    flat, before = model.params_to_flat(cast), model.params_to_flat(params)
    assert {str(a.dtype) for a in flat.values()} == {"bfloat16"}
    for key, value in before.items():  # the same weights, rounded
        want = np.asarray(value.astype("bfloat16"), np.float32)
        np.testing.assert_array_equal(np.asarray(flat[key], np.float32), want)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 9))
    logits32, logits16 = model.forward(params, tokens), model.forward(cast, tokens)
    err = np.linalg.norm(logits16 - logits32) / np.linalg.norm(logits32)
    assert 0 < err < 3e-2  # computed in bfloat16: close, not equal
    same = resources.load_model(params, dtype="float32")
    assert same[1] is params and same[3] == "given params"
    assert resources.load_model(params)[1] is params


def test_a_bad_dtype_for_given_params_is_named():
    with pytest.raises(ValueError, match="int8"):
        resources.load_model(model.init_params(PRESETS["tiny"], seed=3), dtype="int8")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_size=0), "page_size=0"),  # was a ZeroDivisionError
        (dict(max_num_seqs=0), "max_num_seqs=0"),  # blamed kv_memory_fraction
        (dict(max_model_len=-3), "max_model_len=-3"),
        (dict(page_size=True), "page_size=True"),
        (dict(kv_memory_fraction=1.5), "kv_memory_fraction=1.5"),
    ],
)
def test_plan_num_pages_names_a_bad_size(kwargs, match):
    args = dict(page_size=16, kv_memory_fraction=0.5, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        resources.plan_num_pages(PRESETS["tiny"], **(args | kwargs))
    assert resources.plan_num_pages(PRESETS["tiny"], **args) == 16  # 4 x 64 tokens / 16


@pytest.mark.parametrize("watermark", [0.01, 0.2, 0.0])
@pytest.mark.parametrize(
    "page_size, max_num_seqs, max_model_len", [(4, 1, 512), (16, 64, 512), (16, 3, 100)]
)
def test_cpu_pages_leave_max_num_seqs_sequences_beside_the_watermark(
    watermark, page_size, max_num_seqs, max_model_len
):
    # Was max_num_seqs * ceil(max_model_len / page_size) pages: LLM(max_num_seqs=1,
    # max_model_len=512, page_size=4) on the CPU refused a 512-token request (128 pages,
    # 127 beside the watermark).
    n = resources.plan_num_pages(
        PRESETS["tiny"],
        page_size,
        kv_memory_fraction=1.0,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        watermark=watermark,
    )
    bm = BlockManager(n, page_size, watermark=watermark)
    need = max_num_seqs * planner.peak_pages(max_model_len, page_size)
    assert n - bm.watermark_pages >= need
    smaller = BlockManager(n - 2, page_size, watermark=watermark)  # not wastefully more
    assert n - 2 - smaller.watermark_pages < need


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


def test_plan_num_pages_takes_a_fraction_of_the_free_device_memory():
    cfg = PRESETS["tiny"]
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    per_page = 16 * planner.kv_bytes_per_token(*shape)
    kw = dict(kv_memory_fraction=0.5, max_num_seqs=1, max_model_len=64)
    reserve = resources.step_reserve_bytes(cfg, max_num_batched_tokens=1, max_num_seqs=1)
    dev = _Device(dict(bytes_limit=1000 * per_page + reserve, bytes_in_use=200 * per_page))
    assert resources.plan_num_pages(cfg, 16, device=dev, **kw) == 400  # no max_num_seqs cap
    fp8 = resources.plan_num_pages(cfg, 16, device=dev, kv_dtype="float8_e4m3fn", **kw)
    assert fp8 == 1600  # a float32 model's 4 bytes, 1
    for stats in (None, {}, NotImplementedError("no stats")):  # the CPU's budget, capped
        for budget in (None, 8192):  # (nothing reserved)
            got = resources.plan_num_pages(
                cfg, 16, device=_Device(stats), max_num_batched_tokens=budget, **kw
            )
            assert got == 4
    full = _Device(dict(bytes_limit=1000 * per_page, bytes_in_use=1001 * per_page))
    with pytest.raises(ValueError, match=f"-{per_page} bytes free"):  # the weights took it all
        resources.plan_num_pages(cfg, 16, device=full, **kw)


def test_plan_num_pages_reads_the_default_device(monkeypatch):
    """It read jax.devices()[0] whatever jax.default_device said, where the model and a
    cache without a mesh go."""
    cfg = PRESETS["tiny"]
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    per_page = 16 * planner.kv_bytes_per_token(*shape)
    reserve = resources.step_reserve_bytes(cfg, max_num_batched_tokens=1, max_num_seqs=1)
    dev = _Device(dict(bytes_limit=1000 * per_page + reserve, bytes_in_use=200 * per_page))
    monkeypatch.setattr(sharding, "default_device", lambda: dev)
    kw = dict(kv_memory_fraction=0.5, max_num_seqs=1, max_model_len=64)
    assert resources.plan_num_pages(cfg, 16, **kw) == 400
    monkeypatch.undo()
    cpu = jax.devices()[-1]
    with jax.default_device(cpu):
        assert sharding.default_device() is cpu
    with jax.default_device("cpu"):
        assert sharding.default_device() is jax.devices("cpu")[0]
    assert sharding.default_device() is jax.devices()[0]


def test_plan_num_pages_keeps_each_pool_within_the_gpu_kernels_offsets():
    """A layer's pool [K, P, S, D] past 2**31 elements would wrap the GPU kernels' int32
    offsets: a 1-kv-head fp8 cache on a large device planned more pages than that."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_kv_heads=1, num_heads=2, head_dim=16)
    dev = _Device(dict(bytes_limit=2**40, bytes_in_use=0))
    kw = dict(kv_memory_fraction=1.0, max_num_seqs=1, max_model_len=64, device=dev)
    pages = resources.plan_num_pages(cfg, 16, kv_dtype="float8_e4m3fn", **kw)
    assert pages == 2**31 // (1 * 16 * 16)


def test_plan_num_pages_keeps_slot_ids_in_int32():
    cfg = PRESETS["tiny"]
    kw = dict(kv_memory_fraction=1.0, max_num_seqs=1, max_model_len=64)
    n = resources.plan_num_pages(cfg, 16, device=_Device(dict(bytes_limit=2**60)), **kw)
    assert n * 16 < 2**31  # what BlockManager accepts
    # (the tighter cap: each layer's pool [K, n, 16, D] within 2**31 elements)
    assert n == 2**31 // (cfg.num_kv_heads * 16 * cfg.head_dim)


def test_plan_num_pages_refuses_memory_that_holds_no_page():
    cfg = PRESETS["tiny"]
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    per_page = 16 * planner.kv_bytes_per_token(*shape)
    kw = dict(max_num_seqs=1, max_model_len=64)
    reserve = resources.step_reserve_bytes(cfg, max_num_batched_tokens=1, max_num_seqs=1)
    free = 2 * per_page - 2 + reserve
    almost = _Device(dict(bytes_limit=free, bytes_in_use=0))
    match = f"{free} bytes free.*less {reserve}.*page of {per_page}"
    with pytest.raises(ValueError, match=match):
        resources.plan_num_pages(cfg, 16, kv_memory_fraction=0.5, device=almost, **kw)
    tiny_fraction = per_page / 2 / resources._CPU_KV_BUDGET
    with pytest.raises(ValueError, match=f"kv_memory_fraction={tiny_fraction}.*no page"):
        resources.plan_num_pages(
            cfg, 16, kv_memory_fraction=tiny_fraction, device=_Device(None), **kw
        )


@pytest.mark.parametrize("stats", [None, dict(bytes_limit=2**30)], ids=["cpu", "device"])
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(watermark=1.0), "watermark=1.0"),  # divided by zero
        (dict(watermark=-0.1), "watermark=-0.1"),
        (dict(watermark=True), "watermark=True"),
        (dict(kv_memory_fraction="0.5"), "kv_memory_fraction='0.5'"),  # a TypeError
        (dict(kv_memory_fraction=True), "kv_memory_fraction=True"),  # taken as 1.0
    ],
)
def test_plan_num_pages_names_a_bad_fraction_on_every_device(stats, kwargs, match):
    # A bad watermark was refused on the CPU only: with memory stats it went unchecked.
    kw = dict(kv_memory_fraction=0.5, max_num_seqs=1, max_model_len=64, device=_Device(stats))
    with pytest.raises(ValueError, match=re.escape(match)):
        resources.plan_num_pages(PRESETS["tiny"], 16, **(kw | kwargs))


def test_check_backend():
    import jax

    assert resources.check_backend("xla") == "xla" and resources.check_backend("auto") == "auto"
    with pytest.raises(ValueError, match="backend='cuda'"):
        resources.check_backend("cuda")
    missing = "tpu" if jax.default_backend() != "tpu" else "gpu"
    with pytest.raises(ValueError, match=f"backend='{missing}' needs a {missing.upper()}"):
        resources.check_backend(missing)
    assert resources.check_backend(missing, interpret=True) == missing  # interpret mode


def test_a_model_config_gets_random_weights_in_the_dtype_asked_for():
    cfg, params, tok, desc = resources.load_model(PRESETS["tiny"], dtype="bfloat16", seed=4)
    assert cfg.dtype == "bfloat16" and params.config == cfg and desc.startswith("random")
    assert {str(a.dtype) for a in model.params_to_flat(params).values()} == {"bfloat16"}
    assert tok is not None  # the tiny preset's vocabulary holds the 256 byte ids
    again = model.params_to_flat(resources.load_model(PRESETS["tiny"], seed=4)[1])
    for key, value in model.params_to_flat(model.init_params(PRESETS["tiny"], 4)).items():
        np.testing.assert_array_equal(again[key], value)  # `seed` draws them


def test_sharded_params_are_not_cast():
    from pagedjax import sharding

    params = model.init_params(PRESETS["tiny"], seed=3)
    sharded = sharding.shard_params(params, sharding.make_mesh(1))
    with pytest.raises(ValueError, match="dtype='bfloat16' differs.*sharded over a mesh"):
        resources.load_model(sharded, dtype="bfloat16")
    assert resources.load_model(sharded, dtype="float32")[1] is sharded


def test_plan_num_pages_refuses_a_budget_shorter_than_one_max_model_len_sequence():
    # Was silent: LLM(kv_memory_fraction=...) built a cache of 3 pages for max_model_len=64
    # (4 pages), and every request of max_tokens=None was then refused, one by one.
    cfg = PRESETS["tiny"]
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    per_page = 16 * planner.kv_bytes_per_token(*shape)
    kw = dict(kv_memory_fraction=0.5, max_num_seqs=1, max_model_len=64)
    reserve = resources.step_reserve_bytes(cfg, max_num_batched_tokens=1, max_num_seqs=1)
    short = _Device(dict(bytes_limit=6 * per_page + reserve, bytes_in_use=0))  # 3 pages
    with pytest.raises(ValueError, match=r"max_model_len=64 needs 4 KV pages.* 3 pages \(48 tok"):
        resources.plan_num_pages(cfg, 16, device=short, **kw)
    enough = _Device(dict(bytes_limit=8 * per_page + reserve, bytes_in_use=0))
    assert resources.plan_num_pages(cfg, 16, device=enough, **kw) == 4
    with pytest.raises(
        ValueError, match=r"max_model_len=65 needs 4 KV pages \(32768 bytes\) beside the 1"
    ):
        resources.plan_num_pages(
            cfg, 16, device=enough, **(kw | dict(max_model_len=65)), watermark=0.3
        )
    cpu_fraction = 3 * per_page / resources._CPU_KV_BUDGET  # no stats: 3 pages of 4 GiB
    with pytest.raises(ValueError, match="max_model_len=64 needs 4 KV pages"):
        resources.plan_num_pages(
            cfg, 16, device=_Device(None), **(kw | dict(kv_memory_fraction=cpu_fraction))
        )
    # A sliding window bounds what a sequence holds: W=16 and 8-token chunks, 3 pages.
    windowed = dataclasses.replace(cfg, sliding_window=16)
    assert planner.peak_pages(64, 16, sliding_window=16, max_num_batched_tokens=8) == 3
    assert resources.step_reserve_bytes(cfg, max_num_batched_tokens=8, max_num_seqs=1) == reserve
    got = resources.plan_num_pages(windowed, 16, device=short, max_num_batched_tokens=8, **kw)
    assert got == 3


GIB = 1024**3


def test_plan_num_pages_leaves_room_for_the_largest_step():
    """A 24 GiB GPU with 16 GiB of weights: 0.8 of the 8 GiB free left 1.6 GiB, less than
    one step of 8192 tokens and 256 sampled rows holds (~2 GiB of activations and float32
    logits), so the first full step ran out of memory. The fraction now applies to what
    that step leaves."""
    cfg = PRESETS["llama3-8b"]
    per_page = 16 * planner.kv_bytes_per_token(32, 8, 128, "bfloat16")
    dev = _Device(dict(bytes_limit=24 * GIB, bytes_in_use=16 * GIB))
    kw = dict(kv_memory_fraction=0.8, max_num_seqs=256, max_model_len=8192, device=dev)
    pages = resources.plan_num_pages(cfg, 16, max_num_batched_tokens=8192, **kw)
    reserve = resources.step_reserve_bytes(cfg, max_num_batched_tokens=8192, max_num_seqs=256)
    assert reserve == planner.step_peak_bytes(cfg, 8192, 256) > 0.2 * 8 * GIB  # the old slack
    assert pages == int(0.8 * (8 * GIB - reserve)) // per_page
    assert pages * per_page + reserve <= 8 * GIB
    small = resources.plan_num_pages(cfg, 16, max_num_batched_tokens=512, **kw)
    assert (
        pages < small == int(0.8 * (8 * GIB - planner.step_peak_bytes(cfg, 512, 256))) // (per_page)
    )


def test_step_reserve_bytes_counts_the_padded_step():
    cfg = PRESETS["tiny"]
    peak = planner.step_peak_bytes

    def reserve(tokens, seqs, **buckets):
        bk = decode.Buckets(**buckets) if buckets else None
        return resources.step_reserve_bytes(
            cfg, max_num_batched_tokens=tokens, max_num_seqs=seqs, buckets=bk
        )

    assert reserve(1000, 64) == peak(cfg, 1024, 64)  # padded to powers of two
    assert reserve(1, 1) == peak(cfg, 16, 8)  # the buckets' floors
    assert reserve(24, 64) == peak(cfg, 32, 32)  # no more rows than tokens
    assert reserve(1000, 64, min_tokens=4096) == peak(cfg, 4096, 64)
    assert reserve(32, 8, min_seqs=64) == peak(cfg, 64, 64)  # a decode step: T = B


def test_a_step_larger_than_the_free_memory_is_named():
    """1 GiB free after the weights: a step of 8192 tokens and 256 rows does not fit;
    one of 512 tokens and 16 rows does, but leaves no room for an 8192-token sequence."""
    cfg = PRESETS["llama3-8b"]
    dev = _Device(dict(bytes_limit=20 * GIB, bytes_in_use=19 * GIB))
    kw = dict(kv_memory_fraction=0.9, max_model_len=8192, device=dev)
    big = dict(max_num_batched_tokens=8192, max_num_seqs=256)
    reserve = resources.step_reserve_bytes(cfg, **big)
    assert reserve > GIB
    match = (
        f"of the {GIB} bytes free on .* \\({19 * GIB} of {20 * GIB} in use after the "
        f"weights\\), less {reserve} for one step's working memory \\(max_num_batched_tokens="
        "8192, max_num_seqs=256.* holds no page of 2097152 bytes; lower max_num_batched_tokens"
    )
    with pytest.raises(ValueError, match=match):
        resources.plan_num_pages(cfg, 16, **big, **kw)
    small = dict(max_num_batched_tokens=512, max_num_seqs=16)
    pages = int(0.9 * (GIB - resources.step_reserve_bytes(cfg, **small))) // 2097152
    need = f"max_model_len=8192 needs 512 KV pages \\({512 * 2097152} bytes\\)"
    kept = int(0.01 * pages)  # the watermark's
    assert kept > 0
    with pytest.raises(
        ValueError,
        match=f"{need} beside the {kept} .* holds {pages - kept} pages.*lower max_model_len",
    ):
        resources.plan_num_pages(cfg, 16, **small, **kw)
    assert resources.plan_num_pages(cfg, 16, **small, **kw | dict(max_model_len=1024)) == pages
