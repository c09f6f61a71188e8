"""pagedjax.engine's request API: request ids, abort, add_request/step beside generate,
seeds, SamplingParams and requests refused before anything runs, EOS ids, stop strings
and tokens, text prompts and completion text, cache salts, and chat. Outputs are checked
against the dense no-cache reference, in tests/test_engine.py's geometry
(tests/engine_helpers.py).
"""

import dataclasses
import warnings

import numpy as np
import pytest
from engine_helpers import GEOMETRY, PAGES, PS, Dense, check_clean, greedy, random_params

from pagedjax import openai_api, resources
from pagedjax.engine import LLM, SamplingParams
from pagedjax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def params():
    return random_params()


@pytest.fixture(scope="module")
def dense(params):
    return Dense(params)


def test_abort_frees_everything(params, dense):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (12, 20, 7, 15)]
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    ids = [llm.add_request(p, greedy(30, ignore_eos=True)) for p in prompts]
    outs = {ids[3]: llm.abort(ids[3])}  # before it ever ran
    count = {}

    def on_token(rid, index, tok):
        count[rid] = count.get(rid, 0) + 1
        if rid == ids[1] and count[rid] == 5:
            outs[rid] = llm.abort(rid)  # mid-step: between scheduling and committing

    steps = 0
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step(on_token=on_token))
        steps += 1
        if steps == 4:
            outs[ids[0]] = llm.abort(ids[0])  # between steps
    assert llm.abort(ids[0]) is None
    want = dense.greedy(prompts, 30, stop_ids=())
    got = [outs[i].outputs[0] for i in ids]
    assert [c.finish_reason for c in got] == ["abort", "abort", "length", "abort"]
    assert 0 < len(got[0].token_ids) < 30 and got[0].token_ids == want[0][: len(got[0].token_ids)]
    assert got[1].token_ids == want[1][:5]
    assert got[2].token_ids == want[2]
    assert got[3].token_ids == []
    assert all(outs[i].finished for i in ids)  # (an aborted request: its last output)
    check_clean(llm)


def test_an_n_sample_request_aborted_before_it_ran_aborts_every_sample(params):
    """Samples not yet forked from sample 0 (they fork after the prompt's prefill) are
    aborted too: n completions, each "abort", none generated."""
    llm = LLM(params, **GEOMETRY)
    rid = llm.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=4, seed=1))
    out = llm.abort(rid)
    got = [(c.index, c.token_ids, c.finish_reason) for c in out.outputs]
    assert got == [(0, [], "abort"), (1, [], "abort"), (2, [], "abort")]
    assert out.finished is True and llm.abort(rid) is None
    check_clean(llm)


def test_add_request_outputs_finished_inside_generate_come_from_the_next_step(params, dense):
    """A request queued with add_request that finishes while a generate() runs is not
    lost (it was: generate dropped it, and has_unfinished_requests() said False)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    short, long = [5, 6, 7, 8], [9, 10, 11]
    rid = llm.add_request(short, greedy(2, ignore_eos=True))
    (out,) = llm.generate([long], greedy(12, ignore_eos=True))
    assert out.outputs[0].token_ids == dense.greedy([long], 12, stop_ids=())[0]
    assert llm.has_unfinished_requests()  # an output left for step() to return
    (other,) = llm.step()
    assert other.request_id == rid and other.finished
    assert other.outputs[0].token_ids == dense.greedy([short], 2, stop_ids=())[0]
    assert not llm.has_unfinished_requests() and llm.step() == []
    check_clean(llm)


def test_request_ids_given_and_drawn_never_collide(params):
    """generate()'s own ids skip those add_request was given (the counter's next id was
    refused as "already queued or running"); abort finds an int id as add_request
    stored it, as a str (abort(7) returned None and the request ran on)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    (first,) = llm.generate([[5, 6]], greedy(1))
    nxt = str(int(first.request_id) + 1)
    assert llm.add_request([5, 6, 7], greedy(30), request_id=nxt) == nxt
    (out,) = llm.generate([[5, 6]], greedy(1))
    assert out.request_id != nxt and out.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.add_request([5, 6, 7], greedy(30), request_id=7) == "7"
    assert llm.abort(7).request_id == "7" and llm.abort(int(nxt)).request_id == nxt
    assert llm.abort(7) is None
    assert llm.step() == []  # the step still in flight
    check_clean(llm)


