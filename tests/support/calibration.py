"""What the calibration tests share: the reference length of their tiny texts, the tokens, and a selecting
InfiniGen with calibration off whose knobs a test overrides."""
from __future__ import annotations

import torch

from infinigen.policies.infinigen import InfiniGen

REF = 96  # tokens of a tiny calibration text (the budget's reference length)


def calibration_tokens() -> torch.Tensor:
    return torch.randint(0, 256, (1, REF), generator=torch.Generator().manual_seed(3))


def selecting_policy(**knobs) -> InfiniGen:
    return InfiniGen(**(dict(skew=False, budget_ref=REF, min_fetch=0, alpha=5.0, kv_budget=0.3, budget_growth=0.5,
                             calibrate=False, dense_below=0) | knobs))
