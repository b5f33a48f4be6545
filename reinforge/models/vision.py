"""Vision-language models: which configs are VLMs, their processors, and their multimodal rope positions.

reinforge trains Qwen2.5-VL and Qwen3-VL (``VISION_MODEL_TYPES``): a vision tower turns each image's
patches into embeddings that take the place of the image's ``<|image_pad|>`` tokens in the
language model's input, and the language model's rotary embedding is multimodal (M-RoPE): every
token has three position ids (time, height, width). Text tokens have the same id in all three
rows; an image's tokens take their row and column in the image's grid of merged patches, offset by
where the image starts; the text after an image goes on from the largest position the image
used plus one. A sequence's *rope delta* is its last position id plus one minus its length: the
tokens generated after the prompt are text, at position ``index + delta``.

Processors. ``load_processor`` returns the family's ``AutoProcessor``; where torchvision is not
installed, transformers cannot build the families' video processors, and the processor is built
with its image processor and tokenizer only (``image_only_processor``), which is all reinforge
uses.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen2_vl")
"""model_type of the vision-language models whose processors, rope index and vision tower reinforge knows."""

LANGUAGE_FAMILIES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
"""The text family of each VLM's language model, as ``models.architectures`` describes it."""

PROCESSOR_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
                     "qwen2_vl": "Qwen2VLProcessor"}


def is_vision_language(config) -> bool:
    """Whether ``config`` (an HF config or None) is that of a vision-language model reinforge knows."""
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES


def _processor_class(name: str):
    import transformers

    return getattr(transformers, name)


