"""A frozen vision tower's image embeddings, encoded once per step (engine.image_embeddings), against the packed
forward that runs the tower on each micro-batch's pixels."""

import pytest
import torch

from reinforge.engine.forward import response_log_probs
from reinforge.engine.image_embeddings import ImageEmbeddingCache
from reinforge.engine.micro_batches import iter_balanced_micro_batches
from reinforge.engine.packing import attach_plan
from reinforge.models.tiny_vlm import build_tiny_processor, build_tiny_vlm
from reinforge.models.vision import freeze_vision_tower, vision_tower
from reinforge.protocol import MULTI_MODAL_KEY, Batch
from tests.engine.test_vlm_packing import ARCHES, vlm, vlm_batch


def count_tower_calls(model) -> list[int]:
    """Patches of each call of the model's vision tower, appended as it runs."""
    calls: list[int] = []
    vision_tower(model).register_forward_pre_hook(lambda module, args: calls.append(int(args[0].shape[0])))
    return calls


def micro_batches(batch: Batch, max_tokens: int, share: bool) -> list[Batch]:
    if share:
        return list(iter_balanced_micro_batches(batch, max_tokens, share_prompts=True))
    return [attach_plan(batch.index(list(range(start, min(start + 3, len(batch))))))
            for start in range(0, len(batch), 3)]


def loss_and_gradients(model, micros: list[Batch], cache: ImageEmbeddingCache | None):
    model.zero_grad()
    total = 0.0
    outputs = []
    for micro in micros:
        log_probs, entropy = response_log_probs(model, micro, with_entropy=True, image_embeddings=cache)
        loss = (log_probs * micro["advantages"]).sum() + 0.1 * (entropy * micro["response_mask"]).sum()
        loss.backward()
        total += loss.item()
        outputs.append(log_probs.detach())
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}
    return total, outputs, grads


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("share", [False, True])
def test_cached_embeddings_give_the_log_probs_loss_and_gradients_of_the_tower_per_micro_batch(arch, share):
    model = vlm(arch, seed=2)
    freeze_vision_tower(model)
    batch = vlm_batch(build_tiny_processor(arch), samples=3, seed=2)
    micros = micro_batches(batch, 60, share)
    assert len(micros) > 2
    expected_loss, expected, expected_grads = loss_and_gradients(model, micros, None)
    cache = ImageEmbeddingCache(model, torch.device("cpu"))
    assert cache.prepare(batch) and cache.ready
    calls = count_tower_calls(model)
    loss, outputs, grads = loss_and_gradients(model, micros, cache)
    assert calls == []  # the packed forwards took the cached embeddings
    assert loss == pytest.approx(expected_loss, rel=1e-6, abs=1e-5)
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    assert not any(name.startswith("model.visual.") for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ARCHES)
def test_each_distinct_image_goes_through_the_tower_once_per_step(arch):
    model = vlm(arch, seed=3)
    freeze_vision_tower(model)
    batch = vlm_batch(build_tiny_processor(arch), samples=4, seed=3)
    images = {id(row["pixel_values"]): row for row in batch[MULTI_MODAL_KEY] if row}
    distinct_patches = sum(int(row["image_grid_thw"].prod(-1).sum()) for row in images.values())
    num_images = sum(len(row["image_grid_thw"]) for row in images.values())
    calls = count_tower_calls(model)
    cache = ImageEmbeddingCache(model, torch.device("cpu"))
    for _ in range(3):  # scoring, then two update epochs over the same batch
        cache.prepare(batch)
        for micro in micro_batches(batch, 50, share=True):
            response_log_probs(model, micro, image_embeddings=cache)
    assert calls == [distinct_patches] and cache.num_images_encoded == num_images
    # the batch carried to another process: new tensors of the same pixels are the same images
    copied = Batch(dict(batch.tensors), {MULTI_MODAL_KEY: [
        {key: value.clone() for key, value in row.items()} if row else row for row in batch[MULTI_MODAL_KEY]]}, {})
    cache.prepare(copied)
    response_log_probs(model, attach_plan(copied, share_prompts=True), image_embeddings=cache)
    assert len(calls) == 1
    cache.clear()
    assert not cache.ready
    # the next step encodes again, each image once though each of its rows holds a tensor of its own
    assert cache.prepare(copied) and calls == [distinct_patches, distinct_patches]


