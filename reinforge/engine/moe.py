"""Mixture-of-experts layers in training: grouped expert GEMMs, the router's load-balance metrics and aux loss.

transformers' MoE families (Qwen3-MoE, Mixtral, OLMoE, DeepSeek V2/V3, PhiMoE, GPT-OSS, Granite-MoE, Ernie 4.5 and
the rest) train through their own MoE blocks: a router, whatever its attribute's name (``block.gate``,
``block.router``: the class transformers records the family's router logits from), returning its logits, the top-k
weights and the top-k expert ids, and the experts (``block.experts``, fused 3-D ``gate_up_proj`` and ``down_proj``).
``use_grouped_experts`` sets the experts' implementation to transformers' ``grouped_mm`` (transformers 5.17 and 5.24
alike) where the family has it: the (token, expert) pairs are sorted by expert and each projection is one grouped
GEMM (``torch.nn.functional.grouped_mm`` on CUDA in bf16, CPU kernels in fp32), with no Python loop over experts.
Under ``torch.compile`` transformers takes its per-expert loop for weights other than bf16; training on CUDA
computes in bf16 (FSDP's mixed precision), so the compiled layers stay grouped. The router's numerics are
transformers' own: nothing here changes what a router computes.

``RouterRecorder`` hooks every router and, while it records (an update's forward), keeps a reference to each layer's
logits and chosen experts; nothing runs in the hook, so a recomputed (checkpointed) layer stays identical and the
host never waits. ``router_outputs`` turns them, after the forward, into device scalars: the load-balancing loss as
transformers computes it for ``output_router_logits`` (``num_experts`` x sum over experts of the share of top-k
slots and the mean router probability, both pooled over all MoE layers; the slots the top-k of the softmax of what
the routers return, as transformers' ``load_balancing_loss_func`` counts them whichever experts a biased router
chose) over a padded forward of the same sequences (each layer's softmax computed once; where the routers choose
that top-k themselves, Qwen3-MoE's, Mixtral's and OLMoE's, the loss counts the experts they chose instead of ranking
the softmax again): a shared prompt's tokens, run once in a packed row, count once for each of its samples, and
padding not at all (``token_weights``). transformers computes no such loss for DeepSeek V2 and V3, whose configs
never ask for one; with ``actor.router_aux_loss_coef`` set, theirs takes the same form over the experts their groups
and correction bias chose, V3's sigmoid scores normalised per token as its probabilities. A family neither
transformers nor ``models.architectures`` says how to score (``aux_loss_form`` None: GLM-4.5, Llama 4, ...) is
refused an aux loss; one whose routers do not return the experts they chose (Llama 4), or whose experts are not
fused (JetMoE), trains without routing metrics, its start line saying so. Beside the loss: the load imbalance (most
loaded expert's share over the mean share, averaged over layers) and the unused experts (experts no token chose,
averaged over layers), from the chosen experts' slot counts, which add up over micro-batches and ranks.
Dropless routing drops no token.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reinforge.config.schema import DECLARED_ROUTER_AUX_LOSS
from reinforge.models.architectures import architecture_spec, text_config


def recorded_router(model_class: type) -> tuple[type, int] | None:
    """The module class transformers records a family's router logits from (``_can_record_outputs``) and the index
    of the logits in its outputs; None for a family that names none (remote code, a dense model)."""
    recorder = (getattr(model_class, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if not isinstance(target, type) or not issubclass(target, nn.Module):
        return None
    return target, int(getattr(recorder, "index", 0) or 0)


def _router_of(block: nn.Module, router_class: type | None) -> nn.Module | None:
    """The child of a sparse block that routes its tokens: the family's recorded router class (whatever its
    attribute's name: ``gate``, ``router``), else a child called ``gate`` or ``router``."""
    for name, child in block.named_children():
        if name != "experts" and router_class is not None and isinstance(child, router_class):
            return child
    if router_class is None:
        for name in ("gate", "router"):
            child = getattr(block, name, None)
            if isinstance(child, nn.Module):
                return child
    return None


