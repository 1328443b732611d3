"""Tokens within fetched blocks (InfiniGen's `block_fetch`): the blocks read are chosen in blocks, and what
attention attends is the token rule's selection restricted to them: a subset of the fetched blocks, equal to
an independent top-mass cut over their qualifying tokens. On the block layout the file reads exactly the units
holding an attended entry, the tokens are those of the same policy in RAM, and an unlimited budget is dense."""
from __future__ import annotations

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import infinigen_select as select
from infinigen.policies import make_policy
from infinigen.selection import ALL

from support.offload import B, GEN, PROMPT, offload_policy, offload_prompts, run_placed

BLOCK = 4


def _scores(seed: int, b=2, hkv=2, g=3, s=64):
    """Speculated scores [B, Hkv, G, 1, S] with a few peaked slots per head (a realistic selection) and a
    valid mask with some padding in batch row 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, hkv, g, 1, s, generator=gen) * 2
    x += (torch.rand(b, hkv, 1, 1, s, generator=gen) < 0.15) * 6
    valid = torch.ones(b, hkv, 1, s, dtype=torch.bool)
    valid[0, :, :, :5] = False
    return x, valid


def _reference(s, valid, alpha, totals, fetched):
    """The token rule written out: per (batch row, decoding row), over (KV head, slot), the valid slots of a
    fetched block within `alpha` of their query head's maximum (over every valid slot) somewhere in the
    group, the `totals[batch row]` with the most speculated mass (the group's softmax weights summed) kept, ties to the
    lower (KV head, slot)."""
    rel = s.float().masked_fill(~valid[:, :, None], float("-inf"))
    rel = rel - rel.amax(-1, keepdim=True)
    qualifies = (rel.amax(2) > -alpha) & fetched & valid  # [B, Hkv, R, S]
    mass = rel.softmax(-1).sum(2)
    b, hkv, r, n = qualifies.shape
    out = torch.zeros_like(qualifies)
    for bi in range(b):
        for ri in range(r):
            cand = [(-float(mass[bi, h, ri, j]), h, j) for h in range(hkv) for j in range(n) if qualifies[bi, h, ri, j]]
            for _, h, j in sorted(cand)[:totals[bi]]:
                out[bi, h, ri, j] = True
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fetch", [1.0, 2.0, 3.0])
def test_attended_tokens_are_the_token_rule_within_the_fetched_blocks(seed, fetch):
    s, valid = _scores(seed)
    alpha, ratio = 7.0, 0.1
    totals = [int(ratio * int(valid[b].sum())) for b in range(valid.shape[0])]  # per batch row, over its KV heads
    keep = select.choose(s.clone(), valid, alpha, "layer", ratio, 0, BLOCK, block_fetch=fetch)
    # the fetched blocks: chosen as block selection chooses them, at `fetch` times the cap
    rel = s.float().masked_fill(~valid[:, :, None], float("-inf"))
    rel = rel - rel.amax(-1, keepdim=True)
    caps = torch.tensor([[int(t * fetch)] for t in totals])
    fetched = select.choose_blocks(rel, rel.amax(2) > -alpha, valid, caps, BLOCK)
    assert not (keep & ~fetched).any()  # attended within the fetched blocks
    assert torch.equal(keep, _reference(s, valid, alpha, totals, fetched))
    assert all(k <= t for k, t in zip(keep.sum((1, 2, 3)).tolist(), totals))  # at most the cap per batch row
    if fetch > 1:  # a real restriction: the blocks read hold more than what is attended
        assert int(fetched.sum()) > int(keep.sum())


def test_unrestricting_blocks_give_the_token_rule():
    """Blocks holding every token: the attended set is the token-level selection itself."""
    s, valid = _scores(4)
    token = select.choose(s.clone(), valid, 7.0, "layer", 0.1, 0, 1)
    within = select.choose(s.clone(), valid, 7.0, "layer", 0.1, 0, BLOCK, block_fetch=1000.0)
    assert torch.equal(token, within)
    blocks = select.choose(s.clone(), valid, 7.0, "layer", 0.1, 0, BLOCK)
    assert not torch.equal(blocks, within)  # blocks read whole attend more


def _policy(model, **kw):
    mats = offload_policy("infinigen", model).matrices
    knobs = dict(preset="flat", dense_layers=(0,), min_fetch=0, budget="layer", block=BLOCK, block_fetch=2.0,
                 max_fetch_ratio=0.3) | kw
    return make_policy("infinigen", **knobs).with_skew(mats)


def test_block_fetch_on_disk_same_tokens_and_reads_the_attended_units(tiny_llama, tmp_path):
    """On the block layout: the same tokens as in RAM, and per step the file reads exactly the units that
    hold an attended valid entry (less the open blocks, in memory)."""
    _, model = tiny_llama
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), _policy(model))
    want, attended = [0], [0]

    class Units(runtime.Listener):
        def on_select(self, layer, rows, keep, s):
            store = s.store
            n, bs = store.length[layer], store.block
            chosen = (torch.ones(store.batch, store.kv_heads, n, dtype=torch.bool) if keep is ALL
                      else store.valid[layer][:, :, :n] & keep[:, :, 0, :n])
            attended[0] += int(chosen.sum())
            nb = -(-n // bs)
            per_block = torch.nn.functional.pad(chosen, (0, nb * bs - n)).view(store.bh, nb, bs).any(-1)
            if n < store.capacity:
                per_block[:, n // bs:] = False
            want[0] += int(per_block.sum())

    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK, threaded=False)
    tokens, pad = offload_prompts()
    sess = pl.new_session(model, B, PROMPT + GEN, _policy(model), listeners=[Units()])
    logits = runtime.prefill(model, tokens, sess, pad)
    sess.store.stats.reset()
    out, steps = [], []
    for _ in range(GEN):
        t = logits.argmax(-1)
        out.append(t)
        logits = runtime.decode(model, t, sess)
        steps.append(logits)
    assert torch.equal(torch.stack(out, 1), ref_tokens)
    assert torch.allclose(torch.stack(steps, 1), ref_logits, atol=1e-5, rtol=0)
    assert sess.store.stats.blocks == want[0] > 0
    pl.close(sess)


def test_unlimited_block_fetch_is_dense(tiny_llama, tmp_path):
    _, model = tiny_llama
    _, ref_logits, _ = run_placed(model, Placement("none"), make_policy("full"))
    pol = _policy(model, alpha=1e9, max_fetch_ratio=1.0)
    _, logits, _ = run_placed(model, Placement("disk", pool_dir=str(tmp_path), disk_block=BLOCK), pol)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)


def test_block_fetch_needs_blocks():
    from infinigen.errors import UserError
    with pytest.raises(UserError, match="block_fetch needs block selection"):
        make_policy("infinigen", block_fetch=2.0)
