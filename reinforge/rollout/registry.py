"""Rollout engines by ``rollout.name``: the two built in, and any a package adds through an entry point.

A package adds an engine without editing reinforge by naming its class in the entry point group
``reinforge.rollout_engines`` of its ``pyproject.toml``::

    [project.entry-points."reinforge.rollout_engines"]
    my_engine = "my_package.engine:MyEngine"

after which ``rollout.name=my_engine`` generates with it. The class implements ``RolloutEngine`` (``base.py``:
``generate``, ``sync_weights``, ``wake_up``, ``sleep`` and ``reads_model_in_place``) and is built by the
actor-rollout worker as ``MyEngine.from_config(config, model=model, tokenizer=tokenizer, device=device)``, with the
run's ``Config``, the policy model (in the compute dtype), its tokenizer and the device. ``register_rollout_engine``
adds one from Python code instead (a test, a script), in the process that builds it. ``hf`` and ``native`` are built
by the worker itself, since their settings come from ``rollout`` keys of their own.

Stop strings hold for every engine: a plugin's is built inside ``StopStringsHeld``, which ends each sample at the
token whose text completes one, as the built-in engines do while they generate (an engine that does so itself is
left as it is).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reinforge.rollout.stop_strings import StopStringMatcher, end_at_stop_string, token_decoder

if TYPE_CHECKING:
    from reinforge.rollout.base import Completion, GenerationRequest, SamplingParams

ENTRY_POINT_GROUP = "reinforge.rollout_engines"

ROLLOUT_ENGINES: dict[str, Any] = {"hf": "reinforge.rollout.hf:HFEngine",
                                   "native": "reinforge.rollout.native:NativeEngine"}
"""rollout.name -> the engine class, or "module:Class" until it is first asked for."""


def register_rollout_engine(name: str) -> Callable[[type], type]:
    def add(engine_class: type) -> type:
        if name in ROLLOUT_ENGINES:
            raise ValueError(f"rollout engine {name!r} is registered twice")
        ROLLOUT_ENGINES[name] = engine_class
        return engine_class
    return add


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {entry.name: entry for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def rollout_engine_names() -> list[str]:
    """Every name rollout.name may take: the registered engines and the installed entry points."""
    return sorted({*ROLLOUT_ENGINES, *_entry_points()})


class StopStringsHeld:
    """A plugin engine (``engine``) whose samples end at their stop strings (``SamplingParams.stop``) as the built-in
    engines' do: at the token whose text completes one, its ids, log-probs and alternatives cut after it,
    finish_reason 'stop' (``stop_strings.end_at_stop_string``; with ``ignore_eos`` no stop string ends a sample).
    Cutting afterwards is exact, since the tokens up to that one are those the engine sampled either way; a streamed
    sample's later tokens are not passed on. Everything else is the engine's own."""

    engine_class: type
    """The plugin's class, which ``from_config`` builds."""

    def __init__(self, engine: Any, tokenizer: Any):
        self.engine = engine
        self.decode = token_decoder(tokenizer) if tokenizer is not None else None

    @classmethod
    def from_config(cls, config: Any, *, model: Any, tokenizer: Any, device: Any) -> StopStringsHeld:
        return cls(cls.engine_class.from_config(config, model=model, tokenizer=tokenizer, device=device), tokenizer)

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (a copy being made): no engine to ask
            raise AttributeError(name)
        if name == "generate_async" and hasattr(self.engine, name):
            return self._generate_async
        return getattr(self.engine, name)

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        if not requests:  # the plugin is not asked: it might wake up (copy weights, allocate its cache) for nothing
            return []
        self._check(requests)
        return [[self._end(completion, request.sampling) for completion in completions]
                for request, completions in zip(requests, self.engine.generate(requests), strict=True)]

    async def _generate_async(self, request: GenerationRequest,
                              on_token: Callable[..., None] | None = None) -> list[Completion]:
        """The engine's ``generate_async``; ``on_token(sample_index, token_id, ...)`` hears no token of a sample after
        the one that completes a stop string."""
        self._check([request])
        sampling = request.sampling
        if on_token is None:
            completions = await self.engine.generate_async(request)
        else:
            if sampling.stop and not sampling.ignore_eos:
                on_token = self._stopped_stream(on_token, sampling.stop)
            completions = await self.engine.generate_async(request, on_token)
        return [self._end(completion, sampling) for completion in completions]

    def _stopped_stream(self, on_token: Callable[..., None], stop: tuple[str, ...]) -> Callable[..., None]:
        matchers: dict[int, StopStringMatcher] = {}
        ended: set[int] = set()
        decode = self.decode
        assert decode is not None  # _check refused stop strings without a tokenizer

        def forward(sample_index: int, token_id: int, *rest: Any) -> None:
            if sample_index in ended:
                return
            if matchers.setdefault(sample_index, StopStringMatcher(decode, stop)).add(token_id):
                ended.add(sample_index)
            on_token(sample_index, token_id, *rest)
        return forward

    def _end(self, completion: Completion, sampling: SamplingParams) -> Completion:
        if not sampling.stop or sampling.ignore_eos or self.decode is None:
            return completion
        return end_at_stop_string(completion, sampling.stop, self.decode)

    def _check(self, requests: list[GenerationRequest]) -> None:
        for request in requests:
            if request.sampling.stop and self.decode is None:
                raise ValueError(f"request {request.request_id!r} has stop strings {list(request.sampling.stop)} but "
                                 f"rollout engine {self.engine_class.__qualname__} was built without a tokenizer to "
                                 "read its samples' text; pass tokenizer= to its from_config")


