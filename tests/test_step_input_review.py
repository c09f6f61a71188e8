"""pagedjax.step_input against a per-token oracle: `build_step_input`'s arrays, element by
element, over random valid steps (decode rows, prefill chunks starting and ending
mid-page, shared read-only prefix pages, sliding windows, LoRA slots); its refusals over
random page tables against a brute-force reading of which slot each row writes and
reads; and the number of programs an engine-like workload compiles.

No model runs here (nothing is jitted: `build_step_input` packs numpy arrays).
"""

import dataclasses
import warnings

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedjax import decode
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]  # vocab 256, max_position_embeddings 512
_SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _pow2_at_least(n, floor):
    out = 1
    while out < max(n, floor):
        out *= 2
    return out


@st.composite
def valid_steps(draw):
    """A step no check refuses: (chunks, model_cfg, cache_cfg, buckets, copies); rows
    often end at the model's last position.

    Written pages (those holding a position in [start, end)) are each in exactly one
    table once; pages wholly before a row's start come from a shared pool and may repeat
    anywhere; pages past the end are fresh (read by no one)."""
    s = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_pos = draw(st.integers(1, 128))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    n = draw(st.integers(1, 12))
    decode_only = draw(st.booleans())
    shared = draw(st.integers(1, 6))  # shared prefix pages: 0..shared-1
    next_page = shared
    chunks = []
    for _ in range(n):
        q = 1 if decode_only else draw(st.integers(1, min(3 * s + 3, max_pos)))
        start = draw(st.one_of(st.integers(0, max_pos - q), st.just(max_pos - q)))  # the last
        end = start + q
        first_written, last_written = start // s, (end - 1) // s
        table = [draw(st.integers(0, shared - 1)) for _ in range(first_written)]
        table += range(next_page, next_page + last_written - first_written + 1)
        next_page += last_written - first_written + 1
        extra = draw(st.integers(0, 2))
        table += range(next_page, next_page + extra)
        next_page += extra
        chunks.append(
            decode.SeqChunk(
                draw(st.lists(st.integers(0, TINY.vocab_size - 1), min_size=q, max_size=q)),
                start,
                table,
                temperature=draw(st.sampled_from([0.0, 0.7])),
                top_k=draw(st.integers(0, 50)),
                seed=draw(st.integers(0, 2**32 - 1)),
                sample_step=draw(st.integers(0, 100)),
                lora_slot=draw(st.sampled_from([0, 0, 1, 3])),
            )
        )
    num_pages = next_page + draw(st.integers(0, 8))
    copies = []
    for _ in range(draw(st.integers(0, 5))):  # fresh destinations past every table
        copies.append((draw(st.integers(0, shared - 1)), num_pages))
        num_pages += 1
    buckets = decode.Buckets(
        min_tokens=draw(st.sampled_from([1, 16])),
        min_seqs=draw(st.sampled_from([1, 8])),
        min_pages=draw(st.sampled_from([1, 8])),
        min_copies=draw(st.sampled_from([1, 4])),
    )
    cfg = dataclasses.replace(TINY, sliding_window=window, max_position_embeddings=max_pos)
    return chunks, cfg, CacheConfig(page_size=s, num_pages=num_pages), buckets, copies


