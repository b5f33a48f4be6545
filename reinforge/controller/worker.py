"""The base class of every role worker (actor-rollout, reference, critic, reward).

A worker is one member of a ``WorkerGroup``: the group's backend builds it with its ``rank``
and ``world_size`` already set, so ``__init__`` can use them (device choice, seeding,
``torch.distributed`` setup). Built directly, outside a group, a worker is rank 0 of 1.
"""

from __future__ import annotations

import gc
from typing import Any, TypeVar

from reinforge.controller.register import MethodSpec, registered_methods

WorkerType = TypeVar("WorkerType", bound="Worker")


class Worker:
    _rank: int = 0
    _world_size: int = 1

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @classmethod
    def registered_methods(cls) -> dict[str, MethodSpec]:
        """Name -> ``MethodSpec`` of every ``@register`` method, the ones a group exposes."""
        return registered_methods(cls)


def construct_worker(worker_cls: type[WorkerType], rank: int, world_size: int,
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerType:
    """``worker_cls(*args, **kwargs)`` with rank and world size set before ``__init__`` runs."""
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(f"{worker_cls!r} is not a subclass of reinforge.controller.Worker; "
                        f"worker groups can only hold Worker subclasses")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size} members")
    worker = worker_cls.__new__(worker_cls)
    worker._rank = rank
    worker._world_size = world_size
    worker.__init__(*args, **kwargs)
    freeze_long_lived_objects()
    return worker


def freeze_long_lived_objects() -> None:
    """Collect, then exempt every object alive now from later garbage collections.

    A worker's model, optimizer and compiled graphs live as long as the process; left in the
    collector's oldest generation, every full collection (triggered by a step's many short-lived
    objects) walks all of them, tens of milliseconds in the middle of a rollout or an update.
    """
    gc.collect()
    gc.freeze()
