"""Generate text with pagedjax's engine, then report what a serving user wants to know.

    python scripts/generate.py                                  # demo model, default prompts
    python scripts/generate.py --prompt "def fib(n):" --max-tokens 64
    python scripts/generate.py --checkpoint path/to/hf-dir --prompts-file prompts.txt --json
    python scripts/generate.py --checkpoint path/to/instruct-dir --chat --prompt "Hi!"

Runs on JAX's default device (a CUDA GPU when jax has one, else the CPU), or with
`--tensor-parallel N` on the first N devices, the model and its KV cache split over
them (`pagedjax.sharding`; several hosts: see the README). With no
`--checkpoint` it serves the embedded demo model (`pagedjax/demo_model`); until that
is there, the `tiny` preset with random weights and a byte tokenizer, and it says so.
A single prompt (n = 1, no beam search, no `--stop`) streams its text as it is
generated; a batch shows a progress bar over requests. Then a closing report: load and
compile time, TTFT, prefill and decode tokens/s, KV bytes read per second (the
DESIGN.md performance model: every step reads its rows' live K/V once), peak device
memory, KV pages, prefix-cache hit rate, preemptions, jit compilations, host overhead.

Sampling defaults, as vLLM's (`--generation-config auto`, the default): of
`--temperature`, `--top-k`, `--top-p`, `--min-p`, `--repetition-penalty` and
`--max-tokens`, those not given take the checkpoint's generation_config.json values
(temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens; `do_sample` is
ignored, as vLLM ignores it), named in one line on stderr; else greedy and 64 tokens.
With `--beam-width`, only max_new_tokens is taken (beam search does not sample, and
only a `--temperature` given conflicts with it). `--generation-config none` ignores the
file. The demo model's sets none of them.

`--seed` seeds the engine, as vLLM's does: each request draws its sampling seed from
it, so a run is reproducible and different prompts get different random draws.
`--stop TEXT` (repeatable) ends a completion where a string appears, cut from its text
(not with `--beam-width`); `--stop-token-ids ID ...` ends it at those tokens (kept), as
EOS does; `--ignore-eos` does not stop at EOS.

`--logprobs K` lists, after the text, each generated token with its log-probability
under the model's raw distribution and the K most likely tokens at its position;
`--prompt-logprobs K` does the same for the prompt's tokens (given the tokens before
each; such prompts are computed whole, without prefix-cache hits).

`--repetition-penalty`, `--presence-penalty`, `--frequency-penalty` penalise tokens
already seen (vLLM's and the OpenAI API's definitions; see `SamplingParams`), greedy
decoding included; not with `--beam-width`. `--min-tokens N` defers every stop (EOS,
stop tokens and strings) until N tokens; `--logit-bias '{"13": -100}'` adds values to
token logits. Neither with `--beam-width`.

`--beam-width N` (> 1) runs beam search, which ranks by log-probability and does not
sample: not with `--temperature` > 0, `--top-k`, `--top-p` or `--min-p`.

`--prompts-file FILE`: one prompt per line (blank lines skipped); a line that starts with
a double quote is read as a JSON string, so a prompt can hold newlines. `-` reads stdin
(so does a pipe's path: `/dev/stdin`, the shell's `<(...)`).

`--chat` (instruct checkpoints): each prompt becomes one user message, after a system
message when `--system TEXT` is given, rendered with the checkpoint's chat template
(`chat_template.jinja`, tokenizer_config.json's, or `chat_template.json`; needs
jinja2, the `chat` extra), or with the Jinja file `--chat-template FILE` instead,
and sent to the engine as token ids. The output still shows the prompt as typed. A
checkpoint without a template, a missing or unparsable template file, or no jinja2, is
an error before any weights load. For a multi-turn conversation, see scripts/chat.py.

`--json` prints one JSON object instead, with these keys:

    model            what was loaded (demo model path, checkpoint, or the random fallback)
    device           the JAX device, e.g. "cuda:0" or "cpu:0"
    backend          the --backend flag
    resolved_backend what "auto" chose: "gpu", "tpu" or "xla"
    settings         page_size, num_pages, max_num_batched_tokens, max_num_seqs,
                     max_model_len, enable_prefix_caching, async_scheduling, tensor_parallel,
                     kv_cache_dtype (the pages' storage dtype),
                     compilation_cache (the directory, or null when off), chat
                     (--chat), chat_template (the --chat-template file or null),
                     system (the --system text or null), and the sampling flags
                     as used (given, or the generation config's, or the defaults;
                     seed is the engine's), stop, stop_token_ids, ignore_eos
    outputs          one per prompt: prompt, prompt_tokens, num_cached_tokens, ttft_s,
                     latency_s, prompt_logprobs, completions: [{text, token_ids,
                     finish_reason, cumulative_logprob, logprobs}]; logprobs is null
                     without --logprobs, else one list per generated token of
                     {token_id, logprob}: the sampled token, then the K most likely;
                     prompt_logprobs likewise with --prompt-logprobs, per prompt
                     token (null for the first)
    metrics          load_time_s, compile_time_s, num_compilations, run_time_s,
                     num_requests, num_steps, num_prompt_tokens, num_prefill_tokens,
                     num_generated_tokens, ttft_mean_s, ttft_p50_s, ttft_p99_s,
                     latency_mean_s, device_time_s, prefill_tokens_per_s (over steps
                     with prefill), decode_tokens_per_s (over pure decode steps),
                     output_tokens_per_s (end to end), kv_bytes_read,
                     kv_bytes_read_per_s, peak_device_memory_bytes
                     (null when the device has no memory stats), kv_pages_used (peak),
                     kv_pages_total, kv_utilization (peak used / total),
                     prefix_cache_hit_rate, preemptions, host_hidden_ms_per_step,
                     host_exposed_ms_per_step, device_wait_ms_per_step

Compiled step programs are kept in a persistent XLA compilation cache, so a second
run of the same model and geometry skips most of its compile time: `--compilation-cache
DIR`, else `$PAGEDJAX_COMPILATION_CACHE`, else jax's own `JAX_COMPILATION_CACHE_DIR` if
set, else `$XDG_CACHE_HOME/pagedjax/xla` (`~/.cache/pagedjax/xla`); `off` disables it.
jax caches only programs that took at least `jax_persistent_cache_min_compile_time_secs`
(1 s by default) to compile.

Ctrl-C stops the run with "interrupted" on stderr and exit status 130. Running out of
device memory (a `--num-pages` too many, say) ends with one line on stderr and status 1,
and stdout closed early (piped into `head`) with status 141, without a traceback.

Bad input (an empty or too long prompt, a prompts file without prompts, n < 1, top_p
outside (0, 1], a negative temperature, a bad value in generation_config.json, a
checkpoint directory missing files, --backend gpu without a GPU) ends with one line on
stderr and exit status 2, before anything is printed on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

PREFIX = '''"""Helpers for reading, checking and writing simple configuration files.

