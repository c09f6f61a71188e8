"""The host's fast paths (review 30) against the per-row code they replace.

`SeqTables.page_tables` copies all mirrors at once when they are as long and the pad is
PAD_PAGE; `Tokenizer._index_ids` / `_check_ids` take a list of plain ints as it is. Each
must give what the per-row path gives, on random block-manager states and id lists.
"""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import computed
from test_tokenizer import byte_level_bpe

from pagedjax.blocks import BlockManager
from pagedjax.seq_pages import PAD_PAGE
from pagedjax.tokenizer import Tokenizer


def per_row_tables(bm: BlockManager, ids, width=None, pad=PAD_PAGE) -> np.ndarray:
    """`page_tables` as one row per sequence from `page_table` (-1 released: PAD_PAGE)."""
    rows = [[PAD_PAGE if p < 0 else p for p in bm.page_table(i)] for i in ids]
    width = max(map(len, rows), default=0) if width is None else width
    out = np.full((len(rows), width), pad, np.int32)
    for o, r in zip(out, rows, strict=True):
        o[: len(r)] = r
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_model_len", [None, 96])
def test_page_tables_equal_the_per_row_tables_on_random_states(seed, max_model_len):
    """Admits, appends (crossing pages, growing the mirrors), forks (copy-on-write),
    frees and windows at random; every batch of tables equals the per-row one, whether
    the mirrors are as long (max_model_len) or not (None: they double as they fill)."""
    rng = np.random.default_rng(seed)
    ps = 4
    bm = BlockManager(400, ps, max_model_len=max_model_len)
    live: list[str] = []
    for k in range(60):
        op = rng.integers(4)
        if op == 0 or len(live) < 3:
            sid = f"s{k}"
            computed(bm, sid, rng.integers(0, 50, int(rng.integers(1, 20))).tolist())
            live.append(sid)
        elif op == 1:
            batch = [s for s in live if bm.num_tokens(s) < 90]
            bm.append_tokens(batch, rng.integers(0, 50, len(batch)).tolist())
        elif op == 2:
            bm.fork(live[int(rng.integers(len(live)))], f"f{k}")
            live.append(f"f{k}")
        else:
            bm.free(live.pop(int(rng.integers(len(live)))))
        ids = [live[i] for i in rng.permutation(len(live))[: int(rng.integers(1, len(live) + 1))]]
        got = bm.page_tables(ids)
        assert got.dtype == np.int32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, per_row_tables(bm, ids))
        width = got.shape[1] + int(rng.integers(0, 3))
        np.testing.assert_array_equal(
            bm.page_tables(ids, width=width), per_row_tables(bm, ids, width)
        )
        np.testing.assert_array_equal(
            bm.page_tables(ids, width=width, pad=7), per_row_tables(bm, ids, width, pad=7)
        )
        bm.check_invariants()


def test_page_tables_of_released_pages_and_past_a_mirror_are_padded():
    """Released entries read PAD_PAGE; a width past the mirrors' length pads too."""
    bm = BlockManager(64, 4, max_model_len=16, sliding_window=4)
    computed(bm, "a", list(range(14)))
    computed(bm, "b", list(range(5)))
    bm.release_before("a", 9)
    want = per_row_tables(bm, ["a", "b"], 6)
    np.testing.assert_array_equal(bm.page_tables(["a", "b"], width=6), want)
    np.testing.assert_array_equal(bm.page_tables(["a", "b"]), want[:, :4])
    assert want[0, :2].tolist() == [PAD_PAGE, PAD_PAGE]
    bm.check_invariants()


def test_check_invariants_sees_a_mirror_stale_past_its_pages():
    """The fast copy reads the mirror past the pages: the check covers that part too."""
    bm = BlockManager(16, 4, max_model_len=32)
    computed(bm, "a", list(range(5)))
    bm.check_invariants()
    bm._seqs["a"].table[5] = 3
    with pytest.raises(Exception, match="past its pages"):
        bm.check_invariants()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(byte_level_bpe(False), bos_token_id=0, eos_token_ids=[1])


def per_id(tok, ids) -> list[int]:
    """`_check_ids` as each id would be checked: refused, or kept if a token has it."""
    out = []
    for i in ids:
        if isinstance(i, bool) or not hasattr(type(i), "__index__"):
            raise TypeError
        out.append(int(i))
    if any(i < 0 for i in out):
        raise ValueError
    return [i for i in out if i < tok.vocab_size and i not in tok._holes]


@pytest.mark.parametrize("seed", range(5))
def test_check_ids_equals_the_per_id_check_on_random_lists(tok, seed):
    rng = np.random.default_rng(seed)
    v = tok.vocab_size
    for _ in range(50):
        ids = rng.integers(0, v + 5 if rng.random() < 0.3 else v, int(rng.integers(0, 12))).tolist()
        kinds = rng.integers(0, 8, len(ids))
        ids = [
            np.int64(i) if k == 1 else -i - 1 if k == 2 and rng.random() < 0.2 else i
            for i, k in zip(ids, kinds, strict=True)
        ]
        if rng.random() < 0.1 and ids:
            ids[int(rng.integers(len(ids)))] = [True, 2.0, "3"][int(rng.integers(3))]
        try:
            want = per_id(tok, ids)
        except (TypeError, ValueError) as e:
            with pytest.raises(type(e)):
                tok._check_ids(ids)
            continue
        got = tok._check_ids(ids)
        assert got == want and all(type(i) is int for i in got)
        assert got is not ids  # (a new list: the caller's is never handed back)


def test_index_ids_errors_name_the_bad_id(tok):
    with pytest.raises(TypeError, match="got bool True"):
        tok._index_ids([3, True])
    with pytest.raises(ValueError, match=r"got \[-2\]"):
        tok._index_ids([3, -2])
    with pytest.raises(ValueError, match=r"got \[-2\]"):
        tok._index_ids([np.int32(3), -2])
    assert tok.decode([]) == ""
