"""Chat with an instruct checkpoint in the terminal: the model loads once, then turn after turn.

    python scripts/chat.py --checkpoint path/to/Llama-3.2-1B-Instruct --system "Be brief."
    python scripts/chat.py --checkpoint path/to/dir --chat-template my_template.jinja
    printf 'Hi!\\nAnd then?\\n' | python scripts/chat.py --checkpoint path/to/dir --temperature 0

Each line read from stdin (after a `> ` prompt on stderr when stdin is a terminal, so
that stdout holds the replies alone) is a user message. The whole conversation so far,
after the `--system TEXT` message when given, is rendered with the checkpoint's chat
template (or the Jinja file `--chat-template FILE`; needs jinja2, the `chat` extra), and
the reply streams to stdout as it is generated, then joins the conversation. Every
turn's prompt repeats the turns before it, so from the second turn on the engine's
prefix cache serves most of it: the stats line after each reply (on stderr) says how
many prompt tokens it served, with the reply's length, its time to first token and its
tokens/s after the first token.

A line that is not UTF-8 text is reported on stderr and not sent; a byte order mark
before the first line is skipped.
Commands: `/reset` starts the conversation over (keeping the system message);
`/exit`, or the end of stdin, ends the session. Ctrl-C while a reply streams stops it
(`[interrupted]` on stderr) and drops the turn: neither the message nor the partial
reply joins the conversation, and the prompt comes back (the engine aborts the reply
and stays usable); Ctrl-C at the prompt ends the session. A conversation that no
longer fits the model's length (`--max-model-len`, default the model's) or the KV cache
(`--num-pages`) is reported on stderr and its last message dropped (`/reset` and go on; a
first message refused on its own is said to be), and a reply cut short by the length is
noted there. Sampling: `--max-tokens` (per
reply, 256), `--temperature` (0.7; 0 is greedy), `--top-k`, `--top-p`, `--min-p`,
`--repetition-penalty`, `--presence-penalty`, `--frequency-penalty`, `--min-tokens`,
`--logit-bias JSON`, and `--seed`, the seed of every reply, so a session is
reproducible. With `--generation-config auto` (the default), as in vLLM, those of
`--temperature`, `--top-k`, `--top-p`, `--min-p`, `--repetition-penalty` and
`--max-tokens` not given take the values of the checkpoint's generation_config.json
(temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens) where it has
them, said in one line on stderr; `--generation-config none` ignores the file.

The engine flags (`--page-size`, `--num-pages` | `--kv-memory-fraction`,
`--kv-cache-dtype`, `--max-batch-tokens`, `--max-model-len`, `--backend`,
`--tensor-parallel`, `--compilation-cache`) are scripts/generate.py's, and so are `--lora
PATH` (every reply runs with that PEFT LoRA adapter) and `--max-lora-rank N`. Bad input
(a checkpoint or template that cannot serve a chat, a bad flag, a `--system` message
that leaves no room for a reply within `--max-model-len`) ends with one line on stderr
and exit status 2, before any weights load (an adapter the engine refuses: right after
them); running out of device memory, with one line and status 1; Ctrl-C at the prompt
(or while the model loads), with status 130.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli  # noqa: E402  (the scripts' shared flags, checks and exits)

COMMANDS = ("/reset", "/exit")
KEYS = (
    "Commands: /reset starts the conversation over (keeping --system), /exit ends the "
    "session. Ctrl-C while a reply streams stops it and drops the turn (message and partial "
    "reply); Ctrl-C (status 130) or Ctrl-D at the prompt ends the session."
)
NO_TEMPLATE_HINT = "give --chat-template FILE (a Jinja chat template)"


def build_parser() -> cli.Parser:
    p = cli.Parser(prog="scripts/chat.py", description=__doc__.split("\n")[0], epilog=KEYS)
    p.add_argument(
        "--checkpoint",
        help="HF directory or pagedjax orbax checkpoint (default: the embedded demo model)",
    )
    p.add_argument("--system", metavar="TEXT", help="a system message first in the conversation")
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file to use instead of the checkpoint's",
    )
    p.add_argument("--max-tokens", type=int, help="most tokens per reply (default 256)")
    cli.add_sampling_flags(
        p, temperature=0.7, max_tokens=256, seed_help="sampling seed of every reply"
    )
    cli.add_engine_flags(p)
    cli.add_lora_flags(p)
    return p


def stats_line(out) -> str:
    """One line about a reply: prompt tokens (and how many the prefix cache served), reply
    tokens and why it ended, time to first token, tokens/s after the first."""
    c = out.outputs[0]
    n = len(c.token_ids)
    ttft = "n/a" if out.ttft_s is None else f"{out.ttft_s:.3f} s"
    rate = "n/a"
    if n > 1 and out.ttft_s is not None and out.latency_s > out.ttft_s:
        rate = f"{(n - 1) / (out.latency_s - out.ttft_s):,.1f} tok/s"
    return (
        f"[prompt {len(out.prompt_token_ids)} tokens ({out.num_cached_tokens} cached), "
        f"reply {n} tokens ({c.finish_reason}), TTFT {ttft}, {rate}]"
    )


def not_utf8(text: str) -> str | None:
    """The first byte that stdin could not decode as UTF-8 (read with surrogateescape:
    byte b as the lone surrogate U+DC00 + b), as "byte 0xe9"; None for valid text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        return f"byte {c - 0xDC00:#04x}" if 0xDC80 <= c <= 0xDCFF else f"character {c:#x}"
    return None