def image_only_processor(processor_class: str | type, image_processor, tokenizer, chat_template: str | None = None):
    """The processor ``processor_class`` (a family's, e.g. ``Qwen2_5_VLProcessor``) with no video processor."""
    family = _processor_class(processor_class) if isinstance(processor_class, str) else processor_class

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # the family's __init__ hands (image_processor, tokenizer, video_processor) to ProcessorMixin, which pairs
        # them with this class's attributes, image_processor and tokenizer: the missing video processor is dropped
        family.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    image_only = type(family.__name__, (family,), {"__init__": __init__, "__module__": __name__,
                                                   "__qualname__": family.__name__})
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return image_only(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def load_processor(path: str | Path, trust_remote_code: bool = False):
    """The ``AutoProcessor`` of a VLM folder or hub id; without torchvision, its image-only processor."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    config_file = Path(path) / "processor_config.json"
    processor_class = json.loads(config_file.read_text()).get("processor_class") if config_file.is_file() else None
    if processor_class is None:
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code).model_type
        processor_class = PROCESSOR_CLASSES.get(model_type)
    if processor_class is None:
        return AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return image_only_processor(processor_class, image_processor, tokenizer)


def _merge_size(config) -> int:
    return int(config.vision_config.spatial_merge_size)


def image_token_mask(config, input_ids: Tensor, image_grid_thw: Tensor | None) -> Tensor:
    """Which tokens of one sequence (no padding) are its images' (bool, tokens).

    ``image_grid_thw`` (images, 3) describes the sequence's runs of ``image_token_id`` in order: each run takes the
    next images whose token counts fit in what is left of it. An image-token id outside those images (the policy
    sampled it, or an SFT completion holds it; alone or right after an image's run) is text: the engines embed it
    as text at text positions. Raises ValueError when the runs cannot hold every image of the grid.
    """
    merge = _merge_size(config)
    is_token = input_ids == config.image_token_id
    mask = torch.zeros_like(is_token)
    counts = [] if image_grid_thw is None else (image_grid_thw.prod(-1) // (merge * merge)).tolist()
    index = 0  # the next image
    start = 0
    for image, run in itertools.groupby(is_token.tolist()):
        length = len(list(run))
        if image:
            end = start
            while index < len(counts) and end + counts[index] <= start + length:
                end += counts[index]
                index += 1
            mask[start:end] = True
        start += length
    if index < len(counts):
        raise ValueError(f"the sequence's runs of image token {config.image_token_id} hold {index} of the "
                         f"{len(counts)} images of its image_grid_thw; the prompt's token ids must come from the "
                         "processor that made image_grid_thw")
    return mask


def sequence_rope_positions(config, input_ids: Tensor, image_grid_thw: Tensor | None) -> tuple[Tensor, int]:
    """M-RoPE position ids (3, tokens) of one sequence (no padding) and its rope delta.

    ``image_grid_thw`` (images in the sequence, 3): each image's (time, height, width) in patches, in the order
    its ``image_token_id`` runs appear (``image_token_mask``: an image-token id outside them is text). Images only
    (no video): time positions of an image are all the image's start, as in transformers' ``get_rope_index`` for
    still images.
    """
    merge = _merge_size(config)
    is_image = image_token_mask(config, input_ids, image_grid_thw).tolist()
    grids = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    parts: list[Tensor] = []
    current = 0
    cursor = 0
    for image, run in itertools.groupby(is_image):
        length = len(list(run))
        if not image:
            parts.append(torch.arange(current, current + length).expand(3, -1))
            current += length
            cursor += length
            continue
        while length > 0:  # consecutive images form one run of image tokens
            time, height, width = next(grids)
            height, width = height // merge, width // merge
            count = time * height * width
            t_ids = torch.arange(time).view(-1, 1, 1).expand(time, height, width)
            h_ids = torch.arange(height).view(1, -1, 1).expand(time, height, width)
            w_ids = torch.arange(width).view(1, 1, -1).expand(time, height, width)
            parts.append(torch.stack([t_ids, h_ids, w_ids]).reshape(3, -1) + current)
            current += max(height, width)
            cursor += count
            length -= count
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - cursor if cursor else 0
    return positions.long(), delta


def _substitute_id(config) -> int:
    """A text id that no vision rule reads (not the image, video or vision start/end tokens)."""
    special = {getattr(config, f"{name}_token_id", None) for name in ("image", "video", "vision_start", "vision_end")}
    return next(token for token in range(len(special) + 1) if token not in special)


@contextlib.contextmanager
def image_tokens_as_text(model, input_ids: Tensor, text_tokens: Tensor | None) -> Iterator[Tensor]:
    """Yields the ``input_ids`` to give the VLM ``model`` so that its image-token ids marked in ``text_tokens``
    (same shape; None or none marked: ``input_ids`` as they are) are text: they are replaced by another id, so
    that transformers places image features and (Qwen3-VL) deepstack features at the images' tokens only and
    counts them alone, and while the context is open the model's input embedding gives those positions the image
    token's own embedding (gradients reach its row). Position ids must come from ``image_token_mask`` (the packed
    path passes them) or from ``mm_token_type_ids`` marking the images' tokens only."""
    if text_tokens is None or not bool(text_tokens.any()):
        yield input_ids
        return
    embedding = model.get_input_embeddings()
    token_id = model.config.image_token_id
    marked = text_tokens.to(input_ids.device)

    def embed_as_text(module, args, kwargs, output):
        ids = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
        if ids is None or ids.shape != marked.shape:  # a decode step's tokens: nothing of the prompt's to change
            return output
        own = module.weight[token_id].to(output.dtype)
        return torch.where(marked.to(output.device).unsqueeze(-1), own, output)

    handle = embedding.register_forward_hook(embed_as_text, with_kwargs=True)
    try:
        yield torch.where(marked, torch.full_like(input_ids, _substitute_id(model.config)), input_ids)
    finally:
        handle.remove()


@contextlib.contextmanager
def image_embeddings_in_place(model, image_mask: Tensor, embeddings: Tensor,
                              deepstack: list[Tensor] | None = None) -> Iterator[None]:
    """While the context is open, the VLM ``model``'s forward over a row of ``image_mask.shape[1]`` tokens, given no
    pixels, puts ``embeddings`` (image tokens, hidden), in order, at the tokens ``image_mask`` (1, tokens) marks,
    as transformers puts its vision tower's output there; Qwen3-VL's ``deepstack`` features (per deepstack layer,
    (image tokens, hidden)) reach its language model as transformers hands them over. A mask on the CPU is read
    there (no wait for the device)."""
    positions = torch.nonzero(image_mask[0].cpu()).squeeze(-1).to(embeddings.device, non_blocking=True)
    image_mask = image_mask.to(embeddings.device, non_blocking=True)

    def place_images(module, args, output):
        if output.shape[:2] != image_mask.shape:  # another row's (a decode step's) embeddings
            return output
        return output.index_put((torch.zeros_like(positions), positions), embeddings.to(output.device, output.dtype))

    def add_deepstack(module, args, kwargs):
        hidden = kwargs.get("inputs_embeds")
        if hidden is None or hidden.shape[:2] != image_mask.shape or kwargs.get("deepstack_visual_embeds") is not None:
            return None
        return args, kwargs | {"visual_pos_masks": image_mask, "deepstack_visual_embeds": list(deepstack)}

    handles = [model.get_input_embeddings().register_forward_hook(place_images)]
    if deepstack:
        language_model = model.model.language_model
        handles.append(language_model.register_forward_pre_hook(add_deepstack, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def keep_vision_tower_attention(model, implementation: str = "sdpa") -> None:
    """Give the vision tower of ``model`` (a VLM) ``implementation`` back after the whole model was switched to the
    packed varlen attention: the tower separates its images itself (its own ``cu_seqlens``), and must not read the
    language model's packed segments, which reach it through the forward's keyword arguments."""
    tower = vision_tower(model)
    if tower is not None:
        tower.set_attn_implementation(implementation)


def vision_tower(model):
    """The vision encoder module of a VLM (``model.model.visual`` in Qwen2.5-VL and Qwen3-VL; ``model.model.
    vision_tower`` in Gemma 3's multimodal wrapper, which trains on text alone), or None."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "visual", None)
    return tower if tower is not None else getattr(inner, "vision_tower", None)


def freeze_vision_tower(model, frozen: bool = True) -> int:
    """Turn the vision tower's gradients off (``frozen``) or on; returns how many parameters it has."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    for parameter in tower.parameters():
        parameter.requires_grad_(not frozen)
    return sum(parameter.numel() for parameter in tower.parameters())


def processor_for(path: str | Path, trust_remote_code: bool = False, chat_template: str | None = None,
                  min_pixels: int | None = None, max_pixels: int | None = None):
    """The processor of the model at ``path`` when it is a vision-language model reinforge knows, else None.

    ``chat_template`` (data.chat_template) replaces the processor's and its tokenizer's template; ``min_pixels`` and
    ``max_pixels`` (data.min_pixels, data.max_pixels) its image processor's bounds (``set_pixel_bounds``), which a
    model reinforge gives no processor refuses (``refuse_pixel_bounds``). Every processor of a run, the dataset's,
    the rollout's (tool images) and the checkpoint's, comes from here."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if not is_vision_language(config):
        refuse_pixel_bounds(config, path, min_pixels, max_pixels)
        return None
    processor = load_processor(path, trust_remote_code)
    if chat_template:
        processor.chat_template = chat_template
        processor.tokenizer.chat_template = chat_template
    set_pixel_bounds(processor.image_processor, min_pixels, max_pixels, path)
    return processor


def run_processor(model, data):
    """``processor_for`` a run's model (its ``model`` config section) with its ``data`` section's chat template and
    pixel bounds (RL's and SFT's data sections both have them); None for a model that takes no images."""
    return processor_for(model.path, model.trust_remote_code, data.chat_template, data.min_pixels, data.max_pixels)


def folder_image_processor(path: str | Path, trust_remote_code: bool = False, patch_size: int = 14,
                           merge_size: int = 2):
    """The image processor of the vision-language model folder at ``path``, as its processor loads it (its
    preprocessor_config.json), without the tokenizer; a folder of config.json alone (``reinforge plan``'s model
    shapes) gets the Qwen2-VL image processor of the tower's ``patch_size`` and ``merge_size`` with transformers'
    default pixel bounds."""
    if (Path(path) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as family
    except ImportError:
        from transformers import Qwen2VLImageProcessor as family
    return family(patch_size=patch_size, merge_size=merge_size)


def set_pixel_bounds(image_processor, min_pixels: int | None, max_pixels: int | None,
                     path: str | Path = "the model") -> None:
    """Make the image processor resize every image to between ``min_pixels`` and ``max_pixels`` pixels (None: the
    bound the model folder's preprocessor_config.json gives): its ``size`` (shortest_edge, longest_edge), which
    Qwen2-VL's ``smart_resize`` reads for each image, and which the checkpoints' processor saves. Raises one line
    when the bounds, the model's own included, leave no image size the processor keeps them at: one above the
    other, a max_pixels below one merged patch (the processor would make every image one merged patch, above it),
    or no whole number of merged patches between the two (the processor would silently leave one bound)."""
    if min_pixels is None and max_pixels is None:
        return
    bounds = dict(image_processor.size)
    own = {"min_pixels": bounds.get("shortest_edge"), "max_pixels": bounds.get("longest_edge")}
    if None in own.values():
        raise ValueError(f"data.min_pixels and data.max_pixels set pixel bounds, but the image processor of {path} "
                         f"({type(image_processor).__name__}) resizes by size={bounds}; unset both keys")
    lowest = own["min_pixels"] if min_pixels is None else min_pixels
    highest = own["max_pixels"] if max_pixels is None else max_pixels
    if lowest > highest:  # one key set (validate_pixel_bounds checks both)
        if min_pixels is None:
            raise ValueError(f"data.max_pixels={max_pixels} is below the min_pixels={own['min_pixels']} of {path} "
                             f"(its preprocessor_config.json), so no image size fits both; set data.min_pixels to "
                             f"at most {max_pixels} too, or raise data.max_pixels")
        raise ValueError(f"data.min_pixels={min_pixels} is above the max_pixels={own['max_pixels']} of {path} "
                         f"(its preprocessor_config.json), so no image size fits both; set data.max_pixels to at "
                         f"least {min_pixels} too, or lower data.min_pixels")
    side = image_processor.patch_size * image_processor.merge_size
    merged = side * side  # an image's sides are whole merged patches: its pixels are a whole number of these
    if max_pixels is not None and max_pixels < merged:
        raise ValueError(f"data.max_pixels={max_pixels} is below one merged patch of {path} ({side} x {side} = "
                         f"{merged} pixels: patch_size={image_processor.patch_size} x merge_size="
                         f"{image_processor.merge_size}), the smallest image its processor makes, which would give "
                         f"every image one token; set data.max_pixels to at least {merged}")
    fewest, most = -(-lowest // merged), highest // merged  # whole merged patches within the bounds
    if fewest > most:
        key, value = ("data.min_pixels", min_pixels) if min_pixels is not None else ("data.max_pixels", max_pixels)
        lowest_from = "" if min_pixels is not None else f" (of {path})"
        highest_from = "" if max_pixels is not None else f" (of {path})"
        raise ValueError(f"{key}={value} leaves no whole number of merged patches ({side} x {side} = {merged} pixels) "
                         f"between min_pixels={lowest}{lowest_from} and max_pixels={highest}{highest_from}, and the "
                         f"processor resizes every image to whole merged patches, so it would break one bound; set "
                         f"data.min_pixels to at most {most * merged} or data.max_pixels to at least {fewest * merged}")
    bounds["shortest_edge"], bounds["longest_edge"] = lowest, highest
    size = image_processor.size
    image_processor.size = bounds if isinstance(size, dict) else type(size)(**bounds)


def refuse_pixel_bounds(config, path: str | Path, min_pixels: int | None, max_pixels: int | None) -> None:
    """Raise one line when data.min_pixels or data.max_pixels is set for the model of ``config`` (an HF config)
    at ``path``, to which reinforge gives no processor: its images are never resized, so the bounds would do
    nothing (Gemma 3's and Llava's image processors resize to a fixed size anyway, with no pixel bound)."""
    given = [f"data.{key}={value}" for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels))
             if value is not None]
    if not given:
        return
    name = _architecture_name(config)
    model = f"a {name}, which reinforge trains on text-only prompts" if _has_images(config) else \
        f"a text-only model ({name})"
    keys = " and ".join(item.split("=")[0] for item in given)
    raise ValueError(f"{' and '.join(given)} {'bounds' if len(given) == 1 else 'bound'} the images of Qwen2-VL, "
                     f"Qwen2.5-VL and Qwen3-VL, and {path} is {model}: no image of the run is resized by "
                     f"{'it' if len(given) == 1 else 'them'}; unset {keys}")


def _architecture_name(config) -> str:
    return (getattr(config, "architectures", None) or [getattr(config, "model_type", None)])[0]


def _has_images(config) -> bool:
    """Whether ``config`` is an image-text model's (transformers maps it to one, or it has a vision tower)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            or getattr(config, "vision_config", None) is not None)


IMAGE_ATTENTION_BOTH_WAYS = {
    "gemma3": "its image tokens attend to each other both ways in transformers' forward (its token_type_ids mask)",
    "paligemma": "its prompt's tokens, images included, attend to each other both ways in transformers' forward (its "
                 "prefix mask)",
}
"""Vision-language families whose language model reads images through attention that is not causal, which
reinforge's causal packed passes would silently get wrong."""


def why_no_images(path: str | Path, trust_remote_code: bool = False) -> str:
    """Why the model at ``path``, which ``processor_for`` gives no processor, takes no images, with the fix: the end of
    the one line that refuses a row with images, before any model loads (``... has 1 image(s) ..., but {this}``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    model_type = getattr(config, "model_type", None)
    name = _architecture_name(config)
    supported = "Qwen2-VL, Qwen2.5-VL and Qwen3-VL train on images"
    if model_type in IMAGE_ATTENTION_BOTH_WAYS:
        return (f"{path} is a {name}: {IMAGE_ATTENTION_BOTH_WAYS[model_type]}, which reinforge's causal packed "
                f"passes do not reproduce; it trains on text-only prompts (drop that column), and {supported}")
    if _has_images(config):
        return (f"{path} is a {name}, whose images reinforge does not place in its language model; it trains on "
                f"text-only prompts (drop that column), and {supported}")
    return f"{path} is a text-only model ({name}); drop that column, or train a vision-language model: {supported}"


def language_model_spec(config):
    """The architecture table of a VLM's language model (its text config read as its text family's), or None."""
    import copy

    from reinforge.models.architectures import architecture_spec

    if not is_vision_language(config):
        return None
    language = copy.copy(config.get_text_config())
    language.model_type = LANGUAGE_FAMILIES[config.model_type]
    return architecture_spec(language)


def segment_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scaling: float) -> Tensor:
    """Bidirectional attention within each segment of a packed row, in one SDPA call over the segments padded
    to the longest one (its keys masked); query, key, value and the result: (tokens, heads, head dim)."""
    import torch.nn.functional as F

    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    longest = max(lengths)
    starts = torch.tensor(cu_seqlens[:-1].tolist(), device=query.device)
    offsets = torch.arange(longest, device=query.device)
    valid = offsets[None, :] < torch.tensor(lengths, device=query.device)[:, None]  # (segments, longest)
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)

    def padded(tensor: Tensor) -> Tensor:  # (segments, heads, longest, head dim)
        return tensor[index].transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(query), padded(key), padded(value), attn_mask=valid[:, None, None, :],
                                         scale=scaling)
    return out.transpose(1, 2)[valid]


def _vision_attention_forward(self, hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings=None,
                              max_seqlen: int | None = None, **kwargs) -> Tensor:
    """transformers' vision attention of Qwen2.5-VL and Qwen3-VL, its images and windows in one SDPA call
    (transformers makes one call per image or window where no flash kernel is installed)."""
    tokens = hidden_states.shape[0]
    query, key, value = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    query, key = self._rotate_vision(query, key, cos, sin)
    return self.proj(segment_attention(query, key, value, cu_seqlens, self.scaling).reshape(tokens, -1))


def use_batched_vision_attention(model) -> int:
    """Swap the forward of each attention module of the model's vision tower for ``_vision_attention_forward``;
    returns how many (0 without a tower of the known shape)."""
    tower = vision_tower(model)
    return 0 if tower is None else batch_tower_attention(tower)


def batch_tower_attention(tower) -> int:
    """``use_batched_vision_attention`` on a vision tower module itself (the rollout engine's copy of one)."""
    import sys
    import types

    count = 0
    for module in tower.modules():
        modeling = sys.modules.get(type(module).__module__)
        rotate = getattr(modeling, "apply_rotary_pos_emb_vision", None)
        if (type(module).__name__.endswith("VisionAttention") and rotate is not None
                and all(hasattr(module, name) for name in ("qkv", "proj", "num_heads", "scaling"))):
            module._rotate_vision = rotate
            module.forward = types.MethodType(_vision_attention_forward, module)
            count += 1
    return count
