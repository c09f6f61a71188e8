import dataclasses
import itertools
import json

import numpy as np
import pytest

from pagedjax import planner
from pagedjax.blocks import BlockManager
from pagedjax.config import PRESETS
from pagedjax.scheduler import Scheduler, Sequence, SequenceGroup


def test_llama3_70b_seed_example():
    # 2 x 2 bytes x 80 layers x 8 kv heads x 128 x 4096 tokens x 32 sequences
    n = planner.kv_cache_bytes(80, 8, 128, seq_len=4096, batch=32, dtype="bfloat16")
    assert n == 42_949_672_960
    assert n / 1024**3 == 40.0


def test_hand_computed_small_example():
    # 2 x 4 bytes x 3 layers x 2 kv heads x 16 head_dim = 768 bytes per token.
    assert planner.kv_bytes_per_token(3, 2, 16, "float32") == 768
    assert planner.kv_cache_bytes(3, 2, 16, seq_len=10, batch=5, dtype="float32") == 768 * 50


def test_fp8_halves_bf16():
    bf16 = planner.kv_cache_bytes(80, 8, 128, seq_len=4096, batch=32, dtype="bfloat16")
    assert planner.kv_cache_bytes(80, 8, 128, seq_len=4096, batch=32, dtype="fp8") == bf16 // 2


def test_cli_takes_the_fp8_kv_dtype(capsys):
    args = ["--model", "llama3-8b", "--batch", "32", "--seq-len", "4096", "--json"]
    assert planner.main([*args, "--dtype", "fp8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "float8_e4m3fn" and out["kv_cache_gib"] == 8.0
    assert planner.main([*args, "--dtype", "int8"]) == 2
    assert "'int8'" in capsys.readouterr().err


def test_pages_needed():
    assert planner.pages_needed(0, 16) == 0
    assert planner.pages_needed(1, 16) == 1
    assert planner.pages_needed(16, 16) == 1
    assert planner.pages_needed(17, 16) == 2


def test_plan_paged_vs_contiguous():
    per_token = planner.kv_bytes_per_token(2, 2, 8, "float32")
    p = planner.plan(
        layers=2,
        kv_heads=2,
        head_dim=8,
        seq_len=100,
        dtype="float32",
        memory_bytes=per_token * 16 * 70,
        page_size=16,
        max_seq_len=1000,
    )
    assert p.pages_per_sequence == 7  # 112 slots for the K/V of 99 tokens (the 100th: none)
    assert p.num_pages == 70 and p.watermark_pages == 0  # int(0.01 * 70)
    assert p.max_seqs_paged == 10  # 70 pages // 7
    assert p.contiguous_slots_per_sequence == 999
    assert p.max_seqs_contiguous == 1  # 1120 slots // 999
    assert p.capacity_ratio == 10.0
    assert p.paged_waste_fraction == pytest.approx(13 / 112)


def test_plan_under_a_window_counts_the_positions_a_peak_holds():
    # Window 6, chunks of 8: W - 1 + 8 = 13 positions span at most 4 pages of 4 slots, so
    # 3 of the 16 slots hold no K/V at the peak; contiguous: a ring of W slots.
    kw = dict(layers=2, kv_heads=2, head_dim=8, seq_len=10_000, page_size=4)
    p = planner.plan(**kw, sliding_window=6, max_num_batched_tokens=8)
    assert p.pages_per_sequence == p.window_pages == 4
    assert p.paged_waste_fraction == pytest.approx(3 / 16)
    assert p.contiguous_slots_per_sequence == 6


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(max_seq_len=99), "max_seq_len 99 < seq_len 100"),
        (dict(watermark=1.0), "watermark=1.0"),
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(memory_bytes=-1), "memory_bytes=-1"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
    ],
)
def test_plan_rejects_values_just_past_their_ranges(bad, match):
    kw = dict(layers=2, kv_heads=2, head_dim=8, seq_len=100)
    with pytest.raises(ValueError, match=match):
        planner.plan(**kw, **bad)
    edge = dict(max_seq_len=100, watermark=0.0, sliding_window=1, memory_bytes=0)
    edge |= dict(max_num_batched_tokens=1)
    planner.plan(**kw, **{k: edge[k] for k in bad})  # the last value in range is accepted


