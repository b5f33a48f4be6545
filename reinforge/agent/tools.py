"""Tools an agent loop can call: a class interface, and plain typed Python functions as tools.

A tool has an OpenAI function schema (what the chat template shows the model) and a lifecycle
per trajectory: ``create`` an instance (with the row's ``extra_info.tools_kwargs[name].create_kwargs``),
``execute`` calls on it, each returning ``ToolResult(text, reward, metrics)``, then ``release``
it. A typed function with a Google-style docstring is a tool too (``FunctionTool``): its schema
comes from ``transformers.utils.get_json_schema``; synchronous functions run in a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple


class ToolResult(NamedTuple):
    text: str
    """What the model reads in the tool message."""
    reward: float | None = None
    """Optional reward of the call; the rewards of a trajectory's calls are summed into its score."""
    metrics: dict[str, float] = {}
    """Numbers summed per tool (``agent/tool/<name>/<key>``); ``tool_error`` marks a failed call, and ``service_error``
    one that failed because the tool's service did not run it (a sandbox down: the model's call was not at fault)."""
    images: tuple = ()
    """Images the model sees before the text, for a vision-language model (``agent/tool_images.py``): PIL images,
    encoded bytes, file paths or data URIs, as a dataset row's images."""


class ToolUnavailable(RuntimeError):
    """Raised by a tool whose service has stopped working (not by one whose call merely failed): the agent loop
    lets it through instead of showing it to the model, so the rollout stops and the run with it, with one line,
    rather than train on error messages. Checkpoints already written stay."""


class BaseTool:
    """Subclass and override ``execute`` (and ``create``/``release`` for per-trajectory state).

    config: the ``config`` mapping of the tool's YAML entry; schema: an OpenAI function schema
    ``{"type": "function", "function": {"name", "description", "parameters"}}``.
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        self.config = dict(config or {})
        if schema is None:
            raise ValueError(f"tool {type(self).__name__} has no tool_schema; give one in its YAML entry "
                             "(type: function, function: {name, description, parameters})")
        self.schema = check_schema(schema, type(self).__name__)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def check(self) -> None:
        """Raise ``ValueError`` (one line: what is wrong and the fix) when the tool cannot work at all, e.g. the
        service it calls does not answer. The trainer calls it once per tool before any model loads, so a run
        does not train for hours against a tool that only ever returns errors. The default checks nothing."""

    def kwargs_problem(self, create_kwargs: dict[str, Any], execute_kwargs: dict[str, Any]) -> str | None:
        """Why a row's ``create_kwargs`` / ``execute_kwargs`` cannot reach this tool (``create`` or ``execute``
        would raise TypeError at every call, each answered with an error message), or None. Only the names
        matter, so ``check_agent_rows`` asks once per set of names."""
        for method, args, kwargs in ((self.create, (), create_kwargs),
                                     (self.execute, ("instance", {}), execute_kwargs)):
            problem = _binding_problem(method, args, kwargs, partial=False)
            if problem is not None:
                return f"{type(self).__name__}.{method.__name__}() {problem}"
        return None

    def arguments_problem(self, arguments: dict[str, Any], execute_kwargs: dict[str, Any]) -> str | None:
        """Why the model's arguments (with the row's ``execute_kwargs``) cannot reach the tool, or None. The loop answers such a call with it as the
        model's mistake (``tool_error``), without running the tool: a tool that raised on them would count as a
        failing tool (``ToolFailureCheck``). The default checks nothing: a class reads its own arguments (verl's
        tools coerce them); ``FunctionTool`` checks them against its function."""
        return None

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Start a per-trajectory instance; returns its id."""
        return instance_id or uuid.uuid4().hex

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        raise NotImplementedError(f"{type(self).__name__} does not implement execute")

    async def release(self, instance_id: str) -> None:
        """End the instance; free what ``create`` made."""


JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: (isinstance(value, int) and not isinstance(value, bool))
    or (isinstance(value, float) and value.is_integer()),
    "number": lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    "boolean": lambda value: isinstance(value, bool),
    "array": lambda value: isinstance(value, list),
    "object": lambda value: isinstance(value, dict),
    "null": lambda value: value is None,
}


def _fits_json_type(value: Any, spec: dict[str, Any]) -> bool:
    """Whether ``value`` is of the JSON type(s) a schema property names (a property without a known type fits all;
    ``nullable`` lets None through, as transformers' get_json_schema writes an Optional)."""
    types = spec.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    known = [JSON_TYPES[name] for name in types if isinstance(name, str) and name in JSON_TYPES]
    if not known or (value is None and spec.get("nullable")):
        return True
    return any(check(value) for check in known)