Each function documents the exceptions it raises; none of them keeps state
between calls.
"""

import os
import re
import sys


'''
DEFAULT_PROMPTS = (
    PREFIX + 'def read_config(path, encoding="utf-8"):\n',
    PREFIX + "class ConfigError(Exception):\n",
    PREFIX + "def parse_line(line):\n    ",
    PREFIX + "def write_config(path, values):\n",
)


class Parser(argparse.ArgumentParser):
    """Reports a bad flag as `BadInput` (one line and status 2, like every other bad input)."""

    def error(self, message):
        raise BadInput(message)


class BadInput(Exception):
    """Bad input on the command line: `main` prints it as one line and exits with 2."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="scripts/generate.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        help="HF directory or pagedjax orbax checkpoint (default: the embedded demo model)",
    )
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument(
        "--prompts-file", metavar="FILE", help="a file of prompts, one per line ('-': stdin)"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the checkpoint's chat template",
    )
    p.add_argument("--system", metavar="TEXT", help="a system message before each prompt (--chat)")
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file to use instead of the checkpoint's (--chat)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help="most tokens per completion (default 64, or the generation config's)",
    )
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    add_sampling_flags(
        p,
        temperature=0.0,
        max_tokens=64,
        seed_help="the engine's seed: each request draws its sampling seed from it",
    )
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="a string that ends a completion, cut from its text (repeatable)",
    )
    p.add_argument(
        "--stop-token-ids",
        type=int,
        nargs="+",
        metavar="ID",
        help="token ids that end a completion (kept in its tokens), besides EOS",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop on EOS tokens")
    p.add_argument("--beam-width", type=int, default=1, help="> 1: beam search")
    p.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="show each generated token's logprob and the K most likely alternatives",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="K",
        help="show each prompt token's logprob and the K most likely alternatives",
    )
    add_engine_flags(p)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="apply each step's tokens on the host before dispatching the next",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


