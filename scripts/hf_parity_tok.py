"""Tokenizer and chat-template parity with transformers: the tok-* cases of
`check_hf_parity.py` (run them with `python scripts/check_hf_parity.py --cases tok`).

Each case (`TOK_CASES`, in `hf_parity_tok_cases.py`) writes a tokenizer directory in
one family's style: a tokenizer.json built with the `tokenizers` library (byte-level
BPE with Llama 3's or Qwen2's split regex; SentencePiece-converted BPE with byte
fallback, Mistral's Metaspace or Llama 2's legacy normalizer), a tokenizer_config.json
as those checkpoints have it (bos/eos, add_bos_token, tokenizer_class, chat_template)
and chat templates of our own modeled on Llama 3.1's, Qwen2.5's, Qwen3's, Mistral's,
Llama 2's and a ChatML fine-tune's (a default + tool_use list). `Tokenizer.from_dir`
and `AutoTokenizer.from_pretrained` load it, and every check compares ours with HF's:

* facts: BOS id, HF's EOS among ours.
* chat / chat ids: `apply_chat_template` text and `encode_chat` ids for each of
  `CONVERSATIONS` (system or not, multi-turn, empty, unicode, special-token text in
  content, roles a template refuses, tool calls, reasoning) with and without the
  generation prompt, and continuing a final assistant message, with each of the
  case's template variables (tools, enable_thinking, date_string); a refusal must be
  one on both sides.
* encode: `encode(text)` vs `tokenizer(text)` (with and without BOS) for `TOK_TEXTS`
  and the rendered prompts.
* decode: `decode(ids, skip_special_tokens=)` vs HF's, both ways, for those ids and
  random ones (byte tokens, special tokens anywhere).
* context: a completion's `decode(ids, context=prompt)` and `stream(context=prompt)`
  vs HF's decode(prompt + ids) less decode(prompt), for chat prompts and random ones
  (skipped where the prompt's text ends inside a character, which the completion's
  bytes may complete: what it adds is then moot).

A case passes when every check is equal, HF's result adjusted only by our documented
choices, each counted in the table ("deliberate"): no second BOS for text that starts
with it (`Tokenizer.encode`).
Chat ids are HF's exactly: a template that writes no BOS gets none, whether the
tokenizer adds BOS by its config (tok-chatml) or by its post-processor alone
(tok-llama3-chatml), as HF's `apply_chat_template` encodes the text without special
tokens. Llama 2's tokenizer_class `LlamaTokenizer` is not used: transformers 5 rebuilds
that class's own pre-tokenizer (Metaspace) instead of the tokenizer.json's legacy
normalizer, ids that differ (leading spaces, text after special tokens) from the
tokenizer.json we follow.
"""

from __future__ import annotations

import tempfile
import time

from hf_parity_tok_cases import TOK_CASE_NAMES, TOK_CASES, TokCase  # noqa: F401  (re-exported)

_S, _U, _A, _T = "system", "user", "assistant", "tool"
WEATHER_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}


def _msgs(*pairs) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


CONVERSATIONS = (
    _msgs((_U, "Hello!")),
    _msgs((_S, "You are a pirate. Answer briefly."), (_U, "What is the capital of France?")),
    _msgs(
        (_S, "You are a helpful assistant."),
        (_U, "Hi there"),
        (_A, "Hello! How can I help?"),
        (_U, "Write fib(n) in Python."),
    ),
    _msgs((_U, "Hi"), (_A, "Hello"), (_U, "How are you?"), (_A, "Fine, thanks.")),
    _msgs((_U, "What is the capital of France?"), (_A, "The capital of France is")),
    _msgs((_U, "")),
    _msgs((_S, ""), (_U, "no system prompt really")),
    _msgs((_U, "héllo wörld 日本語のテキスト 🙂🚀 ça va?\nnew line\ttab 𝄞")),
    _msgs((_U, "  leading and trailing spaces  \n")),
    _msgs((_U, "Say it"), (_A, "  spaced answer  ")),
    _msgs((_U, "Say it"), (_A, "\n```python\n")),
    _msgs((_U, "Spell the end"), (_A, "end")),
    _msgs((_U, "Say nothing"), (_A, "")),
    _msgs((_U, "Specials: <|eot_id|> <|im_end|> <|begin_of_text|> </s> <s> [INST] <think>")),
    _msgs((_U, "<s>[INST] injected [/INST]"), (_A, "ok</s>")),
    _msgs((_U, "first"), (_U, "second")),  # not alternating
    _msgs((_A, "I speak first")),
    _msgs((_S, "Only a system message")),
    _msgs((_U, "What's the weather?"), (_T, '{"temp": 21, "unit": "°C"}')),
    _msgs(
        (_U, "2+2?"),
        (_A, "<think>\nSimple sum.\n</think>\n\n4"),
        (_U, "And 3+3?"),
        (_A, "<think>\nAgain a sum.\n</think>\n\n6"),
    ),
    _msgs((_U, "Think first"), (_A, "<think>\nLet me think")),
    *(
        [
            {"role": _U, "content": "2+2?"},
            {"role": _A, "content": "4", key: "Two and two make four."},
        ]
        for key in ("reasoning_content", "reasoning", "thinking")
    ),
    [  # as OpenAI clients send them: a tool call, content and tool_calls null
        {"role": _U, "content": "Weather in Paris?"},
        {"role": _A, "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": _T, "content": '{"temp": 21}'},
        {"role": _A, "content": "It is 21 °C.", "tool_calls": None},
    ],
)
TOK_TEXTS = (
    "Hello world",
    "",
    " leading space",
    "two  spaces and trailing ",
    "\n\nnewlines\n",
    "héllo wörld 日本語 🙂 café naïve",
    "e\u0301 combining, \u00a0nbsp, ﬁ ligature",
    "ünïcödé 𝄞 at the end",
    "    indented code\n\treturn 1",
    "<|begin_of_text|>Hello",
    "<s>[INST] hi [/INST]",
    "<s><s>twice",
    "Hello<|eot_id|>world<|im_end|>a</s>b",
    "<think>\nreasoning\n</think>\n\nanswer",
    "x" * 40 + " 1234567",
)
# Replies decoded after each chat prompt (the context check), and random id lists.
REPLIES = ("Paris.", " The capital is Paris.", "日本語 🙂!", "\n\n```python\nx = 1\n```", "end")
RANDOM_ID_LISTS = 40


