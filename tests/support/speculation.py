"""InfiniGen's tests' common parts: random orthogonal skew matrices (no calibration needed, the maths is the
same), random tokens, a recorder of a policy's selections, and decoding after a prefill."""
from __future__ import annotations

import torch

from infinigen import runtime
from infinigen.cache import SelectedRows
from infinigen.placement import Placement

T, P = 36, 12  # sequence length, prompt length


def random_skew(model, seed=3):
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]


def random_tokens(model, b=2, t=T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (b, t), generator=g)


def record_selections(pol):
    """Wrap the policy's `keep` so a run leaves its selections in `pol.seen`: layer -> list of masks."""
    object.__setattr__(pol, "seen", {})  # policies are frozen: test attributes all the same
    inner = pol.keep

    def keep(layer, rows, sess):
        out = inner(layer, rows, sess)
        if rows.in_store:  # decoding: one row over the store's slots (or its rows packed: their mask)
            mask = out.keep if isinstance(out, SelectedRows) else out[:, :, 0]
            pol.seen.setdefault(layer, []).append(mask.clone())
        else:  # teacher-forced: every row at once
            pol.seen[layer] = [out[:, :, r, :rows.first + r] for r in range(out.shape[2])]
        return out
    object.__setattr__(pol, "keep", keep)
    return pol


def prefill_then_decode(model, pol, tokens, p=P):
    """Prefill the first `p` tokens, then decode the rest but the last one: the logits [B, T-p, V] and the
    session."""
    sess = Placement().new_session(model, tokens.shape[0], tokens.shape[1], pol)
    logits = [runtime.prefill(model, tokens[:, :p], sess)]
    for t in range(p, tokens.shape[1] - 1):
        logits.append(runtime.decode(model, tokens[:, t], sess))
    return torch.stack(logits, 1), sess
