"""The transformers backend: wraps ``model.generate`` behind the rollout-engine interface.

It works for any causal LM transformers can load and is the fallback where the native engine
does not support an architecture. It generates with the training model itself (same
parameters, nothing to copy), so ``sync_weights`` has nothing to do. Requests whose sampling
parameters differ only in their seed are batched together, prompts left-padded.

Seeded requests sample by Gumbel-max inside ``generate``'s greedy search: a logits processor
tempers and truncates (top-k, top-p, min-p) each row's logits and adds the Gumbel noise of
``rollout.noise`` (a hash of the sample's seed, the token's position and the column), so a
request's samples depend on its seed alone, not on what shares its batch, and are the native
engine's samples for the same logits. A request without a seed gets one from the engine (as the native engine
gives it one): ``generate`` runs inside ``fork_rng``, so transformers' own sampling would draw one stream every call.
Either way the rollout.* settings alone shape the distribution: the model's ``generation_config`` keeps its
token ids and cache settings during ``generate`` and nothing else (a checkpoint's repetition penalty, forced EOS or
banned n-grams would sample other probabilities than training computes), said in one line at start.

A vision-language model (Qwen2.5-VL, Qwen3-VL) generates from each request's ``multi_modal_inputs``
too: the rows' pixel values and grids go to ``generate`` with the image tokens marked, so the model
places its vision tower's embeddings and computes its M-RoPE positions itself (an image-token id outside the
row's images, as an earlier turn may have sampled, is text: ``models.vision.image_tokens_as_text``); a prompt's n samples
are n rows, each with its images. The tower still encodes each prompt's images once: its call on the
n copies encodes the first and repeats the embeddings to the other rows (``_encode_each_prompt_once``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.utils import ModelOutput

from reinforge.models.longrope import longrope_original_length
from reinforge.models.signatures import takes_position_ids
from reinforge.models.vision import image_token_mask, image_tokens_as_text, vision_tower
from reinforge.models.window_masks import window_never_applies
from reinforge.rollout.base import (
    Completion,
    GenerationInterrupted,
    GenerationRequest,
    SamplingParams,
    prompt_problem,
    sampling_problem,
)
from reinforge.rollout.native.sampling import MAX_INV_TEMPERATURE, truncation_thresholds
from reinforge.rollout.noise import gumbel_noise, noise_keys, sample_seed
from reinforge.rollout.stop_strings import StopStringMatcher, token_decoder

CACHE_KWARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
"""The name ``generate`` takes a cache by (transformers 5.24 renamed ``past_key_values``)."""

logger = logging.getLogger(__name__)


KEPT_GENERATION_FIELDS = ("bos_token_id", "decoder_start_token_id", "cache_implementation", "cache_config",
                          "max_cache_len", "compile_config", "disable_compile")
"""What of a model's ``generation_config`` a rollout keeps: token ids and cache settings. The rest (repetition
penalty, forced BOS or EOS, banned n-grams, suppressed tokens, a minimum length, beams, its own temperature or
top-k) would make it sample from other probabilities than the training passes compute."""


def dropped_generation_settings(model: nn.Module) -> dict:
    """The settings of ``model``'s generation_config that a rollout leaves out (``KEPT_GENERATION_FIELDS``), those
    that differ from transformers' defaults."""
    own = getattr(model, "generation_config", None)
    if own is None:
        return {}
    ignored = {*KEPT_GENERATION_FIELDS, "eos_token_id", "pad_token_id", "transformers_version", "_from_model_config",
               "use_cache", "return_dict_in_generate", "output_attentions", "output_hidden_states"}
    return {name: value for name, value in own.to_diff_dict().items() if name not in ignored}


@contextmanager
def sampling_only_generation_config(model: nn.Module) -> Iterator[None]:
    """``model.generation_config`` reduced to ``KEPT_GENERATION_FIELDS`` inside the block: ``generate`` fills every
    setting the call leaves unset from it, so the checkpoint's processors would otherwise apply."""
    own = getattr(model, "generation_config", None)
    if own is None:
        yield
        return
    model.generation_config = GenerationConfig(**{name: getattr(own, name) for name in KEPT_GENERATION_FIELDS
                                                  if getattr(own, name, None) is not None})
    try:
        yield
    finally:
        model.generation_config = own