def test_an_id_of_a_running_generate_call_is_refused(params, dense):
    """add_request (here from on_step) with the id of a running generate call's request
    that already finished is refused: it was queued, its output replaced the call's
    (generate returned another prompt's completion) and no step() returned it."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompts = [[5, 6, 7], [9, 10, 11]]
    refused = []

    def on_step(engine):
        if engine.metrics.num_steps == 3:  # prompt 0 ("0", one token) has finished
            try:
                engine.add_request([20, 21, 22, 23], greedy(1), request_id="0")
            except ValueError as e:
                refused.append(str(e))

    outs = llm.generate(prompts, [greedy(1), greedy(8, ignore_eos=True)], on_step=on_step)
    assert [o.request_id for o in outs] == ["0", "1"]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert refused == ["request id '0' belongs to a running generate() call"]
    assert outs[0].outputs[0].token_ids == dense.greedy([prompts[0]], 1)[0]
    assert llm.step() == []
    # Once the call returned, its ids are free again.
    assert llm.add_request([20, 21, 22, 23], greedy(1), request_id="0") == "0"
    (again,) = [o for _ in range(4) for o in llm.step()]
    assert again.request_id == "0" and again.prompt_token_ids == [20, 21, 22, 23]
    check_clean(llm)


def test_a_refused_request_draws_no_seed(params):
    """Requests without a seed draw theirs from the engine's seed in the order they are
    queued; a refused one (too many pages, an id in use, a generate call refused at its
    second prompt) draws none (each did: every later request sampled differently)."""
    sp = SamplingParams(temperature=1.0, max_tokens=3)

    def seeds(llm, n):
        rids = [llm.add_request([5, 6], sp) for _ in range(n)]
        return [llm.scheduler.get(r).seqs[0].seed for r in rids]

    want = seeds(LLM(params, **GEOMETRY), 3)
    assert seeds(LLM(params, seed=1, **GEOMETRY), 3) != want
    llm = LLM(params, **GEOMETRY)
    too_big = SamplingParams(max_tokens=500, n=2)
    with pytest.raises(ValueError, match="KV pages"):
        llm.add_request([5] * 100, too_big)
    rid = llm.add_request([5, 6], sp)
    with pytest.raises(ValueError, match="already queued or running"):
        llm.add_request([5, 6], sp, request_id=rid)
    with pytest.raises(ValueError, match="prompt 1: .*KV pages"):
        llm.generate([[5, 6], [5] * 100], [sp, too_big])
    assert [llm.scheduler.get(rid).seqs[0].seed, *seeds(llm, 2)] == want


def test_cache_salt_separates_prefix_caches(params):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    prompt = np.random.default_rng(3).integers(3, 256, size=33).tolist()
    llm.generate([prompt], greedy(3, cache_salt="alice"))
    pages = {}

    def on_step(engine):
        for g in engine.scheduler.running:
            salt = g.cache_salt
            if g.seqs and g.seqs[0].num_admitted:
                pages[salt] = set(engine.block_manager.page_table(g.seqs[0].seq_id))
        if len(pages) == 2:
            assert not pages["bob"] & pages["alice"]

    bob, alice = llm.generate(
        [prompt, prompt],
        [greedy(3, cache_salt="bob"), greedy(3, cache_salt="alice")],
        on_step=on_step,
    )
    assert set(pages) == {"bob", "alice"}
    assert bob.num_cached_tokens == 0 and alice.num_cached_tokens == 32
    assert bob.outputs[0].token_ids == alice.outputs[0].token_ids
    check_clean(llm)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n=0), "n=0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(top_k=-2), "top_k=-2"),
        (dict(top_k=-1.0), "top_k=-1.0"),
        (dict(min_p=1.01), "min_p=1.01"),
        (dict(min_p=True), "min_p=True"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(seed=-3), "seed=-3"),
        (dict(seed=-1.0), "seed=-1.0"),
        (dict(beam_width=2, n=3), "n=3"),
        (dict(stop=[""]), r"stop=\[''\]"),
        (dict(length_penalty=float("nan")), "length_penalty=nan"),
        # (-1: the whole vocabulary; the cap is the engine's: tests/test_max_logprobs.py)
        (dict(logprobs=-2), "logprobs must be None, an int >= 0 or -1 .*got logprobs=-2"),
        (dict(logprobs=True), "got logprobs=True"),
        (dict(logprobs=2.0), "got logprobs=2.0"),
        (dict(prompt_logprobs=-2), "got prompt_logprobs=-2"),
        (dict(prompt_logprobs="3"), "prompt_logprobs must be None, an int >= 0 or -1"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_take_vllms_minus_one_for_off():
    # vLLM's SamplingParams take top_k=-1 for "off" and seed=-1 for "no seed".
    p = SamplingParams(top_k=-1, seed=-1)
    assert (p.top_k, p.seed) == (0, None)
    assert SamplingParams(top_k=np.int64(-1), seed=np.int32(-1)) == SamplingParams()
    assert dataclasses.replace(SamplingParams(top_k=5, seed=3), top_k=-1, seed=-1) == p
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(beam_width=2, top_k=4)
    assert SamplingParams(beam_width=2, top_k=-1).top_k == 0


def test_bad_requests_fail_before_anything_runs(params):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate([[5, 6], []], greedy(2))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], greedy(2))
    with pytest.raises(ValueError, match="512 tokens"):
        llm.generate([[5] * 512], greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 300]], greedy(2))
    with pytest.raises(ValueError, match="KV pages"):  # could never fit in 64 pages
        llm.generate([[5] * 100], SamplingParams(max_tokens=500, n=2))
    assert not llm.has_unfinished_requests()
    # Refused while queueing, after prompt 0 was queued: all or none, prompt 0 unqueued.
    with pytest.raises(ValueError, match="prompt 1: .*KV pages"):
        llm.generate([[5, 6], [5] * 100], [greedy(2), SamplingParams(max_tokens=500, n=2)])
    assert not llm.has_unfinished_requests() and not llm.step()
    # More seats than max_num_seqs: refused by _add before it builds n sequences (the
    # scheduler's refusal came after them: n=10**6 took 4 s, n=10**9 would take an hour).
    for params_, n in ((SamplingParams(n=10**6), 10**6), (SamplingParams(beam_width=9, n=2), 9)):
        with pytest.raises(ValueError, match=rf"{n} sequences at once \(n=.*max_num_seqs=8"):
            llm.add_request([5, 6], params_)
    assert not llm.has_unfinished_requests()
    with pytest.raises(ValueError, match="backend='gpu'"):
        LLM(params, page_size=PS, num_pages=PAGES, backend="gpu")
    with pytest.raises(ValueError, match="not both"):
        LLM(params, num_pages=8, kv_memory_fraction=0.5)
    for bad in (0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"):  # 0 was silently 0.8
        with pytest.raises(ValueError, match=r"kv_memory_fraction must be in \(0, 1\]"):
            LLM(params, kv_memory_fraction=bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        LLM(params, num_pages=8, backend="cuda")


def test_generate_tokenizes_each_text_prompt_once(params, monkeypatch):
    """generate() checks every prompt before queueing any, then queues the ids it checked
    (it encoded each text twice: in the check and again in add_request)."""
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)  # byte tokenizer
    prompts = ["def f(x):", "import os"]
    want = [llm.tokenizer.encode(p) for p in prompts]
    encoded = []
    encode = Tokenizer.encode

    def spy(self, text, *args, **kwargs):
        encoded.append(text)
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    outs = llm.generate([prompts[0], want[1], prompts[1]], greedy(2))
    assert encoded == [prompts[0], prompts[1]]
    assert [o.prompt for o in outs] == [prompts[0], None, prompts[1]]
    assert [o.prompt_token_ids for o in outs] == [want[0], want[1], want[1]]
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    (one,) = llm.generate(prompts[1], greedy(2))  # one text: one prompt, not its characters
    assert one.prompt == prompts[1] and one.outputs[0].token_ids == outs[2].outputs[0].token_ids
    encoded.clear()
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["ok", ""], greedy(2))
    assert encoded == ["ok"] and not llm.has_unfinished_requests()
    check_clean(llm)


def test_the_tokenizers_eos_ids_stop_as_the_models_do(params, dense):
    """A completion stops at any EOS id of the model's config or of the tokenizer (an
    instruct tokenizer often names its end-of-turn id only there); ignore_eos ignores it."""
    prompt = np.random.default_rng(5).integers(3, 256, size=6).tolist()
    free = dense.greedy([prompt], 12, stop_ids=())[0]
    k = next(i for i, t in enumerate(free) if i > 0 and t not in free[:i])
    assert 2 not in free[: k + 1]  # the model's own EOS does not stop it first
    eos = free[k]
    llm = LLM(
        params,
        tokenizer=resources.byte_tokenizer(eos_token_id=eos),
        max_num_batched_tokens=16,
        **GEOMETRY,
    )
    assert llm.eos_ids == {2, eos}
    out = llm.generate([prompt], greedy(12))[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (free[: k + 1], "stop", eos)
    out = llm.generate([prompt], greedy(12, ignore_eos=True))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free, "length")
    check_clean(llm)


def test_stop_strings_and_stop_tokens(params, dense):
    llm = LLM(params, max_num_batched_tokens=16, **GEOMETRY)  # byte tokenizer
    prompt = "def f(x):"
    ids = llm.tokenizer.encode(prompt)
    free = dense.greedy([ids], 20, stop_ids=())[0]
    j = next(i for i, t in enumerate(free) if 33 <= t < 127)  # an ASCII character
    stop = chr(free[j])
    out = llm.generate([prompt], greedy(20, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free[: free.index(free[j]) + 1]
    assert stop not in out.text
    assert out.text == llm.tokenizer.decode(free[: free.index(free[j])])
    out = llm.generate([prompt], greedy(20, stop_token_ids=[free[3]], ignore_eos=True))[0]
    assert out.outputs[0].token_ids == free[: free.index(free[3]) + 1]
    assert out.outputs[0].stop_reason == free[3]
    check_clean(llm)


def test_completion_text_reads_after_its_prompt(params):
    """With a SentencePiece-style decoder (it strips a text's leading space), a completion
    is decoded after its prompt: a first token "▁w" reads " w", as prompt + completion
    does (decoded alone it lost the space), in the final text and in the stop-string
    stream alike."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    vocab.update({c: 4 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")})
    vocab["▁w"] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab, [("▁", "w")], unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = Tokenizer(hf, bos_token_id=1, eos_token_ids=[2], add_bos=True)
    llm = LLM(params, tokenizer=tok, **GEOMETRY)
    w = vocab["▁w"]
    prompt = "hello"
    assert tok.decode([w]) == "w"  # alone: the strip
    for stop in ([], ["zz"]):  # the final text; with a stop string, the stream too
        sp = greedy(3, logit_bias={w: 100.0}, stop=stop)
        (out,) = llm.generate([prompt], sp)
        assert out.outputs[0].token_ids == [w] * 3
        assert out.outputs[0].text == " w w w"
        assert tok.decode(out.prompt_token_ids + [w] * 3) == prompt + out.outputs[0].text
    check_clean(llm)


