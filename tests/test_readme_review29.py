"""The README's references to the code resolve, and the defaults and figures it states are
the code's (what tests/test_readme.py does not check: it runs the examples and the
scripts' flag lists).

Every source file is named in "Where things are"; every dotted API name in a code span
(`decode.check_cache`, `llm.sampling_defaults`, ...) exists; every keyword argument a
code span passes (`LLM(..., kv_cache_dtype="fp8")`, `update_params(new,
check_finite=True)`) is one the callee takes; each default the README states in words
is the signature's or the parser's; the planner's figures are what it prints; and every
flag of a `scripts/` command in BENCHMARKS.md or the README is one that script parses.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

from pagedjax import planner
from pagedjax.beam_search import BeamSearchParams
from pagedjax.config import CacheConfig
from pagedjax.engine import LLM, SamplingParams, StructuredOutputsParams
from pagedjax.lora import LoRARequest
from pagedjax.request import RequestOutput
from pagedjax.sampling_params import RequestOutputKind
from pagedjax.scheduler import Scheduler
from pagedjax.step_input import SeqChunk
from pagedjax.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()
# Code spans, which may wrap across lines as the README's do.
SPANS = re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", README, flags=re.S))
FILE_SUFFIXES = (".py", ".md", ".json", ".jinja", ".bin", ".safetensors", ".sh", ".toml")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : None if end < 0 else end]


def test_every_source_file_is_named_in_where_things_are():
    section = _section("Where things are")
    files = [*ROOT.glob("pagedjax/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]
    files += [*ROOT.glob("scripts/*.py"), *ROOT.glob("scripts/*.sh")]
    # (a kernel family's gpu.py / tpu.py are named as `paged_decode/{gpu,gpu_merge,tpu}.py`)
    named = set(re.findall(r"[\w]+\.(?:py|sh)", section))
    for group in re.findall(r"\{([\w,]+)\}\.py", section):
        named |= {f"{name}.py" for name in group.split(",")}
    missing = sorted(
        str(f.relative_to(ROOT)) for f in files if f.name != "__init__.py" and f.name not in named
    )
    assert not missing, f"source files the README's module list does not name: {missing}"


# Code spans that name other projects' APIs: OpenAI's response field, HF's generate.
FOREIGN = {"message.tool_calls", "generate(num_beams=...)"}
# What a code span's first name stands for.
ROOTS = {
    "LLM": LLM,
    "llm": LLM,
    "SamplingParams": SamplingParams,
    "Scheduler": Scheduler,
    "SeqChunk": SeqChunk,
    "Tokenizer": Tokenizer,
    "RequestOutput": RequestOutput,
    "engine": importlib.import_module("pagedjax.serving").EngineThread,  # engine.call
}


def _resolve(dotted: str):
    """The object `dotted` names (AttributeError / ImportError if none)."""
    head, *rest = dotted.split(".")
    if head in ROOTS:
        obj = ROOTS[head]
    elif head == "pagedjax":
        obj = importlib.import_module("pagedjax")
    elif head in ("jax", "nnx"):
        obj = importlib.import_module("flax.nnx" if head == "nnx" else "jax")
    else:
        obj = importlib.import_module(f"pagedjax.{head}")
    for i, name in enumerate(rest):
        if inspect.ismodule(obj) and not hasattr(obj, name):
            obj = importlib.import_module(f"{obj.__name__}.{name}")
            continue
        if inspect.isclass(obj) and not hasattr(obj, name):
            # an instance attribute the constructor sets (`llm.sampling_defaults`) or a
            # dataclass field (`RequestOutput.prompt_logprobs`)
            fields = getattr(obj, "__dataclass_fields__", {})
            init = inspect.getsource(obj.__init__) if "__init__" in vars(obj) else ""
            if name in fields or re.search(rf"self\.{name}\b\s*(?:,|=[^=])", init):
                assert i == len(rest) - 1, dotted
                return name
        obj = getattr(obj, name)
    return obj


def test_every_api_name_in_a_code_span_exists():
    names = set()
    for span in SPANS:
        m = re.match(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(|$)", span.strip())
        if m and not m.group(1).endswith(FILE_SUFFIXES) and m.group(1) not in FOREIGN:
            names.add(m.group(1))
    assert len(names) > 30, sorted(names)  # (the extraction found them)
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} ({e})")
    assert not missing, f"names the README cites that the code lacks: {missing}"


# Callables a code span calls by a bare name (`generate(..., priority=[...])`).
CALLEES = {
    "LLM": LLM.__init__,
    "SamplingParams": SamplingParams,
    "BeamSearchParams": BeamSearchParams,
    "StructuredOutputsParams": StructuredOutputsParams,
    "LoRARequest": LoRARequest,
    "CacheConfig": CacheConfig,
}


def _calls(text: str):
    """(callee, top-level keyword names, top-level argument texts) of each call in `text`."""
    for m in re.finditer(r"([A-Za-z_][\w.]*)\(", text):
        depth, i, start, args = 1, m.end(), m.end(), []
        while i < len(text) and depth:
            c = text[i]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            if (c == "," and depth == 1) or depth == 0:
                args.append(text[start:i].strip())
                start = i + 1
            i += 1
        if depth == 0:
            yield m.group(1), args


def _callee(name: str):
    if name in CALLEES:
        return CALLEES[name]
    if "." in name:
        obj = _resolve(name)
        return obj if callable(obj) else None
    return getattr(LLM, name, None)  # `update_params(new, ...)`, `wake_up(tags=...)`


def test_every_keyword_a_code_span_passes_is_taken():
    checked, bad = 0, []
    for span in (s for s in SPANS if s not in FOREIGN):
        for name, args in _calls(span):
            fn = _callee(name)
            if fn is None:
                continue
            params = inspect.signature(fn).parameters
            takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
            for arg in args:
                kw = re.match(r"([A-Za-z_]\w*)\s*=(?!=)", arg)
                if kw and kw.group(1) not in params and not takes_kwargs:
                    bad.append(f"{name}({kw.group(1)}=...) in `{' '.join(span.split())}`")
                checked += bool(kw)
    # `LoRARequest(lora_name, lora_int_id, lora_path)`: the README names its fields in order
    fields = re.search(r"`LoRARequest\((\w+), (\w+),\s+(\w+)\)`", README)
    assert fields and list(fields.groups()) == list(inspect.signature(LoRARequest).parameters)
    assert checked > 20, checked
    assert not bad, f"keyword arguments the README passes that the code does not take: {bad}"


def _script_parser(name: str) -> argparse.ArgumentParser:
    """scripts/NAME.py's parser: its `build_parser()`, else the one its `parse_args` or
    `main` builds (caught as it parses, before anything runs)."""
    spec = importlib.util.spec_from_file_location(f"{name}_readme29", ROOT / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
        sys.modules.pop(spec.name, None)
    if hasattr(module, "build_parser"):
        return module.build_parser()

    class Caught(Exception):
        pass

    def catch(self, *args, **kwargs):
        raise Caught(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", catch)
        mp.setattr(argparse.ArgumentParser, "parse_known_args", catch)
        try:
            (getattr(module, "parse_args", None) or module.main)([])
        except Caught as e:
            return e.args[0]
    raise AssertionError(f"scripts/{name}.py built no parser")


def _defaults(parser: argparse.ArgumentParser) -> dict:
    return {a.dest: a.default for a in parser._actions} | parser._defaults


def test_the_defaults_the_readme_states():
    """Each (README phrase, the value the code has): the phrase is there, and the value
    is what the phrase says."""
    llm = {k: p.default for k, p in inspect.signature(LLM.__init__).parameters.items()}
    sp = {k: p.default for k, p in inspect.signature(SamplingParams).parameters.items()}
    pause = inspect.signature(LLM.pause_generation).parameters
    gen = _defaults(_script_parser("generate"))
    chat = _defaults(_script_parser("chat"))
    serve = _defaults(_script_parser("serve"))
    reply = "else temperature\n0.7 and 256 tokens a reply"
    claims = [
        ("`LLM(max_logprobs=20)`", llm["max_logprobs"], 20),
        ("`max_loras` (default 1)", llm["max_loras"], 1),
        ("`max_lora_rank` (default 16)", llm["max_lora_rank"], 16),
        ("the engine's 0.01 of\nthe pages by default", llm["watermark"], 0.01),
        ("`--max-batch-tokens`, the engine's 1024 by default", llm["max_num_batched_tokens"], 1024),
        ('under\nthe default "fcfs"', llm["scheduling_policy"], "fcfs"),
        ("(`--generation-config auto`, the\ndefault)", llm["generation_config"], "auto"),
        ("(`--generation-config auto`, the\ndefault)", gen["generation_config"], "auto"),
        ("the default `FINAL_ONLY`", sp["output_kind"], RequestOutputKind.FINAL_ONLY),
        ('`mode="abort"` (vLLM\'s default)', pause["mode"].default, "abort"),
        ("`clear_cache=True` (the default)", pause["clear_cache"].default, True),
        ("Defaults: `--page-size` 16", gen["page_size"], 16),
        ("`--max-batch-tokens` 1024", gen["max_batch_tokens"], 1024),
        ("`--max-logprobs` 20", gen["max_logprobs"], 20),
        ("`--tensor-parallel` 1", gen["tensor_parallel"], 1),
        ("greedy with 64 tokens", gen["script_defaults"]["temperature"], 0.0),
        ("greedy with 64 tokens", gen["script_defaults"]["max_tokens"], 64),
        (reply, chat["script_defaults"]["temperature"], 0.7),
        (reply, chat["script_defaults"]["max_tokens"], 256),
        ("`--read-timeout S` (default 60)", serve["read_timeout"], 60),
        ("`--max-connections N` (default 1024)", serve["max_connections"], 1024),
        ("it binds 127.0.0.1 unless `--host`", serve["host"], "127.0.0.1"),
        ("curl -s localhost:8000/v1/chat/completions", serve["port"], 8000),
        ("(under the default `fcfs`", serve["scheduling_policy"], "fcfs"),
    ]
    absent = [phrase for phrase, _, _ in claims if phrase not in README]
    assert not absent, f"phrases no longer in the README (update this test): {absent}"
    wrong = [(phrase, got, said) for phrase, got, said in claims if got != said]
    assert not wrong, f"README defaults the code does not have (phrase, code, README): {wrong}"


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_planner_figures_are_what_it_prints(capsys):
    section = _section("The capacity planner")
    (command,) = re.findall(r"python -m pagedjax\.planner (--model .*)", section)
    assert planner.main([*command.split(), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    m = re.search(r"bf16: ([\d,]+) bytes, ([\d.]+) GiB", section)
    assert (_number(m.group(1)), float(m.group(2))) == (got["kv_cache_bytes"], got["kv_cache_gib"])

    m = re.search(
        r"Mistral-7B \(W = ([\d,]+)\), ([\d,]+)-token sequences, (\d+) GiB: ([\d,]+) pages,\s+"
        r"(\d+) kept free, (\d+) a sequence, so (\d+) sequences paged against (\d+) contiguous "
        r"rings; without\s+the window, (\d+) against (\d+)\.",
        section,
    )
    assert m, "the Mistral example's sentence changed (update this test)"
    window, seq_len, gib, pages, free, per_seq, paged, rings, paged0, contig0 = map(
        _number, m.groups()
    )
    args = ["--model", "mistral-7b-v0.1", "--seq-len", str(seq_len), "--memory-gb", str(gib)]
    assert planner.main([*args, "--json"]) == 0
    w = json.loads(capsys.readouterr().out)
    assert planner.main([*args, "--sliding-window", "0", "--json"]) == 0
    no_w = json.loads(capsys.readouterr().out)
    assert (w["sliding_window"], w["num_pages"], w["watermark_pages"]) == (window, pages, free)
    assert (w["window_pages"], w["max_seqs_paged"], w["max_seqs_contiguous"]) == (
        per_seq,
        paged,
        rings,
    )
    assert (no_w["max_seqs_paged"], no_w["max_seqs_contiguous"]) == (paged0, contig0)


def _shell_commands(text: str) -> list[tuple[str, str]]:
    """(script, its arguments) of each `python scripts/X.py ...` / `bash scripts/X.sh ...`
    in `text`, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = re.findall(r"(?:python|bash) (scripts/\w+\.(?:py|sh))([^`\n]*)", text)
    found += re.findall(r"`(scripts/\w+\.py)( --[^`]*)`", text)  # `scripts/x.py --flag N`
    return [(script, args.split(" #")[0]) for script, args in found]


@pytest.mark.parametrize("doc", ["BENCHMARKS.md", "README.md"])
def test_every_flag_of_a_script_command_exists(doc):
    text = BENCHMARKS if doc == "BENCHMARKS.md" else README
    commands = _shell_commands(text)
    assert len(commands) > (20 if doc == "BENCHMARKS.md" else 5), commands
    parsers, bad = {}, []
    for script, args in commands:
        name = Path(script).stem
        if script.endswith(".sh"):  # its flags, as its usage comment and case arms spell them
            known = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", (ROOT / script).read_text()))
        else:
            if name not in parsers:
                parsers[name] = {o for a in _script_parser(name)._actions for o in a.option_strings}
            known = parsers[name]
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", args))
        bad += [f"{script} {flag}" for flag in sorted(flags - known)]
    assert not bad, f"{doc} commands with flags their script does not take: {bad}"