def moe_routers(model: nn.Module, modules: list[nn.Module] | None = None) -> list[tuple[nn.Module, nn.Module]]:
    """(sparse block, its router) of an HF model, in layer order: blocks with fused 3-D expert weights
    (``experts.down_proj``) and a router child. ``modules``: ``model.modules()`` already listed (None: walked here)."""
    recorded = recorded_router(type(model))
    router_class = recorded[0] if recorded is not None else None
    pairs = []
    for module in model.modules() if modules is None else modules:
        weight = getattr(getattr(module, "experts", None), "down_proj", None)
        if not isinstance(weight, Tensor) or weight.dim() != 3:
            continue
        router = _router_of(module, router_class)
        if router is not None:
            pairs.append((module, router))
    return pairs


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MLP blocks of an HF model: modules with a router and fused 3-D expert weights."""
    return [block for block, _ in moe_routers(model)]


def is_moe(model: nn.Module) -> bool:
    return bool(moe_blocks(model))


def _unfused_router_class(model: nn.Module, modules: list[nn.Module]) -> str | None:
    """The router class of a model in which ``moe_blocks`` finds no fused 3-D experts, where it has routers that
    transformers records (an unfused mixture of experts: JetMoE, Doge), else None; ``modules``: ``model.modules()``."""
    recorded = recorded_router(type(model))
    if recorded is None:
        return None
    return recorded[0].__name__ if any(isinstance(module, recorded[0]) for module in modules) else None


def use_grouped_experts(model: nn.Module, blocks: list[nn.Module] | None = None) -> str | None:
    """Run every expert MLP of ``model`` as grouped GEMMs where transformers has grouped_mm for its family; one line
    saying how they run, None for a dense model. ``blocks``: its ``moe_blocks``, already found (None: found here).

    Raises when the installed transformers cannot select experts implementations at all (its loop over experts
    would be the hot path).
    """
    blocks = moe_blocks(model) if blocks is None else blocks
    if not blocks:
        return None
    experts = blocks[0].experts
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        setter = getattr(model, "set_experts_implementation", None)
        if setter is None:
            raise ValueError(f"{type(model).__name__} has mixture-of-experts layers but the installed transformers "
                             "cannot select their grouped_mm implementation; install transformers>=5.17")
        if not getattr(model, "_can_set_experts_implementation", lambda: True)():
            return (f"{len(blocks)} mixture-of-experts layers of {experts.down_proj.shape[0]} experts run as "
                    f"transformers implements {type(experts).__name__} (it has no grouped_mm for them)")
        setter("grouped_mm")
    return (f"{len(blocks)} mixture-of-experts layers of {experts.down_proj.shape[0]} experts run as grouped GEMMs "
            "(transformers' grouped_mm, tokens sorted by expert)")


def without_router_logits_output(model: nn.Module) -> bool:
    """Make ``model``'s forward default to ``output_router_logits=False`` (returns whether it takes that argument).

    A config with ``output_router_logits: true`` makes every transformers forward keep all layers' router
    logits and compute its aux loss against the attention mask, which a packed pass does not have; the
    recorder computes the same loss itself. The config stays as it is, so exported checkpoints keep it.
    """
    import inspect

    forward = model.forward
    if "output_router_logits" not in inspect.signature(forward).parameters:
        return False
    if getattr(forward, "_router_logits_off", False):
        return True

    # the forward's own signature stays visible: generate passes position_ids only to a forward that names them,
    # and without them a left-padded row's positions count its padding (a LongRoPE row switched factors early)
    @functools.wraps(forward)
    def forward_without_router_logits(*args, **kwargs):
        kwargs.setdefault("output_router_logits", False)
        return forward(*args, **kwargs)

    forward_without_router_logits._router_logits_off = True
    model.forward = forward_without_router_logits
    return True


def prepare_moe_training(model: nn.Module) -> tuple[RouterRecorder | None, str | None]:
    """For a MoE model: grouped experts, no router logits in the forward's outputs, and a ``RouterRecorder``
    on its routers, with one line saying what runs; (None, None) for a dense model. Run before compiling.
    A family whose routers do not say which experts they chose trains without a recorder, its line saying so."""
    modules = list(model.modules())  # the one walk of the module tree: every step below reads this list
    pairs = moe_routers(model, modules)
    line = use_grouped_experts(model, [block for block, _ in pairs])
    if line is None:
        unfused = _unfused_router_class(model, modules)
        if unfused is None:
            return None, None
        without_router_logits_output(model)
        return None, (f"{type(model).__name__}'s mixture-of-experts layers (router {unfused}) are not fused 3-D "
                      "experts: they run as transformers implements them, and their routing metrics are not reported")
    without_router_logits_output(model)
    routers = [router for _, router in pairs]
    unrecorded = _unrecorded_reason(model, type(routers[0]))
    if unrecorded is not None:
        return None, f"{line}; routing metrics are not reported: {unrecorded}"
    recorder = RouterRecorder(model, routers)
    if recorder.loss_form is None:
        line += (f"; reinforge does not know how {type(model).__name__}'s routers score experts: moe/aux_loss is "
                 "reported as a softmax router's, and no aux loss can be trained")
    return recorder, line


@dataclass
class RouterOutputs:
    """One forward's router statistics, device scalars (no host sync)."""

    aux_loss: Tensor
    """transformers' load-balancing loss over all MoE layers (with grad when it was asked for)."""
    expert_counts: Tensor
    """(layers, experts) float32: the top-k slots that chose each expert (``token_weights``-weighted). They add up
    over micro-batches and ranks, which ``pooled_routing_metrics`` turns into the whole update's balance."""

    @property
    def load_imbalance(self) -> Tensor:
        """The most loaded expert's share of top-k slots over the mean share, averaged over layers (1: balanced)."""
        return routing_balance(self.expert_counts)[0]

    @property
    def unused_experts(self) -> Tensor:
        """Experts no token chose, averaged over layers."""
        return routing_balance(self.expert_counts)[1]


