"""How the block-accuracy benchmark counts what a block file reads: a selection reads every block holding one of its
entries (the valid slots only), and a local layer reads the blocks its window lies in."""
from __future__ import annotations

import torch


def _row(n: int, kept: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    keep[..., kept] = True
    return keep, torch.ones(1, 1, 1, n, dtype=torch.bool)


def test_a_selection_reads_the_valid_slots_of_every_block_it_touches(block_accuracy):
    tally = block_accuracy.BlockTally(16)
    tally.add(*_row(40, [3, 35]))  # blocks 0..15 and 32..39 (the last one holds 8 valid slots)
    assert (tally.attended, tally.read, tally.valid) == (2, 24, 40)


def test_a_local_layer_reads_the_blocks_its_window_lies_in(block_accuracy):
    tally = block_accuracy.BlockTally(16, windows=(20, 64))
    tally.add(*_row(40, [0]))
    # window 20: positions 21..39, in the blocks from 16 on -> 24 slots; window 64 covers all 40
    assert tally.window_read == [24, 40]
    # one selecting layer (16 of 40) and the two windows (24 and 40 of 40), averaged over the three layers
    assert abs(tally.all_layers(1) - (16 + 24 + 40) / 120) < 1e-12