def generate_fails(model: nn.Module, error: BaseException) -> str:
    """The one line said when transformers' own ``generate`` fails on ``model``."""
    import transformers

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    name = type(model).__name__.removeprefix("FSDP")  # FSDP2 renames the class it shards
    return (f"transformers' generate fails on {name} (model_type={model_type!r}, from model.path's "
            f"config.json) in rollout.name=hf ({reason}); set rollout.name=native where the native engine runs it, "
            f"or use a transformers version (this is {transformers.__version__}) whose generate runs {model_type}")


class _SeededSampler(LogitsProcessor):
    """Turns greedy search into seeded sampling: tempered, truncated logits plus per-row Gumbel noise.

    sample_seeds and prompt_lengths: per row; padded_length: the rows' common (left-padded) prompt length.
    """

    def __init__(self, sample_seeds: list[int], prompt_lengths: list[int], padded_length: int,
                 sampling: SamplingParams):
        self.sample_seeds, self.prompt_lengths = sample_seeds, prompt_lengths
        self.padded_length, self.sampling = padded_length, sampling

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        sampling = self.sampling
        scaled = scores.float() / tempered(sampling.temperature)
        rows = scaled.shape[0]
        threshold = torch.full((rows,), -math.inf, device=scaled.device)
        if sampling.top_k > 0 or sampling.top_p < 1.0:
            top_k = torch.full((rows,), max(sampling.top_k, 0), dtype=torch.long, device=scaled.device)
            top_p = torch.full((rows,), sampling.top_p, device=scaled.device)
            threshold = truncation_thresholds(scaled, top_k, top_p)
        if sampling.min_p > 0:
            threshold = torch.maximum(threshold, scaled.max(-1).values + math.log(sampling.min_p))
        step = input_ids.shape[1] - self.padded_length
        keys = noise_keys(self.sample_seeds, [length + step for length in self.prompt_lengths], scaled.device)
        return torch.where(scaled >= threshold[:, None], scaled + gumbel_noise(keys, scaled.shape[1]), -math.inf)


def tempered(temperature: float) -> float:
    """The temperature logits are divided by: one so small that the quotient overflows float32 is the native sampler's
    smallest (``MAX_INV_TEMPERATURE``), which samples the argmax."""
    return max(temperature, 1 / MAX_INV_TEMPERATURE)


class _TokenLogProbs(LogitsProcessor):
    """Each sampled token's log-prob (log-softmax of the step's scores at ``scale``), without keeping every step's
    logits: ``generate(output_logits=True)`` holds rows x new tokens x vocabulary logits (159 GB for 256 rows of
    2,048 tokens of a 152k vocabulary), this only one step's. A step's call reads the token the step before
    sampled (the last column of its input ids) from that step's log-softmax; ``finish`` reads the last token.
    It sees the scores after transformers' own non-sampling processors (with ``ignore_eos``, min_new_tokens has
    masked the end-of-sequence token, which the samples then cannot contain either). With ``num_top`` it also keeps
    each step's ``num_top`` most likely tokens and their log-probs (``top``)."""

    def __init__(self, scale: float, num_top: int = 0):
        self.scale = scale
        self.num_top = num_top
        self.previous: Tensor | None = None
        self.columns: list[Tensor] = []
        self.top: list[tuple[Tensor, Tensor]] = []
        """Each step's (log-probs, ids), (rows, num_top) each, most likely first."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.previous is not None:
            self.columns.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float() / self.scale, dim=-1)
        if self.num_top:
            values, ids = self.previous.topk(min(self.num_top, self.previous.shape[-1]), dim=-1)
            self.top.append((values.cpu(), ids.cpu()))
        return scores

    def finish(self, sequences: Tensor) -> Tensor:
        """(rows, new tokens) log-probs, once generate has returned its ``sequences``."""
        if self.previous is not None:
            self.columns.append(self.previous.gather(-1, sequences[:, -1:].to(self.previous.device)).squeeze(-1))
            self.previous = None
        return torch.stack(self.columns, dim=1).cpu() if self.columns else torch.zeros(len(sequences), 0)

    def top_of(self, row: int, length: int) -> list[list[tuple[int, float]]]:
        """A row's alternatives of its first ``length`` tokens: (token id, log-prob), most likely first."""
        return [list(zip(ids[row].tolist(), values[row].tolist(), strict=True)) for values, ids in self.top[:length]]


