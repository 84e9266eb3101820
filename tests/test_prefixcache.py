"""Prefix caching: the scheduler defaults and the estimate of a prompt's cached tokens (pure, no engine)."""

from __future__ import annotations

from modelserver.prefixcache import CPU_CACHE_SIZE_GB, PrefixTracker, block_size_for, scheduler_defaults


def test_llm_gets_prefix_caching_and_a_fixed_cpu_cache_by_default() -> None:
    assert scheduler_defaults("llm", "CPU", {}) == {"enable_prefix_caching": True, "cache_size": CPU_CACHE_SIZE_GB}


def test_the_models_own_scheduler_fields_win() -> None:
    assert scheduler_defaults("llm", "CPU", {"cache_size": 4}) == {"enable_prefix_caching": True, "cache_size": 4}
    assert scheduler_defaults("llm", "CPU", {"num_kv_blocks": 900}) == {"enable_prefix_caching": True,
                                                                        "num_kv_blocks": 900}


def test_opt_out_leaves_the_scheduler_alone() -> None:
    assert scheduler_defaults("llm", "CPU", {"enable_prefix_caching": False}) == {"enable_prefix_caching": False}


def test_gpu_keeps_its_dynamic_cache_and_other_tasks_are_untouched() -> None:
    assert scheduler_defaults("llm", "GPU.0", {}) == {"enable_prefix_caching": True}
    assert scheduler_defaults("vlm", "CPU", {"max_num_seqs": 4}) == {"max_num_seqs": 4}
    assert (block_size_for("GPU"), block_size_for("CPU")) == (16, 32)


def test_a_repeated_prefix_counts_whole_blocks_and_never_the_last_token() -> None:
    tracker = PrefixTracker(block_size=4)
    first = list(range(10))
    assert tracker.count(first) == 0
    tracker.remember([*first, 100, 101])  # the prompt and its answer
    assert tracker.count([*first, 100, 101, 7, 8]) == 12  # three whole blocks
    assert tracker.count(list(range(9)) + [55]) == 8  # the third block differs
    assert tracker.count(first[:8]) == 7  # all cached: the last token is computed anyway
    assert tracker.stats()["prefix_cached_tokens"] == 27 and tracker.stats()["prefix_cache_hits"] == 3


def test_a_different_start_shares_nothing_and_a_disabled_tracker_counts_nothing() -> None:
    tracker = PrefixTracker(block_size=4)
    tracker.remember(list(range(12)))
    assert tracker.count([99, *range(1, 12)]) == 0
    off = PrefixTracker(block_size=4, enabled=False)
    off.remember(list(range(12)))
    assert off.count(list(range(12))) == 0 and off.stats()["prefix_prompt_tokens"] == 12


def test_the_oldest_blocks_are_forgotten_first() -> None:
    tracker = PrefixTracker(block_size=2, max_blocks=3)
    tracker.remember([1, 2, 3, 4, 5, 6])
    tracker.remember([7, 8])
    assert tracker.count([1, 2, 3, 4, 5, 6, 0]) == 0  # its first block went
    assert tracker.count([7, 8, 0]) == 2
