"""`resources.load_model`: each kind of LLM source, and the dtype override on each."""

import numpy as np
import pytest

from pagedjax import model, planner, resources
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
@pytest.mark.parametrize("page_size, max_num_seqs, max_model_len", [(4, 1, 512), (16, 64, 512)])
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
    dev = _Device(dict(bytes_limit=1000 * per_page, bytes_in_use=200 * per_page))
    assert resources.plan_num_pages(cfg, 16, device=dev, **kw) == 400  # no max_num_seqs cap
    fp8 = resources.plan_num_pages(cfg, 16, device=dev, kv_dtype="float8_e4m3fn", **kw)
    assert fp8 == 1600  # a float32 model's 4 bytes, 1
    for stats in (None, {}, NotImplementedError("no stats")):  # the CPU's budget, capped
        assert resources.plan_num_pages(cfg, 16, device=_Device(stats), **kw) == 4
    full = _Device(dict(bytes_limit=1000 * per_page, bytes_in_use=1001 * per_page))
    with pytest.raises(ValueError, match=f"-{per_page} bytes free"):  # the weights took it all
        resources.plan_num_pages(cfg, 16, device=full, **kw)