def test_chat_renders_conversations_and_generates_from_them(params, dense):
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    byte = resources.byte_tokenizer()
    tok = Tokenizer(
        byte.tokenizer, bos_token_id=1, eos_token_ids=[2], add_bos=True, chat_template=template
    )
    llm = LLM(params, tokenizer=tok, max_num_batched_tokens=16, **GEOMETRY)
    convs = [
        [{"role": "user", "content": "def f(x):"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
    ]
    ids = [tok.encode_chat(c) for c in convs]
    assert ids[0] == tok.encode("<user>def f(x):\n<assistant>", add_bos=False)  # no BOS, as HF
    want = dense.greedy(ids, 6)
    outs = llm.chat(convs, greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.prompt_token_ids for o in outs] == ids
    assert outs[1].prompt == "<system>Be brief.\n<user>2+2=\n<assistant>"
    (one,) = llm.chat(convs[0], greedy(6))  # one conversation, not a list of them
    assert one.outputs[0].token_ids == want[0]
    bare = llm.chat(convs[0], greedy(6), add_generation_prompt=False)[0]
    assert bare.prompt == "<user>def f(x):\n"

    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(
        ValueError, match=r"conversation 1: messages\[0\].content\[0\] has type='ima"
    ):
        llm.chat([convs[0], image], greedy(2))
    for bad in ("hi", [], None):
        with pytest.raises(TypeError, match="messages must be a conversation"):
            llm.chat(bad, greedy(2))
    with pytest.raises(
        ValueError, match="tokenizer has none .this tokenizer was built without one"
    ):
        LLM(params, max_num_batched_tokens=16, **GEOMETRY).chat(convs[0])
    check_clean(llm)


def test_chat_takes_openai_messages_as_the_server_does(params):
    """LLM.chat takes what vLLM's does (its parse_chat_messages, shared with its server):
    null content, text parts, an assistant's tool calls with JSON-string arguments and
    tool results; the prompt ids are those of the server's path for the same messages."""
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function.arguments | tojson }}</call>"
        "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}|{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    byte = resources.byte_tokenizer()
    tok = Tokenizer(byte.tokenizer, bos_token_id=1, eos_token_ids=[2], chat_template=template)
    llm = LLM(params, tokenizer=tok, max_num_batched_tokens=16, **GEOMETRY)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    conv = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    (out,) = llm.chat(conv, greedy(1))
    assert out.prompt == '<user>a\nb|<assistant><call>{"x": 1}</call>|<tool>2[c1]|<assistant>'
    assert out.prompt_token_ids == openai_api.chat_prompt({"messages": conv}, tok, "completions")
    bad = [
        *conv[:1],
        {
            "role": "assistant",
            "tool_calls": [{**call, "function": {"name": "f", "arguments": "{x"}}],
        },
    ]
    with pytest.raises(
        ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not"
    ):
        llm.chat(bad, greedy(1))
    check_clean(llm)


