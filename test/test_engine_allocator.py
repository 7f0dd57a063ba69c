"""Property tests of the page allocator, copy-on-write forks and the prefix tree (hypothesis)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oxygen_ros.engine import BlockPool, BlockPoolExhausted, KVCacheManager, PrefixCache

BLOCK = 4


def _pool(num_blocks):
    # 1 layer, 1 KV head, head_dim 2, fp32: 2 * 4 * 2 * 4 B = 64 B per page.
    return BlockPool(1, 1, 2, BLOCK, budget_bytes=64 * num_blocks)


def _check_pool(pool, live):
    """Every page free xor referenced; reference counts equal the live block-table references."""
    refs = [0] * pool.num_blocks
    for seq in live:
        for block in seq.block_table:
            refs[block] += 1
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == refs
    assert all(r >= 0 for r in refs)
    assert pool.num_free == refs.count(0)


def _append(manager, seq, values):
    """Append tokens whose K equals ``values`` through a paged view (as a model forward would)."""
    manager.prepare_append(seq, len(values))
    view = manager.view([seq], [len(values)])
    k = torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1).expand(1, len(values), 1, 2)
    view.attend(0, k.contiguous(), k.contiguous())
    view.commit()


def _read(manager, seq):
    k, _, valid = manager.view([seq]).read(0)
    return k[0, valid[0], 0, 0].tolist()


operations = st.lists(st.tuples(st.sampled_from(["new", "fork", "append", "free"]),
                                st.integers(0, 7), st.integers(1, 9)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=operations)
def test_forks_never_see_each_other_and_counts_stay_exact(num_blocks, ops):
    pool = _pool(num_blocks)
    manager = KVCacheManager(pool)
    live, expected = [], {}
    token = 0.0
    for op, pick, n in ops:
        if op == "new" or not live:
            seq = manager.new_sequence()
            live.append(seq)
            expected[id(seq)] = []
        elif op == "fork":
            parent = live[pick % len(live)]
            child = manager.fork(parent)
            live.append(child)
            expected[id(child)] = list(expected[id(parent)])
        elif op == "append":
            seq = live[pick % len(live)]
            values = [token + i for i in range(n)]
            token += n
            before = (list(seq.block_table), seq.num_tokens, pool.num_free)
            if manager.append_blocks_needed(seq, n) > pool.num_free:
                with pytest.raises(BlockPoolExhausted):
                    manager.prepare_append(seq, n)
                assert (seq.block_table, seq.num_tokens, pool.num_free) == before
            else:
                _append(manager, seq, values)
                expected[id(seq)].extend(values)
        else:
            seq = live.pop(pick % len(live))
            manager.free(seq)
            del expected[id(seq)]
        _check_pool(pool, live)
        for seq in live:
            if seq.num_tokens:
                assert _read(manager, seq) == expected[id(seq)]
    for seq in live:
        manager.free(seq)
    assert pool.num_free == pool.num_blocks


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 10), asks=st.lists(st.integers(0, 6), max_size=12))
def test_allocation_is_all_or_nothing_at_the_budget(num_blocks, asks):
    pool = _pool(num_blocks)
    held = []
    for n in asks:
        free = pool.num_free
        if n > free:
            with pytest.raises(BlockPoolExhausted):
                pool.allocate(n)
            assert pool.num_free == free
        else:
            blocks = pool.allocate(n)
            assert len(set(blocks)) == n and not set(blocks) & {b for h in held for b in h}
            held.append(blocks)
    for blocks in held:
        pool.release(blocks)
    assert pool.num_free == pool.num_blocks
    if pool.num_blocks:
        with pytest.raises(ValueError):
            pool.release([0])


def test_budget_below_one_page_is_an_error():
    with pytest.raises(ValueError, match="below one page"):
        BlockPool(2, 1, 64, 16, budget_bytes=100)


@settings(max_examples=40, deadline=None)
@given(prefix=st.integers(1, 11), prompts=st.lists(st.integers(1, 7), min_size=1, max_size=4))
def test_prefix_tree_forks_share_images_and_free_on_last_reference(prefix, prompts):
    pool = _pool(32)
    manager = KVCacheManager(pool)
    tree = PrefixCache(manager)
    images = manager.new_sequence()
    _append(manager, images, [float(i) for i in range(prefix)])
    tree.insert((("images", 0),), images)
    users = []
    for p, length in enumerate(prompts):
        fork = manager.fork(tree.lookup((("images", 0),)).seq)
        values = [100.0 * (p + 1) + i for i in range(length)]
        _append(manager, fork, values)
        tree.insert((("images", 0), ("prompt", p)), fork)
        users.append((manager.fork(fork), list(range(prefix)) + values))
    assert len(tree) == 1 + len(prompts)
    # Full image pages are stored once however many prompts fork them.
    if prefix >= BLOCK:
        assert pool.ref_count(images.block_table[0]) == 1 + 2 * len(prompts)
    tree.clear()
    for seq, values in users:
        assert _read(manager, seq) == [float(v) for v in values]
    for seq, _ in users:
        manager.free(seq)
    assert pool.num_free == pool.num_blocks
    with pytest.raises(KeyError):
        tree.insert((("images", 1), ("prompt", 0)), manager.new_sequence())


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=5, unique=True),
                                st.integers(0, 3)), min_size=1, max_size=12))
def test_decode_rows_hold_exactly_each_sequences_tokens(steps):
    """Batches join, leave and reorder between decode steps; prefills append behind the rows' back;
    every step's keys are each row's tokens so far plus its new token, in the caller's order."""
    manager = KVCacheManager(_pool(64))
    root = manager.new_sequence()
    _append(manager, root, [1.0, 2.0, 3.0, 4.0, 5.0])
    seqs = [manager.fork(root) for _ in range(5)]
    counter = 100.0
    for members, prefill in steps:
        batch = [seqs[i] for i in members]
        if prefill:   # a prefill through an ordinary view between decode steps
            _append(manager, batch[0], [counter + i for i in range(prefill)])
            counter += prefill
        counter = _decode_step_checked(manager, batch, counter)
    assert manager.decode_rows < 2 * max(len(members) for members, _ in steps)