def schema_arguments_problem(schema: dict[str, Any], arguments: dict[str, Any],
                             given: dict[str, Any] | None = None) -> str | None:
    """Why ``arguments`` do not fit an OpenAI function schema (a required one missing, one it forbids, a value of
    another JSON type than its property's), or None. ``given``: arguments the row supplies (``execute_kwargs``),
    which count as present."""
    parameters = schema["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required") or () if name not in arguments and name not in (given or {})]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))}"
    if parameters.get("additionalProperties") is False:
        unknown = [name for name in arguments if name not in properties]
        if unknown:
            return f"unknown argument(s) {', '.join(map(repr, unknown))}; it takes {', '.join(map(repr, properties))}"
    for name, value in arguments.items():
        spec = properties.get(name)
        if isinstance(spec, dict) and not _fits_json_type(value, spec):
            return f"argument {name!r} is {json.dumps(value)[:40]}, not of type {spec['type']}"
    return None


def _binding_problem(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any], partial: bool) -> str | None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    try:
        (signature.bind_partial if partial else signature.bind)(*args, **kwargs)
    except TypeError as error:
        return f"cannot take keyword arguments {sorted(kwargs)}: {error}"
    return None


def check_schema(schema: dict[str, Any], where: str) -> dict[str, Any]:
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"the tool schema of {where} is {schema!r}; expected an OpenAI function schema "
                         '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}')
    parameters = function.get("parameters")
    problem = None
    if parameters is not None and not isinstance(parameters, dict):
        problem = f"its parameters are {parameters!r}, not a mapping"
    elif parameters is not None and not isinstance(parameters.get("properties") or {}, dict):
        problem = f"its parameters' properties are {parameters['properties']!r}, not a mapping of names to schemas"
    elif parameters is not None and not (isinstance(parameters.get("required") or [], list) and all(
            isinstance(name, str) for name in parameters.get("required") or [])):
        problem = f"its parameters' required is {parameters['required']!r}, not a list of names"
    if problem is not None:  # every call would fail on it, or the model would read a wrong schema
        raise ValueError(f"the tool schema of {where} ({function['name']!r}): {problem}; write parameters: "
                         "{type: object, properties: {NAME: {type: ..., description: ...}}, required: [NAME, ...]}")
    return {"type": schema.get("type", "function"), "function": function}


def as_tool_result(value: Any) -> ToolResult:
    """A tool's return value as a ToolResult: text, (text, reward), (text, reward, metrics), a dict or a number.

    Metrics that are not a mapping of names to numbers raise ValueError (the loop answers the call with it)
    rather than fail later, where they would stop the whole rollout."""
    if isinstance(value, ToolResult):
        text, reward, metrics, images = value
        return ToolResult(_as_text(text), None if reward is None else float(reward), _as_metrics(metrics),
                          _as_images(images))
    elif isinstance(value, tuple) and 1 <= len(value) <= 3:
        text, reward, metrics = (*value, None, None)[:3]
    else:
        text, reward, metrics = value, None, None
    return ToolResult(_as_text(text), None if reward is None else float(reward), _as_metrics(metrics))


def _as_images(images: Any) -> tuple:
    """A result's images as RGB PIL images, read as a dataset row's are (a PIL image, bytes, a file path, a data
    URI; ``data.multimodal.load_image``). One that cannot be read, or a web address, raises ValueError with what to
    return instead: the loop answers the call with it, as any failed call, instead of stopping the rollout."""
    from reinforge.data.multimodal import load_image

    if images is None:
        return ()
    if isinstance(images, str | bytes | bytearray | dict) or not isinstance(images, list | tuple):
        images = (images,)  # one image given alone, not in a tuple
    return tuple(load_image(image, "the tool's result", number) for number, image in enumerate(images))


def _as_metrics(metrics: Any) -> dict[str, float]:
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        try:
            return {str(key): float(value) for key, value in metrics.items()}
        except (TypeError, ValueError):
            pass
    raise ValueError(f"the tool returned metrics {metrics!r}; they must map names to numbers")


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):  # a subprocess's output, say: its text, not its repr
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, dict | list):  # the model reads its characters as they are, not as \u escapes
        return json.dumps(value, ensure_ascii=False, default=_json_value)
    return str(value)


