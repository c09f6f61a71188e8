"""What the command-line scripts share (generate.py, chat.py, serve.py import it as a
sibling): bad input as one line and status 2 (`Parser`, `BadInput`, `run_cli`), the
sampling and engine flags and their checks, the checkpoint's generation_config defaults
for flags left out, the persistent compilation cache (`--compilation-cache DIR`, else
`$PAGEDJAX_COMPILATION_CACHE`, else jax's `JAX_COMPILATION_CACHE_DIR` if set, else
`$XDG_CACHE_HOME/pagedjax/xla`; `off` disables it), `--lora` (a LoRA adapter), the chat
template's tokenizer, one completion streamed to stdout (`TextStream`), and the exits a
user can cause: Ctrl-C (`INTERRUPT`), running out of device memory, stdout closed early.
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


class Parser(argparse.ArgumentParser):
    """Reports a bad flag as `BadInput` (one line and status 2, like every other bad input)."""

    def error(self, message):
        raise BadInput(message)


class BadInput(Exception):
    """Bad input on the command line: `run_cli` prints it as one line, status 2."""


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
        choices=("auto", "fp8", "fp8_e4m3"),
        help="KV page storage: the model's dtype, or FP8 (float8_e4m3fn, vLLM's fp8 and "
        "fp8_e4m3: twice the tokens per byte)",
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


def add_max_logprobs_flag(p: argparse.ArgumentParser) -> None:
    """`--max-logprobs N` (generate.py, serve.py): `LLM(max_logprobs=N)`, the engine's
    cap on the logprobs per token a request may ask for."""

    def cap(text: str) -> int:
        n = int(text)  # (a ValueError: argparse's "invalid cap value")
        if n < -1:
            raise argparse.ArgumentTypeError(f"must be >= 0 or -1 (no cap), got {n}")
        return n

    p.add_argument(
        "--max-logprobs",
        type=cap,
        default=20,
        metavar="N",
        help="most logprobs per token a request may ask for (-1: no cap, the whole "
        "vocabulary; default 20)",
    )


def int_at_least(low: int):
    """An argparse `type` for an int >= `low` ("invalid int value" for what is no int)."""

    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n

    parse.__name__ = "int"  # (argparse names it in "invalid int value: 'x'")
    return parse


LORA_RANK = 16  # --max-lora-rank's default, LLM's and vLLM's


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """`--lora PATH` and `--max-lora-rank N` (generate.py, chat.py): one PEFT LoRA adapter
    that every request runs with (`lora_request`, `lora_kwargs`, `read_lora`)."""
    p.add_argument(
        "--lora",
        metavar="PATH",
        help="a PEFT LoRA adapter directory that every prompt runs with",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int_at_least(1),
        metavar="N",
        help=f"the largest adapter rank accepted (with --lora; default {LORA_RANK})",
    )


def lora_request(args):
    """The `LoRARequest` of `--lora` (None without it): named after its directory, id 1.
    BadInput, before the model loads, for a path that is no directory or for
    `--max-lora-rank` without `--lora`."""
    if args.lora is None:
        if args.max_lora_rank is not None:
            raise BadInput("--max-lora-rank needs --lora (the adapter it limits)")
        return None
    from pagedjax.lora import LoRARequest

    path = Path(args.lora)
    if not path.is_dir():
        raise BadInput(f"--lora {args.lora}: no such directory (give a PEFT adapter directory)")
    return LoRARequest(path.resolve().name or str(path), 1, str(path))


def lora_kwargs(args) -> dict:
    """The `LLM` arguments of `add_lora_flags`' flags."""
    return dict(enable_lora=args.lora is not None, max_lora_rank=args.max_lora_rank or LORA_RANK)


def read_lora(llm, request, flag: str) -> None:
    """Reads an adapter into `llm` now (`LLM.add_lora`): one that does not fit the model
    (or has a rank above the engine's max_lora_rank) is BadInput naming `flag`, not a
    traceback at the first request."""
    try:
        llm.add_lora(request)
    except (ValueError, FileNotFoundError) as e:
        raise BadInput(f"{flag}: {e}") from None


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


def enable_compilation_cache(path: str | None, *, given: bool = True) -> str | None:
    """Points jax's persistent compilation cache at `path` (a no-op for None); returns the
    directory in use. One that cannot be made is BadInput when `given` (by
    --compilation-cache); else (the default's, say in a read-only home) a note on stderr,
    and the run goes on without a cache (None)."""
    if path is None:
        return None
    import jax

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if given:
            raise BadInput(f"--compilation-cache {path}: cannot create it ({e.strerror})") from None
        print(
            f"note: no compilation cache: {path} cannot be made ({e.strerror}); give "
            "--compilation-cache DIR or off",
            file=sys.stderr,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path


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


def check_checkpoint(path: str, *, tokenizer: bool = True) -> None:
    """Fails fast on a directory that cannot serve (text, unless `tokenizer` is False)
    before loading weights."""
    from pagedjax import weights
    from pagedjax.tokenizer import TOKENIZER_FILE

    weights.checkpoint_format(path)  # FileNotFoundError naming what is missing
    if tokenizer and not (Path(path) / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {TOKENIZER_FILE}; it is needed to encode prompts")


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


class TextStream:
    """Writes one completion's text to stdout as its tokens come (`on_token`), then the
    rest of its final text (`finish`): what the engine's text holds, so a possible stop
    token's text (the engine leaves it out if the completion stops on it) waits for the
    next token, and the decoder's held-back bytes come from the final text.

    Args:
      tokenizer: the engine's.
      prompt_ids: the prompt's token ids (the text continues them).
      stop_ids: the tokens that may end the completion (`LLM.stop_ids(params)`).
    """

    def __init__(self, tokenizer, prompt_ids, stop_ids):
        self.decoder = tokenizer.stream(context=prompt_ids)
        self.stop_ids = stop_ids
        self.held, self.written = "", 0

    def on_token(self, _rid, _index, tok) -> None:
        """`LLM.generate`'s on_token."""
        piece, self.held = self.held, ""
        text = self.decoder.add(tok)
        if tok in self.stop_ids:
            self.held = text
        else:
            piece += text
        sys.stdout.write(piece)
        sys.stdout.flush()
        self.written += len(piece)

    def finish(self, text: str) -> str:
        """The rest of the completion's final `text`, not yet written."""
        return text[self.written :]


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


def exit_with(rc: int) -> None:
    """Exits with status `rc`; after a Ctrl-C (130) at once, stdout and stderr flushed,
    without Python's shutdown (the `__main__` of generate.py and chat.py).

    A Ctrl-C can land while jax compiles a step: the KeyboardInterrupt unwinds Python,
    but XLA's compile goes on in its thread pool (jaxlib's `CompileAndLoad`), and
    Python's shutdown then destroys the client under it: a SIGSEGV (status 139, not 130)
    in `SingleDeviceSharding::Create` on the CPU, in about a third of interrupted runs.
    `os._exit` ends the process, that thread with it.
    """
    if rc != 130:
        sys.exit(rc)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(rc)


def stdout_closed() -> int:
    """After a BrokenPipeError (stdout piped into `head`, say): no traceback, no second
    error when Python flushes stdout at exit; status 141, a shell's for SIGPIPE."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # not a file (tests)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
