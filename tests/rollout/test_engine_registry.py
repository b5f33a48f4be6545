"""Rollout engines as plugins: a package's entry point adds an engine that rollout.name selects."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from reinforge.rollout.base import Completion, RolloutEngine
from reinforge.rollout.registry import ROLLOUT_ENGINES, check_plugin_engine, get_rollout_engine, rollout_engine_names

TOY_ENGINE = '''
import dataclasses

from reinforge.rollout.base import Completion


class ToyEngine:
    """Answers every request with its prompt's first token, n times."""

    reads_model_in_place = False

    def __init__(self, device):
        self.device = device
        self.awake = False

    @classmethod
    def from_config(cls, config, *, model, tokenizer, device):
        return cls(device)

    def generate(self, requests):
        return [[Completion([request.prompt_token_ids[0]], [-1.0], "length")] * request.sampling.n
                for request in requests]

    def sync_weights(self, model):
        pass

    def wake_up(self):
        self.awake = True

    def sleep(self, abandon=False):
        self.awake = False


class Partial:
    reads_model_in_place = False

    def generate(self, requests):
        return []


class Unstoppable:
    """The hf engine on the policy, blind to stop strings: each sample runs to its stop token or its length."""

    reads_model_in_place = True

    def __init__(self, engine):
        self.engine = engine

    @classmethod
    def from_config(cls, config, *, model, tokenizer, device):
        from reinforge.rollout.hf import HFEngine

        return cls(HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id]))

    def generate(self, requests):
        return self.engine.generate([dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, stop=()))
                                     for request in requests])

    async def generate_async(self, request, on_token=None):
        [completions] = self.generate([request])
        for index, completion in enumerate(completions):
            for token_id, log_prob in zip(completion.token_ids, completion.log_probs):
                if on_token is not None:
                    on_token(index, token_id, log_prob, None)
        return completions

    def sync_weights(self, model):
        pass

    def wake_up(self):
        pass

    def sleep(self, abandon=False):
        pass
'''


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """An installed distribution (its dist-info) on sys.path whose entry points add the engines toy and partial."""
    (tmp_path / "toy_engine_pkg").mkdir()
    (tmp_path / "toy_engine_pkg" / "__init__.py").write_text(TOY_ENGINE)
    info = tmp_path / "toy_engine_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[reinforge.rollout_engines]\ntoy = toy_engine_pkg:ToyEngine\n"
                                           "partial = toy_engine_pkg:Partial\nunstoppable = toy_engine_pkg:Unstoppable\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("toy", "partial", "unstoppable"):
        ROLLOUT_ENGINES.pop(name, None)
    sys.modules.pop("toy_engine_pkg", None)


def test_an_entry_point_adds_an_engine_that_the_worker_builds_by_rollout_name(toy_package):
    from reinforge.config.schema import Config
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.workers.rollout_side import build_rollout_engine

    assert {"hf", "native", "toy", "partial"} <= set(rollout_engine_names())
    check_plugin_engine("toy")
    config = Config()
    config.rollout.name = "toy"
    engine = build_rollout_engine(config, torch.device("cpu"), tokenizer=None, model=torch.nn.Linear(1, 1))
    assert type(engine) is get_rollout_engine("toy") and isinstance(engine, RolloutEngine)
    engine.wake_up()
    assert engine.generate([GenerationRequest([7, 8], SamplingParams(n=2))]) == [[Completion([7], [-1.0], "length")] * 2]


def test_an_engine_that_lacks_part_of_the_contract_or_is_unknown_is_refused_in_one_line(toy_package):
    with pytest.raises(ValueError, match=r"rollout.name='partial': toy_engine_pkg.Partial lacks from_config, "
                                         r"sync_weights, wake_up, sleep of the RolloutEngine contract"):
        check_plugin_engine("partial")
    with pytest.raises(ValueError, match=r"rollout.name='vllm' is not a rollout engine; known: hf, native, partial, "
                                         r"toy, unstoppable \(a package adds one through the entry point group "
                                         r"'reinforge.rollout_engines'\)"):
        get_rollout_engine("vllm")


def test_the_built_in_engines_are_registered_by_name():
    from reinforge.rollout.hf import HFEngine
    from reinforge.rollout.native import NativeEngine

    assert get_rollout_engine("hf") is HFEngine and get_rollout_engine("native") is NativeEngine


def test_a_plugin_engine_blind_to_stop_strings_ends_its_samples_as_the_built_in_engines_do(toy_package):
    """A plugin's samples ran past their stop strings, which only hf and native watched for: they now end at the token
    that completes one, with its log-probs, alternatives and finish_reason as hf's own, streamed tokens alike."""
    import asyncio

    from reinforge.config.schema import Config
    from reinforge.models.tiny import build_char_tokenizer, build_tiny_causal_lm
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.hf import HFEngine
    from reinforge.workers.rollout_side import build_rollout_engine

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm("qwen2", vocab_size=len(tokenizer), num_layers=1)
    config = Config()
    config.rollout.name = "unstoppable"
    plugin = build_rollout_engine(config, torch.device("cpu"), tokenizer=tokenizer, model=model)
    built_in = HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
                        tokenizer=tokenizer)
    sampling = SamplingParams(max_tokens=16, temperature=1.0, n=2, seed=3, num_top_log_probs=2)
    prompt = tokenizer.encode("Q: 1+1=")
    [unstopped] = plugin.generate([GenerationRequest(prompt, sampling)])
    # a stop string of two characters that the second sample's text holds and the first one's does not
    first_text, ids = tokenizer.decode(unstopped[0].token_ids), unstopped[1].token_ids
    stop = next(text for start in range(2, len(ids) - 1) for text in [tokenizer.decode(ids[start:start + 2])]
                if len(text) == 2 and text.isascii() and text.isprintable() and text not in first_text)
    request = GenerationRequest(prompt, dataclasses.replace(sampling, stop=(stop, "never written")), "stopped")

    [ended] = plugin.generate([request])
    assert ended == built_in.generate([request])[0]
    assert ended[0] == unstopped[0]  # no stop string: as the engine gave it
    assert ended[1].finish_reason == "stop" and len(ended[1].token_ids) < len(ids)
    assert tokenizer.decode(ended[1].token_ids).endswith(stop)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    ended_async = asyncio.run(plugin.generate_async(request, lambda index, token_id, *rest: streamed[index].append(
        token_id)))
    assert ended_async == ended and [streamed[0], streamed[1]] == [sample.token_ids for sample in ended]
    ignoring = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, ignore_eos=True))
    [kept] = plugin.generate([ignoring])
    assert kept == plugin.engine.generate([ignoring])[0]  # ignore_eos: no stop string ends a sample, as in hf's


def test_no_requests_never_reach_a_plugin_engine(toy_package):
    from reinforge.config.schema import Config
    from reinforge.workers.rollout_side import build_rollout_engine

    config = Config()
    config.rollout.name = "toy"
    engine = build_rollout_engine(config, torch.device("cpu"), tokenizer=None, model=torch.nn.Linear(1, 1))
    asked = []
    engine.engine.generate = lambda requests: asked.append(requests) or []
    assert engine.generate([]) == [] and asked == []