def test_the_tower_encodes_in_chunks_of_bounded_patches():
    model = vlm("qwen2_5_vl", seed=5)
    freeze_vision_tower(model)
    batch = vlm_batch(build_tiny_processor("qwen2_5_vl"), samples=2, seed=5)
    largest = max(int(row["image_grid_thw"].prod(-1).max()) for row in batch[MULTI_MODAL_KEY] if row)
    calls = count_tower_calls(model)
    cache = ImageEmbeddingCache(model, torch.device("cpu"), max_patches=largest)
    cache.prepare(batch)
    patches = [int(size) for row in {id(row["pixel_values"]): row for row in batch[MULTI_MODAL_KEY] if row}.values()
               for size in row["image_grid_thw"].prod(-1)]
    assert cache.num_images_encoded == len(patches) == 4 and sum(calls) == sum(patches)
    assert max(calls) <= largest and 1 < len(calls) < len(patches)  # the two small images of a prompt share a call
    expected, _ = response_log_probs(model, attach_plan(batch, share_prompts=True))
    got, _ = response_log_probs(model, attach_plan(batch, share_prompts=True), image_embeddings=cache)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_a_trained_tower_runs_per_micro_batch_with_its_gradients(arch):
    model = vlm(arch, seed=6)
    freeze_vision_tower(model, frozen=False)
    batch = vlm_batch(build_tiny_processor(arch), samples=2, seed=6)
    cache = ImageEmbeddingCache(model, torch.device("cpu"))
    assert not cache.prepare(batch) and not cache.ready
    calls = count_tower_calls(model)
    log_probs, _ = response_log_probs(model, attach_plan(batch, share_prompts=True), image_embeddings=cache)
    (log_probs * batch["advantages"]).sum().backward()
    assert len(calls) == 1
    assert all(parameter.grad is not None for parameter in vision_tower(model).parameters())


@pytest.mark.parametrize("arch", ARCHES)
def test_an_image_token_id_outside_the_images_stays_text_with_cached_embeddings(arch):
    from tests.engine.test_vlm_text_image_tokens import sampled_with_image_tokens

    batch, expected = sampled_with_image_tokens(build_tiny_vlm(arch, seed=5), build_tiny_processor(arch))
    model = vlm(arch, seed=5)
    freeze_vision_tower(model)
    cache = ImageEmbeddingCache(model, torch.device("cpu"))
    assert cache.prepare(batch)
    calls = count_tower_calls(model)
    for share in (False, True):
        log_probs, _ = response_log_probs(model, attach_plan(Batch(dict(batch.tensors), dict(batch.non_tensors), {}),
                                                             share_prompts=share), image_embeddings=cache)
        torch.testing.assert_close(log_probs * batch["response_mask"], expected, rtol=0, atol=1e-5)
    assert calls == []


def counted(method, calls: list[int]):
    def call(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)
    return call


def test_the_actor_and_reference_encode_each_image_once_per_step_and_update_as_without_the_cache(tmp_path):
    """Through the workers (FSDP on one CPU rank): old log-probs, reference log-probs and a two-epoch update run
    the actor's tower once and the reference's once; the update's metrics and weights are those of the tower run
    per micro-batch; the cache is empty after the update."""
    from reinforge.config.schema import Config
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.workers.actor_rollout import ActorRolloutWorker
    from reinforge.workers.reference import ReferenceWorker

    config = Config()
    config.model.path, config.trainer.device = str(save_tiny_vlm(tmp_path / "vlm", "qwen3_vl", seed=7)), "cpu"
    config.data.train_batch_size, config.actor.max_tokens_per_micro_batch, config.actor.ppo_epochs = 4, 60, 2
    batch = vlm_batch(build_tiny_processor("qwen3_vl"), samples=2, seed=7)
    results = []
    for cached in (True, False):
        actor, reference = ActorRolloutWorker(config, total_training_steps=2), ReferenceWorker(config)
        actor_calls, reference_calls = count_tower_calls(actor.model), count_tower_calls(reference.model)
        if not cached:
            actor.image_embeddings = reference.image_embeddings = None
        scored = batch.union(actor.compute_log_prob(batch)).union(reference.compute_ref_log_prob(batch))
        gathers: list[int] = []
        actor.model.unshard = counted(actor.model.unshard, gathers)
        metrics = actor.update_actor(scored)
        weights = {name: parameter.full_tensor().detach().clone() for name, parameter in
                   actor.model.named_parameters() if parameter.requires_grad}
        results.append((scored, metrics, weights))
        # a collective: the update gathers the tower's unit though it has no image left to encode
        assert len(gathers) == int(cached)
        if cached:
            assert len(actor_calls) == len(reference_calls) == 1
            assert not actor.image_embeddings.ready and not reference.image_embeddings.ready
        else:
            assert len(actor_calls) > 4 and len(reference_calls) > 1
    (cached_batch, cached_metrics, cached_weights), (batch_without, metrics_without, weights_without) = results
    for key in ("old_log_probs", "ref_log_probs", "entropy"):
        torch.testing.assert_close(cached_batch[key], batch_without[key], rtol=0, atol=1e-5, msg=key)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert cached_metrics[key] == pytest.approx(metrics_without[key], rel=1e-4, abs=1e-6), key
    for name, weight in cached_weights.items():
        torch.testing.assert_close(weight, weights_without[name], rtol=1e-5, atol=1e-6, msg=name)
