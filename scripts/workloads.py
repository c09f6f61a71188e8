"""Seeded request workloads shared by the benchmark scripts.

Every workload is a list of `Request`s drawn from a `numpy.random.Generator` seeded by
the caller, so a (name, seed, size) triple names one exact list of requests. Token ids
are random in ``[3, vocab)`` (0-2 are left to pad/BOS/EOS), so two requests share a
prefix only where the workload says they do.

Workloads (`WORKLOADS`; lengths in tokens, clipped so prompt + output <= max_seq_len):

- ``sharegpt`` (the default): independent requests, prompt ~ LogNormal(median 100,
  sigma 1.0) (mean ~165), output ~ LogNormal(median 200, sigma 1.0) (mean ~330). The
  means follow ShareGPT as the vLLM paper (Kwon et al., SOSP 2023, sec. 6.1) reports
  it: 161 input and 338 output tokens on average. Prompts are clipped to
  max_seq_len / 2.
- ``heavy``: independent requests with Pareto tails, prompt ~ Pareto(alpha 1.3,
  min 32) (mean ~139), output ~ Pareto(alpha 1.3, min 64) (mean ~277); about 1% of
  outputs reach max_seq_len. Few requests dominate the memory: the hard case for
  allocators that size memory per request.
- ``chat``: multi-turn conversations behind one shared system prompt (default 512
  tokens). A conversation has Geometric(1/2) turns (>= 1, mean 2, as in
  LMSYS-Chat-1M); each user message ~ LogNormal(median 48, sigma 0.9) (mean ~72),
  each reply ~ LogNormal(median 160, sigma 0.8) (mean ~220), close to LMSYS-Chat-1M's
  69.5 / 214.5. Turn k's prompt is the system prompt, every earlier message and reply,
  and the new message; it arrives `think` steps (Exponential, mean 20) after turn k-1
  finished. A conversation ends early rather than exceed max_seq_len.

`environment()` describes the machine a benchmark ran on, for its report.

Arrivals: first requests (every request of ``sharegpt``/``heavy``, each conversation's
first turn) arrive as a Poisson process of `rate` requests per step.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform

import numpy as np

__all__ = [
    "Request",
    "preset_config",
    "WORKLOADS",
    "make_workload",
    "chat_conversations",
    "describe",
    "environment",
]

VOCAB = 32000
FIRST_TOKEN = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload.

    Attributes:
        rid: index in the workload list.
        prompt: ``[T]`` int32 prompt token ids.
        output: ``[O]`` int32 token ids the simulated model emits (O >= 1).
        arrival: step at which it arrives (first turns), or 0 for follow-ups.
        parent: rid of the previous turn of its conversation, or None.
        think: steps between the parent finishing and this request arriving.
        conv: conversation id (equal to rid for single-turn workloads).
    """

    rid: int
    prompt: np.ndarray  # [T] int32
    output: np.ndarray  # [O] int32
    arrival: int
    parent: int | None = None
    think: int = 0
    conv: int = 0

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def output_len(self) -> int:
        return int(self.output.shape[0])

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return rng.lognormal(np.log(median), sigma, n)


def _pareto(rng: np.random.Generator, alpha: float, minimum: float, n: int) -> np.ndarray:
    return minimum * (1.0 + rng.pareto(alpha, n))


def _tokens(rng: np.random.Generator, n: int, vocab: int = VOCAB) -> np.ndarray:
    return rng.integers(FIRST_TOKEN, vocab, n, dtype=np.int32)


def _arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.floor(np.cumsum(rng.exponential(1.0 / rate, n))).astype(np.int64)