class _Tally:
    """Per-check counts: compared, equal, equal only under a documented rule of ours
    (`deliberate`), and the first few mismatches for the JSON report."""

    def __init__(self):
        self.n, self.ok, self.deliberate = {}, {}, {}
        self.mismatches: list[dict] = []

    def add(self, check: str, got, want, where, *, rule: str | None = None, hf=None):
        self.n[check] = self.n.get(check, 0) + 1
        if got == want:
            self.ok[check] = self.ok.get(check, 0) + 1
            if rule is not None:
                self.deliberate[rule] = self.deliberate.get(rule, 0) + 1
        elif len(self.mismatches) < 12:
            self.mismatches.append(
                dict(check=check, where=where, ours=got, hf=want if hf is None else hf)
            )


def _outcome(call, *args, **kwargs):
    """call(*args, **kwargs), or ("raised", "ExceptionType: message")."""
    try:
        return call(*args, **kwargs)
    except Exception as e:
        return ("raised", f"{type(e).__name__}: {str(e)[:160]}")


def _raised(x) -> bool:
    return isinstance(x, tuple) and x[:1] == ("raised",)


def _chat_checks(tok, hf, case: TokCase, tally: _Tally) -> list[list[int]]:
    """Renders every conversation both ways (text, then ids); returns HF's prompt ids."""
    prompts = []
    for c, conv in enumerate(CONVERSATIONS):
        modes = [dict(add_generation_prompt=True), dict(add_generation_prompt=False)]
        if conv[-1]["role"] == "assistant":
            modes.append(dict(add_generation_prompt=False, continue_final_message=True))
        for v, variables in enumerate(case.variables):
            for mode in modes:
                kw = {**mode, **variables}
                where = dict(conversation=c, variables=v, **mode)
                hf_text = _outcome(hf.apply_chat_template, conv, tokenize=False, **kw)
                hf_ids = _outcome(
                    hf.apply_chat_template, conv, tokenize=True, return_dict=False, **kw
                )
                text = _outcome(tok.apply_chat_template, conv, **kw)
                ids = _outcome(tok.encode_chat, conv, **kw)
                if _raised(hf_text) or _raised(text):
                    # Both refuse (a template's raise_exception).
                    if _raised(text) and _raised(hf_text):
                        tally.add("chat", "refused", "refused", where)
                    else:
                        tally.add("chat", text, hf_text, where)
                    continue
                tally.add("chat", text, hf_text, where)
                tally.add("chat ids", ids, hf_ids, where)
                if mode.get("add_generation_prompt"):
                    prompts.append(hf_ids)
    return prompts


def _encode_checks(tok, hf, texts, tally: _Tally) -> list[list[int]]:
    out = []
    bos, bos_text = tok.bos_token_id, tok.bos_token
    for text in texts:
        where = dict(text=text[:80])
        want = hf(text)["input_ids"]
        rule = None
        if tok.add_bos and bos_text and text.startswith(bos_text) and want[:2] == [bos, bos]:
            want, rule = want[1:], "no second BOS for text that starts with it"
        got = tok.encode(text)
        tally.add("encode", got, want, where, rule=rule, hf=hf(text)["input_ids"])
        plain = hf(text, add_special_tokens=False)["input_ids"]
        tally.add("encode", tok.encode(text, add_bos=False), plain, dict(where, add_bos=False))
        out.append(got)
    return out


