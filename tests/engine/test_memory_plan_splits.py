"""The planner's count of micro-batches equals the micro-batches the update makes, and a large step plans at once."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter

import pytest

from reinforge.engine import memory_plan
from reinforge.engine.memory_plan import GiB, ModelShape, RunShape, plan_memory
from reinforge.engine.memory_plan_splits import fewest_bins, largest_load, split_loads
from reinforge.engine.micro_batches import _fewest_bins, _longest_first, micro_batch_loads, split_group

QWEN25_05B = ModelShape.from_hf_config(dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                                            num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                                            tie_word_embeddings=True))


def simulated_loads(group_costs: list[int], num_groups: int, max_tokens: int) -> tuple[int, int]:
    """What the planner counted before: the update's micro-batches, made item by item."""
    loads = micro_batch_loads(group_costs * num_groups, max_tokens)
    return len(loads), max(loads)


@pytest.mark.parametrize("prompt, response, samples, groups, budget", [
    (128, 512, 8, 64, 65536),  # 4,224-token groups: five micro-batches of 54,912 at most
    (128, 512, 8, 64, 16384),
    (1024, 8192, 16, 8, 32768),  # a group cut into items of three responses and a last one of one
    (3000, 30000, 4, 5, 24576),  # every item over the budget: one a micro-batch
    (0, 1000, 7, 13, 4096),
    (500, 100, 1, 257, 1000),
    (64, 4096, 32, 3, 12288),
])
def test_micro_batches_are_counted_as_the_update_makes_them(prompt, response, samples, groups, budget):
    costs = [cost for _, cost in split_group(prompt, [response] * samples, budget)]
    assert split_loads(costs, groups, budget) == simulated_loads(costs, groups, budget)


def test_longest_first_and_its_search_on_any_few_costs():
    """Items of up to four costs in any number, against the update's own spread and search."""
    rng = random.Random(0)
    for _ in range(150):
        item_costs = Counter({rng.randint(0, 300): rng.randint(1, 40) for _ in range(rng.randint(1, 4))})
        items = [cost for cost, count in item_costs.items() for _ in range(count)]
        for num_bins in {1, 2, 3, rng.randint(1, len(items) + 2), len(items)}:
            assert largest_load(item_costs, num_bins) == max(
                sum(items[item] for item in bin_items) for bin_items in _longest_first(items, num_bins))
        budget = rng.randint(1, 2000)
        assert fewest_bins(item_costs, budget) == _fewest_bins(items, budget)


@pytest.mark.parametrize("run", [
    RunShape(prompts=64, samples_per_prompt=8, prompt_length=128, response_length=512),
    RunShape(prompts=256, samples_per_prompt=16, prompt_length=1024, response_length=8192, num_mini_batches=4),
    RunShape(prompts=96, samples_per_prompt=5, prompt_length=2048, response_length=20000, num_devices=4),
    RunShape(prompts=32, samples_per_prompt=4, prompt_length=256, response_length=1024, lora_rank=32),
], ids=("standard", "long", "four-devices", "lora"))
@pytest.mark.parametrize("gpu_gib", [24, 80])
def test_a_plan_is_the_plan_of_micro_batches_made_item_by_item(run, gpu_gib, monkeypatch):
    def plans() -> tuple[object, ...]:
        memory_plan.micro_batch_split.cache_clear()
        memory_plan.micro_batch_prompts.cache_clear()
        try:
            plan = plan_memory(QWEN25_05B, run, {}, gpu_gib * GiB, 64 * GiB)
            return plan.settings, plan.phases, plan.host
        except memory_plan.MemoryPlanError as refusal:
            return (str(refusal),)

    counted = plans()
    monkeypatch.setattr(memory_plan, "split_loads", simulated_loads)
    assert plans() == counted
    memory_plan.micro_batch_split.cache_clear()
    memory_plan.micro_batch_prompts.cache_clear()


def test_two_hundred_thousand_prompts_plan_in_well_under_a_second():
    """The planner made every micro-batch of a step: 50,000 prompts took 80 s to plan."""
    run = RunShape(prompts=200_000, samples_per_prompt=8, prompt_length=128, response_length=512)
    start = time.perf_counter()
    plan = plan_memory(QWEN25_05B, run, {}, 80 * GiB, 512 * GiB)
    plan_memory(QWEN25_05B, dataclasses.replace(run, num_devices=8), {}, 80 * GiB, 512 * GiB)
    assert time.perf_counter() - start < 1.0
    assert plan.fits
