"""Partial rollouts on the real worker: segments under unchanged weights give the whole-sample result,
every token is kept once with the version that sampled it, and a sync between segments changes what
the rest of a sample is sampled with."""

from __future__ import annotations

import pytest
import torch

from reinforge.config import load_config
from reinforge.data import PromptLoader, RLDataset, get_pad_token_id
from reinforge.models import load_tokenizer
from reinforge.rollout.base import SamplingParams
from reinforge.trainer.modes.partial import group_batch, groups_from_prompts, run_segment
from reinforge.workers.actor_rollout import ActorRolloutWorker, seed_for

RESPONSE = 8


@pytest.fixture(scope="module")
def setup(tiny_model_dir, arithmetic_data_dir):
    config = load_config(None, [f"model.path={tiny_model_dir}", f"data.train_files=[{arithmetic_data_dir / 'train.parquet'}]",
                                "data.max_prompt_length=64", f"data.max_response_length={RESPONSE}", "rollout.n=3",
                                "trainer.mode=async", "data.train_batch_size=2", "actor.optim.lr=0.05"])
    tokenizer = load_tokenizer(str(tiny_model_dir))
    loader = PromptLoader.for_training(RLDataset.from_config(config.data, tokenizer, split="train"), config.data,
                                       get_pad_token_id(tokenizer))
    worker = ActorRolloutWorker(config, 4)
    return config, worker, next(iter(loader)), get_pad_token_id(tokenizer)


def make_groups(prompts, n=3):
    return groups_from_prompts(prompts, 0, n, lambda position, uid: seed_for(7, uid))


def generate_with(worker):
    return lambda batch, sampling: worker.generate(batch, sampling, 0)


SAMPLING = SamplingParams(max_tokens=RESPONSE, temperature=1.0)


def test_segments_under_unchanged_weights_are_the_whole_sample_with_each_token_versioned(setup):
    config, worker, prompts, pad = setup
    whole = make_groups(prompts)
    assert run_segment(generate_with(worker), whole, SAMPLING, RESPONSE, version=0, pad_token_id=pad) > 0
    pieces = make_groups(prompts)
    for version in range(RESPONSE // 2):
        run_segment(generate_with(worker), pieces, SAMPLING, 2, version=version, pad_token_id=pad)
    assert all(group.finished for group in whole + pieces)
    for group_whole, group_pieces in zip(whole, pieces, strict=True):
        for a, b in zip(group_whole.samples, group_pieces.samples, strict=True):
            assert a.tokens == b.tokens and a.stopped == b.stopped
            torch.testing.assert_close(torch.tensor(b.log_probs), torch.tensor(a.log_probs), rtol=0, atol=1e-5)
            assert len(b.tokens) == len(b.log_probs) == len(b.versions)
            assert b.versions == [position // 2 for position in range(len(b.tokens))]
            assert a.versions == [0] * len(a.tokens)
    rows = group_batch(pieces[0], RESPONSE, pad)
    for row, sample in enumerate(pieces[0].samples):
        length = len(sample.tokens)
        assert rows["response_mask"][row].sum() == length
        assert rows["responses"][row, :length].tolist() == sample.tokens
        assert rows["token_versions"][row].tolist() == sample.versions + [-1] * (RESPONSE - length)
        assert rows["input_ids"][row, :len(pieces[0].prompt_ids)].tolist() == pieces[0].prompt_ids
    assert list(rows["uid"]) == [pieces[0].uid] * 3


def test_a_sync_between_segments_resumes_samples_under_the_new_weights(setup):
    config, worker, prompts, pad = setup
    before = make_groups(prompts)
    run_segment(generate_with(worker), before, SAMPLING, 4, version=0, pad_token_id=pad)
    kept = [[list(sample.tokens) for sample in group.samples] for group in before]
    # change the weights: one large update, then the sync that gives the rollout version 1
    batch = group_batch(before[0], RESPONSE, pad)
    batch["advantages"] = torch.ones_like(batch["response_mask"])
    worker.update_actor(batch)
    worker.sync_rollout_weights()
    run_segment(generate_with(worker), before, SAMPLING, 4, version=1, pad_token_id=pad)
    for group, first_part in zip(before, kept, strict=True):
        for sample, tokens in zip(group.samples, first_part, strict=True):
            assert sample.tokens[:len(tokens)] == tokens  # nothing sampled before the sync was lost or redone
            assert sample.versions == [0] * len(tokens) + [1] * (len(sample.tokens) - len(tokens))
    # the tokens after the sync carry the new policy's log-probs, those before it the old one's
    rows = group_batch(before[1], RESPONSE, pad)
    current = worker.compute_log_prob(rows)["old_log_probs"]
    new_part, old_part = rows["token_versions"] == 1, rows["token_versions"] == 0
    assert new_part.any() and old_part.any()
    torch.testing.assert_close(rows["rollout_log_probs"][new_part], current[new_part], rtol=0, atol=1e-4)
    assert (rows["rollout_log_probs"][old_part] - current[old_part]).abs().max() > 1e-3


def test_a_vision_language_prompts_segments_see_its_images_as_sync_mode_does(tmp_path):
    """Every segment's request carries its prompt's pixels: the samples are sync mode's, which see the images."""
    from reinforge.demo.vision_task import VisionDemoTask
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.models.vision import processor_for
    from reinforge.protocol import MULTI_MODAL_KEY

    model_dir = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl")
    files = VisionDemoTask(num_train=2, num_test=1, num_sft=1).write(tmp_path / "data")
    config = load_config(None, [f"model.path={model_dir}", f"data.train_files=[{files['train']}]",
                                "data.max_prompt_length=64", f"data.max_response_length={RESPONSE}", "rollout.n=2",
                                "trainer.mode=async", "data.train_batch_size=2"])
    tokenizer = load_tokenizer(str(model_dir))
    dataset = RLDataset.from_config(config.data, tokenizer, split="train", processor=processor_for(model_dir))
    prompts = next(iter(PromptLoader.for_training(dataset, config.data, get_pad_token_id(tokenizer))))
    assert all(images["pixel_values"].numel() for images in prompts[MULTI_MODAL_KEY])
    worker = ActorRolloutWorker(config, 4)
    groups = make_groups(prompts, n=2)
    for version in range(RESPONSE // 4):
        run_segment(generate_with(worker), groups, SAMPLING, 4, version=version, pad_token_id=tokenizer.pad_token_id)
    sync = worker.generate(prompts.repeat(2), SAMPLING, 7)
    for row, sample in enumerate(sample for group in groups for sample in group.samples):
        length = int(sync["response_mask"][row].sum())
        assert sample.tokens == sync["responses"][row, :length].tolist()
        torch.testing.assert_close(torch.tensor(sample.log_probs), sync["rollout_log_probs"][row, :length], rtol=0,
                                   atol=1e-5)