def _json_value(value: Any) -> Any:
    """A value json cannot write, as one it can: a numpy scalar's or array's Python value, else its text (a tool's
    dict holding an np.int64 or a datetime is an answer, not a failed call)."""
    for method in ("tolist", "item"):
        convert = getattr(value, method, None)
        if callable(convert):
            try:
                return convert()
            except Exception:  # noqa: BLE001  (not numpy's: its text will do)
                pass
    return str(value)


class FunctionTool(BaseTool):
    """A plain typed function as a tool: ``FunctionTool(multiply)``.

    The function needs type hints and a Google-style docstring with an ``Args:`` section (for the
    schema); it may be async. It returns text, ``(text, reward)``, ``(text, reward, metrics)`` or
    anything ``str()`` renders. Per-row ``execute_kwargs`` are passed as extra keyword arguments.
    """

    def __init__(self, function: Callable[..., Any], config: dict[str, Any] | None = None,
                 schema: dict[str, Any] | None = None):
        if schema is None:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(function)
            except Exception as error:
                raise ValueError(f"cannot build a tool schema from {getattr(function, '__qualname__', function)!r}: "
                                 f"{error}; give it type hints and a Google-style docstring with an Args: section"
                                 ) from None
        super().__init__(config, schema)
        self.function = function
        parameters = self.schema["function"].get("parameters") or {}
        properties = [*(parameters.get("properties") or {}), *(parameters.get("required") or ())]
        problem = _binding_problem(function, (), dict.fromkeys(properties), partial=True)
        if problem is not None:  # every call that used the schema's arguments would fail, each the model's "mistake"
            name = getattr(function, "__qualname__", "the function")
            raise ValueError(f"the tool schema of {name} names arguments {', '.join(map(repr, dict.fromkeys(properties)))}, but "
                             f"{name}() {problem}; make the schema's properties the function's parameters")

    def kwargs_problem(self, create_kwargs: dict[str, Any], execute_kwargs: dict[str, Any]) -> str | None:
        """execute_kwargs reach the function itself, beside the model's arguments: each must be one of its
        parameters (or it takes **kwargs)."""
        problem = _binding_problem(self.function, (), execute_kwargs, partial=True)
        name = getattr(self.function, "__qualname__", "the function")
        return None if problem is None else f"{name}() {problem}"

    def arguments_problem(self, arguments: dict[str, Any], execute_kwargs: dict[str, Any]) -> str | None:
        """The arguments against the schema (made from the function's type hints), then with the row's execute_kwargs
        against its signature, as ``execute`` calls it."""
        problem = schema_arguments_problem(self.schema, arguments, execute_kwargs)
        if problem is not None:
            return problem
        try:
            inspect.signature(self.function).bind(**arguments, **execute_kwargs)
        except TypeError as error:
            properties = (self.schema["function"].get("parameters") or {}).get("properties") or {}
            return f"{error}; it takes {', '.join(map(repr, properties))}"
        except ValueError:  # a builtin without a signature: nothing to check
            pass
        return None

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        try:  # a tool's sys.exit() must not end the event loop (nor the run): it is a failed call like any other
            if inspect.iscoroutinefunction(self.function):
                value = await self.function(**arguments, **execute_kwargs)
            else:
                value = await _in_daemon_thread(self.function, **arguments, **execute_kwargs)
        except SystemExit as error:
            raise RuntimeError(f"the tool called exit({error.code})") from None
        return as_tool_result(value)


async def _in_daemon_thread(function: Callable[..., Any], **kwargs: Any) -> Any:
    """``function(**kwargs)`` in a daemon thread of its own: a call that never returns can be left behind at a
    timeout (asyncio.to_thread's pool is joined when asyncio.run ends, and at exit, so one hung call hangs the run)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def target() -> None:
        try:
            value, error = function(**kwargs), None
        except BaseException as raised:  # noqa: BLE001  (handed to the awaiting task)
            value, error = None, raised
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop has closed: nobody waits for the call's answer any more
            pass

    threading.Thread(target=target, name=f"tool-{getattr(function, '__name__', 'call')}", daemon=True).start()
    return await future


def as_tool(item: BaseTool | Callable[..., Any]) -> BaseTool:
    """A BaseTool as it is; a function wrapped in FunctionTool."""
    if isinstance(item, BaseTool):
        return item
    if callable(item):
        return FunctionTool(item)
    raise TypeError(f"{item!r} is neither a BaseTool nor a function")
