"""An image-token id outside a sequence's images (the policy sampled it, or a completion holds it) is text: the
native engine embeds it as text at text positions, and training, SFT and the hf backend compute the same."""

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from reinforge.engine.forward import response_log_probs
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.packing import attach_plan, pack_vision_inputs, plan_packing
from reinforge.models.tiny_vlm import build_tiny_processor, build_tiny_vlm, tiny_vlm_config
from reinforge.models.vision import image_token_mask, sequence_rope_positions
from reinforge.protocol import MULTI_MODAL_KEY, Batch
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.hf import HFEngine
from reinforge.rollout.native import NativeEngine
from reinforge.trainer.sft_trainer import token_log_probs

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from test_native_vlm import encode  # noqa: E402
from test_vlm_rollout import sampled_batch  # noqa: E402

ARCHES = ("qwen2_5_vl", "qwen3_vl")


def test_rope_positions_give_image_token_ids_outside_the_images_text_positions():
    config = tiny_vlm_config("qwen2_5_vl")
    image, text = config.image_token_id, 7
    # text, text, an image of 2 x 2 merged patches, a stray image token right after it, text, a lone stray
    ids = torch.tensor([text, text, image, image, image, image, image, text, image])
    positions, delta = sequence_rope_positions(config, ids, torch.tensor([[1, 4, 4]]))
    expected = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5, 6],
                             [0, 1, 2, 2, 3, 3, 4, 5, 6],
                             [0, 1, 2, 3, 2, 3, 4, 5, 6]])
    assert torch.equal(positions, expected)
    assert delta == 7 - 9
    assert image_token_mask(config, ids, torch.tensor([[1, 4, 4]])).tolist() == [False] * 2 + [True] * 4 + [False] * 3
    positions, delta = sequence_rope_positions(config, torch.tensor([text, image, text]), None)  # no images: all text
    assert torch.equal(positions, torch.arange(3).expand(3, -1)) and delta == 0


def test_image_runs_that_do_not_hold_the_grids_raise_one_line():
    config = tiny_vlm_config("qwen2_5_vl")
    ids = torch.tensor([7, config.image_token_id, config.image_token_id, 7])
    with pytest.raises(ValueError, match=r"hold 0 of the 1 images of its image_grid_thw") as error:
        sequence_rope_positions(config, ids, torch.tensor([[1, 4, 4]]))
    assert "\n" not in str(error.value)
    batch = Batch.from_dict(tensors={"prompts": ids[None, :3], "responses": ids[None, 3:],
                                     "response_mask": torch.ones(1, 1), "input_ids": ids[None],
                                     "attention_mask": torch.ones(1, 4, dtype=torch.long)},
                            non_tensors={MULTI_MODAL_KEY: [{"image_grid_thw": torch.tensor([[1, 4, 4]]),
                                                            "pixel_values": torch.zeros(16, 384)}]})
    with pytest.raises(ValueError, match=r"^row 0 of the micro-batch: the sequence's runs of image token"):
        pack_vision_inputs(batch, plan_packing(batch), config)


