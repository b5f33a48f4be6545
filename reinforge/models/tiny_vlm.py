"""Tiny vision-language models (Qwen2.5-VL and Qwen3-VL) and their processor, built in code.

Tests, the vision demo and the GPU checks need a real VLM of each family reinforge trains, with
no hub download. ``build_tiny_vlm`` builds one: the text model of ``reinforge.models.tiny``'s
shape (2 layers, hidden 64, 4 heads of 16 dims, multimodal rope over sections 2/3/3 of the 8
rotary frequencies; Qwen3-VL's interleaved) and a vision tower of 2 blocks (hidden 32, patches of
8 pixels, 2 x 2 patches merged into one language token; Qwen2.5-VL's window attention on its
first block, Qwen3-VL's deepstack features from its first block and learned position embeddings).

The processor is the family's own (``Qwen2_5_VLProcessor`` or ``Qwen3VLProcessor``) around the
Qwen2-VL image processor, resizing images to 16 x 16 .. 64 x 64 pixels, and the character
tokenizer of ``reinforge.models.tiny`` with the vision tokens ``<|vision_start|>``,
``<|image_pad|>`` (one per merged patch after expansion), ``<|vision_end|>`` and ``<|video_pad|>``,
as special tokens. Its chat template renders a message's content as a string or as a list of
parts, ``{"type": "image"}`` becoming ``<|vision_start|><|image_pad|><|vision_end|>``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from reinforge.models.export import atomic_folder
from reinforge.models.tiny import build_char_tokenizer
from reinforge.models.vision import PROCESSOR_CLASSES, image_only_processor

VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
VISION_TOKENS = (VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN)

PATCH_SIZE = 8
MERGE_SIZE = 2
MIN_PIXELS = 16 * 16
MAX_PIXELS = 64 * 64

_RENDER_CONTENT = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' or 'text' in part -%}{{ part.text }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)

VISION_CHAT_TEMPLATE = (
    _RENDER_CONTENT
    + "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ render(messages[0].content) }}{% else %}You are a helpful assistant."
    "{% endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + render(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{ '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + render(message.content) }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML whose contents may be lists of text and image parts; tools and tool responses as in Qwen2.5's template
(a tool's content may hold an image too)."""

VISION_ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl")


def build_vision_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer of ``models.tiny`` with the four vision tokens (special) and the vision chat template."""
    tokenizer = build_char_tokenizer(chat_template=VISION_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def build_tiny_processor(arch: str = "qwen2_5_vl", tokenizer: PreTrainedTokenizerFast | None = None):
    """The family's processor (image inputs only) over the tiny image processor and ``build_vision_tokenizer``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _check_arch(arch)
    tokenizer = tokenizer or build_vision_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
                                               size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    return image_only_processor(PROCESSOR_CLASSES[arch], image_processor, tokenizer)


def _check_arch(arch: str) -> None:
    if arch not in VISION_ARCHITECTURES:
        raise ValueError(f"unknown tiny vision-language architecture {arch!r}; known: {', '.join(VISION_ARCHITECTURES)}")


def tiny_vlm_config(arch: str = "qwen2_5_vl", tokenizer: PreTrainedTokenizerFast | None = None,
                    num_layers: int = 2, vision_depth: int = 2, **text_overrides) -> PretrainedConfig:
    """The config of a tiny ``arch`` VLM whose token ids are those of ``tokenizer`` (``build_vision_tokenizer``)."""
    _check_arch(arch)
    tokenizer = tokenizer or build_vision_tokenizer()
    token_ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
                 (("image", IMAGE_PAD_TOKEN), ("video", VIDEO_PAD_TOKEN), ("vision_start", VISION_START_TOKEN),
                  ("vision_end", VISION_END_TOKEN))}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=1024,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
    if arch == "qwen2_5_vl":  # window attention (2 x 2 merged patches) on the first block, full on the last
        vision |= {"window_size": 2 * MERGE_SIZE * PATCH_SIZE, "fullatt_block_indexes": [vision_depth - 1]}
    else:
        text["rope_parameters"]["mrope_interleaved"] = True
        vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    text |= text_overrides
    return AutoConfig.for_model(arch, text_config=text, vision_config=vision, tie_word_embeddings=True,
                                **token_ids)


def build_tiny_vlm(arch: str = "qwen2_5_vl", seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None,
                   **config_kwargs) -> PreTrainedModel:
    """A randomly initialised float32 tiny VLM of ``arch`` (see ``tiny_vlm_config``); the global RNG is left untouched."""
    tokenizer = tokenizer or build_vision_tokenizer()
    config = tiny_vlm_config(arch, tokenizer, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.float()


def save_processor_folder(processor, out_dir: Path) -> None:
    """Write the processor's tokenizer, image processor and the files that name the processor and video processor.

    Written piece by piece so a processor without its video processor (``vision.image_only_processor``) saves
    the folder a full ``AutoProcessor`` loads; the video processor's settings are the image processor's.
    """
    out_dir = Path(out_dir)
    processor.tokenizer.save_pretrained(out_dir)
    image_processor = processor.image_processor
    image_processor.save_pretrained(out_dir)
    family_class = next(cls for cls in type(processor).__mro__ if cls.__name__ in PROCESSOR_CLASSES.values())
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": family_class.__name__}, indent=2))
    video = {"video_processor_type": "Qwen2VLVideoProcessor" if family_class.__name__ == "Qwen2_5_VLProcessor"
             else "Qwen3VLVideoProcessor", "processor_class": family_class.__name__,
             "patch_size": image_processor.patch_size, "merge_size": image_processor.merge_size,
             "temporal_patch_size": image_processor.temporal_patch_size,
             "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 4},
             "image_mean": list(image_processor.image_mean), "image_std": list(image_processor.image_std)}
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


def save_tiny_vlm(out_dir: str | Path, arch: str = "qwen2_5_vl", seed: int = 0, **config_kwargs) -> Path:
    """Save a tiny VLM and its processor into ``out_dir`` (atomically), loadable by ``AutoModelForImageTextToText``
    and ``AutoProcessor`` (``vision.load_processor`` where torchvision is missing); returns the folder."""
    tokenizer = build_vision_tokenizer()
    model = build_tiny_vlm(arch, seed=seed, tokenizer=tokenizer, **config_kwargs)
    processor = build_tiny_processor(arch, tokenizer)
    out_dir = Path(out_dir)
    with atomic_folder(out_dir) as staging:
        model.save_pretrained(staging)
        save_processor_folder(processor, staging)
    return out_dir
