"""A frozen vision tower's image embeddings, computed once per step and reused by every packed pass.

A vision-language model's packed forward (``engine.forward``) would run the vision tower over the images of each
micro-batch, in every pass over the batch: the old log-probs, the reference's, and each update epoch. When no
parameter of the tower requires a gradient (``actor.freeze_vision_tower``, and always for the reference), its
output for an image is a constant within a step. ``ImageEmbeddingCache.prepare`` then encodes each distinct
image of the batch once, many images per tower call (at most ``ENCODE_PATCHES`` patches a call, or one image
when it is larger), without gradients, and keeps the merged embeddings (and Qwen3-VL's deepstack features) on the
device; the packed forwards take them in place of the pixels (``models.vision.image_embeddings_in_place``).

Images are named by the content of their patches and their grid (a SHA-256 digest), so the n samples of a prompt,
and the same image in another prompt, are one image; a row's ``pixel_values`` tensor seen again (the same
object) is not hashed again. The cache holds the images of the last batch prepared: ``prepare`` drops the
others, and the worker clears it after the update, so nothing outlives a step.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from reinforge.models.vision import is_vision_language, vision_tower
from reinforge.protocol import MULTI_MODAL_KEY, Batch

ENCODE_PATCHES = 4096
"""Patches per call of the tower when it encodes a batch's images (4 images of 448 x 448 pixels at 14-pixel
patches): one block's working set for them (``engine.memory_plan.VisionShape.working_bytes_per_patch``; 0.17 GB
for Qwen2.5-VL-3B in bf16) is what the encoding adds to the device's memory, beside the embeddings it keeps (the memory planner counts
both)."""


HASH_THREADS = 8
"""Threads that name a batch's new images (a 448 x 448 image's patches are 4.8 MB, ~3 ms of SHA-256 on one core)."""


@dataclass
class CachedImages:
    """The cached embeddings of a packed row's images and where they go in it."""

    image_mask: Tensor
    """(1, tokens) bool, on the CPU: the packed tokens that are image tokens of their sequence's images."""
    embeddings: Tensor
    """(image tokens, hidden): the merged embeddings of those tokens, in packed order."""
    deepstack: list[Tensor] = field(default_factory=list)
    """Qwen3-VL: per deepstack layer, (image tokens, hidden) added to those tokens after that decoder layer."""


@dataclass
class _Encoded:
    embeddings: Tensor
    deepstack: list[Tensor]


def image_digest(pixels: Tensor, grid: Tensor) -> bytes:
    """The name of one image: a SHA-256 digest of its patches (``pixels``, (patches, patch dim)) and its grid (3,)."""
    digest = hashlib.sha256(str((pixels.dtype, tuple(pixels.shape), [int(size) for size in grid])).encode())
    digest.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.digest()


def _digests(images: list[tuple[Tensor, Tensor]]) -> list[bytes]:
    """``image_digest`` of each (pixels, grid), on up to ``HASH_THREADS`` threads (hashlib releases the GIL)."""
    if len(images) < 2:
        return [image_digest(*image) for image in images]
    with ThreadPoolExecutor(min(HASH_THREADS, len(images), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda image: image_digest(*image), images))