def sampled_with_image_tokens(model, processor) -> tuple[Batch, Tensor]:
    """Samples of the native engine (float32, seeded): from a prompt with an image, ones whose response holds the
    image token and ones without; from the same prompt cut right after its image's tokens, one whose first token
    is the image token (a stray token right after the image's run) and one whose is not. Rollout layout, and the
    engine's log-prob of each response token (0 past the response)."""
    image = model.config.image_token_id
    inputs = encode(processor, 1, seed=3)
    ids = inputs["input_ids"][0].tolist()
    cut = dict(inputs, input_ids=inputs["input_ids"][:, :max(i for i, token in enumerate(ids) if token == image) + 1])
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=8, max_num_seqs=256)
    sampling = SamplingParams(max_tokens=6, temperature=1.0, n=256, seed=7, ignore_eos=True)
    images = {name: inputs[name] for name in ("pixel_values", "image_grid_thw")}
    whole, after_image = engine.generate([GenerationRequest(prompt["input_ids"][0].tolist(), sampling,
                                                            multi_modal_inputs=images) for prompt in (inputs, cut)])
    chosen = {"inside": next(s for s in whole if image in s.token_ids[1:]),
              "none": next(s for s in whole if image not in s.token_ids),
              "right after the image": next(s for s in after_image if s.token_ids[0] == image),
              "none after the image": next(s for s in after_image if image not in s.token_ids)}
    prompts = [inputs, inputs, cut, cut]
    width = max(prompt["input_ids"].shape[1] for prompt in prompts)
    pad = processor.tokenizer.pad_token_id
    prompt_ids = torch.full((4, width), pad)
    prompt_mask = torch.zeros(4, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        length = prompt["input_ids"].shape[1]
        prompt_ids[row, width - length:] = prompt["input_ids"][0]
        prompt_mask[row, width - length:] = 1
    prompt_batch = Batch.from_dict(tensors={"prompts": prompt_ids, "attention_mask": prompt_mask},
                                   non_tensors={MULTI_MODAL_KEY: [images] * 4})
    batch = sampled_batch(prompt_batch, [[sample] for sample in chosen.values()], pad)
    log_probs = torch.zeros_like(batch["response_mask"])
    for row, sample in enumerate(chosen.values()):
        log_probs[row, :len(sample.log_probs)] = torch.tensor(sample.log_probs)
    return batch, log_probs


@pytest.mark.parametrize("arch", ARCHES)
def test_packed_and_sft_log_probs_of_sampled_image_tokens_are_the_native_engines(arch):
    """Rows 0 and 2 hold the image token in their response (row 2 right after the image's run); rows 1 and 3 are
    the common path. The packed pass (each row alone and a prompt's rows sharing it) and the SFT forward give the
    engine's log-probs."""
    batch, expected = sampled_with_image_tokens(build_tiny_vlm(arch, seed=5), build_tiny_processor(arch))
    model = build_tiny_vlm(arch, seed=5)
    prepare_for_training(model, torch.device("cpu"))
    assert pack_vision_inputs(batch.index([1, 3]), plan_packing(batch.index([1, 3])), model.config).text_tokens is None
    for share in (False, True):
        log_probs, _ = response_log_probs(model, attach_plan(Batch(dict(batch.tensors), dict(batch.non_tensors), {}),
                                                             share_prompts=share))
        torch.testing.assert_close(log_probs * batch["response_mask"], expected, rtol=0, atol=1e-5)
    batch.tensors["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # as SFT batches have
    with torch.no_grad():
        sft = token_log_probs(build_tiny_vlm(arch, seed=5), batch) * batch["response_mask"]
    torch.testing.assert_close(sft, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_hf_backend_prompts_holding_a_sampled_image_token_give_the_packed_log_probs(arch):
    """A multi-turn prompt whose earlier assistant turn holds the image token: the hf backend generates from it
    (transformers counts the images' tokens only) and its log-probs are the packed pass's."""
    model, processor = build_tiny_vlm(arch, seed=2), build_tiny_processor(arch)
    image = model.config.image_token_id
    inputs = encode(processor, 1, seed=9)
    turn = processor.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    prompt = inputs["input_ids"][0].tolist() + [17, image, 23, image] + turn
    images = {name: inputs[name] for name in ("pixel_values", "image_grid_thw")}
    pad = processor.tokenizer.pad_token_id
    engine = HFEngine(model, pad_token_id=pad, eos_token_ids=[processor.tokenizer.eos_token_id])
    sampling = SamplingParams(max_tokens=5, temperature=0.0, n=2, ignore_eos=True)
    short = encode(processor, 1, text="hi", seed=9)["input_ids"][0].tolist()  # a shorter prompt: left padding
    completions = engine.generate([GenerationRequest(prompt, sampling, multi_modal_inputs=images),
                                   GenerationRequest(short, sampling, multi_modal_inputs=images)])
    width = len(prompt)
    prompt_ids = torch.full((2, width), pad)
    prompt_mask = torch.zeros(2, width, dtype=torch.long)
    for row, ids in enumerate((prompt, short)):
        prompt_ids[row, width - len(ids):] = torch.tensor(ids)
        prompt_mask[row, width - len(ids):] = 1
    batch = sampled_batch(Batch.from_dict(tensors={"prompts": prompt_ids, "attention_mask": prompt_mask},
                                          non_tensors={MULTI_MODAL_KEY: [images, images]}), completions, pad)
    training = build_tiny_vlm(arch, seed=2)
    prepare_for_training(training, torch.device("cpu"))
    with torch.no_grad():
        log_probs, _ = response_log_probs(training, attach_plan(batch, share_prompts=True))
    expected = torch.tensor([sample.log_probs for samples in completions for sample in samples])
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_native_engine_prompts_holding_a_sampled_image_token_give_the_hf_backends_tokens_and_log_probs(arch):
    """Multi-turn prompts whose earlier turns hold the image token, apart and right after the image's run: the
    native engine reads those ids as text, as the hf backend does (greedy tokens equal, log-probs within 1e-5)."""
    processor = build_tiny_processor(arch)
    image = tiny_vlm_config(arch).image_token_id
    inputs = encode(processor, 1, seed=9)
    ids = inputs["input_ids"][0].tolist()
    turn = processor.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    last = max(index for index, token in enumerate(ids) if token == image)
    prompts = [ids + [17, image, 23, image] + turn, ids[:last + 1] + [image] + ids[last + 1:] + turn]
    images = {name: inputs[name] for name in ("pixel_values", "image_grid_thw")}
    sampling = SamplingParams(max_tokens=5, temperature=0.0, n=1, ignore_eos=True)
    requests = [GenerationRequest(prompt, sampling, multi_modal_inputs=images) for prompt in prompts]
    hf = HFEngine(build_tiny_vlm(arch, seed=2), pad_token_id=processor.tokenizer.pad_token_id,
                  eos_token_ids=[processor.tokenizer.eos_token_id]).generate(requests)
    native = NativeEngine(build_tiny_vlm(arch, seed=2), eos_token_ids=[], max_model_len=256, block_size=8,
                          max_num_seqs=4).generate(requests)
    for (hf_sample,), (native_sample,) in zip(hf, native, strict=True):
        assert native_sample.token_ids == hf_sample.token_ids
        torch.testing.assert_close(torch.tensor(native_sample.log_probs), torch.tensor(hf_sample.log_probs),
                                   rtol=0, atol=1e-5)


def test_a_grpo_step_of_the_vision_demo_trains_on_sampled_image_tokens(tmp_path, monkeypatch):
    """The vision demo's GRPO on its tiny VLM, every rollout sample's first token the image token."""
    from reinforge.config import load_config
    from reinforge.demo.vision_runner import VisionDemoSettings
    from reinforge.demo.vision_task import VisionDemoTask
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.trainer.rl_trainer import RLTrainer

    generate = HFEngine._generate_same_params
    sampled = []

    def with_image_token(self, *args, **kwargs):
        completions = generate(self, *args, **kwargs)
        for samples in completions:
            for sample in samples:
                sample.token_ids[0] = self.model.config.image_token_id
                sampled.append(sample)
        return completions

    monkeypatch.setattr(HFEngine, "_generate_same_params", with_image_token)
    task = VisionDemoTask(num_train=4, num_test=2, num_sft=0)
    settings = VisionDemoSettings(total_steps=1, train_batch_size=2, n=2, test_every=0, save_every=0, num_val=2)
    files = task.write(tmp_path / "data")
    model_dir = save_tiny_vlm(tmp_path / "init", settings.arch)
    overrides = settings.overrides(model_dir, files, tmp_path / "run", task, "cpu", ("jsonl",))
    metrics = RLTrainer(load_config(None, [*overrides, "trainer.val_before_train=false"])).fit()
    actor = {key: value for key, value in metrics.items() if key.startswith("actor/")}
    assert len(sampled) >= 4 and actor and all(torch.isfinite(torch.tensor(float(value))) for value in actor.values())


def test_gradients_reach_the_image_tokens_own_embedding_as_a_text_tokens_would():
    """Qwen2.5-VL (no deepstack) through transformers with inputs_embeds built by hand, image features at the
    images' tokens only, against the packed pass: the same loss gradients, the image token's embedding row too."""
    from reinforge.models.vision import image_token_mask as mask_of

    batch, _ = sampled_with_image_tokens(build_tiny_vlm("qwen2_5_vl", seed=5), build_tiny_processor("qwen2_5_vl"))
    packed_model, reference = build_tiny_vlm("qwen2_5_vl", seed=5), build_tiny_vlm("qwen2_5_vl", seed=5)
    prepare_for_training(packed_model, torch.device("cpu"))
    weights = torch.linspace(-1, 1, batch["responses"].numel()).view_as(batch["response_mask"]) * batch["response_mask"]
    log_probs, _ = response_log_probs(packed_model, attach_plan(batch, share_prompts=False))
    (log_probs * weights).sum().backward()
    config = reference.config
    total = torch.zeros(())
    for row in range(len(batch)):
        attended = batch["attention_mask"][row].bool()
        ids = batch["input_ids"][row][attended]
        images = batch[MULTI_MODAL_KEY][row]
        positions, _ = sequence_rope_positions(config, ids, images["image_grid_thw"])
        embeds = reference.get_input_embeddings()(ids)
        features = torch.cat(reference.model.get_image_features(images["pixel_values"], images["image_grid_thw"],
                                                                return_dict=True).pooler_output)
        embeds = embeds.masked_scatter(mask_of(config, ids, images["image_grid_thw"])[:, None], features)
        logits = reference(inputs_embeds=embeds[None], position_ids=positions[:, None], use_cache=False).logits[0]
        length = int(batch["response_mask"][row].sum())
        targets = batch["responses"][row, :length]
        start = len(ids) - length - 1  # the prompt's last token predicts the first response token
        row_log_probs = torch.log_softmax(logits[start:start + length].float(), -1).gather(-1, targets[:, None])[:, 0]
        total = total + (row_log_probs * weights[row, :length]).sum()
    total.backward()
    image_row = packed_model.get_input_embeddings().weight.grad[config.image_token_id]
    assert image_row.abs().sum() > 0
    for (name, packed), (_, expected) in zip(packed_model.named_parameters(), reference.named_parameters(),
                                             strict=True):
        if packed.grad is not None or expected.grad is not None:
            torch.testing.assert_close(packed.grad, expected.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHES)
def test_packed_bf16_fast_path_gives_sampled_image_tokens_the_engines_log_probs_on_the_gpu(arch):
    """The packed training pass on CUDA (fused language model, compiled layers, flash varlen attention, bfloat16)
    on the CPU engine's float32 samples holding the image token."""
    from reinforge.engine.fused import describe_training_path

    device = torch.device("cuda")
    batch, expected = sampled_with_image_tokens(build_tiny_vlm(arch, seed=5), build_tiny_processor(arch))
    model = build_tiny_vlm(arch, seed=5).to(device, torch.bfloat16)
    prepare_for_training(model, device)
    assert "fast path" in describe_training_path(model, device)
    for share in (False, True):
        model.zero_grad()
        log_probs, _ = response_log_probs(model, attach_plan(Batch(dict(batch.to(device).tensors),
                                                                   dict(batch.non_tensors), {}), share_prompts=share))
        torch.testing.assert_close((log_probs * batch["response_mask"].to(device)).float().cpu(), expected,
                                   atol=5e-2, rtol=5e-2)
        (log_probs * batch["response_mask"].to(device)).sum().backward()
        grads = [parameter.grad for parameter in model.model.language_model.parameters()]
        assert all(grad is not None and torch.isfinite(grad).all() for grad in grads)