_HELD: dict[type, type] = {}
"""A plugin's class -> its ``StopStringsHeld`` class (one each, so the class a worker builds is the one named)."""


def get_rollout_engine(name: str) -> type:
    """The engine class of ``rollout.name``, imported on first use; a plugin's inside ``StopStringsHeld``."""
    engine = _engine_class(name)
    if name in ("hf", "native"):
        return engine
    if engine not in _HELD:
        _HELD[engine] = type(engine.__name__, (StopStringsHeld,), {"engine_class": engine,
                                                                   "__module__": engine.__module__,
                                                                   "__qualname__": engine.__qualname__})
    return _HELD[engine]


def _engine_class(name: str) -> type:
    """The class registered or installed as ``rollout.name``, imported on first use."""
    if name not in ROLLOUT_ENGINES:
        entry = _entry_points().get(name)
        if entry is None:
            raise ValueError(f"rollout.name={name!r} is not a rollout engine; known: {', '.join(rollout_engine_names())} "
                             f"(a package adds one through the entry point group {ENTRY_POINT_GROUP!r})")
        try:
            ROLLOUT_ENGINES[name] = entry.load()
        except Exception as error:
            raise ValueError(f"rollout.name={name!r}: loading {entry.value!r} from the entry point group "
                             f"{ENTRY_POINT_GROUP!r} failed ({type(error).__name__}: {error}); fix or reinstall the "
                             f"package that provides it") from None
    engine = ROLLOUT_ENGINES[name]
    if isinstance(engine, str):
        module, _, attribute = engine.partition(":")
        engine = ROLLOUT_ENGINES[name] = getattr(importlib.import_module(module), attribute)
    return engine


def check_plugin_engine(name: str) -> None:
    """Raise one line when ``rollout.name`` names no engine, or a plugin engine that lacks a part of the contract."""
    engine = _engine_class(name)
    if name in ("hf", "native"):
        return
    missing = [part for part in ("from_config", "generate", "sync_weights", "wake_up", "sleep") if
               not callable(getattr(engine, part, None))]
    if not hasattr(engine, "reads_model_in_place"):
        missing.append("reads_model_in_place")
    if missing:
        raise ValueError(f"rollout.name={name!r}: {engine.__module__}.{engine.__qualname__} lacks "
                         f"{', '.join(missing)} of the RolloutEngine contract (reinforge.rollout.registry); add them")