# The SamplingParams fields whose flags, left out, take the checkpoint's generation config
# (`--generation-config auto`, `generation_defaults`) before the script's own default; their
# flags default to None (not given). Each script defines its --max-tokens itself.
FILE_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_tokens")


def add_sampling_flags(
    p: argparse.ArgumentParser, *, temperature: float, max_tokens: int, seed_help: str
) -> None:
    """The sampling flags of generate.py and chat.py, and `--generation-config`
    (`sampling_kwargs` reads them); `temperature` and `max_tokens` (the script's
    `--max-tokens`) are the script's defaults when the generation config has none."""
    p.set_defaults(
        script_defaults=dict(
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=max_tokens,
        )
    )
    greedy = "greedy" if temperature == 0 else temperature
    p.add_argument("--temperature", type=float, help=f"0: greedy (default {greedy})")
    p.add_argument("--top-k", type=int, help="0: off (default)")
    p.add_argument("--top-p", type=float, help="1: off (default)")
    p.add_argument("--min-p", type=float, help="0: off (default)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        help="> 1 discourages tokens of the prompt and the output so far (1: off, default)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2], subtracted from generated tokens' logits (0: off)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2], times each token's count so far (0: off)",
    )
    p.add_argument(
        "--min-tokens", type=int, default=0, help="no stop token or string before this many"
    )
    p.add_argument(
        "--logit-bias",
        metavar="JSON",
        help="token id -> value in [-100, 100] added to its logit, e.g. '{\"13\": -100}'",
    )
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    add_generation_config_flag(p)


def add_generation_config_flag(p: argparse.ArgumentParser) -> None:
    """`--generation-config` (generate.py, chat.py, serve.py)."""
    p.add_argument(
        "--generation-config",
        default="auto",
        choices=("auto", "none"),
        help="auto: sampling defaults from the checkpoint's generation_config.json, as vLLM "
        "(default); none: ignore the file",
    )


def generation_defaults(args) -> dict:
    """The `SamplingParams` defaults of the checkpoint's generation_config.json (the demo
    model's without --checkpoint), read before the weights load; {} with
    `--generation-config none` (`resources.generation_config_defaults`: a bad value is a
    ValueError naming the file, key and value)."""
    from pagedjax.resources import checkpoint_dir, generation_config_defaults

    path = checkpoint_dir(args.checkpoint) if args.generation_config == "auto" else None
    return {} if path is None else generation_config_defaults(path)


def note_defaults(args, defaults: dict, overridden_by: str) -> None:
    """One line on stderr naming the generation config's `defaults` taken (those whose
    flag, if the script has one, was not given), as vLLM logs them; nothing for none."""
    from pagedjax.resources import GENERATION_CONFIG_FILE, GENERATION_CONFIG_KEYS, checkpoint_dir

    taken = {k: v for k, v in defaults.items() if getattr(args, k, None) is None}
    if not taken:
        return
    key = {field: k for k, field in GENERATION_CONFIG_KEYS.items()}
    values = ", ".join(f"{key[k]}={v}" for k, v in taken.items())
    path = checkpoint_dir(args.checkpoint) / GENERATION_CONFIG_FILE
    print(
        f"note: sampling defaults from {path}: {values} ({overridden_by} override them; "
        "--generation-config none ignores the file)",
        file=sys.stderr,
    )


def parse_logit_bias(text: str | None) -> dict[int, float] | None:
    """`--logit-bias` JSON ({"token id": value}) as {int: float}; BadInput if malformed."""
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"--logit-bias is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadInput(f"--logit-bias must be a JSON object, got {text!r}")
    out = {}
    for key, value in obj.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise BadInput(f"--logit-bias keys must be token ids, got {key!r}") from None
    return out


