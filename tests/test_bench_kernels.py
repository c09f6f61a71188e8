"""Smoke tests of scripts/bench_kernels.py on the CPU.

The CPU path (interpret-mode correctness) runs as a user would run it. The GPU
path cannot run here, so a second test drives its code on a tiny case with the
kernels swapped for their interpret-mode versions: it catches plain Python
mistakes before the rare GPU session does. `--out DIR` is checked on both paths:
rows reach DIR/bench_kernels.jsonl as each finishes, and a case that raises
becomes a failed row while the next case still runs.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import pytest

from pallas_kernels import reference
from pallas_kernels.paged_decode.gpu import paged_decode_gpu

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_kernels.py"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def fake_gpu(bench, monkeypatch, cases):
    """The GPU path on the CPU: no ceilings to measure, tiny rotations, `cases`."""
    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "measure_copy", lambda iters: (1.0, None))
    monkeypatch.setattr(bench, "measure_read_gbps", lambda iters: 1.0)
    monkeypatch.setattr(bench, "measure_matmul_tflops", lambda iters: 1.0)
    monkeypatch.setattr(bench, "L2_BYTES", 1)
    monkeypatch.setattr(bench, "CALLS", (2, 2))
    monkeypatch.setattr(bench, "GPU_DECODE_CASES", cases)


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_kernels_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    # A stand-in TPU kernel (the XLA reference): tests the optional-kernel path
    # without depending on the real TPU kernel's state or interpreter speed.
    fake_tpu = types.ModuleType("pallas_kernels.paged_decode.tpu")
    fake_tpu.paged_decode_tpu = lambda *a, interpret=False, **kw: reference.paged_attention_xla(
        *a, **kw
    )
    monkeypatch.setitem(sys.modules, "pallas_kernels.paged_decode.tpu", fake_tpu)
    return module


def test_cpu_path_json(bench, capsys):
    assert bench.main(["--quick", "--json"], families=[bench.DECODE]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["timed"] is False and "timing needs a CUDA GPU" in result["note"]
    bf16, fp8 = result["results"]["decode"]  # --quick: one bf16 case and the fp8 one
    assert fp8["case"].endswith(" fp8") and not bf16["case"].endswith(" fp8")
    for row in (bf16, fp8):
        assert row["ok"] is True
        assert 0 < row["err_ours"] < 1e-2 and 0 < row["err_tpu"] < 1e-2 and row["err_dense"] < 1e-2


def test_cpu_path_reports_broken_tpu_kernel(bench, capsys, monkeypatch):
    def broken(q, *args, **kwargs):
        return jnp.zeros_like(q) + 1

    monkeypatch.setattr(bench, "CPU_DECODE_CASES", bench.CPU_DECODE_CASES[:1])
    monkeypatch.setattr(sys.modules["pallas_kernels.paged_decode.tpu"], "paged_decode_tpu", broken)
    assert bench.main(["--quick"], families=[bench.DECODE]) == 1
    out = capsys.readouterr().out
    assert "timing needs a CUDA GPU" in out and "False" in out


def test_gpu_path_logic_on_cpu(bench, capsys, monkeypatch):
    from jax.experimental.pallas.ops.gpu import paged_attention as bundled

    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(
        bench, "paged_decode_gpu", functools.partial(paged_decode_gpu, interpret=True)
    )
    monkeypatch.setattr(
        bench,
        "bundled_kernel",
        lambda: (functools.partial(bundled.paged_attention, interpret=True), None),
    )
    monkeypatch.setattr(bench, "measure_copy", lambda iters: (1.0, None))
    monkeypatch.setattr(bench, "measure_read_gbps", lambda iters: 1.0)
    monkeypatch.setattr(bench, "measure_matmul_tflops", lambda iters: 1.0)
    monkeypatch.setattr(bench, "L2_BYTES", 1)
    monkeypatch.setattr(bench, "CALLS", (2, 2))
    case = bench.DecodeCase(2, 64, num_heads=4, num_kv_heads=2, head_dim=64)
    monkeypatch.setattr(bench, "GPU_DECODE_CASES", [case])
    assert bench.main(["--quick", "--json", "--iters", "1"], families=[bench.DECODE]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["timed"] is True
    (row,) = result["results"]["decode"]
    for key in ("ours_us", "dense_us", "bundled_us", "speedup_vs_bundled", "paged_over_dense"):
        assert row[key] > 0, key
    assert row["err_ours"] < 1e-2 and row["err_bundled"] < 1e-2 and row["err_dense"] < 1e-2
    assert row["ok"] is True and row["tuning"]["num_splits"] >= 1


def test_gpu_path_head_to_head_on_cpu(bench, capsys, monkeypatch):
    """The full GPU path (not --quick) with the sweeps' budget spent: the head-to-head
    rounds, and both merges timed where the default splits."""
    from jax.experimental.pallas.ops.gpu import paged_attention as bundled

    interpret = functools.partial(paged_decode_gpu, interpret=True)
    monkeypatch.setattr(bench, "paged_decode_gpu", interpret)
    merge = functools.partial(bench.merge_partials, interpret=True)
    monkeypatch.setattr(bench, "merge_partials", merge)
    run = functools.partial(bundled.paged_attention, interpret=True)
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (run, None))
    case = bench.DecodeCase(1, 1024, num_heads=4, num_kv_heads=2, head_dim=64)
    assert case.tuning()["num_splits"] == 2
    fake_gpu(bench, monkeypatch, [case])
    argv = ["--json", "--iters", "2", "--budget-s", "0"]
    assert bench.main(argv, families=[bench.DECODE]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]["decode"]
    assert row["ok"] is True and row["h2h_rounds"] == 2
    for key in ("ours_us", "bundled_us", "dense_us", "merge_us", "merge_xla_us", "merge_over_xla"):
        assert row[key] > 0, key
    assert row["ours_best_cfg"] == "default" and row["ours_sweep_us"] == {}  # no budget


def test_fp8_row_in_the_gpu_table(bench):
    """The Llama-3-8B layer at (B, S) = (32, 4096), page 16, with fp8 pages: half the bytes."""
    fp8 = [c for c in bench.GPU_DECODE_CASES if c.kv_dtype == "float8_e4m3fn"]
    assert len(fp8) == 1
    (case,) = fp8
    assert (case.batch, case.seq_len, case.page_size, case.dtype) == (32, 4096, 16, "bfloat16")
    assert (case.num_heads, case.num_kv_heads, case.head_dim) == (32, 8, 128)
    bf16 = bench.DecodeCase(32, 4096)
    assert bf16 in bench.GPU_DECODE_CASES
    assert 2 * case.kv_bytes == bf16.kv_bytes == 2 * 32 * 4096 * 8 * 128 * 2
    # The same 16 KiB tile: twice the fp8 tokens.
    assert case.tuning()["block_kv"] == 2 * bf16.tuning()["block_kv"] == 128


def test_gpu_path_fp8_case_on_cpu(bench, capsys, monkeypatch):
    # Our kernel in the interpreter; the bundled kernel must not be called for fp8 pages.
    def bundled(*args, **kwargs):
        raise AssertionError("the bundled kernel has no fp8 path")

    case = bench.DecodeCase(
        2, 64, num_heads=4, num_kv_heads=2, head_dim=64, kv_dtype="float8_e4m3fn"
    )
    fake_gpu(bench, monkeypatch, [case])
    monkeypatch.setattr(
        bench, "paged_decode_gpu", functools.partial(paged_decode_gpu, interpret=True)
    )
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (bundled, None))
    assert bench.main(["--quick", "--json", "--iters", "1"], families=[bench.DECODE]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]["decode"]
    assert row["case"] == "B=2 S=64 page=16 fp8" and row["ok"] is True
    assert row["bundled_us"] == "n/a" and "speedup_vs_bundled" not in row
    assert row["kv_mb"] * 2**20 == 2 * 2 * 64 * 2 * 64  # fp8: 1 byte per element
    assert row["ours_gbps"] == pytest.approx(case.kv_bytes / row["ours_us"] / 1e3)
    assert row["ours_frac_copy"] == pytest.approx(row["ours_gbps"])  # copy stubbed at 1 GB/s
    assert row["err_ours"] < 1e-2 and row["err_dense"] < 1e-2 and row["dense_us"] > 0


def test_gpu_path_survives_failing_kernels(bench, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("triton says no")

    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "paged_decode_gpu", broken)
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (None, "ImportError: gone"))
    monkeypatch.setattr(bench, "measure_copy", lambda iters: (1.0, None))
    monkeypatch.setattr(bench, "measure_read_gbps", lambda iters: 1.0)
    monkeypatch.setattr(bench, "measure_matmul_tflops", lambda iters: 1.0)
    monkeypatch.setattr(bench, "L2_BYTES", 1)
    monkeypatch.setattr(bench, "CALLS", (2, 2))
    case = bench.DecodeCase(1, 32, num_heads=2, num_kv_heads=1, head_dim=64)
    monkeypatch.setattr(bench, "GPU_DECODE_CASES", [case])
    # our kernel failed: nonzero exit
    assert bench.main(["--quick", "--iters", "1"], families=[bench.DECODE]) == 1
    out = capsys.readouterr().out
    assert "error_bundled: missing: ImportError: gone" in out
    assert "error_ours: RuntimeError: triton says no" in out


def test_gpu_path_a_failing_bundled_config_is_a_note(bench, capsys, monkeypatch, tmp_path):
    """One sweep configuration of JAX's kernel failing (e.g. out of shared memory) is noted
    in failed_configs; only when every configuration fails is it an error_bundled."""

    def bundled(q, k, v, page_table, lengths, *, k_splits, **config):
        if k_splits == 4 or fail_all:
            raise RuntimeError(f"RESOURCE_EXHAUSTED k_splits={k_splits}")
        return reference.paged_attention_xla(q, k, v, lengths, page_table, scale=1.0)

    fake_gpu(
        bench, monkeypatch, [bench.DecodeCase(1, 64, num_heads=2, num_kv_heads=1, head_dim=16)]
    )
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (bundled, None))
    ours = lambda q, k, v, n, pt, **tuning: reference.paged_attention_xla(q, k, v, n, pt)  # noqa: E731
    monkeypatch.setattr(bench, "paged_decode_gpu", ours)
    rows = {}
    for fail_all in (False, True):
        out = tmp_path / str(fail_all)
        assert bench.main(["--quick", "--iters", "1", "--out", str(out)], [bench.DECODE]) == 0
        rows[fail_all] = read_jsonl(out / "bench_kernels.jsonl")[1]
    some, every = rows[False], rows[True]
    assert "error_bundled" not in some and some["bundled_us"] > 0 and some["err_bundled"] < 1e-2
    assert len(some["failed_configs"]) == 1 and "k_splits=4" in some["failed_configs"][0]
    assert "bundled_us" not in every and "every configuration failed" in every["error_bundled"]
    assert len(every["failed_configs"]) == 2  # quick, 4 pages: k_splits 1 and 4
    assert "failed_configs: [" in capsys.readouterr().out


def test_a_nan_output_is_null_in_strict_json(bench, capsys, monkeypatch, tmp_path):
    """A kernel that returns NaNs fails its row, and its error is null in --json and
    --out: `json.dumps` wrote `NaN`, which JSON has not (jq and JavaScript refuse it)."""

    def strict(text):
        def refuse(constant):
            raise ValueError(f"not JSON: {constant}")

        return json.loads(text, parse_constant=refuse)

    fake_gpu(
        bench, monkeypatch, [bench.DecodeCase(1, 64, num_heads=2, num_kv_heads=1, head_dim=16)]
    )
    nan = lambda q, k, v, n, pt, **tuning: jnp.full_like(q, jnp.nan)  # noqa: E731
    monkeypatch.setattr(bench, "paged_decode_gpu", nan)
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (None, "missing: ImportError: gone"))
    argv = ["--quick", "--iters", "1", "--json", "--out", str(tmp_path)]
    assert bench.main(argv, [bench.DECODE]) == 1
    (row,) = strict(capsys.readouterr().out)["results"]["decode"]
    lines = [strict(line) for line in (tmp_path / "bench_kernels.jsonl").read_text().splitlines()]
    assert row["ok"] is False and row["err_ours"] is None
    assert lines[1]["ok"] is False and lines[1]["err_ours"] is None


@pytest.mark.slow
def test_gpu_path_full_sweeps_with_stub_kernels(bench, capsys, monkeypatch):
    # The tuning sweeps (skipped by --quick) with cheap stand-ins that record their knobs.
    seen = {"ours": [], "bundled": []}

    def ours(q, k, v, lengths, page_table, **tuning):
        seen["ours"].append(tuning)
        return reference.paged_attention_xla(q, k, v, lengths, page_table)

    def bundled(q, k, v, page_table, lengths, **config):
        seen["bundled"].append(config)
        return reference.paged_attention_xla(q, k, v, lengths, page_table, scale=1.0)

    def measure_copy(iters):  # a real (tiny) copy run: the head-to-head times it too
        arrays = [(jnp.arange(1024, dtype=jnp.float32),)]
        return 1.0, (bench.compile_calls(lambda x: x + 1, arrays), 1, 8192)

    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "paged_decode_gpu", ours)
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (bundled, None))
    monkeypatch.setattr(bench, "measure_copy", measure_copy)
    monkeypatch.setattr(bench, "measure_read_gbps", lambda iters: 1.0)
    monkeypatch.setattr(bench, "measure_matmul_tflops", lambda iters: 1.0)
    monkeypatch.setattr(bench, "L2_BYTES", 1)
    monkeypatch.setattr(bench, "CALLS", (2, 2))
    case = bench.DecodeCase(1, 512, num_heads=2, num_kv_heads=1, head_dim=16)
    monkeypatch.setattr(bench, "GPU_DECODE_CASES", [case])
    args = ["--iters", "3", "--budget-s", "600"]
    assert bench.main(args + ["--json"], families=[bench.DECODE]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]["decode"]
    # The reported figures come from the interleaved head-to-head of the compiled runs.
    assert row["h2h_rounds"] == 3 and row["ours_first_us"] > 0 and row["copy_gbps_h2h"] > 0
    for key in ("speedup_vs_bundled", "paged_over_dense", "one_buffer_over_default"):
        assert row[key] > 0, key
    assert row["ours_frac_copy"] > 0 and len(row["ours_iqr_us"]) == 2
    assert row["ours_gbps"] == pytest.approx(case.kv_bytes / row["ours_us"] / 1e3)
    bench.print_table("decode", [row], bench.DECODE.columns)
    out = capsys.readouterr().out
    assert "x bundled" in out and "paged/dense" in out and "1buf/def" in out
    tried = {tuple(sorted(c.items())) for c in seen["bundled"]}
    assert len(tried) >= 10  # k_splits, then blocks, then warps/stages
    assert any("num_warps" in c for c in seen["bundled"])
    assert {"num_splits", "block_kv", "num_stages"} <= {k for t in seen["ours"] for k in t}


def test_out_streams_rows_as_they_finish(bench, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CPU_DECODE_CASES", bench.CPU_DECODE_CASES[:1])
    out = tmp_path / "new_dir"
    path = out / "bench_kernels.jsonl"
    seen_before_second = []

    def streaming(env):
        yield dict(case="first", ok=True)
        seen_before_second.extend(read_jsonl(path))  # written before the next row starts
        raise RuntimeError("the device fell over")

    families = [
        bench.Family("streaming", streaming, (("case", "case", ""),)),
        bench.DECODE,  # still runs after the broken family
    ]
    assert bench.main(["--quick", "--out", str(out)], families=families) == 1
    assert [r["kind"] for r in seen_before_second] == ["meta", "row"]
    assert seen_before_second[1] == dict(kind="row", family="streaming", case="first", ok=True)
    lines = read_jsonl(path)
    meta, first, broken, decode, end = lines
    assert meta["kind"] == "meta" and meta["jax_version"] and meta["timed"] is False
    assert "copy_gbps" in meta and "matmul_tflops" in meta and "device" in meta
    assert broken["ok"] is False and "RuntimeError: the device fell over" in broken["error"]
    assert decode["family"] == "decode" and decode["ok"] is True and decode["err_ours"] < 1e-2
    assert end == dict(kind="end", ok=False, wall_s=end["wall_s"])
    assert "timing needs a CUDA GPU" in capsys.readouterr().out  # the table as before


def test_gpu_path_out_records_a_raising_case_and_goes_on(bench, capsys, monkeypatch, tmp_path):
    # Stand-in kernels (the XLA reference): this checks the bookkeeping, not a kernel.
    def ours(q, k, v, lengths, page_table, **tuning):
        return reference.paged_attention_xla(q, k, v, lengths, page_table)

    def bundled(q, k, v, page_table, lengths, **config):
        return reference.paged_attention_xla(q, k, v, lengths, page_table, scale=1.0)

    oom = bench.DecodeCase(4, 32, num_heads=2, num_kv_heads=1, head_dim=16)
    fine = bench.DecodeCase(1, 32, num_heads=2, num_kv_heads=1, head_dim=16)
    fake_gpu(bench, monkeypatch, [oom, fine])
    monkeypatch.setattr(bench, "paged_decode_gpu", ours)
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (bundled, None))
    make_inputs = bench.make_decode_inputs

    def make_or_fail(case, seed):
        if case == oom:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")
        return make_inputs(case, seed)

    monkeypatch.setattr(bench, "make_decode_inputs", make_or_fail)
    argv = ["--quick", "--iters", "1", "--out", str(tmp_path)]
    assert bench.main(argv, families=[bench.DECODE]) == 1
    meta, failed, row, end = read_jsonl(tmp_path / "bench_kernels.jsonl")
    assert meta["copy_gbps"] == meta["read_gbps"] == meta["matmul_tflops"] == 1.0
    assert meta["timed"] is True
    assert failed["case"] == oom.name and failed["ok"] is False
    assert "RESOURCE_EXHAUSTED" in failed["error"]
    assert row["case"] == fine.name and row["ok"] is True and row["ours_us"] > 0
    assert row["tuning"]["num_splits"] >= 1  # nested values survive as JSON
    assert end["kind"] == "end" and end["ok"] is False
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err  # the traceback, for the log


def test_ragged_family_records_a_raising_case_and_goes_on(bench, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_ragged_cases as ragged

    two = ragged.cases(gpu=False)[:2]
    monkeypatch.setattr(ragged, "cases", lambda gpu=True: two)

    def gpu_case(case, env, bk):
        if case is two[0]:
            raise ValueError("triton compile failed")
        return dict(case=case.name, ok=True)

    monkeypatch.setattr(ragged, "gpu_case", gpu_case)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)
    env = bench.BenchEnv(on_gpu=True, quick=True, iters=1, deadline=0.0, device="fake")
    rows = list(ragged.run_family(env))
    assert rows[0]["ok"] is False and "ValueError: triton compile failed" in rows[0]["error"]
    assert rows[1] == dict(case=two[1].name, ok=True)


@pytest.mark.parametrize("fails", [False, True])
def test_ragged_prefetch_ab(bench, monkeypatch, fails):
    """The paired A/B of `prefetch_rows` (a stand-in kernel records its knobs; with
    `fails`, the 128-token one cannot compile and the 64-token one still runs)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_ragged_cases as ragged

    seen = []

    def kernel(q, *args, **knobs):
        seen.append(knobs)
        if fails and knobs.get("prefetch_rows") and "block_kv" not in knobs:
            raise ValueError("out of resource: shared memory")
        return q * 2

    monkeypatch.setattr(ragged, "ragged_paged_attention_gpu", kernel)
    env = bench.BenchEnv(on_gpu=True, quick=False, iters=3, deadline=0.0, device="fake")
    paged = [(jnp.full((4, 2), float(i)), None) for i in range(2)]
    out = ragged.prefetch_ab(paged, dict(num_stages=2, block_kv=128), env, bench)
    kv64 = dict(prefetch_rows=True, num_stages=3, block_kv=64)
    assert {} in seen and dict(prefetch_rows=True, num_stages=3) in seen and kv64 in seen
    assert out["prefetch_kv64_over_default"] > 0 and out["prefetch_kv64_cfg"] == kv64
    if fails:
        assert "out of resource" in out["error_prefetch"] and "prefetch_cfg" not in out
    else:
        assert out["prefetch_over_default"] > 0
    # A default tile of 64 tokens or fewer: the one alternative.
    assert set(ragged.prefetch_ab(paged, dict(num_stages=3, block_kv=64), env, bench)) <= {
        "prefetch_over_default",
        "prefetch_cfg",
        "error_prefetch",
    }


