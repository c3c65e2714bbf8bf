"""Shared cases and float64 references for the bias tests (test_bias.py, test_kernels.py)."""

from __future__ import annotations

import torch

# Segment sizes around the kernels' 32-row lane blocks and the 4096-row fallback chunks.
SEGMENT_SIZES = [0, 1, 127, 128, 129, 4096, 3]


def reference_bias_add(value, bias, counts, probs):
    """`value + prob * bias` expert by expert in float64; rows past the counts untouched."""
    out = value.double().clone()
    start = 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        weight = probs[rows].double() if probs is not None else 1.0
        out[rows] += weight * bias[expert].double()
        start += count
    return out


def reference_bias_grad(grad, counts, probs):
    """Per-expert float64 sum of `grad * prob` over the expert's rows."""
    sums, start = [], 0
    for count in counts:
        rows = slice(start, start + count)
        weight = probs[rows].double() if probs is not None else 1.0
        sums.append((grad[rows].double() * weight).sum(0))
        start += count
    return torch.stack(sums)


def reference_probs_grad(grad, bias, counts, rows_total):
    out = torch.zeros(rows_total, 1, dtype=torch.float64)
    start = 0
    for expert, count in enumerate(counts):
        rows = slice(start, start + count)
        out[rows] = (grad[rows].double() * bias[expert].double()).sum(-1, keepdim=True)
        start += count
    return out


def cancellation_case(hidden: int = 4) -> torch.Tensor:
    """`[5120, hidden]` fp32 rows whose running sum climbs to 3072 and falls back near 1024.

    Added one row at a time in fp32, each 0.9999 lands on a grid of 2^-12 around 2048..3072
    and rounds to 1.0, so the naive sum ends at exactly 1024; the true sum is 1023.8976.
    """
    column = torch.cat([torch.ones(2048), torch.full((1024,), 0.9999), -torch.ones(2048)])
    return column[:, None].repeat(1, hidden).float()


def naive_fp32_sum(rows: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(rows.shape[1], dtype=torch.float32)
    for row in rows:
        total += row
    return total
