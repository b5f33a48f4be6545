"""The Ray backend on toy workers: dispatch modes, a gloo group, errors from dead and late members.

One Ray instance (4 logical CPUs) serves every Ray test of this folder (see ``ray_cluster``);
each group member is an actor holding one CPU, so at most four members run at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from reinforge.controller import Dispatch, ResourcePool, Worker, WorkerCallError, WorkerTimeoutError, register  # noqa: E402
from reinforge.controller.ray_backend import MemberDiedError, RayWorkerGroup  # noqa: E402
from reinforge.controller.ray_transport import WireBatch  # noqa: E402
from reinforge.protocol import Batch  # noqa: E402

pytestmark = pytest.mark.slow


class ToyWorker(Worker):
    def __init__(self, offset: int):
        super().__init__()
        self.offset = offset
        print(f"toy worker rank {self.rank} ready", flush=True)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def environment(self) -> dict:
        return {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value * (self.rank + 1)])
        torch.distributed.all_reduce(tensor)
        return float(tensor)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def column_sum(self, batch: Batch) -> float:
        return float(batch["x"].sum())

    @register(dispatch=Dispatch.DP_COMPUTE)
    def shift(self, batch: Batch) -> Batch:
        return Batch.from_dict({"shifted": batch["x"] + self.offset, "half": batch["x"].bfloat16(),
                                "rank": torch.full_like(batch["x"], self.rank)}, {"tag": [f"r{self.rank}"] * len(batch)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch: Batch) -> dict[str, float]:
        return {"loss": float(self.rank), "rows": len(batch)}

    @register(dispatch=Dispatch.RANK_ZERO)
    def save(self, folder: str) -> str:
        return f"{folder} by rank {self.rank}"

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def assign(self, value: int) -> int:
        return value * 10 + self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"bad input on rank {rank}")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        print(f"rank {self.rank} sleeps {seconds} s", flush=True)
        time.sleep(seconds)
        return os.getpid()

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def sleep_then_all_reduce(self, seconds: float) -> float:
        print(f"rank {self.rank} sleeps {seconds} s before an all-reduce", flush=True)
        time.sleep(seconds)
        tensor = torch.ones(1)
        torch.distributed.all_reduce(tensor)
        return float(tensor)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def group(ray_cluster, tmp_path_factory):
    from reinforge.controller.ray_backend import connect_ray

    connect_ray(log_dir=tmp_path_factory.mktemp("member_logs"))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = RayWorkerGroup(ToyWorker, 100, name="toy", resource_pool=ResourcePool("toys", [2]), timeout_s=60)
    yield group
    group.shutdown()


def test_dispatch_modes_match_the_local_backend(group):
    assert group.save("ckpt") == "ckpt by rank 0"
    assert group.assign([1, 2]) == [10, 21]
    batch = Batch.from_dict({"x": torch.arange(5)})
    out = group.shift(batch)
    assert out["shifted"].tolist() == [100, 101, 102, 103, 104]
    assert out["half"].dtype == torch.bfloat16 and out["half"].tolist() == [0, 1, 2, 3, 4]
    assert out["rank"].tolist() == [0, 0, 0, 1, 1] and out["tag"].tolist() == ["r0", "r0", "r0", "r1", "r1"]
    assert group.update(Batch.from_dict({"x": torch.arange(6)})) == {"loss": 0.5, "rows": 3.0}


def test_members_form_a_gloo_group_with_rank_and_master_address(group):
    environments = group.environment()
    assert [env["RANK"] for env in environments] == ["0", "1"]
    assert {env["WORLD_SIZE"] for env in environments} == {"2"}
    assert len({(env["MASTER_ADDR"], env["MASTER_PORT"]) for env in environments}) == 1
    assert group.all_reduce(1.0) == [3.0, 3.0]


def test_members_run_at_the_drivers_priority_where_ray_starts_here(group, monkeypatch):
    """Ray starts its workers at niceness 15: beside other busy processes, a run's members waited on all of them. A
    Ray instance that connect_ray starts runs them at the driver's niceness; a cluster it joins keeps its own."""
    from reinforge.controller.ray_backend import RAY_SYSTEM_CONFIG, connect_ray

    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in group.pid()} == {os.getpriority(os.PRIO_PROCESS, 0)}
    calls = []

    def init(**settings):
        calls.append(settings)
        if "_system_config" in settings and len(calls) == 2:
            raise ValueError("When connecting to an existing cluster, _system_config must not be provided.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process (one test process shares Ray)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connect_ray()  # no cluster found: Ray starts here, with the settings
    connect_ray()  # a `ray start` cluster found on this machine: joined as it is
    assert [call.get("_system_config") for call in calls] == [RAY_SYSTEM_CONFIG, RAY_SYSTEM_CONFIG, None]
    assert RAY_SYSTEM_CONFIG["worker_niceness"] == 0


def test_a_one_to_all_batch_is_stored_once_per_call(group, monkeypatch):
    stored = []
    original = WireBatch.__reduce__
    monkeypatch.setattr(WireBatch, "__reduce__", lambda self: stored.append(len(self.batch)) or original(self))
    batch = Batch.from_dict({"x": torch.ones(100_000)})
    assert group.column_sum(batch) == [100_000.0, 100_000.0]
    assert stored == [100_000]
    stored.clear()
    group.shift(Batch.from_dict({"x": torch.arange(4)}))
    assert stored == [2, 2]  # DP_COMPUTE: each member's own chunk


def test_member_error_names_role_rank_node_and_keeps_the_cause(group):
    with pytest.raises(WorkerCallError, match=r"'toy' \(ToyWorker\) rank 1 of 2 raised in fail_on: ValueError: "
                                              r"bad input on rank 1") as caught:
        group.fail_on(1)
    assert isinstance(caught.value.__cause__, ValueError)
    [note] = caught.value.__cause__.__notes__
    assert "raised by rank 1 of role 'toy' on node" in note and "toys_rank1.log" in note and "in fail_on" in note
    assert group.save("again") == "again by rank 0"  # the group still works


def test_late_member_error_quotes_its_log_and_stack(group):
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"sleep did not finish within 1 s on rank\(s\) \[0, 1\]") as caught:
        group.sleep.with_timeout(1.0)(4.0)
    assert time.monotonic() - start < 5
    message = str(caught.value)
    assert "rank 1 of role 'toy' runs on node" in message and "toys_rank1.log" in message
    assert "rank 1 sleeps 4.0 s" in message  # the member's own output
    assert "in sleep" in message  # its stack, dumped on the controller's request
    group.pid()  # wait for the sleep to end before the next test