def reply(llm, messages: list[dict], params, lora=None) -> str | None:
    """Streams the reply to `messages` (with the LoRA adapter `lora`, if any) to stdout
    and the stats line to stderr; returns the reply's text, or None when the
    conversation cannot be sent (said on stderr)."""
    try:
        ids = llm.tokenizer.encode_chat(messages)
    except (ValueError, TypeError) as e:  # the template rejected the conversation
        print(f"error: {e}", file=sys.stderr)
        return None
    alone = sum(m["role"] == "user" for m in messages) == 1  # then /reset would not help
    dropped = "it was not sent" if alone else "it was not sent; /reset starts the conversation over"
    if len(ids) >= llm.max_model_len:  # (the engine refuses it too): said in a chat's terms
        what = "the message is too long" if alone else "the conversation no longer fits"
        room = f"max_model_len={llm.max_model_len} leaves no room for a reply"
        print(f"error: {what} ({len(ids)} tokens, and {room}); {dropped}", file=sys.stderr)
        return None
    printer = cli.TextStream(llm.tokenizer, ids, llm.stop_ids(params))

    cli.INTERRUPT.clear()  # (a Ctrl-C at the prompt ended the session)
    try:
        (out,) = llm.generate(
            [ids],
            params,
            on_token=printer.on_token,
            on_step=cli.INTERRUPT.check,
            lora_request=lora,
        )
        cli.INTERRUPT.check()  # one that a gc callback swallowed in the last step
    except ValueError as e:  # refused: it would need more KV pages than the cache has, say
        what = "the message" if alone else "the conversation"
        print(f"error: the engine refused {what} ({e}); {dropped}", file=sys.stderr)
        return None
    c = out.outputs[0]
    print(printer.finish(c.text), flush=True)
    print(stats_line(out), file=sys.stderr, flush=True)
    if c.finish_reason == "length" and len(c.token_ids) < params.max_tokens:
        print(
            f"note: the reply was cut at the model's length (max_model_len={llm.max_model_len} "
            "tokens, the whole conversation); /reset starts it over",
            file=sys.stderr,
            flush=True,
        )
    return c.text


def check_room(args, tok, system: list[dict]) -> None:
    """BadInput, before the weights load, when a first turn (the `--system` message and a
    short user message) already takes the whole max_model_len (`--max-model-len`, else the
    model's): every turn would be refused, and /reset (which keeps the system message)
    could not help."""
    from pagedjax.resources import source_config

    limit = args.max_model_len
    if limit is None and (cfg := source_config(args.checkpoint)) is not None:
        limit = cfg.max_position_embeddings
    n = len(tok.encode_chat([*system, {"role": "user", "content": "Hi!"}]))
    if limit is not None and n >= limit:
        given = (
            f"--max-model-len {limit}" if args.max_model_len else f"the model's length ({limit})"
        )
        what = "the chat template and --system" if system else "the chat template"
        fix = "shorten --system or raise --max-model-len" if system else "raise --max-model-len"
        raise cli.BadInput(
            f"{given} leaves no room for a reply: {what} make a first turn of {n} tokens; {fix}"
        )