class _Interrupted(StoppingCriteria):
    """Ends every row once ``interrupted`` is set (from another thread): ``generate`` returns at its next token."""

    def __init__(self, interrupted: threading.Event):
        self.interrupted = interrupted

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        return torch.full((input_ids.shape[0],), self.interrupted.is_set(), device=input_ids.device)


def _raise_if_set(interrupted: threading.Event | None) -> None:
    if interrupted is not None and interrupted.is_set():
        raise GenerationInterrupted("the generate call was interrupted: no one waits for its samples any more")


class _StopStrings(StoppingCriteria):
    """Ends each row at the token whose text completes one of the stop strings (``rollout/stop_strings.py``) and
    keeps how many tokens each row had then (``lengths``, None for a row that completed none)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...], padded_length: int):
        self.decode, self.stop, self.padded_length = decode, stop, padded_length
        self.matchers: list[StopStringMatcher] = []
        self.lengths: list[int | None] = []

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        if not self.matchers:
            self.matchers = [StopStringMatcher(self.decode, self.stop) for _ in range(input_ids.shape[0])]
            self.lengths = [None] * input_ids.shape[0]
        num_generated = input_ids.shape[1] - self.padded_length
        for row, token_id in enumerate(input_ids[:, -1].tolist()):
            if self.lengths[row] is None and self.matchers[row].add(token_id):
                self.lengths[row] = num_generated
        return torch.tensor([length is not None for length in self.lengths], device=input_ids.device)


def _image_kwargs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                  row_images: list[dict[str, Tensor] | None], device: torch.device) -> tuple[dict[str, Tensor], Tensor]:
    """``generate``'s image arguments for these rows: their pixel values and grids in row order, and the images'
    tokens marked (``mm_token_type_ids``, from which the model computes its M-RoPE positions); and the tokens whose
    image-token id is text (outside the row's images, e.g. sampled in an earlier turn) for ``image_tokens_as_text``."""
    present = [row for row in row_images if row]
    is_image = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, images in enumerate(row_images):
        attended = attention_mask[row].bool()
        grid = images.get("image_grid_thw") if images else None
        is_image[row, attended] = image_token_mask(model.config, input_ids[row][attended],
                                                   grid.cpu() if grid is not None else None)
    kwargs = {"pixel_values": torch.cat([row["pixel_values"] for row in present]).to(device),
              "image_grid_thw": torch.cat([row["image_grid_thw"] for row in present]).to(device),
              "mm_token_type_ids": is_image.int().to(device)}
    return kwargs, (input_ids == model.config.image_token_id) & ~is_image


def _spans(counts: list[int], copies: int) -> tuple[Tensor, Tensor]:
    """For items whose counts[p] rows each appear ``copies`` times in a row (prompt p's copies, then p + 1's):
    the index of the first copy's rows among all, and the index repeating those first rows to every copy."""
    starts = [sum(counts[:index]) for index in range(len(counts))]
    first = torch.cat([torch.arange(copies * start, copies * start + count)
                       for start, count in zip(starts, counts, strict=True)])
    repeat = torch.cat([torch.arange(start, start + count).repeat(copies) for start, count in zip(starts, counts,
                                                                                                   strict=True)])
    return first, repeat


def _repeat_rows(value, indices: dict[int, Tensor]):
    """``value`` (a tensor, a list or tuple of them, or a ModelOutput of them) with every tensor whose first
    dimension is a key of ``indices`` indexed by it along that dimension."""
    if isinstance(value, Tensor):
        index = indices.get(value.shape[0]) if value.dim() else None
        return value if index is None else value.index_select(0, index.to(value.device))
    if isinstance(value, ModelOutput):
        for key in list(value.keys()):
            value[key] = _repeat_rows(value[key], indices)
        return value
    if isinstance(value, list | tuple):
        return type(value)(_repeat_rows(item, indices) for item in value)
    return value


@contextmanager
def _encode_each_prompt_once(model: nn.Module, images: list[dict[str, Tensor]], copies: int) -> Iterator[None]:
    """While ``generate`` runs on ``copies`` rows of each prompt of ``images`` (its pixel values and grids, rows in
    prompt order), the vision tower encodes each prompt's images once: a call on the copies encodes the first copy
    and repeats its patches' and merged tokens' rows (deepstack features included) to the other copies, which
    hold the same images. Any other call runs unchanged."""
    tower = vision_tower(model)
    if tower is None or copies == 1 or not images:
        yield
        return
    grids = [row["image_grid_thw"] for row in images]
    patches = [int(grid.prod(-1).sum()) for grid in grids]
    merged = [count // tower.spatial_merge_size ** 2 for count in patches]
    first_patches, repeat_patches = _spans(patches, copies)
    first_images, _ = _spans([len(grid) for grid in grids], copies)
    _, repeat_merged = _spans(merged, copies)
    encode = tower.forward

    def forward(pixel_values: Tensor, grid_thw: Tensor | None = None, **kwargs):
        if grid_thw is None or pixel_values.shape[0] != copies * sum(patches) or \
                grid_thw.shape[0] != copies * len(first_images):
            return encode(pixel_values, grid_thw=grid_thw, **kwargs)
        output = encode(pixel_values[first_patches.to(pixel_values.device)],
                        grid_thw=grid_thw[first_images.to(grid_thw.device)], **kwargs)
        return _repeat_rows(output, {sum(patches): repeat_patches, sum(merged): repeat_merged})

    tower.forward = forward
    try:
        yield
    finally:
        del tower.forward


@contextmanager
def _prefill_again_where_longrope_switches(model: nn.Module) -> Iterator[None]:
    """While ``generate`` runs on a LongRoPE model whose sequences may pass its original length, the step where any
    row's last token reaches that position runs over every row's whole sequence, without the cache: the row's
    earlier keys take the long factors its later tokens use, as a forward over the sequence does (what training
    computes; the trainer's rotary module picks the factors per sequence, ``engine/longrope.py``), and every other
    row's its own. transformers' Phi-3 and PhiMoE drop the cache only when the padded width reaches that length, so a
    left-padded row that passes it later kept its short-factor keys (log-probs several nats from the training
    forward), and other families never drop it."""
    original = longrope_original_length(model)
    if original is None:
        yield
        return
    prepare, patched = model.prepare_inputs_for_generation, vars(model).get("prepare_inputs_for_generation")
    fresh_cache = DynamicCache if window_never_applies(model) else lambda: None  # as generate's own first cache

    @functools.wraps(prepare)  # generate checks its model_kwargs against this signature
    def prepare_inputs(input_ids: Tensor, *args, **kwargs):
        cache, attention_mask = kwargs.get(CACHE_KWARG), kwargs.get("attention_mask")
        # generate leaves the mask out where no row is padded: every row is then as long as the input
        lengths = attention_mask.sum(-1) if attention_mask is not None and attention_mask.dim() == 2 else \
            torch.full((input_ids.shape[0],), input_ids.shape[1])
        if cache is not None and cache.get_seq_length() > 0 and bool((lengths == original + 1).any()):
            kwargs[CACHE_KWARG] = fresh_cache()
            if "next_sequence_length" in kwargs:
                kwargs["next_sequence_length"] = None
            if kwargs.get("cache_position") is not None:  # transformers before 5.24 slices the inputs by it
                kwargs["cache_position"] = torch.arange(input_ids.shape[1], device=input_ids.device)
        return prepare(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = prepare_inputs
    try:
        yield
    finally:
        if patched is None:
            del model.prepare_inputs_for_generation
        else:
            model.prepare_inputs_for_generation = patched


class HFEngine:
    reads_model_in_place = True
    """``generate`` runs on the training module itself."""

    def __init__(self, model: nn.Module, *, pad_token_id: int, eos_token_ids: list[int], max_batch_size: int = 256,
                 seed: int = 0, tokenizer: Any = None):
        """tokenizer: decodes the samples of requests with stop strings (``SamplingParams.stop``), which end at the
        token that completes one; without it such requests are refused."""
        self.model = model
        self.decode = token_decoder(tokenizer) if tokenizer is not None else None
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_size = max_batch_size
        self._seed_generator = np.random.default_rng(seed)
        """Seeds of requests that bring none (see the module docstring)."""
        self.last_metrics: dict[str, float] = {}
        dropped = dropped_generation_settings(model)
        if dropped:
            settings = ", ".join(f"{name}={value!r}" for name, value in sorted(dropped.items()))
            logger.info("rollout.name=hf leaves out the model's generation_config settings %s: rollout.temperature, "
                        "top_p, top_k and min_p alone shape the samples, the probabilities training computes", settings)

    def sync_weights(self, model: nn.Module) -> None:
        self.model = model

    def wake_up(self) -> None:
        pass

    def sleep(self, abandon: bool = False) -> None:
        pass

    def generate(self, requests: list[GenerationRequest],
                 interrupted: threading.Event | None = None) -> list[list[Completion]]:
        """Completions for each request, in request order. ``interrupted``, set from another thread while the call
        runs, ends it at its next token with ``GenerationInterrupted`` (no sample of a call stopped midway is returned:
        a cut sample would read as one that ended there)."""
        results: list[list[Completion] | None] = [None] * len(requests)
        # a model that numbers its positions itself (its forward takes no position_ids: BART's decoders, RWKV's
        # state) would count a row's left padding: its prompts go to generate in rows of one length, unpadded
        unpadded = not takes_position_ids(self.model)
        groups: dict[tuple[SamplingParams, int | None], list[int]] = defaultdict(list)
        vocab_size = self.model.get_input_embeddings().weight.shape[0]
        for index, request in enumerate(requests):
            problem = prompt_problem(request.prompt_token_ids, vocab_size)
            if problem is not None:
                raise ValueError(f"request {request.request_id!r} has {problem}")
            problem = sampling_problem(request.sampling)
            if problem is not None:
                raise ValueError(f"request {request.request_id!r} asks for {problem}")
            if request.sampling.stop and self.decode is None:
                raise ValueError(f"request {request.request_id!r} has stop strings {list(request.sampling.stop)} but "
                                 "the engine has no tokenizer to read its samples' text; build HFEngine with "
                                 "tokenizer=")
            length = len(request.prompt_token_ids) if unpadded else None
            groups[dataclasses.replace(request.sampling, seed=None, first_sample=0), length].append(index)
        for (sampling, _), indices in groups.items():
            # greedy search gives a prompt's n samples alike: one is generated and copied (generate itself refuses
            # greedy search with num_return_sequences > 1 from transformers 5.25)
            copies, sampling = (sampling.n, dataclasses.replace(sampling, n=1)) if sampling.greedy else (1, sampling)
            per_call = max(1, self.max_batch_size // sampling.n)
            for start in range(0, len(indices), per_call):
                chunk = indices[start:start + per_call]
                seeds = None if sampling.greedy else [(self._seed_of(requests[i].sampling),
                                                       requests[i].sampling.first_sample) for i in chunk]
                _raise_if_set(interrupted)
                completions = self._generate_same_params([requests[i].prompt_token_ids for i in chunk], sampling,
                                                         seeds, [requests[i].multi_modal_inputs for i in chunk],
                                                         interrupted)
                _raise_if_set(interrupted)
                for index, samples in zip(chunk, completions, strict=True):
                    results[index] = samples if copies == 1 else [copy.deepcopy(sample) for sample in samples
                                                                  for _ in range(copies)]
        return [samples for samples in results if samples is not None]

    def _seed_of(self, sampling: SamplingParams) -> int:
        return sampling.seed if sampling.seed is not None else int(self._seed_generator.integers(2**62))

    @torch.no_grad()
    def _generate_same_params(self, prompts: list[list[int]], sampling: SamplingParams,
                              seeds: list[tuple[int, int]] | None = None,
                              images: list[dict[str, Tensor] | None] | None = None,
                              interrupted: threading.Event | None = None) -> list[list[Completion]]:
        """``seeds``: each prompt's (request seed, first sample index), None for greedy search; ``images``: each
        prompt's ``multi_modal_inputs`` (None: none); ``interrupted``: ends ``generate`` at the next token once set."""
        device = next(self.model.parameters()).device
        longest = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, longest - len(prompt):] = 1
        stop_ids = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        kwargs = dict(
            max_new_tokens=sampling.max_tokens,
            do_sample=False,
            num_return_sequences=sampling.n,
            pad_token_id=self.pad_token_id,
            eos_token_id=None if sampling.ignore_eos else stop_ids,
            return_dict_in_generate=True,
            use_cache=True,
        )
        if sampling.ignore_eos:
            kwargs["min_new_tokens"] = sampling.max_tokens
        if window_never_applies(self.model):  # the forward attends to every key: so does the cache (a full one)
            # and not the cache the generation_config names (generate refuses both; a static one slides too)
            kwargs |= {CACHE_KWARG: DynamicCache(), "cache_implementation": None}
        recorder = _TokenLogProbs(1.0 if sampling.greedy else tempered(sampling.temperature),
                                  sampling.num_top_log_probs)
        kwargs["logits_processor"] = LogitsProcessorList([recorder])
        stop_strings = None
        stopping_criteria = StoppingCriteriaList([_Interrupted(interrupted)] if interrupted is not None else [])
        if sampling.stop and not sampling.ignore_eos:
            stop_strings = _StopStrings(self.decode, sampling.stop, longest)
            stopping_criteria.append(stop_strings)
        if stopping_criteria:
            kwargs["stopping_criteria"] = stopping_criteria
        if seeds is not None:  # greedy search over seeded Gumbel-perturbed logits (see the module docstring)
            sample_seeds = [sample_seed(seed, first + sample) for seed, first in seeds for sample in range(sampling.n)]
            prompt_lengths = [len(prompt) for prompt in prompts for _ in range(sampling.n)]
            # greedy search returns one sequence per input row: the n samples of a prompt are n rows
            input_ids = input_ids.repeat_interleave(sampling.n, dim=0)
            attention_mask = attention_mask.repeat_interleave(sampling.n, dim=0)
            sampler = _SeededSampler(sample_seeds, prompt_lengths, longest, sampling)
            kwargs.update(do_sample=False, num_return_sequences=1, temperature=None, top_p=None, top_k=None,
                          logits_processor=LogitsProcessorList([recorder, sampler]))
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        text_tokens = None
        if images is not None and any(images):
            if kwargs["num_return_sequences"] > 1:  # n rows per prompt, each with its images
                input_ids = input_ids.repeat_interleave(sampling.n, dim=0)
                attention_mask = attention_mask.repeat_interleave(sampling.n, dim=0)
                kwargs["num_return_sequences"] = 1
            image_kwargs, text_tokens = _image_kwargs(self.model, input_ids, attention_mask,
                                                      [row for row in images for _ in range(sampling.n)], device)
            kwargs |= image_kwargs
        prompt_images = [row for row in images if row] if images is not None else []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    sampling_only_generation_config(self.model), \
                    _encode_each_prompt_once(self.model, prompt_images, sampling.n), \
                    _prefill_again_where_longrope_switches(self.model), \
                    image_tokens_as_text(self.model, input_ids.to(device), text_tokens) as model_input_ids:
                output = self.model.generate(input_ids=model_input_ids, attention_mask=attention_mask.to(device),
                                             **kwargs)
        except torch.OutOfMemoryError:
            raise
        except (ValueError, RuntimeError, TypeError, IndexError, KeyError, AttributeError) as error:
            raise RuntimeError(generate_fails(self.model, error)) from error
        finally:
            self.model.train(was_training)
        generated = output.sequences[:, longest:].cpu()
        token_log_probs = recorder.finish(output.sequences) if generated.shape[1] else torch.zeros(len(generated), 0)
        completions: list[list[Completion]] = []
        stop_set = set(stop_ids)
        for row in range(len(prompts)):
            samples = []
            for sample in range(sampling.n):
                flat = row * sampling.n + sample
                token_ids = generated[flat].tolist()
                length, finish_reason = len(token_ids), "length"
                if not sampling.ignore_eos:
                    for position, token in enumerate(token_ids):
                        if token in stop_set:
                            length, finish_reason = position + 1, "stop"
                            break
                    stopped_at = stop_strings.lengths[flat] if stop_strings is not None and stop_strings.lengths \
                        else None
                    if stopped_at is not None and stopped_at <= length:
                        length, finish_reason = stopped_at, "stop"
                samples.append(Completion(token_ids[:length], token_log_probs[flat, :length].tolist(), finish_reason,
                                          recorder.top_of(flat, length) if sampling.num_top_log_probs else None))
            completions.append(samples)
        return completions
