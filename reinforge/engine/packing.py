"""Padding-free rows: the real tokens of a micro-batch's sequences packed into one row.

A micro-batch arrives in the rollout layout, ``[left-padded prompt | right-padded response]``
(B, P + R). ``pack_rows`` keeps only the attended tokens, one sequence after another, with
position ids restarting at 0 for each, and records which packed positions predict a response
token: the hidden state before response token t of row b. Results computed at those
positions (log-probs, entropy, values) go back to (B, R) with ``unpack_responses``, zeros at
padding, so the losses of ``reinforge.algorithms`` see the layout they always see.

Shared prompts. The n samples of a GRPO group repeat the same prompt; run separately, its
tokens go through the model n times with the same result each time (a token's hidden state
depends only on the tokens before it). With ``share_prompts`` a group's rows become one
prompt segment followed by one segment per response: the prompt is computed once, and each
response's queries attend to the prompt's keys and values and then causally to their own
(the key side of a response segment is ``[prompt | response]``, gathered by ``kv_index``; the
query side is the response alone, aligned to the end of its keys). The results are those of
the unshared layout up to float rounding; 128-token prompts with 8 samples of 512 tokens
leave 17.5% fewer tokens to run through the model.

The plan (which token goes where) is built on the CPU from the attention mask, so packing a
micro-batch that is already on the device does not wait for it.

Images. A vision-language micro-batch carries each row's pixels (``data.multimodal``);
``pack_vision_inputs`` gives the packed row's images, in the order their image tokens appear in
it (a prompt shared by a group's rows once), for the vision tower to run on once, and every
packed token's M-RoPE position ids (``models.vision``), computed per sequence over its
``[prompt | response]`` so that they restart with each. A frozen tower's embeddings of the batch's
images, encoded once per step (``engine.image_embeddings``), take the place of those pixels. Rows with
identical prompt tokens but different images are different prompts. An image-token id outside a
sequence's images (a policy can sample it) is text there, as the rollout engines embed it: text
positions, its own embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from reinforge.engine.image_embeddings import CachedImages, ImageEmbeddingCache
from reinforge.models.vision import image_token_mask, sequence_rope_positions
from reinforge.protocol import MULTI_MODAL_KEY, Batch

PLAN_KEY = "packing_plan"
"""``Batch.meta`` key under which ``attach_plan`` stores a micro-batch's packing plan."""


@dataclass
class PackingPlan:
    """Where each token of a micro-batch goes in its packed row; CPU tensors."""

    source_index: Tensor
    """(tokens,): flat index into the (B, P + R) input ids of each packed token."""
    position_ids: Tensor
    """(tokens,): each token's position inside its sequence."""
    query_lengths: list[int]
    """Length of each attention segment on the query side (packed order)."""
    key_lengths: list[int]
    """Length of each segment on the key side: the query side itself, or [prompt | response] when shared."""
    kv_index: Tensor | None
    """(key tokens,): packed positions that form the key side, or None when it is the packed row itself."""
    predictor_index: Tensor
    """(response tokens,): packed position whose hidden state predicts each response token."""
    response_index: Tensor
    """(response tokens,): flat index into (B, R) of each real response token, row-major."""
    response_shape: tuple[int, int]
    last_index: Tensor
    """(B,): packed position of each row's last attended token (a classification head reads it)."""
    token_weights: Tensor
    """(tokens,) float32: how many sequences of the micro-batch each packed token stands for (a shared prompt's tokens
    its group's rows, every other token 1), so a sum over the packed row weighted by them is the sum over the
    unshared sequences (the routers' load-balancing loss)."""

    @property
    def num_tokens(self) -> int:
        return int(self.source_index.numel())