def test_chat_takes_vllms_chat_template_and_chat_template_kwargs(params):
    # Both fell into **template_vars: a given chat_template was silently ignored (the
    # tokenizer's rendered instead, or "has no chat template"), and so were the variables
    # of chat_template_kwargs; mm_processor_kwargs was ignored without a word.
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    given = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}{% if x %}x={{ x }}{% endif %}"
    )
    byte = resources.byte_tokenizer()
    conv = [{"role": "user", "content": "def f(x):"}]
    for template in (own, None):
        tok = Tokenizer(byte.tokenizer, bos_token_id=1, eos_token_ids=[2], chat_template=template)
        llm = LLM(params, tokenizer=tok, max_num_batched_tokens=16, **GEOMETRY)
        (out,) = llm.chat(conv, greedy(1), chat_template=given)
        assert out.prompt == "<user>def f(x):<a>"
        assert out.prompt_token_ids == tok.encode_rendered(out.prompt, add_bos=False)
        (out,) = llm.chat(conv, greedy(1), chat_template=given, chat_template_kwargs={"x": 7})
        assert out.prompt == "<user>def f(x):<a>x=7"
        kw = dict(chat_template_kwargs={"x": 7}, x=3)  # a keyword wins, as a later update
        assert llm.chat(conv, greedy(1), chat_template=given, **kw)[0].prompt.endswith("x=3")
        # vLLM's update: the kwargs' add_generation_prompt wins (it was a TypeError)
        kw = dict(chat_template_kwargs={"add_generation_prompt": False})
        assert llm.chat(conv, greedy(1), chat_template=given, **kw)[0].prompt == "<user>def f(x):"
    assert llm.chat(conv, greedy(1), chat_template=own)[0].prompt == "[def f(x):]"
    with pytest.raises(TypeError, match="chat.. does not support vLLM's mm_processor_kwargs"):
        llm.chat(conv, greedy(1), chat_template=own, mm_processor_kwargs={})
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(conv, greedy(1), chat_template=own, chat_template_kwargs=["x"])
    with pytest.raises(TypeError, match="chat_template must be a str, got 5"):
        llm.chat(conv, greedy(1), chat_template=5)
    with pytest.raises(ValueError, match="tokenizer has none"):  # none given, none its own
        llm.chat(conv, greedy(1))
    check_clean(llm)


