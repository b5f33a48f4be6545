"""Tools: the class interface, typed functions with schemas from their docstrings, and the YAML config."""

from __future__ import annotations

import asyncio
import re

import pytest

from reinforge.agent import BaseTool, FunctionTool, ToolResult, load_tool_config


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


async def scored_lookup(key: str, table: dict | None = None) -> tuple[str, float]:
    """Look a key up.

    Args:
        key: The key.
        table: The table (given per row through tools_kwargs).
    """
    return (table or {}).get(key, "missing"), 0.25


COUNTER_SOURCE = '''
class Counter(BaseTool):
    """A tool with per-trajectory state: counts its calls per instance."""

    def __init__(self, config, schema):
        super().__init__(config, schema)
        self.counts: dict[str, int] = {}
        self.released: list[str] = []

    async def create(self, instance_id=None, start: int = 0, **kwargs):
        instance_id = await super().create(instance_id)
        self.counts[instance_id] = start
        return instance_id

    async def execute(self, instance_id, arguments, **kwargs):
        self.counts[instance_id] += self.config.get("step", 1)
        return ToolResult(str(self.counts[instance_id]), None, {"count": float(self.counts[instance_id])})

    async def release(self, instance_id):
        self.released.append(instance_id)
'''


def test_function_tool_schema_comes_from_type_hints_and_docstring():
    tool = FunctionTool(multiply)
    assert tool.name == "multiply"
    function = tool.schema["function"]
    assert function["description"] == "Multiply two integers."
    assert function["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first factor."}
    assert function["parameters"]["required"] == ["a", "b"]
    assert asyncio.run(tool.execute("x", {"a": 12, "b": 34})) == ToolResult("408")


def test_function_tool_returns_text_and_reward_and_takes_row_kwargs():
    tool = FunctionTool(scored_lookup)
    result = asyncio.run(tool.execute("x", {"key": "k"}, table={"k": "v"}))
    assert result == ToolResult("v", 0.25, {})


def test_a_tools_dict_is_shown_with_its_characters_and_numpy_values():
    import datetime

    import numpy as np

    from reinforge.agent.tools import as_tool_result

    value = {"n": np.int64(3), "xs": np.arange(2), "city": "Z\u00fcrich", "at": datetime.date(2026, 1, 2)}
    assert as_tool_result(value).text == '{"n": 3, "xs": [0, 1], "city": "Z\u00fcrich", "at": "2026-01-02"}'


def test_a_schema_naming_arguments_the_function_does_not_take_is_refused_when_loaded():
    schema = {"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match=r"the tool schema of multiply names arguments 'x', 'y', but multiply\(\) cannot "
                                         r"take keyword arguments \['x', 'y'\]"):
        FunctionTool(multiply, schema=schema)  # every call failed as the model's mistake, no tool failure counted


def test_function_without_docstring_is_explained():
    def bare(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="cannot build a tool schema from .*bare.*Google-style docstring"):
        FunctionTool(bare)


def test_yaml_config_loads_classes_and_functions(tmp_path):
    module = tmp_path / "my_tools.py"
    module.write_text(
        "from reinforge.agent import BaseTool, ToolResult\n\n"
        + COUNTER_SOURCE +
        "def add(a: int, b: int) -> str:\n"
        "    \"\"\"Add.\n\n    Args:\n        a: first\n        b: second\n    \"\"\"\n"
        "    return str(a + b)\n")
    config = tmp_path / "tools.yaml"
    config.write_text(
        "tools:\n"
        f"  - class_name: {module}:Counter\n"
        "    config: {step: 2}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function: {name: counter, description: counts, parameters: {type: object, properties: {}}}\n"
        f"  - class_name: {module}:add\n")
    tools = load_tool_config(config)
    assert sorted(tools) == ["add", "counter"]
    counter = tools["counter"]
    instance = asyncio.run(counter.create(start=5))
    assert asyncio.run(counter.execute(instance, {})).text == "7"
    assert asyncio.run(tools["add"].execute("x", {"a": 2, "b": 3})).text == "5"


