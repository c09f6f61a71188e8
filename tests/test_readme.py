"""The README's examples and flag lists match the code.

The five Python examples of "Use it from Python" run as written (the kernel
example on random inputs it names but does not build), and so do the two of
"Running on several GPUs" (on 4 simulated CPU devices, the tiny preset for the
checkpoint); every flag of scripts/generate.py and scripts/serve.py is in "Serve a
checkpoint", and every flag that section, "LoRA adapters" and "The capacity planner"
name exists; the `--json` metrics row lists the engine's summary keys; the test
command is what `.ci/run` runs, and the demo command's flags parse with
scripts/generate.py's parser (running it is the demo, not a test).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.metrics import SUMMARY_KEYS
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


def test_the_section_has_five_examples():
    assert len(EXAMPLES) == 5


def test_engine_example_runs(capsys):
    exec(compile(EXAMPLES[0], "README engine example", "exec"), {})
    assert "num_generated_tokens" in capsys.readouterr().out


def test_weight_update_example_runs():
    """The RL loop's example: the engine ends on the last weights it was given."""
    namespace = {}
    exec(compile(EXAMPLES[1], "README weight-update example", "exec"), namespace)
    llm, policy = namespace["llm"], namespace["policy"]
    got, want = jax.tree.leaves(llm.params), jax.tree.leaves(policy)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert len(namespace["outs"]) == 4 and not llm.has_unfinished_requests()


def test_pause_example_runs():
    """The in-flight update after the RL loop's example: the kept requests finish."""
    namespace = {}
    exec(compile(EXAMPLES[1], "README weight-update example", "exec"), namespace)
    exec(compile(EXAMPLES[2], "README pause example", "exec"), namespace)
    llm, done = namespace["llm"], namespace["done"]
    assert sorted(o.request_id for o in done) == sorted(namespace["ids"])
    assert all(o.finished and o.outputs[0].finish_reason != "abort" for o in done)
    assert not llm.is_paused() and not llm.has_unfinished_requests()


def test_functional_core_example_runs(capsys):
    namespace = {}
    exec(compile(EXAMPLES[3], "README functional-core example", "exec"), namespace)
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
    block = EXAMPLES[4]
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


def _script_flags(name: str) -> set[str]:
    """The `--` flags of scripts/NAME.py's `build_parser()`."""
    spec = importlib.util.spec_from_file_location(f"{name}_for_readme", ROOT / f"scripts/{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return {
        option
        for action in script.build_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def _help_flags(*command: str) -> set[str]:
    """The `--` flags a command's `--help` lists."""
    proc = subprocess.run(
        [sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", proc.stdout))


def test_every_generate_flag_is_in_the_readme():
    section = _section("Serve a checkpoint")
    missing = sorted(f for f in _script_flags("generate") if f not in section)
    assert not missing, f"flags of scripts/generate.py missing from the README: {missing}"


def test_every_serve_flag_is_in_the_readme():
    section = _section("Serve a checkpoint")
    missing = sorted(f for f in _script_flags("serve") if f not in section)
    assert not missing, f"flags of scripts/serve.py missing from the README: {missing}"


def test_every_flag_the_readme_names_exists():
    """The section names flags of generate.py, chat.py, serve.py and convert_checkpoint.py
    (which has no build_parser: its --help lists them)."""
    flags = set().union(*map(_script_flags, ("generate", "chat", "serve")))
    flags |= _help_flags("scripts/convert_checkpoint.py")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _section("Serve a checkpoint")))
    assert named - flags == set(), f"flags the README names that no script has: {named - flags}"


def test_every_lora_and_planner_flag_the_readme_names_exists():
    scripts = set().union(*map(_script_flags, ("generate", "chat", "serve")))
    scripts |= _help_flags("scripts/convert_checkpoint.py")  # (--merge-lora)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _section("LoRA adapters")))
    assert named and named - scripts == set(), f"LoRA flags no script has: {named - scripts}"
    planner = _help_flags("-m", "pagedjax.planner")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _section("The capacity planner")))
    assert named and named - planner == set(), f"planner flags it lacks: {named - planner}"


def test_the_demo_command_parses():
    """The demo command's arguments are ones scripts/generate.py's parser takes."""
    head = ".venv/bin/python scripts/generate.py"
    (line,) = [line for line in _section("Two commands").splitlines() if head in line]
    argv = shlex.split(line.split(head, 1)[1])
    spec = importlib.util.spec_from_file_location(
        "generate_for_readme", ROOT / "scripts/generate.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.build_parser().parse_args(argv)
    assert (args.temperature, args.top_p, args.seed, args.max_tokens) == (0.7, 0.9, 0, 64)


def test_the_json_metrics_row_lists_the_summary_keys():
    row = next(line for line in README.splitlines() if line.startswith("| `metrics` |"))
    words = set(re.findall(r"[a-z][a-z0-9_]*", row.split("|")[2]))
    assert set(SUMMARY_KEYS) - words == set(), "summary keys missing from the README"
    listed = {w for w in words if "_" in w}
    assert listed - set(SUMMARY_KEYS) == set(), "README metrics that summary() lacks"


# Runs the section's two examples on 4 simulated CPU devices: the engine one with the tiny
# preset for its checkpoint, the functional one on `cfg`, `params` and `step_input` as the
# functional-core example makes them, its tokens checked against the same step unsharded.
_TP_SCRIPT = """
import json, sys
import numpy as np
from pagedjax import cache as cache_lib, config, decode, model

engine_block, core_block = json.loads(sys.argv[1])
ns = dict(PATH=config.preset("tiny"))
exec(engine_block.replace('"/path/to/llama"', "PATH"), ns)
assert ns["llm"].tensor_parallel == 4, ns["llm"].tensor_parallel

cfg = config.preset("tiny")
params = model.init_params(cfg, seed=0)
cache_cfg = config.CacheConfig(16, 1024, cfg.dtype)
chunks = [decode.SeqChunk([1, 5, 7, 9, 11], start_pos=0, page_table=[3]),
          decode.SeqChunk([1, 42], start_pos=0, page_table=[7])]
step_input = decode.build_step_input(chunks, cfg, cache_cfg)
want, _ = decode.prefill_step(params, cache_lib.create(cfg, cache_cfg), step_input)
ns = dict(cfg=cfg, params=params, step_input=step_input)
exec(core_block, ns)
assert ns["params"].mesh.devices.size == 4 and len(ns["cache"].k[0].sharding.device_set) == 4
got = np.asarray(ns["out"].tokens)[:2]
assert (got == np.asarray(want.tokens)[:2]).all(), (got, want.tokens)
print("ok", got.tolist())
"""


def test_tensor_parallel_examples_run_on_four_devices():
    blocks = _python_blocks(_section("Running on several GPUs / several hosts"))
    assert len(blocks) == 2 and '"/path/to/llama"' in blocks[0]
    flags = "--xla_force_host_platform_device_count=4"  # set before JAX starts
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, json.dumps(blocks)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


def test_the_two_commands_are_what_ci_runs():
    commands = _section("Two commands")
    ci = (ROOT / ".ci" / "run").read_text()
    test = '.venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest -q -n 2'
    assert test + "\n" in commands
    assert '.venv/bin/pip install -q -e ".[test]"' in ci
    # (the README's command; --durations only names the slowest tests, the same ones run)
    assert re.search(r"^\.venv/bin/python -m pytest -q -n 2( --durations=\d+)?$", ci, re.M)
    assert "scripts/generate.py" in commands
