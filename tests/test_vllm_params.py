"""vLLM's SamplingParams fields end to end through `LLM`: include_stop_str_in_output,
skip_special_tokens, max_tokens=None, truncate_prompt_tokens and seed.

The tiny preset with random weights and a byte tokenizer (one token per byte), in
test_engine.py's geometry, so the programs compiled there serve here too. Expected
texts come from the tokenizer's own decode of the tokens the engine generated.
"""

import dataclasses
import json

import numpy as np
import params_helpers
import pytest
from serve_helpers import StreamRecorder
from tokenizers import AddedToken

from pagedjax import openai_api as api
from pagedjax import resources
from pagedjax.config import PRESETS
from pagedjax.engine import LLM, SamplingParams
from pagedjax.tokenizer import Tokenizer

GEOMETRY = dict(page_size=8, num_pages=64, backend="xla", max_num_seqs=8)
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def params():
    return params_helpers.random_params(PRESETS["tiny"], 0)


@pytest.fixture(scope="module")
def llm(params):
    return LLM(params, max_num_batched_tokens=16, max_model_len=32, **GEOMETRY)


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def free_run(llm, prompt=PROMPT, n=16) -> list[int]:
    """The greedy tokens after `prompt`, no stop of any kind."""
    return llm.generate([prompt], greedy(n, ignore_eos=True))[0].outputs[0].token_ids


def ascii_runs(ids: list[int], width: int) -> list[int]:
    """Where `width` printable ASCII tokens in a row start in `ids`."""
    ok = [33 <= t < 127 for t in ids]
    return [i for i in range(len(ids) - width + 1) if all(ok[i : i + width])]


def byte_tokenizer_with_specials(special: list[int], eos: int = 2) -> Tokenizer:
    """The byte tokenizer with the ids `special` marked special (their ids unchanged)."""
    hf = resources.byte_tokenizer().tokenizer
    hf.add_special_tokens([AddedToken(hf.id_to_token(t), special=True) for t in special])
    assert [hf.token_to_id(hf.id_to_token(t)) for t in special] == special
    return Tokenizer(hf, bos_token_id=1, eos_token_ids=[eos])


# ------------------------------------------------------ include_stop_str_in_output


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    free = free_run(llm)
    i = ascii_runs(free, 2)[0]
    stop = llm.tokenizer.decode(free[i : i + 2])  # two characters, across two tokens
    text = llm.tokenizer.decode(free[: i + 2], context=llm.encode(PROMPT)[1])
    cut = text.index(stop)
    outs = {}
    for include in (False, True):
        (o,) = llm.generate([PROMPT], greedy(stop=[stop], include_stop_str_in_output=include))
        outs[include] = o.outputs[0]
    for c in outs.values():  # only the text changes
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (free[: i + 2], "stop", stop)
    assert outs[False].text == text[:cut] and outs[True].text == text[: cut + len(stop)]
    assert outs[True].text.endswith(stop) and stop not in outs[False].text


def stream(llm, body: dict):
    """scripts/serve.py's stream of an engine run of `body` (its token events, then its
    output): (the streamed text pieces, the final completion)."""
    body = dict(prompt=PROMPT, temperature=0, max_tokens=16, stream=True, **body)
    sizes = dict(vocab_size=llm.config.vocab_size, max_model_len=llm.max_model_len)
    job = api.parse_job(body, chat=False, model_name="m", tokenizer=llm.tokenizer, **sizes)
    (rid,) = job.rids
    events = []
    llm.add_request(job.prompts[0], job.params, request_id=rid)
    while llm.has_unfinished_requests():
        for out in llm.step(on_token=lambda r, j, t: events.append(("token", r, j, t))):
            events.append(("done", rid, out))
    (out,) = [e[2] for e in events if e[0] == "done"]
    handler = StreamRecorder(llm.tokenizer, llm.stop_ids)
    handler._stream(job, api.response_head(job, "m"), events)
    assert handler.sent[-2:] == [b"data: [DONE]\n\n", b""]
    pieces = [json.loads(c[len(b"data: ") :])["choices"][0]["text"] for c in handler.sent[:-2]]
    return pieces, out.outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_adds_up_to_the_final_text(llm, include):
    """scripts/serve.py's stream adds up to the non-streamed text, stop string or stop
    token's text kept or not: no piece ever streamed is cut from the final text."""
    free = free_run(llm)
    i = ascii_runs(free, 2)[0]
    stop = llm.tokenizer.decode(free[i : i + 2])
    body = dict(stop=[stop, "\x00never"], include_stop_str_in_output=include)
    pieces, c = stream(llm, body)
    assert c.text.endswith(stop) == include and c.finish_reason == "stop"
    assert "".join(pieces) == c.text and sum(map(bool, pieces[:-1])) > 1
    # A plain stop token (a printable byte's): its text shows only with include.
    j = [j for j in ascii_runs(free, 1) if free.index(free[j]) == j][-1]  # its first time
    body = dict(stop_token_ids=[free[j]], include_stop_str_in_output=include)
    pieces, c = stream(llm, body)
    assert (c.token_ids, c.stop_reason) == (free[: j + 1], free[j])
    text = llm.tokenizer.decode(free[: j + 1 if include else j], context=llm.encode(PROMPT)[1])
    assert "".join(pieces) == c.text == text and sum(map(bool, pieces[:-1])) > 1


