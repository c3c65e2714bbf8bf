"""HybridEP at 0 tokens (issue 39), on real gloo ranks with the HybridEPBuffer test double and
bounded collectives: a rank with 0 tokens whose input is refused tells its peers in every
HybridEP mode (it used to read row 0 of an empty routing map, and its peers waited in their
dispatch until the group's timeout), and 0 tokens on every rank gives empty outputs and
gradients as the other backends do (the double used to fail reshaping 0 elements)."""

import pytest

from tests.dispatcher import hybridep_zero_ranks as ranks

MODES = tuple(ranks.MODES)


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_at_zero_tokens_gives_empty_outputs(dist_pools, mode):
    for r in dist_pools(2).run(ranks.every_rank_empty, mode, timeout=120):
        for step in r["steps"]:
            assert step == {
                "y": (0, ranks.HIDDEN),
                "dtype": "torch.bfloat16",
                "x_grad": (0, ranks.HIDDEN),
                "probs_grad": (0, ranks.TOPK),
            }


def _assert_agreed(results, field):
    last = len(results) - 1
    for r in results:
        assert r["error"] is not None and r["agreed"], r
        assert field in r["error"] and f"rank(s) [{last}]" in r["error"], r["error"]


@pytest.mark.parametrize("mode", MODES)
def test_refused_input_on_a_zero_token_rank_reaches_every_rank(dist_pools, mode):
    """Every rank at 0 tokens (the step before pins or calibrates there), then the last rank's
    token ids are refused: every rank raises the same error naming that rank."""
    _assert_agreed(dist_pools(2).run(ranks.refused_input_at_tokens, mode, (0, (0, 0)), timeout=120), "token_indices")


def test_refused_input_at_zero_tokens_with_equal_counts_does_not_hang(dist_pools):
    """The issue's case: equal counts, 0 tokens, the first step's input refused on one rank."""
    _assert_agreed(
        dist_pools(2).run(ranks.refused_input_at_tokens, "equal_token_counts", (None, (0, 0)), timeout=120),
        "token_indices",
    )


@pytest.mark.parametrize("mode", ["capacity", "static_pin"])
def test_refused_input_on_a_zero_token_rank_after_a_pin(dist_pools, mode):
    """Pinned at 8 tokens, then one rank has 8 tokens and the refusing rank 0."""
    _assert_agreed(dist_pools(2).run(ranks.refused_input_at_tokens, mode, (8, (8, 0)), timeout=120), "token_indices")


@pytest.mark.parametrize("mode", ["equal_token_counts", "capacity"])
def test_refused_fp32_rows_reach_every_rank(dist_pools, mode):
    """Rows HybridEP cannot send (fp32) are refused; the announcement still goes out in 16-bit
    rows (it used to return without sending, leaving the peers in their dispatch)."""
    _assert_agreed(
        dist_pools(2).run(ranks.refused_input_at_tokens, mode, (4, (4, 4)), True, timeout=120), "hidden_states"
    )


def test_double_passes_zero_tokens_through(dist_pools):
    for r in dist_pools(2).run(ranks.double_passes_zero_tokens, timeout=120):
        assert r == {"rows": (0, ranks.HIDDEN), "counts": [0, 0], "y": (0, ranks.HIDDEN), "y_probs": (0, 4)}
