"""The prefix cache with conversations on disk (`serve --kv-offload disk --disk-block N`): a hit is written into
the request's pool file a cached block at a time (whole file blocks, positioned writes), never copied whole into
memory first, and the prefill of the rest reads the prefix back from the file one layer at a time.

- a prefix written in chunks that start and end anywhere in a file block reads back as it was written;
- requests sharing a document on block pools hit the cache and get exactly the tokens of the same request
  alone without any cache;
- the memory a hit takes (the process's peak resident set while it is prefilled) stays a small part of the
  prefix's KV, where copying the prefix whole (the RAM-copy restore) takes at least all of it.
Mechanics on tiny models, no timing."""
from __future__ import annotations

import os

import pytest
import torch

from infinigen.generate import Sampling, generate_ids
from infinigen.memory import MemoryProbe, release_free_heap
from infinigen.placement import BlockedKVStore, Placement, SlowTier
from infinigen.policies import make_policy
from infinigen.serve.engine import Engine, Request


def _tokens(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _run(eng: Engine, req: Request) -> Request:
    eng.submit(req)
    while not eng.idle():
        eng.step()
    assert req.finish == "length", req.finish
    return req


@pytest.mark.parametrize("block,chunks", [(16, (16, 32, 5)), (16, (7, 9, 30, 1)), (5, (3, 12, 13))])
def test_a_prefix_written_in_chunks_reads_back_as_written(tmp_path, block, chunks):
    """`write_prompt(at=)` chunk after chunk (ending inside a file block, exactly on one, or filling the pool to
    its last, partial block) and `keys_values` over any span give back the rows, as a prompt written whole does."""
    layers, kv_heads, d = 2, 3, 8
    capacity = sum(chunks)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(layers, 1, kv_heads, capacity, d, generator=g)
    v = torch.randn(layers, 1, kv_heads, capacity, d, generator=g)

    def store():
        return BlockedKVStore(layers, 1, kv_heads, capacity, d, torch.float32,
                              tier=SlowTier("disk", directory=tmp_path), block=block, threaded=False)

    parts, whole = store(), store()
    valid = torch.ones(1, capacity, dtype=torch.bool)
    at = 0
    for n in chunks:
        for layer in range(layers):
            parts.write_prompt(layer, k[layer, :, :, at:at + n], v[layer, :, :, at:at + n], valid[:, :n],
                               torch.arange(at, at + n)[None], at=at)
        at += n
    for layer in range(layers):
        whole.write_prompt(layer, k[layer], v[layer], valid, torch.arange(capacity)[None])
    for s in (parts, whole):
        for layer in range(layers):
            assert s.length[layer] == capacity and bool(s.valid[layer].all())
            assert torch.equal(s.pos[layer][0, 0], torch.arange(capacity))
            for lo, hi in ((0, capacity), (1, capacity - 1), (block - 1, block + 1), (capacity - 1, capacity)):
                got_k, got_v = s.keys_values(layer, lo, hi)
                assert torch.equal(got_k, k[layer, :, :, lo:hi]) and torch.equal(got_v, v[layer, :, :, lo:hi])
        s.close()
    assert os.listdir(tmp_path) == []


def _policy(name, model):
    if name == "infinigen":  # 4-bit speculation keys over random skew matrices: a real subset on short prompts
        c = model.cfg
        g = torch.Generator().manual_seed(3)
        mats = torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                           dtype=torch.float64))[0]
        return make_policy("infinigen", dense_layers=(0,), alpha=1.0).with_skew(mats)
    if name == "streaming":
        return make_policy("streaming", sinks=4, window=12)
    return make_policy(name)


