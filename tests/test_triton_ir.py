"""scripts/triton_ir.py: the Triton IR of our GPU kernels, captured on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "triton_ir.py"


@pytest.fixture
def tir(monkeypatch):
    spec = importlib.util.spec_from_file_location("triton_ir_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _run(tir, capsys, argv) -> list[dict]:
    assert tir.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_ragged_knobs_reach_the_captured_launch(tir, capsys, tmp_path):
    knobs = dict(block_q=4, block_kv=32, num_warps=2, num_stages=4, prefetch_rows=True)
    small = ["--tokens", "40", "--seqs", "3", "--context", "64", "--heads", "8", "--kv-heads", "2"]
    argv = ["ragged", *small, "--knobs", json.dumps(knobs), "--out", str(tmp_path)]
    (row,) = _run(tir, capsys, argv)
    assert row["kernel"] == "ragged_paged_attention_bq4_bkv32"
    assert (row["num_warps"], row["num_stages"]) == (2, 4)
    text = Path(row["ttir"]).read_text()
    assert "tt.func" in text and "scf.for" in text


def test_a_split_decode_is_two_launches(tir, capsys, tmp_path):
    argv = ["decode", "--batch", "1", "--seq-len", "2048", "--out", str(tmp_path)]
    rows = _run(tir, capsys, [*argv, "--knobs", '{"num_splits": 4}'])
    assert [r["kernel"] for r in rows] == ["paged_decode_gpu", "paged_decode_merge"]
    assert all(Path(r["ttir"]).is_file() for r in rows)
    (one,) = _run(tir, capsys, [*argv, "--knobs", '{"num_splits": 1}'])
    assert one["kernel"] == "paged_decode_gpu"


def test_analyze_ttgir_counts_waits_and_pipelined_buffers(tir):
    text = """
    %0 = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared, #smem, mutable> loc(#a)
    %1 = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared, #smem, mutable> loc(#b)
    %2 = ttg.local_alloc %q : (tensor<64x128xbf16>) -> !ttg.memdesc<64x128xbf16, #shared, #smem>
    %3 = ttg.async_wait %t0, %t1 {num = 2 : i32} loc(#c)
    %4 = ttg.async_wait {num = 0 : i32} loc(#d)
    %5 = ttg.async_wait %t2 {num = 2 : i32} loc(#e)
    """
    assert tir.analyze_ttgir(text) == dict(
        waits={"num=0": 1, "num=2": 2}, buffers={"3x64x128xbf16": 2}
    )


def test_compiles_for_sm90_where_pip_triton_is_installed(tir, capsys, tmp_path):
    pytest.importorskip("triton")  # not a dependency: the CPU CI skips this
    argv = ["decode", "--batch", "2", "--seq-len", "256", "--out", str(tmp_path)]
    rows = _run(tir, capsys, [*argv, "--triton-python", sys.executable])
    assert rows[0]["shared"] > 0 and rows[0]["regs"] > 0 and "error" not in rows[0]