@contextlib.contextmanager
def _root_gathered(model: nn.Module) -> Iterator[None]:
    """The parameters of ``model``'s root FSDP unit (embeddings, head, vision tower) gathered inside the block."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


class ImageEmbeddingCache:
    """Image embeddings of one model's frozen vision tower over a batch (see the module docstring).

        cache = ImageEmbeddingCache(model, device)
        cache.prepare(batch)                      # once per pass; encodes only the images not cached yet
        response_log_probs(model, micro, image_embeddings=cache)
        cache.clear()                             # after the step's last pass
    """

    def __init__(self, model: nn.Module, device: torch.device, max_patches: int = ENCODE_PATCHES):
        self.model, self.device, self.max_patches = model, device, max_patches
        self._rows: dict[int, tuple[Tensor, list[bytes]]] = {}  # id(a row's pixel_values) -> (it, its images' names)
        self._images: dict[bytes, _Encoded] = {}
        self.num_tower_calls = 0
        """Tower calls made (each over up to ``max_patches`` patches of distinct images)."""
        self.num_images_encoded = 0

    @property
    def applies(self) -> bool:
        """Whether the model is a vision-language model whose tower no gradient reaches."""
        tower = vision_tower(self.model) if is_vision_language(getattr(self.model, "config", None)) else None
        return tower is not None and not any(parameter.requires_grad for parameter in tower.parameters())

    @property
    def ready(self) -> bool:
        """Prepared for a batch: the packed forwards take the cached embeddings."""
        return bool(self._rows)

    def clear(self) -> None:
        self._rows, self._images = {}, {}

    def prepare(self, batch: Batch) -> bool:
        """Encode the images of ``batch`` that are not cached yet and drop those of other batches; False (and
        nothing cached) when the tower is trained or the batch holds no image.

        Collective under FSDP: every rank gathers the root unit's parameters (the tower's among them), whether or
        not its own part of the batch has an image to encode."""
        if not self.applies:
            self.clear()
            return False
        rows: dict[int, tuple[Tensor, list[bytes]]] = {}
        images: dict[int, list[tuple[Tensor, Tensor]]] = {}  # id(a row's pixel_values) -> its images' (patches, grid)
        inputs = batch.non_tensors.get(MULTI_MODAL_KEY)
        for row_inputs in inputs if inputs is not None else []:
            pixels = row_inputs.get("pixel_values") if row_inputs else None
            if pixels is None or id(pixels) in images:  # the n samples of a prompt share its tensor
                continue
            grid = row_inputs["image_grid_thw"].cpu()
            images[id(pixels)] = list(zip(pixels.split(grid.prod(-1).tolist()), grid, strict=True))
            known = self._rows.get(id(pixels))  # the same tensor in the step's earlier pass: named already
            rows[id(pixels)] = (pixels, known[1] if known is not None and known[0] is pixels else [])
        new = [(key, image) for key, (_, names) in rows.items() if not names for image in images[key]]
        for (key, _), name in zip(new, _digests([image for _, image in new]), strict=True):
            rows[key][1].append(name)
        wanted: dict[bytes, tuple[Tensor, Tensor]] = {}  # name -> (patches, grid)
        for key, (_, names) in rows.items():
            for name, image in zip(names, images[key], strict=True):
                wanted.setdefault(name, image)
        self._rows = rows
        self._images = {name: encoded for name, encoded in self._images.items() if name in wanted}
        self._encode([(name, *wanted[name]) for name in wanted if name not in self._images])
        return bool(rows)

    @torch.no_grad()
    def _encode(self, images: list[tuple[bytes, Tensor, Tensor]]) -> None:
        tower = vision_tower(self.model)
        merge = int(self.model.config.vision_config.spatial_merge_size)
        chunks: list[list[tuple[bytes, Tensor, Tensor]]] = []
        patches = 0
        for image in images:
            if not chunks or patches + image[1].shape[0] > self.max_patches:
                chunks.append([])
                patches = 0
            chunks[-1].append(image)
            patches += image[1].shape[0]
        with _root_gathered(self.model):  # on every rank, even with nothing to encode: a collective
            dtype = next(tower.parameters()).dtype
            for chunk in chunks:
                pixels = torch.cat([piece for _, piece, _ in chunk]).to(self.device, dtype, non_blocking=True)
                grids = torch.stack([grid for _, _, grid in chunk]).to(self.device, non_blocking=True)
                output = tower(pixels, grid_thw=grids, return_dict=True)
                sizes = (grids.prod(-1) // (merge * merge)).tolist()
                embeddings = output.pooler_output.split(sizes)
                deepstack = [feature.split(sizes) for feature in (getattr(output, "deepstack_features", None) or [])]
                for index, (name, _, _) in enumerate(chunk):
                    self._images[name] = _Encoded(embeddings[index], [feature[index] for feature in deepstack])
                self.num_tower_calls += 1
                self.num_images_encoded += len(chunk)

    def packed(self, sources: list[tuple[Tensor, int]], image_mask: Tensor) -> CachedImages:
        """The cached embeddings of a packed row's images: ``sources`` names each image in packed order (its row's
        ``pixel_values`` and its index among the row's images), ``image_mask`` (1, tokens) marks their tokens."""
        encoded = []
        for pixels, index in sources:
            known = self._rows.get(id(pixels))
            if known is None or known[0] is not pixels:
                raise RuntimeError("a micro-batch's image is not in the batch the image-embedding cache was prepared "
                                   "for; call ImageEmbeddingCache.prepare(batch) with the batch it is cut from")
            encoded.append(self._images[known[1][index]])
        deepstack = [torch.cat(features) for features in zip(*(image.deepstack for image in encoded), strict=True)]
        return CachedImages(image_mask, torch.cat([image.embeddings for image in encoded]), deepstack)


@contextlib.contextmanager
def images_of_step(cache: ImageEmbeddingCache | None, batch: Batch) -> Iterator[None]:
    """``cache`` prepared for ``batch`` inside the block (images encoded by an earlier pass of the step are kept)
    and cleared on leaving it; nothing where ``cache`` is None (a text model)."""
    if cache is None:
        yield
        return
    try:
        cache.prepare(batch)
        yield
    finally:
        cache.clear()