def _decode_checks(tok, hf, id_lists, tally: _Tally):
    for ids in id_lists:
        for skip in (True, False):
            where = dict(ids=ids[:40], skip_special_tokens=skip)
            want = hf.decode(ids, skip_special_tokens=skip)
            tally.add("decode", tok.decode(ids, skip_special_tokens=skip), want, where)


def _context_checks(tok, hf, pairs, tally: _Tally):
    """A completion decoded after its prompt (and streamed after it) vs HF's
    decode(prompt + completion) less decode(prompt), where the prompt's text ends on a
    whole character and is a prefix (the completion's bytes did not change it)."""
    for prompt, completion in pairs:
        for skip in (True, False):
            full = hf.decode(prompt + completion, skip_special_tokens=skip)
            head = hf.decode(prompt, skip_special_tokens=skip)
            if head.endswith("\ufffd") or not full.startswith(head):
                continue  # the prompt ends inside a character: what the completion adds is moot
            where = dict(prompt=prompt[-12:], completion=completion[:24], skip_special_tokens=skip)
            got = tok.decode(completion, skip_special_tokens=skip, context=prompt)
            tally.add("context", got, full[len(head) :], where)
            stream = tok.stream(skip_special_tokens=skip, context=prompt)
            streamed = "".join(stream.add(i) for i in completion) + stream.flush()
            tally.add("context", streamed, full[len(head) :], dict(where, stream=True))


def run_tok_case(case: TokCase, args, transformers) -> dict:
    import numpy as np

    from pagedjax.tokenizer import Tokenizer

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    tally = _Tally()
    with tempfile.TemporaryDirectory(prefix=f"hf_parity_{case.name}_") as path:
        case.write(path)
        tok = Tokenizer.from_dir(path)
        hf = transformers.AutoTokenizer.from_pretrained(path)
    facts = dict(
        bos=(tok.bos_token_id, hf.bos_token_id),
        eos_in_ours=hf.eos_token_id in tok.eos_token_ids,
        add_bos=tok.add_bos,
        hf_class=type(hf).__name__,
    )
    tally.add("facts", (tok.bos_token_id, True), (hf.bos_token_id, facts["eos_in_ours"]), facts)
    prompts = _chat_checks(tok, hf, case, tally)
    texts = [*TOK_TEXTS, *(hf.decode(p) for p in prompts)]
    encoded = _encode_checks(tok, hf, texts, tally)
    vocab = tok.vocab_size
    randoms = [rng.integers(0, vocab, rng.integers(1, 25)).tolist() for _ in range(RANDOM_ID_LISTS)]
    _decode_checks(tok, hf, [*encoded, *prompts, *randoms], tally)
    eos = min(tok.eos_token_ids) if tok.eos_token_ids else None
    replies = [tok.encode(r, add_bos=False) + ([eos] if eos is not None else []) for r in REPLIES]
    pairs = [(p, r) for p in prompts for r in replies]
    pairs += [(encoded[i], r) for i in range(len(TOK_TEXTS)) for r in replies]
    pairs += list(zip(randoms[::2], randoms[1::2], strict=True))
    _context_checks(tok, hf, pairs, tally)
    checks = {k: [tally.ok.get(k, 0), n] for k, n in tally.n.items()}
    return dict(
        case=case.name,
        what=case.what,
        facts=facts,
        checks=checks,
        deliberate=tally.deliberate,
        mismatches=tally.mismatches,
        ok=all(ok == n for ok, n in checks.values()),
        seconds=round(time.perf_counter() - t0, 1),
    )


TOK_CHECKS = ("facts", "chat", "chat ids", "encode", "decode", "context")


def tok_table(results: list[dict]) -> str:
    w = max(map(len, TOK_CASE_NAMES))
    head = f"{'case':{w}} " + " ".join(f"{c:>11}" for c in TOK_CHECKS) + f" {'deliberate':>10}  ok"
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['case']:{w}} FAIL {r['error'].splitlines()[0][:160]}")
            continue
        cells = ["{}/{}".format(*r["checks"][c]) if c in r["checks"] else "-" for c in TOK_CHECKS]
        lines.append(
            f"{r['case']:{w}} "
            + " ".join(f"{c:>11}" for c in cells)
            + f" {sum(r['deliberate'].values()):>10}  {'PASS' if r['ok'] else 'FAIL'}"
        )
    rules = {}
    for r in results:
        for rule, n in r.get("deliberate", {}).items():
            rules[rule] = rules.get(rule, 0) + n
    lines += [f"  deliberate ({n}): {rule}" for rule, n in rules.items()]
    for r in results:
        for m in r.get("mismatches", [])[:3]:
            lines.append(f"  {r['case']} {m['check']} at {m['where']}: ours {m['ours']!r:.200}")
            lines.append(f"  {' ' * len(r['case'])} {' ' * len(m['check'])} HF {m['hf']!r:.200}")
    return "\n".join(lines)
