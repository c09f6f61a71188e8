"""pagedjax/openai_api.py on its own: request bodies to Jobs (the fields, their checks and
the 400s naming them). OpenAI's answers (pagedjax/openai_responses.py) are checked in
tests/test_openai_responses.py.

No engine and no HTTP: a stand-in byte tokenizer (one token per character code,
tests/openai_api_helpers.py's). tests/test_serve.py checks the same code end to end.
"""

import pytest
from openai_api_helpers import MAX_LEN, TOK, VOCAB, job
from test_tokenizer import sentencepiece_style

from pagedjax import openai_api as api
from pagedjax import resources
from pagedjax.guided import StructuredOutputsParams
from pagedjax.lora import LoRARequest
from pagedjax.request import SamplingParams
from pagedjax.tokenizer import Tokenizer


def raises_400(fn, *args, words: str, param: str | None = None, **kwargs) -> api.ApiError:
    with pytest.raises(api.ApiError) as info:
        fn(*args, **kwargs)
    e = info.value
    assert e.status == 400 and words in e.message, e.message
    assert e.param == param, (e.param, e.message)
    assert e.body()["error"]["type"] == "invalid_request_error"
    return e


@pytest.mark.parametrize(
    "body, param, words",
    [
        (dict(temperature=-1), "temperature", "temperature=-1"),
        (dict(top_p=1.5), "top_p", "top_p=1.5"),
        (dict(top_k=-2), "top_k", "top_k=-2"),
        (dict(n=0), "n", "n=0"),
        (dict(seed="s"), "seed", "seed='s'"),
        (dict(min_tokens=-1), "min_tokens", "min_tokens=-1"),
        (dict(min_tokens=20), "min_tokens", "max_tokens=16"),
        (dict(cache_salt=5), "cache_salt", "5"),
        (dict(stop=5), "stop", "got 5"),
        (dict(stop=[""]), "stop", "stop=['']"),
        (dict(stop_token_ids="3"), "stop_token_ids", "'3'"),
        (dict(logit_bias={"x": 1}), "logit_bias", "'x'"),
        (dict(logit_bias={"256": 1}), "logit_bias", "'256'"),
        (dict(logit_bias={"5": 101}), "logit_bias", "101"),
        (dict(logit_bias=[1]), "logit_bias", "[1]"),
        (dict(logprobs=21), "logprobs", "logprobs=21"),
        (dict(logprobs=21, stream=True), "logprobs", "logprobs=21"),
        (dict(echo="yes"), "echo", "echo='yes'"),
        (dict(prompt_logprobs=21), "prompt_logprobs", "prompt_logprobs=21"),
        (dict(best_of=2), "best_of", "best_of=2"),
        (dict(suffix="b"), "suffix", "suffix='b'"),
        (dict(tools=[{}]), "tools", "tools"),
        (dict(functions=[{}]), "functions", "function calling"),
        (dict(max_tokens="9"), "max_tokens", "max_tokens='9'"),
        (dict(max_tokens=True), "max_tokens", "max_tokens=True"),
        (dict(max_tokens=0), "max_tokens", "max_tokens=0"),
        (dict(return_token_ids=1), "return_token_ids", "return_token_ids=1"),
        (dict(return_token_ids="true"), "return_token_ids", "return_token_ids='true'"),
        (dict(skip_special_tokens="no"), "skip_special_tokens", "skip_special_tokens='no'"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output", "output=1"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens", "truncate_prompt_tokens=0"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens", "tokens=-2"),
        (dict(truncate_prompt_tokens="3"), "truncate_prompt_tokens", "tokens='3'"),
        (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens", "tokens=True"),
        (dict(truncate_prompt_tokens=MAX_LEN + 1), "truncate_prompt_tokens", "max_model_len"),
        (dict(allowed_token_ids=[]), "allowed_token_ids", "allowed_token_ids=[]"),
        (dict(allowed_token_ids=[4, -1]), "allowed_token_ids", "-1 in allowed_token_ids"),
        (dict(allowed_token_ids=[4, VOCAB]), "allowed_token_ids", f"got [{VOCAB}]"),
        (dict(allowed_token_ids="3"), "allowed_token_ids", "allowed_token_ids='3'"),
        (dict(allowed_token_ids=[True]), "allowed_token_ids", "True in allowed_token_ids"),
        (dict(allowed_token_ids={"3": 1}), "allowed_token_ids", "{'3': 1}"),
        (dict(bad_words="x"), "bad_words", "bad_words='x'"),
        (dict(bad_words=["x", 5]), "bad_words", "got 5 in bad_words"),
        (dict(bad_words=[""]), "bad_words", "got '' in bad_words"),
        (dict(bad_words=["a\u0100"]), "bad_words", "'aĀ' encodes to token ids [256] outside"),
        # scripts/serve.py streams text decoded with special tokens skipped.
    ],
)
def test_bad_completion_fields_are_400s_naming_field_and_value(body, param, words):
    raises_400(job, dict(prompt="a", **body), words=words, param=param)


@pytest.mark.parametrize(
    "body, param, words",
    [
        (dict(temperature=True), "temperature", "temperature=True"),
        (dict(top_p=True), "top_p", "top_p=True"),
        (dict(seed=True), "seed", "seed=True"),
        (dict(ignore_eos="yes"), "ignore_eos", "ignore_eos='yes'"),
        (dict(stop_token_ids=[True]), "stop_token_ids", "[True]"),
        (dict(stop_token_ids=[VOCAB]), "stop_token_ids", f"[{VOCAB}]"),
        (dict(logit_bias={"²": 1}), "logit_bias", "'²'"),  # a 500: int("²") raised
        (dict(stream="false"), "stream", "stream='false'"),
        (dict(stream=True, stream_options=[1]), "stream_options", "stream_options=[1]"),
        (dict(stream=True, stream_options={"include_usage": "no"}), "stream_options", "'no'"),
        # vLLM's per-chunk usage: it was ignored (the chunks carried none).
        (
            dict(stream=True, stream_options={"continuous_usage_stats": True}),
            "stream_options",
            "continuous_usage_stats is not supported",
        ),
        (
            dict(stream=True, stream_options={"continuous_usage_stats": 1}),
            "stream_options",
            "'continuous_usage_stats': 1",
        ),
        (dict(use_beam_search=1), "use_beam_search", "use_beam_search=1"),
        (dict(model=5), "model", "model must be a string, got model=5"),  # a 404, not served
        (dict(max_tokens=MAX_LEN), "max_tokens", f"max_tokens={MAX_LEN}"),
        (dict(prompt="a" * (MAX_LEN - 8)), "max_tokens", "max_tokens=16"),
        # Completions have no max_completion_tokens (it is ignored): it was named here.
        (dict(prompt="a" * (MAX_LEN - 8), max_completion_tokens=1), "max_tokens", "tokens=16"),
    ],
)
def test_wrong_types_and_what_would_be_ignored_or_cut_are_400s(body, param, words):
    # Each was accepted: a bool as a number, a string as a flag, a field silently ignored,
    # or max_tokens silently cut to what the model's length leaves.
    raises_400(job, {"prompt": "a", **body}, words=words, param=param)


@pytest.mark.parametrize(
    "prompt, words",
    [
        (None, "prompt=None"),
        (5, "prompt=5"),
        ([], "prompt=[]"),
        ([1, "a"], "prompt=[1, 'a']"),
        ([True], "prompt=[True]"),
        ("", "prompt is empty"),
        ([[1, 2], [3, 999]], "prompt 1: "),
        ("x" * MAX_LEN, f"max_model_len={MAX_LEN}"),
    ],
)
def test_bad_prompts_are_400s(prompt, words):
    raises_400(job, dict(prompt=prompt), words=words, param="prompt")


@pytest.mark.parametrize(
    "body, param, words",
    [
        (dict(messages="hi"), "messages", "'hi'"),
        (dict(messages=[]), "messages", "non-empty list"),
        (dict(messages=["hi"]), "messages", "messages[0] must be a dict (a JSON object)"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages",
            "messages[0].content[0] has type='image_url': only text content parts",
        ),
        (dict(messages=[{"role": "user", "content": "x" * MAX_LEN}]), "messages", "max_model_len"),
        (dict(logprobs="yes"), "logprobs", "logprobs='yes'"),
        (dict(logprobs=1), "logprobs", "logprobs=1"),
        (dict(logprobs=0.0), "logprobs", "logprobs=0.0"),
        (dict(top_logprobs=2), "top_logprobs", "logprobs=true"),  # param was null
        (dict(top_logprobs=-1), "top_logprobs", "logprobs=true"),  # (-1: every token)
        (dict(top_logprobs="2", logprobs=True), "top_logprobs", "top_logprobs='2'"),
        (dict(max_completion_tokens=1.5), "max_completion_tokens", "=1.5"),
        # These were a 500 (KeyError, TypeError) or rendered as if they were strings.
        (dict(messages=[{"content": "hi"}]), "messages", "messages[0]"),
        (dict(messages=[{"role": 5, "content": "hi"}]), "messages", "role=5"),
        (dict(messages=[{"role": "user", "content": 5}]), "messages", "content=5"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            "messages",
            "'text': 5",
        ),
        (dict(logprobs=True, top_logprobs=-1), "top_logprobs", "top_logprobs=-1"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs=21"),
        (dict(max_completion_tokens=MAX_LEN), "max_completion_tokens", f"={MAX_LEN}"),
        (dict(max_tokens=MAX_LEN), "max_tokens", f"max_tokens={MAX_LEN}"),
        (dict(logprobs=False, top_logprobs=2), "top_logprobs", "logprobs=true"),
        (dict(logprobs=True, top_logprobs=True), "top_logprobs", "top_logprobs=True"),
        # It was named max_tokens (SamplingParams' name for it).
        (dict(max_completion_tokens=0), "max_completion_tokens", "max_completion_tokens=0"),
    ],
)
def test_bad_chat_fields_are_400s(body, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    raises_400(job, body, chat=True, words=words, param=param)


def test_a_model_not_served_here_is_a_404():
    """As OpenAI ("model_not_found") and vLLM ("NotFoundError") answer it; it was a 400."""
    for chat, body in [(False, dict(prompt="a")), (True, dict(messages=[{"role": "u"}]))]:
        with pytest.raises(api.ApiError) as info:
            job(dict(body, model="gpt-4"), chat=chat)
        e = info.value
        assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
        assert "'gpt-4'" in e.message and "'tiny'" in e.message
        assert e.body()["error"]["type"] == "invalid_request_error"
    assert job(dict(prompt="a", model="tiny")).prompts == [[97]]


def test_a_model_naming_a_lora_adapter_runs_with_it():
    """vLLM's --lora-modules: `model` selects an adapter by name, and answers echo it;
    the model's own name, or none, runs without one; another name is a 404 naming all."""
    loras = {"sql": LoRARequest("sql", 1, "/adapters/sql")}
    for chat, body in [(False, dict(prompt="a")), (True, dict(messages=[{"role": "u"}]))]:
        j = job(dict(body, model="sql"), chat=chat, loras=loras)
        assert (j.model, j.lora_request) == ("sql", loras["sql"])
        assert api.response_head(j, "tiny")["model"] == "sql"
        for named in ("tiny", None):
            j = job(dict(body, model=named), chat=chat, loras=loras)
            assert (j.model, j.lora_request) == (named, None)
            assert api.response_head(j, "tiny")["model"] == "tiny"
        with pytest.raises(api.ApiError) as info:
            job(dict(body, model="SQL"), chat=chat, loras=loras)
        assert info.value.status == 404
        assert info.value.message == "model 'SQL' is not served here; they are 'tiny', 'sql'"
    assert job(dict(prompt="a"), loras=loras).params == job(dict(prompt="a")).params


@pytest.mark.parametrize(
    "body, chat, logprobs",
    [
        (dict(prompt="a", best_of=1), False, None),
        (dict(prompt="a", response_format={"type": "text"}), False, None),
        # OpenAI's and vLLM's "text" asks for nothing, whatever else it holds (a 400).
        (dict(prompt="a", response_format={"type": "text", "json_schema": None}), False, None),
        # Those that OpenAI and vLLM accept; a stream's include_obfuscation is OpenAI's.
        (dict(prompt="a", stream=True, stream_options={"include_obfuscation": False}), False, None),
        (
            dict(prompt="a", stream=True, stream_options={"continuous_usage_stats": False}),
            False,
            None,
        ),
        (dict(prompt="a", logprobs=20), False, 20),
        (dict(messages=[{"role": "u"}], logprobs=True, top_logprobs=20), True, 20),
        (dict(messages=[{"role": "u"}], logprobs=True, top_logprobs=0), True, 0),
        (dict(messages=[{"role": "u"}], logprobs=False), True, None),
        # top_logprobs 0 asks for nothing: vLLM refuses only > 0 or -1 without logprobs.
        (dict(messages=[{"role": "u"}], top_logprobs=0), True, None),
        (dict(messages=[{"role": "u"}], logprobs=False, top_logprobs=0), True, None),
    ],
)
def test_documented_edges_are_accepted(body, chat, logprobs):
    assert job(body, chat=chat).params.logprobs == logprobs


def test_without_a_tokenizer_there_is_no_chat_and_no_stop_strings():
    raises_400(
        job,
        dict(messages=[{"role": "user", "content": "hi"}]),
        chat=True,
        tokenizer=None,
        words="cannot chat: no tokenizer",
    )
    raises_400(job, dict(prompt=[1, 2], stop="x"), tokenizer=None, words="tokenizer", param="stop")
    j = job(dict(prompt=[1, 2], return_token_ids=False), tokenizer=None)
    assert j.prompts == [[1, 2]]
    assert (j.token_ids, j.prompt_token_ids) == (True, False)  # the ids are all there is


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_fields_reach_the_params_and_truncate_the_prompts(chat):
    body = dict(include_stop_str_in_output=True, skip_special_tokens=False)
    prompt = dict(messages=[{"role": "user", "content": "hi"}]) if chat else dict(prompt="a")
    p = job({**prompt, **body}, chat=chat).params
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (True, False)
    p = job(dict(prompt, include_stop_str_in_output=None, skip_special_tokens=None), chat=chat)
    assert (p.params.include_stop_str_in_output, p.params.skip_special_tokens) == (False, True)
    # The last k tokens, before the length checks: a prompt too long for the model fits.
    long = "x" * (2 * MAX_LEN) + "abc"
    if chat:
        prompt = dict(messages=[{"role": "user", "content": long}])
        whole = TOK.encode_chat(prompt["messages"])
    else:
        prompt, whole = dict(prompt=[long, "wxyz"]), TOK.encode(long)
    raises_400(
        job, prompt, chat=chat, words="max_model_len", param="messages" if chat else "prompt"
    )
    j = job(dict(prompt, truncate_prompt_tokens=3), chat=chat)
    assert j.params.truncate_prompt_tokens == 3  # (the engine's cut of 3 ids is none)
    assert j.prompts == ([whole[-3:]] if chat else [whole[-3:], TOK.encode("xyz")])
    if chat:  # chat's default max_tokens fills what the kept prompt leaves
        assert j.params.max_tokens == MAX_LEN - 3
    else:
        ids = [[5, 6, 7, 8], [9] * (2 * MAX_LEN)]
        assert job(dict(prompt=ids, truncate_prompt_tokens=2)).prompts == [[7, 8], [9, 9]]


def test_a_truncated_text_prompt_keeps_the_bos_its_tokenizer_adds():
    tok = Tokenizer(sentencepiece_style(), bos_token_id=1, eos_token_ids=[2], add_bos=True)
    whole = tok.encode("the hello world")
    assert whole[0] == 1 and len(whole) > 4
    sizes = dict(model_name="m", tokenizer=tok, vocab_size=tok.vocab_size, max_model_len=MAX_LEN)
    for prompt, want in (("the hello world", [1, *whole[-2:]]), (whole, whole[-3:])):
        j = api.parse_job(dict(prompt=prompt, truncate_prompt_tokens=3), chat=False, **sizes)
        assert j.prompts == [want]  # (ids are taken as they are)


def test_allowed_token_ids_and_bad_words_reach_the_params():
    body = dict(prompt="a", allowed_token_ids=[5, 3], bad_words=["ab", " c"])
    params = job(body).params
    assert params == SamplingParams(allowed_token_ids=(5, 3), bad_words=("ab", " c"))
    for body in (dict(allowed_token_ids=None, bad_words=None), dict(bad_words=[])):
        p = job(dict(prompt="a", **body)).params
        assert (p.allowed_token_ids, p.bad_words) == (None, None)
    e = raises_400(
        job, dict(prompt=[1], bad_words=["x"]), tokenizer=None, words="need a tokenizer",
        param="bad_words",
    )  # fmt: skip
    assert e.message == "bad_words need a tokenizer; this model has none"
    assert job(dict(prompt=[1], allowed_token_ids=[7]), tokenizer=None).params.allowed_token_ids


def test_structured_outputs_come_from_response_format_and_vllms_fields():
    so = StructuredOutputsParams
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    byte = resources.byte_tokenizer()  # (a guide needs a real tokenizer's bytes)
    for body, want in (
        (dict(response_format={"type": "text"}), None),
        (dict(response_format={"type": "json_object"}), so(json_object=True)),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": schema}}),
            so(json=schema),
        ),
        (dict(structured_outputs={"regex": "a+", "whitespace_pattern": " "}),
         so(regex="a+", whitespace_pattern=" ")),
        (dict(guided_choice=["yes", "no"]), so(choice=("yes", "no"))),
        (dict(guided_json=schema, guided_whitespace_pattern="[ ]*"),
         so(json=schema, whitespace_pattern="[ ]*")),
    ):  # fmt: skip
        assert job(dict(body, prompt="a"), tokenizer=byte).params.structured_outputs == want
    for body, param, words in (
        (dict(response_format={"type": "json_schema"}), "response_format", "json_schema"),
        (dict(response_format={"type": "xml"}), "response_format", "'xml'"),
        (dict(response_format="json"), "response_format", "'json'"),
        (dict(structured_outputs="a+"), "structured_outputs", "'a+'"),
        (dict(structured_outputs={"type": "text"}), "structured_outputs", "'type'"),
        (dict(structured_outputs={"regex": "(a"}), "structured_outputs", "(a"),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "one of"),
        (dict(structured_outputs={"pattern": "a"}), "structured_outputs", "pattern"),
        (dict(guided_json={"type": "object", "minProperties": 1}), "guided_json", "minProperties"),
        (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "not several"),
    ):
        raises_400(job, dict(body, prompt="a"), tokenizer=byte, param=param, words=words)
    raises_400(
        job, dict(prompt=[1], guided_regex="a"), tokenizer=None, param="guided_regex",
        words="need a tokenizer",
    )  # fmt: skip


def test_return_token_ids_asks_for_the_ids():
    j = job(dict(prompt="a"))
    assert (j.token_ids, j.prompt_token_ids) == (False, False)
    j = job(dict(prompt="a", return_token_ids=True))
    assert (j.token_ids, j.prompt_token_ids) == (True, True)
    j = job(dict(prompt=[1, 2], return_token_ids=True), tokenizer=None)
    assert (j.token_ids, j.prompt_token_ids) == (True, True)


def test_a_completion_body_becomes_its_job():
    body = dict(prompt=["ab", "c"], n=2, top_k=-1, seed=3, stop="x", stream=True)
    body.update(stream_options={"include_usage": True}, logit_bias={"65": -100, "66": 2.5})
    j = job(body)
    assert j.prompts == [[97, 98], [99]] and not j.chat and j.stream and j.include_usage
    assert j.params == SamplingParams(
        n=2, top_k=0, seed=3, stop=("x",), max_tokens=16, logit_bias={65: -100, 66: 2.5}
    )
    assert j.rids == [f"{j.id}-0", f"{j.id}-1"] and len(set(job(body).rids) & set(j.rids)) == 0
    assert job(dict(prompt=[[1], [2, 3]])).prompts == [[1], [2, 3]]
    # stream_options only with a stream, as OpenAI and vLLM answer; null or {} pass (vLLM).
    for opts in (None, {}):
        assert not job(dict(prompt="a", stream_options=opts)).include_usage
    with pytest.raises(api.ApiError, match=r"stream_options needs stream=true, got stream_opt"):
        job(dict(prompt="a", stream_options={"include_usage": True}))


def test_a_chat_body_becomes_its_job():
    parts = [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]
    messages = [{"role": "system", "content": None}, {"role": "user", "content": parts}]
    j = job(dict(messages=messages, logprobs=True), chat=True)
    (ids,) = j.prompts
    assert TOK.decode(ids) == "<system>\n<user>two\nparts\n<assistant>"
    assert j.params.max_tokens == MAX_LEN - len(ids)  # up to the model's length
    assert j.params.logprobs == 0  # logprobs without top_logprobs: the sampled token only
    body = dict(messages=messages, max_tokens=5, max_completion_tokens=7, top_logprobs=3)
    j = job(dict(body, logprobs=True), chat=True)
    assert (j.params.max_tokens, j.params.logprobs) == (7, 3)


def test_chat_can_continue_the_last_message_or_leave_the_turn_closed():
    """vLLM's chat extensions: continue_final_message (add_generation_prompt then
    defaults to false) and add_generation_prompt; they were ignored."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    render = lambda **kw: TOK.decode(job(dict(messages=messages, **kw), chat=True).prompts[0])  # noqa: E731
    assert render() == "<user>hi\n<assistant>Sure\n<assistant>"
    assert render(continue_final_message=True) == "<user>hi\n<assistant>Sure"
    assert render(add_generation_prompt=False) == "<user>hi\n<assistant>Sure\n"
    both = dict(continue_final_message=True, add_generation_prompt=True)
    raises_400(
        job, dict(messages=messages, **both), chat=True, words="continue_final", param="messages"
    )
    for name in ("continue_final_message", "add_generation_prompt"):
        bad = dict(messages=messages, **{name: "yes"})
        raises_400(job, bad, chat=True, words=f"{name} must be a boolean", param=name)


def test_chat_template_kwargs_are_template_variables_that_override_the_request():
    """vLLM's chat_template_kwargs (e.g. Qwen3's enable_thinking) reach the template and
    override the request's own settings, as vLLM merges them; they were ignored."""
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
        "{% if enable_thinking is false %}<no-think>{% endif %}"
    )
    tok = Tokenizer(resources.byte_tokenizer().tokenizer, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]

    def render(**kw):
        return tok.decode(api.chat_prompt(dict(messages=messages, **kw), tok, "x"))

    assert render() == "<user>hi\n<assistant>"
    assert (
        render(chat_template_kwargs={"enable_thinking": False}) == "<user>hi\n<assistant><no-think>"
    )
    assert render(chat_template_kwargs=None) == "<user>hi\n<assistant>"
    kw = dict(add_generation_prompt=True, chat_template_kwargs={"add_generation_prompt": False})
    assert render(**kw) == "<user>hi\n"
    for bad, words in [
        (["enable_thinking"], "chat_template_kwargs must be an object"),
        ({"messages": []}, "chat_template_kwargs cannot set 'messages'"),
        ({"chat_template": "{{ 1 }}"}, "cannot set 'chat_template'"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt must be a boolean"),
    ]:
        with pytest.raises(api.ApiError, match=words) as e:
            render(chat_template_kwargs=bad)
        assert e.value.status == 400


def test_int_field():
    assert api.int_field({}, "k", 4) == 4 and api.int_field({"k": None}, "k", 4) == 4
    assert api.int_field({"k": 0}, "k", 4) == 0
    raises_400(api.int_field, {"k": 2.0}, "k", 4, words="k must be an int, got k=2.0", param="k")


def test_api_error_body():
    e = api.ApiError(503, "down")
    assert e.body() == dict(error=dict(message="down", type="server_error", param=None, code=None))
    # A 501 answers what the client asked for (an unknown method, a Transfer-Encoding).
    assert api.ApiError(501, "no").body()["error"]["type"] == "invalid_request_error"


def test_an_explicit_null_max_tokens_fills_each_prompts_room():
    """As vLLM's completions: max_tokens null (not left out: 16) is the room each prompt
    leaves, capped by the checkpoint's max_tokens; it is never a too-long 400."""
    long = "a" * (MAX_LEN - 8)
    j = job(dict(prompt=["hi", long], max_tokens=None))
    assert j.params.max_tokens is None
    assert job(dict(prompt="hi")).params.max_tokens == 16
    kw = dict(chat=False, model_name="tiny", tokenizer=TOK, vocab_size=VOCAB, max_model_len=MAX_LEN)
    body = dict(prompt=long, max_tokens=None)
    assert api.parse_job(body, **kw, defaults=dict(max_tokens=20)).params.max_tokens == 20
    raises_400(job, dict(prompt=long), words="max_tokens=16", param="max_tokens")


@pytest.mark.parametrize("chat", [False, True])
def test_truncate_prompt_tokens_minus_one_is_max_model_len(chat):
    """vLLM's -1 is k = max_model_len: a shorter prompt is kept whole, a longer one cut to
    max_model_len tokens leaves no room to generate (a 400, as with k = max_model_len);
    another negative, 0, a bool or a float is a 400 naming it, and that -1 is allowed."""
    where = "messages" if chat else "prompt"

    def body(text, **kw):
        return (
            dict(messages=[{"role": "user", "content": text}], **kw)
            if chat
            else dict(prompt=text, **kw)
        )

    def ids(text):
        return TOK.encode_chat(body(text)["messages"]) if chat else TOK.encode(text)

    short = "ab" * 10
    j = job(body(short, truncate_prompt_tokens=-1), chat=chat)
    assert j.prompts == [ids(short)] and j.params.truncate_prompt_tokens == -1
    assert j.prompts == job(body(short, truncate_prompt_tokens=MAX_LEN), chat=chat).prompts
    if chat:  # the default max_tokens fills what the prompt leaves
        assert j.params.max_tokens == MAX_LEN - len(ids(short))
    long = "x" * (2 * MAX_LEN) + "abc"
    for k in (-1, MAX_LEN):
        words = f"prompt has {MAX_LEN} tokens after truncate_prompt_tokens={k}; max_model_len"
        raises_400(job, body(long, truncate_prompt_tokens=k), chat=chat, words=words, param=where)
    # Which ids -1 keeps, the last MAX_LEN: one outside the vocabulary ("\u0100" = 256)
    # is refused (before the length check) only if it is kept.
    seen = set()
    for i in range(len(long) - MAX_LEN - 16, len(long)):
        text = long[:i] + "\u0100" + long[i + 1 :]
        kept = len(ids(text)) - ids(text).index(VOCAB) <= MAX_LEN
        words = f"ids [{VOCAB}] are outside" if kept else f"prompt has {MAX_LEN} tokens after"
        raises_400(job, body(text, truncate_prompt_tokens=-1), chat=chat, words=words, param=where)
        seen.add(kept)
    assert seen == {False, True}
    for bad in (-2, -MAX_LEN, 0, True, 1.5, -1.0):
        words = f"None, -1 (max_model_len) or an int >= 1, got truncate_prompt_tokens={bad!r}"
        kw = dict(words=words, param="truncate_prompt_tokens")
        raises_400(job, body(short, truncate_prompt_tokens=bad), chat=chat, **kw)


def test_a_seed_is_any_64_bit_int_as_openai_and_vllm_take_it():
    """OpenAI's and vLLM's seed is any int64 (a 400 here: the engine's are in [0, 2**32));
    one outside that range is taken modulo 2**32, so it still fixes the draws. -1 is no
    seed, as vLLM's SamplingParams reads it (it was seed 2**32 - 1)."""
    for seed, want in ((-1, None), (-2, 2**32 - 2), (2**40 + 7, 7), (-(2**63), 0), (5, 5)):
        assert job(dict(prompt="a", seed=seed)).params.seed == want
    raises_400(job, dict(prompt="a", seed=2**63), words=f"seed={2**63}", param="seed")
    raises_400(job, dict(prompt="a", seed=1.0), words="seed=1.0", param="seed")
