import pytest

from reinforge.controller import Dispatch, Execute, MethodSpec, Worker, register


class Base(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute(self, x):
        return x + 1

    @register()
    def ping(self):
        return "pong"

    def helper(self):
        return "not registered"


class Child(Base):
    def ping(self):  # an override without the decorator is not registered
        return "child"


def test_register_leaves_direct_calls_alone():
    worker = Base()
    assert worker.compute(1) == 2
    assert worker.rank == 0 and worker.world_size == 1


def test_registered_methods_lists_decorated_methods_with_their_specs():
    assert Base.registered_methods() == {
        "compute": MethodSpec(Dispatch.DP_COMPUTE, Execute.ALL),
        "ping": MethodSpec(Dispatch.ONE_TO_ALL, Execute.ALL),
    }
    assert set(Child.registered_methods()) == {"compute"}


def test_rank_zero_execute_refuses_splitting_dispatch():
    with pytest.raises(ValueError, match="drop the other members' share"):
        register(dispatch=Dispatch.DP_COMPUTE, execute=Execute.RANK_ZERO)
    with pytest.raises(TypeError, match="takes a Dispatch"):
        register(dispatch="dp_compute")
