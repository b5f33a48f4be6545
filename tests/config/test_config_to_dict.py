"""config_to_dict gives what OmegaConf gives for a config, and walks a loaded one without OmegaConf's nodes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from reinforge.config import config_to_dict, load_config, load_sft_config, loader

EXAMPLES = Path(loader.__file__).parents[1] / "examples"


def through_omegaconf(config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def same(a, b) -> bool:
    """Equal values of equal types, in the same key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("example", ["ppo_gsm8k.yaml", "grpo_gsm8k.yaml", "dapo_gsm8k.yaml", "retool.yaml", None])
def test_a_loaded_config_is_walked_without_omegaconf_and_gives_its_result(example, monkeypatch):
    config = load_config(None if example is None else EXAMPLES / example, ["model.path=/models/m"], validate=False)
    expected = through_omegaconf(config)

    def refuse(*args, **kwargs):
        raise AssertionError("config_to_dict built OmegaConf nodes for a config that needs no conversion")

    monkeypatch.setattr(loader.OmegaConf, "structured", refuse)
    assert same(config_to_dict(config), expected)


def test_an_sft_config_is_walked_too(monkeypatch):
    config = load_sft_config(None, ["model.path=/models/m", "data.train_files=[train.parquet]"])
    expected = through_omegaconf(config)
    monkeypatch.setattr(loader.OmegaConf, "structured", lambda *args, **kwargs: pytest.fail("OmegaConf was used"))
    assert same(config_to_dict(config), expected)


def test_values_omegaconf_converts_or_resolves_come_out_as_it_gives_them():
    config = load_config(None, ["model.path=/models/m"], validate=False)
    config.actor.optim.lr = 1  # an int in a float field
    config.trainer.output_dir = Path("/runs/x")  # a path in a text field
    config.trainer.experiment_name = "${trainer.project_name}-b"  # an interpolation
    result = config_to_dict(config)
    assert same(result, through_omegaconf(config))
    assert result["actor"]["optim"]["lr"] == 1.0 and isinstance(result["actor"]["optim"]["lr"], float)
    assert result["trainer"]["output_dir"] == "/runs/x"
    assert result["trainer"]["experiment_name"] == "reinforge-b"


def test_each_load_starts_from_the_schemas_defaults():
    """load_config copies one OmegaConf tree of the schema's defaults: what a load sets stays in its own config."""
    from reinforge.config.schema import Config

    first = load_config(None, ["model.path=/a", "reward.kwargs.k=1", "data.train_files=[x.parquet]",
                               "trainer.total_steps=7"], validate=False)
    second = load_config(None, ["model.path=/b"], validate=False)
    defaults = Config()
    assert (first.reward.kwargs, first.data.train_files, first.trainer.total_steps) == ({"k": 1}, ["x.parquet"], 7)
    assert second.reward.kwargs == defaults.reward.kwargs and second.data.train_files == defaults.data.train_files
    assert second.trainer.total_steps == defaults.trainer.total_steps and second.model.path == "/b"
