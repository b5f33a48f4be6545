"""Resource pools: which devices a worker group may use, and which pool each role runs on.

The local backend runs a group inside the controller's process and lets each worker pick its
own device, so it only reads a pool's size (one device by default). The Ray backend places
one member process per device of the pool, node by node (a STRICT_PACK placement group per
node), and builds the workers of every role that shares the pool inside those same processes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResourcePool:
    name: str
    devices_per_node: list[int] = field(default_factory=lambda: [1])
    """Devices (GPUs, or CPU slots in tests) on each node: [8, 8] is two nodes of eight."""

    def __post_init__(self) -> None:
        if not self.devices_per_node or any(count < 1 for count in self.devices_per_node):
            raise ValueError(f"resource pool {self.name!r} has devices_per_node={self.devices_per_node}; "
                             f"give at least one node, each with one device or more")

    @property
    def world_size(self) -> int:
        """Members of a group placed on this pool: one per device."""
        return sum(self.devices_per_node)


LOCAL_POOL = ResourcePool("local", [1])


@dataclass
class RolePlacement:
    """Role name -> the resource pool its worker group runs on."""

    pools: dict[str, ResourcePool]
    role_to_pool: dict[str, str]

    def __post_init__(self) -> None:
        unknown = {role: pool for role, pool in self.role_to_pool.items() if pool not in self.pools}
        if unknown:
            raise ValueError(f"roles {unknown} name pools that do not exist; the pools are {sorted(self.pools)}")

    @classmethod
    def colocated(cls, roles: Iterable[str], pool: ResourcePool = LOCAL_POOL) -> RolePlacement:
        """Every role on one pool, the hybrid-engine layout (and the only one of the local backend)."""
        return cls({pool.name: pool}, {role: pool.name for role in roles})

    def pool_for(self, role: str) -> ResourcePool:
        if role not in self.role_to_pool:
            raise KeyError(f"role {role!r} has no resource pool; placed roles are {sorted(self.role_to_pool)}")
        return self.pools[self.role_to_pool[role]]
