"""When a calibration candidate's verdict is certain before its last row: the paired test that stops its pass.

A candidate's verdict is whether its mean NLL over the window's N tokens stays within the target of the full
cache's: whether the mean of the per-token differences (candidate less full cache, paired on the same tokens: the
shared dense pass gives the full cache's) is at most log1p(target). The candidate's pass runs its rows in blocks
(`calibrate.score_rows`); after each block, `misses_certainly` asks whether the mean over all N tokens exceeds
that margin at `CONFIDENCE`, from the tokens scored so far: the observed ones are known exactly, the rest
predicted from them (a prediction interval for their mean: the uncertainty of the observed mean and the spread of
N - n more tokens around it). Neighbouring tokens' differences correlate (a candidate's error on one token's keys
and values reaches the tokens after it), so the spread is measured on means of BATCH consecutive tokens, and the
quantile is Student's t with as many degrees of freedom as batches less one, at 1 - (1 - CONFIDENCE) / looks
for the looks a pass may take (so CONFIDENCE holds over all of them).

Only a miss stops a candidate: one certain to reach the target runs to the end, because the search ranks those by
what they read over the whole run (a row reads a larger share of a shorter past: the reads of the first rows
overstate a run's) and records the chosen one's loss and reads. A close candidate never stops, so its verdict is
the one-pass verdict; a stopped miss's loss is an estimate from its tokens, which the search still compares with
other misses' (which way to read layer 0, where the remainder starts, the lowest loss where none reaches the
target). How early a miss stops depends on how much a selection moves each token's loss against how far the
candidate is from the target: on SmolLM2's calibration text, late or not at all
(results/calibration/calibration_early_stop.md).
"""
from __future__ import annotations

import math
from statistics import NormalDist

import torch

CONFIDENCE = 0.999  # of a stopped candidate's miss, over every look of its pass
MIN_ROWS = 512  # tokens a candidate scores at least before it may stop
BATCH = 32  # consecutive tokens averaged into one observation of the spread


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile at probability p with df degrees of freedom: the normal quantile's Cornish-Fisher
    expansion in 1/df (Abramowitz and Stegun 26.7.5; within 0.5% from df 15 on at p 0.999 and 0.9999)."""
    z = NormalDist().inv_cdf(p)
    terms = ((z ** 3 + z) / 4, (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96,
             (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384,
             (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160)
    return z + sum(c / df ** (i + 1) for i, c in enumerate(terms))


def lower_bound(diffs: torch.Tensor, total: int, confidence: float, batch: int) -> float:
    """A lower bound at `confidence` on the mean of `total` per-token differences whose first ones are `diffs`;
    -inf where fewer than two batches are observed; their mean itself once every token is."""
    n = diffs.numel()
    mean = float(diffs.double().mean())
    if n >= total:
        return mean
    k = n // batch
    if k < 2:
        return -math.inf
    spread = float(diffs[:k * batch].double().view(k, batch).mean(1).std())  # of a batch's mean
    # the rest's mean: the observed mean's error (k batches) and the rest's own spread ((total - n) / batch of them)
    rest_error = spread * math.sqrt(1 / k + batch / (total - n))
    return mean - t_quantile(confidence, k - 1) * rest_error * (total - n) / total


def misses_certainly(diffs: torch.Tensor, total: int, margin: float, looks: int = 1) -> bool:
    """Whether the mean of `total` per-token loss differences (candidate less full cache), `diffs` the first ones
    (at least MIN_ROWS of them), exceeds `margin` at CONFIDENCE over the `looks` times a pass may ask (each asked
    at 1 - (1 - CONFIDENCE) / looks): the candidate certainly misses its target."""
    if diffs.numel() < min(MIN_ROWS, total):
        return False
    return lower_bound(diffs, total, 1 - (1 - CONFIDENCE) / max(1, looks), BATCH) > margin


def looks_of(total: int, block_rows: int) -> int:
    """How many times a pass over `total` tokens in blocks of `block_rows` rows may ask `misses_certainly`: after
    each block but the last once MIN_ROWS tokens are scored."""
    return max(1, math.ceil(max(0, total - MIN_ROWS) / block_rows))
