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
generated, then its finish reason in brackets; a batch shows a progress bar over
requests, then each completion with its finish reason. Then a closing report: load and
compile time, TTFT, prefill and decode tokens/s, KV bytes read per second (the
DESIGN.md performance model: every step reads its rows' live K/V once), peak device
memory, KV pages, prefix-cache hit rate, preemptions, jit compilations, host overhead.

Sampling defaults, as vLLM's (`--generation-config auto`, the default): of
`--temperature`, `--top-k`, `--top-p`, `--min-p`, `--repetition-penalty` and
`--max-tokens`, those not given take the checkpoint's generation_config.json values
(temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens; `do_sample` is
ignored, as vLLM ignores it), named in one line on stderr; else greedy and 64 tokens.
With `--beam-width`, only max_new_tokens is taken (beam search does not sample; a
`--temperature` given conflicts with it, one from the generation config is not taken).
`--generation-config none` ignores the file. The demo model's sets none of them.

`--seed` seeds the engine, as vLLM's does: each request draws its sampling seed from
it, so a run is reproducible and different prompts get different random draws.
`--stop TEXT` (repeatable) ends a completion where a string appears, cut from its text
(not with `--beam-width`); `--stop-token-ids ID ...` ends it at those tokens (kept in its
token ids, not in its text), as EOS does; `--ignore-eos` does not stop at EOS.

Structured outputs (`pagedjax.guided`, as vLLM's): `--regex PATTERN`, `--choice TEXT`
(repeatable), `--json-schema FILE`, `--json-object` or `--grammar FILE` (a GBNF grammar,
`pagedjax.grammar`) keep each completion a prefix of a match and let EOS end it only at
a full match (one of them; not with `--beam-width`; a spec it cannot enforce is an error
naming what).

`--logprobs K` lists, after the text, each generated token with its log-probability
under the model's raw distribution and the K most likely tokens at its position;
`--prompt-logprobs K` does the same for the prompt's tokens (given the tokens before
each; such prompts are computed whole, without prefix-cache hits). K is at most
`--max-logprobs N` (default 20; -1: no cap); K = -1 lists every token of the vocabulary.

`--repetition-penalty`, `--presence-penalty`, `--frequency-penalty` penalise tokens
already seen (vLLM's and the OpenAI API's definitions; see `SamplingParams`), greedy
decoding included; not with `--beam-width`. `--min-tokens N` defers every stop (EOS,
stop tokens and strings) until N tokens; `--logit-bias '{"13": -100}'` adds values to
token logits. Neither with `--beam-width`.

`--beam-width N` (> 1) runs beam search, which ranks by log-probability and does not
sample: not with `--temperature` > 0, `--top-k`, `--top-p` or `--min-p`.

`--prompts-file FILE`: UTF-8 (a byte order mark is skipped; a line that is not UTF-8 is
bad input naming it), one prompt per line (blank lines skipped); a line that starts with
a double quote is read as a JSON string, so a prompt can hold newlines. `-` reads stdin
(so does a pipe's path: `/dev/stdin`, the shell's `<(...)`).

`--chat` (instruct checkpoints): each prompt becomes one user message, after a system
message when `--system TEXT` is given, rendered with the checkpoint's chat template
(`chat_template.jinja`, tokenizer_config.json's, or `chat_template.json`; needs
jinja2, the `chat` extra), or with the Jinja file `--chat-template FILE` instead,
and sent to the engine as token ids. The output still shows the prompt as typed. A
checkpoint without a template, a missing or unparsable template file, or no jinja2, is
an error before any weights load. For a multi-turn conversation, see scripts/chat.py.

`--lora PATH` runs every prompt with a PEFT LoRA adapter (`pagedjax.lora`; the engine's
`enable_lora`), named after its directory; `--max-lora-rank N` (default 16) is the
largest rank it may have. A path that is no directory is bad input before the model
loads; an adapter the engine refuses (a rank above `--max-lora-rank`, shapes that do
not fit the model, DoRA, biases, `modules_to_save`, `adapter_model.bin`) right after it.

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
                     system (the --system text or null), lora (the --lora path
                     or null), n, the sampling flags
                     as used (given, or the generation config's, or the defaults;
                     seed is the engine's), beam_width, stop, stop_token_ids, ignore_eos,
                     structured_outputs (the fields of --regex, --choice, --json-schema,
                     --json-object or --grammar, e.g. {"regex": "..."}, or null),
                     logprobs, prompt_logprobs
    outputs          one per prompt: prompt, prompt_tokens, num_cached_tokens, ttft_s,
                     latency_s, prompt_logprobs, completions: [{text, token_ids,
                     finish_reason, cumulative_logprob, logprobs}]; logprobs is null
                     without --logprobs, else one list per generated token of
                     {token_id, logprob}: the sampled token, then the K most likely;
                     prompt_logprobs likewise with --prompt-logprobs, per prompt
                     token (null for the first); a logprob of -inf (a banned token
                     among the K) is null, so the output is strict JSON
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
A directory that cannot be made is bad input when given with the flag; otherwise (a
read-only home) a note on stderr, and the run goes on without a cache.
jax caches only programs that took at least `jax_persistent_cache_min_compile_time_secs`
(1 s by default) to compile.

Ctrl-C stops the run with "interrupted" on stderr and exit status 130. Running out of
device memory (a `--num-pages` too many, say) ends with one line on stderr and status 1,
and stdout closed early (piped into `head`) with status 141, without a traceback.

Bad input (an empty or too long prompt, a prompts file without prompts, n < 1, top_p
outside (0, 1], a negative temperature, a bad value in generation_config.json, a
checkpoint directory missing files, --backend gpu without a GPU, a --lora adapter that
cannot serve, a request that the KV cache can never hold) ends with one line on stderr
and exit status 2, before anything is printed on stdout.

What it prints once the requests are done (completions, logprobs, the report, the
--json object) is laid out in `generate_output.py`.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli  # noqa: E402  (the scripts' shared flags, checks and exits)
from generate_output import (  # noqa: E402  (format_logprobs, so_fields: re-exported)
    format_logprobs,  # noqa: F401
    json_result,
    json_text,
    print_text,
    report,
    so_fields,  # noqa: F401
)

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


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="scripts/generate.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        help="HF directory or pagedjax orbax checkpoint (default: the embedded demo model)",
    )
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument(
        "--prompts-file",
        action="append",  # (to refuse a second one: argparse would let it replace the first)
        metavar="FILE",
        help="a file of prompts, one per line ('-': stdin)",
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
    cli.add_sampling_flags(
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
    so = p.add_mutually_exclusive_group()  # structured outputs (pagedjax.guided)
    so.add_argument("--regex", metavar="PATTERN", help="completions match this regex")
    so.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="a completion is one of these (repeatable)",
    )
    so.add_argument("--json-schema", metavar="FILE", help="completions are JSON of this schema")
    so.add_argument("--json-object", action="store_true", help="completions are JSON objects")
    so.add_argument("--grammar", metavar="FILE", help="completions match this GBNF grammar")
    p.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="show each generated token's logprob and the K most likely alternatives (-1: all)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="K",
        help="show each prompt token's logprob and the K most likely alternatives (-1: all)",
    )
    cli.add_engine_flags(p)
    cli.add_max_logprobs_flag(p)
    cli.add_lora_flags(p)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="apply each step's tokens on the host before dispatching the next",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    files = args.prompts_file or []
    if len(files) > 1:
        raise cli.BadInput(
            f"--prompts-file given twice ({', '.join(files)}): give one file, and "
            "--prompt for more prompts"
        )
    if files:
        name = files[0]
        path = Path(name)
        if name == "-":  # stdin; a pipe's path (/dev/stdin, <(...)) reads too
            if sys.stdin is None:  # (closed: `<&-`)
                raise cli.BadInput("--prompts-file -: stdin is closed")
            path = Path("<stdin>")
        elif path.is_dir():
            raise cli.BadInput(f"prompts file {path} is a directory")
        elif not path.exists():
            raise cli.BadInput(f"prompts file not found: {path}")
        try:
            data = sys.stdin.buffer.read() if name == "-" else path.read_bytes()
        except OSError as e:
            raise cli.BadInput(f"prompts file {path}: cannot read it ({e})") from None
        text = decode_prompts(data, path)
        before = len(prompts)
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            if line.startswith('"'):
                try:
                    line = json.loads(line)
                except json.JSONDecodeError as e:
                    raise cli.BadInput(f"{path} line {i + 1}: bad JSON string: {e}") from None
            prompts.append(line)
        if len(prompts) == before:
            raise cli.BadInput(f"prompts file {path} has no prompts (blank lines are skipped)")
    return prompts if (args.prompt is not None or files) else list(DEFAULT_PROMPTS)


def decode_prompts(data: bytes, path: Path) -> str:
    """A prompts file's text: UTF-8, less a byte order mark (which Windows editors write,
    and which would start the first prompt); BadInput naming the line that is not UTF-8."""
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise cli.BadInput(
            f"prompts file {path} line {line} is not UTF-8 text ({e.reason}: byte "
            f"{data[e.start]:#04x})"
        ) from None


def chat_prompts(args, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as a user message (after `--system`), by the chat template
    (checked before the weights load: `chat_tokenizer`)."""
    hint = "give --chat-template FILE, or drop --chat to send raw text"
    tok = cli.chat_tokenizer(args.checkpoint, args.chat_template, hint)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    ids = []
    for i, p in enumerate(prompts):
        if not p:
            raise cli.BadInput(f"prompt {i}: prompt is empty")
        try:
            ids.append(tok.encode_chat([*system, {"role": "user", "content": p}]))
        except ImportError as e:
            raise cli.BadInput(f"--chat: {e}") from None
    return ids


def check_logprobs_flags(args, vocab_size: int | None = None) -> None:
    """BadInput for a --logprobs or --prompt-logprobs K over --max-logprobs or, once the
    model has loaded (`vocab_size`), its vocabulary; K = -1 counts as the vocabulary's
    size, so it is checked then (`LLM.generate` would refuse it as a prompt's error)."""
    from pagedjax.request import logprobs_count

    for flag, k in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if k is None or (vocab_size is None and k == -1):
            continue
        try:
            logprobs_count(flag, k, args.max_logprobs, vocab_size or k, "--max-logprobs")
        except ValueError as e:
            raise cli.BadInput(str(e)) from None


def structured_outputs(args):
    """The `StructuredOutputsParams` of --regex, --choice, --json-schema, --json-object or
    --grammar (None without one); BadInput for a schema or grammar file that cannot be
    read, ValueError (from `pagedjax.guided`) for a spec it refuses."""
    from pagedjax.guided import StructuredOutputsParams

    if args.json_schema is not None:
        path = Path(args.json_schema)
        try:
            schema = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise cli.BadInput(f"--json-schema {path}: {e}") from None
        return StructuredOutputsParams(json=schema)
    if args.grammar is not None:
        path = Path(args.grammar)
        try:
            grammar = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as e:
            raise cli.BadInput(f"--grammar {path}: {e}") from None
        return StructuredOutputsParams(grammar=grammar)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    return StructuredOutputsParams(json_object=True) if args.json_object else None


def run(args) -> int:
    # (before the prompts are read: stdin, which a refusal after it had consumed for nothing)
    if args.system is not None and not args.chat:
        raise cli.BadInput("--system needs --chat (it is the chat's system message)")
    if args.chat_template is not None and not args.chat:
        raise cli.BadInput("--chat-template needs --chat")
    prompts = read_prompts(args)
    # Beam search ranks by logprob: a --temperature given conflicts (one from the
    # generation config is not taken).
    if args.beam_width > 1 and args.temperature is not None and args.temperature > 0:
        raise cli.BadInput(
            f"--temperature {args.temperature} with --beam-width {args.beam_width}: beam "
            "search does not sample; drop --temperature"
        )
    # Validate the cheap things before loading anything.
    from pagedjax.engine import LLM, SamplingParams

    defaults = cli.generation_defaults(args)
    if args.beam_width > 1:  # it does not sample: only the length default applies
        defaults = {k: v for k, v in defaults.items() if k == "max_tokens"}
    sampling = cli.sampling_kwargs(args, defaults)
    sp = SamplingParams(
        n=args.n,
        beam_width=args.beam_width,
        **{**sampling, "seed": None},  # --seed seeds the engine: each request draws its own
        stop=tuple(args.stop or ()),
        stop_token_ids=tuple(args.stop_token_ids or ()),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        structured_outputs=structured_outputs(args),
    )
    cli.check_engine_flags(args)
    check_logprobs_flags(args)
    lora = cli.lora_request(args)
    seats, most = max(args.n, args.beam_width), cli.engine_kwargs(args)["max_num_seqs"]
    if seats > most:  # (LLM.generate would refuse it, after the weights load)
        flag = "--n" if args.n >= args.beam_width else "--beam-width"
        raise cli.BadInput(
            f"{flag} {seats}: at most {most} sequences run at once (64, or --max-batch-tokens "
            "when lower)"
        )
    inputs = chat_prompts(args, prompts) if args.chat else prompts
    cli.note_defaults(args, defaults, "flags")
    if sp.temperature == 0 and args.n > 1 and args.beam_width == 1:
        print("note: --n > 1 with --temperature 0 gives identical completions", file=sys.stderr)

    import jax

    cache_dir = cli.enable_compilation_cache(
        cli.compilation_cache_dir(args.compilation_cache),
        given=args.compilation_cache is not None,
    )
    llm = LLM(
        args.checkpoint,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        async_scheduling=not args.no_async_scheduling,
        generation_config=args.generation_config,
        max_logprobs=args.max_logprobs,
        **cli.lora_kwargs(args),
        **cli.engine_kwargs(args),
    )
    cli.INTERRUPT.check()  # a Ctrl-C that a gc callback swallowed while loading
    if lora is not None:
        cli.read_lora(llm, lora, "--lora")
    cli.check_logit_bias(sp.logit_bias, llm.config.vocab_size)
    check_logprobs_flags(args, llm.config.vocab_size)
    outside = [t for t in sp.stop_token_ids if t >= llm.config.vocab_size]
    if outside:  # they could never stop anything
        raise cli.BadInput(
            f"--stop-token-ids {outside[:5]} are outside the vocabulary [0, "
            f"{llm.config.vocab_size})"
        )
    cut = []  # prompts that leave less room than --max-tokens under the model's length
    encoded = []  # their token ids, for generate (which would tokenize text again)
    for i, p in enumerate(inputs):  # e.g. too long for the model: before anything prints
        try:
            encoded.append(llm.encode(p)[1])
        except (ValueError, TypeError) as e:
            raise cli.BadInput(f"prompt {i}: {e}") from None
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
    with_lora = "" if lora is None else f" with LoRA adapter {lora.lora_path}"
    # (Not with stop strings: the text streamed so far could be cut.)
    stream = len(prompts) == 1 and args.n == 1 and args.beam_width == 1 and not args.json
    stream = stream and not sp.stop
    on_token = None
    sep = "\n" if args.chat else ""  # a chat reply is a new turn, not a continuation
    if stream:
        printer = cli.TextStream(llm.tokenizer, encoded[0], llm.stop_ids(sp))
        on_token = printer.on_token

    def start(**bar):
        """`generate`'s progress bar (`use_tqdm`), which it makes once it has queued every
        request: the engine has accepted them (one the KV cache can never hold is refused
        as it is queued), so the model line and the streamed prompt are printed now, and
        bad input leaves stdout empty."""
        from tqdm.auto import tqdm

        print(f"model: {llm.model_source}{with_lora}", file=note, flush=True)
        if stream:
            print(prompts[0] + sep, end="", flush=True)
        return tqdm(**bar, disable=len(prompts) == 1)

    outs = llm.generate(
        encoded,
        sp,
        use_tqdm=start,
        on_token=on_token,
        on_step=cli.INTERRUPT.check,
        lora_request=lora,
    )
    cli.INTERRUPT.check()
    if stream:  # then why it stopped, as a batch shows each completion's
        c = outs[0].outputs[0]
        print(f"{printer.finish(c.text)} ({c.finish_reason})")
    summary = llm.summary()
    if args.json:
        obj = json_result(
            llm,
            args,
            prompts,
            outs,
            device=device,
            sampling=sampling,
            sp=sp,
            cache_dir=cache_dir,
            summary=summary,
        )
        print(json_text(obj))
        return 0
    print_text(llm, args, prompts, outs, streamed=stream, sep=sep)
    print(report(llm, summary, device))
    return 0


def main(argv=None) -> int:
    with cli.INTERRUPT.latched():
        try:
            return cli.run_cli(build_parser, run, argv)
        except KeyboardInterrupt:  # the engine aborted the requests; no traceback for a Ctrl-C
            print("\ninterrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            return cli.stdout_closed()


if __name__ == "__main__":
    cli.exit_with(main())