# ------------------------------------------------------------- skip_special_tokens


def test_skip_special_tokens_per_request(params, llm):
    """Two tokens of the completion made special, the second the tokenizer's EOS: the
    first shows with skip_special_tokens=False, in the text and to stop strings; the
    EOS that ends the completion shows only with include_stop_str_in_output too."""
    free = free_run(llm)
    ascii = [i for i, t in enumerate(free) if 33 <= t < 127]
    a = ascii[0]
    b = next(i for i in ascii if i > a and free.index(free[i]) == i)  # its first time
    one, eos = free[a], free[b]
    assert one != eos and 2 not in free[: b + 1]
    tok = byte_tokenizer_with_specials([one, eos], eos=eos)
    special = LLM(params, tokenizer=tok, max_num_batched_tokens=16, **GEOMETRY)
    ids = tok.encode(PROMPT)
    gen = free[: b + 1]  # ends on the special EOS

    def run(**kw):
        (o,) = special.generate([PROMPT], greedy(**kw))
        return o.outputs[0]

    def text(ids_, skip):
        return tok.decode(ids_, skip_special_tokens=skip, context=ids)

    shown = run(skip_special_tokens=False)
    assert (shown.token_ids, shown.stop_reason) == (gen, eos)
    assert shown.text == text(gen[:-1], False) and chr(one) in shown.text
    hidden = run()
    assert hidden.token_ids == gen and hidden.text == text(gen, True)
    assert chr(one) not in hidden.text and hidden.text != shown.text
    assert run(skip_special_tokens=False, include_stop_str_in_output=True).text == text(gen, False)
    assert run(include_stop_str_in_output=True).text == hidden.text  # EOS's text: none
    for include in (False, True):  # serve.py's stream adds up to the same texts
        body = dict(skip_special_tokens=False, include_stop_str_in_output=include)
        pieces, c = stream(special, body)
        assert "".join(pieces) == c.text == text(gen if include else gen[:-1], False)
    # A stop string that only the shown text has.
    stop = chr(one)
    c = run(skip_special_tokens=False, stop=[stop])
    assert (c.token_ids, c.stop_reason, c.text) == (free[: a + 1], stop, text(free[:a], False))
    c = run(stop=[stop])
    assert (c.token_ids, c.stop_reason) == (gen, eos)  # never matched: ran to the EOS


# ------------------------------------------------------------------ max_tokens=None


def test_max_tokens_none_runs_to_max_model_len(llm):
    prompt = [5, 6, 7, 8, 9]
    room = llm.max_model_len - len(prompt)
    sp = SamplingParams(max_tokens=None, ignore_eos=True, n=2, seed=1)
    (out,) = llm.generate([prompt], sp)
    assert [(len(c.token_ids), c.finish_reason) for c in out.outputs] == [(room, "length")] * 2
    beam = SamplingParams(max_tokens=None, ignore_eos=True, beam_width=2)
    (out,) = llm.generate([prompt], beam)
    assert [(len(c.token_ids), c.finish_reason) for c in out.outputs] == [(room, "length")]
    # min_tokens is not bounded by a max_tokens of None (the length limit still ends it).
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=None, min_tokens=100))
    assert len(out.outputs[0].token_ids) == room
    assert SamplingParams().max_tokens == 16
    # Each sequence may run to max_model_len: a cache too small for n of them says so.
    small = LLM(
        llm.params, max_num_batched_tokens=16, max_model_len=32, **GEOMETRY | dict(num_pages=6)
    )
    with pytest.raises(ValueError, match=r"lower max_tokens \(max_tokens=None runs each"):
        small.generate([prompt], SamplingParams(max_tokens=None, n=2))