def test_tune_kernels_dry_run(tmp_path, monkeypatch):
    """scripts/tune_kernels.py on the CPU: each grid times, and the winners are checked."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location(
        "tune_under_test", SCRIPT.parent / "tune_kernels.py"
    )
    tune = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, tune)
    spec.loader.exec_module(tune)
    assert tune.main(["--dry-run", "--skip-ceilings", "--out", str(tmp_path)]) == 0
    records = read_jsonl(tmp_path / "tune.jsonl")
    assert records[0]["kind"] == "meta"
    timed = [r for r in records if r["kind"] in ("decode", "ragged")]
    assert timed and all(r["us"] > 0 for r in timed)
    # The default is timed first and last, around every config of the grid.
    configs = [r["config"] for r in timed if r["kind"] == "decode"]
    assert configs == ["default", {"num_splits": 1}, "default"]
    # The dry-run case's default splits in 2: the merge is timed alone too.
    assert [(r["splits"], r["us"] > 0) for r in records if r["kind"] == "merge"] == [(2, True)]
    best = {r["kind"]: r for r in records if r["kind"].endswith("_best")}
    assert set(best) == {"decode_best", "ragged_best"}
    assert all(r["ok"] and 0 < r["err"] < 1e-2 for r in best.values())


def load_script(name: str, monkeypatch) -> types.ModuleType:
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location(
        f"{name}_under_test", SCRIPT.parent / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_profile_decode_dry_run(tmp_path, monkeypatch):
    """scripts/profile_decode.py on the CPU: every variant times, the checks pass; the
    device times' plumbing (the "/host:CPU" plane in a dry run)."""
    profile = load_script("profile_decode", monkeypatch)
    assert profile.main(["--dry-run", "--device-times", "--out", str(tmp_path)]) == 0
    records = read_jsonl(tmp_path / "profile_decode.jsonl")
    assert records[0]["kind"] == "meta" and records[0]["tuning"]["num_splits"] == 2
    (check,) = [r for r in records if r["kind"] == "check"]
    assert check["ok"] and set(check["errors"]) == {"default", "kernel+merge", "contiguous"}
    assert all(0 < e < 1e-2 for e in check["errors"].values())
    variants = {r["name"]: r for r in records if r["kind"] == "variant"}
    names = ["default", "kernel", "merge", "merge_xla", "one_split", "one_buffer", "contiguous"]
    assert list(variants) == [*names, "fixed_cost", "dense_xla"]
    assert all(r["us"] > 0 for r in variants.values())
    # GB/s only where the variant reads the whole cache.
    assert {n for n, r in variants.items() if "gbps" not in r} == {
        "merge",
        "merge_xla",
        "fixed_cost",
    }
    device = {r["name"]: r for r in records if r["kind"] == "device"}
    assert list(device) == ["merge", "merge_xla"]  # on a GPU: profile.DEVICE_VARIANTS
    for r in device.values():
        assert "error" not in r and r["segments"] == 1 and r["busy_us_per_call"] > 0, r
        assert sum(k["count"] for k in r["kernels"].values()) == r["events"] > 0


def test_run_device_tests_tally(monkeypatch):
    """The device-test runner's counts: pytest's summary line, else the -v verdicts."""
    runner = load_script("run_device_tests", monkeypatch)
    summary = "x.py::t PASSED\n==== 1 failed, 9 passed, 2 skipped, 1 error in 50.2s ===="
    assert runner.tally(summary) == dict(failed=1, passed=9, skipped=2, error=1)
    killed = "t.py::a[x] PASSED [ 10%]\nt.py::b FAILED [ 20%]\nt.py::c PASSED\nt.py::d "
    assert runner.tally(killed) == dict(passed=2, failed=1)
    assert runner.tally("") == {}
