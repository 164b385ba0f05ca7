"""Grouping decodes by context length bounds the padding of the CPU attention path."""

import random

from shared.engine.paged_attention import group_decodes_by_length


def test_every_decode_lands_in_exactly_one_group():
    lens = [random.Random(i).randint(1, 4000) for i in range(100)]
    groups = group_decodes_by_length(lens)
    assert sorted(i for g in groups for i in g) == list(range(100))


def test_groups_bound_the_padding():
    lens = [900, 880, 700, 690, 400, 50, 45, 44]
    groups = group_decodes_by_length(lens, max_padding=0.25)
    assert [sorted(lens[i] for i in g) for g in groups] == [[690, 700, 880, 900], [400], [44, 45, 50]]
    for group in groups:
        longest = max(lens[i] for i in group)
        assert all(lens[i] >= 0.75 * longest for i in group)


def test_group_count_is_capped():
    lens = [2**i for i in range(20)]
    groups = group_decodes_by_length(lens, max_groups=4)
    assert len(groups) == 4
    assert sorted(i for g in groups for i in g) == list(range(20))


def test_equal_lengths_share_one_group():
    assert group_decodes_by_length([64] * 10) == [list(range(10))]
    assert group_decodes_by_length([]) == []


def test_short_contexts_share_one_group_whatever_their_ratio():
    # Below min_padding_tokens of padding a group's fixed cost (a gather and an SDPA per layer) is the larger one.
    assert group_decodes_by_length([200, 40, 120, 10], min_padding_tokens=256) == [[0, 2, 1, 3]]
    assert len(group_decodes_by_length([200, 40, 120, 10], min_padding_tokens=0)) == 4


def test_the_native_kernel_takes_every_thread_only_for_big_enough_steps():
    from shared.engine.paged_attention import KEYS_PER_KERNEL_THREAD, decode_kernel_threads

    assert decode_kernel_threads(32 * 3, 2) == 1
    assert decode_kernel_threads(KEYS_PER_KERNEL_THREAD + 1, 2) == 1
    assert decode_kernel_threads(2 * KEYS_PER_KERNEL_THREAD, 2) == 2
    assert decode_kernel_threads(100 * KEYS_PER_KERNEL_THREAD, 4) == 4
    assert decode_kernel_threads(100 * KEYS_PER_KERNEL_THREAD, 1) == 1
    # All of torch's threads or one, never some: a smaller team would end threads torch starts again.
    assert decode_kernel_threads(3 * KEYS_PER_KERNEL_THREAD, 16) == 16
