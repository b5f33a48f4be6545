"""FSDP2 for every trained or frozen model: sharding, mixed precision, offload, clipping, state.

Each decoder layer is one ``fully_shard`` unit (all-gathered just before its forward and
backward, freed after), and the module that owns the embeddings and the head is the root unit.
The same code runs on one device (a process group of one: sharding is then a no-op copy) and
on N. Master weights, gradients after reduction and optimizer state are float32; on CUDA the
forward and backward compute in bfloat16 (``MixedPrecisionPolicy``), except the parameters
transformers keeps in float32 in a bfloat16 model (DeepSeek's routers): each module holding them
is a unit of its own, gathered in float32, so the training forward picks the experts transformers
and the native engine pick. With ``offload`` the sharded parameters, their gradients and the
optimizer step live on the CPU and each layer's parameters are copied to the device for its
forward, which is how the reference policy is "streamed in per layer".
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from reinforge.engine.device import compute_dtype
from reinforge.engine.distributed import init_distributed
from reinforge.engine.memory_plan import shard_aligned
from reinforge.engine.offload import HostOffloadedAdamW
from reinforge.models.loading import float32_parameter_names

logger = logging.getLogger(__name__)

LAYER_LIST_NAMES = ("layers", "h", "blocks", "block", "layer")
"""What transformers' families call their decoder blocks (Llama's ``layers``, GPT-2's ``h``, MPT's ``blocks``)."""


VISION_PARTS = ("vision", "visual", "image")
"""Parts of a module path that name an image tower (``git.image_encoder.vision_model.encoder.layers``)."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF model: the first ModuleList named by the first name of ``LAYER_LIST_NAMES``
    any of its lists has, else the ModuleList of blocks of one class holding the most parameters."""
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) > 0]
    # a vision-language model's tower may name its blocks ``layers`` too, and come first (Gemma 3's SigLIP encoder,
    # model.vision_tower.encoder.layers, before model.language_model.layers): prefer the lists of the language model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if isinstance(decoder, nn.Module) and decoder is not model:
        inside = {id(module) for module in decoder.modules()}
        lists = [item for item in lists if id(item[1]) in inside] or lists
    # and where the decoder holds a tower too (GIT's image encoder beside its text layers): the lists outside it
    text = [item for item in lists if not any(part in segment for segment in item[0].split(".")
                                              for part in VISION_PARTS)]
    lists = text or lists
    for wanted in LAYER_LIST_NAMES:  # in this order: a vision-language model's language layers before its tower's blocks
        for name, module in lists:
            if name.rsplit(".", 1)[-1] == wanted:
                return list(module)
    uniform = [module for _, module in lists if len({type(block) for block in module}) == 1]
    if uniform:
        return list(max(uniform, key=lambda module: sum(p.numel() for p in module.parameters())))
    raise ValueError(f"{type(model).__name__} has no ModuleList of decoder blocks (named "
                     f"{', '.join(LAYER_LIST_NAMES)} or otherwise); the engine shards one decoder layer per FSDP "
                     "unit and cannot find them")


def shard_model(model: nn.Module, device: torch.device, dtype_name: str = "auto", offload: bool = False,
                roots: Iterable[nn.Module] | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Apply FSDP2 in place: one unit per decoder layer, then each of ``roots`` (default: the model).

    Parameters must be float32 (the master weights), or the compute dtype where frozen. In a compute dtype other
    than float32, each module whose parameters transformers keeps in float32 (``float32_units``) is a unit of its own,
    gathered in float32 around its layer's forward (``gather_around``) and fed its inputs as they come.
    ``reshard_after_forward=False`` keeps each decoder layer's gathered parameters from its forward to its backward,
    which then gathers nothing again (the whole model's compute-dtype copy is held meanwhile). Returns ``model``.
    """
    init_distributed(device_type=device.type)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = compute_dtype(device, dtype_name)
    mp_policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                 if dtype != torch.float32 else MixedPrecisionPolicy())
    # Offloaded shards are pinned by pin_offloaded_shards below, at their exact size, not by FSDP.
    offload_policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    pin = register_host_memory if offload and device.type == "cuda" else None
    # a parameter without values (DeepSeek's shared MLP of width 0, n_shared_experts: 0) stays outside FSDP, which
    # gathers a (hidden, 0) weight as (0, 0) and refuses to reduce an empty gradient: frozen, in the compute dtype
    empty = {parameter for parameter in model.parameters() if not parameter.numel()}
    for parameter in empty:
        parameter.requires_grad_(False)
        parameter.data = parameter.data.to(device, dtype)
    # a router transformers keeps in float32 computes its logits from its float32 weight; gathered in bfloat16
    # with its layer, the rounded weight sent tokens to other experts than the model transformers loads picks
    float32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                          cast_forward_inputs=False)
    kept_units = float32_units(model, dtype, empty) if dtype != torch.float32 else []
    layers = decoder_layers(model)
    for unit in [*kept_units, *layer_units(layers)]:
        fully_shard(unit, mesh=mesh, mp_policy=float32_policy if unit in kept_units else mp_policy,
                    offload_policy=offload_policy, reshard_after_forward=reshard_after_forward, ignored_params=empty)
        if pin is not None:
            pin_offloaded_shards(unit[0] if isinstance(unit, list) else unit, pin)
        if unit in kept_units:
            layer = next((layer for layer in layers if any(module is unit for module in layer.modules())), None)
            if layer is not None:
                gather_around(unit, layer)
    for layer in layers:
        layer.reinforge_compute_dtype = dtype
    for root in list(roots) if roots is not None else [model]:
        fully_shard(root, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy, ignored_params=empty)
        if pin is not None:
            pin_offloaded_shards(root, pin)
    return model