def test_an_empty_batch_needs_no_bytes():
    assert planner.kv_cache_bytes(2, 2, 8, seq_len=100, batch=0) == 0
    assert planner.kv_cache_bytes(2, 2, 8, seq_len=0, batch=3) == 0
    with pytest.raises(ValueError, match="batch=-1"):
        planner.kv_cache_bytes(2, 2, 8, seq_len=100, batch=-1)


def test_cli_json_prints_exact_integer(capsys):
    assert (
        planner.main(["--model", "llama3-70b", "--batch", "32", "--seq-len", "4096", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache_bytes"] == 42_949_672_960
    assert isinstance(out["kv_cache_bytes"], int)


def test_cli_explicit_shape_and_budget(capsys):
    args = ["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--batch", "32"]
    args += ["--seq-len", "4096", "--dtype", "bf16", "--memory-gb", "80"]
    assert planner.main(args) == 0
    text = capsys.readouterr().out
    assert "42,949,672,960 bytes (40.00 GiB)" in text
    # 16384 pages, 163 of them the watermark: 16221 // 256 (64 before the watermark counted)
    assert "budget         80.00 GiB: 16384 pages, 163 of them the watermark" in text
    assert "paged          63 sequences" in text
    assert "contiguous     64 sequences preallocated at 4095 K/V slots for up to" in text
    assert "ring" not in text  # no window: a slot per token


def test_cli_missing_shape_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        planner.main(["--layers", "2"])
    assert e.value.code == 2
    assert "--kv-heads" in capsys.readouterr().err


def test_cli_bad_page_size(capsys):
    assert planner.main(["--model", "tiny", "--page-size", "12", "--memory-gb", "1"]) == 2
    assert "page_size must be a power of two" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [dict(layers=0), dict(kv_heads=-1), dict(head_dim=0)])
def test_bad_shapes(bad):
    kw = dict(layers=2, kv_heads=2, head_dim=8) | bad
    ((name, value),) = bad.items()
    with pytest.raises(ValueError, match=f"{name}={value}"):
        planner.kv_bytes_per_token(**kw)


@pytest.mark.parametrize("seed", range(3))
def test_cli_text_says_how_much_of_the_last_page_is_unused(capsys, seed):
    rng = np.random.default_rng(seed)
    ps = 2 ** int(rng.integers(0, 8))
    seq_len = int(rng.integers(2, 10_000))
    args = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8"]
    assert planner.main([*args, "--seq-len", str(seq_len), "--page-size", str(ps)]) == 0
    text = capsys.readouterr().out
    kv = seq_len - 1  # the last token is sampled, never fed: no K/V
    pages = -(-kv // ps)
    unused = pages * ps - kv
    # (was "0.36% of its last page unused" for 15 of 16 slots: the waste over all pages)
    assert f"{pages} pages for its {kv} K/V tokens" in text
    assert f"{unused} of its last page's {ps} slots unused" in text
    assert f"({100 * unused / (pages * ps):.2f}% of its slots)" in text


@pytest.mark.parametrize("seed", range(3))
def test_cli_bad_shape_with_a_model_is_an_error_not_the_presets(capsys, seed):
    rng = np.random.default_rng(seed)
    flag = ["--layers", "--kv-heads", "--head-dim"][seed]
    for value in (0, -int(rng.integers(1, 5))):  # 0 fell back to the preset's value
        assert planner.main(["--model", "llama3-8b", flag, str(value), "--json"]) == 2
        assert f"{flag[2:].replace('-', '_')}={value}" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["inf", "nan", "-inf", "-0.5"])
def test_cli_bad_memory_budget_is_an_error_naming_the_flag(capsys, bad):
    # inf was an OverflowError traceback; nan "cannot convert float NaN to integer"
    assert planner.main(["--model", "tiny", f"--memory-gb={bad}"]) == 2
    assert f"--memory-gb {bad}" in capsys.readouterr().err


def test_cli_random_memory_budget(capsys):
    rng = np.random.default_rng(3)
    gb = float(rng.uniform(0.1, 200))
    assert planner.main(["--model", "llama3-8b", "--memory-gb", repr(gb), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_bytes"] == int(gb * 1024**3)
    num_pages = out["memory_bytes"] // out["bytes_per_page"]
    assert out["num_pages"] == num_pages and out["watermark_pages"] == int(0.01 * num_pages)
    assert out["max_seqs_paged"] == (num_pages - out["watermark_pages"]) // 256


def test_non_integer_arguments_are_type_errors_naming_them():
    # layers=2.5 gave bytes_per_token=160.0 and memory_bytes=80e9 max_seqs_paged=4464285.0
    # ("all byte counts exact integers"); page_size=True planned pages of 1 token.
    rng = np.random.default_rng(11)
    good = dict(layers=2, kv_heads=2, head_dim=8, seq_len=100, batch=3, page_size=16)
    good |= dict(memory_bytes=10**6, max_seq_len=128, sliding_window=40)
    good |= dict(max_num_batched_tokens=32)
    bads = [float(rng.integers(1, 9)) + 0.5, True, "4", float(rng.integers(1, 9))]
    for name in good:
        for bad in bads:
            with pytest.raises(TypeError, match=f"{name}={bad!r}"):
                planner.plan(**(good | {name: bad}))
    with pytest.raises(TypeError, match="head_dim=8.0"):
        planner.kv_bytes_per_token(2, 2, 8.0)
    with pytest.raises(TypeError, match="batch=1.5"):
        planner.kv_cache_bytes(2, 2, 8, seq_len=4, batch=1.5)
    with pytest.raises(TypeError, match="page_size=False"):
        planner.pages_needed(4, False)
    p = planner.plan(
        **(good | dict(layers=np.int64(2), seq_len=np.int32(100), memory_bytes=np.int64(10**6)))
    )
    assert p == planner.plan(**good)  # numpy integers are integers
    ints = ("bytes", "paged", "pages", "window", "tokens", "sequence")
    assert all(type(v) is int for k, v in vars(p).items() if k.endswith(ints))
    for bad in (True, "0.01", None):
        with pytest.raises(TypeError, match=f"watermark={bad!r}"):
            planner.plan(**good, watermark=bad)


def test_cli_ratio_line_reads_right_when_paging_fits_fewer(capsys):
    # With the default --max-seq-len (= --seq-len), page rounding makes paging fit fewer
    # sequences: the line said "0.50x more sequences with paging".
    rng = np.random.default_rng(5)
    ps = 16
    seq_len = ps * int(rng.integers(1, 8)) + 2  # K/V (seq_len - 1) one token into a last page
    per_page = planner.kv_bytes_per_token(2, 2, 8) * ps
    pages = seq_len // ps + 1
    memory = per_page * pages * int(rng.integers(20, 50))
    p = planner.plan(layers=2, kv_heads=2, head_dim=8, seq_len=seq_len, memory_bytes=memory)
    assert p.capacity_ratio < 1
    args = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--seq-len", str(seq_len)]
    assert planner.main([*args, "--memory-gb", repr(memory / 1024**3)]) == 0
    text = capsys.readouterr().out
    assert "more sequences" not in text
    assert f"paging fits {p.capacity_ratio:.2f}x as many sequences" in text


# ------------------------------------------ the engine's admission: sliding window, watermark


def test_defaults_are_the_engines():
    import inspect

    from pagedjax.blocks import BlockManager
    from pagedjax.engine import LLM

    llm = inspect.signature(LLM).parameters
    assert llm["max_num_batched_tokens"].default == planner.MAX_NUM_BATCHED_TOKENS
    assert llm["watermark"].default == planner.WATERMARK
    assert inspect.signature(BlockManager).parameters["watermark"].default == planner.WATERMARK
    p = inspect.signature(planner.plan).parameters
    assert p["max_num_batched_tokens"].default == planner.MAX_NUM_BATCHED_TOKENS
    assert p["watermark"].default == planner.WATERMARK


def _group(ids, rid, prompt_len, seq_len, n):
    """A request of `n` samples of `seq_len` tokens (as the engine builds it)."""
    prompt = list(range(3, 3 + prompt_len))
    seqs = [Sequence(next(ids), list(prompt), prompt_len, seq_len, i) for i in range(n)]
    return SequenceGroup(rid, seqs[:1], n, forks=seqs[1:])


def test_max_seqs_paged_is_what_the_scheduler_admits():
    # The scheduler counts pages with planner.held_pages / window_pages; plan() adds
    # BlockManager's watermark. A real Scheduler over a real BlockManager (no model): a
    # request of max_seqs_paged samples is accepted, one more sample is refused.
    rng = np.random.default_rng(21)
    ids = itertools.count()
    per_token = planner.kv_bytes_per_token(1, 1, 8, "float32")
    windowed = watermarked = 0
    for case in range(150):
        ps = 2 ** int(rng.integers(0, 8))
        w = None if case % 3 == 0 else int(rng.integers(1, 3000))
        budget = int(rng.integers(2, 2049))
        seq_len = int(rng.integers(2, 20_000))
        wm = planner.WATERMARK if case % 2 else float(rng.uniform(0, 0.3))
        kw = dict(sliding_window=w, max_num_batched_tokens=budget)
        probe = Scheduler(BlockManager(1, ps), max_num_seqs=1, **kw)
        need = probe.max_pages_needed(_group(ids, "p", int(rng.integers(1, seq_len)), seq_len, 1))
        assert planner.peak_pages(seq_len, ps, **kw) == need, (ps, seq_len, kw)
        if w is not None:
            assert planner.window_pages(w, ps, budget) == probe.window_pages
        n_target = int(rng.integers(0, min(budget - 2, 60) + 1))
        num_pages = int(rng.integers(n_target * need + 1, (n_target + 1) * need + 2))
        bm = BlockManager(num_pages, ps, enable_prefix_caching=False, watermark=wm)
        sched = Scheduler(bm, max_num_seqs=budget, **kw)
        memory = num_pages * per_token * ps + int(rng.integers(0, per_token * ps))
        p = planner.plan(
            layers=1, kv_heads=1, head_dim=8, dtype="float32", seq_len=seq_len,
            memory_bytes=memory, page_size=ps, watermark=wm, **kw,
        )  # fmt: skip
        assert (p.num_pages, p.watermark_pages) == (bm.num_pages, bm.watermark_pages)
        n = p.max_seqs_paged
        assert n + 1 <= sched.max_num_seqs  # so that only pages can refuse n + 1
        if n:
            sched.add(_group(ids, "fits", int(rng.integers(1, seq_len)), seq_len, n))
        with pytest.raises(ValueError, match="may need"):
            sched.add(_group(ids, "over", int(rng.integers(1, seq_len)), seq_len, n + 1))
        windowed += p.pages_per_sequence < planner.pages_needed(seq_len - 1, ps)
        watermarked += n < num_pages // need
    assert windowed >= 30 and watermarked >= 30  # both cases are exercised


@pytest.mark.parametrize("seed", range(3))
def test_admission_takes_max_seqs_paged_prompts_in_one_step(seed):
    # Full attention: prompts of seq_len - 1 tokens with 1 token to generate each reserve
    # their peak on admission; a budget that prefills them all in one step admits exactly
    # max_seqs_paged of them (the watermark stops the next).
    rng = np.random.default_rng(seed)
    ids = itertools.count()
    ps = 2 ** int(rng.integers(0, 6))
    seq_len = int(rng.integers(2, 300))
    need = planner.peak_pages(seq_len, ps)
    num_pages = int(rng.integers(need, 60 * need))
    wm = float(rng.uniform(0.01, 0.2))
    p = planner.plan(
        layers=1, kv_heads=1, head_dim=8, seq_len=seq_len, page_size=ps, watermark=wm,
        memory_bytes=num_pages * planner.kv_bytes_per_token(1, 1, 8) * ps,
    )  # fmt: skip
    n = p.max_seqs_paged
    bm = BlockManager(num_pages, ps, enable_prefix_caching=False, watermark=wm)
    budget = (n + 2) * seq_len
    sched = Scheduler(bm, max_num_seqs=n + 2, max_num_batched_tokens=budget)
    for i in range(n + 2):
        sched.add(_group(ids, i, seq_len - 1, seq_len, 1))
    sched.schedule()
    assert len(sched.running) == n and len(sched.waiting) == 2
    assert bm.num_free_pages - bm.num_reserved_pages >= bm.watermark_pages


def test_cli_mistral_window_and_watermark(capsys):
    # 16 GiB of 2 MiB pages: 8192, 81 kept free. The window (4096 tokens, chunks of 1024)
    # bounds a sequence at ceil(5118 / 16) + 1 = 321 pages: 8111 // 321 = 25 (the planner
    # said 1024 pages and 8 sequences). Contiguous: a ring of 4096 slots, 32 sequences.
    args = ["--model", "mistral-7b-v0.1", "--seq-len", "16384", "--memory-gb", "16"]
    assert planner.main(args) == 0
    text = capsys.readouterr().out
    assert "sliding_window=4096" in text
    assert "at most 321 pages at once under the window" in text
    assert "not the 1024 its 16383 K/V tokens fill" in text
    assert "budget         16.00 GiB: 8192 pages, 81 of them the watermark" in text
    assert "paged          25 sequences of 16384 tokens at their peak at once" in text
    assert "contiguous     32 sequences preallocated at 4096 K/V slots (a ring" in text
    assert "paging fits 0.78x" in text
    assert planner.main([*args, "--max-batch-tokens", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["window_pages"] == out["pages_per_sequence"] == 513  # ceil(8190 / 16) + 1
    assert out["max_seqs_paged"] == 8111 // 513
    assert planner.main([*args, "--sliding-window", "0", "--watermark", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sliding_window"] is None and out["pages_per_sequence"] == 1024
    assert (out["watermark_pages"], out["max_seqs_paged"], out["max_seqs_contiguous"]) == (
        0,
        8,
        8,
    )


@pytest.mark.parametrize(
    "flag,value,err",
    [
        ("--sliding-window", "-3", "sliding_window=-3"),
        ("--max-batch-tokens", "0", "max_num_batched_tokens=0"),
        ("--watermark", "1.5", "watermark=1.5"),
        ("--watermark", "nan", "watermark=nan"),
    ],
)
def test_cli_bad_window_budget_watermark(capsys, flag, value, err):
    assert planner.main(["--model", "mistral-7b-v0.1", "--memory-gb", "1", flag, value]) == 2
    assert err in capsys.readouterr().err


def test_step_peak_bytes_hand_computed():
    cfg = PRESETS["llama3-8b"]  # bf16, E=4096, F=14336, H=32, K=8, D=128, V=128256
    # The MLP phase (residual, norm, gate, up, product: 2 * 4096 + 3 * 14336 = 51200
    # elements a token) outweighs attention's (2 * 4096 + 3 * (32 + 8) * 128 = 23552).
    body = 1024 * (2 * 51200 + 4 * 4096)  # bf16, and the norm's float32 copy
    head = 64 * 128256 * 4 * planner.HEAD_ROW_COPIES  # float32 [B, V] rows
    # A prompt-logprobs step's scoring: float32 [256, V] arrays (of 1024 tokens).
    score = 256 * 128256 * 4 * planner.SCORE_ROW_COPIES
    assert (planner.SCORE_ROWS, planner.SCORE_ROW_COPIES) == (256, 3)
    assert planner.step_peak_bytes(cfg, 1024, 64) == body + head + score == 778_305_536
    f32 = dataclasses.replace(cfg, dtype="float32")
    assert planner.step_peak_bytes(f32, 1024, 64) == 2 * body - 1024 * 4 * 4096 + head + score
    assert planner.step_peak_bytes(cfg, 0, 0) == 0
    # Attention outweighs a narrow MLP: x, norm, q/k/v projected and rotated, the output;
    # one token's scoring is one row.
    wide = dataclasses.replace(cfg, intermediate_size=1024)
    assert planner.step_peak_bytes(wide, 1, 0) == 2 * 23552 + 4 * 4096 + 3 * 128256 * 4
    with pytest.raises(ValueError, match="num_rows=-1"):
        planner.step_peak_bytes(cfg, 16, -1)
    with pytest.raises(TypeError, match="num_tokens=1.5"):
        planner.step_peak_bytes(cfg, 1.5, 8)


def test_head_row_copies_bound_xlas_sampling_temporaries():
    """The step's head, as `decode._step` runs it with every option on (bias mask,
    penalties, min_p, top-k/top-p, requested logprobs and ranks), holds no more [B, V]
    float32 arrays than `HEAD_ROW_COPIES` counts (XLA:CPU's buffer assignment: 6 besides
    the logits, when this was written). A sampler change that adds [B, V] temporaries
    should raise the constant, which sizes the reserve `plan_num_pages` keeps free."""
    import jax
    import jax.numpy as jnp

    from pagedjax import sampling

    b, v = 8, 2048

    def head(logits, temperature, top_k, top_p, min_p, seeds, steps, ids, mask):
        pen = sampling.Penalties(top_p, min_p, min_p, ids, steps)
        bias = sampling.LogitBias(ids, temperature[:, None] + 0 * ids, None, None, mask)
        tokens, logprobs = sampling.sample(
            logits, temperature, top_k, top_p, seeds, steps, min_p, penalties=pen, bias=bias
        )
        top_ids, top_lp = sampling.top_logprobs(logits, 8)
        lp = jax.nn.log_softmax(logits, axis=-1)
        ranks = jnp.sum(lp >= jnp.take_along_axis(lp, tokens[:, None], axis=-1), axis=-1)
        return tokens, logprobs, top_ids, top_lp, ranks

    row = jax.ShapeDtypeStruct((b,), jnp.float32)
    irow = jax.ShapeDtypeStruct((b,), jnp.int32)
    args = (
        jax.ShapeDtypeStruct((b, v), jnp.float32),
        row,
        irow,
        row,
        row,
        jax.ShapeDtypeStruct((b,), jnp.uint32),
        irow,
        jax.ShapeDtypeStruct((b, 16), jnp.int32),
        jax.ShapeDtypeStruct((b, v // 32), jnp.uint32),
    )
    stats = jax.jit(head).lower(*args).compile().memory_analysis()
    if stats is None:  # (a backend without buffer statistics)
        pytest.skip("no memory_analysis() on this backend")
    copies = (stats.temp_size_in_bytes + b * v * 4) / (b * v * 4)  # the logits count too
    assert 4 <= copies <= planner.HEAD_ROW_COPIES


@pytest.mark.parametrize(
    "argv, want",
    [
        # an OverflowError traceback (int(inf)), as --memory-gb inf was
        (["--memory-gb", "1e300"], "--memory-gb 1e+300 is too large"),
        # "None sequences of 1 tokens at their peak at once (129762 pages // 0)"
        (["--seq-len", "1", "--memory-gb", "1"], "--seq-len must be >= 2, got 1"),
        (["--seq-len", "0"], "--seq-len must be >= 2, got 0"),
        # an OverflowError traceback (the cache's size in GiB as a float)
        (["--seq-len", "9" * 400, "--json"], "too large"),
        (["--batch", "9" * 400], "too large"),
    ],
)
def test_cli_bad_values_are_one_line_errors(argv, want, capsys):
    assert planner.main(["--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and want in err, err
