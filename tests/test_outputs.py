"""pagedjax/outputs.py: the logprobs entry of one token (the rest runs in test_engine.py)."""

import numpy as np

from pagedjax.outputs import logprobs_entry


def test_logprobs_entry_puts_the_sampled_token_first_then_the_top_k_in_rank_order():
    top_ids = np.array([[9, 4, 7, 1], [3, 5, 6, 2]], np.int32)  # the step's k' = 4 >= k
    top_lps = np.array([[-0.1, -1.0, -2.0, -3.0], [-0.2, -0.9, -1.5, -4.0]], np.float32)
    e = logprobs_entry(7, -2.0, 3, top_ids, top_lps, 0)  # sampled: rank 3 of row 0
    assert list(e) == [7, 9, 4] and e[9] == np.float32(-0.1) and e[7] == -2.0
    e = logprobs_entry(8, -5.5, 2, top_ids, top_lps, 1)  # outside the top-k: k + 1
    assert list(e) == [8, 3, 5] and e[5] == np.float32(-0.9)
    assert logprobs_entry(3, -0.2, 0, None, None, 1) == {3: -0.2}  # k = 0: no top-k
