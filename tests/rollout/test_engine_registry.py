"""Rollout engines as plugins: a package's entry point adds an engine that rollout.name selects."""

from __future__ import annotations

import sys

import pytest
import torch

from reinforge.rollout.base import Completion, RolloutEngine
from reinforge.rollout.registry import ROLLOUT_ENGINES, check_plugin_engine, get_rollout_engine, rollout_engine_names

TOY_ENGINE = '''
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
                                           "partial = toy_engine_pkg:Partial\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("toy", "partial"):
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
                                         r"toy \(a package adds one through the entry point group "
                                         r"'reinforge.rollout_engines'\)"):
        get_rollout_engine("vllm")


def test_the_built_in_engines_are_registered_by_name():
    from reinforge.rollout.hf import HFEngine
    from reinforge.rollout.native import NativeEngine

    assert get_rollout_engine("hf") is HFEngine and get_rollout_engine("native") is NativeEngine
