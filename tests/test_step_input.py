"""pagedjax.step_input (through `pagedjax.decode`, which re-exports it): `build_step_input`
pads a step to its buckets and refuses, on the host and by name, what it cannot pack: bad
token ids, positions, page tables and sampling values, values it used to truncate, two
tokens written to one slot, and a page written where another row of the step reads it.

No model runs here; the steps themselves are tested in tests/test_decode.py.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import cache as cache_lib
from pagedjax import decode
from pagedjax.config import PRESETS, CacheConfig

TINY = PRESETS["tiny"]


def test_step_input_is_padded_to_buckets():
    cfg, cache_cfg = TINY, CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunks = [
        decode.SeqChunk([7, 8, 9], 0, [3], temperature=0.7, top_k=5, top_p=0.9, seed=11),
        decode.SeqChunk([4], 5, [1, 2], sample_step=2),
        decode.SeqChunk(list(range(10)), 4, [6, 7, 8, 9]),
    ]
    inp = decode.build_step_input(chunks, cfg, cache_cfg, copies=[(2, 30)])
    assert inp.bucket == (16, 8, 8, 4, False)
    np.testing.assert_array_equal(inp.query_start_loc, [0, 3, 4, 14, 14, 14, 14, 14, 14])
    np.testing.assert_array_equal(inp.logits_indices[:3], [2, 3, 13])
    np.testing.assert_array_equal(inp.context_lens, [3, 6, 14, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(inp.positions[:4], [0, 1, 2, 5])
    np.testing.assert_array_equal(inp.slot_mapping[:4], [12, 13, 14, 9])
    assert (inp.slot_mapping[14:] == -1).all()
    np.testing.assert_array_equal(
        inp.slot_mapping[4:14], cache_lib.slots_for([6, 7, 8, 9], 4, 14, 4)
    )
    np.testing.assert_array_equal(inp.copy_src, [2, 0, 0, 0])
    np.testing.assert_array_equal(inp.copy_dst, [30, -1, -1, -1])
    np.testing.assert_array_equal(inp.top_k[:4], [5, 0, 0, 0])
    np.testing.assert_array_equal(inp.seeds[:2], [11, 0])
    np.testing.assert_array_equal(inp.sample_steps[:2], [0, 2])
    # Distinct pages per sequence: two tokens of a step may not write one slot.
    dec = decode.build_step_input(
        [decode.SeqChunk([4], 5, [1 + 2 * i, 2 + 2 * i]) for i in range(3)], cfg, cache_cfg
    )
    assert dec.decode and dec.bucket == (8, 8, 8, 4, True)
    big = decode.build_step_input(
        [decode.SeqChunk([1] * 40, 0, list(range(10 * i, 10 * i + 10))) for i in range(9)],
        cfg,
        CacheConfig(page_size=4, num_pages=128, dtype="float32"),
    )
    assert big.bucket == (512, 16, 16, 4, False)


@pytest.mark.parametrize(
    "chunk,kwargs,match",
    [
        (decode.SeqChunk([1, 256], 0, [1]), {}, "token id 256 is outside the vocabulary"),
        (decode.SeqChunk([-1], 0, [1]), {}, "token id -1 is outside the vocabulary"),
        (decode.SeqChunk([1, 2], 511, list(range(1, 32))), {}, "max_position_embeddings"),
        (decode.SeqChunk([1] * 5, 0, [1]), {}, "holds 4 tokens, needs 5"),
        (decode.SeqChunk([1], 0, [32]), {}, "page id 32 is out of range"),
        (decode.SeqChunk([1], 0, [1], temperature=-0.5), {}, "temperature=-0.5"),
        (decode.SeqChunk([1], 0, [1], top_p=0.0), {}, "top_p=0.0"),
        # packed as int32: 2**40 wrapped to a negative top_k (off) with a RuntimeWarning
        (decode.SeqChunk([1], 0, [1], top_k=2**40), {}, r"top_k=1099511627776"),
        (decode.SeqChunk([], 0, [1]), {}, "non-empty"),
        (decode.SeqChunk([1, 2], 0, [1]), {"decode": True}, "one token per sequence"),
        (decode.SeqChunk([1], 0, [1]), {"copies": [(3, 40)]}, r"copy pair \(3, 40\)"),
        (decode.SeqChunk([1], 0, [1]), {"copies": [(3, 4), (5, 4)]}, "distinct"),
    ],
)
def test_build_step_input_rejects_bad_input(chunk, kwargs, match):
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    with pytest.raises(ValueError, match=match):
        decode.build_step_input([chunk], TINY, cache_cfg, **kwargs)


@pytest.mark.parametrize(
    "chunks,kwargs,error,match",
    [
        # Each of these was truncated or flattened without a word.
        ([decode.SeqChunk([1], 2.5, [1])], {}, TypeError, "sequence 0: start_pos must be an int"),
        ([decode.SeqChunk([1], True, [1])], {}, TypeError, "start_pos must be an int"),
        ([decode.SeqChunk([1], 0, [3.7])], {}, TypeError, "sequence 0: page_table must hold"),
        ([decode.SeqChunk([1], 0, [[3]])], {}, ValueError, r"page_table must be 1-D, got shape"),
        ([decode.SeqChunk([1], 0, [1], sample_step=1.5)], {}, TypeError, "sample_step must be"),
        ([decode.SeqChunk([1], 0, [1], sample_step=-1)], {}, ValueError, "sample_step=-1"),
        ([decode.SeqChunk([1], 0, [1])], {"copies": [(1.5, 2)]}, TypeError, "copies must be int"),
        ([decode.SeqChunk([1], 0, [1])], {"copies": [(1, 2, 4)]}, ValueError, "pairs"),
        # Two tokens of one step written to the same cache slot: one overwrites the other.
        (
            [decode.SeqChunk([1, 2], 0, [3]), decode.SeqChunk([4], 1, [3])],
            {},
            ValueError,
            r"sequences 0 and 1 both write cache slot 13 \(positions 1 and 1\)",
        ),
        (
            [decode.SeqChunk([1] * 5, 0, [3, 3])],
            {},
            ValueError,
            r"sequences 0 and 0 both write cache slot 12 \(positions 0 and 4\)",
        ),
        # Packed as int32: sample_step 2**40 wrapped to 0 (step 0's PRNG key again).
        (
            [decode.SeqChunk([1], 0, [1], sample_step=2**40)],
            {},
            ValueError,
            r"sample_step must be in \[0, 2\*\*31\), got sample_step=1099511627776",
        ),
        # Were StopIteration (every value an int, but no int64 array holds them).
        ([decode.SeqChunk([1], 2**70, [1])], {}, ValueError, r"start_pos=1180591620717411303424"),
        # Blamed max_position_embeddings.
        (
            [decode.SeqChunk([1], -1, [1])],
            {},
            ValueError,
            "start_pos must be >= 0, got start_pos=-1",
        ),
        # int() truncated a float token id to another token.
        (
            [decode.SeqChunk([1], 0, [1], logit_bias={3.7: 1.0})],
            {},
            TypeError,
            "logit_bias token ids must be ints, got 3.7",
        ),
        (
            [decode.SeqChunk([1], 0, [1], repetition_penalty=1.2, prompt_ids=[1.5])],
            {},
            TypeError,
            "prompt_ids must be int token ids, got dtype float64",
        ),
        # Was numpy's "could not convert string to float", naming no field.
        (
            [decode.SeqChunk([1], 0, [1], temperature="hot")],
            {},
            ValueError,
            "temperature=.hot.",
        ),
        # Each of these was converted to a float and used: a numeric string, a bool, a
        # one-element list; a bool penalty of True (== 1.0) was "off".
        *(
            ([decode.SeqChunk([1], 0, [1], **{name: bad})], {}, ValueError, match)
            for name, bad, match in [
                ("temperature", "0.5", r"sequence 0: temperature must be a real number, got "),
                ("top_k", True, r"sequence 0: top_k must be a real number, got top_k=True"),
                ("seed", True, r"seed must be a real number, got seed=True"),
                ("top_p", [0.5], r"top_p must be a real number, got top_p=\[0.5\]"),
                ("min_p", "0", r"min_p must be a real number, got min_p='0'"),
                ("repetition_penalty", True, r"got repetition_penalty=True"),
            ]
        ),
        # A list was "'list' object has no attribute 'values'", a string value numpy's
        # "could not convert string to float" ('0.5' and True were taken as numbers).
        (
            [decode.SeqChunk([1], 0, [1], logit_bias=[1, 2])],
            {},
            TypeError,
            r"sequence 0: logit_bias must be a mapping of token id -> value, got \[1, 2\]",
        ),
        *(
            (
                [decode.SeqChunk([1], 0, [1], logit_bias={1: bad})],
                {},
                TypeError,
                rf"sequence 0: logit_bias values must be real numbers, got {match} for token 1",
            )
            for bad, match in (("x", "'x'"), ("0.5", "'0.5'"), (True, "True"))
        ),
        # A uint64 page id past int64 was named as a negative one (-9223372036854775808).
        (
            [decode.SeqChunk([1], 0, np.array([2**63], np.uint64))],
            {},
            ValueError,
            r"sequence 0: page id 9223372036854775808 is out of range \[0, 32\)",
        ),
        # Were "'tuple' object has no attribute 'min_seqs'", and a StepInput whose static
        # `decode` was 'yes' (refused by both steps).
        ([decode.SeqChunk([1], 0, [1])], {"buckets": (16, 8)}, TypeError, r"got buckets=\(16, 8\)"),
        ([decode.SeqChunk([1], 0, [1])], {"decode": "yes"}, TypeError, "got decode='yes'"),
    ],
)
def test_build_step_input_rejects_what_it_used_to_truncate(chunks, kwargs, error, match):
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    with pytest.raises(error, match=match):
        decode.build_step_input(chunks, TINY, cache_cfg, **kwargs)


def test_build_step_input_names_arguments_of_the_wrong_type():
    # Were "object of type 'SeqChunk' has no len()", "'tuple' object has no attribute
    # 'token_ids'" and "'ModelConfig' object has no attribute 'page_size'".
    cc = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunk = decode.SeqChunk([1], 0, [1])
    for args, match in [
        ((chunk, TINY, cc), r"chunks must be a list of SeqChunk .*got SeqChunk\("),
        (([([1], 0, [1])], TINY, cc), r"chunk 0 must be a SeqChunk, got \(\[1\], 0, \[1\]\)"),
        (([chunk], cc, TINY), "a ModelConfig and a CacheConfig, got CacheConfig and ModelConfig"),
    ]:
        with pytest.raises(TypeError, match=match):
            decode.build_step_input(*args)


def test_build_step_input_allows_shared_read_only_pages():
    # A shared prefix page (3) is read by both sequences and written by neither.
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    inp = decode.build_step_input(
        [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 4, [3, 6])], TINY, cache_cfg
    )
    np.testing.assert_array_equal(inp.slot_mapping[:2], [20, 24])


@pytest.mark.parametrize(
    "chunks,window,written,reader",
    [
        # One page twice in a table: position 4 overwrote position 0 (same offset).
        ([decode.SeqChunk([1], 4, [3, 3])], None, (0, 12, 4), (0, 0)),
        # A fork that forgot its copy: both write page 5, each reads the other's slot.
        (
            [decode.SeqChunk([1], 5, [3, 5]), decode.SeqChunk([2], 6, [3, 5])],
            None,
            (0, 21, 5),
            (1, 5),
        ),
        # A page one sequence writes is an earlier page of another.
        (
            [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 8, [5, 3, 6])],
            None,
            (0, 20, 4),
            (1, 0),
        ),
        # Within the window: page 5 holds sequence 1's positions 8..11, all still seen.
        (
            [decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 12, [0, 0, 5, 6])],
            8,
            (0, 20, 4),
            (1, 8),
        ),
    ],
)
def test_build_step_input_refuses_to_write_a_page_another_row_reads(
    chunks, window, written, reader
):
    """A page written in a step and read elsewhere in it (another page table, or the same
    one twice) gave the reader the writer's new K/V in place of its own, with no error
    (relative logit error ~0.66 against dense in a two-sequence probe)."""
    cfg = dataclasses.replace(TINY, sliding_window=window)
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    (x, slot, p), (y, q) = written, reader
    match = rf"sequence {x} writes cache slot {slot} \(position {p}\), which sequence {y} reads"
    with pytest.raises(ValueError, match=match + rf" as its position {q}: "):
        decode.build_step_input(chunks, cfg, cache_cfg)


@pytest.mark.parametrize(
    "chunks,window",
    [
        # Page 5 is in sequence 1's table past its length: not read.
        ([decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 4, [3, 6, 5])], None),
        # Window 4: sequence 1 at 12 sees 9..12, not page 5 (4..7) nor the released 0s.
        ([decode.SeqChunk([1], 4, [3, 5]), decode.SeqChunk([2], 12, [0, 5, 7, 6])], 4),
        ([decode.SeqChunk([1], 0, [0]), decode.SeqChunk([2], 12, [0, 0, 7, 6])], 4),
    ],
)
def test_build_step_input_allows_pages_no_one_reads_where_they_are_written(chunks, window):
    cfg = dataclasses.replace(TINY, sliding_window=window)
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    decode.build_step_input(chunks, cfg, cache_cfg)


def test_build_step_input_takes_numpy_copies_buckets_and_mixed_int_types():
    cache_cfg = CacheConfig(page_size=4, num_pages=32, dtype="float32")
    chunks = [decode.SeqChunk([1], 5, [1, 2]), decode.SeqChunk([2], 3, [4])]
    want = decode.build_step_input(chunks, TINY, cache_cfg, copies=[(7, 8)])
    # numpy pairs were "truth value of an array is ambiguous", and numpy ints in Buckets
    # "must be a positive int".
    got = decode.build_step_input(
        chunks, TINY, cache_cfg, copies=np.array([[7, 8]]), buckets=decode.Buckets(np.int64(16))
    )
    for name in ("copy_src", "copy_dst", "positions", "slot_mapping"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    assert got.bucket == want.bucket
    # uint64 next to a Python int made a float64 array, then a bare StopIteration.
    chunks[0].start_pos = np.uint64(5)
    mixed = decode.build_step_input(chunks, TINY, cache_cfg, copies=np.zeros((0, 2), int))
    np.testing.assert_array_equal(mixed.positions, want.positions)
    np.testing.assert_array_equal(mixed.slot_mapping[:2], [9, 19])
    # Numpy and jax scalars are numbers (the type checks on sampling values take them).
    chunks[1] = decode.SeqChunk(
        [2], 3, [4], temperature=np.float32(0.5), top_k=np.int64(3), top_p=jnp.float32(0.5),
        seed=jnp.uint32(7), min_p=np.array(0.25), repetition_penalty=np.float64(1.5),
        logit_bias={np.int64(9): np.float32(2.0)},
    )  # fmt: skip
    scalars = decode.build_step_input(chunks, TINY, cache_cfg)
    assert (scalars.temperature[1], scalars.top_k[1], scalars.top_p[1]) == (0.5, 3, 0.5)
    assert (scalars.seeds[1], scalars.min_p[1], scalars.penalties.repetition[1]) == (7, 0.25, 1.5)
    assert scalars.logit_bias.ids[1, 0] == 9 and scalars.logit_bias.values[1, 0] == 2.0


def test_buckets_refuse_floors_that_cannot_be_packed():
    # Were taken, then a multi-gigabyte allocation or numpy's "array is too big" (the
    # padded sizes and offsets are int32).
    for name in ("min_tokens", "min_seqs", "min_pages", "min_copies", "min_history"):
        with pytest.raises(
            ValueError, match=rf"{name} must be at most 2\*\*30 .*{name}=2147483648"
        ):
            decode.Buckets(**{name: 2**31})
    assert decode.Buckets(min_tokens=2**30).min_tokens == 2**30
