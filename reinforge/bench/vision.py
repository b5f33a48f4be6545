"""The vision-language workload of ``reinforge bench train --model qwen2.5-vl-3b`` and its TRL twin.

The model folder holds the shape's random bf16 weights and a processor: the Qwen2.5-VL processor around the
Qwen2-VL image processor (14-pixel patches, 2 x 2 merged, images resized to exactly ``IMAGE_SIDE`` pixels square)
and the character tokenizer with the vision tokens (``models.tiny_vlm.build_vision_tokenizer``), whose ids the
config's ``image_token_id`` and friends name. A prompt is one user turn of the chat template: one random
448 x 448 image (256 image tokens after the merge) and ``--prompt-tokens`` random letters (one token each), as
the processor encodes them; the rollout generates ``--response-tokens`` tokens for each of its n samples.
``prompt_images`` gives the same images and texts to reinforge and to ``benchmarks/trl_grpo_vl.py``.
``--cpu`` uses the tiny Qwen2.5-VL of ``models.tiny_vlm`` and 32 x 32 images.
"""

from __future__ import annotations

import random
import string
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

IMAGE_SIDE = 448
"""Pixels on each side of the workload's images."""
TINY_IMAGE_SIDE = 32


def write_vision_model(folder: Path, tiny: bool, size: str) -> Path:
    """Shape ``size`` (a vision-language one) with random bf16 weights and its processor in ``folder/model``;
    ``tiny``: the tiny float32 Qwen2.5-VL of ``models.tiny_vlm``."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from reinforge.bench.shapes import SHAPES, shape_config
    from reinforge.models.export import default_dtype
    from reinforge.models.tiny_vlm import (
        IMAGE_PAD_TOKEN,
        VIDEO_PAD_TOKEN,
        VISION_END_TOKEN,
        VISION_START_TOKEN,
        build_vision_tokenizer,
        save_processor_folder,
        save_tiny_vlm,
    )
    from reinforge.models.vision import PROCESSOR_CLASSES, image_only_processor

    family = SHAPES[size].family
    if tiny:
        return save_tiny_vlm(folder / "model", arch=family)
    tokenizer = build_vision_tokenizer()
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           (("image", IMAGE_PAD_TOKEN), ("video", VIDEO_PAD_TOKEN), ("vision_start", VISION_START_TOKEN),
            ("vision_end", VISION_END_TOKEN))}
    keys = {key: value for key, value in shape_config(size).items() if key != "model_type"}
    vision, tied = keys.pop("vision_config"), keys.pop("tie_word_embeddings")
    text = keys | {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision, tie_word_embeddings=tied, **ids,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"), default_dtype(torch.bfloat16):
        model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(folder / "model")
    vision = config.vision_config
    image_processor = _image_processor_class()(
        patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size, min_pixels=IMAGE_SIDE * IMAGE_SIDE,
        max_pixels=IMAGE_SIDE * IMAGE_SIDE)
    processor = image_only_processor(PROCESSOR_CLASSES[family], image_processor, tokenizer)
    save_processor_folder(processor, folder / "model")
    del model
    return folder / "model"


def _image_processor_class():
    """The Qwen2-VL image processor: the PIL one where transformers has it apart (no torchvision needed)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


def prompt_images(num_prompts: int, num_letters: int, side: int, seed: int) -> tuple[list, list[str]]:
    """``num_prompts`` random RGB images of ``side`` x ``side`` pixels and as many texts of ``num_letters`` random
    letters (the same for the same arguments)."""
    from PIL import Image

    generator = np.random.default_rng(seed)
    letters = random.Random(seed)
    images = [Image.fromarray(generator.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(num_prompts)]
    texts = ["".join(letters.choice(string.ascii_letters) for _ in range(num_letters)) for _ in range(num_prompts)]
    return images, texts


def conversation(text: str) -> list[dict]:
    """One user turn: an image, then ``text``."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


class VisionPrompts:
    """The workload's prompt batches (one image and ``args.prompt_tokens`` letters a prompt), step by step."""

    def __init__(self, model_dir: Path, args):
        from reinforge.models.vision import load_processor

        self.processor = load_processor(model_dir)
        if getattr(self.processor, "chat_template", None) is None:
            self.processor.chat_template = self.processor.tokenizer.chat_template
        self.args = args
        self.side = TINY_IMAGE_SIDE if args.cpu else IMAGE_SIDE

    @property
    def prompt_length(self) -> int:
        """Tokens of each prompt (all are as long: one image of the same size, as many letters)."""
        return self._encoded(0)["input_ids"].shape[1]

    @property
    def image_tokens(self) -> int:
        """Image tokens of each prompt: its image's patches over merge_size^2 (256 for 448 x 448 at 14 pixels)."""
        return int(self._encoded(0)["image_grid_thw"].prod(-1).max()) // self.processor.image_processor.merge_size ** 2

    @lru_cache(maxsize=1)  # noqa: B019  (one instance a run; each step asks twice)
    def _encoded(self, step: int) -> dict:
        args = self.args
        images, texts = prompt_images(args.prompts, args.prompt_tokens, self.side, seed=1000 + step)
        prompts = [self.processor.apply_chat_template(conversation(text), add_generation_prompt=True, tokenize=False)
                   for text in texts]
        return dict(self.processor(text=prompts, images=images, return_tensors="pt", padding=True))

    def batch(self, step: int):
        """Step ``step``'s prompts, each repeated n times: input_ids, attention_mask, uid and multi_modal_inputs."""
        from reinforge.protocol import Batch

        args = self.args
        encoded = self._encoded(step)
        grids = encoded["image_grid_thw"]
        patches = encoded["pixel_values"].split(grids.prod(-1).tolist())
        rows = np.empty(args.prompts, dtype=object)
        rows[:] = [{"pixel_values": pixels, "image_grid_thw": grid[None]} for pixels, grid in zip(patches, grids,
                                                                                                 strict=True)]
        batch = Batch.from_dict(tensors={"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]},
                                non_tensors={"uid": np.array([f"{step}-{i}" for i in range(args.prompts)], dtype=object),
                                             "multi_modal_inputs": rows})
        return batch.repeat(args.n, interleave=True)