@dataclass
class PackedRows:
    input_ids: Tensor
    """(1, tokens): every computed token, in packed order."""
    position_ids: Tensor
    """(1, tokens): 0, 1, ... within each sequence."""
    cu_seqlens: Tensor
    """(segments + 1,) int32: where each query segment starts in the row, then the total."""
    cu_seqlens_k: Tensor
    """(segments + 1,) int32: the same on the key side (equal to ``cu_seqlens`` without sharing)."""
    kv_index: Tensor | None
    lengths: list[int]
    key_lengths: list[int]
    max_length: int
    max_key_length: int
    predictor_index: Tensor
    """(response tokens,): packed position whose hidden state predicts each response token."""
    response_targets: Tensor
    """(response tokens,): the response token ids themselves."""
    response_index: Tensor
    response_shape: tuple[int, int]
    last_index: Tensor
    """(B,): packed position of each row's last attended token."""

    def attention_kwargs(self, with_lengths: bool = True) -> dict:
        """Keyword arguments of an HF forward that route attention through the varlen path.

        The segment lengths as Python lists serve the masked-SDPA path only; a compiled layer
        would guard on (and recompile for) every new list, so the flash path leaves them out.
        """
        kwargs = {"packed_cu_seqlens": self.cu_seqlens, "packed_max_length": self.max_length,
                  "packed_cu_seqlens_k": self.cu_seqlens_k, "packed_max_length_k": self.max_key_length,
                  "packed_kv_index": self.kv_index}
        if with_lengths:
            kwargs |= {"packed_lengths": self.lengths, "packed_key_lengths": self.key_lengths}
        return kwargs

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def prompt_groups(batch: Batch) -> list[list[int]]:
    """Rows with identical prompts (ignoring padding), each group in row order, groups by first row."""
    prompts = batch["prompts"].cpu().numpy()
    valid = batch["attention_mask"][:, :prompts.shape[1]].cpu().numpy().astype(bool)
    images = batch.non_tensors.get(MULTI_MODAL_KEY)
    groups: dict[bytes, list[int]] = {}
    for row in range(prompts.shape[0]):
        key = prompts[row][valid[row]].tobytes()
        if images is not None and images[row]:  # the same text with other images is another prompt: the n samples of
            key += b"|%d" % id(images[row])  # a prompt share its inputs' dict (repeat, index and pickling keep it)
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def plan_packing(batch: Batch, share_prompts: bool = False) -> PackingPlan:
    """The packed layout of ``batch`` (any device; its attention mask is read on the CPU)."""
    attention = batch["attention_mask"].cpu().numpy().astype(bool)
    num_rows, width = attention.shape
    response_width = batch["responses"].shape[1]
    prompt_width = width - response_width
    flat = np.arange(num_rows * width).reshape(num_rows, width)
    prompt_at = [flat[row, :prompt_width][attention[row, :prompt_width]] for row in range(num_rows)]
    response_at = [flat[row, prompt_width:][attention[row, prompt_width:]] for row in range(num_rows)]
    for row in range(num_rows):
        if len(prompt_at[row]) == 0:
            raise ValueError(f"row {row} of the micro-batch has no prompt token; every sample needs a prompt "
                             "(its first response token is predicted from the last prompt token)")
    groups = prompt_groups(batch) if share_prompts else [[row] for row in range(num_rows)]
    # the shared layout also where no prompt repeats here (a micro-batch left with one row of each group): the
    # compiled decoder layers then see one set of attention arguments, and no step of a run recompiles them
    # (a micro-batch of single rows made the 0.5B bench recompile once, its update 2.7 s slower that step)
    shared = share_prompts
    sources, positions, kv_parts, weights = [], [], [], []
    query_lengths, key_lengths = [], []
    predictors: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_rows
    last = np.zeros(num_rows, dtype=np.int64)
    cursor = 0
    for rows in groups:
        prompt_tokens = len(prompt_at[rows[0]])
        if not shared:  # one segment per sequence: prompt then response
            row = rows[0]
            response_tokens = len(response_at[row])
            sources += [prompt_at[row], response_at[row]]
            positions.append(np.arange(prompt_tokens + response_tokens))
            weights.append(np.ones(prompt_tokens + response_tokens))
            query_lengths.append(prompt_tokens + response_tokens)
            predictors[row] = np.arange(cursor + prompt_tokens - 1, cursor + prompt_tokens + response_tokens - 1)
            cursor += prompt_tokens + response_tokens
            last[row] = cursor - 1
            continue
        prompt_span = np.arange(cursor, cursor + prompt_tokens)
        sources.append(prompt_at[rows[0]])
        positions.append(np.arange(prompt_tokens))
        weights.append(np.full(prompt_tokens, float(len(rows))))
        query_lengths.append(prompt_tokens)
        key_lengths.append(prompt_tokens)
        kv_parts.append(prompt_span)
        cursor += prompt_tokens
        for row in rows:
            response_tokens = len(response_at[row])
            last[row] = prompt_span[-1]
            if response_tokens == 0:
                continue
            response_span = np.arange(cursor, cursor + response_tokens)
            sources.append(response_at[row])
            positions.append(np.arange(prompt_tokens, prompt_tokens + response_tokens))
            weights.append(np.ones(response_tokens))
            query_lengths.append(response_tokens)
            key_lengths.append(prompt_tokens + response_tokens)
            kv_parts += [prompt_span, response_span]
            predictors[row] = np.concatenate([prompt_span[-1:], response_span[:-1]])
            cursor += response_tokens
            last[row] = cursor - 1
    response_flat = np.arange(num_rows * response_width).reshape(num_rows, response_width)
    return PackingPlan(
        source_index=torch.from_numpy(np.concatenate(sources).astype(np.int64)),
        position_ids=torch.from_numpy(np.concatenate(positions).astype(np.int64)),
        query_lengths=query_lengths, key_lengths=key_lengths if shared else list(query_lengths),
        kv_index=torch.from_numpy(np.concatenate(kv_parts).astype(np.int64)) if shared else None,
        predictor_index=torch.from_numpy(np.concatenate(predictors).astype(np.int64)),
        response_index=torch.from_numpy(response_flat[attention[:, prompt_width:]].astype(np.int64)),
        response_shape=(num_rows, response_width), last_index=torch.from_numpy(last),
        token_weights=torch.from_numpy(np.concatenate(weights).astype(np.float32)))