def _independent(rng, prompt_lens, output_lens, rate, max_seq_len) -> list[Request]:
    n = len(prompt_lens)
    prompts = np.clip(np.round(prompt_lens), 1, max_seq_len // 2).astype(np.int64)
    outputs = np.clip(np.round(output_lens), 1, max_seq_len - prompts).astype(np.int64)
    arrivals = _arrivals(rng, n, rate)
    return [
        Request(i, _tokens(rng, int(p)), _tokens(rng, int(o)), int(arrivals[i]), conv=i)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def sharegpt(rng, n: int, *, rate: float = 1.0, max_seq_len: int = 2048) -> list[Request]:
    """Independent ShareGPT-like requests (lognormal lengths); see the module docstring."""
    return _independent(
        rng, _lognormal(rng, 100, 1.0, n), _lognormal(rng, 200, 1.0, n), rate, max_seq_len
    )


def heavy(rng, n: int, *, rate: float = 1.0, max_seq_len: int = 2048) -> list[Request]:
    """Independent requests with Pareto-tailed lengths; see the module docstring."""
    return _independent(rng, _pareto(rng, 1.3, 32, n), _pareto(rng, 1.3, 64, n), rate, max_seq_len)


def chat_conversations(
    rng,
    num_conversations: int,
    *,
    rate: float = 0.5,
    max_seq_len: int = 2048,
    system_prompt_len: int = 512,
    mean_turns: float = 2.0,
    think_mean: float = 20.0,
    message_median: float = 48,
    reply_median: float = 160,
    system_prompt: np.ndarray | None = None,
    vocab: int = VOCAB,
    max_turns: int | None = None,
) -> list[Request]:
    """Multi-turn conversations behind one shared system prompt; see the module docstring.

    Args:
        rng: the generator.
        num_conversations: conversations (each 1 or more requests).
        rate: conversation starts per step (Poisson).
        max_seq_len: no request grows past this (prompt + output).
        system_prompt_len: tokens of the shared system prompt.
        mean_turns: mean turns per conversation (geometric, >= 1).
        think_mean: mean steps between a reply finishing and the next message.
        message_median, reply_median: medians of the lognormal message/reply lengths.
        system_prompt: the shared prompt's tokens; default random of system_prompt_len.
        vocab: token ids are drawn from [3, vocab).
        max_turns: cap on the turns of a conversation (None: no cap).
    """
    if system_prompt is not None:
        system_prompt_len = len(system_prompt)
    if system_prompt_len >= max_seq_len:
        raise ValueError(f"{system_prompt_len=} leaves no room in {max_seq_len=}")
    if mean_turns < 1:
        raise ValueError(f"mean_turns must be >= 1, got {mean_turns=}")
    if system_prompt is None:
        system = _tokens(rng, system_prompt_len, vocab)
    else:
        system = np.asarray(system_prompt, np.int32)
    starts = _arrivals(rng, num_conversations, rate)
    requests: list[Request] = []
    for conv in range(num_conversations):
        turns = int(rng.geometric(1.0 / mean_turns))
        turns = turns if max_turns is None else min(turns, max_turns)
        history = system
        parent = None
        for _ in range(turns):
            msg = max(1, round(float(_lognormal(rng, message_median, 0.9, 1)[0])))
            reply = max(1, round(float(_lognormal(rng, reply_median, 0.8, 1)[0])))
            think = int(rng.exponential(think_mean))
            prompt_len = len(history) + msg
            if prompt_len >= max_seq_len:
                break
            reply = min(reply, max_seq_len - prompt_len)
            prompt = np.concatenate([history, _tokens(rng, msg, vocab)])
            output = _tokens(rng, reply, vocab)
            rid = len(requests)
            arrival = int(starts[conv]) if parent is None else 0
            requests.append(Request(rid, prompt, output, arrival, parent, think, conv))
            history = np.concatenate([prompt, output])
            parent = rid
    return requests


def make_workload(
    name: str, num_requests: int, *, seed: int = 0, max_seq_len: int = 2048, **kwargs
) -> list[Request]:
    """The named workload with about `num_requests` requests.

    For ``chat``, `num_requests` / mean_turns conversations are drawn, so the count is
    approximate, and the system prompt defaults to min(512, max_seq_len / 4) tokens.
    Extra keyword arguments go to the workload's function.

    Raises:
        ValueError: unknown name or a non-positive count.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests=}")
    rng = np.random.default_rng(seed)
    if name == "chat":
        turns = kwargs.get("mean_turns", 2.0)
        n = max(1, round(num_requests / turns))
        kwargs.setdefault("system_prompt_len", min(512, max_seq_len // 4))
        return chat_conversations(rng, n, max_seq_len=max_seq_len, **kwargs)
    return WORKLOADS[name](rng, num_requests, max_seq_len=max_seq_len, **kwargs)


WORKLOADS = {"sharegpt": sharegpt, "heavy": heavy, "chat": chat_conversations}


def describe(requests: list[Request]) -> dict:
    """Summary statistics of a workload (counts and length means/percentiles)."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    t = p + o
    return {
        "requests": len(requests),
        "conversations": len({r.conv for r in requests}),
        "prompt_mean": float(p.mean()),
        "output_mean": float(o.mean()),
        "total_mean": float(t.mean()),
        "total_p50": float(np.percentile(t, 50)),
        "total_p99": float(np.percentile(t, 99)),
        "total_max": int(t.max()),
    }


def environment() -> dict:
    """Where a benchmark ran, for its report: CPUs, CPU model, jax version, device, date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        import jax

        env["jax"] = jax.__version__
        env["device"] = str(jax.devices()[0].device_kind)
        env["platform"] = jax.default_backend()
    except ImportError:
        env["jax"] = None
    if hasattr(os, "getloadavg"):
        env["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return env


def preset_config(name: str, *, dtype: str | None = None, min_positions: int = 0):
    """The preset `name` (`pagedjax.config.PRESETS`) in `dtype` (None: its own), with
    max_position_embeddings raised to `min_positions` where it is smaller, so that a
    benchmark's sequences fit whatever the preset's context."""
    from pagedjax.config import preset

    cfg = preset(name)
    if dtype:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if cfg.max_position_embeddings < min_positions:
        cfg = dataclasses.replace(cfg, max_position_embeddings=min_positions)
    return cfg


def make_plot_dir(parser, args) -> None:
    """Creates `args.plot_dir` unless `args.no_plots`, before a benchmark runs (a bad
    --plot-dir found after the run lost its results); a usage error if it cannot be."""
    if args.no_plots:
        return
    try:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--plot-dir {args.plot_dir}: cannot create it ({e.strerror or e})")
