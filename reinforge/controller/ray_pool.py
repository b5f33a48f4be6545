"""A resource pool placed on a Ray cluster: its placement groups and its member processes.

Each node of the pool gets one STRICT_PACK placement group with a bundle per device, and each
bundle one ``MemberHost`` actor; ranks run node by node (node 0's devices first). Rank 0's node
is the master address of the pool's ``torch.distributed`` group. Every role placed on the pool
builds its worker inside these same processes, so roles sharing a pool are colocated.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from reinforge.controller.ray_member import MemberHost
from reinforge.controller.resource_pool import ResourcePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemberInfo:
    rank: int
    node_ip: str
    node_id: str
    hostname: str
    pid: int
    log_path: Path

    def where(self) -> str:
        return f"node {self.node_ip} ({self.hostname}), pid {self.pid}"


@dataclass
class PoolSettings:
    log_dir: Path
    uses_gpu: bool
    num_cpus_per_member: float
    startup_timeout_s: float
    collective_timeout_s: float


def cluster_shortfall(devices_per_node: list[int], bundle: dict[str, float],
                      node_resources: list[dict[str, float]]) -> str | None:
    """Why a cluster whose live nodes have ``node_resources`` can never hold the pool, or None when it can: each
    entry of ``devices_per_node`` needs that many ``bundle``s packed on one node, each node used once."""
    def capacity(resources: dict[str, float]) -> int:
        return int(min(resources.get(name, 0.0) // amount for name, amount in bundle.items() if amount > 0))

    free = sorted((capacity(resources) for resources in node_resources), reverse=True)
    needed = sorted(devices_per_node, reverse=True)
    device = "GPU" if bundle.get("GPU") else "CPU slot"
    if len(needed) > len(free):
        return f"the Ray cluster has {len(free)} live node(s), fewer than the pool's trainer.nnodes={len(needed)}"
    if len(needed) > len(free) or any(count > room for count, room in zip(needed, free, strict=False)):
        held = ", ".join(str(room) for room in free) or "none"
        return (f"the Ray cluster's nodes hold {held} {device}s for members (one member per {bundle}), fewer than "
                f"trainer.nnodes x trainer.devices_per_node = {' + '.join(map(str, devices_per_node))}")
    return None


FEWER_DEVICES = "lower trainer.devices_per_node / trainer.nnodes to what the cluster has, or add nodes"


def pools_shortfall(pools: list[ResourcePool], held: list[ResourcePool], bundle: dict[str, float],
                    node_resources: list[dict[str, float]]) -> str | None:
    """Why the cluster can never place ``pools`` beside the ``held`` pools (placed already, keeping their devices),
    or None when it may: each pool must fit on its own (``cluster_shortfall``) and all of them together. The reason
    ends with its fix."""
    if pools and bundle.get("GPU") and not any(resources.get("GPU") for resources in node_resources):
        return ("the Ray cluster has no GPUs, and each member asks for one (trainer.device=cuda); set "
                "trainer.device=cpu or auto to run the members on CPU slots, or add nodes with GPUs")
    for pool in pools:
        shortfall = cluster_shortfall(pool.devices_per_node, bundle, node_resources)
        if shortfall is not None:
            return f"resource pool {pool.name!r} cannot be placed: {shortfall}; {FEWER_DEVICES}"
    every = [*held, *pools]
    needed = sum(pool.world_size for pool in every)
    capacity = sum(int(min(resources.get(name, 0.0) // amount for name, amount in bundle.items() if amount > 0))
                   for resources in node_resources)
    if len(every) > 1 and needed > capacity:
        device = "GPU" if bundle.get("GPU") else "CPU slot"
        asked = ", ".join(f"{pool.name!r} {pool.world_size}" for pool in every)
        return (f"the resource pools ({asked}) need {needed} {device}s together, but the Ray cluster's nodes hold "
                f"{capacity} (one member per {bundle}); pools of different names never share devices; {FEWER_DEVICES}")
    return None


def live_nodes() -> list[dict[str, float]]:
    """The resources of each live node of the cluster."""
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def member_bundle(num_cpus_per_member: float, uses_gpu: bool) -> dict[str, float]:
    """What one member holds: its CPUs and, on GPUs, one GPU."""
    return {"CPU": num_cpus_per_member, **({"GPU": 1.0} if uses_gpu else {})}


class PlacedPool:
    """The member processes of one resource pool, shared by the roles placed on it."""

    def __init__(self, pool: ResourcePool, settings: PoolSettings):
        self.pool, self.settings = pool, settings
        self.roles: set[str] = set()
        bundle = member_bundle(settings.num_cpus_per_member, settings.uses_gpu)
        shortfall = pools_shortfall([pool], [placed.pool for placed in _PLACED.values()], bundle, live_nodes())
        if shortfall is not None:  # Ray would wait startup_timeout_s for devices that are not there
            raise ValueError(shortfall)
        self.placement_groups = [placement_group([dict(bundle)] * count, strategy="STRICT_PACK",
                                                 name=f"reinforge-{pool.name}-node{node}")
                                 for node, count in enumerate(pool.devices_per_node)]
        self.hosts: list[Any] = []
        self.members: list[MemberInfo] = []
        try:
            self._wait_for_placement(bundle)
            self._start_members()
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def _wait_for_placement(self, bundle: dict[str, float]) -> None:
        ready, _ = ray.wait([group.ready() for group in self.placement_groups],
                            num_returns=len(self.placement_groups), timeout=self.settings.startup_timeout_s)
        if len(ready) < len(self.placement_groups):
            raise RuntimeError(
                f"resource pool {self.pool.name!r} asks for devices_per_node={self.pool.devices_per_node}, each "
                f"device a bundle {bundle} packed on one node, and Ray could not place it within "
                f"{self.settings.startup_timeout_s:g} s; the cluster has {ray.cluster_resources()} in all and "
                f"{ray.available_resources()} free. Lower trainer.devices_per_node / trainer.nnodes or add nodes")

    def _start_members(self) -> None:
        host_class = ray.remote(MemberHost)
        uses_gpu = self.settings.uses_gpu
        rank = 0
        for node, count in enumerate(self.pool.devices_per_node):
            for local_rank in range(count):
                log_path = self.settings.log_dir / f"{self.pool.name}_rank{rank}.log"
                strategy = PlacementGroupSchedulingStrategy(self.placement_groups[node],
                                                            placement_group_bundle_index=local_rank)
                self.hosts.append(host_class.options(
                    num_cpus=self.settings.num_cpus_per_member, num_gpus=1 if uses_gpu else 0,
                    scheduling_strategy=strategy, max_restarts=0, name=f"reinforge-{self.pool.name}-rank{rank}",
                ).remote(self.pool.name, rank, self.world_size, local_rank, str(log_path), uses_gpu, os.getcwd()))
                rank += 1
        described = self._get([host.describe.remote() for host in self.hosts], "start its members")
        self.members = [MemberInfo(rank=rank, log_path=self.settings.log_dir / f"{self.pool.name}_rank{rank}.log",
                                   **info) for rank, info in enumerate(described)]
        port = self._get([self.hosts[0].free_port.remote()], "pick a master port")[0]
        master = self.members[0].node_ip
        self._get([host.init_distributed.remote(master, port, self.settings.collective_timeout_s)
                   for host in self.hosts], f"form its torch.distributed group at {master}:{port}")
        logger.info("resource pool %r: %d members on %s", self.pool.name, self.world_size,
                    sorted({member.node_ip for member in self.members}))

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        try:
            return ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"resource pool {self.pool.name!r} did not {what} within "
                               f"{self.settings.startup_timeout_s:g} s; see the member logs in "
                               f"{self.settings.log_dir}") from None

    def shutdown(self) -> None:
        for host in self.hosts:
            ray.kill(host, no_restart=True)
        for group in self.placement_groups:
            remove_placement_group(group)
        self.hosts, self.placement_groups = [], []


_PLACED: dict[str, PlacedPool] = {}


def check_pools_fit(pools: list[ResourcePool], settings: PoolSettings) -> None:
    """Refuse at once (ValueError, one line) pools that the cluster cannot place beside those placed already, or
    that disagree with a placed pool of their name: before any of them starts a member or loads a model."""
    new: dict[str, ResourcePool] = {}
    for pool in pools:
        known = new.get(pool.name) or (_PLACED[pool.name].pool if pool.name in _PLACED else None)
        if known is not None and known.devices_per_node != pool.devices_per_node:
            raise ValueError(f"two resource pools are named {pool.name!r}, with devices_per_node="
                             f"{known.devices_per_node} and {pool.devices_per_node}; give the pools different names")
        if pool.name not in _PLACED:
            new[pool.name] = pool
    held = [placed.pool for placed in _PLACED.values()]
    shortfall = pools_shortfall(list(new.values()), held, member_bundle(settings.num_cpus_per_member,
                                                                        settings.uses_gpu), live_nodes())
    if shortfall is not None:
        raise ValueError(shortfall)


def acquire_pool(pool: ResourcePool, role: str, settings: PoolSettings) -> PlacedPool:
    """The placed pool of ``pool.name`` (started on first use) with ``role`` added to it."""
    placed = _PLACED.get(pool.name)
    if placed is not None and placed.pool.devices_per_node != pool.devices_per_node:
        raise ValueError(f"role {role!r} asks for resource pool {pool.name!r} with devices_per_node="
                         f"{pool.devices_per_node}, but it already runs with {placed.pool.devices_per_node} for "
                         f"roles {sorted(placed.roles)}; give the pools different names")
    if placed is not None and role in placed.roles:
        raise ValueError(f"role {role!r} already runs on resource pool {pool.name!r}; shut its group down first "
                         f"or give the new group another name")
    if placed is None:
        placed = _PLACED[pool.name] = PlacedPool(pool, settings)
    placed.roles.add(role)
    return placed


def release_pool(placed: PlacedPool, role: str) -> None:
    """Remove ``role``; the last role out stops the members and frees the placement groups."""
    placed.roles.discard(role)
    if not placed.roles:
        placed.shutdown()
        if _PLACED.get(placed.pool.name) is placed:
            del _PLACED[placed.pool.name]


def release_all_pools() -> None:
    """Stop every placed pool of this process, e.g. after a run failed with its groups still up."""
    for placed in list(_PLACED.values()):
        placed.roles.clear()
        release_pool(placed, "")
