"""Multimodal prefill of the native engine: Qwen2-VL, Qwen2.5-VL and Qwen3-VL prompts with images.

A request's ``multi_modal_inputs`` (its processor's ``pixel_values`` and ``image_grid_thw``) enter the engine with
the request (``MultimodalPrompts.add``). At a prefill, the engine's own copy of the vision tower
(``VisionTower``) encodes the images whose ``<|image_pad|>`` tokens the step computes, once per request (the
embeddings stay with the request until it finishes, for a preempted sequence's recompute), and the embeddings
take the place of those tokens' embeddings; Qwen3-VL's deepstack features are added to the visual tokens'
residual stream after its first decoder layers. The prefill's tokens rotate by their three M-RoPE position ids
(time, height, width; ``models.vision.sequence_rope_positions``): each rotary frequency reads one of the three,
Qwen2-VL and Qwen2.5-VL in contiguous sections, Qwen3-VL interleaved (``MropeLayout``). A sequence's tokens
after its prompt are text at position ``index + rope delta`` on all three axes, where M-RoPE reduces to the
plain rotary table: decode steps read that table at the shifted position (``rope_positions``), and are
otherwise those of a text model (CUDA graphs included). The n samples of a prompt share its prefill.

Prefix caching: the keys and values of an image's tokens depend on the image, which the token ids do not
name. The engine's copy of a multimodal prompt's token ids names each image's pad tokens by a negative id of
their own (``image_key_id``): the digest of the image's pixels when the request keeps its prefix for a
continuation (an agent's next turn repeats its images, whose blocks it then reuses), else an id unique to
the request, so no other prompt ever matches its image blocks. The ids never reach the model (their
embeddings are replaced) nor the caller (completions hold the generated tokens only).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from torch import Tensor, nn

from reinforge.models.architectures import ArchitectureSpec, architecture_spec, text_config
from reinforge.models.vision import batch_tower_attention, image_token_mask, sequence_rope_positions
from reinforge.rollout.base import GenerationRequest

logger = logging.getLogger(__name__)

TEXT_FAMILIES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
"""model_type of each vision-language family the engine runs -> the text family its language model is."""

INTERLEAVED_MROPE = ("qwen3_vl",)
"""Families whose M-RoPE interleaves the three axes over the rotary frequencies (the others use sections)."""


def is_vision_language(config) -> bool:
    return getattr(config, "model_type", None) in TEXT_FAMILIES


def native_architecture_spec(config) -> ArchitectureSpec | None:
    """The architecture table the engine runs: a vision-language model's is its language model's."""
    if not is_vision_language(config):
        return architecture_spec(config)
    language = copy.copy(text_config(config))
    language.model_type = TEXT_FAMILIES[config.model_type]
    return architecture_spec(language)


def language_model(model: nn.Module) -> nn.Module:
    """The module holding embed_tokens, layers, norm and rotary_emb of a vision-language model."""
    return model.model.language_model


def vision_module(model: nn.Module) -> nn.Module:
    return model.model.visual


def multimodal_unsupported_reason(model: nn.Module) -> str | None:
    """Why the engine cannot run the vision-language ``model``, or None when it can."""
    config = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "language_model") or not hasattr(inner, "visual"):
        return f"{type(model).__name__} keeps no model.language_model and model.visual"
    rope = getattr(text_config(config), "rope_parameters", None) or getattr(text_config(config), "rope_scaling", None)
    if not isinstance(rope, dict) or "mrope_section" not in rope:
        return f"{config.model_type}'s text config names no mrope_section"
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"{config.model_type} with rope_type={rope.get('rope_type')!r}; the engine's M-RoPE is the default one"
    return None


def image_key_id(digest: bytes) -> int:
    """The negative token id naming an image's pad tokens in the engine's copy of a prompt (63 bits of ``digest``)."""
    return -1 - (int.from_bytes(digest[:8], "little") & (2**62 - 1))


class MropeLayout:
    """cos and sin of M-RoPE for tokens with three position ids, as the model's text rotary module computes them.

    Rotary frequency j reads axis ``axis_of_frequency[j]`` of a token's position ids: Qwen2-VL and Qwen2.5-VL
    give the first mrope_section[0] frequencies to time, the next mrope_section[1] to height and the rest to
    width; Qwen3-VL gives frequencies 1, 4, 7, ... (the first 3 * mrope_section[1]) to height, 2, 5, 8, ... (the
    first 3 * mrope_section[2]) to width and the others to time.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device):
        config = model.config
        rotary = language_model(model).rotary_emb
        rope = getattr(text_config(config), "rope_parameters", None) or text_config(config).rope_scaling
        sections = list(rope["mrope_section"])
        self.inv_freq = rotary.inv_freq.detach().float().to(device)
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))
        half = self.inv_freq.shape[0]
        axis = np.zeros(half, dtype=np.int64)
        if config.model_type in INTERLEAVED_MROPE:
            for dim, offset in ((1, 1), (2, 2)):
                axis[offset:sections[dim] * 3:3] = dim
        else:
            axis[:] = np.repeat([0, 1, 2], sections)[:half]
        self.axis_of_frequency = torch.from_numpy(axis).to(device)
        self.dtype = dtype
        self.device = device

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens, rotary_dim) cos and sin in the model dtype for position ids (3, tokens)."""
        chosen = positions.to(self.device)[self.axis_of_frequency].t()  # (tokens, half): each frequency's axis
        freqs = chosen.float() * self.inv_freq
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        return torch.cat((cos, cos), dim=-1).to(self.dtype), torch.cat((sin, sin), dim=-1).to(self.dtype)

    def text_table(self, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin of text positions 0..length-1 (equal on all three axes): the decode steps' table."""
        return self.cos_sin(torch.arange(length, device=self.device).expand(3, -1))


