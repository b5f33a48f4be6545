"""Random multi-turn workloads on the native engine: turns joining the running batch (batched arrivals, each join's
prefill launched behind the decode step in flight) give the samples of one-by-one admission, token for token and with
the same finish reasons, through preemption (few KV blocks), n > 1, stop tokens and the prefix cache on or off."""

from __future__ import annotations

import random

import pytest

from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine


@pytest.fixture(scope="module")
def qwen2(tiny):
    return tiny.build("qwen2", seed=2)


def random_plan(trial: int, tiny) -> dict:
    rng = random.Random(trial)
    count = rng.randint(2, 9)
    return dict(prompts=tiny.prompts([rng.randint(1, 40) for _ in range(count)], seed=trial),
                turns=[rng.randint(1, 4) for _ in range(count)], tool_steps=[rng.randint(0, 5) for _ in range(count)],
                max_tokens=[rng.randint(1, 12) for _ in range(count)], n=[rng.choice([1, 1, 2, 3]) for _ in range(count)],
                tool=[5, 9, 3][:rng.randint(0, 3)], eos=rng.choice([[], [7], [3, 11]]), block_size=rng.choice([4, 8, 16]),
                max_model_len=rng.choice([64, 128, 200]), max_num_seqs=rng.choice([4, 8, 16, 32]),
                num_kv_blocks=rng.choice([None, None, 14, 20]), admission=rng.choice([(0, 0.0), (4, 1.0), (16, 0.0625),
                                                                                      (2, 0.5)]),
                prefix_caching=rng.random() < 0.8)


def run_turns(model, plan: dict, batch_arrivals: bool) -> list[list[list[tuple[list[int], str]]]]:
    """Each trajectory's turns (every sample's tokens and finish reason); a tool between turns takes some engine steps."""
    kwargs = {} if plan["num_kv_blocks"] is None else {"num_kv_blocks": plan["num_kv_blocks"]}
    if batch_arrivals:
        kwargs |= dict(max_admission_wait=plan["admission"][0], admission_fraction=plan["admission"][1],
                       enable_prefix_caching=plan["prefix_caching"])
    engine = NativeEngine(model, eos_token_ids=plan["eos"], max_model_len=plan["max_model_len"],
                          block_size=plan["block_size"], max_num_seqs=plan["max_num_seqs"], **kwargs)
    engine.wake_up()
    contexts = [list(prompt) for prompt in plan["prompts"]]
    results: list[list] = [[] for _ in contexts]
    turns_done = [0] * len(contexts)
    ended = [False] * len(contexts)
    arrivals = dict.fromkeys(range(len(contexts)), 0)
    step = 0

    def finished(trajectory: int, completions) -> None:
        results[trajectory].append([(completion.token_ids, completion.finish_reason) for completion in completions])
        contexts[trajectory] += completions[0].token_ids + plan["tool"]
        turns_done[trajectory] += 1
        if turns_done[trajectory] < plan["turns"][trajectory] and len(contexts[trajectory]) < plan["max_model_len"] - 2:
            arrivals[trajectory] = step + plan["tool_steps"][trajectory]
        else:
            ended[trajectory] = True

    while not all(ended):
        for trajectory, arrival in list(arrivals.items()):
            if arrival <= step:
                del arrivals[trajectory]
                sampling = SamplingParams(max_tokens=plan["max_tokens"][trajectory], temperature=1.0,
                                          seed=100 * trajectory + turns_done[trajectory], n=plan["n"][trajectory])
                engine._submit(GenerationRequest(contexts[trajectory], sampling),
                               on_done=lambda completions, t=trajectory: finished(t, completions))
        engine._step(batch_arrivals)
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return results


# each preempts (few KV blocks), with n up to 3; 11, 16, 17 and 34 have stop tokens, 11, 34 and 36 the prefix cache on
@pytest.mark.parametrize("trial", [1, 11, 16, 17, 34, 36])
def test_joining_turns_give_the_samples_of_one_by_one_admission(qwen2, tiny, trial):
    plan = random_plan(trial, tiny)
    assert run_turns(qwen2, plan, batch_arrivals=True) == run_turns(qwen2, plan, batch_arrivals=False)