RECORD_ATTRIBUTE = "reinforge_routing"
"""The router attribute a recording hook stores its (logits, expert ids) in."""


def _text_config_of(model: nn.Module):
    config = getattr(model, "config", None)
    return text_config(config) if config is not None else None


def aux_loss_form(model_class: type | None, model_config) -> str | None:
    """How reinforge computes a family's load-balancing loss exactly: "transformers" (its causal LM's forward adds
    transformers' ``load_balancing_loss_func``: the softmax of the recorded router output and its own top-k of it),
    "softmax" or "sigmoid" (``models.architectures`` knows its router; transformers computes none: the experts the
    router chose, scored so), or None (neither: the loss cannot be computed as the family's)."""
    import inspect
    import sys

    if model_class is not None:
        recorded = recorded_router(model_class)
        loss_func = getattr(sys.modules.get(model_class.__module__), "load_balancing_loss_func", None)
        try:
            calls_loss = "load_balancing_loss_func(" in inspect.getsource(model_class.forward)
        except (OSError, TypeError):
            calls_loss = False
        if (calls_loss and recorded is not None and recorded[1] == 0 and callable(loss_func)
                and list(inspect.signature(loss_func).parameters) == ["gate_logits", "num_experts", "top_k",
                                                                     "attention_mask"]):
            return "transformers"
    spec = architecture_spec(text_config(model_config)) if model_config is not None else None
    return spec.moe.scoring if spec is not None and spec.moe is not None else None


def trained_loss_form(model: nn.Module) -> str | None:
    """``aux_loss_form`` of a loaded model: its own class's, or where that class computes no loss (a reward model's
    sequence classifier) its config's causal LM's, whose loss ``router_aux_loss_coef`` lets the run train."""
    config = getattr(model, "config", None)
    form = aux_loss_form(type(model), config)
    language_model = causal_lm_class(config) if form != "transformers" and config is not None else None
    if language_model is not None and language_model is not type(model) \
            and aux_loss_form(language_model, config) == "transformers":
        return "transformers"
    return form