# ------------------------------------------------------------ truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    rng = np.random.default_rng(4)
    long = rng.integers(3, 256, size=40).tolist()  # longer than max_model_len=32
    with pytest.raises(ValueError, match="40 tokens"):
        llm.generate([long], greedy(4))
    (plain,) = llm.generate([long[-17:]], greedy(4))
    (cut,) = llm.generate([long], greedy(4, truncate_prompt_tokens=17))
    assert cut.prompt_token_ids == long[-17:] and cut.prompt is None
    assert cut.outputs[0].token_ids == plain.outputs[0].token_ids
    assert cut.num_cached_tokens == 16  # the kept tokens' full pages hit plain's cache
    rid = llm.add_request(long, greedy(2, truncate_prompt_tokens=3))
    (out,) = [o for _ in range(8) for o in llm.step() if o.request_id == rid]
    assert out.prompt_token_ids == long[-3:]
    (short,) = llm.generate([long[:5]], greedy(2, truncate_prompt_tokens=30))
    assert short.prompt_token_ids == long[:5]  # shorter than k: as it is


def test_truncate_prompt_tokens_minus_one_is_max_model_len(llm):
    """vLLM's -1: k = max_model_len (32). A shorter prompt runs whole; a longer one, cut to
    32 tokens, leaves no room to generate and is refused, as with k = 32, before any runs."""
    long = np.random.default_rng(5).integers(3, 256, size=40).tolist()
    params = [greedy(1), greedy(1, truncate_prompt_tokens=-1)]
    whole, cut = llm.generate([long[:31], long[:31]], params)
    assert cut.prompt_token_ids == whole.prompt_token_ids == long[:31]
    assert cut.outputs[0].token_ids == whole.outputs[0].token_ids
    for k in (-1, 32):
        words = f"prompt 1: prompt has 32 tokens after truncate_prompt_tokens={k}; max_model_len=32"
        with pytest.raises(ValueError, match=words):
            llm.generate([long[:5], long], [greedy(1), greedy(1, truncate_prompt_tokens=k)])
    assert not llm.has_unfinished_requests()


def test_a_text_prompt_keeps_its_bos_when_truncated(params):
    """As HF's left truncation (vLLM's) keeps the special tokens the tokenizer adds: the
    BOS, then the last k - 1 tokens of the text."""
    hf = resources.byte_tokenizer().tokenizer
    tok = Tokenizer(hf, bos_token_id=1, eos_token_ids=[2], add_bos=True)
    llm = LLM(params, tokenizer=tok, max_num_batched_tokens=16, **GEOMETRY)
    text = "hello world"
    assert tok.encode(text) == [1, *text.encode()]
    (out,) = llm.generate([text], greedy(2, truncate_prompt_tokens=4))
    assert out.prompt_token_ids == [1, *b"rld"] and out.prompt == text
    (out,) = llm.generate([text], greedy(2, truncate_prompt_tokens=1))
    assert out.prompt_token_ids == [1]
    (out,) = llm.generate([[1, *text.encode()]], greedy(2, truncate_prompt_tokens=4))
    assert out.prompt_token_ids == list(b"orld")  # ids are taken as they are


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens=0"),
        (dict(truncate_prompt_tokens=-2), r"-1 \(max_model_len\) or an int >= 1, got .*=-2"),
        (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens=True"),
        (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens=2.0"),
        (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens=1.5"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(max_tokens="8"), "max_tokens='8'"),
        (dict(skip_special_tokens="no"), "skip_special_tokens='no'"),
        (dict(skip_special_tokens=None), "skip_special_tokens=None"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output=1"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens=5, max_tokens=4"),
    ],
)
def test_bad_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_are_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="prompt 1: truncate_prompt_tokens=33 is more than max"):
        llm.generate([[5, 6], [5, 6]], [greedy(2), greedy(2, truncate_prompt_tokens=33)])
    with pytest.raises(TypeError, match="prompt 1: sampling params must be a SamplingParams"):
        llm.generate([[5, 6], [5, 6]], [greedy(2), dict(max_tokens=2)])
    assert not llm.has_unfinished_requests()
    p = SamplingParams(include_stop_str_in_output=np.bool_(True), skip_special_tokens=np.bool_(0))
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (True, False)
    assert type(p.skip_special_tokens) is bool
    assert dataclasses.replace(p, truncate_prompt_tokens=np.int64(3)).truncate_prompt_tokens == 3


# ------------------------------------------------------------------- prompt dicts


