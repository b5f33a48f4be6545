"""The micro-batches an update makes of a step at full lengths, counted without making them.

The planner asks, for every token budget it tries, how many micro-batches ``engine.micro_batches`` cuts a
mini-batch into and how many tokens the largest holds. At full lengths every prompt group is cut into the same
items (``split_group``), so a mini-batch is a few item costs, each many times over: at most two, a group's full
items and its last one. Making the micro-batches item by item (``micro_batch_loads``) takes a minute for 50,000
prompts; here the same longest-first spread and the same search for the fewest micro-batches run on loads with a
count of micro-batches each, a whole round of equal items at a time, so their answer is the same in milliseconds.
"""

from __future__ import annotations

from collections import Counter


def largest_load(item_costs: Counter[int], num_bins: int) -> int:
    """The largest bin's tokens after ``micro_batches._longest_first`` spreads items (cost: how many) over
    ``num_bins`` bins: costliest first, each into a least-loaded bin.

    Bins of equal load are interchangeable, so the loads are kept as load -> bins. A run of equal items fills the
    least-loaded bins a round at a time (one item each, in turn) until they reach the next load; what is left of the
    run, fewer items than bins, lifts that many of them once.
    """
    levels: dict[int, int] = {0: num_bins}
    for cost in sorted(item_costs, reverse=True):
        count = item_costs[cost]
        while count and cost:
            low = min(levels)
            bins = levels.pop(low)
            if count < bins:
                levels[low] = bins - count
                levels[low + cost] = levels.get(low + cost, 0) + count
                break
            rounds = count // bins
            above = min(levels, default=None)
            if above is not None:  # the rounds until these bins reach the next load (the least then alternates)
                rounds = min(rounds, -(-(above - low) // cost))
            levels[low + rounds * cost] = levels.get(low + rounds * cost, 0) + bins
            count -= rounds * bins
    return max(levels)


def fewest_bins(item_costs: Counter[int], max_tokens: int) -> int:
    """``micro_batches._fewest_bins`` of these items: the same counts tried in the same order (a few from the token
    count's lower bound up, then a binary search up to one item per bin), each judged by ``largest_load``."""
    num_items = sum(item_costs.values())
    if not num_items:
        return 1
    limit = max(max_tokens, max(item_costs))
    total = sum(cost * count for cost, count in item_costs.items())
    low, high = max(1, -(-total // max_tokens)), num_items
    for num_bins in range(low, min(low + 4, high)):
        if largest_load(item_costs, num_bins) <= limit:
            return num_bins
    low = min(low + 4, high)
    while low < high:
        middle = (low + high) // 2
        if largest_load(item_costs, middle) <= limit:
            high = middle
        else:
            low = middle + 1
    return high


def split_loads(group_costs: list[int], num_groups: int, max_tokens: int) -> tuple[int, int]:
    """(micro-batches, tokens of the largest) that ``micro_batches.micro_batch_loads`` gives for ``num_groups``
    copies of a group cut into items of ``group_costs`` tokens."""
    item_costs = Counter({cost: count * num_groups for cost, count in Counter(group_costs).items()})
    num_bins = fewest_bins(item_costs, max_tokens)
    return num_bins, largest_load(item_costs, num_bins)
