"""From a worker method to the model is at most two calls (STYLE.md): the method calls the forward, the forward the model.

Each worker method runs with a hook on the model that records the Python stack when the model
is called; the frames between the method and torch's ``Module.__call__`` are the path.
"""

import sys
import traceback
from pathlib import Path

import torch

import reinforge
from reinforge.workers.actor_rollout import ActorRolloutWorker
from reinforge.workers.critic import CriticWorker
from reinforge.workers.reference import ReferenceWorker

sys.path.insert(0, str(Path(__file__).parent))
from test_actor_rollout import make_config, scored_batch  # noqa: E402

PACKAGE = str(Path(reinforge.__file__).parent)
MODULE_CALL = str(Path("torch", "nn", "modules", "module.py"))


def path_to_the_model(module: torch.nn.Module, method, *args) -> list[str]:
    """The functions from ``method`` (included) to the call of ``module``, at its first call (decorators' frames too)."""
    stacks: list[traceback.StackSummary] = []
    handle = module.register_forward_pre_hook(lambda *_: stacks.append(traceback.extract_stack()))
    try:
        method(*args)
    finally:
        handle.remove()
    assert stacks, f"{method.__name__} never called the model"
    stack = stacks[0]
    start = max(index for index, frame in enumerate(stack) if frame.name == method.__name__)
    path = []
    for frame in stack[start:]:
        if frame.filename.endswith(MODULE_CALL):
            return path  # the model is being called
        path.append(frame.name if frame.filename.startswith(PACKAGE) else f"{frame.name} ({frame.filename})")
    raise AssertionError("the hook's stack has no Module.__call__")


def with_values(batch):
    batch["values"] = torch.zeros_like(batch["advantages"])
    batch["returns"] = batch["advantages"]
    return batch


def test_actor_critic_and_reference_reach_the_model_in_two_calls(tiny_model_dir):
    config = make_config(tiny_model_dir)
    actor = ActorRolloutWorker(config, total_training_steps=2)
    assert path_to_the_model(actor.model, actor.update_actor, scored_batch()) == ["update_actor", "response_log_probs"]
    assert path_to_the_model(actor.model, actor.compute_log_prob, scored_batch()) == ["compute_log_prob",
                                                                                       "response_log_probs"]
    reference = ReferenceWorker(config)
    assert path_to_the_model(reference.model, reference.compute_ref_log_prob, scored_batch()) == [
        "compute_ref_log_prob", "response_log_probs"]
    critic = CriticWorker(config, total_training_steps=2)
    backbone = critic.model.backbone
    assert path_to_the_model(backbone, critic.update_critic, with_values(scored_batch())) == ["update_critic",
                                                                                          "response_values"]
    assert path_to_the_model(backbone, critic.compute_values, scored_batch()) == ["compute_values", "response_values"]