def layer_units(layers: list[nn.Module]) -> list[nn.Module | list[nn.Module]]:
    """The decoder layers as FSDP units: each layer alone, but layers that hold the same parameter (Zamba's one
    attention block, shared by every hybrid layer) together, as one unit of a list (FSDP refuses a parameter in two
    units); in the order of each unit's first layer."""
    parent = list(range(len(layers)))

    def root(index: int) -> int:
        while parent[index] != index:
            index = parent[index]
        return index

    holder: dict[int, int] = {}  # id(parameter) -> the first layer holding it
    for index, layer in enumerate(layers):
        for parameter in layer.parameters():
            parent[root(index)] = root(holder.setdefault(id(parameter), index))
    units: dict[int, list[nn.Module]] = {}
    for index, layer in enumerate(layers):
        units.setdefault(root(index), []).append(layer)
    return [unit[0] if len(unit) == 1 else unit for unit in units.values()]


def float32_units(model: nn.Module, dtype: torch.dtype, skipped: Iterable[nn.Parameter] = ()) -> list[nn.Module]:
    """The largest modules of ``model`` whose parameters (but ``skipped``) are all ones transformers keeps in float32
    when it loads the model in ``dtype`` (``float32_parameter_names``): DeepSeek V2/V3's router modules, and in float16
    gpt-oss's norms. A kept parameter beside others in its module (none in the families reinforge trains fast)
    computes in its unit's dtype, and one line says so."""
    kept = float32_parameter_names(model, dtype)
    if not kept:
        return []
    skipped_ids = {id(parameter) for parameter in skipped}
    units: list[nn.Module] = []
    covered: set[str] = set()
    for prefix, module in model.named_modules():
        if module is model or any(prefix.startswith(f"{outer}.") for outer in covered):
            continue
        named = [(f"{prefix}.{name}", parameter) for name, parameter in module.named_parameters()
                 if id(parameter) not in skipped_ids]
        if named and all(name in kept for name, _ in named):
            units.append(module)
            covered.add(prefix)
    alone = sorted(name for name in kept if not any(name.startswith(f"{outer}.") for outer in covered))
    if alone:
        logger.warning("%s keeps %s in float32 but its module holds other parameters; it computes in the "
                       "compute dtype of its layer", type(model).__name__, ", ".join(alone[:3]))
    return units


