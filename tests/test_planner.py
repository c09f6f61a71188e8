import json

import numpy as np
import pytest

from pagedjax import planner


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
    assert p.pages_per_sequence == 7  # 112 slots for 100 tokens
    assert p.max_seqs_paged == 10  # 70 pages // 7
    assert p.max_seqs_contiguous == 1  # 1120 slots // 1000
    assert p.capacity_ratio == 10.0
    assert p.paged_waste_fraction == pytest.approx(12 / 112)


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
    assert "paged          64 sequences" in text


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
    seq_len = int(rng.integers(1, 10_000))
    args = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8"]
    assert planner.main([*args, "--seq-len", str(seq_len), "--page-size", str(ps)]) == 0
    text = capsys.readouterr().out
    pages = -(-seq_len // ps)
    unused = pages * ps - seq_len
    # (was "0.36% of its last page unused" for 15 of 16 slots: the waste over all pages)
    assert f"{pages} pages per sequence, {unused} of its last page's {ps} slots unused" in text
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
    assert out["max_seqs_paged"] == out["memory_bytes"] // out["bytes_per_page"] // 256


def test_non_integer_arguments_are_type_errors_naming_them():
    # layers=2.5 gave bytes_per_token=160.0 and memory_bytes=80e9 max_seqs_paged=4464285.0
    # ("all byte counts exact integers"); page_size=True planned pages of 1 token.
    rng = np.random.default_rng(11)
    good = dict(layers=2, kv_heads=2, head_dim=8, seq_len=100, batch=3, page_size=16)
    good |= dict(memory_bytes=10**6, max_seq_len=128)
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
    assert all(type(v) is int for k, v in vars(p).items() if k.endswith(("bytes", "paged")))


def test_cli_ratio_line_reads_right_when_paging_fits_fewer(capsys):
    # With the default --max-seq-len (= --seq-len), page rounding makes paging fit fewer
    # sequences: the line said "0.50x more sequences with paging".
    rng = np.random.default_rng(5)
    ps = 16
    seq_len = ps * int(rng.integers(1, 8)) + 1  # one token into a last page
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
