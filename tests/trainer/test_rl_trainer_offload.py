"""actor.optimizer_offload in the RL loop on a tiny model: it trains, checkpoints and resumes like the on-device optimizer."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from reinforge.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_trainer import base_args, read_metrics  # noqa: E402


@pytest.mark.slow
def test_optimizer_offload_run_matches_the_on_device_run_and_saves_its_weights(tiny_model_dir, arithmetic_data_dir,
                                                                              tmp_path):
    runs = {}
    for offload in (False, True):
        run_dir = tmp_path / f"offload_{offload}"
        assert main(["train", *base_args(tiny_model_dir, arithmetic_data_dir, run_dir,
                                         **{"actor.optimizer_offload": offload})]) == 0
        runs[offload] = run_dir
    on_device, offloaded = (read_metrics(runs[flag]) for flag in (False, True))
    for row_device, row_host in zip(on_device, offloaded, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            assert abs(row_device[key] - row_host[key]) <= 1e-4 * max(1.0, abs(row_device[key])), key
    checkpoint = runs[True] / "checkpoints" / "step_000002"
    trained = torch.load(checkpoint / "actor_state.pt", weights_only=True)["model"]
    saved = AutoModelForCausalLM.from_pretrained(checkpoint / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[name], tensor) for name, tensor in trained.items() if name in saved)
    assert not torch.equal(trained["model.embed_tokens.weight"],
                           AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
                           .state_dict()["model.embed_tokens.weight"])