def test_each_member_writes_its_own_log_file(group):
    log_dir = group.backend.members[0].log_path.parent
    assert sorted(path.name for path in log_dir.glob("*.log")) == ["toys_rank0.log", "toys_rank1.log"]
    assert "toy worker rank 1 ready" in (log_dir / "toys_rank1.log").read_text()
    assert "toy worker rank 1 ready" not in (log_dir / "toys_rank0.log").read_text()


def test_a_killed_member_fails_the_call_at_once_with_its_last_log_lines(group):
    """Rank 0 waits in an all-reduce for rank 1, which is killed: the error names rank 1, the root cause.

    Runs last in this module: it leaves the group without rank 1.
    """
    future = group.sleep_then_all_reduce.with_timeout(30).async_call([0.0, 20.0])
    # kill rank 1 once it sleeps, with rank 0 past its (zero) sleep and so in the all-reduce
    members = group.backend.members
    deadline = time.monotonic() + 30
    while not all(f"rank {rank} sleeps {seconds} s before an all-reduce" in members[rank].log_path.read_text()
                  for rank, seconds in ((0, 0.0), (1, 20.0))):
        assert time.monotonic() < deadline, "the members did not start the call"
        time.sleep(0.05)
    time.sleep(0.1)
    os.kill(members[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerCallError, match=r"'toy' \(ToyWorker\) rank 1 of 2 raised in sleep_then_all_reduce: "
                                              r"MemberDiedError: the member process died") as caught:
        future.result()
    assert time.monotonic() - start < 15
    assert isinstance(caught.value.__cause__, MemberDiedError)
    message = str(caught.value)
    assert "rank 1 of role 'toy' runs on node" in message and "rank 1 sleeps 20.0 s before an all-reduce" in message


def test_cluster_shortfall_compares_each_node_with_the_pools_devices():
    from reinforge.controller.ray_pool import cluster_shortfall

    gpu = {"CPU": 1.0, "GPU": 1.0}
    eight_gpus = {"CPU": 64.0, "GPU": 8.0}
    assert cluster_shortfall([8], gpu, [eight_gpus]) is None
    assert cluster_shortfall([8, 8], gpu, [eight_gpus, eight_gpus]) is None
    assert cluster_shortfall([8], gpu, [{"CPU": 64.0, "GPU": 4.0}, {"CPU": 64.0, "GPU": 4.0}]) == (
        "the Ray cluster's nodes hold 4, 4 GPUs for members (one member per {'CPU': 1.0, 'GPU': 1.0}), fewer than "
        "trainer.nnodes x trainer.devices_per_node = 8")
    assert cluster_shortfall([8, 8], gpu, [eight_gpus]) == (  # one node cannot serve two
        "the Ray cluster has 1 live node(s), fewer than the pool's trainer.nnodes=2")
    assert "hold 0 GPUs" in cluster_shortfall([1], gpu, [{"CPU": 4.0}])
    assert "CPU slots" in cluster_shortfall([8], {"CPU": 1.0}, [{"CPU": 2.0}])


def test_pools_shortfall_counts_the_pools_together_and_those_placed_already():
    from reinforge.controller.ray_pool import pools_shortfall

    cpu, four_cpus = {"CPU": 1.0}, [{"CPU": 4.0}]
    actor, critic = ResourcePool("actor", [2]), ResourcePool("critic", [2])
    assert pools_shortfall([actor, critic], [], cpu, four_cpus) is None
    assert pools_shortfall([ResourcePool("critic", [3])], [actor], cpu, four_cpus) == (
        "the resource pools ('actor' 2, 'critic' 3) need 5 CPU slots together, but the Ray cluster's nodes hold 4 "
        "(one member per {'CPU': 1.0}); pools of different names never share devices; lower "
        "trainer.devices_per_node / trainer.nnodes to what the cluster has, or add nodes")
    assert pools_shortfall([ResourcePool("critic", [8])], [], cpu, four_cpus).startswith(
        "resource pool 'critic' cannot be placed: the Ray cluster's nodes hold 4 CPU slots")
    assert pools_shortfall([actor], [], {"CPU": 1.0, "GPU": 1.0}, four_cpus) == (
        "the Ray cluster has no GPUs, and each member asks for one (trainer.device=cuda); set trainer.device=cpu or "
        "auto to run the members on CPU slots, or add nodes with GPUs")


def test_a_pool_larger_than_the_cluster_is_refused_at_once(ray_cluster, tmp_path):
    from reinforge.controller.ray_backend import connect_ray

    connect_ray(log_dir=tmp_path, device="cpu")
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"resource pool 'huge' cannot be placed: the Ray cluster's nodes hold \d+ "
                                         r"CPU slots .* = 64; lower trainer.devices_per_node"):
        RayWorkerGroup(ToyWorker, 100, name="huge", resource_pool=ResourcePool("huge", [64]), timeout_s=60)
    assert time.monotonic() - started < 10


def test_a_cluster_address_where_nothing_listens_is_refused_at_once(monkeypatch):
    """Ray would retry the address for minutes without a word; the run stops in one line naming the setting."""
    import socket

    from reinforge.controller.ray_backend import connect_ray

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process (one test process shares Ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"^trainer.ray_address=127.0.0.1:{port}: no Ray cluster answers at "
                                              rf"127.0.0.1:{port} \(.*refused\); start one there"):
        connect_ray(f"127.0.0.1:{port}")
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=rf"^RAY_ADDRESS=ray://127.0.0.1:{port}: no Ray cluster answers"):
        connect_ray("10.0.0.1:6379")
    assert time.monotonic() - started < 5