def test_add_request_times_a_request_from_its_arrival_time(params):
    """vLLM's `arrival_time` (time.time() seconds): the request's time to first token and
    latency, and the metrics', count from it; None counts from now, a time in the future
    as now; anything but a finite number is refused before anything is queued."""
    import math
    import time

    llm = LLM(params, **GEOMETRY)
    early = llm.add_request([5, 6, 7], greedy(3), arrival_time=time.time() - 5.0)
    now = llm.add_request([5, 6, 8], greedy(3))
    future = llm.add_request([5, 6, 9], greedy(3), arrival_time=time.time() + 60.0)
    outs = {}
    while llm.has_unfinished_requests():
        outs |= {o.request_id: o for o in llm.step()}
    assert 5.0 <= outs[early].ttft_s <= outs[early].latency_s < 60.0
    for rid in (now, future):
        assert 0 <= outs[rid].ttft_s <= outs[rid].latency_s < 5.0
    assert max(llm.metrics.ttfts) == outs[early].ttft_s
    assert llm.metrics.latency_hist.sum >= 5.0
    for bad in (math.nan, math.inf, -math.inf, "1.5", True, [1.0]):
        with pytest.raises(ValueError, match="arrival_time must be a finite number"):
            llm.add_request([5, 6, 7], greedy(3), arrival_time=bad)
    assert not llm.has_unfinished_requests()


def test_a_temperature_and_penalty_past_float32_run_without_a_warning(params):
    """SamplingParams take any finite temperature and repetition penalty; past
    float32's range they are +inf on the device (a uniform draw, an infinite penalty),
    and the engine's batch warned "overflow encountered in cast" at each step."""
    llm = LLM(params, **GEOMETRY)
    sp = SamplingParams(temperature=1e39, repetition_penalty=1e39, max_tokens=3, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (out,) = llm.generate([[1, 2, 3]], sp)
    assert len(out.outputs[0].token_ids) == 3
    check_clean(llm)
