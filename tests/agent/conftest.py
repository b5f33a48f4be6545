"""A scripted engine for agent-loop tests: it answers each turn with the next text of a script.

It is the engine's contract (token ids in, sampled ids and log-probs out) with the sampling
replaced by a script, so a test knows exactly which tokens the model "sampled"; it records the
prompt of every turn, so a test can check that each turn continued the previous tokens as they were.
"""

from __future__ import annotations

import pytest

from reinforge.rollout.base import Completion, SamplingParams


class ScriptedClient:
    def __init__(self, tokenizer, turns: list[str], eos_text: str | None = None):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.eos_id = tokenizer.convert_tokens_to_ids(eos_text or tokenizer.eos_token)
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingParams] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Completion:
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        text = self.turns.pop(0)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.eos_id]
        if len(ids) > sampling.max_tokens:
            ids = ids[:sampling.max_tokens]
            return Completion(ids, [-0.5] * len(ids), "length")
        return Completion(ids, [-0.5] * len(ids), "stop")


@pytest.fixture
def scripted_client():
    """The ScriptedClient class: ``scripted_client(tokenizer, ["turn 1 text", ...])``."""
    return ScriptedClient


@pytest.fixture(scope="session")
def chatml_tokenizer():
    """The character tokenizer with the ChatML tool template (Qwen2.5's shape)."""
    from reinforge.models.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer

    return build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