def run(args) -> int:
    from pagedjax.engine import LLM, SamplingParams

    if sys.stdin is None:  # (`chat.py <&-`): the messages have nowhere to come from
        raise cli.BadInput("stdin is closed; chat.py reads the user's messages from it")
    defaults = cli.generation_defaults(args)
    params = SamplingParams(**cli.sampling_kwargs(args, defaults))
    cli.check_engine_flags(args)
    lora = cli.lora_request(args)
    tok = cli.chat_tokenizer(args.checkpoint, args.chat_template, NO_TEMPLATE_HINT)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    try:  # a first turn renders, or the template is unusable (before the weights load)
        tok.apply_chat_template([*system, {"role": "user", "content": "Hi!"}])
    except ImportError as e:
        raise cli.BadInput(str(e)) from None
    except (ValueError, TypeError) as e:
        raise cli.BadInput(f"the chat template cannot render a first turn: {e}") from None
    check_room(args, tok, system)

    cli.note_defaults(args, defaults, "flags")
    cli.enable_compilation_cache(
        cli.compilation_cache_dir(args.compilation_cache), given=args.compilation_cache is not None
    )
    llm = LLM(
        args.checkpoint,
        seed=args.seed,
        tokenizer=tok,
        generation_config=args.generation_config,
        **cli.lora_kwargs(args),
        **cli.engine_kwargs(args),
    )
    if lora is not None:
        cli.read_lora(llm, lora, "--lora")
    cli.check_logit_bias(params.logit_bias, llm.config.vocab_size)  # not each turn's error
    tty = sys.stdin.isatty()
    with_lora = "" if lora is None else f" with LoRA adapter {lora.lora_path}"
    source = f"{llm.model_source}{with_lora} (template: {tok.chat_template_source})"
    print(f"model: {source}", file=sys.stderr)
    if tty:
        print(
            "commands: /reset starts over, /exit (or Ctrl-D) ends; Ctrl-C stops a reply",
            file=sys.stderr,
        )
    messages = list(system)
    if hasattr(sys.stdin, "reconfigure"):  # a line not UTF-8 is reported, not the end
        sys.stdin.reconfigure(errors="surrogateescape")
    number = 0
    while True:
        if tty:  # (on stderr, as the stats: `chat.py | tee replies.txt` gets the replies)
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        number += 1
        if not line:  # end of input
            if tty:
                print(file=sys.stderr)
            return 0
        if number == 1:  # a byte order mark (a file a Windows editor saved) is no text
            line = line.removeprefix("\ufeff")
        text = line.strip()
        if not text:
            continue
        if bad := not_utf8(text):
            print(
                f"error: line {number} is not UTF-8 text ({bad}); it was not sent", file=sys.stderr
            )
            continue
        if text.startswith("/") and len(text.split()) == 1:
            if text == "/exit":
                return 0
            if text == "/reset":
                messages = list(system)
                print("(conversation reset)", file=sys.stderr)
            else:
                print(f"unknown command {text}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        try:
            answer = reply(llm, messages, params, lora)
        except KeyboardInterrupt:  # the engine recovered (aborted the reply); drop the turn
            sys.stdout.write("\n")
            sys.stdout.flush()
            print("[interrupted]", file=sys.stderr, flush=True)
            answer = None
        if answer is None:
            messages.pop()  # so that the user can go on with a shorter line, or /reset
        else:
            messages.append({"role": "assistant", "content": answer})


def main(argv=None) -> int:
    with cli.INTERRUPT.latched():
        try:
            return cli.run_cli(build_parser, run, argv)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        except BrokenPipeError:  # stdout closed: no traceback
            return cli.stdout_closed()


if __name__ == "__main__":
    cli.exit_with(main())