@_SETTINGS
@given(valid_steps())
def test_build_step_input_matches_a_per_token_oracle(step):
    chunks, cfg, cache_cfg, buckets, copies = step
    inp = decode.build_step_input(chunks, cfg, cache_cfg, copies=copies, buckets=buckets)
    s, n = cache_cfg.page_size, len(chunks)
    q_lens = [len(c.token_ids) for c in chunks]
    total = sum(q_lens)
    is_decode = all(q == 1 for q in q_lens)
    b = _pow2_at_least(n, buckets.min_seqs)
    t = b if is_decode else _pow2_at_least(total, buckets.min_tokens)
    width = _pow2_at_least(max(len(c.page_table) for c in chunks), buckets.min_pages)
    num_copies = _pow2_at_least(len(copies), buckets.min_copies)
    assert inp.bucket == (t, b, width, num_copies, is_decode)
    assert inp.decode == is_decode and (inp.page_size, inp.num_pages) == (s, cache_cfg.num_pages)

    token_ids, positions, slots = np.zeros(t), np.zeros(t), np.full(t, -1)
    page_table = np.zeros((b, width))
    context_lens, starts, last = np.zeros(b), np.full(b + 1, total), np.zeros(b)
    lora = np.zeros(t)
    row = 0
    for i, c in enumerate(chunks):
        starts[i] = row
        page_table[i, : len(c.page_table)] = c.page_table
        context_lens[i] = c.start_pos + len(c.token_ids)
        for k, tok in enumerate(c.token_ids):
            p = c.start_pos + k
            token_ids[row], positions[row], lora[row] = tok, p, c.lora_slot
            slots[row] = c.page_table[p // s] * s + p % s
            row += 1
        last[i] = row - 1
    for name, want in [
        ("token_ids", token_ids),
        ("positions", positions),
        ("slot_mapping", slots),
        ("page_table", page_table),
        ("context_lens", context_lens),
        ("query_start_loc", starts),
        ("logits_indices", last),
    ]:
        got = getattr(inp, name)
        assert got.dtype == np.int32, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    # Padding is inert: it writes nothing, reads nothing, and indexes inside its arrays.
    assert (inp.slot_mapping[total:] == -1).all()
    assert (np.diff(inp.query_start_loc)[n:] == 0).all()
    assert ((inp.page_table >= 0) & (inp.page_table < cache_cfg.num_pages)).all()
    assert ((inp.logits_indices >= 0) & (inp.logits_indices < t)).all()
    if any(c.lora_slot for c in chunks):
        np.testing.assert_array_equal(inp.lora_slots, lora)
    else:
        assert inp.lora_slots is None
    np.testing.assert_array_equal(inp.copy_src[: len(copies)], [a for a, _ in copies])
    np.testing.assert_array_equal(inp.copy_dst[: len(copies)], [d for _, d in copies])
    assert (inp.copy_dst[len(copies) :] == -1).all()
    for name, field, pad in [
        ("temperature", "temperature", 0),
        ("top_k", "top_k", 0),
        ("seeds", "seed", 0),
        ("sample_steps", "sample_step", 0),
        ("top_p", "top_p", 1),
    ]:
        want = [getattr(c, field) for c in chunks] + [pad] * (b - n)
        np.testing.assert_allclose(getattr(inp, name), want, rtol=1e-6, err_msg=name)


def _conflict(chunks, s, window):
    """Brute force: does a slot written this step get written twice, or read by any
    (row, position) other than the one that writes it?"""
    writers = {}
    for i, c in enumerate(chunks):
        for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
            slot = c.page_table[p // s] * s + p % s
            if slot in writers:
                return True
            writers[slot] = (i, p)
    for i, c in enumerate(chunks):
        end = c.start_pos + len(c.token_ids)
        lo = 0 if window is None else max(c.start_pos - window + 1, 0)
        for p in range(lo, end):
            slot = c.page_table[p // s] * s + p % s
            if slot in writers and writers[slot] != (i, p):
                return True
    return False


@st.composite
def colliding_steps(draw):
    """Steps over a pool of a few pages, where tables often share pages."""
    s = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    num_pages = draw(st.integers(1, 8))
    chunks = []
    for _ in range(draw(st.integers(1, 4))):
        q = draw(st.integers(1, 2 * s + 1))
        start = draw(st.integers(0, 3 * s))
        need = -(-(start + q) // s) + draw(st.integers(0, 1))
        table = draw(st.lists(st.integers(0, num_pages - 1), min_size=need, max_size=need))
        chunks.append(decode.SeqChunk([1] * q, start, table))
    return chunks, s, window, num_pages


@_SETTINGS
@given(colliding_steps())
def test_build_step_input_refuses_exactly_the_steps_that_overwrite_a_read_slot(step):
    chunks, s, window, num_pages = step
    cfg = dataclasses.replace(TINY, sliding_window=window)
    cache_cfg = CacheConfig(page_size=s, num_pages=num_pages)
    if _conflict(chunks, s, window):
        with pytest.raises(ValueError, match="cache slot"):
            decode.build_step_input(chunks, cfg, cache_cfg)
    else:
        decode.build_step_input(chunks, cfg, cache_cfg)


@pytest.mark.parametrize(
    "chunk,match",
    [
        (decode.SeqChunk([1], 0, [32]), r"sequence 0: page id 32 is out of range \[0, 32\)"),
        (decode.SeqChunk([1], 0, [-3]), r"sequence 0: page id -3 is out of range \[0, 32\)"),
        (decode.SeqChunk([1], -2, [1]), "start_pos must be >= 0, got start_pos=-2"),
        (decode.SeqChunk([1] * 3, 2, [1]), "page table of 1 pages holds 4 tokens, needs 5"),
        (decode.SeqChunk([1], 512, list(range(1, 31))), r"positions \[512, 513\) exceed"),
        (decode.SeqChunk([300], 0, [1]), "token id 300 is outside the vocabulary"),
    ],
)
def test_bad_steps_are_refused_by_value(chunk, match):
    ok = decode.SeqChunk([1], 4, [5, 6])  # a valid row first: the bad one is still named
    with pytest.raises(ValueError, match=match.replace("sequence 0", "sequence 1")):
        decode.build_step_input([ok, chunk], TINY, CacheConfig(page_size=4, num_pages=32))


def test_engine_like_workloads_compile_a_bounded_set_of_programs():
    """Decode batches of 1..max_num_seqs rows and mixed steps of up to
    max_num_batched_tokens tokens land in the power-of-two buckets: at most
    |B| * |pages| decode programs and |T| * |B| * |pages| mixed ones, and batches of
    one bucket share one pytree signature."""
    max_seqs, budget, max_len, s = 32, 512, 1024, 16
    cfg = dataclasses.replace(TINY, max_position_embeddings=max_len)
    per_seq = max_len // s
    cache_cfg = CacheConfig(page_size=s, num_pages=max_seqs * per_seq)
    rng = np.random.default_rng(0)
    buckets, signatures = set(), {}
    for _ in range(300):
        mixed = rng.random() < 0.4
        n_dec = int(rng.integers(0 if mixed else 1, max_seqs))
        lens = [(int(c) - 1, 1) for c in rng.integers(1, max_len, n_dec)]
        if mixed:
            q = int(rng.integers(1, budget - n_dec + 1))
            lens.append((int(rng.integers(0, max_len - q + 1)), q))
        chunks = [
            decode.SeqChunk([1] * q, start, range(i * per_seq, i * per_seq - (-(start + q) // s)))
            for i, (start, q) in enumerate(lens)
        ]
        inp = decode.build_step_input(chunks, cfg, cache_cfg)
        t, b, width, _, is_decode = inp.bucket
        assert b >= len(chunks) and t >= sum(q for _, q in lens) and (not is_decode or t == b)
        buckets.add(inp.bucket)
        leaves = jax.tree.leaves(inp)
        sig = (jax.tree.structure(inp), tuple((x.shape, x.dtype) for x in leaves))
        assert signatures.setdefault(inp.bucket, sig) == sig
    num_b, num_pages, num_t = 3, 4, 6  # 8..32 rows, 8..64 pages, 16..512 tokens
    assert all(k[:4] in {(k[1], k[1], k[2], 4)} for k in buckets if k[4])
    assert sum(k[4] for k in buckets) <= num_b * num_pages
    assert sum(not k[4] for k in buckets) <= num_t * num_b * num_pages


def test_slot_and_page_ids_past_int32_are_refused():
    """Were packed as int32 without a word: slot 2**27 * 16 wrapped to -2**31, page
    2**32 + 5 to page 5 (another sequence's). Such a cache is refused when configured."""
    for page_size, num_pages in [(16, 2**28), (16, 2**33), (2**20, 2**11)]:  # (2**31: one over)
        with pytest.raises(ValueError, match=rf"num_pages={num_pages} .*int32"):
            CacheConfig(page_size=page_size, num_pages=num_pages)
    # The largest pool of such pages: its last slot is packed as it is.
    cache_cfg = CacheConfig(page_size=2**20, num_pages=2**11 - 1)
    cfg = dataclasses.replace(TINY, max_position_embeddings=2**20)
    chunk = decode.SeqChunk([1], 2**20 - 1, [2**11 - 2])
    assert decode.build_step_input([chunk], cfg, cache_cfg).slot_mapping[0] == 2**31 - 2**20 - 1


def test_positions_past_int32_are_refused():
    """A model allowing 2**40 positions packed position 2**31 as -2**31 (context length
    -2**31 + 1), without a word."""
    cfg = dataclasses.replace(TINY, max_position_embeddings=2**40)
    cache_cfg = CacheConfig(page_size=2**20, num_pages=4)
    chunk = decode.SeqChunk([1], 2**31 - 1, [0] * 2047 + [1])  # page 1: 2**31 - 2**20 on
    with pytest.raises(ValueError, match=r"sequence 0: positions \[2147483647, 2147483648\)"):
        decode.build_step_input([chunk], cfg, cache_cfg)
    chunk.start_pos = 2**31 - 2  # its context length, 2**31 - 1, still fits
    assert decode.build_step_input([chunk], cfg, cache_cfg).context_lens[0] == 2**31 - 1


@pytest.mark.parametrize("start_pos", [2**63, np.uint64(2**64 - 1)])
def test_start_pos_past_int64_is_named_as_given(start_pos):
    # numpy holds 2**63 as uint64, which the int64 cast named as start_pos=-2**63.
    with pytest.raises(ValueError, match=rf"sequence 0: start_pos={int(start_pos)} "):
        decode.build_step_input(
            [decode.SeqChunk([1], start_pos, [1])], TINY, CacheConfig(page_size=4, num_pages=8)
        )


@pytest.mark.parametrize("value", [1e39, np.float64(3.5e38), 10**40])
def test_a_bias_past_float32_is_refused(value):
    """A finite bias past float32's range was packed as +inf (refused when given as inf:
    logits of +inf make NaN probabilities)."""
    chunk = decode.SeqChunk([1], 0, [1], logit_bias={3: value})
    with pytest.raises(ValueError, match="sequence 0: logit_bias values must be finite"):
        decode.build_step_input([chunk], TINY, CacheConfig(page_size=4, num_pages=8))
    # A negative one is a ban, as -inf is.
    chunk.logit_bias = {3: -value}
    inp = decode.build_step_input([chunk], TINY, CacheConfig(page_size=4, num_pages=8))
    assert inp.logit_bias.values[0, 0] == -np.inf


def test_a_temperature_or_penalty_past_float32_packs_as_inf_without_a_warning():
    """Valid, finite values past float32's range are +inf on the device, which sampling
    handles (a uniform draw, an infinite penalty); the pack warned "overflow encountered
    in cast" at every step, and under -W error failed."""
    chunk = decode.SeqChunk([1], 0, [1], temperature=1e39, repetition_penalty=10**40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inp = decode.build_step_input([chunk], TINY, CacheConfig(page_size=4, num_pages=8))
    assert inp.temperature[0] == np.inf and inp.penalties.repetition[0] == np.inf