@pytest.mark.parametrize("text, message", [
    ("tools: []\n", "has no 'tools' list"),
    ("tools:\n  - config: {}\n", "needs a 'class_name'"),
    ("tools:\n  - class_name: no_such_module_xyz.Tool\n", "cannot import 'no_such_module_xyz'"),
    ("tools:\n  - class_name: reinforge.agent.BaseTool\n", "has no tool_schema"),
    ("tools:\n  - class_name: reinforge.agent.nothing_here\n", "names nothing"),
    ("tools:\n  - class_name: [unclosed\n", r"is not valid YAML at line 3, column 1 \(expected ',' or '\]'"),
    ("tools:\n  - class_name: a.B\n    class_name: c.D\n",
     r"is not valid YAML at line 3, column 5 \(the key 'class_name' is given twice in one mapping \(first on line 2\)"),
    ("tools:\n  - class_name: reinforge.agent.code_interpreter.CodeInterpreterTool\n    config: {run_timeout_s: 5}\n",
     r"tool 0 of .*: making reinforge.agent.code_interpreter.CodeInterpreterTool from its config .* failed: "
     r"ValueError: the code_interpreter tool needs config.sandbox_url"),
    ("tools:\n  - class_name: no/such/tools.py:add\n",
     r"tool 0 of .*: the file 'no/such/tools.py' of 'no/such/tools.py:add' does not exist \(looked for /.*/no/such/"
     r"tools.py; a relative path is the working directory's\)"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: [a, b]\n",
     r"tool 0 of .*: config is \['a', 'b'\]; it must be a mapping"),
    ("tools:\n  - class_name: reinforge.agent.gsm8k_tool.Gsm8kTool\n    cofnig: {type: native}\n",
     "tool 0 of .* has key.s. cofnig; a tool entry's keys are class_name, config, tool_schema"),
    ("tools:\n  - class_name: reinforge.agent.gsm8k_tool.Gsm8kTool\n    tool_schema: {type: function, function: "
     "{name: x, parameters: {type: object, properties: {code: {type: string}}, required: code}}}\n",
     "the tool schema of Gsm8kTool .'x'.: its parameters' required is 'code', not a list of names"),
    ("tools:\n  - class_name: reinforge.agent.gsm8k_tool.Gsm8kTool\n    tool_schema: {type: function, function: "
     "{name: x, parameters: [code]}}\n", r"its parameters are \['code'\], not a mapping"),
    (b"tools:\n  - class_name: caf\xe9.Tool\n", "is not UTF-8 text .byte 26: invalid continuation byte.; save it as UTF-8"),
])
def test_bad_yaml_config_is_explained(tmp_path, text, message):
    config = tmp_path / "tools.yaml"
    config.write_bytes(text) if isinstance(text, bytes) else config.write_text(text)
    with pytest.raises(ValueError, match=message) as raised:
        load_tool_config(config)
    assert "\n" not in str(raised.value)


def test_missing_config_file_is_explained(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="tool_config_path=.*does not exist"):
        load_tool_config(tmp_path / "nope.yaml")
    # a relative path is read from the working directory: the line says where it looked
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    with pytest.raises(ValueError, match=re.escape(f"does not exist (looked for {tmp_path / 'run' / 'tools.yaml'}); "
                                                   "point it at a YAML file with a 'tools' list, by a path relative "
                                                   "to the working directory or absolute")):
        load_tool_config("tools.yaml")
    with pytest.raises(ValueError, match=r"tool_config_path='\.\.' is a folder; point it at the YAML file"):
        load_tool_config("..")


@pytest.mark.parametrize("extra_info, message", [
    ({"tools_kwargs": "multiply"}, r"train row 3 has extra_info.tools_kwargs of type str; it must map each tool's name"),
    ({"tools_kwargs": {"multiply": ["x"]}}, r"train row 3: extra_info.tools_kwargs\['multiply'\] is a list; it must be"),
    ({"tools_kwargs": {"multiply": {"create_kwargs": "x"}}},
     r"train row 3: extra_info.tools_kwargs\['multiply'\] has create_kwargs='x'; it must be"),
    ({"tools_kwargs": {"calc": {}}}, r"train row 3 has extra_info.tools_kwargs for 'calc', which is not in the tool "),
])
def test_malformed_tools_kwargs_fail_before_training_naming_the_row(extra_info, message):
    from reinforge.agent import check_agent_rows

    tools = {"multiply": FunctionTool(multiply)}
    check_agent_rows([("train row 2", "tool_agent", {"tools_kwargs": {"multiply": {"execute_kwargs": {"a": 1}}}})],
                     tools)
    with pytest.raises(ValueError, match=message):
        check_agent_rows([("train row 3", "tool_agent", extra_info)], tools)


def test_an_unknown_tool_call_format_is_refused_before_training_even_without_tool_rows():
    from reinforge.agent import check_tools

    check_tools("hermes", {"multiply": FunctionTool(multiply)})
    with pytest.raises(ValueError, match=r"rollout.multi_turn.format='xml_calls' is not a known tool-call format; "
                                         r"known: .*hermes"):
        check_tools("xml_calls", {})


def test_a_tool_file_that_fails_to_import_names_the_config_entry(tmp_path):
    broken = tmp_path / "broken_tools.py"
    broken.write_text("def add(a: int) -> str\n    return a\n")
    config = tmp_path / "tools.yaml"
    config.write_text(f"tools:\n  - class_name: {broken}:add\n")
    with pytest.raises(ValueError, match=r"tool 0 of .*tools.yaml.*importing .*broken_tools.py.* failed \(SyntaxError") \
            as raised:
        load_tool_config(config)
    assert "\n" not in str(raised.value)
    import sys

    assert not any(getattr(module, "__file__", None) == str(broken) for module in list(sys.modules.values()))


