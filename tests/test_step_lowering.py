"""Whole engine steps at Llama-3-8B scale lower for CUDA and TPU on a CPU-only machine.

The kernel tests lower each kernel alone; here the jitted `prefill_step` and
`decode_step` (CoW copies, 32 layers of paged forward with the kernels, sampling)
are traced on abstract parameters and an abstract 4,096-page cache (nothing is
allocated) and lowered for the real targets, as the GPU path of scripts/generate.py
would run them. Each layer must call its kernel once, on the whole layer pool: the
pool reaches the kernel as itself (a free reshape), never as a gathered copy.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import pytest
from flax import nnx

from pagedjax import cache as cache_lib
from pagedjax import config, decode, model

CFG = config.preset("llama3-8b")
CACHE = config.CacheConfig(page_size=16, num_pages=4096, dtype=CFG.dtype)


@pytest.fixture(scope="module")
def abstract_state():
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.Llama(CFG, rngs=nnx.Rngs(0))))
    params = model.Params(graphdef=graphdef, state=state, config=CFG)
    return params, jax.eval_shape(lambda: cache_lib.create(CFG, CACHE))


def _step_input(is_decode: bool):
    if is_decode:  # 8 sequences, one token each
        chunks = [
            decode.SeqChunk([5], start_pos=100 + i, page_table=list(range(8 * i, 8 * i + 8)))
            for i in range(8)
        ]
        return decode.build_step_input(chunks, CFG, CACHE)
    chunks = [  # a prompt chunk over a cached prefix, a decode row, one CoW page copy
        decode.SeqChunk(list(range(40)), start_pos=30, page_table=list(range(8))),
        decode.SeqChunk([7], start_pos=50, page_table=list(range(8, 16))),
    ]
    return decode.build_step_input(chunks, CFG, CACHE, copies=[(3, 20)])


@pytest.mark.parametrize("backend, platform", [("gpu", "cuda"), ("tpu", "tpu")])
@pytest.mark.parametrize(
    "is_decode, scored",
    [(False, False), (True, False), (False, True)],
    ids=["prefill", "decode", "prefill-prompt-logprobs"],
)
def test_step_lowers_with_one_kernel_call_per_layer(
    abstract_state, backend, platform, is_decode, scored
):
    """`scored`: a prompt-logprobs step, its LM head mapped over row chunks."""
    params, cache = abstract_state
    inp = _step_input(is_decode)
    if scored:
        inp = dataclasses.replace(inp, target_ids=jax.numpy.zeros_like(inp.token_ids))
    jitted = decode._decode_jit if is_decode else decode._prefill_jit
    traced = jitted.trace(
        params, cache, inp, backend=backend, interpret=False, num_top_logprobs=0,
        num_prompt_top_logprobs=5 if scored else 0, return_logits=False,
    )  # fmt: skip
    text = traced.lower(lowering_platforms=(platform,)).as_text()

    marker = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert marker in text, f"no {platform} kernel in the lowered step"
    pool = f"tensor<{CFG.num_kv_heads}x{CACHE.num_pages}x{CACHE.page_size}x{CFG.head_dim}xbf16>"
    # Calls of the kernel's wrapper function with the K and V pools as operands.
    calls = [
        line
        for line in text.splitlines()
        if re.search(r"\bcall @", line) and line.count(pool) >= 2 and "->" in line
    ]
    assert len(calls) == CFG.num_layers, f"{len(calls)} kernel calls for {CFG.num_layers} layers"
