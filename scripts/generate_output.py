"""What scripts/generate.py prints once its requests are done: the completions, the
logprobs listings (`format_logprobs`), the closing report (`report`) and the `--json`
object (`json_result`; generate.py's docstring lists its keys).

generate.py reads the flags and prompts, checks them and runs the engine; this module
only turns the engine's outputs and `LLM.summary()` into text or JSON, so the layout of
what a user reads lives in one place. generate.py re-exports `report`,
`format_logprobs` and `so_fields`. Nothing here imports jax or pagedjax at import time
(generate.py refuses bad input before either loads).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys


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
        f"over {s['device_time_s']:.2f} s of measured device time "
        f"({s['kv_bytes_read'] / 1e6:,.1f} MB in the whole run)",
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


def so_fields(so) -> dict | None:
    """The fields a `StructuredOutputsParams` sets (None for none), for --json."""
    if so is None:
        return None
    return {k: v for k, v in dataclasses.asdict(so).items() if v not in (None, False)}


def json_text(obj) -> str:
    """`obj` as strict JSON: a non-finite float (a logprob of -inf: a token the run's
    constraints ban, among the K most likely) is null, where `json.dumps` writes
    `-Infinity`, which JSON has not (jq and JavaScript refuse it)."""

    def finite(v):
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(obj), allow_nan=False)


def json_result(
    llm, args, prompts, outs, *, device, sampling: dict, sp, cache_dir, summary: dict
) -> dict:
    """The --json object: what ran where, the settings as used (`sampling`: the sampling
    flags as taken; `sp`: the run's SamplingParams), one output per prompt, the metrics."""
    from pallas_kernels.dispatch import resolve_backend

    return dict(
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
            lora=args.lora,
            n=args.n,
            **sampling,
            beam_width=args.beam_width,
            stop=list(sp.stop),
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            structured_outputs=so_fields(sp.structured_outputs),
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


def print_text(llm, args, prompts, outs, *, streamed: bool, sep: str) -> None:
    """Each prompt's completions with their finish reasons (unless `streamed`: the one
    completion is on stdout already), then the --prompt-logprobs and --logprobs listings.
    `sep` goes between a prompt and its completion (a newline for --chat)."""
    if not streamed:
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