def attach_plan(batch: Batch, share_prompts: bool = False) -> Batch:
    """Store the packing plan in ``batch.meta`` (done on the CPU, before the batch moves to the device)."""
    batch.meta[PLAN_KEY] = plan_packing(batch, share_prompts)
    return batch


def _cu_seqlens(lengths: list[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32).to(device, non_blocking=True)


def plan_of(micro: Batch) -> PackingPlan:
    """The micro-batch's attached plan, or its unshared plan when none is attached (or one of another batch)."""
    plan = micro.meta.get(PLAN_KEY)
    if plan is None or plan.response_shape != tuple(micro["responses"].shape):
        plan = plan_packing(micro)  # none attached, or attached to another batch this one was cut from
    return plan


def pack_rows(micro: Batch) -> PackedRows:
    """Pack the attended tokens of ``micro`` (on any device) into one row, by its attached plan if any."""
    plan = plan_of(micro)
    device = micro["input_ids"].device

    def moved(tensor: Tensor) -> Tensor:
        return tensor.to(device, non_blocking=True)

    cu_seqlens = _cu_seqlens(plan.query_lengths, device)
    cu_seqlens_k = cu_seqlens if plan.kv_index is None else _cu_seqlens(plan.key_lengths, device)
    return PackedRows(
        input_ids=micro["input_ids"].reshape(-1)[moved(plan.source_index)].unsqueeze(0),
        position_ids=moved(plan.position_ids).unsqueeze(0), cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k,
        kv_index=None if plan.kv_index is None else moved(plan.kv_index),
        lengths=plan.query_lengths, key_lengths=plan.key_lengths, max_length=max(plan.query_lengths),
        max_key_length=max(plan.key_lengths), predictor_index=moved(plan.predictor_index),
        response_targets=micro["responses"].reshape(-1)[moved(plan.response_index)],
        response_index=moved(plan.response_index), response_shape=plan.response_shape,
        last_index=moved(plan.last_index))


def unpack_responses(values: Tensor, packed: PackedRows) -> Tensor:
    """(response tokens,) -> (B, R) with zeros at padding."""
    rows, width = packed.response_shape
    out = values.new_zeros(rows * width)
    return out.index_put((packed.response_index,), values).view(rows, width)


@dataclass
class PackedVisionInputs:
    position_ids: Tensor
    """(3, 1, tokens): each packed token's M-RoPE position ids (time, height, width)."""
    pixel_values: Tensor | None
    """(patches, patch dim): the patches of the images in the packed row, in the order of their tokens; None without."""
    image_grid_thw: Tensor | None
    """(images, 3): those images' grids."""
    text_tokens: Tensor | None = None
    """(1, tokens) bool: the packed tokens whose id is the image token's but that belong to none of their sequence's
    images (``models.vision.image_token_mask``): text, at text positions; None where there are none."""
    image_mask: Tensor | None = None
    """(1, tokens) bool: the packed tokens that are their sequence's images' tokens; None without images."""
    image_sources: list[tuple[Tensor, int]] | None = None
    """Each image of ``pixel_values`` as its row's inputs hold it: (the row's ``pixel_values`` tensor itself, the
    image's index among the row's images), in packed order (``engine.image_embeddings`` names images by them)."""


def pack_vision_inputs(micro: Batch, plan: PackingPlan, config) -> PackedVisionInputs:
    """The packed row's M-RoPE positions and images (see the module docstring); ``config`` is the VLM's."""
    input_ids = micro["input_ids"].cpu()
    attention = micro["attention_mask"].cpu().bool()
    num_rows, width = attention.shape
    inputs = micro.non_tensors.get(MULTI_MODAL_KEY)
    merge = int(config.vision_config.spatial_merge_size)
    positions = torch.zeros(3, num_rows * width, dtype=torch.long)
    image_of_token = torch.full((num_rows * width,), -1, dtype=torch.long)
    patches: list[Tensor] = []
    grids: list[Tensor] = []
    sources: list[tuple[Tensor, int]] = []
    for row in range(num_rows):
        flat = torch.nonzero(attention[row]).squeeze(-1) + row * width
        ids = input_ids[row][attention[row]]
        row_inputs = inputs[row] if inputs is not None and inputs[row] else {}
        grid = row_inputs.get("image_grid_thw")
        grid = grid.cpu() if grid is not None else None  # where the plan is: pixels move to the device only packed
        try:
            positions[:, flat], _ = sequence_rope_positions(config, ids, grid)
        except ValueError as error:
            raise ValueError(f"row {row} of the micro-batch: {error}") from None
        if grid is None:
            continue
        is_image = image_token_mask(config, ids, grid)  # an image-token id outside the row's images is text
        tokens_per_image = grid.prod(-1) // (merge * merge)
        image_of_token[flat[is_image]] = len(grids) + torch.repeat_interleave(
            torch.arange(len(grid)), tokens_per_image)
        patches += list(row_inputs["pixel_values"].split(grid.prod(-1).tolist()))
        grids += list(grid)
        sources += [(row_inputs["pixel_values"], index) for index in range(len(grid))]
    packed_positions = positions[:, plan.source_index].unsqueeze(1)
    packed_images = image_of_token[plan.source_index]
    text_tokens = ((input_ids.reshape(-1)[plan.source_index] == config.image_token_id) & (packed_images < 0))[None]
    text_tokens = text_tokens if bool(text_tokens.any()) else None
    used = packed_images[packed_images >= 0]
    if used.numel() == 0:
        return PackedVisionInputs(packed_positions, None, None, text_tokens)
    order, counts = torch.unique_consecutive(used, return_counts=True)
    expected = torch.stack([grids[index].prod() // (merge * merge) for index in order.tolist()])
    if order.unique().numel() != order.numel() or not torch.equal(counts, expected):
        raise ValueError("an image's tokens are split across the packed row; pack whole sequences")
    return PackedVisionInputs(packed_positions, torch.cat([patches[index] for index in order.tolist()]),
                              torch.stack([grids[index] for index in order.tolist()]), text_tokens,
                              image_mask=(packed_images >= 0)[None],
                              image_sources=[sources[index] for index in order.tolist()])


def vision_model_kwargs(micro: Batch, config, device: torch.device, image_embeddings: ImageEmbeddingCache | None = None
                        ) -> tuple[dict, Tensor | None, CachedImages | None]:
    """The keyword arguments a VLM's forward takes for the packed row of ``micro``: M-RoPE ``position_ids``
    (3, 1, tokens) and, when the row holds images, their ``pixel_values`` and ``image_grid_thw``; the packed
    tokens whose image-token id is text (``PackedVisionInputs.text_tokens``, for ``models.vision.image_tokens_as_text``);
    and, when ``image_embeddings`` is prepared for the batch, the row's cached image embeddings instead of its
    pixels (for ``models.vision.image_embeddings_in_place``), else None."""
    vision = pack_vision_inputs(micro, plan_of(micro), config)
    kwargs = {"position_ids": vision.position_ids.to(device, non_blocking=True)}
    if vision.pixel_values is None:
        return kwargs, vision.text_tokens, None
    if image_embeddings is not None and image_embeddings.ready:
        return kwargs, vision.text_tokens, image_embeddings.packed(vision.image_sources, vision.image_mask)
    kwargs |= {"pixel_values": vision.pixel_values.to(device, non_blocking=True),
               "image_grid_thw": vision.image_grid_thw.to(device, non_blocking=True)}
    return kwargs, vision.text_tokens, None