def sampling_kwargs(args, defaults: dict | None = None) -> dict:
    """The `SamplingParams` fields that `add_sampling_flags` and `--max-tokens` set: of
    `FILE_FIELDS`, the flag given, else `defaults`' value (`generation_defaults`), else
    the script's default."""
    defaults = defaults or {}
    picked = {}
    for name in FILE_FIELDS:
        v = getattr(args, name)
        picked[name] = v if v is not None else defaults.get(name, args.script_defaults[name])
    return dict(
        **picked,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        logit_bias=parse_logit_bias(args.logit_bias),
        seed=args.seed,
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the engine's geometry, backend and compilation cache (scripts/chat.py too)."""
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-pages", type=int, help="KV pages")
    kv.add_argument(
        "--kv-memory-fraction",
        type=float,
        help="share in (0, 1] of free device memory for the KV cache (default 0.8)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=1024,
        help="token budget of one step (decode tokens + prefill chunks)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="longest sequence, prompt and completion, in tokens (default: the model's)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8"),
        help="KV page storage: the model's dtype, or FP8 (twice the tokens per byte)",
    )
    p.add_argument("--backend", default="auto", choices=("auto", "gpu", "tpu", "xla"))
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split the model and KV cache over N devices (default 1)",
    )
    p.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="persistent XLA compilation cache directory, or 'off' (default: "
        "$PAGEDJAX_COMPILATION_CACHE, $JAX_COMPILATION_CACHE_DIR or ~/.cache/pagedjax/xla)",
    )


def engine_kwargs(args) -> dict:
    """The `LLM` arguments that `add_engine_flags` sets (scripts/chat.py, serve.py too)."""
    return dict(
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_memory_fraction=args.kv_memory_fraction,
        max_num_seqs=min(64, args.max_batch_tokens),
        max_num_batched_tokens=args.max_batch_tokens,
        backend=args.backend,
        tensor_parallel=args.tensor_parallel,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
    )


def check_engine_flags(args, *, tokenizer: bool = True) -> None:
    """Checks `add_engine_flags`'s values and `--checkpoint` (its tokenizer.json too, unless
    `tokenizer` is False: serve.py serves token id prompts without one) before anything
    loads."""
    from pagedjax.resources import check_backend

    check_backend(args.backend)
    for name in ("page_size", "max_batch_tokens", "num_pages", "tensor_parallel"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise BadInput(f"--max-model-len must be >= 2, got {args.max_model_len}")
    f = args.kv_memory_fraction
    if f is not None and not 0 < f <= 1:  # (LLM checks it too, after the jax import)
        raise BadInput(f"--kv-memory-fraction must be in (0, 1], got {f}")
    if args.checkpoint is not None:
        check_checkpoint(args.checkpoint, tokenizer=tokenizer)


def check_logit_bias(bias: dict[int, float] | None, vocab_size: int) -> None:
    """`--logit-bias` token ids past the loaded model's vocabulary are bad input (checked
    before anything is printed; `LLM.generate` would refuse them as a prompt's error)."""
    bad = sorted(t for t in bias or () if t >= vocab_size)
    if bad:
        raise BadInput(
            f"--logit-bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )


def compilation_cache_dir(flag: str | None) -> str | None:
    """The compilation cache directory to use (None: off), by the precedence in the docstring."""
    import jax

    choice = flag if flag is not None else os.environ.get("PAGEDJAX_COMPILATION_CACHE")
    if choice is None:
        if jax.config.jax_compilation_cache_dir:
            return jax.config.jax_compilation_cache_dir
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        choice = os.path.join(base, "pagedjax", "xla")
    if choice.strip().lower() in ("", "off", "none", "0"):
        return None
    return choice


def enable_compilation_cache(path: str | None) -> None:
    """Points jax's persistent compilation cache at `path` (a no-op for None)."""
    if path is None:
        return
    import jax

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--compilation-cache {path}: cannot create it ({e.strerror})") from None
    jax.config.update("jax_compilation_cache_dir", path)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if args.prompts_file == "-":  # stdin; a pipe's path (/dev/stdin, <(...)) reads too
            path = Path("<stdin>")
        elif path.is_dir():
            raise BadInput(f"prompts file {path} is a directory")
        elif not path.exists():
            raise BadInput(f"prompts file not found: {path}")
        try:
            if args.prompts_file == "-":
                text = sys.stdin.buffer.read().decode("utf-8")
            else:
                text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"prompts file {path}: cannot read it ({e})") from None
        before = len(prompts)
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            if line.startswith('"'):
                try:
                    line = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadInput(f"{path} line {i + 1}: bad JSON string: {e}") from None
            prompts.append(line)
        if len(prompts) == before:
            raise BadInput(f"prompts file {path} has no prompts (blank lines are skipped)")
    return prompts if (args.prompt is not None or args.prompts_file) else list(DEFAULT_PROMPTS)


def chat_tokenizer(checkpoint: str | None, template_file: str | None, hint: str):
    """The checkpoint's tokenizer (None: the demo model's), with the template of
    `--chat-template FILE` in place of its own when given.

    Runs before the weights load, so that a missing or broken template, a checkpoint
    without one, or a missing jinja2 fails fast (`BadInput`; `hint` ends the message
    when there is no template).
    """
    from pagedjax import demo
    from pagedjax.tokenizer import Tokenizer

    text = None
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise BadInput(f"--chat-template {path}: no such file")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"--chat-template {path}: cannot read it ({e})") from None
    tok = Tokenizer.from_dir(checkpoint if checkpoint is not None else demo.demo_model_dir())
    try:
        if text is not None:
            tok = tok.with_chat_template(text, str(template_file))
    except ImportError as e:
        raise BadInput(f"--chat-template: {e}") from None
    if tok.chat_template is None:
        raise BadInput(f"{tok.chat_template_source}; {hint}")
    return tok


