"""scripts/chat.py end to end (in-process `main(argv)`, stdin and stdout replaced).

The checkpoint is the `tiny` preset with random weights, a byte-level tokenizer and a
plain-text chat template, served with the geometry of tests/test_generate_cli.py so
that both share compiled programs. `LLM.generate` is wrapped to record what the
engine received and returned.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest
from generate_cli_helpers import load_script
from params_helpers import SAMPLING_ARGV, SAMPLING_FIELDS, write_tiny_checkpoint

from pagedjax.engine import LLM, SamplingParams
from pagedjax.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = ["--page-size", "8", "--num-pages", "64", "--max-batch-tokens", "16"]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SYSTEM = {"role": "system", "content": "You write short Python."}
STATS = re.compile(
    r"\[prompt (\d+) tokens \((\d+) cached\), reply (\d+) tokens \((stop|length)\), "
    r"TTFT \d+\.\d{3} s, (n/a|[\d,.]+ tok/s)\]"
)


chat_cli = load_script("chat")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_chat_ckpt")
    write_tiny_checkpoint(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture
def calls(monkeypatch):
    """(token ids sent, RequestOutput) of every `LLM.generate` call."""
    seen = []
    generate = LLM.generate

    def spy(self, prompts, *args, **kwargs):
        outs = generate(self, prompts, *args, **kwargs)
        seen.extend(zip(prompts, outs, strict=True))
        return outs

    monkeypatch.setattr(LLM, "generate", spy)
    return seen


def run(argv, lines, capsys, monkeypatch, stdin_cls=io.StringIO):
    monkeypatch.setattr("sys.stdin", stdin_cls("".join(f"{x}\n" for x in lines)))
    rc = chat_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


class Terminal(io.StringIO):
    """stdin on a terminal."""

    def isatty(self):
        return True


def base(ckpt, *extra):
    return ["--checkpoint", ckpt, "--backend", "xla", *GEOMETRY, "--temperature", "0", *extra]


def test_two_turns_carry_the_conversation_and_hit_the_prefix_cache(
    ckpt, calls, capsys, monkeypatch
):
    argv = base(ckpt, "--system", SYSTEM["content"], "--max-tokens", "6")
    u1, u2 = "def add(a, b):", "now subtract"
    rc, out, err = run(argv, [u1, "", u2], capsys, monkeypatch)  # a blank line is skipped
    assert rc == 0, err
    assert len(calls) == 2
    replies = [o.outputs[0].text for _, o in calls]
    conv1 = [SYSTEM, {"role": "user", "content": u1}]
    conv2 = [*conv1, {"role": "assistant", "content": replies[0]}, {"role": "user", "content": u2}]
    tok = Tokenizer.from_dir(ckpt)
    assert [ids for ids, _ in calls] == [tok.encode_chat(conv1), tok.encode_chat(conv2)]
    second = tok.decode(calls[1][0])
    assert u1 in second and replies[0] in second and second.endswith(f"<user>{u2}\n<assistant>")
    assert out == "".join(f"{r}\n" for r in replies)  # streamed text = the engine's text
    stats = [STATS.fullmatch(line) for line in err.splitlines() if line.startswith("[prompt")]
    assert len(stats) == 2 and all(stats), err
    assert [int(m[1]) for m in stats] == [len(ids) for ids, _ in calls]
    assert [int(m[3]) for m in stats] == [len(o.outputs[0].token_ids) for _, o in calls]
    assert int(stats[0][2]) == 0 and int(stats[1][2]) >= 8  # the first turn's pages hit

    # Each reply is what LLM.chat gives for the same conversation and sampling.
    kw = dict(page_size=8, num_pages=64, max_num_seqs=16, max_num_batched_tokens=16)
    llm = LLM(str(ckpt), backend="xla", **kw)  # as the script builds it
    sp = SamplingParams(temperature=0, max_tokens=6, seed=0)
    assert [o.outputs[0].text for o in llm.chat([conv1, conv2], sp)] == replies


def test_penalty_flags_reach_the_sampler(ckpt, calls, capsys, monkeypatch):
    pen = dict(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in pen.items()]
    rc, out, err = run(
        base(ckpt, "--max-tokens", "8", *flags), ["def add(a, b):"], capsys, monkeypatch
    )
    assert rc == 0, err
    [(ids, got)] = calls
    kw = dict(page_size=8, num_pages=64, max_num_seqs=16, max_num_batched_tokens=16)
    llm = LLM(str(ckpt), backend="xla", **kw)
    want = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, seed=0, **pen))
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, seed=0))
    assert got.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert want[0].outputs[0].token_ids != plain[0].outputs[0].token_ids  # they matter here


def test_reset_unknown_commands_and_exit_on_a_terminal(ckpt, calls, capsys, monkeypatch):
    lines = ["first line", "/reset", "/nope", "second line", "/exit", "never sent"]
    argv = base(ckpt, "--system", SYSTEM["content"], "--max-tokens", "3")
    rc, out, err = run(argv, lines, capsys, monkeypatch, Terminal)
    assert rc == 0, err
    tok = Tokenizer.from_dir(ckpt)
    want = [tok.encode_chat([SYSTEM, {"role": "user", "content": x}]) for x in lines[::3]]
    assert [ids for ids, _ in calls] == want  # after /reset: the system message and the new line
    assert "(conversation reset)" in err and "unknown command /nope" in err
    assert "> " not in out and err.count("> ") == 5  # one prompt per line read, on stderr


def test_a_conversation_too_long_is_reported_and_the_loop_goes_on(ckpt, calls, capsys, monkeypatch):
    lines = ["hi", "x" * 80, "ok"]
    argv = base(ckpt, "--max-model-len", "64", "--max-tokens", "4")
    rc, out, err = run(argv, lines, capsys, monkeypatch)
    assert rc == 0, err
    assert len(calls) == 2  # the long line was refused
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "max_model_len=64" in errors[0] and "/reset" in errors[0], err
    tok = Tokenizer.from_dir(ckpt)
    reply = calls[0][1].outputs[0].text
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]
    assert calls[1][0] == tok.encode_chat([*conv, {"role": "user", "content": "ok"}])  # no "x"s
    assert out == "".join(f"{o.outputs[0].text}\n" for _, o in calls)


def test_a_reply_cut_by_the_models_length_is_said(ckpt, calls, capsys, monkeypatch):
    """A reply stopped by max_model_len, well short of --max-tokens, was shown as any
    other "(length)" reply: the conversation was full and nothing said so."""
    argv = base(ckpt, "--max-model-len", "64", "--max-tokens", "40")
    rc, out, err = run(argv, ["x" * 40], capsys, monkeypatch)
    assert rc == 0, err
    (c,) = calls[0][1].outputs
    assert c.finish_reason == "length" and len(calls[0][0]) + len(c.token_ids) == 64
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: the reply was cut at the model's length (max_model_len=64 tokens, the whole "
        "conversation); /reset starts it over"
    ], err
    run(base(ckpt, "--max-tokens", "4"), ["x"], capsys, monkeypatch)  # cut by --max-tokens
    assert calls[1][1].outputs[0].finish_reason == "length"
    assert "note: " not in capsys.readouterr().err


def test_a_ctrl_c_that_python_drops_still_stops_the_reply(ckpt, capsys, monkeypatch):
    """A Ctrl-C dropped by Python (raised in jax's gc callback) let the reply run on to its
    end; it stops the reply at the next step, the turn is dropped, and the next turn
    runs whole (the latch is cleared)."""
    import signal

    generate, seen = LLM.generate, []

    def spy(self, prompts, sp, *, on_step=None, **kwargs):
        steps = [0]

        def step(llm):
            steps[0] += 1
            if on_step is not None:
                on_step(llm)

        if not seen:  # the first reply
            with contextlib.suppress(KeyboardInterrupt):  # as Python's gc drops it
                signal.raise_signal(signal.SIGINT)
        try:
            return generate(self, prompts, sp, on_step=step, **kwargs)
        finally:
            seen.append(steps[0])

    monkeypatch.setattr(LLM, "generate", spy)
    rc, out, err = run(base(ckpt, "--max-tokens", "6"), ["hi", "again"], capsys, monkeypatch)
    assert rc == 0, err
    assert seen[0] == 1 and seen[1] >= 6, seen  # stopped at its first step; then whole
    assert err.count("[interrupted]") == 1 and len(STATS.findall(err)) == 1, err


def test_stdout_closed_early_is_no_traceback(ckpt, capsys, monkeypatch):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert chat_cli.main([str(a) for a in base(ckpt, "--max-tokens", "2")]) == 141


def test_a_logit_bias_outside_the_vocabulary_is_bad_input(ckpt, calls, capsys, monkeypatch):
    """It was refused turn after turn as "the conversation no longer fits", status 0."""
    argv = base(ckpt, "--logit-bias", '{"256": 1}')
    rc, out, err = run(argv, ["hi", "again"], capsys, monkeypatch)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "--logit-bias token ids [256] are outside the vocabulary [0, 256)" in err, err
    assert out == "" and not calls


def test_ctrl_c_while_a_reply_streams_drops_that_turn(ckpt, capsys, monkeypatch):
    """The second reply is interrupted (KeyboardInterrupt from its on_token, inside the
    engine's step) after two tokens: the third turn's prompt has the first turn and not
    the second; then Ctrl-C at the prompt ends the session (status 130)."""
    seen = []  # (token ids sent, RequestOutput or None, engine)
    generate = LLM.generate

    def spy(self, prompts, sp, *, on_token, **kwargs):
        n, interrupt = [0], len(seen) == 1

        def tokens(rid, index, tok):
            on_token(rid, index, tok)
            n[0] += 1
            if interrupt and n[0] == 2:
                raise KeyboardInterrupt

        try:
            (out,) = generate(self, prompts, sp, on_token=tokens, **kwargs)
        except KeyboardInterrupt:
            seen.append((prompts[0], None, self))
            raise
        seen.append((prompts[0], out, self))
        return [out]

    class CtrlCAtTheEnd(io.StringIO):
        def readline(self, *args):
            line = super().readline(*args)
            if not line:
                raise KeyboardInterrupt
            return line

    monkeypatch.setattr(LLM, "generate", spy)
    u1, u2, u3 = "def add(a, b):", "now subtract", "and multiply"
    argv = base(ckpt, "--system", SYSTEM["content"], "--max-tokens", "6")
    rc, out, err = run(argv, [u1, u2, u3], capsys, monkeypatch, CtrlCAtTheEnd)
    assert rc == 130, err
    assert [o is None for _, o, _ in seen] == [False, True, False]
    r1, r3 = seen[0][1].outputs[0].text, seen[2][1].outputs[0].text
    conv3 = [
        SYSTEM,
        {"role": "user", "content": u1},
        {"role": "assistant", "content": r1},
        {"role": "user", "content": u3},
    ]
    tok = Tokenizer.from_dir(ckpt)
    assert seen[2][0] == tok.encode_chat(conv3)  # the interrupted turn is gone
    assert u2 not in tok.decode(seen[2][0])
    assert err.count("[interrupted]") == 1 and len(STATS.findall(err)) == 2, err
    assert out.startswith(f"{r1}\n") and out.endswith(f"\n{r3}\n") and out.count("\n") == 3
    llm = seen[2][2]  # the engine is clean, and its third reply a fresh engine's
    llm.block_manager.check_invariants()
    assert llm.block_manager.stats().num_used_pages == 0 and not llm.has_unfinished_requests()
    kw = dict(page_size=8, num_pages=64, max_num_seqs=16, max_num_batched_tokens=16)
    fresh = LLM(str(ckpt), backend="xla", **kw)
    sp = SamplingParams(temperature=0, max_tokens=6, seed=0)
    assert [o.outputs[0].text for o in generate(fresh, [seen[2][0]], sp)] == [r3]


def test_chat_template_file_replaces_the_checkpoints(ckpt, calls, tmp_path, capsys, monkeypatch):
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}MARKER {{ m['content'] }}|{% endfor %}>>")
    rc, out, err = run(
        base(ckpt, "--chat-template", f, "--max-tokens", "2"), ["hi"], capsys, monkeypatch
    )
    assert rc == 0, err
    assert [Tokenizer.from_dir(ckpt).decode(ids) for ids, _ in calls] == ["MARKER hi|>>"]
    assert f"template: {f}" in err


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--chat-template", "missing.jinja"], "--chat-template missing.jinja: no such file"),
        (["--chat-template", "broken.jinja"], "(broken.jinja) has a syntax error at line 2"),
        (["--chat-template", "no_system.jinja", "--system", "x"], "cannot render a first turn"),
        (["--checkpoint", "bare"], "has no chat template"),
        (["--max-model-len", "1"], "--max-model-len must be >= 2, got 1"),
        (["--page-size", "0"], "--page-size must be >= 1, got 0"),
        (["--top-p", "0"], "top_p=0.0"),
        (["--repetition-penalty", "0"], "got repetition_penalty=0.0"),
        (["--backend", "gpu"], "backend='gpu' needs a GPU"),
        (["--checkpoint", "nowhere"], "not found"),
    ],
)
def test_bad_input_is_one_line_before_loading_weights(
    ckpt, tmp_path, capsys, monkeypatch, extra, match
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.jinja").write_text("ok\n{% for m in messages %}{{ m }")
    (tmp_path / "no_system.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    )
    (tmp_path / "bare").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / "bare" / name).write_bytes((ckpt / name).read_bytes())
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    rc, out, err = run(["--checkpoint", ckpt, *extra], ["hi"], capsys, monkeypatch)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert match in err and out == "", err
    if "bare" in extra:
        assert "--chat-template FILE" in err


def test_every_flag_is_in_the_docstring_and_the_readme():
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("`scripts/chat.py` loads") :].split("```")[0]
    flags = {
        option
        for action in chat_cli.build_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    assert not sorted(f for f in flags if f not in paragraph)
    assert not sorted(f for f in flags if f not in chat_cli.__doc__)
    assert "python scripts/chat.py --checkpoint" in readme


def test_sampling_flags_and_defaults_reach_the_engine(ckpt, capsys, monkeypatch):
    """Every reply's SamplingParams: the flags given, else chat's defaults (temperature
    0.7, 256 tokens, seed 0), and the engine flags to `LLM`."""
    seen = []
    init = LLM.__init__

    def spy_init(self, *args, **kwargs):
        seen.append(kwargs)
        init(self, *args, **kwargs)

    def stop(self, prompts, sp, **kwargs):  # a Ctrl-C mid-reply: the turn is dropped
        seen.append(sp)
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "__init__", spy_init)
    monkeypatch.setattr(LLM, "generate", stop)
    argv = ["--checkpoint", ckpt, "--backend", "xla", *GEOMETRY]
    rc, _, err = run(argv, ["hi"], capsys, monkeypatch)
    assert rc == 0 and err.count("[interrupted]") == 1, err
    assert seen[1] == SamplingParams(temperature=0.7, max_tokens=256, seed=0)
    assert seen[0]["seed"] == 0 and seen[0]["page_size"] == 8 and seen[0]["num_pages"] == 64
    seen.clear()
    argv += [*SAMPLING_ARGV, "--max-tokens", "9", "--max-model-len", "100"]
    rc, _, err = run(argv, ["hi"], capsys, monkeypatch)
    assert rc == 0, err
    assert seen[1] == SamplingParams(max_tokens=9, **SAMPLING_FIELDS)
    assert seen[0]["seed"] == 11 and seen[0]["max_model_len"] == 100


def test_stats_line_rate_counts_the_tokens_after_the_first():
    from types import SimpleNamespace as NS

    def out(n, ttft, latency):
        c = NS(token_ids=list(range(n)), finish_reason="length")
        kw = dict(prompt_token_ids=[1] * 12, num_cached_tokens=8)
        return NS(outputs=[c], ttft_s=ttft, latency_s=latency, **kw)

    line = chat_cli.stats_line(out(5, 0.5, 1.5))  # 4 tokens in the second after the first
    assert line == "[prompt 12 tokens (8 cached), reply 5 tokens (length), TTFT 0.500 s, 4.0 tok/s]"
    assert chat_cli.stats_line(out(1, 0.5, 0.7)).endswith("TTFT 0.500 s, n/a]")  # one token
    assert chat_cli.stats_line(out(3, None, 0.7)).endswith("TTFT n/a, n/a]")


def test_a_line_starting_with_a_slash_and_more_words_is_a_message(ckpt, calls, capsys, monkeypatch):
    """Only a single word like /reset is a command; "/usr/bin is where?" is sent."""
    rc, out, err = run(base(ckpt, "--max-tokens", "2"), ["/usr/bin is where?"], capsys, monkeypatch)
    assert rc == 0 and "unknown command" not in err, err
    tok = Tokenizer.from_dir(ckpt)
    assert [ids for ids, _ in calls] == [
        tok.encode_chat([{"role": "user", "content": "/usr/bin is where?"}])
    ]


def test_a_line_that_is_not_utf8_is_reported_and_the_loop_goes_on(ckpt, calls, capsys, monkeypatch):
    """stdin decoded strictly (a UTF-8 locale's default): one bad byte ended the session
    with status 2, and the lines read with it in one chunk were never answered."""
    data = b"hi\ncaf\xe9\nok\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    rc = chat_cli.main([str(a) for a in base(ckpt, "--max-tokens", "2")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert [ids for ids, _ in calls][0] == Tokenizer.from_dir(ckpt).encode_chat(
        [{"role": "user", "content": "hi"}]
    )
    assert len(calls) == 2  # "hi" and "ok"; the bad line was not sent
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: line 2 is not UTF-8 text (byte 0xe9); it was not sent"], err


def test_on_a_terminal_stdout_holds_the_replies_alone(ckpt, calls, capsys, monkeypatch):
    """The `> ` prompt (and the newline at Ctrl-D) went to stdout: `chat.py | tee log` or
    `chat.py > replies.txt` got "> " glued to the front of every reply."""
    rc, out, err = run(
        base(ckpt, "--max-tokens", "3"), ["hi", "again"], capsys, monkeypatch, Terminal
    )
    assert rc == 0, err
    assert out == "".join(f"{o.outputs[0].text}\n" for _, o in calls)
    assert err.count("> ") == 3  # one prompt per line read, and one at the end of input


def test_a_system_message_that_leaves_no_room_is_bad_input(ckpt, calls, capsys, monkeypatch):
    """Every turn was refused with "/reset starts it over", which keeps the system message:
    nothing could ever be answered, and piped input still ended with status 0."""
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    argv = base(ckpt, "--system", "x" * 80, "--max-model-len", "64")
    rc, out, err = run(argv, ["hi", "/reset", "hi"], capsys, monkeypatch)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    conv = [{"role": "system", "content": "x" * 80}, {"role": "user", "content": "Hi!"}]
    n = len(Tokenizer.from_dir(ckpt).encode_chat(conv))
    assert (
        "error: --max-model-len 64 leaves no room for a reply: the chat template and --system "
        f"make a first turn of {n} tokens; shorten --system or raise --max-model-len"
    ) in err
    assert out == "" and not calls


def test_a_message_too_long_by_itself_is_not_sent_to_reset(ckpt, calls, capsys, monkeypatch):
    """A first message longer than the model allows was answered "the conversation no
    longer fits ...; /reset starts it over": there was nothing to reset."""
    argv = base(ckpt, "--max-model-len", "64", "--max-tokens", "4")
    rc, out, err = run(argv, ["x" * 80, "hi"], capsys, monkeypatch)
    assert rc == 0, err
    n = len(Tokenizer.from_dir(ckpt).encode_chat([{"role": "user", "content": "x" * 80}]))
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: the message is too long ({n} tokens, and max_model_len=64 leaves no room for "
        "a reply); it was not sent"
    ], err
    assert len(calls) == 1 and out == f"{calls[0][1].outputs[0].text}\n"  # "hi" is answered


def test_a_first_turn_the_cache_cannot_hold_is_not_sent_to_reset(ckpt, capsys, monkeypatch):
    """A first turn whose reply (--max-tokens) needs more KV pages than --num-pages gives
    was refused with "raise num_pages or lower max_tokens ...; /reset starts it over"."""
    argv = base(ckpt, "--num-pages", "4", "--max-tokens", "64")
    rc, out, err = run(argv, ["hi"], capsys, monkeypatch)
    assert rc == 0 and out == "", err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: the engine refused the message ("), err
    assert "raise num_pages or lower max_tokens" in errors[0] and "/reset" not in errors[0], err
    assert errors[0].endswith("; it was not sent"), err


def test_help_names_the_commands_and_the_keys():
    """--help said nothing of /reset and /exit (shown only on a terminal, once loaded)."""
    text = " ".join(chat_cli.build_parser().format_help().split())
    assert "/reset starts the conversation over (keeping --system), /exit ends" in text
    assert "Ctrl-C (status 130) or Ctrl-D at the prompt ends the session" in text


def test_stdin_closed_is_bad_input(ckpt, capsys, monkeypatch):
    """`chat.py <&-` (sys.stdin None) loaded the model, then ended in a traceback."""
    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("weights were loaded"))
    monkeypatch.setattr("sys.stdin", None)
    assert chat_cli.main([str(a) for a in base(ckpt)]) == 2
    out, err = capsys.readouterr()
    assert err == "error: stdin is closed; chat.py reads the user's messages from it\n"