def _decode_step_checked(manager, batch, counter):
    """One decode step of ``batch`` whose new keys are ``counter, counter + 1, ...`` (in view order);
    asserts that every row holds its sequence's tokens so far plus the new one, and that the new
    token reached the sequence's pages. Returns the next counter."""
    for seq in batch:
        manager.prepare_append(seq, 1)
    expected = [_read(manager, seq) for seq in batch]
    view, order = manager.decode_view(batch)
    assert sorted(order) == list(range(len(batch)))
    new = torch.tensor([counter + i for i in order]).view(-1, 1, 1, 1).expand(-1, 1, 1, 2)
    keys, values = view.attend(0, new.contiguous(), new.contiguous())
    for row, i in enumerate(order):
        n = batch[i].num_tokens
        assert keys[row, :n + 1, 0, 0].tolist() == expected[i] + [new[row, 0, 0, 0].item()]
        assert torch.equal(keys[row, :n + 1], values[row, :n + 1])
    view.commit()
    for i, seq in enumerate(batch):
        assert _read(manager, seq)[-1] == new[order.index(i), 0, 0, 0].item()
    return counter + len(batch)


def test_decode_rows_survive_a_step_with_a_smaller_batch():
    """A sequence that sits out a step (the deadline scheduler stepped only part of the batch)
    keeps its decode row: the next full step gathers nothing from the pages, and every row still
    reads its own tokens. Freeing a sequence gives its row up."""
    manager = KVCacheManager(_pool(64))
    root = manager.new_sequence()
    _append(manager, root, [1.0, 2.0, 3.0])
    seqs = [manager.fork(root) for _ in range(4)]
    counter = 10.0

    def step(batch):
        nonlocal counter
        counter = _decode_step_checked(manager, batch, counter)

    step(seqs)
    assert manager.decode_gathered_tokens == 4 * 3
    step([seqs[3]])          # row 3 swaps into row 0; the sequence there moves to row 3
    step([seqs[2], seqs[0]])
    step(seqs)
    assert manager.decode_gathered_tokens == 4 * 3
    manager.free(seqs[1])
    step([seqs[0], seqs[2], seqs[3]])
    assert manager.decode_gathered_tokens == 4 * 3
    fresh = manager.fork(root)
    step([fresh, seqs[0]])
    assert manager.decode_gathered_tokens == 4 * 3 + 3
