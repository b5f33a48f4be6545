"""``@register``: how a worker method is spread over the members of its group.

The decorator only attaches a ``MethodSpec`` to the function; calling the method directly on a
worker behaves exactly as before. ``WorkerGroup`` reads the specs to build its own methods, and
``reinforge.controller.dispatch`` implements what each mode does with arguments and results.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

Method = TypeVar("Method", bound=Callable[..., Any])

SPEC_ATTRIBUTE = "__reinforge_method_spec__"


class Dispatch(enum.Enum):
    """How the controller's arguments reach the members and how their results come back."""

    ONE_TO_ALL = "one_to_all"
    """Every member gets the same arguments; the group returns the list of results, by rank."""
    DP_COMPUTE = "dp_compute"
    """Batch arguments are split across members (padded to equal chunks); results are gathered."""
    RANK_ZERO = "rank_zero"
    """Only member 0 is called; the group returns its result."""
    ALL_TO_ALL = "all_to_all"
    """Every argument is a list with one element per member; the group returns the list of results."""


class Execute(enum.Enum):
    """Which members run the call."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    dispatch: Dispatch
    execute: Execute

    @property
    def runs_on_rank_zero_only(self) -> bool:
        return self.dispatch is Dispatch.RANK_ZERO or self.execute is Execute.RANK_ZERO


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL, execute: Execute = Execute.ALL) -> Callable[[Method], Method]:
    """Mark a worker method as callable through its ``WorkerGroup``.

    ``execute=Execute.RANK_ZERO`` with ``Dispatch.ONE_TO_ALL`` calls member 0 alone with the
    arguments and returns its result, like ``Dispatch.RANK_ZERO``. Splitting modes (DP_COMPUTE,
    ALL_TO_ALL) need every member, so they only take ``Execute.ALL``.
    """
    if not isinstance(dispatch, Dispatch) or not isinstance(execute, Execute):
        raise TypeError(f"register(dispatch={dispatch!r}, execute={execute!r}) takes a Dispatch and an Execute member")
    if execute is Execute.RANK_ZERO and dispatch in (Dispatch.DP_COMPUTE, Dispatch.ALL_TO_ALL):
        raise ValueError(f"register(dispatch=Dispatch.{dispatch.name}, execute=Execute.RANK_ZERO) would drop the "
                         f"other members' share of the data; use Execute.ALL, or Dispatch.RANK_ZERO")
    spec = MethodSpec(dispatch, execute)

    def attach(method: Method) -> Method:
        setattr(method, SPEC_ATTRIBUTE, spec)
        return method

    return attach


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> spec of the methods of ``cls`` (inherited ones included) that carry ``@register``.

    An override without the decorator is not registered: the override decides.
    """
    methods = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), SPEC_ATTRIBUTE, None)
        if isinstance(spec, MethodSpec):
            methods[name] = spec
    return methods
