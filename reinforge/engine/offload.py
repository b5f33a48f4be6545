"""Optimizer offload: AdamW whose state and step live in host memory (``actor.optimizer_offload``).

The parameters and their gradients stay on the device (FSDP shards, float32); only the float32
master copy the step writes and the two AdamW moments (12 bytes per parameter) live on the host,
each as one flat buffer of exactly the trained elements (this rank's shards laid end to end).
A step walks that flat space in chunks of ``chunk_numel`` elements:

1. the chunk's gradients are copied from the device into a pinned staging buffer (non-blocking;
   two buffers alternate, so the copy of chunk k + 1 runs while the CPU steps chunk k);
2. PyTorch's fused AdamW updates the chunk of the master copy on the CPU (one optimizer per
   chunk, its state views of the flat moment buffers);
3. the updated chunk is copied into a pinned upload buffer and from there, non-blocking, back
   into the device parameters (the stream orders it before the next forward).

AdamW is elementwise, so stepping chunks of a flat buffer equals stepping each parameter: the
update is ``torch.optim.AdamW``'s (the tests compare bitwise). The host master copy starts equal
to the device parameters and only this optimizer writes either (``pull_parameters`` re-reads
them after a checkpoint is loaded into the model). A parameter whose gradient is None is
left as it is, master copy and moments, as torch's AdamW skips it (its bias correction then counts the chunk's steps).

Host memory: 12 bytes per trained parameter plus four pinned chunks (1 GiB at the default
chunk), e.g. 85 GiB for a 7.6B model. Pinned buffers are sized to powers of two, which is what
PyTorch's pinned allocator rounds every request up to. On a CPU run "device" and host are the
same memory; the copies still run, so the tests exercise the whole path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
DEFAULT_CHUNK_NUMEL = 1 << 26
"""64 Mi float32 elements (256 MiB) per step chunk: large enough for the CPU kernel, small enough to pipeline."""


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _flat(tensor: Tensor) -> Tensor:
    """A 1-D view (never a copy: writes must reach the parameter)."""
    return _local(tensor).view(-1)


@dataclass
class _Segment:
    """Elements [param_start, param_start + length) of parameter ``index`` sit at [chunk_start, ...) of a chunk."""

    index: int
    param_start: int
    chunk_start: int
    length: int


class HostOffloadedAdamW(torch.optim.Optimizer):
    """AdamW over ``named_parameters`` (name, device parameter) with state and step on the host.

    Its one param group holds the device parameters, so schedulers, ``zero_grad`` and gradient
    clipping work on it as on any optimizer. Save and load its state with ``full_state_dict`` and
    ``load_full_state_dict`` (the format of ``torch.distributed.checkpoint``'s full optimizer state,
    so a checkpoint moves between offloaded and on-device runs).
    """

    def __init__(self, named_parameters: Iterable[tuple[str, nn.Parameter]], *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL):
        named = list(named_parameters)
        if not named:
            raise ValueError("HostOffloadedAdamW got no parameters to train")
        self.names = [name for name, _ in named]
        config = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__([parameter for _, parameter in named], dict(config))
        locals_ = [_flat(parameter) for _, parameter in named]
        self.device = locals_[0].device
        self.offsets = [0]
        for local in locals_:
            self.offsets.append(self.offsets[-1] + local.numel())
        total = self.offsets[-1]
        self.master = torch.empty(total, dtype=torch.float32)
        self.exp_avg = torch.zeros(total, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32)
        for index, local in enumerate(locals_):
            self.master[self.offsets[index]:self.offsets[index + 1]].copy_(local.detach())
        self.chunks: list[tuple[int, int, list[_Segment], torch.optim.AdamW]] = []
        for start in range(0, total, chunk_numel):
            stop = min(start + chunk_numel, total)
            chunk = self.master[start:stop]
            optimizer = torch.optim.AdamW([chunk], fused=True, **config)
            optimizer.state[chunk] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": self.exp_avg[start:stop], "exp_avg_sq": self.exp_avg_sq[start:stop]}
            self.chunks.append((start, stop, self._segments(start, stop), optimizer))
        pin = self.device.type == "cuda"
        capacity = 1 << max(min(chunk_numel, total) - 1, 1).bit_length()
        self.staging = [torch.empty(capacity, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.upload = [torch.empty(capacity, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._upload_done: list[torch.cuda.Event | None] = [None, None]

    def _segments(self, start: int, stop: int) -> list[_Segment]:
        segments = []
        for index in range(len(self.names)):
            low, high = max(start, self.offsets[index]), min(stop, self.offsets[index + 1])
            if low < high:
                segments.append(_Segment(index, low - self.offsets[index], low - start, high - low))
        return segments

    def host_bytes(self) -> int:
        """Host memory this optimizer holds: master copy, moments, pinned staging and upload buffers."""
        return (self.master.numel() * 3 + sum(b.numel() for b in self.staging + self.upload)) * 4

    # ---- the step -----------------------------------------------------------------------
    def _copy_gradients_out(self, position: int) -> torch.cuda.Event | None:
        start, stop, segments, _ = self.chunks[position]
        staging = self.staging[position % 2]
        parameters = self.param_groups[0]["params"]
        for segment in segments:
            destination = staging[segment.chunk_start:segment.chunk_start + segment.length]
            grad = parameters[segment.index].grad
            if grad is None:  # not stepped: step() puts its master copy and moments back after the chunk's step
                destination.zero_()
            else:
                destination.copy_(_flat(grad)[segment.param_start:segment.param_start + segment.length],
                                  non_blocking=True)
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _copy_parameters_in(self, position: int) -> None:
        start, stop, segments, _ = self.chunks[position]
        slot = position % 2
        if self._upload_done[slot] is not None:
            self._upload_done[slot].synchronize()  # its previous upload has left the buffer
        upload = self.upload[slot][:stop - start]
        upload.copy_(self.master[start:stop])
        parameters = self.param_groups[0]["params"]
        for segment in segments:
            _flat(parameters[segment.index])[segment.param_start:segment.param_start + segment.length].copy_(
                upload[segment.chunk_start:segment.chunk_start + segment.length], non_blocking=True)
        if self.device.type == "cuda":
            self._upload_done[slot] = torch.cuda.Event()
            self._upload_done[slot].record()

    def _segments_without_grad(self, position: int) -> list[tuple[int, int]]:
        """The flat ranges [low, high) of chunk ``position`` whose parameter has no gradient this step."""
        start, _, segments, _ = self.chunks[position]
        parameters = self.param_groups[0]["params"]
        return [(start + segment.chunk_start, start + segment.chunk_start + segment.length)
                for segment in segments if parameters[segment.index].grad is None]

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        if closure is not None:
            raise ValueError("HostOffloadedAdamW.step takes no closure")
        group = self.param_groups[0]
        events = {0: self._copy_gradients_out(0)}
        for position, (start, stop, _, optimizer) in enumerate(self.chunks):
            # the other staging buffer was read by the previous chunk's step, which has returned
            if position + 1 < len(self.chunks):
                events[position + 1] = self._copy_gradients_out(position + 1)
            event = events.pop(position)
            if event is not None:
                event.synchronize()
            host_group = optimizer.param_groups[0]
            for key in HYPERPARAMETERS:
                host_group[key] = group[key]
            chunk = host_group["params"][0]
            chunk.grad = self.staging[position % 2][:stop - start]
            # torch's AdamW skips a parameter whose gradient is None (one the backward did not reach: a VLM's tower or
            # projector in a text-only step); a zero gradient would still decay it and move it by its moments
            skipped = [(low, high, [buffer[low:high].clone() for buffer in (self.master, self.exp_avg, self.exp_avg_sq)])
                       for low, high in self._segments_without_grad(position)]
            optimizer.step()
            for low, high, saved in skipped:
                for buffer, before in zip((self.master, self.exp_avg, self.exp_avg_sq), saved, strict=True):
                    buffer[low:high].copy_(before)
            chunk.grad = None
            self._copy_parameters_in(position)
        return None

    @torch.no_grad()
    def pull_parameters(self) -> None:
        """Re-read the master copy from the device parameters (after loading weights into the model)."""
        for index, parameter in enumerate(self.param_groups[0]["params"]):
            self.master[self.offsets[index]:self.offsets[index + 1]].copy_(_flat(parameter))

    # ---- state ------------------------------------------------------------------------
    def _view(self, flat: Tensor, index: int) -> Tensor:
        """Parameter ``index``'s part of a flat host buffer, shaped as its local shard (a view)."""
        local = _local(self.param_groups[0]["params"][index])
        return flat[self.offsets[index]:self.offsets[index + 1]].view(local.shape)

    def _full(self, index: int, host: Tensor) -> Tensor:
        """The whole tensor of parameter ``index`` from this rank's host shard ``host``. Collective."""
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

    def _step_count(self) -> Tensor:
        return self.chunks[0][3].state[self.chunks[0][3].param_groups[0]["params"][0]]["step"]

    def full_master_state(self) -> dict[int, Tensor]:
        """id(device parameter) -> its whole float32 value on the host (the master copy). Collective.

        In a group of one these are views of the master buffer, not copies.
        """
        parameters = self.param_groups[0]["params"]
        return {id(parameter): self._full(index, self._view(self.master, index))
                for index, parameter in enumerate(parameters)}

    def full_state_dict(self) -> dict:
        """{"state": {name: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]} with whole tensors. Collective."""
        step = self._step_count()
        state = {}
        if step.item() > 0:
            for index, name in enumerate(self.names):
                state[name] = {"step": step.clone(), "exp_avg": self._full(index, self._view(self.exp_avg, index)),
                               "exp_avg_sq": self._full(index, self._view(self.exp_avg_sq, index))}
        group = {key: value for key, value in self.param_groups[0].items() if key != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(self.names)}]}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Inverse of ``full_state_dict``; every rank passes the same whole state. Collective."""
        for key, value in state_dict["param_groups"][0].items():
            if key != "params":
                self.param_groups[0][key] = value
        saved = state_dict["state"]
        missing = [name for name in self.names if name not in saved]
        if saved and missing:
            raise ValueError(f"the saved optimizer state has no moments for {missing[0]}; it belongs to another model")
        step = saved[self.names[0]]["step"].detach().float() if saved else torch.zeros(())
        for index, name in enumerate(self.names):
            for key in ("exp_avg", "exp_avg_sq"):
                value = self._shard(index, saved[name][key]) if saved else 0.0
                self._view(getattr(self, key), index).copy_(value)
        for _, _, _, optimizer in self.chunks:
            optimizer.state[optimizer.param_groups[0]["params"][0]]["step"].copy_(step)
