"""What a dispatcher hands experts that gather their own rows (the fused expert path,
`experts/fused_mlp.py`): `IndexedRows`, the received rows as they arrived plus the index maps,
instead of the `[P, H]` permuted copy. The experts still return `[P, H]` outputs in permuted
order (prob applied); the combine sums them back along `slot_of_row_RJ` (no atomics).

Legend: R received rows, H hidden, P permuted rows (positions), J slots per received row
(the top-k width the backend delivers), e local experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_moe_ext.dispatcher.common.permute import TokenCounts


@dataclass(frozen=True)
class IndexedRows:
    """Received rows plus the maps that say which row each permuted position reads.

    rows_RH: [R, H] the rows the backend delivered, in its order (not permuted).
    row_of_slot_P: int32 [P], the received row that permuted position p reads. Positions
        grouped contiguously by local expert, `tokens_per_expert` of them each; positions past
        `sum(tokens_per_expert)` (fixed-shape padding) read row 0 and carry prob 0.
    slot_of_row_RJ: int64 [R, J], the permuted positions of each received row's slots, -1
        where a slot goes to no local expert: the combine's gather-and-sum map, and the map of
        the gather's backward (the gradient of a row is the sum over its positions).
    tokens_per_expert: [e] counts, a host list, CPU tensor or device tensor.
    probs_P: fp32 [P] routing prob of each position (0 on padding).
    """

    rows_RH: torch.Tensor
    row_of_slot_P: torch.Tensor
    slot_of_row_RJ: torch.Tensor
    tokens_per_expert: TokenCounts
    probs_P: torch.Tensor

    @property
    def num_permuted(self) -> int:
        return self.row_of_slot_P.shape[0]


def indexed_rows(
    rows_RH: torch.Tensor,
    probs_P: torch.Tensor,
    row_of_slot_P: torch.Tensor,
    slot_of_row_RJ: torch.Tensor,
    tokens_per_expert: TokenCounts,
) -> IndexedRows:
    """`IndexedRows` from a permutation's maps, whose "none" is one past the end (R in
    `row_of_slot_P`, as `permute.gather_rows` takes it; P in `slot_of_row_RJ`, as
    `permute.gather_sum` takes it): padding reads row 0 and an unused slot is -1 here."""
    num_rows, num_permuted = rows_RH.shape[0], row_of_slot_P.shape[0]
    return IndexedRows(
        rows_RH,
        torch.where(row_of_slot_P < num_rows, row_of_slot_P, 0).int(),
        torch.where(slot_of_row_RJ < num_permuted, slot_of_row_RJ, -1),
        tokens_per_expert,
        probs_P,
    )