def test_prompt_dicts_as_vllm(llm):
    """vLLM's TextPrompt and TokensPrompt are prompts (a lone one too), and their
    cache_salt is the request's."""
    ids = llm.encode(PROMPT)[1]
    want = [o.outputs[0].token_ids for o in llm.generate([PROMPT, ids], greedy(4))]
    outs = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}], greedy(4))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.prompt for o in outs] == [PROMPT, None]
    # A TokensPrompt's text (vLLM's "prompt" beside the ids) is the output's prompt.
    (told,) = llm.generate({"prompt_token_ids": ids, "prompt": "given"}, greedy(4))
    assert (told.prompt, told.prompt_token_ids, told.outputs[0].token_ids) == (
        "given",
        ids,
        want[1],
    )
    (one,) = llm.generate({"prompt": PROMPT}, greedy(4))
    assert one.outputs[0].token_ids == want[0] and one.num_cached_tokens > 0
    salted = {"prompt": PROMPT, "cache_salt": "x"}
    first, again = (llm.generate(salted, greedy(4))[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, one.num_cached_tokens)
    rid = llm.add_request({"prompt_token_ids": ids, "cache_salt": "y"}, greedy(2))
    (out,) = [o for _ in range(8) for o in llm.step() if o.request_id == rid]
    assert out.num_cached_tokens == 0 and out.prompt_token_ids == ids
    with pytest.raises(ValueError, match="prompt 1: the prompt dict's cache_salt='x' differs"):
        llm.generate([PROMPT, salted], greedy(2, cache_salt="z"))
    with pytest.raises(TypeError, match="prompt 0: a prompt dict's keys"):
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {}}], greedy(2))
    assert not llm.has_unfinished_requests()


# ---------------------------------------------------- detokenize, clone, get_tokenizer


def test_detokenize_false_leaves_text_empty_and_tokens_alone(llm):
    (plain,) = llm.generate([PROMPT], greedy(6, logprobs=1))
    (bare,) = llm.generate([PROMPT], greedy(6, logprobs=1, detokenize=False))
    c, b = plain.outputs[0], bare.outputs[0]
    assert c.text and b.text == "" and b.token_ids == c.token_ids
    for e, f in zip(b.logprobs, c.logprobs, strict=True):  # (b's prompt: a cache hit)
        assert list(e) == list(f) and list(e.values()) == pytest.approx(list(f.values()), 1e-5)
    assert all(x.decoded_token is None and x.rank >= 1 for e in b.logprobs for x in e.values())
    assert all(x.decoded_token is not None for e in c.logprobs for x in e.values())
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a bool, got detokenize=0"):
        SamplingParams(detokenize=0)


def test_clone_and_get_tokenizer_as_vllm(llm):
    sp = greedy(3, stop=["x"])
    assert sp.clone() == sp and sp.clone() is not sp
    assert llm.get_tokenizer() is llm.tokenizer is not None


# ------------------------------------------------------------------ seed


def test_a_seed_draws_the_same_tokens_whatever_the_batch(llm):
    """A seeded request's tokens depend on its seed and params only: alone, or among
    other requests (greedy, penalised, biased, truncating, unseeded, one with the same
    seed) at any position, with asynchronous steps or not. Its n samples differ from each
    other; sample 0 is the request with n=1."""
    probe = SamplingParams(
        n=2, temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, seed=4242, max_tokens=10
    )
    probe = dataclasses.replace(probe, ignore_eos=True)
    (alone,) = llm.generate([PROMPT], probe)
    want = [c.token_ids for c in alone.outputs]
    assert len(want[0]) == 10 and want[0] != want[1]
    (one,) = llm.generate([PROMPT], dataclasses.replace(probe, n=1))
    assert one.outputs[0].token_ids == want[0]
    penalised = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    others = [
        greedy(12),
        SamplingParams(temperature=1.0, seed=1, max_tokens=9, **penalised),
        SamplingParams(temperature=0.7, top_p=0.5, max_tokens=14, logit_bias={7: 5.0}),
        SamplingParams(n=3, temperature=1.5, top_k=3, seed=4242, max_tokens=6),
        SamplingParams(temperature=1.0, seed=9, min_tokens=4, allowed_token_ids=range(40, 90)),
    ]
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 14, 7, 20, 11)]
    sync = LLM(
        llm.params, async_scheduling=False, max_num_batched_tokens=16, max_model_len=32, **GEOMETRY
    )
    for engine in (llm, sync):
        for at in (0, 2, len(others)):
            sps = others[:at] + [probe] + others[at:]
            outs = engine.generate(prompts[:at] + [PROMPT] + prompts[at:], sps)
            got = [c.token_ids for c in outs[at].outputs]
            assert got == want, f"async_scheduling={engine.async_scheduling}, at row {at}"