def causal_lm_class(model_config) -> type | None:
    """The transformers class ``AutoModelForCausalLM`` builds for ``model_config``; None where it knows none."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(model_config)]
    except (KeyError, ValueError):
        return None


def _routers_choose_loss_slots(model: nn.Module, routers: list[nn.Module]) -> bool:
    """Whether ``routers`` choose the top-k of the softmax of their logits that transformers' loss counts, so the
    loss can count their chosen experts: transformers' own routers of a family ``models.architectures`` knows to
    route so (softmax scores, no expert groups, no correction bias), with the loss's top-k.

    In float32 the two are the same experts. In bf16 the routers rank the float32 softmax of their bf16 logits,
    where transformers' loss ranks the softmax rounded to bf16, which can tie experts the router told apart: the
    loss then counts the experts the tokens were sent to."""
    spec = architecture_spec(_text_config_of(model))
    routing = spec.moe if spec is not None else None
    return (routing is not None and routing.scoring == "softmax" and routing.n_group is None
            and not routing.correction_bias and routing.top_k == _top_k(model)
            and all(type(router).__module__.startswith("transformers.") for router in routers))


def _top_k(model: nn.Module) -> int:
    """The top-k transformers' loss reads: the causal LM's ``num_experts_per_tok``, else its config's."""
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(_text_config_of(model), "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise ValueError(f"{type(model).__name__} has no num_experts_per_tok; its load-balancing loss has no top-k")
    return top_k


def _unrecorded_reason(model: nn.Module, router_class: type) -> str | None:
    """Why ``model``'s routers (of ``router_class``) cannot be recorded: transformers records their logits elsewhere
    than their first output, or their forward does not return (logits, weights, chosen expert ids), read from its
    source; None when they can."""
    import ast
    import inspect
    import textwrap

    recorded = recorded_router(type(model))
    if recorded is not None and recorded[1] != 0:
        return f"transformers records its router logits from output {recorded[1]} of {recorded[0].__name__}"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(router_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return f"the source of {router_class.__name__}.forward cannot be read"
    returned = [node.value for node in ast.walk(tree) if isinstance(node, ast.Return)]
    if returned and all(isinstance(value, ast.Tuple) and len(value.elts) >= 3 for value in returned):
        return None
    return f"{router_class.__name__} does not return (logits, weights, chosen expert ids)"


class RouterRecorder:
    """Forward hooks on the routers of ``model``'s MoE blocks (``routers``: those ``moe_routers`` found, None: found
    here); they keep references while ``recording()``.

    Register before ``torch.compile`` wraps the decoder layers, so the compiled graphs contain the hooks. Each hook
    stores its router's outputs on the router itself (``RECORD_ATTRIBUTE``), not in a list they all append to: the
    compiled layers would guard on that list, whose length and items differ from one layer to the next, and compile
    once per layer (a 48-layer model: 48 compiles of each of its layer graphs).
    """

    def __init__(self, model: nn.Module, routers: list[nn.Module] | None = None):
        self.routers = [router for _, router in moe_routers(model)] if routers is None else routers
        self.loss_form = trained_loss_form(model)
        self.scoring = self.loss_form if self.loss_form == "sigmoid" else "softmax"
        self.loss_top_k = (_top_k(model) if self.loss_form == "transformers"
                           and not _routers_choose_loss_slots(model, self.routers) else None)
        """transformers' loss counts the top-k of the softmax of its router outputs, whichever experts they chose;
        None: the chosen experts are those (or the family's loss counts the chosen ones)."""
        self.recording = False
        for router in self.routers:
            setattr(router, RECORD_ATTRIBUTE, None)
        self.handles = [router.register_forward_hook(self._keep) for router in self.routers]

    @classmethod
    def attach(cls, model: nn.Module) -> RouterRecorder | None:
        """A recorder on ``model``'s routers, or None for a dense model."""
        routers = [router for _, router in moe_routers(model)]
        return cls(model, routers) if routers else None

    def _keep(self, module: nn.Module, args, output) -> None:
        if self.recording and isinstance(output, tuple) and len(output) >= 3:
            # (tokens, experts) logits, (tokens, top_k) expert ids
            setattr(module, RECORD_ATTRIBUTE, (output[0], output[2]))

    @contextlib.contextmanager
    def recording_forward(self) -> Iterator[None]:
        """Record the routers of the forwards run inside (not their recomputation in the backward)."""
        self._forget()
        self.recording = True
        try:
            yield
        finally:
            self.recording = False

    def _forget(self) -> list[tuple[Tensor, Tensor]]:
        """What the routers recorded, in layer order, each record dropped."""
        captured = [getattr(router, RECORD_ATTRIBUTE, None) for router in self.routers]
        for router in self.routers:
            setattr(router, RECORD_ATTRIBUTE, None)
        return [record for record in captured if record is not None]

    def take(self, with_grad: bool, token_weights: Tensor | None = None) -> RouterOutputs | None:
        """The statistics of what was recorded (then forgotten); None when no router ran. ``token_weights``: how
        many tokens each routed token stands for (``engine.forward.routed_token_weights``); None: 1 each."""
        captured = self._forget()
        if not captured:
            return None
        return router_outputs([logits for logits, _ in captured], [ids for _, ids in captured], with_grad,
                              token_weights, self.scoring, self.loss_top_k)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def expert_counts(expert_ids: Tensor, num_experts: int, token_weights: Tensor | None = None) -> Tensor:
    """(num_experts,) float32: top-k slots that chose each expert, each token's slots counted ``token_weights``
    times (None: once); ``expert_ids`` (tokens, top_k)."""
    flat = expert_ids.reshape(-1).long()
    counted = (torch.ones_like(flat, dtype=torch.float32) if token_weights is None
               else token_weights.float()[:, None].expand(expert_ids.shape).reshape(-1))
    return torch.zeros(num_experts, dtype=torch.float32, device=flat.device).scatter_add_(0, flat, counted)


def _checked_weights(token_weights: Tensor | None, rows: int) -> Tensor | None:
    if token_weights is not None and token_weights.shape[0] != rows:
        raise ValueError(f"a router saw {rows} tokens but the forward's token weights count {token_weights.shape[0]}; "
                         "its MoE block routes other tokens than the forward's inputs, which the load-balance "
                         "statistics cannot weigh")
    return token_weights


def router_probabilities(logits: Tensor, scoring: str = "softmax") -> Tensor:
    """Each token's probability over the experts: a softmax router's softmax; a sigmoid router's (DeepSeek V3)
    sigmoid scores normalised to sum to 1, the affinities its paper's balance loss reads."""
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
        return scores / scores.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    return torch.softmax(logits, dim=-1)


def load_balancing_loss(router_logits: list[Tensor], top_k: int, token_weights: Tensor | None = None,
                        scoring: str = "softmax") -> Tensor:
    """transformers' ``load_balancing_loss_func`` over the layers' (tokens, experts) logits, each router choosing the
    top-k of its probabilities (what a softmax router without groups or a correction bias chooses); see
    ``_balancing_loss``."""
    return _balancing_loss(router_logits, None, token_weights, scoring, top_k)


def _balancing_loss(router_logits: list[Tensor], slots: Tensor | None, token_weights: Tensor | None, scoring: str,
                    top_k: int | None = None) -> Tensor:
    """num_experts x sum_e (top-k slots of expert e / tokens) x (router probability of e summed / tokens), pooled
    over the layers, each token counted ``token_weights`` times (transformers' attention mask is such a weight, 0 or
    1; None: once each); ``slots``: (experts,) the layers' slot counts, weighted alike, or None: the ``top_k`` of
    each layer's probabilities, ranked in the softmax that the sums read; ``scoring``: ``router_probabilities``'s."""
    num_experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    counted = torch.zeros(num_experts, dtype=torch.float32, device=device) if slots is None else slots
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        routing = router_probabilities(logits, scoring)
        if slots is None:
            counted = counted + expert_counts(torch.topk(routing, top_k, dim=-1).indices, num_experts,
                                              _checked_weights(token_weights, logits.shape[0]))
        routing = routing.float()
        if token_weights is None:
            probs = probs + routing.sum(dim=0)
            rows = rows + logits.shape[0]
        else:
            probs = probs + (routing * token_weights.float()[:, None]).sum(dim=0)
            rows = rows + token_weights.float().sum()
    rows = rows.clamp(min=1e-9)
    return num_experts * torch.sum((counted / rows) * (probs / rows))


def router_outputs(router_logits: list[Tensor], expert_ids: list[Tensor], with_grad: bool,
                   token_weights: Tensor | None = None, scoring: str = "softmax",
                   loss_top_k: int | None = None) -> RouterOutputs:
    """Aux loss and slot counts of one forward's MoE layers (``RouterOutputs``), over the experts the routers chose
    (DeepSeek's groups and correction bias included), each token counted ``token_weights`` times (None: once).
    ``loss_top_k``: the loss counts the top-k of each layer's router probabilities instead, as transformers' does."""
    num_experts = router_logits[0].shape[-1]
    counts = torch.stack([expert_counts(ids, num_experts, _checked_weights(token_weights, ids.shape[0]))
                          for ids in expert_ids])  # (layers, experts)
    logits = router_logits if with_grad else [tensor.detach() for tensor in router_logits]
    aux_loss = (_balancing_loss(logits, counts.sum(dim=0), token_weights, scoring) if loss_top_k is None
                else load_balancing_loss(logits, loss_top_k, token_weights, scoring))
    return RouterOutputs(aux_loss=aux_loss, expert_counts=counts)


def routing_balance(counts: Tensor) -> tuple[Tensor, Tensor]:
    """(load imbalance, unused experts) of (layers, experts) slot counts, each averaged over layers."""
    mean = counts.sum(dim=1) / counts.shape[1]
    imbalance = (counts.max(dim=1).values / mean.clamp(min=1e-9)).mean()
    unused = (counts == 0).float().sum(dim=1).mean()
    return imbalance, unused


def pooled_routing_metrics(counts: Tensor, role: str) -> dict[str, float]:
    """``<role>/moe/load_imbalance`` and ``<role>/moe/unused_experts`` of an update's summed slot counts, summed
    over the data-parallel ranks as well (collective): the routing of the whole batch, which does not change with
    the number of ranks or the micro-batch budget as the mean of per-micro-batch values does."""
    import torch.distributed as dist

    from reinforge.engine.distributed import world_size

    counts = counts.detach().float()
    if world_size() > 1:
        device = counts.device if dist.get_backend() != "nccl" else torch.device("cuda", torch.cuda.current_device())
        summed = counts.to(device)
        dist.all_reduce(summed)
        counts = summed.to(counts.device)
    imbalance, unused = routing_balance(counts)
    return {f"{role}/moe/load_imbalance": float(imbalance), f"{role}/moe/unused_experts": float(unused)}


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config attributes that count a mixture of experts' experts (a config of remote code may declare no
output_router_logits)."""


def declares_experts(model_config) -> bool:
    """Whether ``model_config`` (a transformers config) is a mixture of experts': its text config has an
    ``output_router_logits`` attribute (whatever its value; TRL's test), or counts more than one expert."""
    text = text_config(model_config)
    if hasattr(text, "output_router_logits"):
        return True
    return any(isinstance(getattr(text, name, None), int) and getattr(text, name) > 1
               for name in EXPERT_COUNTS)


def routed_layers(model_config) -> int | None:
    """How many decoder layers of ``model_config`` route to experts, by the rules transformers builds them with
    (``mlp_only_layers`` and ``decoder_sparse_step``; ``first_k_dense_replace`` and ``moe_layer_freq``); None where
    the config says neither (every layer of such a family is a mixture of experts)."""
    text = text_config(model_config)
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return None
    step, dense = getattr(text, "decoder_sparse_step", None), getattr(text, "mlp_only_layers", None)
    if isinstance(step, int) or isinstance(dense, list | tuple):
        step = step if isinstance(step, int) and step > 0 else 1
        dense = set(dense) if isinstance(dense, list | tuple) else set()
        return sum(1 for layer in range(layers) if layer not in dense and (layer + 1) % step == 0)
    first = getattr(text, "first_k_dense_replace", None)
    if isinstance(first, int):
        frequency = getattr(text, "moe_layer_freq", 1)
        frequency = frequency if isinstance(frequency, int) and frequency > 0 else 1
        return sum(1 for layer in range(first, layers) if layer % frequency == 0)
    return None


ALL_DENSE = ("layers are all dense (no layer routes to experts: see mlp_only_layers, decoder_sparse_step or "
             "first_k_dense_replace in its config.json)")


def _declared_coef(text) -> float:
    """The aux loss weight a model config declares: ``router_aux_loss_coef``, or JetMoE's ``aux_loss_coef``."""
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        value = getattr(text, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _coef_source(key: str, configured: float | str | None, coef: float) -> str:
    """Where an aux loss weight ``coef`` came from, for an error: the run's ``key`` set to a number, else the model
    config's weight that its value (null or declared) took."""
    if isinstance(configured, int | float):
        return f"{key}={configured}"
    return f"the model config's router_aux_loss_coef={coef} ({key}={configured})"


def trained_aux_loss_coef(model: nn.Module, recorder: RouterRecorder | None, configured: float | str | None,
                          key: str) -> float:
    """``router_aux_loss_coef`` for a loaded model whose routers ``prepare_moe_training`` recorded (``recorder``):
    a weight above 0 that no recorder can apply (a mixture of experts whose routers are not recorded, its start line
    says why) is refused in one line rather than trained as 0."""
    coef = router_aux_loss_coef(model.config, configured, key)
    if coef > 0 and recorder is None:
        modules = list(model.modules())
        why = ("routers are not recorded (see the line above)" if moe_routers(model, modules)
               or _unfused_router_class(model, modules) is not None
               else ALL_DENSE)
        raise ValueError(f"{_coef_source(key, configured, coef)} asks for a load-balancing loss, but "
                         f"{type(model).__name__}'s {why}, so none would be added; set {key}=0 to train without one")
    return coef


def router_aux_loss_coef(model_config, configured: float | str | None, key: str = "router_aux_loss_coef") -> float:
    """The aux loss's weight: the run's own (``actor.router_aux_loss_coef``, the SFT, rm and dpo
    ``trainer.router_aux_loss_coef``) when it is a number; ``declared`` (TRL's rule): the model config's
    ``router_aux_loss_coef`` for a mixture of experts whatever its ``output_router_logits``, 0 where it declares none;
    None (reinforge's rule): the model config's ``router_aux_loss_coef`` when its ``output_router_logits`` is true,
    else 0. A vision-language model's are its text config's, where transformers reads them.

    Raises for a weight above 0 on a transformers family whose loss reinforge cannot compute as the family's
    (``aux_loss_form``); ``key`` names the run's setting in that error."""
    text = text_config(model_config)
    if configured == DECLARED_ROUTER_AUX_LOSS:
        coef = _declared_coef(text) if declares_experts(model_config) else 0.0
    elif configured is not None:
        coef = float(configured)
    elif getattr(text, "output_router_logits", False):
        coef = _declared_coef(text)
    else:
        coef = 0.0
    model_class = causal_lm_class(model_config) if coef > 0 else None
    if model_class is not None and aux_loss_form(model_class, model_config) is None:
        raise ValueError(f"{_coef_source(key, configured, coef)} asks for a load-balancing loss, but reinforge cannot "
                         f"compute {model_class.__name__}'s as its routers score experts; set {key}=0 to train it "
                         "without one")
    return coef
