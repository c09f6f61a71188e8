"""The README's examples and flag lists match the code.

The three Python examples of "Use it from Python" run as written (the kernel
example on random inputs it names but does not build); every flag of
scripts/generate.py is in the README; the two commands are what `.ci/run` runs.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : None if end < 0 else end]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


EXAMPLES = _python_blocks(_section("Use it from Python"))


def test_the_section_has_three_examples():
    assert len(EXAMPLES) == 3


def test_engine_example_runs(capsys):
    exec(compile(EXAMPLES[0], "README engine example", "exec"), {})
    assert "num_generated_tokens" in capsys.readouterr().out


def test_functional_core_example_runs(capsys):
    namespace = {}
    exec(compile(EXAMPLES[1], "README functional-core example", "exec"), namespace)
    assert len(namespace["tokens"]) == 12  # the prompt's first token, then 11 decode steps
    assert all(0 <= t < namespace["cfg"].vocab_size for t in namespace["tokens"])


def _dense_kv(pages, row, n):
    """One sequence's first n keys or values gathered in numpy: [K, P, S, D] -> [n, K, D]."""
    x = np.asarray(pages)[:, np.asarray(row)]  # [K, max_pages, S, D]
    return x.transpose(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[-1])[:n]


def test_kernel_example_runs_and_matches_the_reference():
    """Checked against dense attention per sequence on numpy-gathered K/V, not against
    the paged XLA path: on the CPU `backend="auto"` is that path."""
    rng = np.random.default_rng(0)
    k_heads, pages, page_size, head_dim, heads = 2, 12, 8, 64, 8
    pool = lambda: jnp.asarray(rng.normal(size=(k_heads, pages, page_size, head_dim)), jnp.float32)
    k_pages, v_pages = pool(), pool()
    page_table = jnp.asarray(rng.permutation(pages)[:9].reshape(3, 3), jnp.int32)
    lengths = jnp.asarray([1, 8, 21], jnp.int32)
    q_lens = np.array([1, 5, 3])
    query_start_loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    namespace = dict(
        q=jnp.asarray(rng.normal(size=(3, heads, head_dim)), jnp.float32),
        k_pages=k_pages,
        v_pages=v_pages,
        lengths=lengths,
        page_table=page_table,
        context_lens=jnp.asarray([4, 8, 21], jnp.int32),
        query_start_loc=query_start_loc,
    )
    decode_q = namespace["q"]
    block = EXAMPLES[2]
    first, second = block.split("# q [T, H, D]")
    exec(compile(first, "README kernel example (decode)", "exec"), namespace)
    want = np.stack(
        [
            reference.attention_chunk(
                decode_q[b][None], _dense_kv(k_pages, row, n), _dense_kv(v_pages, row, n)
            )[0]
            for b, (row, n) in enumerate(zip(page_table, lengths.tolist(), strict=True))
        ]
    )
    assert np.isfinite(np.asarray(namespace["out"])).all()
    np.testing.assert_allclose(namespace["out"], want, rtol=1e-5, atol=1e-5)

    namespace["q"] = jnp.asarray(rng.normal(size=(int(q_lens.sum()), heads, head_dim)), jnp.float32)
    exec(compile("# q [T, H, D]" + second, "README kernel example (ragged)", "exec"), namespace)
    loc = np.asarray(query_start_loc)
    ctx = namespace["context_lens"].tolist()
    want = np.concatenate(
        [
            reference.attention_chunk(
                namespace["q"][loc[b] : loc[b + 1]],
                _dense_kv(k_pages, page_table[b], ctx[b]),
                _dense_kv(v_pages, page_table[b], ctx[b]),
            )
            for b in range(len(ctx))
        ]
    )
    assert namespace["out"].shape == namespace["q"].shape
    assert np.isfinite(np.asarray(namespace["out"])).all()
    np.testing.assert_allclose(namespace["out"], want, rtol=1e-5, atol=1e-5)


def test_every_generate_flag_is_in_the_readme():
    spec = importlib.util.spec_from_file_location(
        "generate_for_readme", ROOT / "scripts/generate.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    flags = {
        option
        for action in gen.build_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    missing = sorted(f for f in flags if f not in _section("Serve a checkpoint"))
    assert not missing, f"flags of scripts/generate.py missing from the README: {missing}"


def test_the_two_commands_are_what_ci_runs():
    commands = _section("Two commands")
    ci = (ROOT / ".ci" / "run").read_text()
    test = '.venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest -q -n 2'
    assert test + "\n" in commands
    assert '.venv/bin/pip install -q -e ".[test]"' in ci
    assert ".venv/bin/python -m pytest -q -n 2\n" in ci
    assert "scripts/generate.py" in commands
