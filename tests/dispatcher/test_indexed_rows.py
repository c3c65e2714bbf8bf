"""The `IndexedRows` hand-off (`dispatcher/common/handoff.py`): experts that gather their own rows
get the same outputs and gradients as from the dispatcher's permuted rows, at EP1 and EP2
(gloo), in the dropless, capacity and budget modes (rank bodies: indexed_rows_ranks.py)."""

import pytest

from tests.dispatcher import indexed_rows_ranks


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", list(indexed_rows_ranks.MODES))
def test_indexed_rows_match_the_permuting_path(dist_pools, world, mode):
    for rank, r in enumerate(dist_pools(world).run(indexed_rows_ranks.indexed_vs_permuted, mode)):
        assert r["indexed"] and r["maps_consistent"], (rank, r)
        assert r["num_permuted"] == r["permuted_rows"][0], (rank, r)
        # The forward sums each row's outputs in the same order on both paths: bitwise.
        assert r["bitwise"]["y"], (rank, r)
        for name, err in r["diffs"].items():
            assert err <= 1e-6, (rank, name, r)


def test_backends_that_permute_in_their_communication_refuse_indexed_rows(dist_pools):
    for message in dist_pools(2).run(indexed_rows_ranks.hybridep_refuses_indexed_rows):
        assert message is not None and "hand_indexed_rows" in message and "'hybridep'" in message


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("policy", ["save_dispatch_outputs", "recompute_all"])
def test_indexed_rows_under_checkpoint_match_no_checkpoint(dist_pools, world, policy):
    for rank, r in enumerate(dist_pools(world).run(indexed_rows_ranks.indexed_rows_under_checkpoint, policy)):
        # save_dispatch_outputs keeps the IndexedRows (received rows and maps), never permuted rows.
        assert r["kept"] == (["IndexedRows"] if policy == "save_dispatch_outputs" else ["NoneType"]), (rank, r)
        assert r["pending"] == 0 and max(r["diffs"]) <= 1e-6, (rank, r)
