"""Prefix caching: the scheduler defaults and the estimate of a prompt's cached tokens (pure, no engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelserver.modelfiles import attention_shape
from modelserver.prefixcache import (
    CPU_CACHE_SIZE_GB,
    PrefixTracker,
    block_size_for,
    kv_blocks,
    kv_token_bytes,
    scheduler_defaults,
    scheduler_for,
)
from modelserver.spec import ModelSpec, build_model_spec


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


# -- the CPU KV cache sized from the model's shape, concurrency and context ------------------------------------


def test_kv_token_bytes_counts_k_and_v_of_every_layer_and_kv_head() -> None:
    # SmolLM2-135M: 30 layers x K,V x 3 KV heads x (64 u8 + 12 of scale and zero point) = what the pipeline reports
    assert kv_token_bytes(30, 3, 64) == 437_760 / 32
    assert kv_token_bytes(30, 3, 64, "f16") == 30 * 2 * 3 * 64 * 2
    assert kv_token_bytes(2, 2, 16, "F32") == 2 * 2 * 2 * 16 * 4


def test_kv_blocks_hold_every_sequence_at_full_context_up_to_the_cap() -> None:
    small = kv_token_bytes(2, 2, 16)
    assert kv_blocks(4, 4096, small, 32) == 4 * 4096 // 32  # fits: exactly concurrency x context
    assert kv_blocks(3, 100, small, 32) == 10  # rounded up to whole blocks
    smollm = kv_token_bytes(30, 3, 64)
    capped = kv_blocks(16, 8192, smollm, 32)
    assert capped is not None and capped < 16 * 8192 // 32
    assert capped * 32 * smollm <= CPU_CACHE_SIZE_GB * 1024**3 < (capped + 1) * 32 * smollm
    assert kv_blocks(16, None, smollm, 32) is None and kv_blocks(16, 8192, None, 32) is None


def test_scheduler_defaults_give_the_sized_cache_as_blocks_and_the_models_own_size_wins() -> None:
    assert scheduler_defaults("llm", "CPU", {}, blocks=512) == {"enable_prefix_caching": True, "num_kv_blocks": 512}
    assert scheduler_defaults("llm", "CPU", {"cache_size": 2}, blocks=512) == {"enable_prefix_caching": True,
                                                                               "cache_size": 2}
    assert scheduler_defaults("llm", "GPU", {}, blocks=512) == {"enable_prefix_caching": True}


def _spec(path: Path, **fields: Any) -> ModelSpec:
    return build_model_spec("m", {"task": "llm", "path": str(path), **fields})


def test_scheduler_for_reads_the_shape_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 64}))
    assert attention_shape(tmp_path) == (2, 2, 16)
    fields = scheduler_for(_spec(tmp_path, max_concurrency=4), tmp_path, 4096)
    assert fields == {"enable_prefix_caching": True, "num_kv_blocks": 4 * 4096 // 32}
    fewer = scheduler_for(_spec(tmp_path, max_concurrency=4, scheduler={"max_num_seqs": 2}), tmp_path, 4096)
    assert fewer["num_kv_blocks"] == 2 * 4096 // 32


def test_scheduler_for_a_model_of_unknown_shape_keeps_the_fixed_size(tmp_path: Path) -> None:
    assert attention_shape(tmp_path) is None
    assert scheduler_for(_spec(tmp_path), tmp_path, 4096) == {"enable_prefix_caching": True,
                                                              "cache_size": CPU_CACHE_SIZE_GB}


def test_the_demo_gguf_declares_its_kv_shape() -> None:
    gguf = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.fail(f"{gguf} is missing: run `make models`")
    assert attention_shape(gguf) == (30, 3, 64)
