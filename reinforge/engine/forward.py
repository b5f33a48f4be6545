"""Forward passes over packed micro-batches: response log-probs, entropy, values, reward-model scores.

Every pass packs the micro-batch's attended tokens into one row (``engine.packing``; a prompt
shared by several samples once, when the micro-batch's plan says so) and runs the model with
varlen attention (``engine.attention``), so no FLOP goes to padding or to repeated prompts. The
causal LM is called through its own ``forward`` (FSDP's hooks live there) with an empty
``logits_to_keep``, and its last hidden state is caught on the way out; the log-probs of the
response tokens then come from the fused, chunked projection of ``engine.log_probs``.
Position ``t`` of a response is predicted by the hidden state of the token before it. Logits
are divided by the rollout temperature: the sampler drew from ``softmax(logits / T)``, and
the policy ratio must compare like with like.

A vision-language model (Qwen2.5-VL, Qwen3-VL) runs the same way: its vision tower once over the
images of the packed row, their embeddings in place of the image tokens, and the language model
over the packed row with M-RoPE position ids that restart with each sequence (``packing.vision_model_kwargs``);
an image-token id outside the sequence's images is text (``models.vision.image_tokens_as_text``). Given a frozen
tower's embeddings of the batch's images (``engine.image_embeddings``, encoded once per step), the forward
takes no pixels: the embeddings (and Qwen3-VL's deepstack features) go in place of the image tokens' as the
tower's would (``models.vision.image_embeddings_in_place``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from reinforge.engine.attention import NAME as ATTENTION_NAME
from reinforge.engine.attention import (
    flash_applies,
    flash_runs_shared_segments,
    flex_runs_on,
    restore_own_attention,
    watch_attention_calls,
)
from reinforge.engine.fsdp import layer_compute_dtype, reshard
from reinforge.engine.image_embeddings import ImageEmbeddingCache
from reinforge.engine.log_probs import MAX_LOGITS_BYTES, linear_log_probs, linear_log_probs_and_sum_pi_squared
from reinforge.engine.longrope import unshared_where_factors_differ
from reinforge.engine.micro_batches import iter_balanced_micro_batches, iter_padded_micro_batches, rows_in_batch_order
from reinforge.engine.packing import PackedRows, pack_rows, plan_of, unpack_responses, vision_model_kwargs
from reinforge.models.architectures import architecture_spec, runs_code_it_ships
from reinforge.models.head_probe import kept_final_softcap
from reinforge.models.reward_model import score_head
from reinforge.models.signatures import takes_position_ids
from reinforge.models.vision import image_embeddings_in_place, image_tokens_as_text, is_vision_language, vision_tower
from reinforge.packed_attention.softcap_kernels import softcap_kernel_runs_on
from reinforge.protocol import MULTI_MODAL_KEY, Batch

_NO_MASK = {"full_attention": None, "sliding_attention": None}
"""Precomputed masks of the usual layer types: none, the varlen kernel keeps sequences apart (and applies
each layer's window itself)."""


def _no_mask(config, device: torch.device):
    """What stands for the attention mask of a packed row: the varlen kernel needs none.

    Models with per-layer-type masks (Qwen2, Qwen3, Gemma, SmolLM3, ...) take a precomputed
    mapping with an entry for every layer type their config names; the others (Llama, Mistral)
    take a 4D tensor as precomputed, which transformers passes through untouched (here a
    1-element placeholder that the varlen attention ignores); given no mask at all they would
    build a tokens x tokens one.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VLM's language model
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return {**_NO_MASK, **dict.fromkeys(layer_types)}
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


SOFT_CAP_NAMES = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
"""Config keys of a final soft-cap, ``cap * tanh(logits / cap)``, on the causal LM's logits."""


def logit_transform(config) -> tuple[float, float | None]:
    """(multiplier, final soft-cap) that the causal LM applies to ``lm_head``'s output, from its config.

    Cohere's ``logit_scale`` multiplies, Granite's ``logits_scaling`` divides, Gemma's
    ``final_logit_softcapping`` (RecurrentGemma's ``logits_soft_cap``, xLSTM's ``output_logit_soft_cap``) caps
    after them: the log-probs are those of the logits the model itself returns. A family whose head does something
    else is found by the start-up probe (``engine.fused.check_packed_sequences_stay_apart``).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    multiplier = float(getattr(config, "logit_scale", None) or 1.0)
    divisor = getattr(config, "logits_scaling", None)
    if divisor:
        multiplier /= float(divisor)
    cap = next((value for name in SOFT_CAP_NAMES if (value := getattr(config, name, None))), None)
    return multiplier, cap


def model_logit_transform(model: nn.Module) -> tuple[float, float | None]:
    """``logit_transform`` of the model's config, without the cap where the model's forward leaves it out
    (``models.head_probe``, asked by ``engine.fused.prepare_for_training``)."""
    multiplier, cap = logit_transform(model.config)
    return multiplier, kept_final_softcap(model, cap)


PACKS_ROWS = "_reinforge_packs_rows"
"""The attribute a model keeps its answer of ``packs_rows`` in."""
PROBE_LENGTH = 3
"""Tokens of each of the two sequences ``packs_rows`` packs into one row."""
PROBE_LEAK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
"""Largest change of the second sequence's output, relative to its size, that ``packs_rows`` takes for rounding when
only the first sequence's tokens change (others: 0.05). The shapes are the same, so a model that keeps the sequences
apart gives the same numbers to ~1e-7 in float32; in 16-bit types a mixture of experts can take other kernels for
the other token counts per expert."""


def packs_rows(model: nn.Module) -> bool:
    """Whether ``model``'s attention takes packed rows: it runs through reinforge's varlen attention and every call
    receives the packed forward's arguments. Families of the architecture table (and the vision-language models)
    do; another model is probed once, eagerly and in eval mode, with two sequences of three tokens through its own
    forward (FSDP's hooks live there), and the answer is kept on the model. A model whose modeling code drops those
    arguments on the way to its attention (StableLM in transformers 5), or calls no attention function of
    transformers' table (Falcon, BLOOM, MPT), would attend across the sequences of a packed row; it runs padded, as
    does one whose layers fail on a packed row (Mamba), and one whose other layers carry the first sequence into the
    second (Qwen3-Next's Gated DeltaNet, Jamba's and Zamba's Mamba layers beside their attention). The causal LM's
    start-up probe checks more (``engine.fused.check_packed_sequences_stay_apart``); a sequence classifier's or value
    model's backbone has only this one.
    """
    known = getattr(model, PACKS_ROWS, None)
    if known is not None:
        return known
    config = model.config
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        known = False
    elif not runs_code_it_ships(model) and (architecture_spec(config) is not None or is_vision_language(config)):
        known = True
    else:
        device = next(model.parameters()).device
        length = PROBE_LENGTH
        bounds = torch.tensor([0, length, 2 * length], dtype=torch.int32, device=device)
        probe = {"packed_cu_seqlens": bounds, "packed_max_length": length, "packed_cu_seqlens_k": bounds,
                 "packed_max_length_k": length, "packed_kv_index": None, "packed_lengths": [length, length],
                 "packed_key_lengths": [length, length]}
        positions = torch.arange(length, device=device).repeat(2)[None]
        second = torch.tensor([7, 11, 5], device=device)

        def hidden_or_logits(output) -> Tensor:
            hidden = getattr(output, "last_hidden_state", None)
            return (hidden if hidden is not None else output.logits)[0].float()

        def packed_output(first: list[int]) -> Tensor:
            """The module's output over the second sequence's tokens, packed after ``first``."""
            return hidden_or_logits(model(input_ids=torch.cat([torch.tensor(first, device=device), second])[None],
                                          position_ids=positions, attention_mask=_no_mask(config, device),
                                          use_cache=False, **probe))[length:]

        was_training = model.training
        model.eval()  # a router's training noise (PhiMoE's jitter) would read as a leak
        try:
            with watch_attention_calls() as calls, torch.no_grad(), torch.compiler.set_stance("force_eager"):
                after_one = packed_output([4, 9, 6])
                # the same shapes after another first sequence: any change is the first one leaking into the second
                # (a recurrent, convolution or linear-attention state carried along the row: Mamba, Gated DeltaNet)
                after_other = packed_output([8, 3, 10])
            known = calls.packed > 0 and calls.unpacked == 0
            with torch.no_grad():  # and as it is alone: a model that numbers its positions itself (BART's decoder
                # takes no position ids) numbers a packed row's second sequence on from the first
                alone = hidden_or_logits(model(input_ids=second[None], use_cache=False))
            if calls.packed == calls.unpacked == 0:  # attention in its own classes: its own masks too
                restore_own_attention(model, "its modules call no attention function of transformers' table")
            compared = torch.stack([after_one, alone])
            leak = float((compared - after_other).abs().max())
            tolerance = PROBE_LEAK_TOLERANCE.get(next(model.parameters()).dtype, 0.05)
            known = known and leak <= tolerance * max(float(compared.abs().max()), 1.0)
        except Exception:  # noqa: BLE001 (layers that take no packed row at all: padded rows)
            # Mamba's mixer reads the mask as padding; a model that fails padded too is refused by its probe
            known = False
        finally:
            model.train(was_training)
    setattr(model, PACKS_ROWS, known)
    return known


def runs_padded(model: nn.Module) -> bool:
    """Whether a training or scoring pass over ``model`` runs padded rows (``packs_rows`` of the module whose attention
    takes them: a value model's backbone, a sequence classifier's base model, else the causal LM itself)."""
    module = model
    if isinstance(getattr(model, "value_head", None), nn.Module) and hasattr(model, "backbone"):
        module = model.backbone
    elif score_head(model) is not None and hasattr(model, "base_model"):
        module = model.base_model
    if getattr(model, OWN_LOGITS, False):  # a head read whole runs padded rows (``own_logits_log_probs``)
        return True
    return getattr(module, "config", None) is not None and not packs_rows(module)


def _padded_forward(model: nn.Module, micro: Batch, **extra):
    """``model``'s outputs over the micro-batch's padded rows, through its own masked attention: the path of a model
    whose attention does not take packed rows. Returns the outputs and a function that lays a (rows, tokens, ...)
    output out as the micro-batch's columns.

    Each row runs with its tokens first and all its padding after them: a model that numbers its positions itself
    (BART's learned positions take no ``position_ids``) counted the left padding, which a forward of the sequence
    alone does not, and a causal model's tokens never see the padding after them. The position ids go in where the
    model's ``forward`` names them, as transformers' ``generate`` hands them over, so training reads the
    probabilities the rollout samples from.
    """
    images = micro.non_tensors.get(MULTI_MODAL_KEY)
    if images is not None and any(images):  # the padded rows would run without their pixels and M-RoPE positions
        raise ValueError(f"{type(model).__name__} takes rows with images through the packed pass only, and its "
                         "attention is not reinforge's varlen one; call engine.fused.prepare_for_training(model, "
                         "device) on it first, as every worker does")
    attention_mask = micro["attention_mask"]
    position_ids = micro["position_ids"] if "position_ids" in micro.keys() else build_position_ids(attention_mask)
    if position_ids.dim() != 2:
        raise ValueError(f"a padded forward takes (rows, tokens) position ids, got {tuple(position_ids.shape)}")
    width = attention_mask.shape[1]
    columns = torch.arange(width, device=attention_mask.device)
    leading = attention_mask.ne(0).int().argmax(dim=1, keepdim=True)  # padding before each row's first token
    aligned = (columns + leading) % width  # column j of an aligned row is column aligned[j] of the micro-batch's

    def align(tensor: Tensor) -> Tensor:
        return tensor.gather(1, aligned)

    positions = {"position_ids": align(position_ids)} if takes_position_ids(model) else {}
    output = model(input_ids=align(micro["input_ids"]), attention_mask=align(attention_mask), use_cache=False,
                   **positions, **extra)
    back = (columns - leading) % width

    def in_columns(tensor: Tensor, columns: slice = slice(None)) -> Tensor:
        """The micro-batch's ``columns`` of an aligned (rows, tokens, ...) output."""
        index = back[:, columns]
        return tensor.gather(1, index.reshape(*index.shape, *(1,) * (tensor.dim() - 2)).expand(
            *index.shape, *tensor.shape[2:]))

    return output, in_columns


def _response_positions(micro: Batch) -> tuple[int, Tensor]:
    """The prompt width and the response tokens' mask (B, R): the hidden state at width - 1 + t predicts token t."""
    width = micro["prompts"].shape[1]
    return width, micro["attention_mask"][:, width:].bool()


def _scattered(values: Tensor, valid: Tensor) -> Tensor:
    """(valid tokens,) -> (B, R) with zeros elsewhere."""
    return values.new_zeros(valid.shape).masked_scatter(valid, values)


def _check_varlen(config) -> None:
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError(f"the model uses attn_implementation={config._attn_implementation!r}, which would attend "
                         "across packed sequences; call reinforge.engine.attention.use_varlen_attention(model) first")


def _soft_capped(config) -> bool:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "attn_logit_softcapping", None) is not None


def _head_dim(config) -> int:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention_kwargs(packed: PackedRows, compute_dtype: torch.dtype, config=None) -> dict:
    """Decided here, outside the (possibly compiled) decoder layers: flash, flex (soft-caps) or masked attention."""
    device = packed.input_ids.device
    soft_capped = config is not None and _soft_capped(config)
    kernel = device.type == "cuda" and soft_capped and softcap_kernel_runs_on(device, compute_dtype, _head_dim(config))
    flex = device.type == "cuda" and soft_capped and not kernel and flex_runs_on(device)
    with_lengths = (not flash_applies(device, compute_dtype, packed.kv_index is not None)
                    or (soft_capped and not flex and not kernel))
    kwargs = packed.attention_kwargs(with_lengths=with_lengths)
    if packed.kv_index is not None:
        kwargs["packed_flash_shared"] = flash_runs_shared_segments(device)
    if flex:
        kwargs["packed_flex"] = True
    if kernel:
        kwargs["packed_softcap_kernel"] = True
    return kwargs


def response_log_probs(model: nn.Module, micro: Batch, temperature: float = 1.0, with_entropy: bool = False,
                       max_logits_bytes: int = MAX_LOGITS_BYTES,
                       with_sum_pi_squared: bool = False,
                       image_embeddings: ImageEmbeddingCache | None = None) -> tuple[Tensor, ...]:
    """Log-prob of each response token (B, R) and, if asked, the entropy at each position; float32.

    Logits of at most ``max_logits_bytes`` are kept for the backward (``engine.log_probs``; the memory
    planner's ``actor.logits_buffer_gib``), larger ones are recomputed chunk by chunk.
    with_sum_pi_squared (scoring only, no grad) adds a third output, sum_v pi(v)^2 at each position.
    image_embeddings: a vision-language model's frozen-tower image embeddings, prepared for the batch ``micro`` is cut
    from (``engine.image_embeddings``); the forward then takes them instead of running the tower on the pixels.

    ``model`` is a causal LM; its last hidden state over the packed row is caught by a hook on
    its decoder, and the output projection runs fused with the log-softmax. A model whose attention does not take
    packed rows (``packs_rows``) runs the micro-batch's padded rows instead, with the same projection.
    """
    if getattr(model, OWN_LOGITS, False):  # a head reinforge does not reproduce: its own logits, whole
        return own_logits_log_probs(model, micro, temperature, with_entropy, with_sum_pi_squared)
    if not packs_rows(model):  # padded rows, no shared prompts: hidden state at width - 1 + t predicts token t
        width, valid = _response_positions(micro)
        with _last_hidden_state(model) as captured:
            _, in_columns = _padded_forward(model, micro,
                                            logits_to_keep=torch.empty(0, dtype=torch.long, device=valid.device))
        return _response_projection(model, in_columns(captured[-1], slice(width - 1, -1))[valid], micro["responses"][valid],
                                    lambda values: _scattered(values, valid), temperature, with_entropy,
                                    max_logits_bytes, with_sum_pi_squared)
    _check_varlen(model.config)
    packed = pack_rows(unshared_where_factors_differ(model, micro))
    device = packed.input_ids.device
    inputs, text_tokens, cached = {"position_ids": packed.position_ids}, None, None
    if is_vision_language(model.config):  # M-RoPE positions, and the images for the vision tower (or their embeddings)
        inputs, text_tokens, cached = vision_model_kwargs(micro, model.config, device, image_embeddings)
    with (_last_hidden_state(model) as captured,
          image_tokens_as_text(model, packed.input_ids, text_tokens) as input_ids,
          image_embeddings_in_place(model, cached.image_mask, cached.embeddings, cached.deepstack)
          if cached is not None else contextlib.nullcontext()):
        output = model(input_ids=input_ids, attention_mask=_no_mask(model.config, device), use_cache=False,
                       logits_to_keep=torch.empty(0, dtype=torch.long, device=device),
                       **inputs, **_attention_kwargs(packed, layer_compute_dtype(model), model.config))
    hidden = captured[-1][0, packed.predictor_index]
    symmetric = _trained_tower_on_every_rank(model, inputs, output)
    if symmetric is not None:
        hidden = hidden + symmetric.to(hidden.dtype)
    return _response_projection(model, hidden, packed.response_targets,
                                lambda values: unpack_responses(values, packed), temperature, with_entropy,
                                max_logits_bytes, with_sum_pi_squared)


def _trained_tower_on_every_rank(model: nn.Module, inputs: dict, output) -> Tensor | None:
    """A zero to add to the forward's output of a VLM whose vision tower trains, on one of several ranks (None
    elsewhere): every rank's backward must run FSDP's collectives alike. The model's output holds the tower's
    image features, so a rank whose rows hold images runs the root unit's pre-backward gather when their gradient
    comes and gives the tower gradients, while a rank without images would do neither, and the two would wait on
    each other for ever. The zero reads the output's (empty) logits, whose gradient comes first on every rank, and,
    without images here, one entry of each trained tower parameter, which then gets a zero gradient."""
    import torch.distributed as dist

    if (not torch.is_grad_enabled() or not is_vision_language(model.config)
            or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)):
        return None
    tower = vision_tower(model)
    trained = [parameter for parameter in tower.parameters() if parameter.requires_grad] if tower is not None else []
    if not trained:
        return None
    zero = output.logits.float().sum() * 0.0
    if "pixel_values" not in inputs:
        zero = zero + torch.stack([parameter.reshape(-1)[0].float() for parameter in trained]).sum() * 0.0
    return zero


def routed_token_weights(model: nn.Module, micro: Batch) -> Tensor:
    """(tokens,) float32 on ``micro``'s device, in the order ``response_log_probs`` just ran them through ``model``:
    how many of the micro-batch's unshared, unpadded tokens each one stands for. A packed row's shared prompt tokens
    stand for their group's rows (``PackingPlan.token_weights``); padded rows weigh their padding 0, as transformers'
    attention mask does, each row's tokens first as ``_padded_forward`` ran them. A router's statistics weighted by
    them are those of transformers' padded forward."""
    if getattr(model, OWN_LOGITS, False) or not packs_rows(model):
        attention_mask = micro["attention_mask"]
        columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        return (columns < attention_mask.ne(0).sum(dim=1, keepdim=True)).reshape(-1).float()
    return plan_of(micro).token_weights.to(micro["input_ids"].device, non_blocking=True)


def decoder_of(model: nn.Module) -> nn.Module:
    """The causal LM's decoder (the module that returns ``last_hidden_state``): ``get_decoder()``, or where that
    gives the causal LM itself (Llama 4's text model, whose base-model prefix names no attribute), the child that
    holds its decoder blocks."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if decoder is not model:
        return decoder
    from reinforge.engine.fsdp import decoder_layers

    first = decoder_layers(model)[0]
    for child in model.children():
        if any(module is first for module in child.modules()):
            return child
    return model


OWN_LOGITS = "_reinforge_own_logits"
"""Set on a model whose head transforms its logits beyond ``lm_head`` and ``logit_transform`` (found by the start-up
probe): its log-probs are read from the logits its own forward returns, over padded rows."""


def own_logits_log_probs(model: nn.Module, micro: Batch, temperature: float, with_entropy: bool,
                          with_sum_pi_squared: bool) -> tuple[Tensor, ...]:
    """``response_log_probs`` from the logits the causal LM itself returns (every vocabulary entry of every response
    position at once, in float32: more memory than the fused projection, which never holds them all)."""
    width, valid = _response_positions(micro)
    output, in_columns = _padded_forward(model, micro)
    logits = in_columns(output.logits, slice(width - 1, -1))[valid].float()
    logits = logits / (temperature if temperature > 0 else 1.0)
    log_softmax = logits.log_softmax(-1)
    log_probs = log_softmax.gather(-1, micro["responses"][valid][:, None])[:, 0]
    if not (with_entropy or with_sum_pi_squared):
        return _scattered(log_probs, valid), None
    probs = log_softmax.exp()
    entropy = _scattered(-(probs * log_softmax).sum(-1), valid)
    if with_sum_pi_squared:
        return _scattered(log_probs, valid), entropy, _scattered(probs.square().sum(-1), valid)
    return _scattered(log_probs, valid), entropy


@contextlib.contextmanager
def _last_hidden_state(model: nn.Module) -> Iterator[list[Tensor]]:
    """A list that receives the causal LM's last hidden state from each forward inside the block (a hook on its
    decoder)."""
    captured: list[Tensor] = []
    hook = decoder_of(model).register_forward_hook(
        lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        yield captured
    finally:
        hook.remove()


def _response_projection(model: nn.Module, hidden: Tensor, targets: Tensor, unpack, temperature: float,
                         with_entropy: bool, max_logits_bytes: int, with_sum_pi_squared: bool) -> tuple[Tensor, ...]:
    """The response tokens' log-probs (and entropy, or sum_v pi(v)^2) from their predictors' hidden states, the
    output projection fused with the log-softmax; ``unpack`` lays each (tokens,) output out as (B, R)."""
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)  # Phi-2's and GPT-J's output layers have a bias
    logit_scale, softcap = model_logit_transform(model)
    if with_sum_pi_squared:
        outputs = linear_log_probs_and_sum_pi_squared(hidden.to(weight.dtype), weight, targets, temperature,
                                                      max_logits_bytes=max_logits_bytes, logit_scale=logit_scale,
                                                      softcap=softcap, bias=bias)
        return tuple(unpack(output) for output in outputs)
    log_probs, entropy = linear_log_probs(hidden.to(weight.dtype), weight, targets, temperature,
                                          max_logits_bytes=max_logits_bytes, logit_scale=logit_scale,
                                          softcap=softcap, bias=bias)
    return unpack(log_probs), unpack(entropy) if with_entropy else None


def response_values(model: nn.Module, micro: Batch) -> Tensor:
    """Value of the state before each response token (B, R), float32; ``model`` is a ValueModel."""
    if not packs_rows(model.backbone):
        width, valid = _response_positions(micro)
        outputs, in_columns = _padded_forward(model.backbone, micro)
        head = model.value_head
        hidden = in_columns(outputs.last_hidden_state, slice(width - 1, -1))[valid]
        return _scattered(head(hidden.to(head.weight.dtype)).squeeze(-1).float(), valid)
    _check_varlen(model.backbone.config)
    packed = pack_rows(unshared_where_factors_differ(model, micro))
    outputs = model.backbone(input_ids=packed.input_ids, position_ids=packed.position_ids,
                             attention_mask=_no_mask(model.backbone.config, packed.input_ids.device), use_cache=False,
                             **_attention_kwargs(packed, layer_compute_dtype(model.backbone), model.backbone.config))
    hidden = outputs.last_hidden_state[0, packed.predictor_index]
    head = model.value_head
    values = head(hidden.to(head.weight.dtype)).squeeze(-1).float()
    return unpack_responses(values, packed)


def last_token_scores(model: nn.Module, micro: Batch) -> Tensor:
    """The classification head at each sequence's last attended token (B, 1), float32.

    ``model`` is a ``*ForSequenceClassification`` or ``*ForTokenClassification`` (a reward model): its backbone
    (``base_model``) runs over the packed row and its head (``score_head``) reads only the last tokens.
    """
    backbone = model.base_model
    if not packs_rows(backbone):
        outputs, in_columns = _padded_forward(backbone, micro)
        attention_mask = micro["attention_mask"]
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.bool() * positions).argmax(dim=1)  # the last attended token of each row
        hidden = in_columns(outputs.last_hidden_state)[torch.arange(len(last), device=last.device), last]
        head = score_head(model)
        return head(hidden.to(head.weight.dtype)).float()
    _check_varlen(backbone.config)
    packed = pack_rows(unshared_where_factors_differ(model, micro))
    outputs = backbone(input_ids=packed.input_ids, position_ids=packed.position_ids,
                       attention_mask=_no_mask(backbone.config, packed.input_ids.device), use_cache=False,
                       **_attention_kwargs(packed, layer_compute_dtype(backbone), backbone.config))
    hidden = outputs.last_hidden_state[0, packed.last_index]
    head = score_head(model)
    return head(hidden.to(head.weight.dtype)).float()


class ScoringPass:
    """Scoring of a batch in token-balanced micro-batches, in eval mode and without grad; the caller runs each
    forward, one call away from the model:

        with ScoringPass(model, batch, max_tokens, device) as scoring:
            for micro in scoring:
                scoring.add(*response_log_probs(model, micro, with_entropy=True))
        log_probs, entropy = scoring.outputs()

    Each output added (rows, <= R) comes back from ``outputs`` as one (B, R) tensor in batch order;
    the parameters are resharded on leaving. The scoring loop of the actor, the reference, the critic and the
    reward model.
    """

    def __init__(self, model: nn.Module, batch: Batch, max_tokens: int, device: torch.device):
        self.model, self.batch, self.max_tokens, self.device = model, batch, max_tokens, device
        self.pieces: list[Batch] = []
        self.results: list[tuple[Tensor, ...]] = []
        self._no_grad = torch.no_grad()

    def __enter__(self) -> ScoringPass:
        self._was_training = self.model.training
        self.model.eval()
        self._no_grad.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._no_grad.__exit__(*exc_info)
        self.model.train(self._was_training)
        reshard(self.model)

    def __iter__(self) -> Iterator[Batch]:
        pieces = (iter_padded_micro_batches(self.batch, self.max_tokens) if runs_padded(self.model)
                  else iter_balanced_micro_batches(self.batch, self.max_tokens, share_prompts=True))
        for micro in pieces:
            self.pieces.append(micro)
            yield micro.to(self.device)

    def add(self, *outputs: Tensor) -> None:
        """The outputs of the micro-batch just yielded, each (its rows, <= R)."""
        self.results.append(outputs)

    def outputs(self) -> tuple[Tensor, ...]:
        width = self.batch["responses"].shape[1]
        return tuple(rows_in_batch_order(self.pieces, list(column), len(self.batch), width)
                     for column in zip(*self.results, strict=True))


def build_position_ids(attention_mask: Tensor) -> Tensor:
    """0, 1, 2, ... over the real tokens of each row; padding positions get 0."""
    return (torch.cumsum(attention_mask, dim=-1) - 1).clamp(min=0) * attention_mask
