"""The agent demo: its task and tool, and a shortened GRPO run that raises held-out accuracy."""

from __future__ import annotations

import json

import pytest

from reinforge.demo.agent_reward import compute_score
from reinforge.demo.agent_task import AGENT_MODEL_DIR, TOOL_CALL, AgentDemoTask, calc
from reinforge.demo.task import MODEL_CARD


def test_task_rows_conversations_and_tool(tmp_path):
    task = AgentDemoTask(num_train=50, num_test=20, num_sft=200)
    files = task.write(tmp_path)
    test_rows = [json.loads(line) for line in open(files["test"])]
    train_prompts = {json.loads(line)["prompt"][0]["content"] for line in open(files["train"])}
    test_prompts = {row["prompt"][0]["content"] for row in test_rows}
    assert len(test_prompts) == 20 and not test_prompts & train_prompts
    assert all(row["agent_name"] == "tool_agent" for row in test_rows)
    assert test_rows[0]["extra_info"]["tools_kwargs"]["calc"]["execute_kwargs"]["e"] == test_rows[0]["prompt"][0][
        "content"]
    conversations = [json.loads(line)["messages"] for line in open(files["sft_train"])]
    assert all(messages[1]["content"] == TOOL_CALL and messages[2]["content"] == calc(messages[0]["content"])
               for messages in conversations)
    rounded = [m for m in conversations if m[3]["content"] != m[2]["content"]]
    assert 0.5 < len(rounded) / len(conversations) < 0.7
    assert all(int(m[3]["content"]) % 100 == 0 for m in rounded)
    assert calc("482*317") == "152794"
    with pytest.raises(ValueError, match="digits joined by"):
        calc("__import__('os')")


def test_score_reads_the_last_line_of_the_whole_response():
    assert compute_score("<tool_call>...</tool_call>\ntool\n152794\nassistant\n152794", "152794")["acc"]
    assert not compute_score("<tool_call>...</tool_call>\ntool\n152794\nassistant\n15279", "152794")["acc"]
    assert compute_score("152794", "152794")["score"] == 1.0


@pytest.mark.slow
@pytest.mark.skipif(not (AGENT_MODEL_DIR / MODEL_CARD).is_file(),
                    reason="the agent demo model is not built; run python -m reinforge.demo.agent_build")
def test_shortened_agent_demo_raises_held_out_accuracy(tmp_path):
    from reinforge.demo.agent_runner import AgentDemoSettings, run_agent_demo

    settings = AgentDemoSettings(total_steps=4, train_batch_size=8, n=8, test_every=4, save_every=4, num_val=40)
    result = run_agent_demo(tmp_path / "run", settings=settings, device="cpu", loggers=("jsonl",), plots=False)
    assert result["after"] >= result["before"] + 0.2, result  # 14.5% before; about 80% after 16 steps


@pytest.mark.skipif(not (AGENT_MODEL_DIR / MODEL_CARD).is_file(),
                    reason="the agent demo model is not built; run python -m reinforge.demo.agent_build")
def test_committed_agent_model_matches_its_build_command():
    from dataclasses import asdict

    from reinforge.demo.agent_build import AGENT_MODEL, AGENT_SFT, BUILD_COMMAND
    from reinforge.demo.agent_task import AGENT_TASK

    card = json.loads((AGENT_MODEL_DIR / MODEL_CARD).read_text())
    assert card["rebuild_command"] == BUILD_COMMAND
    assert card["sft"] == asdict(AGENT_SFT) and card["model"] == asdict(AGENT_MODEL)
    assert card["task"] == json.loads(json.dumps(asdict(AGENT_TASK)))
    assert card["held_out_accuracy"] <= 0.3  # the flaw is there for RL to fix


@pytest.mark.slow
@pytest.mark.skipif(not (AGENT_MODEL_DIR / MODEL_CARD).is_file(),
                    reason="the agent demo model is not built; run python -m reinforge.demo.agent_build")
def test_the_openai_client_agent_trains_as_tool_agent_does(tmp_path):
    """The same rows run by tool_agent and by the openai-client agent through the endpoint: the same run."""
    import dataclasses

    from reinforge.demo.agent_runner import AgentDemoSettings, run_agent_demo

    settings = AgentDemoSettings(total_steps=2, train_batch_size=4, n=4, test_every=2, save_every=2, num_val=16)
    runs = {}
    for name, openai in (("tool_agent", False), ("openai", True)):
        result = run_agent_demo(tmp_path / name, settings=dataclasses.replace(settings, openai=openai), device="cpu",
                                loggers=("jsonl",), plots=False)
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (result["before"], result["after"],
                      [(row.get("critic/score/mean"), row.get("num_turns/mean"), row.get("response_length/mean"))
                       for row in metrics])
    assert runs["openai"] == runs["tool_agent"]