VISION_FLASH = "reinforge_vision_flash"
"""The attention the engine's vision tower runs on CUDA in bf16/fp16: every image's (or window's) patches attend
to each other in one flash varlen call; transformers' SDPA path makes one call per window (16 per 448 x 448 image
and layer in Qwen2.5-VL's windowed layers)."""


def vision_flash_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None = None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs) -> tuple[Tensor, None]:
    """query, key, value (1, heads, patches, dim) -> (1, patches, heads, dim), unmasked within each segment of
    ``cu_seq_lens_q``; without it (a transformers that splits the segments itself) one SDPA call."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    q, k, v = (tensor[0].transpose(0, 1).contiguous() for tensor in (query, key, value))
    cu_seqlens = cu_seqlens.to(torch.int32)
    longest = kwargs.get("max_length_q")
    longest = int(longest) if longest is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, False,
                                                  False, scale=scaling)[0]
    return out.unsqueeze(0), None


@cache
def _register_vision_flash() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_FLASH, vision_flash_attention)


class VisionTower:
    """The engine's own copy of the model's vision tower, refreshed in place at each weight sync like the decoder's.

    On CUDA in bf16/fp16 it attends with ``VISION_FLASH`` once a probe (a 224 x 224 image through both) finds it
    agrees with SDPA; elsewhere, or if it does not, with SDPA (``attention`` says which), one call per layer over
    all the images and windows (``batched``) where the tower's attention modules have the known shape."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.device = device
        self.module: nn.Module | None = None
        self.attention = "sdpa"
        self.batched = False  # SDPA over every image and window of a layer at once (``batch_tower_attention``)
        self._probed = False

    @torch.no_grad()
    def load(self, model: nn.Module, whole: Callable[[Tensor], Tensor]) -> None:
        """Copy ``model``'s vision tower (made on first use, else overwritten in place); ``whole`` reads a parameter's
        full tensor (``model.whole``)."""
        source = vision_module(model)
        if self.module is None:
            # the model's own class (FSDP wraps it in a subclass of its own), built empty, then filled below:
            # parameters in the engine's dtype, buffers in the model's (rotary frequencies stay float32)
            plain = next(cls for cls in type(source).__mro__ if cls.__module__.startswith("transformers."))
            config = copy.deepcopy(source.config)  # its own: the attention set below is the copy's alone
            config._attn_implementation = "sdpa"
            with torch.device("meta"):
                module = plain(config)
            module = module.to_empty(device=self.device).to(self.dtype).eval()
            for name, buffer in source.named_buffers():
                owner, _, leaf = name.rpartition(".")
                module.get_submodule(owner)._buffers[leaf] = torch.empty_like(buffer, device=self.device)
            self.module = module
            module.config._attn_implementation = self.attention
            if self.batched:  # a copy made again after the engine's memory was freed attends as the first did
                batch_tower_attention(module)
        targets = dict(itertools.chain(self.module.named_parameters(), self.module.named_buffers()))
        for name, tensor in itertools.chain(source.named_parameters(), source.named_buffers()):
            if ".lora_" in name:  # a LoRA actor's adapters: the engine adds their product (``linear_slices``)
                continue
            target = targets[name.replace(".base_layer", "")]
            target.copy_(whole(tensor).detach().to(target.dtype))
        if not self._probed:
            self._probed = True
            if self._flash_may_apply():
                self.attention = VISION_FLASH if self._flash_agrees() else "sdpa"
                self.module.config._attn_implementation = self.attention
            # one SDPA call per layer over all the images and windows, as packed training runs the tower
            # (transformers' SDPA path makes one call per image or window: tens of thousands a rollout)
            self.batched = self.attention == "sdpa" and batch_tower_attention(self.module) > 0

    def linear_slices(self, model: nn.Module) -> dict[int, Tensor]:
        """id(linear layer of ``model``'s vision tower, or the LoRA wrapper around one) -> the copy's weight."""
        slices = {}
        for name, module in vision_module(model).named_modules():
            if isinstance(getattr(module, "weight", None), Tensor) and name and ".lora_" not in name:
                copy_name = name.replace(".base_layer", "")
                target = self.module.get_submodule(copy_name)
                if isinstance(getattr(target, "weight", None), Tensor) and target.weight.dim() == 2:
                    slices[id(module)] = target.weight
        return slices

    def _flash_may_apply(self) -> bool:
        return (self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                and hasattr(torch.ops.aten, "_flash_attention_forward"))

    def _flash_agrees(self) -> bool:
        """Whether the tower with ``VISION_FLASH`` encodes a random 224 x 224 image as with SDPA (within bf16's
        rounding over its layers); any error says no."""
        config = self.module.config
        patch, merge = config.patch_size, config.spatial_merge_size
        side = 224 // patch // merge * merge
        channels = getattr(config, "in_channels", getattr(config, "in_chans", 3))
        generator = torch.Generator(device="cpu").manual_seed(0)
        pixels = torch.randn(side * side, channels * config.temporal_patch_size * patch * patch, generator=generator)
        grid = torch.tensor([[1, side, side]])
        try:
            _register_vision_flash()
            reference, _ = self.encode(pixels, grid)
            config._attn_implementation = VISION_FLASH
            flash, _ = self.encode(pixels, grid)
        except Exception as error:  # noqa: BLE001  (any failure keeps SDPA, said once)
            logger.warning("the native engine's vision tower keeps SDPA attention: the flash varlen path failed "
                           "(%s: %s)", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            return False
        finally:
            config._attn_implementation = "sdpa"
        scale = reference.float().abs().max().clamp(min=1e-6)
        agrees = bool(((flash.float() - reference.float()).abs().max() / scale) < 0.02)
        if not agrees:
            logger.warning("the native engine's vision tower keeps SDPA attention: the flash varlen path disagreed")
        return agrees

    def free(self) -> None:
        self.module = None

    @torch.no_grad()
    def encode(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Merged embeddings (image tokens, hidden) of the images of ``grid_thw`` (images, 3), in order, and the
        deepstack features (one (image tokens, hidden) per deepstack layer; none for families without them)."""
        output = self.module(pixel_values.to(self.device, self.dtype), grid_thw=grid_thw.to(self.device))
        if isinstance(output, Tensor):
            return output, []
        if isinstance(output, tuple):  # (embeddings, deepstack features)
            return output[0], list(output[1]) if len(output) > 1 and output[1] is not None else []
        embeddings = output.pooler_output if output.pooler_output is not None else output.last_hidden_state
        return embeddings, list(getattr(output, "deepstack_features", None) or [])


@dataclass
class ImageSpan:
    """One image of a prompt: its pad tokens (prompt indices start..start + num_tokens) and its patches."""

    start: int
    num_tokens: int
    patch_start: int
    num_patches: int
    grid_thw: tuple[int, int, int]


class MultimodalPrompt:
    """A request's images, its prompt's M-RoPE positions and, once encoded, its images' embeddings."""

    def __init__(self, request: GenerationRequest, config, request_number: int):
        inputs = request.multi_modal_inputs
        unknown = set(inputs) - {"pixel_values", "image_grid_thw"}
        if unknown or "pixel_values" not in inputs or "image_grid_thw" not in inputs:
            raise ValueError(f"request {request.request_id!r} has multi_modal_inputs {sorted(inputs)}; the native "
                             "engine reads pixel_values and image_grid_thw (images; no videos)")
        self.pixel_values = inputs["pixel_values"]
        grids = inputs["image_grid_thw"].reshape(-1, 3).tolist()
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
        merge = config.vision_config.spatial_merge_size
        try:  # the images' tokens; an image-token id outside them (an earlier turn sampled it) is text
            is_image = image_token_mask(config, torch.from_numpy(prompt),
                                        inputs["image_grid_thw"].reshape(-1, 3).cpu()).numpy()
        except ValueError as error:
            raise ValueError(f"request {request.request_id!r}: its image tokens do not hold its images: {error}") from None
        self.spans: list[ImageSpan] = []
        index = patch = 0
        for grid in grids:
            while index < len(prompt) and not is_image[index]:
                index += 1
            num_tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
            if not is_image[index:index + num_tokens].all() or len(is_image[index:index + num_tokens]) < num_tokens:
                raise ValueError(f"request {request.request_id!r}: image {len(self.spans)} of grid {grid} needs "
                                 f"{num_tokens} image tokens at prompt index {index}; the prompt's ids must come "
                                 "from the processor that made image_grid_thw")
            num_patches = grid[0] * grid[1] * grid[2]
            self.spans.append(ImageSpan(index, num_tokens, patch, num_patches, tuple(grid)))
            index += num_tokens
            patch += num_patches
        if int(is_image.sum()) != sum(span.num_tokens for span in self.spans) or patch != self.pixel_values.shape[0]:
            raise ValueError(f"request {request.request_id!r} has {int(is_image.sum())} image tokens and "
                             f"{self.pixel_values.shape[0]} patches for {len(grids)} images of grids {grids}; the "
                             "prompt's ids, pixel_values and image_grid_thw must come from one processor call")
        positions, self.rope_delta = sequence_rope_positions(config, torch.from_numpy(prompt),
                                                             inputs["image_grid_thw"].reshape(-1, 3))
        self.positions = positions.numpy()
        """(3, prompt tokens) M-RoPE position ids."""
        self.embeddings: list[tuple[Tensor, list[Tensor]] | None] = [None] * len(self.spans)
        """Each image's merged embeddings and deepstack features, once encoded."""
        key_ids = np.asarray(request.prompt_token_ids, dtype=np.int64)
        for number, span in enumerate(self.spans):
            if request.keep_prefix:
                digest = hashlib.blake2b(digest_size=8)
                digest.update(np.asarray(span.grid_thw, dtype=np.int64).tobytes())
                patches = self.pixel_values[span.patch_start:span.patch_start + span.num_patches]
                digest.update(patches.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())  # any dtype: bf16 too
                key = image_key_id(digest.digest())
            else:
                key = image_key_id(hashlib.blake2b(f"request {request_number} image {number}".encode(),
                                                   digest_size=8).digest())
            key_ids[span.start:span.start + span.num_tokens] = key
        self.key_token_ids: list[int] = key_ids.tolist()
        """The prompt as the engine's sequences hold it: image pad tokens named by ``image_key_id``."""

    def positions_of(self, start: int, stop: int) -> np.ndarray:
        """(3, stop - start) position ids of a sequence's tokens start..stop (generated ones: index + delta)."""
        num_prompt = self.positions.shape[1]
        prompt_part = self.positions[:, start:min(stop, num_prompt)]
        if stop <= num_prompt:
            return prompt_part
        text = np.arange(max(start, num_prompt), stop, dtype=np.int64) + self.rope_delta
        return np.concatenate([prompt_part, np.broadcast_to(text, (3, len(text)))], axis=1)

    def spans_within(self, start: int, stop: int) -> Iterator[tuple[int, ImageSpan, int, int]]:
        """(image number, span, first, last) of the images with tokens in start..stop; first..last: those tokens'
        rows within the image's embeddings."""
        for number, span in enumerate(self.spans):
            first, last = max(start, span.start), min(stop, span.start + span.num_tokens)
            if first < last:
                yield number, span, first - span.start, last - span.start


@dataclass
class PrefillImages:
    """What a multimodal prefill step adds to a text one: image embeddings at rows ``rows`` of the step's packed
    tokens, deepstack features to add after the first decoder layers (same rows), and every token's cos and sin."""

    rows: Tensor
    embeddings: Tensor
    deepstack: list[Tensor]
    cos: Tensor
    sin: Tensor

    def place(self, hidden: Tensor) -> Tensor:
        """The token embeddings (tokens, hidden) with the image rows replaced."""
        if not len(self.rows):
            return hidden
        return hidden.index_copy(0, self.rows, self.embeddings.to(hidden.dtype))

    def add_deepstack(self, layer: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """After decoder layer ``layer``, the stream residual + hidden with the layer's deepstack features added to
        the image rows, as (zeros, stream): the next norm adds the two as transformers' layer output would be."""
        if layer >= len(self.deepstack) or not len(self.rows):
            return hidden, residual
        stream = residual + hidden
        stream.index_add_(0, self.rows, self.deepstack[layer].to(stream.dtype))
        return torch.zeros_like(hidden), stream

    @contextmanager
    def rotary(self, tables) -> Iterator[Tensor]:
        """While open, ``tables`` (the decoder's ``RotaryTables``) hand every layer this step's cos and sin; yields
        the positions that read them (row i for token i)."""
        saved = tables.tables
        tables.tables = {kind: (self.cos, self.sin) for kind in saved}
        try:
            yield torch.arange(self.cos.shape[0], device=self.cos.device)
        finally:
            tables.tables = saved


class MultimodalPrompts:
    """The engine's multimodal requests by request key, its vision tower and M-RoPE layout (one per engine)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device):
        self.config = model.config
        self.image_token_id = model.config.image_token_id
        self.layout = MropeLayout(model, dtype, device)
        self.tower = VisionTower(dtype, device)
        self.device = device
        self.prompts: dict[int, MultimodalPrompt] = {}
        self._num_prepared = 0
        self.num_images_encoded = 0
        self.encode_seconds = 0.0
        """Time spent in the vision tower (device time included: the engine waits for the embeddings), summed."""

    def prepare(self, request: GenerationRequest) -> MultimodalPrompt:
        """``request``'s images checked against its prompt, with its positions and the ids its sequences hold."""
        self._num_prepared += 1
        return MultimodalPrompt(request, self.config, self._num_prepared)

    def add(self, request_key: int, prompt: MultimodalPrompt) -> None:
        """Hold a prepared prompt's images under ``request_key`` until ``discard``."""
        self.prompts[request_key] = prompt

    def discard(self, request_key: int) -> None:
        self.prompts.pop(request_key, None)

    def clear(self) -> None:
        self.prompts.clear()

    def rope_delta(self, request_key: int) -> int:
        """The request's rope delta (0 for a text request)."""
        prompt = self.prompts.get(request_key)
        return 0 if prompt is None else prompt.rope_delta

    def prefill_inputs(self, request_keys: list[int], starts: list[int], stops: list[int]) -> PrefillImages | None:
        """The images, deepstack features and cos/sin of a prefill of sequences (of requests ``request_keys``)
        computing tokens starts[i]..stops[i] each; None when none of them is multimodal."""
        if not any(key in self.prompts for key in request_keys):
            return None
        positions, rows, pieces, to_encode = [], [], [], {}
        offset = 0
        for key, start, stop in zip(request_keys, starts, stops, strict=True):
            prompt = self.prompts.get(key)
            if prompt is None:
                text = np.arange(start, stop, dtype=np.int64)
                positions.append(np.broadcast_to(text, (3, len(text))))
            else:
                positions.append(prompt.positions_of(start, stop))
                for number, span, first, last in prompt.spans_within(start, stop):
                    rows.append(np.arange(offset + span.start + first - start, offset + span.start + last - start))
                    pieces.append((prompt, number, first, last))
                    if prompt.embeddings[number] is None:
                        to_encode[(key, number)] = (prompt, number)
            offset += stop - start
        if to_encode:
            begin = time.perf_counter()
            self._encode(list(to_encode.values()))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.encode_seconds += time.perf_counter() - begin
        cos, sin = self.layout.cos_sin(torch.from_numpy(np.concatenate(positions, axis=1)))
        if not pieces:
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            return PrefillImages(empty, cos.new_zeros(0), [], cos, sin)
        embeddings = torch.cat([prompt.embeddings[number][0][first:last] for prompt, number, first, last in pieces])
        num_deepstack = len(pieces[0][0].embeddings[pieces[0][1]][1])
        deepstack = [torch.cat([prompt.embeddings[number][1][layer][first:last]
                                for prompt, number, first, last in pieces]) for layer in range(num_deepstack)]
        index = torch.from_numpy(np.concatenate(rows)).to(self.device)
        return PrefillImages(index, embeddings, deepstack, cos, sin)

    def _encode(self, images: list[tuple[MultimodalPrompt, int]]) -> None:
        """Run the vision tower once over ``images`` (prompt, image number) and keep each one's embeddings."""
        spans = [prompt.spans[number] for prompt, number in images]
        pixels = torch.cat([prompt.pixel_values[span.patch_start:span.patch_start + span.num_patches]
                            for (prompt, _), span in zip(images, spans, strict=True)])
        grids = torch.tensor([span.grid_thw for span in spans], dtype=torch.long)
        embeddings, deepstack = self.tower.encode(pixels, grids)
        sizes = [span.num_tokens for span in spans]
        per_image = embeddings.split(sizes)
        per_layer = [features.split(sizes) for features in deepstack]
        for index, (prompt, number) in enumerate(images):
            prompt.embeddings[number] = (per_image[index], [layer[index] for layer in per_layer])
        self.num_images_encoded += len(images)
