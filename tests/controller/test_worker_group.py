import time

import pytest
import torch

from reinforge.controller import (
    Dispatch,
    Execute,
    ResourcePool,
    RolePlacement,
    Worker,
    WorkerCallError,
    WorkerGroup,
    WorkerTimeoutError,
    register,
)
from reinforge.protocol import Batch


class ToyWorker(Worker):
    def __init__(self, offset: int, scale: float = 1.0):
        super().__init__()
        self.offset = offset
        self.scale = scale
        self.seen_rows = 0
        self.rank_at_init = self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def describe(self, suffix: str) -> str:
        return f"rank{self.rank}/{self.world_size}{suffix}"

    @register(dispatch=Dispatch.DP_COMPUTE)
    def shift(self, batch: Batch) -> Batch:
        self.seen_rows += len(batch)
        return Batch.from_dict({"shifted": batch["x"] * self.scale + self.offset, "rank": torch.full_like(batch["x"], self.rank)},
                               {"tag": [f"r{self.rank}"] * len(batch)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch: Batch) -> dict[str, float]:
        return {"loss": float(self.rank), "rows": len(batch)}

    @register(dispatch=Dispatch.RANK_ZERO)
    def save(self, folder: str) -> str:
        return f"{folder} by rank {self.rank}"

    @register(dispatch=Dispatch.ONE_TO_ALL, execute=Execute.RANK_ZERO)
    def only_first(self) -> int:
        return self.rank

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def assign(self, value: int) -> int:
        return value * 10 + self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rows_seen(self) -> int:
        return self.seen_rows

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"bad input on rank {rank}")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_rank(self) -> int:
        return self.rank_at_init


@pytest.fixture(params=[1, 2], ids=["one_member", "two_members"])
def group(request):
    group = WorkerGroup(ToyWorker, 100, name="toy", num_members=request.param, init_kwargs={"scale": 2.0},
                        timeout_s=10)
    yield group
    group.shutdown()


def test_one_to_all_rank_zero_and_all_to_all(group):
    size = group.num_members
    assert group.describe("!") == [f"rank{rank}/{size}!" for rank in range(size)]
    assert group.init_rank() == list(range(size))
    assert group.save("ckpt") == "ckpt by rank 0"
    assert group.only_first() == 0
    assert group.assign(list(range(size))) == [rank * 10 + rank for rank in range(size)]


@pytest.mark.parametrize("num_rows", [1, 4, 5, 7])
def test_dp_compute_removes_padding_and_keeps_order(group, num_rows):
    batch = Batch.from_dict({"x": torch.arange(num_rows)})
    out = group.shift(batch)
    assert out["shifted"].tolist() == [2 * row + 100 for row in range(num_rows)]
    assert len(out["tag"]) == num_rows
    assert "num_padding" not in out.meta and "num_padding" not in batch.meta
    chunk = -(-num_rows // group.num_members)
    assert out["rank"].tolist() == [row // chunk for row in range(num_rows)]
    assert group.rows_seen() == [chunk] * group.num_members


def test_dp_compute_metrics_are_averaged_over_members(group):
    metrics = group.update(Batch.from_dict({"x": torch.arange(6)}))
    assert metrics == {"loss": sum(range(group.num_members)) / group.num_members, "rows": 6 / group.num_members}


def test_member_error_names_role_rank_and_method(group):
    bad_rank = group.num_members - 1
    with pytest.raises(WorkerCallError, match=rf"'toy' \(ToyWorker\) rank {bad_rank} of {group.num_members} "
                                              rf"raised in fail_on: ValueError: bad input") as caught:
        group.fail_on(bad_rank)
    assert isinstance(caught.value.__cause__, ValueError)
    assert group.describe("") is not None  # the group still works after a member error


def test_deadline_overrun_raises_quickly_with_a_clear_message():
    group = WorkerGroup(ToyWorker, 0, num_members=2, timeout_s=30)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"'ToyWorker': sleep did not finish within 0.2 s on rank\(s\) \[0, 1\]"):
        group.sleep.with_timeout(0.2)(1.0)
    assert time.monotonic() - start < 0.9
    group.shutdown()


def test_group_deadline_applies_to_every_call():
    group = WorkerGroup(ToyWorker, 0, timeout_s=0.2)
    with pytest.raises(WorkerTimeoutError, match="within 0.2 s"):
        group.sleep(1.0)
    group.shutdown()


def test_async_call_returns_a_future():
    group = WorkerGroup(ToyWorker, 0, num_members=2, timeout_s=10)
    start = time.monotonic()
    future = group.sleep.async_call(0.3)
    assert time.monotonic() - start < 0.2
    with pytest.raises(WorkerTimeoutError, match="within 0.05 s"):
        future.result(timeout_s=0.05)
    assert future.result() == [0.3, 0.3]
    assert future.done()
    group.shutdown()


class BrokenWorker(Worker):
    def __init__(self):
        if self.rank == 1:
            raise RuntimeError("no device")

    @register()
    def ping(self) -> str:
        return "pong"


def test_construction_error_names_rank_and_init():
    with pytest.raises(WorkerCallError, match=r"'BrokenWorker' rank 1 of 2 raised in __init__: RuntimeError: no device"):
        WorkerGroup(BrokenWorker, num_members=2)


class ClashingWorker(Worker):
    @register()
    def shutdown(self) -> None:
        pass


def test_group_refuses_method_names_it_uses_itself():
    with pytest.raises(TypeError, match=r"registers \['shutdown'\]"):
        WorkerGroup(ClashingWorker)


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown controller backend 'slurm' .* known backends: .*'local'"):
        WorkerGroup(ToyWorker, 0, backend="slurm")


def test_resource_pool_sets_the_group_size_and_roles_map_to_pools():
    pool = ResourcePool("cpu", [2])
    placement = RolePlacement.colocated(["actor_rollout", "ref"], pool)
    assert placement.pool_for("ref") is pool
    with pytest.raises(KeyError, match="role 'critic' has no resource pool"):
        placement.pool_for("critic")
    group = WorkerGroup(ToyWorker, 0, resource_pool=placement.pool_for("actor_rollout"))
    assert group.num_members == 2 and group.describe("") == ["rank0/2", "rank1/2"]
    group.shutdown()
    with pytest.raises(ValueError, match="num_members=3 but resource pool 'cpu' has 2 devices"):
        WorkerGroup(ToyWorker, 0, num_members=3, resource_pool=pool)
    with pytest.raises(ValueError, match="devices_per_node"):
        ResourcePool("empty", [])