def gather_around(unit: FSDPModule, outer: nn.Module) -> None:
    """Run ``unit``'s FSDP forward hooks around ``outer``'s forward instead of its own; call it before
    ``fully_shard(outer)``, whose hooks then run outside them.

    ``unit`` (a float32 router inside a decoder layer) is then gathered for the whole of ``outer``'s forward and
    backward, as ``outer``'s own parameters are, and a compiled ``outer.forward`` (``fused.compile_decoder_layers``)
    meets no FSDP hook, which dynamo cannot trace: each would split the layer's graph in three. Where FSDP keeps no
    handles of its hooks (another torch version), they stay where they are: the same numbers, the graph split.
    """
    state = unit._get_fsdp_state()
    if not all(hasattr(state, name) for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle")):
        return
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    state._pre_forward_hook_handle = outer.register_forward_pre_hook(state._pre_forward, prepend=True,
                                                                     with_kwargs=True)
    state._post_forward_hook_handle = outer.register_forward_hook(state._post_forward, prepend=False)


def _param_groups(unit: nn.Module) -> list:
    """The FSDPParamGroups of one ``fully_shard`` unit (torch 2.11 keeps one group, later versions a list)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def fsdp_params(unit: nn.Module) -> list:
    """The FSDPParam records of one ``fully_shard`` unit."""
    return [param for group in _param_groups(unit) for param in group.fsdp_params]


def reshards_after_forward(unit: FSDPModule) -> bool:
    """Whether ``unit`` frees its gathered parameters after its forward."""
    return any(group.post_forward_mesh_info is not None for group in _param_groups(unit))


def reduce_gradients_now(units: Iterable[FSDPModule], now: bool) -> None:
    """Each unit reduces its gradients and frees its gathered parameters after its next backward (``now``), or
    keeps both: the unreduced gradients accumulate (in FSDP's reduce dtype) until a backward that reduces."""
    for unit in units:
        unit.set_requires_gradient_sync(now, recurse=False)
        unit.set_reshard_after_backward(now, recurse=False)


@contextlib.contextmanager
def kept_gathered(model: nn.Module) -> Iterator[list[FSDPModule]]:
    """Inside the block no unit of ``model`` frees its gathered parameters after its forward; the caller says with
    ``reduce_gradients_now`` which backward reduces. On leaving, every unit resumes its own setting, reduces after
    each backward and frees what it still holds. Yields the units."""
    units = fsdp_units(model)
    # the decoder layers and the units inside them (a float32 router) only: a root unit keeps its parameters after
    # its forward (the head's weight is read after it) from FSDP's lazy initialisation on, which may not have run yet
    in_layers = {id(module) for layer in decoder_layers(model) for module in layer.modules()}
    resharding = [unit for unit in units if id(unit) in in_layers and reshards_after_forward(unit)]
    for unit in resharding:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield units
    finally:
        for unit in resharding:
            unit.set_reshard_after_forward(True, recurse=False)
        reduce_gradients_now(units, True)
        for unit in units:
            unit.reshard()


def pin_offloaded_shards(unit: nn.Module, register: Callable[[Tensor], bool]) -> int:
    """Move a unit's offloaded shards into one page-locked host buffer of their exact size; returns its bytes.

    FSDP's own pinning goes through PyTorch's caching host allocator, which rounds every shard up to
    a power of two: Qwen2.5-7B's 14.2 GiB of bf16 shards took 27.0 GiB of host memory. Here the
    shards are copied into one anonymous mapping per unit (each at a ``SHARD_ALIGN``-byte offset),
    ``register`` page-locks it (``cudaHostRegister``), and each FSDPParam's flat data and local
    tensor become views of it, so FSDP copies them to and from the device asynchronously as it does
    pinned shards. If ``register`` fails, FSDP pins them its own way at its first forward.
    """
    params = [param for param in fsdp_params(unit)
              if param.offload_to_cpu and param._sharded_param_data.numel() > 0]
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        data = param._sharded_param_data
        total += shard_aligned(data.numel() * data.element_size())
    if not total:
        return 0
    # A shared anonymous mapping (Python's default for mmap(-1, n)): a process forked later (reward workers)
    # shares its pages instead of marking them copy-on-write, so the next write here cannot move a page
    # away from the physical address the device copies from.
    buffer = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8)
    if not register(buffer):
        for param in params:  # FSDP's lazy initialisation pins what is not pinned yet
            param.pin_memory = True
        return 0
    for param, offset in zip(params, offsets, strict=True):
        data = param._sharded_param_data
        flat = buffer[offset:offset + data.numel() * data.element_size()].view(data.dtype)
        flat.copy_(data)
        param._sharded_param_data = flat
        local = param.sharded_param._local_tensor
        dim = param.fsdp_placement.dim
        param.sharded_param._local_tensor = flat.view(param.padded_sharded_param_size).narrow(dim, 0, local.size(dim))
        param.pin_memory = True
    unit.reinforge_pinned_shards = buffer  # alive as long as the unit; unregistered when it goes
    return total


def register_host_memory(buffer: Tensor) -> bool:
    """Page-lock ``buffer``'s memory for asynchronous copies (``cudaHostRegister``) until it is freed."""
    cudart = torch.cuda.cudart()
    pointer, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if cudart.cudaHostRegister(pointer, size, 0) != cudart.cudaError.success:
        return False
    weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)
    return True


