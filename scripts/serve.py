"""An OpenAI-compatible HTTP server over pagedjax's engine (standard library only).

    python scripts/serve.py --checkpoint path/to/Llama-3.2-1B-Instruct --port 8000
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

Point an OpenAI client at `http://HOST:PORT/v1` (any API key). Endpoints:

    GET  /health               200 "ok"
    GET  /metrics              Prometheus text: vLLM's metrics as "pagedjax:..." with
                               its model_name label (requests running and waiting, KV
                               cache usage, token, request and preemption counters,
                               TTFT and latency histograms in its buckets)
    GET  /v1/models            the model: id = --served-model-name, else the
                               checkpoint directory's name ("pagedjax-demo" without
                               one); then each LoRA adapter (--lora-modules, or
                               loaded since) with vLLM's `parent` (the model's id)
                               and `root` (its path)
    GET  /v1/models/{id}       one of those (OpenAI's models.retrieve); 404 for another
    POST /v1/completions       prompt: a string, a list of strings, a list of token ids
                               or a list of such lists
    POST /v1/chat/completions  messages, rendered with the checkpoint's chat template
                               (or --chat-template FILE); content is a string or a list
                               of {"type": "text", "text"} parts; vLLM's
                               `continue_final_message` (continue the last message) and
                               `add_generation_prompt` (default: true, false with the
                               former), `chat_template_kwargs` (more template variables,
                               e.g. {"enable_thinking": false}; they override the
                               request's settings); function calling: `tools`, `tool_choice`,
                               `parallel_tool_calls` (see "Function calling")
    POST /tokenize             vLLM's: a `prompt` string or chat `messages` -> {count,
                               max_model_len, tokens, token_strs}; `add_special_tokens`
                               (default: true for a prompt, false for messages, whose
                               template writes them), `return_token_strs`;
                               messages' `tools` render as a chat request's do
    POST /detokenize           vLLM's: `tokens` (a list of ids) -> {prompt}, the text
                               with special tokens shown
    POST /v1/load_lora_adapter vLLM's, with --allow-runtime-lora-updating only (else
                               a 404): {"lora_name", "lora_path"} reads a LoRA
                               adapter and serves it under that name
    POST /v1/unload_lora_adapter  the same: {"lora_name"} (or vLLM's "lora_int_id")
                               stops serving one (see "Runtime LoRA updating")

Fields of both POSTs: `model` (optional: the model's id or a LoRA adapter's name, which
runs the request with that adapter and which the answer's `model` echoes; another name
is a 404 listing the served ones; /tokenize and /detokenize take it too), `max_tokens`
(default 16 for completions, null: up to the model's length, as vLLM's, 0: the prompt
alone with `echo`; for chat `max_completion_tokens` or `max_tokens`, default: up to the
model's length),
`temperature` (default 1), `top_p`, `n`, `stop` (a string or a list), `seed` (any
int64, taken modulo 2**32; -1: none, as vLLM), `presence_penalty`, `frequency_penalty`,
`stream`,
`stream_options: {"include_usage"}` (with `stream: true` only; `{}` sends no usage chunk,
as OpenAI's; `continuous_usage_stats: true` is a 400), `logit_bias` ({"token id": value
in [-100, 100]}), and
vLLM's `top_k` (-1 or 0: off), `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `min_tokens`, `cache_salt`, `include_stop_str_in_output`,
`skip_special_tokens`, `truncate_prompt_tokens` (the last K prompt tokens; -1: K = max_model_len),
`allowed_token_ids` (a list of token ids: only those can be drawn), `bad_words` (a list
of strings never generated; needs a tokenizer), structured outputs (needs a tokenizer;
one of: OpenAI's `response_format` `{"type": "json_schema", "json_schema": {"schema":
{...}}}` or `{"type": "json_object"}`, vLLM's `structured_outputs` object with
`json`, `regex`, `choice`, `grammar` or `json_object` and `whitespace_pattern` /
`disable_any_whitespace`, or its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` with `guided_whitespace_pattern`; `pagedjax.guided` says which regex,
JSON schema and grammar (GBNF, `pagedjax.grammar`) features are supported: the others
are 400s naming them), `return_token_ids` (a
boolean, as in vLLM: each choice gets `token_ids`, its generated token ids, and
completions choices `prompt_token_ids`; a chat answer has `prompt_token_ids` beside its
choices), `priority` (vLLM's: an int, default 0; with `--scheduling-policy priority`
the waiting requests are served lowest first, ties by arrival, and preemption takes the
worst running one first; under the default `fcfs`, another value than 0 is a 400).
Logprobs: completions take `logprobs: K` and
answer `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets into the
completion text; as OpenAI's, each `top_logprobs` has the K most likely tokens and the
sampled one, so K + 1 when it is not among them); chat takes `logprobs: true` with
`top_logprobs: K` and answers `{content: [{token, logprob, bytes, top_logprobs}]}` (the
K most likely only); K <= `--max-logprobs N` (default 20, else a 400 naming the field
and the cap; -1: no cap), and K = -1 (as vLLM's) lists the whole vocabulary (its size
counts against the cap); all are the model's raw log-probabilities (before
temperature and truncation). Each prompt of a completions batch is one engine request;
choice `i * n + j` is completion j of prompt i.
`finish_reason` is "stop" (EOS, a stop string or a stop token), "length", "error" (a
structured output that other constraints left no token) or chat's "tool_calls". Errors are
OpenAI's `{"error": {message, type, param, code}}`: 400 for a bad field (the message
names the value; a field of the wrong JSON type is bad), a prompt too long for
`--max-model-len` or one that leaves less room than `max_tokens` (as vLLM answers:
max_tokens is never cut short silently), bad JSON or a malformed request (a body cut
short of its length, two lengths); 404 for an unknown path or a model not served here
(code "model_not_found", as OpenAI and vLLM answer); 405 for a wrong method; 408 for a
body that stops coming; 413 for a body over 32 MiB; 500 when the engine failed; 501 for
an unknown method or Transfer-Encoding; 503 when it is not running. http.server's own
errors (a bad request line, too many headers) have that shape too. An error after a
stream has begun is its last event, `data: {"error": ...}`, followed by `data: [DONE]`
(as vLLM ends it). HEAD answers a GET path's status and headers; OPTIONS, 204 (no body,
no `Content-Length`) with the path's `Allow` methods.

Echo and prompt logprobs, as vLLM serves them (`pagedjax.openai_echo`): completions'
`echo: true` starts each choice's `text` with its prompt's (a string prompt as given; a
token id prompt, or one `truncate_prompt_tokens` cut, as its tokens' names spell it,
special tokens shown), and with `logprobs: K` its `logprobs` cover the prompt's tokens
then its own: the first prompt token's `token_logprobs` and `top_logprobs` are null,
each other's are its log-probability given the tokens before it and the K most likely
there (such a request reads nothing from the prefix cache), and `text_offset`s count
from the start of the echoed text (the completion's from the prompt text's length).
`max_tokens: 0` with echo answers the prompt alone: `finish_reason` "length", no
`token_ids`, `usage.completion_tokens` 0 (the engine runs one token, dropped; vLLM
counts it). vLLM's `prompt_logprobs: K` (-1: the whole vocabulary, within
`--max-logprobs`; above 0 with `stream: true` a 400, as vLLM's) adds `prompt_logprobs`
to each completions choice, or beside a chat answer's choices: per prompt token null
(the first) or `{"token id": {logprob, rank, decoded_token}}`, the token's own then its
K most likely; as vLLM's, echo sets K where the field is left out (completions:
`logprobs`, if given; chat: `top_logprobs`, default 0). Chat's `echo: true` starts each
choice's content with the last message's when the answer continues its role (after an
assistant message, or with `continue_final_message`); else with "". Every choice echoes
(`n`, several prompts, beam search). Streamed, a completions choice's first chunk starts
with its prompt's text (with logprobs, the prompt tokens' logprobs, the first null, as
vLLM's; the engine thread sends them once the prefill is done), then its tokens stream
as without echo, the chunks adding up to the non-streamed choice; chat's echoed
content is one chunk per choice after the role chunks; streams carry no
`prompt_logprobs`. lm-evaluation-harness's `local-completions` model scores
loglikelihood tasks this way (token id prompts, `max_tokens` 1, `logprobs` 1, echo),
its tokenizer from the checkpoint and `max_length` at most `--max-model-len`:

    ARGS=model=NAME,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=CHECKPOINT_DIR
    lm_eval --model local-completions --tasks hellaswag \\
      --model_args $ARGS,tokenizer_backend=huggingface,max_length=2048

(NAME: the served model's id; `batch_size=N` sends N prompts a request. Keep its
default token id prompts: `tokenized_requests=False` sends texts, which get the
tokenizer's BOS if it adds one, which its context lengths do not count.)

Beam search: vLLM's `use_beam_search: true` runs a beam search of width `n` (the
engine's `SamplingParams(beam_width=n, n=n)`) and answers its `n` best beams as the
choices, best first, each scored `logprob_sum / length ** length_penalty` (vLLM's
`length_penalty`, default 1; without beam search another value is a 400). `n: 1` (the
default) is greedy decoding, which vLLM's width-1 search nearly is. `max_tokens`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `logprobs` (each beam's
own tokens') and `return_token_ids` apply; `temperature` is ignored, as vLLM ignores it,
and the checkpoint's sampling defaults do not apply; stop strings, `top_k`, `top_p`,
`min_p`, `min_tokens`, the penalties, `logit_bias`, `allowed_token_ids`, `bad_words`
and structured outputs are 400s naming the field. Streamed, each choice comes whole
when the search ends: one chunk with its text (and logprobs and token ids) and its
`finish_reason`.

A checkpoint without a tokenizer (no tokenizer.json) serves completions of token id
prompts only, as vLLM with `skip_tokenizer_init`: a string prompt, chat and `stop`
strings are 400s. Its `text` is always "", so every choice carries `token_ids` (with or
without `return_token_ids`); logprobs name a token `"token_id:<id>"` in `tokens` and as
the keys of `top_logprobs`, and every `text_offset` is 0 (offsets into the empty text).

Defaults from the checkpoint: with `--generation-config auto` (the default), as vLLM
does, a field left out (or null) of `temperature`, `top_k`, `top_p`, `min_p` and
`repetition_penalty` takes the value of the checkpoint's generation_config.json, if it
has one (the startup log names them), else the default above; its `max_new_tokens`
caps a left-out `max_tokens`' default (as vLLM's does; a `max_tokens` given is not cut).
`--generation-config none` ignores the file.

Not supported (400 when asked for): `best_of` > 1, `suffix`, `tools` on
/v1/completions, the deprecated `functions` and a `function_call` naming one, a
request's own `chat_template` (vLLM's without `--trust-request-chat-template`),
`structured_outputs.structural_tag`,
`max_tokens: 0` without echo or on chat, and vLLM's `truncation_side: "right"`,
`return_tokens_as_token_ids`, `logprob_token_ids`, `thinking_token_budget` and
`repetition_detection`.
Other unknown fields are ignored.

Function calling, as vLLM serves it (`pagedjax.tool_calls` has the details): chat's
`tools` (`[{"type": "function", "function": {"name", "description", "parameters",
"strict"}}]`) are rendered by the chat template (its `tools` variable), whatever the
`tool_choice`; messages may hold the assistant's `tool_calls` (their JSON `arguments`
reach the template parsed) and `role: "tool"` results. `tool_choice` (default "auto"
with tools): "none" answers the text; `{"type": "function", "function": {"name": F}}`
constrains the output to F's `parameters` JSON and answers one call of F (content "",
finish_reason as the engine's); "required" constrains it to a JSON array of calls
(finish_reason "tool_calls"); "auto" needs `--enable-auto-tool-choice --tool-call-parser
hermes|llama3_json` (else a 400, vLLM's) and answers the calls the parser finds in the
text (finish_reason "tool_calls"), or the text as content when it finds none.
`parallel_tool_calls: false` keeps the first call. A call is `{"id":
"chatcmpl-tool-...", "type": "function", "function": {"name", "arguments": JSON text}}`
in `message.tool_calls`. Streamed, content goes out until a call could be starting and
the calls come whole in the choice's last chunk with a delta (`delta.tool_calls` with
`index`, `id`, `type`, `function`), then its finish_reason in a chunk of its own
(`delta: {}`), as OpenAI streams them. A bad tool, a tool_choice naming none or given
without tools, and a named or "required" one with other structured outputs, with beam
search or with a schema it cannot constrain to are 400s naming the value.

Streaming (`stream: true`): Server-Sent Events, one `data: {chunk}` per new piece of
text (`text_completion` chunks, or `chat.completion.chunk` with `delta: {role}` first,
then `delta: {content}`), a last chunk per choice with its `finish_reason`, a usage
chunk (`choices: []`) when `stream_options.include_usage` (then, as OpenAI's, every
other chunk has `usage: null`; without it, none has the field), then `data: [DONE]`.
Pieces come from an incremental detokenizer per completion (`Tokenizer.stream()`), so a
multi-byte character is never split. With stop strings, a token's text is streamed only once the
next token shows that the engine did not stop on it, less the last `max(len(stop)) - 1`
characters: the engine stops on the token that completes a stop string and cuts the
text where the string begins (with `min_tokens` too: not at an earlier occurrence that
`min_tokens` let through), so no text streamed can be cut later. The last chunk
carries what the engine's final text has beyond what was streamed, so the pieces
always add up to the non-streamed text. With logprobs, each chunk's `logprobs` (in the
non-streamed answer's format) are those of the tokens whose text that chunk completes
(a token whose text is held back waits with it), and the last chunk has the rest (as
in the non-streamed answer, the tokens that complete a stop string are there though
their text is cut), so they too add up to the non-streamed answer's. So do the chunks'
`token_ids` when the answer has them (the same tokens as the chunk's logprobs; `[]` in
chat's role chunks); with `return_token_ids`, a completions choice's first chunk
carries its `prompt_token_ids`, and a chat's role chunks the prompt's. Without a
tokenizer, each token is a chunk of its own (text "", `token_ids: [id]`, its
logprobs), and the last chunk of a choice has `token_ids: []` (or the tokens not
streamed yet, if any) and its `finish_reason`. The HTTP status and headers go out with
the first event: a step that fails before it is still a 500; one that fails later ends
the stream with an `{"error"}` event.

Usage: `usage` (streamed: the usage chunk's) counts `prompt_tokens` (each prompt once,
whatever its `n`), `completion_tokens` (every choice's) and `total_tokens`. With
`--enable-prompt-tokens-details` (vLLM's flag) it also carries `prompt_tokens_details:
{"cached_tokens": N}`: the prompt tokens the prefix cache served (whole pages of an
earlier request's prompt, at the request's first admission), summed over the prompts
as `prompt_tokens` is, 0 included (vLLM leaves out a 0 and counts one prompt's only).

The server is `pagedjax.http_server` (`Server`, `Handler`); this script is its command
line. Threading: one engine thread (`pagedjax.serving.EngineThread`, whose docstring has
the details) owns the `LLM`; each HTTP connection is a thread (`ThreadingHTTPServer`) that
validates and tokenizes on its own (`pagedjax.openai_api`: the tokenizer is Rust's
`tokenizers` used only through read-only calls, and Jinja templates render
concurrently), so bad requests never reach the engine; it then queues its requests and
waits on its own queue for token events and the final outputs. A client that goes
away (a failed write, or its socket closed while waiting) has its requests aborted.
If a step raises, the engine recovers by itself (`LLM.step`): the requests it held
fail with a 500 and the server goes on.

Request bodies come with a `Content-Length` or `Transfer-Encoding: chunked` (at most
32 MiB; a client that sends `Expect: 100-continue` gets the 413 before it sends one
over the limit). A stream to an HTTP/1.0 client is not chunked (HTTP/1.0 has no
chunks): the connection's end ends it. A client silent for 60 s
(`http_server.TIMEOUT_S`) mid-request (a 408 if in its body), between two requests or
while its stream waits for it to read is let go (its requests aborted), as is one that
has not sent a whole request (line, headers, body) within `--read-timeout S` (default
60) of the server waiting for it, however it dribbles it (a 408 if in its body; the
answer's time is not counted: a long stream goes on). At most `--max-connections N`
(default 1024) connections are served at once, each a thread; one more gets a 503
(`Connection: close`, `Retry-After: 1`) and is closed. Ctrl-C or
SIGTERM stops the server: the requests in flight get a 503 (a stream, its error event
and [DONE]) before it exits (it waits up to 10 s for those answers). For trusted
networks only: there is no authentication and no rate limit; bind to 127.0.0.1 (the
default) unless the network is yours.

LoRA adapters, as vLLM serves them: `--lora-modules NAME=PATH [NAME=PATH ...]` (or
vLLM's JSON form `'{"name": "sql", "path": "/p"}'`) serves each PEFT adapter directory
under its name, beside the model (the engine's `enable_lora`; each gets `lora_int_id`
1, 2, ... in order); every adapter is read at startup, so one the engine refuses (a
rank above `--max-lora-rank`, shapes that do not fit the model, DoRA, biases,
`modules_to_save`, `adapter_model.bin`) fails the start with one line naming it.
`--max-loras N` (default 1) adapters run at once (requests of another wait), each of
rank up to `--max-lora-rank N` (default 16); `--max-cpu-loras N` (default: max-loras)
bounds the adapters kept on the host beyond the ones in use, though every adapter of
`--lora-modules` stays held. Names given twice, or equal to the model's, are bad flags.
Metrics keep the model's name as their label.

Runtime LoRA updating, as vLLM's: `--allow-runtime-lora-updating` (or the environment
variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True or 1, as vLLM reads it) enables LoRA in
the engine, with or without `--lora-modules`, and serves two more endpoints (without it
they are unknown paths, 404s, as in vLLM). `POST /v1/load_lora_adapter` with
`{"lora_name": NAME, "lora_path": DIR}` reads the adapter on the engine thread and
serves it as NAME (the next `lora_int_id`; ids are never reused, so an adapter
rewritten in place and loaded again never hits the old one's prefix-cache pages):
200 with the text "Success: LoRA adapter 'NAME' added successfully.". A NAME already
served ("The lora adapter 'NAME' has already been loaded.") or the model's, a missing
field, no adapter at DIR or one the engine refuses (as at startup) is a 400 naming it,
and nothing changes. `POST /v1/unload_lora_adapter` with `{"lora_name": NAME}` (or
vLLM's `"lora_int_id"`) stops serving it and has the engine forget it: 200 "Success:
LoRA adapter 'NAME' removed successfully."; a name not served is a 404 ("The lora
adapter 'NAME' cannot be found."), and an adapter that queued or running requests use
is a 400 naming it (unload it once they finish; nothing changes). Once loaded, an
adapter is in /v1/models and a request's `model` selects it; once unloaded, it is not,
and naming it is a 404. For development and trusted networks: anyone who can reach
the server can make it read any adapter directory the server can read.

Flags:
`--checkpoint`, `--host` (an IPv6 address binds IPv6: `--host ::1`, or `::` for all;
URLs bracket it, `http://[::1]:8000`), `--port`, `--read-timeout S`,
`--max-connections N`, `--served-model-name`, `--chat-template FILE`,
`--seed` (for requests without one), `--generation-config auto|none`, scripts/generate.py's
engine flags (`--page-size`, `--num-pages` | `--kv-memory-fraction`, `--kv-cache-dtype`,
`--max-batch-tokens`, `--max-model-len N`, `--backend`, `--tensor-parallel`,
`--compilation-cache`), `--max-logprobs N` (default 20; -1: no cap), `--no-prefix-caching`,
`--no-async-scheduling`, `--scheduling-policy fcfs|priority` (vLLM's: by arrival, or by
each request's `priority`), `--lora-modules`, `--allow-runtime-lora-updating`,
`--max-loras N`, `--max-lora-rank N`, `--max-cpu-loras N`, `--enable-auto-tool-choice`
with `--tool-call-parser hermes|llama3_json` (vLLM's: `tool_choice: "auto"`; the parser
alone is unused, as in vLLM), `--enable-prompt-tokens-details` (vLLM's: `usage` carries
`prompt_tokens_details: {cached_tokens}`, see "Usage"), `--quiet` (no request log).
Bad flags, a checkpoint directory missing files, a bad value in its
generation_config.json, a LoRA adapter directory that is not there or a port that
cannot be bound end with one line on stderr and exit status 2, before any weights load
(an adapter the engine refuses: right after them); Ctrl-C while the model loads, with
"interrupted" and status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli  # noqa: E402  (the scripts' shared flags, checks and exits)

from pagedjax.chat import jinja_missing  # noqa: E402
from pagedjax.http_io import url_host  # noqa: E402
from pagedjax.http_server import (  # noqa: E402, F401  (Handler: re-exported)
    MAX_CONNECTIONS,
    READ_TIMEOUT_S,
    Handler,
    Server,
)
from pagedjax.tool_calls import PARSERS  # noqa: E402

DEMO_NAME = "pagedjax-demo"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's: "1" or "true" enables it


def build_parser() -> cli.Parser:
    p = cli.Parser(prog="scripts/serve.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        help="HF directory or pagedjax orbax checkpoint (default: the embedded demo model)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; an IPv6 one, ::1 or ::, binds IPv6)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument(
        "--read-timeout",
        type=float,
        default=READ_TIMEOUT_S,
        metavar="S",
        help="seconds a client has to send a whole request, headers and body; not counting "
        f"the answer, a stream's generation (default {READ_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-connections",
        type=cli.int_at_least(1),
        default=MAX_CONNECTIONS,
        metavar="N",
        help=f"connections served at once; more get a 503 (default {MAX_CONNECTIONS})",
    )
    p.add_argument("--served-model-name", metavar="NAME", help="the model id (default: dir name)")
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file to use instead of the checkpoint's",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    cli.add_generation_config_flag(p)
    cli.add_engine_flags(p)
    cli.add_max_logprobs_flag(p)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="apply each step's tokens on the host before dispatching the next",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="serve waiting requests by arrival (default) or by their `priority` field",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        metavar="NAME=PATH",
        help='LoRA adapters served under their names (NAME=PATH or \'{"name": ..., "path": ...}\')',
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (LoRA enabled); "
        f"also {RUNTIME_LORA_ENV}=True or 1",
    )
    p.add_argument(
        "--max-loras",
        type=cli.int_at_least(1),
        metavar="N",
        help="most LoRA adapters running at once (default 1)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=cli.int_at_least(1),
        metavar="N",
        help=f"the largest LoRA adapter rank accepted (default {cli.LORA_RANK})",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=cli.int_at_least(0),
        metavar="N",
        help="LoRA adapters kept on the host beyond those in use (default: --max-loras)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve chat\'s tool_choice "auto" (needs --tool-call-parser)',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help='how tool calls are read from the text under tool_choice "auto"',
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage carries prompt_tokens_details.cached_tokens (prefix-cache hits)",
    )
    p.add_argument("--quiet", action="store_true", help="do not log each request")
    return p


def lora_module(text: str) -> tuple[str, str, str | None]:
    """One `--lora-modules` value as (name, path, base model name or None): vLLM's
    `NAME=PATH`, or its JSON `{"name": ..., "path": ..., "base_model_name": ...}` (the
    last optional)."""
    if not text.lstrip().startswith("{"):
        name, _, path = text.partition("=")
        if not name or not path:
            raise argparse.ArgumentTypeError(
                f"expected NAME=PATH or a JSON object, got {text!r:.100}"
            )
        return name, path, None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r:.100} is not JSON: {e}") from None
    keys = {"name", "path", "base_model_name"}
    if not isinstance(obj, dict) or set(obj) - keys or not {"name", "path"} <= set(obj):
        raise argparse.ArgumentTypeError(
            f'expected {{"name": ..., "path": ...[, "base_model_name": ...]}}, got {text!r:.100}'
        )
    if not all(isinstance(v, str) and v for v in obj.values()):
        raise argparse.ArgumentTypeError(f"expected non-empty strings, got {text!r:.100}")
    return obj["name"], obj["path"], obj.get("base_model_name")


def runtime_lora_updating(args) -> bool:
    """`--allow-runtime-lora-updating`, or vLLM's environment variable set as vLLM reads
    it (True or 1, any case and spaces)."""
    env = os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
    return args.allow_runtime_lora_updating or env


def lora_requests(args, served: str) -> list:
    """The `LoRARequest` of each `--lora-modules` value (ids 1, 2, ... in order), checked
    before the model loads: BadInput for a path that is no directory, a base model name
    other than `served`, and the other LoRA flags without `--lora-modules` (or runtime
    LoRA updating)."""
    from pagedjax.lora import LoRARequest

    if not args.lora_modules:
        for flag in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(args, flag) is not None and not runtime_lora_updating(args):
                name = "--" + flag.replace("_", "-")
                raise cli.BadInput(
                    f"{name} needs --lora-modules (the adapters to serve) or "
                    "--allow-runtime-lora-updating"
                )
        return []
    out = []
    for i, (name, path, base) in enumerate(args.lora_modules, start=1):
        if base is not None and base != served:
            raise cli.BadInput(
                f"--lora-modules {name}: base_model_name {base!r} is not the served model, "
                f"{served!r}"
            )
        if not Path(path).is_dir():
            raise cli.BadInput(f"--lora-modules {name}={path}: no such directory")
        out.append(LoRARequest(name, i, path))
    return out


def model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    return DEMO_NAME if args.checkpoint is None else Path(args.checkpoint).resolve().name


def run(args) -> int:
    from pagedjax.engine import LLM

    cli.check_engine_flags(args, tokenizer=False)  # without one it serves token id prompts
    if not 0 <= args.port < 2**16:
        raise cli.BadInput(f"--port must be in [0, 65535], got {args.port}")
    if not (args.read_timeout > 0 and math.isfinite(args.read_timeout)):
        raise cli.BadInput(f"--read-timeout must be a positive number, got {args.read_timeout}")
    tok = None
    if args.chat_template is not None:
        hint = "give a Jinja chat template file"
        tok = cli.chat_tokenizer(args.checkpoint, args.chat_template, hint)
    loras = lora_requests(args, model_name(args))
    runtime_loras = runtime_lora_updating(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # as vLLM refuses it
        raise cli.BadInput("--enable-auto-tool-choice requires --tool-call-parser")
    try:  # before the weights load: a port in use is a one-line error
        server = Server(
            (args.host, args.port),
            model_name=model_name(args),
            quiet=args.quiet,
            lora_modules=loras,
            allow_runtime_lora_updating=runtime_loras,
            tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
            read_timeout=args.read_timeout,
            max_connections=args.max_connections,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        )
    except OSError as e:
        where = f"{url_host(args.host)}:{args.port}"
        raise cli.BadInput(f"cannot listen on {where}: {e.strerror or e}") from None
    except ValueError as e:  # a name given twice, or the model's
        raise cli.BadInput(f"--lora-modules: {e}") from None
    try:
        cli.enable_compilation_cache(
            cli.compilation_cache_dir(args.compilation_cache),
            given=args.compilation_cache is not None,
        )
        llm = LLM(
            args.checkpoint,
            enable_prefix_caching=not args.no_prefix_caching,
            seed=args.seed,
            tokenizer=tok,
            async_scheduling=not args.no_async_scheduling,
            generation_config=args.generation_config,
            scheduling_policy=args.scheduling_policy,
            max_logprobs=args.max_logprobs,
            enable_lora=bool(loras) or runtime_loras,
            max_loras=args.max_loras or 1,
            max_lora_rank=args.max_lora_rank or cli.LORA_RANK,
            max_cpu_loras=args.max_cpu_loras,
            **cli.engine_kwargs(args),
        )
        server.start(llm)
        cli.note_defaults(args, llm.sampling_defaults, "request fields given")
        tok = llm.tokenizer
        if tok is not None and tok.chat_template is not None and (why := jinja_missing()):
            print(f"note: /v1/chat/completions will fail: {why}", file=sys.stderr)
        adapters = f", LoRA adapters {', '.join(server.loras)}" if loras else ""
        if runtime_loras:
            print(
                "note: runtime LoRA updating is on: POST /v1/load_lora_adapter and "
                "/v1/unload_lora_adapter change the served adapters (no authentication)",
                file=sys.stderr,
            )
        print(
            f"serving {server.model_name} ({llm.model_source}{adapters}) at {server.url}/v1; "
            "Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt), sigterm_interrupts():
            server.serve_forever()
    finally:
        server.close()  # the requests in flight get their 503s before the process exits
    return 0


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM (`kill`, `docker stop`, systemd) as Ctrl-C, a KeyboardInterrupt in the
    main thread: the server stops as cleanly. Python's default killed the process at
    once, its requests in flight cut off. A second SIGTERM, during the stop, kills."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    try:
        return cli.run_cli(build_parser, run, argv)
    except KeyboardInterrupt:  # while the model loads (serving, Ctrl-C stops: status 0)
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    cli.exit_with(main())
