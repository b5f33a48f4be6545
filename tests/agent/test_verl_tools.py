"""verl's tool configs load as they are: its GSM8K tool and its SandboxFusion tools as reinforge's equivalents."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from reinforge.agent.code_interpreter import CodeInterpreterTool
from reinforge.agent.gsm8k_tool import Gsm8kTool
from reinforge.agent.tool_config import load_tool_config

CHECK_ANSWER = {"type": "function", "function": {
    "name": "calc_gsm8k_reward", "description": "Check the answer.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
RUN_CODE = {"type": "function", "function": {
    "name": "code_interpreter", "description": "Run code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def write_tools(tmp_path, *entries):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": list(entries)}))
    return path


def test_verls_gsm8k_tool_scores_answers_and_penalises_no_improvement(tmp_path):
    tools = load_tool_config(write_tools(tmp_path, {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool",
                                                    "config": {"type": "native"}, "tool_schema": CHECK_ANSWER}))
    tool = tools["calc_gsm8k_reward"]
    assert isinstance(tool, Gsm8kTool)

    async def calls():
        instance = await tool.create(ground_truth="72")
        results = [await tool.execute(instance, {"answer": answer}) for answer in ("71", "72", "#### 72", "70", 72)]
        await tool.release(instance)
        return results

    results = asyncio.run(calls())
    assert [result.reward for result in results] == [-0.05, 0.0, -0.05, -0.05, 0.0]
    assert [result.metrics["correct"] for result in results] == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert "reward=1.0" in results[1].text


@pytest.mark.parametrize("class_name", ["verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                                        "recipe.retool.retool.CustomSandboxFusionTool"])
def test_verls_sandbox_tools_are_the_code_interpreter_with_their_keys_renamed(tmp_path, class_name):
    config = {"sandbox_fusion_url": "http://127.0.0.1:1/run_code", "num_workers": 8, "enable_global_rate_limit": True,
              "rate_limit": 8, "default_timeout": 30, "default_language": "python", "memory_limit_mb": 1024,
              "type": "native"}
    tool = load_tool_config(write_tools(tmp_path, {"class_name": class_name, "config": config,
                                                   "tool_schema": RUN_CODE}))["code_interpreter"]
    assert isinstance(tool, CodeInterpreterTool)
    assert (tool.client.url, tool.run_timeout_s, tool.memory_limit_mb) == ("http://127.0.0.1:1/run_code", 30.0, 1024)
    assert tool._executor._max_workers == 8


@pytest.mark.parametrize(("change", "message"), [
    ({"default_language": "cpp"}, "default_language='cpp'; the code_interpreter tool runs python only"),
    ({"sandbox_region": "eu"}, "has keys sandbox_region, which the code_interpreter tool does not take"),
])
def test_a_verl_sandbox_setting_without_equivalent_names_itself(tmp_path, change, message):
    entry = {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "tool_schema": RUN_CODE,
             "config": {"sandbox_fusion_url": "http://127.0.0.1:1", **change}}
    with pytest.raises(ValueError, match=message):
        load_tool_config(write_tools(tmp_path, entry))


def test_a_verl_tool_without_an_equivalent_is_refused_by_name(tmp_path):
    entry = {"class_name": "verl.tools.search_tool.SearchTool", "tool_schema": RUN_CODE,
             "config": {"retrieval_service_url": "http://127.0.0.1:1/retrieve", "type": "native"}}
    path = write_tools(tmp_path, entry)
    with pytest.raises(ValueError) as refusal:
        load_tool_config(path)
    assert str(refusal.value) == (
        f"tool 0 of {path}: verl.tools.search_tool.SearchTool is a verl tool without a reinforge equivalent (those "
        "are verl.tools.gsm8k_tool.Gsm8kTool, verl.tools.sandbox_fusion_tools.SandboxFusionTool, "
        "recipe.retool.retool.CustomSandboxFusionTool); port it as a reinforge BaseTool subclass or a typed function "
        "(see reinforge/agent/tools.py) and name it by package.module.Name or file.py:Name")