def layer_compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the decoder layers compute in: FSDP's parameter dtype if sharded, else their weights'."""
    layer = decoder_layers(model)[0]
    dtype = getattr(layer, "reinforge_compute_dtype", None)
    return dtype if dtype is not None else next(layer.parameters()).dtype


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Every unit's full parameters (in the compute dtype) stay gathered inside the block.

    The rollout engine reads the modules directly, outside FSDP's hooks, so it needs this.
    """
    units = fsdp_units(model)
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter (the root unit keeps its own gathered after a forward)."""
    for unit in fsdp_units(model):
        unit.reshard()


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Clip the global L2 norm of the gradients to ``max_norm``; returns the norm before clipping.

    Sharded gradients (DTensor) contribute the squares of their local shard, summed over the
    ranks; replicated gradients count once.
    """
    sharded, replicated, group = [], [], None
    for parameter in parameters:
        grad = parameter.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            sharded.append(grad.to_local())
            group = grad.device_mesh.get_group()
        else:
            replicated.append(grad)
    local = sharded + replicated
    if not local:
        return torch.tensor(0.0)
    device = local[0].device
    sharded_square = _sum_of_squares(sharded, device)
    if group is not None and dist.get_world_size(group) > 1:
        reduce_device = device if dist.get_backend(group) != "nccl" else torch.device("cuda", torch.cuda.current_device())
        sharded_square = sharded_square.to(reduce_device)
        dist.all_reduce(sharded_square, group=group)
        sharded_square = sharded_square.to(device)
    total_norm = (sharded_square + _sum_of_squares(replicated, device)).sqrt()
    # a norm that is not finite leaves the gradients as they are (times 1), read on the device: no wait for it
    clip_coef = torch.where(torch.isfinite(total_norm), (max_norm / (total_norm + 1e-6)).clamp(max=1.0), 1.0)
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in local:
        by_device.setdefault(grad.device, []).append(grad)
    for device_grads in by_device.values():
        torch._foreach_mul_(device_grads, clip_coef.to(device_grads[0].device))
    return total_norm


def _sum_of_squares(tensors: list[Tensor], device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    for device_tensors in by_device.values():
        norms = torch._foreach_norm(device_tensors)
        total = total + torch.stack(norms).float().square().sum().to(device)
    return total


# ---- state: full (unsharded) tensors on the CPU, gathered collectively -----------------------------

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_TRAINED = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's float32 state dict on the CPU. Collective: every rank must call it."""
    reshard(model)
    return get_model_state_dict(model, options=_FULL)


def full_training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """Trained parameters and optimizer state as full tensors on the CPU. Collective.

    Frozen parameters (a LoRA actor's base) are left out: they are the model's starting weights,
    which a resumed run loads again.

    With an offloaded optimizer the trained parameters come from its host master copy (in a
    group of one, the buffers themselves: saving a 7B model then needs no second host copy; write
    the state before the next step changes them).
    """
    if isinstance(optimizer, HostOffloadedAdamW):
        return {"model": full_trained_state(model, optimizer), "optimizer": optimizer.full_state_dict()}
    return {"model": full_trained_state(model, optimizer),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=_FULL)}


def full_trained_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The model part of ``full_training_state``. Collective."""
    reshard(model)
    # by name, not by parameter: a tied head (lm_head.weight) is a second name of a frozen embedding
    trained = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()
               if not (isinstance(tensor, nn.Parameter) and not tensor.requires_grad)}
    if isinstance(optimizer, HostOffloadedAdamW):
        masters = optimizer.full_master_state()
        return {name: masters[id(tensor)] if id(tensor) in masters else _full_on_cpu(tensor)
                for name, tensor in trained.items()}
    model_state = get_model_state_dict(model, options=_TRAINED)
    return {name: tensor for name, tensor in model_state.items() if name in trained}


def _full_on_cpu(tensor: Tensor) -> Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu()


def load_full_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
    """Inverse of ``full_training_state``; every rank passes the same full state. Collective."""
    frozen = {name for name, tensor in model.state_dict(keep_vars=True).items()
              if isinstance(tensor, nn.Parameter) and not tensor.requires_grad}
    reshard(model)
    keys = set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True,
                                                                                 strict=not frozen))
    missing = sorted(set(keys.missing_keys) - frozen)
    if missing or keys.unexpected_keys:
        raise ValueError(f"the saved model state does not fit this model: missing {missing[:3]}, unexpected "
                         f"{sorted(keys.unexpected_keys)[:3]}; was it written with another model or model.lora?")
    if isinstance(optimizer, HostOffloadedAdamW):
        optimizer.pull_parameters()
        if "optimizer" in state:
            optimizer.load_full_state_dict(state["optimizer"])
    elif optimizer is not None and "optimizer" in state:
        # not strict: a trained parameter that no step has given a gradient yet (BART's cross-attention in a causal LM,
        # an expert no token was routed to) has no optimizer state to save; the model state was checked above
        set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True, strict=False))