@pytest.mark.parametrize("policy", ["full", "streaming", "infinigen"])
@pytest.mark.parametrize("prefix_block", [32, 24])
def test_requests_sharing_a_document_on_block_pools_hit_and_get_their_tokens_alone(make_tiny, tmp_path, policy,
                                                                                  prefix_block):
    """Three questions about one document, one after another and two side by side, on pools of 16-token file
    blocks: the later ones restore the document's cached blocks into their files (cache blocks of 32 tokens:
    whole file blocks; of 24: ending inside one) and prefill only what follows; every answer is the same
    request's alone, with no cache."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    pol = _policy(policy, model)
    placement = Placement(kv_offload="disk", disk_block=16, pool_dir=str(tmp_path / "pool"))
    eng = Engine(model, pol, placement, max_batch=4, prefix_block=prefix_block)
    assert eng.prefix is not None
    vocab = model.cfg.vocab_size
    doc = _tokens(vocab, 100, seed=7)
    questions = [_tokens(vocab, n, seed=s) for n, s in ((5, 8), (9, 9), (3, 10))]
    first = _run(eng, Request(doc + questions[0], 8))
    later = [eng.submit(Request(doc + q, 8)) for q in questions[1:]]
    while not eng.idle():
        eng.step()
    s = eng.snapshot()
    cached = (100 // prefix_block) * prefix_block
    assert s["prefix_cache_hits"] == 2 and s["prefix_cache_hit_tokens"] == 2 * cached
    for req, q in zip([first] + later, questions):
        alone = generate_ids(model, [doc + q], 8, Sampling(), pol, placement=placement).tokens[0]
        assert req.finish == "length" and req.tokens == alone, (policy, len(q))
    assert os.listdir(tmp_path / "pool") == []


def test_a_hit_does_not_copy_the_prefix_whole_into_memory(make_tiny, tmp_path):
    """A 2048-token document cached, then a question about it on a block pool: the process's peak resident set
    while the hit is restored and prefilled grows by less than a third of the document's KV (every layer's
    keys and values), and the answer is the one without a cache. Restoring it as one copy of the whole prefix
    per layer (`lookup` + `restore_prefix`) takes at least the whole KV again."""
    _, model = make_tiny("llama", num_hidden_layers=16, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=4096)
    pol = make_policy("streaming", sinks=4, window=16)
    placement = Placement(kv_offload="disk", disk_block=16, pool_dir=str(tmp_path / "pool"))
    eng = Engine(model, pol, placement, prefix_block=256, prefix_cache_bytes=1 << 30)
    vocab = model.cfg.vocab_size
    doc, question = _tokens(vocab, 2048, seed=1), _tokens(vocab, 8, seed=2)
    _run(eng, Request(doc + [5], 2))
    c = model.cfg
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * len(doc)  # float32 keys and values, every layer
    assert eng.snapshot()["prefix_cache_bytes"] == kv
    _run(eng, Request(doc[:64] + [5], 2))  # the engine's buffers and allocator warm at this size
    probe = MemoryProbe(torch.device("cpu"))
    release_free_heap()
    probe.reset()
    base = probe.peak()
    hit = _run(eng, Request(doc + question, 4))
    grew = probe.peak() - base
    assert eng.snapshot()["prefix_cache_hit_tokens"] == 2048
    assert grew < kv / 3, (grew, kv)  # about a fifth here: one layer's prefix read back, the heap's slack
    alone = generate_ids(model, [doc + question], 4, Sampling(), pol, placement=placement).tokens[0]
    assert hit.tokens == alone


def test_blocks_kept_in_the_cache_folder_are_restored_into_a_block_pool_after_a_restart(make_tiny, tmp_path):
    """`--prefix-cache-dir` with block pools: a restarted server (a new engine over the same folder) finds the
    document's blocks there, writes them into the new request's pool file, and answers as with no cache."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    pol = make_policy("full")
    placement = Placement(kv_offload="disk", disk_block=16, pool_dir=str(tmp_path / "pool"))
    vocab = model.cfg.vocab_size
    doc, question = _tokens(vocab, 70, seed=4), _tokens(vocab, 6, seed=6)
    before = Engine(model, pol, placement, prefix_block=32, prefix_cache_dir=tmp_path / "prefixes")
    _run(before, Request(doc + [5], 2))
    before.stop()  # the folder's writer finishes
    after = Engine(model, pol, placement, prefix_block=32, prefix_cache_dir=tmp_path / "prefixes")
    hit = _run(after, Request(doc + question, 6))
    s = after.snapshot()
    assert s["prefix_cache_disk_hits"] == 1 and s["prefix_cache_disk_hit_tokens"] == 64
    assert hit.tokens == generate_ids(model, [doc + question], 6, Sampling(), pol, placement=placement).tokens[0]
    after.stop()
    assert os.listdir(tmp_path / "pool") == []
