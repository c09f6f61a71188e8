"""Smoke tests of scripts/bench_kernels.py on the CPU.

The CPU path (interpret-mode correctness) runs as a user would run it. The GPU
path cannot run here, so a second test drives its code on a tiny case with the
kernels swapped for their interpret-mode versions: it catches plain Python
mistakes before the rare GPU session does.
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
    (row,) = result["results"]["decode"]
    assert row["ok"] is True
    assert 0 < row["err_ours"] < 1e-2 and 0 < row["err_tpu"] < 1e-2 and row["err_dense"] < 1e-2


def test_cpu_path_reports_broken_tpu_kernel(bench, capsys, monkeypatch):
    def broken(q, *args, **kwargs):
        return jnp.zeros_like(q) + 1

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
    monkeypatch.setattr(bench, "measure_copy_gbps", lambda iters: 1.0)
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


def test_gpu_path_survives_failing_kernels(bench, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("triton says no")

    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "paged_decode_gpu", broken)
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (None, "ImportError: gone"))
    monkeypatch.setattr(bench, "measure_copy_gbps", lambda iters: 1.0)
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

    monkeypatch.setattr(bench, "has_gpu", lambda: True)
    monkeypatch.setattr(bench, "paged_decode_gpu", ours)
    monkeypatch.setattr(bench, "bundled_kernel", lambda: (bundled, None))
    monkeypatch.setattr(bench, "measure_copy_gbps", lambda iters: 1.0)
    monkeypatch.setattr(bench, "measure_matmul_tflops", lambda iters: 1.0)
    monkeypatch.setattr(bench, "L2_BYTES", 1)
    monkeypatch.setattr(bench, "CALLS", (2, 2))
    case = bench.DecodeCase(1, 512, num_heads=2, num_kv_heads=1, head_dim=16)
    monkeypatch.setattr(bench, "GPU_DECODE_CASES", [case])
    assert bench.main(["--iters", "1", "--budget-s", "600"], families=[bench.DECODE]) == 0
    out = capsys.readouterr().out
    assert "x bundled" in out and "paged/dense" in out
    tried = {tuple(sorted(c.items())) for c in seen["bundled"]}
    assert len(tried) >= 10  # k_splits, then blocks, then warps/stages
    assert any("num_warps" in c for c in seen["bundled"])
    assert {"num_splits", "block_kv", "num_stages"} <= {k for t in seen["ours"] for k in t}