def chat_prompts(args, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as a user message (after `--system`), by the chat template
    (checked before the weights load: `chat_tokenizer`)."""
    hint = "give --chat-template FILE, or drop --chat to send raw text"
    tok = chat_tokenizer(args.checkpoint, args.chat_template, hint)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    ids = []
    for i, p in enumerate(prompts):
        if not p:
            raise BadInput(f"prompt {i}: prompt is empty")
        try:
            ids.append(tok.encode_chat([*system, {"role": "user", "content": p}]))
        except ImportError as e:
            raise BadInput(f"--chat: {e}") from None
    return ids


def check_checkpoint(path: str, *, tokenizer: bool = True) -> None:
    """Fails fast on a directory that cannot serve (text, unless `tokenizer` is False)
    before loading weights."""
    from pagedjax import weights
    from pagedjax.tokenizer import TOKENIZER_FILE

    weights.checkpoint_format(path)  # FileNotFoundError naming what is missing
    if tokenizer and not (Path(path) / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {TOKENIZER_FILE}; it is needed to encode prompts")


def _fmt(x, unit="", scale=1.0, digits=3):
    return "n/a" if x is None else f"{x * scale:,.{digits}g}{unit}"


def _rate(x, unit):
    return "n/a" if x is None else f"{x:,.0f}{unit}"


def report(llm, summary: dict, device: str) -> str:
    s = summary
    hit = s["prefix_cache_hit_rate"]
    peak = s["peak_device_memory_bytes"]
    lines = [
        f"model        {llm.model_source}",
        f"device       {device} (attention backend {llm.backend})",
        f"load         {s['load_time_s']:.2f} s; compile {s['compile_time_s']:.2f} s "
        f"({s['num_compilations']} jit compilations)",
        f"requests     {s['num_requests']}: {s['num_prompt_tokens']} prompt tokens "
        f"({s['num_prefill_tokens']} prefilled), {s['num_generated_tokens']} generated, "
        f"{s['num_steps']} steps in {s['run_time_s']:.2f} s",
        f"TTFT         mean {_fmt(s['ttft_mean_s'], ' s')}, p50 {_fmt(s['ttft_p50_s'], ' s')}, "
        f"p99 {_fmt(s['ttft_p99_s'], ' s')}",
        f"throughput   prefill {_rate(s['prefill_tokens_per_s'], ' tok/s')}, decode "
        f"{_rate(s['decode_tokens_per_s'], ' tok/s')} (device time of those steps); "
        f"output {_rate(s['output_tokens_per_s'], ' tok/s')} end to end",
        f"KV read      {_fmt(s['kv_bytes_read_per_s'], ' GB/s', 1e-9)} "
        f"({s['kv_bytes_read'] / 1e6:,.1f} MB in {s['device_time_s']:.2f} s of device time)",
        f"peak memory  {'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}",
        f"KV pages     {s['kv_pages_used']} / {s['kv_pages_total']} at peak "
        f"({100 * s['kv_utilization']:.1f}% utilization; {llm.cache_config.dtype})",
        f"prefix cache {100 * hit:.1f}% of prompt tokens hit",
        f"preemptions  {s['preemptions']}",
        f"host         {_fmt(s['host_hidden_ms_per_step'], ' ms')} hidden, "
        f"{_fmt(s['host_exposed_ms_per_step'], ' ms')} exposed, "
        f"{_fmt(s['device_wait_ms_per_step'], ' ms')} waiting on the device, per step",
    ]
    return "\n".join(lines)


def _json_logprobs(entries):
    if entries is None:
        return None
    return [
        None if e is None else [dict(token_id=t, logprob=x) for t, x in e.items()] for e in entries
    ]


def format_logprobs(tokenizer, token_ids, entries) -> str:
    """One line per token: the token, its logprob, then the alternatives (an entry of
    None, the first prompt token's, shows the token alone)."""

    def name(t):
        return repr(tokenizer.decode([t])) if tokenizer is not None else str(t)

    lines = []
    for tok, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            lines.append(f"{name(tok):>16}")
            continue
        alts = ", ".join(f"{name(t)} {x:.3f}" for t, x in list(entry.items())[1:])
        lines.append(f"{name(tok):>16} {entry[tok]:8.3f}" + (f"  | {alts}" if alts else ""))
    return "\n".join(lines)


def run(args) -> int:
    prompts = read_prompts(args)
    if args.system is not None and not args.chat:
        raise BadInput("--system needs --chat (it is the chat's system message)")
    if args.chat_template is not None and not args.chat:
        raise BadInput("--chat-template needs --chat")
    # Beam search ranks by logprob: a --temperature given conflicts (one from the
    # generation config is not taken).
    if args.beam_width > 1 and args.temperature is not None and args.temperature > 0:
        raise BadInput(
            f"--temperature {args.temperature} with --beam-width {args.beam_width}: beam "
            "search does not sample; drop --temperature"
        )
    # Validate the cheap things before loading anything.
    from pagedjax.engine import LLM, SamplingParams
    from pallas_kernels.dispatch import resolve_backend

    defaults = generation_defaults(args)
    if args.beam_width > 1:  # it does not sample: only the length default applies
        defaults = {k: v for k, v in defaults.items() if k == "max_tokens"}
    sampling = sampling_kwargs(args, defaults)
    sp = SamplingParams(
        n=args.n,
        beam_width=args.beam_width,
        **{**sampling, "seed": None},  # --seed seeds the engine: each request draws its own
        stop=tuple(args.stop or ()),
        stop_token_ids=tuple(args.stop_token_ids or ()),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )
    check_engine_flags(args)
    seats, most = max(args.n, args.beam_width), engine_kwargs(args)["max_num_seqs"]
    if seats > most:  # (LLM.generate would refuse it, after the weights load)
        flag = "--n" if args.n >= args.beam_width else "--beam-width"
        raise BadInput(
            f"{flag} {seats}: at most {most} sequences run at once (64, or --max-batch-tokens "
            "when lower)"
        )
    inputs = chat_prompts(args, prompts) if args.chat else prompts
    note_defaults(args, defaults, "flags")
    if sp.temperature == 0 and args.n > 1 and args.beam_width == 1:
        print("note: --n > 1 with --temperature 0 gives identical completions", file=sys.stderr)

    import jax

    cache_dir = compilation_cache_dir(args.compilation_cache)
    enable_compilation_cache(cache_dir)
    llm = LLM(
        args.checkpoint,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        async_scheduling=not args.no_async_scheduling,
        generation_config=args.generation_config,
        **engine_kwargs(args),
    )
    INTERRUPT.check()  # a Ctrl-C that a gc callback swallowed while loading
    check_logit_bias(sp.logit_bias, llm.config.vocab_size)
    outside = [t for t in sp.stop_token_ids if t >= llm.config.vocab_size]
    if outside:  # they could never stop anything
        raise BadInput(
            f"--stop-token-ids {outside[:5]} are outside the vocabulary [0, "
            f"{llm.config.vocab_size})"
        )
    cut = []  # prompts that leave less room than --max-tokens under the model's length
    encoded = []  # their token ids, for generate (which would tokenize text again)
    for i, p in enumerate(inputs):  # e.g. too long for the model: before anything prints
        try:
            encoded.append(llm.encode(p)[1])
        except (ValueError, TypeError) as e:
            raise BadInput(f"prompt {i}: {e}") from None
        n = len(encoded[-1])
        if n + sp.max_tokens > llm.max_model_len:
            cut.append(f"{i} ({llm.max_model_len - n})")
    if cut:
        print(
            f"note: the model's length ({llm.max_model_len} tokens) leaves less than "
            f"--max-tokens {sp.max_tokens} after prompt {', '.join(cut[:8])}"
            f"{', ...' if len(cut) > 8 else ''}: they end there (finish_reason length)",
            file=sys.stderr,
        )
    device = str(jax.devices()[0])
    note = sys.stderr if args.json else sys.stdout
    print(f"model: {llm.model_source}", file=note)
    # (Not with stop strings: the text streamed so far could be cut.)
    stream = len(prompts) == 1 and args.n == 1 and args.beam_width == 1 and not args.json
    stream = stream and not sp.stop
    on_token = None
    sep = "\n" if args.chat else ""  # a chat reply is a new turn, not a continuation
    if stream:
        decoder = llm.tokenizer.stream(context=encoded[0])
        print(prompts[0] + sep, end="", flush=True)

        def on_token(_rid, _index, tok):
            sys.stdout.write(decoder.add(tok))
            sys.stdout.flush()

    outs = llm.generate(
        encoded, sp, use_tqdm=len(prompts) > 1, on_token=on_token, on_step=INTERRUPT.check
    )
    INTERRUPT.check()
    if stream:
        print(decoder.flush())
    summary = llm.summary()
    if args.json:
        obj = dict(
            model=llm.model_source,
            device=device,
            backend=args.backend,
            resolved_backend=resolve_backend(args.backend),
            settings=dict(
                page_size=llm.cache_config.page_size,
                num_pages=llm.cache_config.num_pages,
                max_num_batched_tokens=args.max_batch_tokens,
                max_num_seqs=llm.scheduler.max_num_seqs,
                max_model_len=llm.max_model_len,
                enable_prefix_caching=not args.no_prefix_caching,
                async_scheduling=llm.async_scheduling,
                tensor_parallel=llm.tensor_parallel,
                kv_cache_dtype=llm.cache_config.dtype,
                compilation_cache=cache_dir,
                chat=args.chat,
                chat_template=args.chat_template,
                system=args.system,
                n=args.n,
                **sampling,
                beam_width=args.beam_width,
                stop=list(sp.stop),
                stop_token_ids=list(sp.stop_token_ids),
                ignore_eos=sp.ignore_eos,
                logprobs=args.logprobs,
                prompt_logprobs=args.prompt_logprobs,
            ),
            outputs=[
                dict(
                    prompt=prompt,
                    prompt_tokens=len(o.prompt_token_ids),
                    num_cached_tokens=o.num_cached_tokens,
                    ttft_s=o.ttft_s,
                    latency_s=o.latency_s,
                    prompt_logprobs=_json_logprobs(o.prompt_logprobs),
                    completions=[
                        dict(
                            text=c.text,
                            token_ids=c.token_ids,
                            finish_reason=c.finish_reason,
                            cumulative_logprob=c.cumulative_logprob,
                            logprobs=_json_logprobs(c.logprobs),
                        )
                        for c in o.outputs
                    ],
                )
                for prompt, o in zip(prompts, outs, strict=True)
            ],
            metrics=summary,
        )
        print(json.dumps(obj))
        return 0
    if not stream:
        for i, (prompt, o) in enumerate(zip(prompts, outs, strict=True)):
            print(f"--- prompt {i} ({len(o.prompt_token_ids)} tokens)")
            for c in o.outputs:
                tag = f" [{c.index}]" if len(o.outputs) > 1 else ""
                print(
                    f"{prompt}{sep}\x1b[1m{c.text}\x1b[0m{tag} ({c.finish_reason})"
                    if sys.stdout.isatty()
                    else f"{prompt}{sep}{c.text}{tag} ({c.finish_reason})"
                )
    for i, o in enumerate(outs):
        if args.prompt_logprobs is not None:
            print(f"--- prompt logprobs, prompt {i}")
            print(format_logprobs(llm.tokenizer, o.prompt_token_ids, o.prompt_logprobs))
        for c in o.outputs if args.logprobs is not None else ():
            print(f"--- logprobs, prompt {i} completion {c.index}")
            print(format_logprobs(llm.tokenizer, c.token_ids, c.logprobs))
    print(report(llm, summary, device))
    return 0


class Interrupt:
    """Ctrl-C as a KeyboardInterrupt that is not lost (`INTERRUPT`, installed by `latched`).

    Python drops an exception raised in a gc callback or a `__del__` ("Exception ignored
    in ..."), and jax runs a gc callback on every collection: a Ctrl-C that landed there
    vanished, and the run went on to its end with status 0. The handler raises as
    Python's does and also latches; `check` (the engine's `on_step`) raises again while
    latched, until `clear`; the dropped one is not reported ("Exception ignored").
    """

    def __init__(self):
        self.pending = False

    @contextlib.contextmanager
    def latched(self):
        """Installs the handler (in the main thread, unless SIGINT is ignored) and clears
        the latch; restores the previous handler on exit."""
        self.pending = False
        previous = None  # (None: leave the handler as it is on exit)
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job's
            previous = signal.signal(signal.SIGINT, self._handler)
        hook = sys.unraisablehook

        def unraisable(u):  # the Ctrl-C that Python drops (latched): not worth a traceback
            if not (self.pending and isinstance(u.exc_value, KeyboardInterrupt)):
                hook(u)

        sys.unraisablehook = unraisable
        try:
            yield self
        finally:
            sys.unraisablehook = hook
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _handler(self, _signum, _frame):
        self.pending = True
        raise KeyboardInterrupt

    def check(self, *_) -> None:
        """Raises KeyboardInterrupt if a Ctrl-C came since `clear`."""
        if self.pending:
            raise KeyboardInterrupt

    def clear(self) -> None:
        self.pending = False


INTERRUPT = Interrupt()


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is XLA's out-of-memory error (a jax runtime error, RESOURCE_EXHAUSTED)."""
    jax = sys.modules.get("jax")  # (raised by jax, so imported when it is one)
    return (
        jax is not None
        and isinstance(e, jax.errors.JaxRuntimeError)
        and "RESOURCE_EXHAUSTED" in str(e)
    )


def run_cli(build_parser, run, argv=None) -> int:
    """Parses `argv` and runs; bad input ends as one line on stderr and status 2, running
    out of device memory as one line and status 1 (the `main` of generate.py, chat.py and
    serve.py)."""
    try:
        args = build_parser().parse_args(argv)
        return run(args)
    except (BadInput, ValueError, TypeError, FileNotFoundError, NotADirectoryError) as e:
        msg = " ".join(str(e).split())  # multi-line errors (checkpoint listings) on one line
        print(f"error: {msg[:2000]}", file=sys.stderr)
        return 2
    except Exception as e:
        if not out_of_memory(e):
            raise
        msg = " ".join(str(e).split("\n")[0].split())
        print(
            f"error: out of device memory ({msg[:500]}); lower --num-pages (or "
            "--kv-memory-fraction), --max-batch-tokens or --max-model-len",
            file=sys.stderr,
        )
        return 1


def stdout_closed() -> int:
    """After a BrokenPipeError (stdout piped into `head`, say): no traceback, no second
    error when Python flushes stdout at exit; status 141, a shell's for SIGPIPE."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # not a file (tests)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def main(argv=None) -> int:
    with INTERRUPT.latched():
        try:
            return run_cli(build_parser, run, argv)
        except KeyboardInterrupt:  # the engine aborted the requests; no traceback for a Ctrl-C
            print("\ninterrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            return stdout_closed()


if __name__ == "__main__":
    sys.exit(main())
