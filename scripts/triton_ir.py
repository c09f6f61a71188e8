"""What Triton makes of our GPU kernels, on a machine without a GPU.

    python scripts/triton_ir.py decode --batch 32 --seq-len 4096 --page-size 16
    python scripts/triton_ir.py ragged --tokens 2048 --seqs 4 --knobs '{"prefetch_rows": true}'
    python scripts/triton_ir.py ragged ... --triton-python /path/to/venv/bin/python --json

Our Pallas kernels are lowered for `cuda` on the CPU (Llama-3-8B heads by default:
32 query heads, 8 kv heads, D=128, bfloat16), and the Triton IR of every Pallas
call is written to `--out` (one `<kernel>.ttir` each; the paged decode path has two
launches when it splits: the kernel and the merge). With `--triton-python`, a Python
that has pip's `triton` (no GPU needed; keep it in its own venv), each module is
compiled there for sm90 with its launch's `num_warps` and `num_stages`, and the
table reports what decides a memory-bound loop's speed:

  shared    bytes of shared memory per program (the H200 allows 232,448)
  regs      registers per thread, and `stack`: bytes spilled (cuobjdump)
  waits     the `async_wait`s of the TTGIR: `num = 0` waits for every copy in flight
            (nothing overlaps the next tile's loads), `num = k` keeps k in flight
  buffers   the multi-buffered shared allocations (depth x tile), e.g. K/V tiles

This is how BENCHMARKS.md's compile-only tables were made. pip's Triton is not
the Triton inside jaxlib: its choices are evidence, not a measurement; time on a
GPU before changing a default. The capture reads `num_warps` / `num_stages` from
jax's Pallas-to-Triton lowering (private API, `jax._src.pallas.triton`): a jax
release that renames them makes this script fail with a clear error, not lie.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp

COMPILE = r"""
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
path, num_warps, num_stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=num_stages))
stem = path.rsplit(".", 1)[0]
Path(stem + ".ttgir").write_text(k.asm["ttgir"])
Path(stem + ".cubin").write_bytes(k.asm["cubin"])
tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
print(json.dumps(dict(shared=k.metadata.shared, cuobjdump=str(tools / "cuobjdump"))))
"""


@contextlib.contextmanager
def capture_triton_modules():
    """Records (name, num_warps, num_stages, Triton IR text) of every Pallas call that
    is lowered for a GPU inside the block."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    found, original = [], reg.lowering.lower_jaxpr_to_triton_module

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering's launch parameters
        missing = [k for k in ("num_warps", "num_stages", "name") if k not in caller]
        if missing:
            raise RuntimeError(f"this jax's Pallas Triton lowering has no locals {missing}")
        text = result.module.operation.get_asm(enable_debug_info=False)
        found.append((caller["name"], caller["num_warps"], caller["num_stages"], text))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = wrapper
    try:
        yield found
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original


def lower(kind: str, args, knobs: dict) -> list[tuple[str, int, int, str]]:
    """The Triton modules of one call of our `kind` ("decode" or "ragged") kernel."""
    sds = jax.ShapeDtypeStruct
    dtype = jnp.dtype(args.dtype)
    heads, kv_heads, dim, page = args.heads, args.kv_heads, args.head_dim, args.page_size
    if kind == "decode":
        from pallas_kernels.paged_decode.gpu import paged_decode_gpu as fn

        max_pages = -(-args.seq_len // page)
        shapes = (
            sds((args.batch, heads, dim), dtype),
            sds((kv_heads, args.batch * max_pages, page, dim), dtype),
            sds((kv_heads, args.batch * max_pages, page, dim), dtype),
            sds((args.batch,), jnp.int32),
            sds((args.batch, max_pages), jnp.int32),
        )
    else:
        from pallas_kernels.ragged.gpu import ragged_paged_attention_gpu as fn

        max_pages = -(-args.context // page)
        shapes = (
            sds((args.tokens, heads, dim), dtype),
            sds((kv_heads, args.seqs * max_pages, page, dim), dtype),
            sds((kv_heads, args.seqs * max_pages, page, dim), dtype),
            sds((args.seqs, max_pages), jnp.int32),
            sds((args.seqs,), jnp.int32),
            sds((args.seqs + 1,), jnp.int32),
        )
    with capture_triton_modules() as found:
        jax.jit(lambda *a: fn(*a, **knobs)).trace(*shapes).lower(lowering_platforms=("cuda",))
    if not found:
        raise RuntimeError(f"no Triton module was lowered for {kind} with {knobs}")
    return found


def analyze_ttgir(text: str) -> dict:
    """The async waits and the pipelined (mutable) shared allocations of a TTGIR module."""
    waits = Counter(
        int(n) for n in re.findall(r"ttg\.async_wait [^\n]*?\{num = (\d+) : i32\}", text)
    )
    allocs = re.findall(r"ttg\.local_alloc[^\n]*?-> !ttg\.memdesc<([^,>]+)([^>]*)>", text)
    buffers = Counter(shape for shape, tail in allocs if "mutable" in tail)
    return dict(
        waits={f"num={n}": c for n, c in sorted(waits.items())},
        buffers=dict(sorted(buffers.items())),
    )


def compile_report(ttir: Path, num_warps: int, num_stages: int, python: str) -> dict:
    """Compiles one Triton IR file for sm90 under `python` (with pip's triton)."""
    proc = subprocess.run(
        [python, "-c", COMPILE, str(ttir), str(num_warps), str(num_stages)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        return dict(error=(proc.stderr.strip().splitlines() or ["failed"])[-1])
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    report = dict(shared=info["shared"])
    cubin = ttir.with_suffix(".cubin")
    usage = subprocess.run(
        [info["cuobjdump"], "--dump-resource-usage", str(cubin)], capture_output=True, text=True
    ).stdout
    if m := re.search(r"REG:(\d+) STACK:(\d+)", usage):
        report.update(regs=int(m[1]), stack=int(m[2]))
    report.update(analyze_ttgir(ttir.with_suffix(".ttgir").read_text()))
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("kind", choices=("decode", "ragged"))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="q's dtype and the pages'")
    p.add_argument("--batch", type=int, default=32, help="decode: sequences")
    p.add_argument("--seq-len", type=int, default=4096, help="decode: page-table width")
    p.add_argument("--tokens", type=int, default=2048, help="ragged: T query rows")
    p.add_argument("--seqs", type=int, default=4, help="ragged: B sequences")
    p.add_argument("--context", type=int, default=2048, help="ragged: page-table width")
    p.add_argument("--knobs", type=json.loads, default={}, help="JSON tuning knobs")
    p.add_argument("--triton-python", help="a Python with pip's triton: compile for sm90")
    p.add_argument("--out", type=Path, default=Path("triton_ir"), help="where files go")
    p.add_argument("--json", action="store_true", help="one JSON list on stdout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (name, num_warps, num_stages, text) in enumerate(lower(args.kind, args, args.knobs)):
        ttir = args.out / f"{i}_{name}.ttir"
        ttir.write_text(text)
        row = dict(kernel=name, num_warps=num_warps, num_stages=num_stages, ttir=str(ttir))
        if args.triton_python:
            row.update(compile_report(ttir, num_warps, num_stages, args.triton_python))
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for row in rows:
        figures = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("kernel", "ttir"))
        print(f"{row['kernel']}: {figures}\n  {row['ttir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
