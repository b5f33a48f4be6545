"""Optimizer offload: AdamW whose state and step live in host memory (``actor.optimizer_offload``).

The parameters and their gradients stay on the device (FSDP shards, float32); only the float32
master copy the step writes and the two AdamW moments (12 bytes per parameter) live on the host.
A step walks the parameters in buckets of ``bucket_numel`` elements:

1. the bucket's device gradients are copied into a pinned host staging buffer (non-blocking; two
   buffers alternate, so the copy of bucket i + 1 overlaps the step of bucket i);
2. PyTorch's fused AdamW updates the bucket's host master copy with them on the CPU;
3. the updated master values are copied back into the device parameters (non-blocking, from
   pinned memory; the stream orders them before the next forward and the next step's copies).

The host master copy starts equal to the device parameters and only this optimizer writes either
(``pull_parameters`` re-reads the device after a checkpoint is loaded into the model), so the
update equals ``torch.optim.AdamW`` on the device up to the CPU kernel's rounding. On a CPU run
the "device" and the host are the same memory; the copies still run, so the path is exercised.

Pinned buffers are allocated in power-of-two sizes, which is what PyTorch's pinned-memory
allocator rounds every request up to: the bucket buffers waste nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
DEFAULT_BUCKET_NUMEL = 1 << 26
"""64 Mi float32 elements (256 MiB) per bucket: large enough for the CPU kernel, small enough to pipeline."""


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host_buffer(numel: int, pin: bool) -> Tensor:
    return torch.empty(numel, dtype=torch.float32, pin_memory=pin)


class _Bucket:
    """Consecutive parameters whose host master copies are views of one flat host buffer."""

    def __init__(self, indices: list[int], locals_: list[Tensor], pin: bool, config: dict):
        self.indices = indices
        sizes = [t.numel() for t in locals_]
        self.numel = sum(sizes)
        capacity = 1 << max(self.numel - 1, 1).bit_length() if pin else self.numel
        self.flat = _host_buffer(capacity, pin)
        self.masters = [view.view_as(t) for view, t in zip(self.flat[:self.numel].split(sizes), locals_, strict=True)]
        for master, local in zip(self.masters, locals_, strict=True):
            master.copy_(local.detach())
        self.optimizer = torch.optim.AdamW(self.masters, fused=True, **config)


class HostOffloadedAdamW(torch.optim.Optimizer):
    """AdamW over ``named_parameters`` (name, device parameter) with state and step on the host.

    Its one param group holds the device parameters, so schedulers, ``zero_grad`` and gradient
    clipping work on it as on any optimizer. Save and load its state with ``full_state_dict`` and
    ``load_full_state_dict`` (the format of ``torch.distributed.checkpoint``'s full optimizer state,
    so a checkpoint moves between offloaded and on-device runs).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        named = list(named_parameters)
        self.names = [name for name, _ in named]
        parameters = [parameter for _, parameter in named]
        config = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(parameters, dict(config))
        locals_ = [_local(parameter) for parameter in parameters]
        self.device = locals_[0].device if locals_ else torch.device("cpu")
        pin = self.device.type == "cuda"
        self.buckets: list[_Bucket] = []
        pending: list[int] = []
        for index, local in enumerate(locals_):
            if pending and sum(locals_[i].numel() for i in pending) + local.numel() > bucket_numel:
                self.buckets.append(_Bucket(pending, [locals_[i] for i in pending], pin, config))
                pending = []
            pending.append(index)
        if pending:
            self.buckets.append(_Bucket(pending, [locals_[i] for i in pending], pin, config))
        largest = max((bucket.numel for bucket in self.buckets), default=1)
        staging_numel = 1 << max(largest - 1, 1).bit_length() if pin else largest
        self.staging = [_host_buffer(staging_numel, pin) for _ in range(2 if len(self.buckets) > 1 else 1)]

    def host_bytes(self) -> int:
        """Host memory this optimizer holds once its moments exist (master copy, moments, staging)."""
        masters = sum(bucket.flat.numel() for bucket in self.buckets) * 4
        moments = sum(bucket.numel for bucket in self.buckets) * 8
        return masters + moments + sum(buffer.numel() for buffer in self.staging) * 4

    # ---- the step -----------------------------------------------------------------------
    def _copy_gradients_out(self, position: int) -> torch.cuda.Event | None:
        bucket = self.buckets[position]
        flat = self.staging[position % len(self.staging)]
        offset = 0
        parameters = self.param_groups[0]["params"]
        for index, master in zip(bucket.indices, bucket.masters, strict=True):
            grad = parameters[index].grad
            if grad is None:
                master.grad = None
            else:
                staged = flat[offset:offset + master.numel()].view_as(master)
                staged.copy_(_local(grad), non_blocking=True)
                master.grad = staged
            offset += master.numel()
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        if closure is not None:
            raise ValueError("HostOffloadedAdamW.step takes no closure")
        group = self.param_groups[0]
        parameters = group["params"]
        for bucket in self.buckets:
            host_group = bucket.optimizer.param_groups[0]
            for key in HYPERPARAMETERS:
                host_group[key] = group[key]
        events = {0: self._copy_gradients_out(0)} if self.buckets else {}
        for position, bucket in enumerate(self.buckets):
            if position + 1 < len(self.buckets):
                events[position + 1] = self._copy_gradients_out(position + 1)
            event = events.pop(position)
            if event is not None:
                event.synchronize()
            bucket.optimizer.step()
            for index, master in zip(bucket.indices, bucket.masters, strict=True):
                master.grad = None
                if parameters[index].grad is not None:
                    _local(parameters[index]).copy_(master, non_blocking=True)
            # the staging buffer of this bucket is rewritten two buckets on; the copy of bucket + 1
            # is already queued into the other one, so the CPU step above could overlap it
        return None

    @torch.no_grad()
    def pull_parameters(self) -> None:
        """Re-read the master copies from the device parameters (after loading weights into the model)."""
        parameters = self.param_groups[0]["params"]
        for bucket in self.buckets:
            for index, master in zip(bucket.indices, bucket.masters, strict=True):
                master.copy_(_local(parameters[index]))

    # ---- state ------------------------------------------------------------------------
    def _entries(self) -> Iterable[tuple[int, str, Tensor, dict]]:
        for bucket in self.buckets:
            for index, master in zip(bucket.indices, bucket.masters, strict=True):
                yield index, self.names[index], master, bucket.optimizer.state.get(master, {})

    def _full(self, index: int, host: Tensor) -> Tensor:
        """The whole tensor of parameter ``index``'s shape from this rank's host shard ``host``. Collective."""
        parameter = self.param_groups[0]["params"][index]
        if not isinstance(parameter, DTensor) or parameter.device_mesh.size() == 1:
            return host
        shard = DTensor.from_local(host.to(self.device), parameter.device_mesh, parameter.placements,
                                   shape=parameter.shape, stride=parameter.stride())
        return shard.full_tensor().cpu()

    def _shard(self, index: int, full: Tensor) -> Tensor:
        parameter = self.param_groups[0]["params"][index]
        if not isinstance(parameter, DTensor) or parameter.device_mesh.size() == 1:
            return full
        return distribute_tensor(full.to(self.device), parameter.device_mesh, parameter.placements).to_local()

    def full_master_state(self) -> dict[int, Tensor]:
        """id(device parameter) -> its whole float32 value on the host (the master copy). Collective.

        In a group of one these are the master buffers themselves, not copies.
        """
        parameters = self.param_groups[0]["params"]
        return {id(parameters[index]): self._full(index, master) for index, _, master, _ in self._entries()}

    def full_state_dict(self) -> dict:
        """{"state": {name: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]} with whole tensors. Collective."""
        state = {}
        for index, name, _, moments in self._entries():
            if moments:
                state[name] = {"step": moments["step"].clone(), "exp_avg": self._full(index, moments["exp_avg"]),
                               "exp_avg_sq": self._full(index, moments["exp_avg_sq"])}
        group = {key: value for key, value in self.param_groups[0].items() if key != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(self.names)}]}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Inverse of ``full_state_dict``; every rank passes the same whole state. Collective."""
        saved_group = state_dict["param_groups"][0]
        for key, value in saved_group.items():
            if key != "params":
                self.param_groups[0][key] = value
        for index, name, master, _ in self._entries():
            saved = state_dict["state"].get(name)
            bucket_optimizer = next(b.optimizer for b in self.buckets if index in b.indices)
            if saved is None:
                bucket_optimizer.state.pop(master, None)
                continue
            bucket_optimizer.state[master] = {
                "step": saved["step"].detach().to(torch.float32).clone(),
                "exp_avg": self._shard(index, saved["exp_avg"]).to("cpu", torch.float32).clone(),
                "exp_avg_sq": self._shard(index, saved["exp_avg_sq"]).to("cpu", torch.float32).clone()}
