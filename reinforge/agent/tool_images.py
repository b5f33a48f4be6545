"""Images in tool results: a tool may show the model an image (a crop of the prompt's image, a rendered plot).

A ``ToolResult`` with ``images`` becomes a tool message whose content is those images, then its text, as a
vision-language chat template renders content parts. Its turn is rendered as any tool turn (``turn_tokens``),
and the model's processor turns the text with its image placeholders into token ids, one ``<|image_pad|>`` per
merged patch, and the images into ``pixel_values`` and ``image_grid_thw``. The ids join the trajectory like any
tool output (response mask 0); the pixels join the trajectory's images (the prompt's first, then each tool turn's,
in the order their pad tokens appear), which every later turn's request carries to the engine and the rollout
hands to training (``multi_modal_inputs`` of ``AgentLoopOutput``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def tool_message(text: str, images: tuple | list, call_id: str | None = None) -> dict[str, Any]:
    """A tool message: plain text, or its images then its text as content parts; with ``tool_call_id`` when the
    call has an id (a template may render it, as Mistral's does)."""
    message: dict[str, Any] = {"role": "tool", "content": text} if not images else {
        "role": "tool", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def encode_with_images(processor: Any, text: str, images: list) -> tuple[list[int], dict[str, Tensor]]:
    """The token ids of ``text`` (a rendered turn with one image placeholder per image) with each placeholder
    expanded by the processor, and the images' ``pixel_values`` and ``image_grid_thw``."""
    token = getattr(processor, "image_token", None) or "<|image_pad|>"
    places = text.count(token)
    if places < len(images):  # transformers' own error named neither the tool nor the template
        raise ValueError(f"a tool returned {len(images)} image(s), but the chat template rendered its tool turn with "
                         f"{places} {token!r} token(s): it shows no image content part of a tool message; set "
                         "data.chat_template to one that renders {'type': 'image'} parts in tool messages, or return "
                         "text from the tool")
    if places > len(images):
        raise ValueError(f"a tool returned {len(images)} image(s), but its tool turn holds {places} {token!r} tokens: "
                         f"its text spells {places - len(images)} {token!r}, the model's image token, which would "
                         "take an image's place; return text without it")
    encoded = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
    return encoded["input_ids"][0].tolist(), {key: encoded[key] for key in IMAGE_KEYS}


def merged_images(first: dict[str, Tensor] | None, second: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    """The images of ``first`` then those of ``second`` (either may be None or empty)."""
    if not first:
        return dict(second) if second else None
    if not second:
        return dict(first)
    return {key: torch.cat([first[key], second[key]]) for key in IMAGE_KEYS}