def test_rows_may_carry_none_for_the_tools_they_do_not_use():
    """Parquet gives every row every tool's key of a struct column, None where a row does not use the tool."""
    from reinforge.agent import check_agent_rows

    check_agent_rows([("train row 0", "tool_agent", {"tools_kwargs": {"multiply": {"execute_kwargs": {"a": 1}},
                                                                       "other": None}})],
                     {"multiply": FunctionTool(multiply)})


def test_tools_that_fail_every_call_stop_the_run_after_some_rollouts():
    from reinforge.agent.loop import AgentLoopOutput
    from reinforge.agent.runner import TOOL_FAILURE_STEPS, ToolFailure, ToolFailureCheck

    def rollout(raised: int, calls: int = 10, malformed: int = 0, cut: int = 0):
        metrics = {"num_tool_calls": float(calls + malformed), "tool_errors": float(raised + malformed),
                   "tool_raised": float(raised), "tool_calls_cut": float(cut)}
        return [AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], response_log_probs=[0.0],
                                num_turns=2, metrics=metrics)]

    check = ToolFailureCheck(["calc"])
    check(rollout(raised=10))
    check(rollout(raised=9))  # one call answered: the count starts again
    check(rollout(raised=10))
    check(rollout(raised=5, calls=10, cut=5))  # five of the calls that ran were answered; cut ones never ran
    check(rollout(raised=3, calls=3))  # too few calls to say
    for _ in range(TOOL_FAILURE_STEPS - 1):
        check(rollout(raised=10, malformed=5))  # malformed calls never reached the tool
    with pytest.raises(ToolFailure, match=r"every one of the 10 tool calls .* \(tools: calc\)"):
        check(rollout(raised=10))


class Needs(BaseTool):
    """create needs a level; execute takes no extra keyword."""

    async def create(self, instance_id=None, *, level):
        return "instance"

    async def execute(self, instance_id, arguments):
        return "ok"


NEEDS_SCHEMA = {"type": "function", "function": {"name": "needs", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra_info, message", [
    ({"tools_kwargs": {"multiply": {"execute_kwargs": {"c": 1}}}},
     r"train row 3: the tool 'multiply' gets .*, but multiply\(\) cannot take keyword arguments \['c'\]"),
    ({"tools_kwargs": {"needs": {"create_kwargs": {"levle": 1}}}},
     r"train row 3: the tool 'needs' gets .*, but Needs.create\(\) cannot take keyword arguments \['levle'\]: "
     r"missing a required argument: 'level'; fix the row's tools_kwargs"),
    (None, r"Needs.create\(\) cannot take keyword arguments \[\]: missing a required argument: 'level'"),
    ({"tools_kwargs": {"needs": {"create_kwargs": {"level": 1}, "execute_kwargs": {"x": 1}}}},
     r"Needs.execute\(\) cannot take keyword arguments \['x'\]"),
])
def test_tools_kwargs_a_tool_cannot_take_fail_before_training(extra_info, message):
    from reinforge.agent import check_agent_rows

    tools = {"multiply": FunctionTool(multiply), "needs": Needs({}, NEEDS_SCHEMA)}
    good = {"tools_kwargs": {"multiply": {"execute_kwargs": {"a": 1}}, "needs": {"create_kwargs": {"level": 2}}}}
    check_agent_rows([("train row 2", "tool_agent", good), ("train row 4", "single_turn", extra_info)], tools)
    with pytest.raises(ValueError, match=message) as raised:
        check_agent_rows([("train row 2", "tool_agent", good), ("train row 3", "tool_agent", extra_info)], tools)
    assert "\n" not in str(raised.value)


class Blocking(BaseTool):
    def execute(self, instance_id, arguments, **execute_kwargs):  # not async: every call would fail
        return "ok"


def test_a_tool_whose_execute_is_not_async_is_refused_before_training():
    from reinforge.agent import check_tools

    with pytest.raises(ValueError, match=r"tool 'needs': Blocking.execute is not an async function; write "
                                         r"`async def execute\(...\)`"):
        check_tools("hermes", {"multiply": FunctionTool(multiply), "needs": Blocking({}, NEEDS_SCHEMA)})


class CheckRaises(BaseTool):
    def check(self):
        raise ConnectionError("connection refused")

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return "ok"


def test_a_tool_check_that_raises_a_non_value_error_is_one_line_naming_the_tool():
    from reinforge.agent import check_tools

    with pytest.raises(ValueError, match=r"^tool 'needs' \(CheckRaises\) cannot work: its check\(\) raised "
                                         r"ConnectionError: connection refused; fix the tool"):
        check_tools("hermes", {"needs": CheckRaises({}, NEEDS_SCHEMA)})
