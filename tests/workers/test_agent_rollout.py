"""The actor-rollout worker runs agent rows as multi-turn trajectories, on both engines, and trains on them.

The tiny model is random, so it never writes a Hermes call: these tests register a parser
that reads every assistant turn as a call to ``echo`` with the turn's first characters, and
stop turns at any lowercase letter (rollout.stop_token_ids) so that they are short. The tool
turns are then real: rendered by the chat template, appended with response_mask 0.
"""

from __future__ import annotations

import json

import pytest
import torch

from reinforge.agent import TOOL_PARSERS, ToolCall, register_tool_parser
from reinforge.config.schema import Config
from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams
from reinforge.workers.actor_rollout import ActorRolloutWorker

TOOLS_PY = '''
def echo(text: str) -> str:
    """Echo the text.

    Args:
        text: The text.
    """
    return "echo:" + text
'''

LETTER_IDS = [3 + byte for byte in range(ord("a"), ord("z") + 1)]


@pytest.fixture(autouse=True)
def every_turn_calls_echo():
    @register_tool_parser("test_every_turn")
    class EveryTurn:
        def parse(self, text):
            return [ToolCall("echo", {"text": text[:4]})]

    yield
    del TOOL_PARSERS["test_every_turn"]


@pytest.fixture
def tool_config(tmp_path):
    (tmp_path / "echo_tools.py").write_text(TOOLS_PY)
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {tmp_path / 'echo_tools.py'}:echo\n")
    return path


def agent_config(model_dir, tool_config, backend: str) -> Config:
    config = Config()
    config.model.path = str(model_dir)
    config.trainer.device = "cpu"
    config.rollout.name = backend
    config.rollout.stop_token_ids = LETTER_IDS
    config.data.max_prompt_length, config.data.max_response_length = 32, 160
    config.rollout.multi_turn.tool_config_path = str(tool_config)
    config.rollout.multi_turn.format = "test_every_turn"
    config.rollout.multi_turn.max_assistant_turns = 3
    return config


def prompt_batch(tokenizer, rows: int = 4, samples: int = 2) -> Batch:
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{i}+{i}"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for i in range(rows)]
    width = max(len(p) for p in prompts)
    ids = torch.full((rows, width), tokenizer.pad_token_id)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    batch = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                            non_tensors={"uid": [f"u{i}" for i in range(rows)], "agent_name": ["tool_agent"] * rows,
                                         "extra_info": [{}] * rows, "raw_prompt": [None] * rows})
    return batch.repeat(samples, interleave=True)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_agent_rows_become_trajectories_whose_log_probs_the_trainer_reproduces(tiny_model_dir, tool_config, backend):
    worker = ActorRolloutWorker(agent_config(tiny_model_dir, tool_config, backend), total_training_steps=1)
    batch = prompt_batch(worker.tokenizer)
    output = worker.generate(batch, SamplingParams(max_tokens=160, temperature=1.0), seed=5)
    mask, in_response = output["response_mask"], output["attention_mask"][:, output["prompts"].shape[1]:]
    turns = output["num_turns"]
    assert all(2 <= t <= 6 for t in turns) and any(t > 2 for t in turns)
    assert torch.all(mask <= in_response)
    assert (in_response.float() - mask).sum() > 0  # tool tokens: in the response, not sampled
    assert torch.all(output["rollout_log_probs"][mask == 0] == 0)
    metrics = output.meta["rollout_metrics"]
    assert metrics["agent/num_tool_calls/mean"] > 0 and "timing_s/agent_loop/tool_calls/max" in metrics
    assert "num_turns/mean" in metrics
    assert metrics["rollout/num_generated_tokens"] == float(mask.sum())  # sampled tokens only, tool tokens not
    assert metrics["rollout/tokens_per_s"] == pytest.approx(float(mask.sum()) / metrics["rollout/time_s"])
    if backend == "native":  # later turns read their trajectory's earlier blocks from the prefix cache
        assert metrics["rollout/prefix_cache_hit_tokens"] > 0 and 0 < metrics["rollout/prefix_cache_hit_rate"] < 1
        assert metrics["rollout/prefill_tokens"] > 0
    else:
        assert "rollout/prefix_cache_hit_tokens" not in metrics
    # every trajectory is one token stream: tool text where the mask is 0, the trainer's log-probs where it is 1
    texts = worker.tokenizer.batch_decode([row[keep.bool()] for row, keep in
                                           zip(output["responses"], in_response, strict=True)])
    assert any("tool\necho:" in text for text in texts)  # the tiny tokenizer's ChatML: <|im_start|>tool\n...
    scored = worker.compute_log_prob(output)["old_log_probs"]
    valid = mask.bool()
    torch.testing.assert_close(scored[valid], output["rollout_log_probs"][valid], atol=2e-4, rtol=1e-4)


def test_same_seed_same_trajectories_on_hf(tiny_model_dir, tool_config):
    worker = ActorRolloutWorker(agent_config(tiny_model_dir, tool_config, "hf"), total_training_steps=1)
    batch = prompt_batch(worker.tokenizer, rows=2)
    first = worker.generate(batch, SamplingParams(max_tokens=160), seed=3)
    second = worker.generate(batch, SamplingParams(max_tokens=160), seed=3)
    assert torch.equal(first["responses"], second["responses"])


def test_training_on_tool_trajectories_end_to_end(tiny_model_dir, tool_config, tmp_path):
    from reinforge.cli import main

    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": f"{i}+{i}"}], "agent_name": "tool_agent",
             "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {}} for i in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    scorer = tmp_path / "score.py"
    scorer.write_text("def compute_score(solution_str, ground_truth, **kwargs):\n"
                      "    return float(solution_str.count('echo:'))\n")  # tool output is in what the scorer sees
    run_dir = tmp_path / "run"
    args = [f"model.path={tiny_model_dir}", f"data.train_files=[{data}]", "data.train_batch_size=4",
            "data.max_prompt_length=32", "data.max_response_length=160", "rollout.n=2",
            f"rollout.stop_token_ids=[{','.join(map(str, LETTER_IDS))}]",
            f"rollout.multi_turn.tool_config_path={tool_config}", "rollout.multi_turn.format=test_every_turn",
            "rollout.multi_turn.max_assistant_turns=3", f"reward.custom_function={scorer}:compute_score",
            "reward.num_workers=0", f"trainer.output_dir={run_dir}", "trainer.loggers=[jsonl]",
            "trainer.total_steps=2", "trainer.val_before_train=false", "trainer.device=cpu"]
    assert main(["train", *args]) == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for row in metrics:
        assert row["num_turns/mean"] > 2 and row["agent/num_tool_calls/mean"] > 0
        assert row["critic/score/max"] >= 1  # the scorer saw tool output
        assert row["actor/pg_loss"] is not None  # not NaN (metrics.jsonl writes it as null)


def test_unknown_agent_and_missing_tool_config_fail_before_training(tiny_model_dir, tmp_path, capsys):
    from reinforge.cli import main

    def run_with(agent_name: str, *extra: str) -> str:
        data = tmp_path / f"{agent_name}.jsonl"
        data.write_text(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1"}],
                                    "agent_name": agent_name, "reward_model": {"ground_truth": "2"}}) + "\n")
        assert main(["train", f"model.path={tiny_model_dir}", f"data.train_files=[{data}]",
                     "data.train_batch_size=1", "rollout.n=2", f"trainer.output_dir={tmp_path / 'run'}",
                     "trainer.device=cpu", *extra]) != 0
        return capsys.readouterr().err

    # the row is named by its file and its row number there
    assert (f"train row 0 of {tmp_path / 'tool_agnt.jsonl'} asks for agent_name='tool_agnt', which is not a "
            "registered agent loop; known: single_turn, tool_agent" in run_with("tool_agnt"))
    assert (f"train row 0 of {tmp_path / 'tool_agent.jsonl'} asks for agent_name='tool_agent', which calls tools, "
            "but rollout.multi_turn.tool_config_path is not set" in run_with("tool_agent"))


def test_async_mode_refuses_agent_rows_before_any_model_loads(tiny_model_dir, tool_config, tmp_path, capsys,
                                                               monkeypatch):
    from reinforge.cli import main

    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1"}],
                                "agent_name": "tool_agent", "reward_model": {"ground_truth": "2"}}) + "\n")
    assert main(["train", f"model.path={tiny_model_dir}", f"data.train_files=[{data}]", "data.train_batch_size=1",
                 "rollout.n=2", f"rollout.multi_turn.tool_config_path={tool_config}", "trainer.mode=async",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.device=cpu"]) != 0
    assert ("trainer.mode=async generates plain samples in segments, but rows use the agent loops ['tool_agent']; "
            "train agent rows with trainer.mode=sync or one_step_off") in capsys.readouterr().err
    assert not loaded and not (tmp_path / "run" / "checkpoints").exists()


def test_hf_and_native_sample_the_same_trajectories(tiny_model_dir, tool_config):
    # the same seeds draw the same tokens in both engines (rollout.noise), so the whole multi-turn
    # trajectories agree: batching (hf: turns grouped per call, cut to their budget; native: continuous)
    # changes nothing
    batch = None
    responses = {}
    for backend in ("hf", "native"):
        worker = ActorRolloutWorker(agent_config(tiny_model_dir, tool_config, backend), total_training_steps=1)
        batch = batch or prompt_batch(worker.tokenizer, rows=3)
        output = worker.generate(batch, SamplingParams(max_tokens=160), seed=11)
        responses[backend] = (output["responses"], output["response_mask"], output["num_turns"].tolist())
    assert torch.equal(responses["hf"][0], responses["native"][0])
    assert torch.equal(responses["hf"][1], responses["native"][1])
    assert responses["hf"][2] == responses["native"][2]


def test_a_tool_that_fails_every_call_stops_the_run_instead_of_exiting_0(tiny_model_dir, tmp_path, capsys):
    from reinforge.agent.runner import TOOL_FAILURE_STEPS
    from reinforge.cli import main

    (tmp_path / "broken_tools.py").write_text(TOOLS_PY.replace('return "echo:" + text', 'raise OSError("no disk")'))
    tools = tmp_path / "tools.yaml"
    tools.write_text(f"tools:\n  - class_name: {tmp_path / 'broken_tools.py'}:echo\n")
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": f"{i}+{i}"}], "agent_name": "tool_agent",
             "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {}} for i in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    scorer = tmp_path / "score.py"
    scorer.write_text("def compute_score(solution_str, ground_truth, **kwargs):\n    return 0.0\n")
    run_dir = tmp_path / "run"
    args = [f"model.path={tiny_model_dir}", f"data.train_files=[{data}]", "data.train_batch_size=4",
            f"reward.custom_function={scorer}:compute_score",
            "data.max_prompt_length=32", "data.max_response_length=160", "rollout.n=2", "rollout.name=hf",
            f"rollout.stop_token_ids=[{','.join(map(str, LETTER_IDS))}]",
            f"rollout.multi_turn.tool_config_path={tools}", "rollout.multi_turn.format=test_every_turn",
            "rollout.multi_turn.max_assistant_turns=3", "reward.num_workers=0", f"trainer.output_dir={run_dir}",
            "trainer.loggers=[jsonl]", f"trainer.total_steps={TOOL_FAILURE_STEPS + 2}",
            "trainer.val_before_train=false", "trainer.device=cpu"]
    assert main(["train", *args]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ToolFailure: every one of the" in error and "(tools: echo)" in error
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == TOOL_FAILURE_STEPS - 1  # the steps before the third failed rollout stay logged
    assert all(row["agent/tool_raised"] == row["agent/tool_errors"] > 0 for row in metrics)


def test_a_template_that_cannot_render_tool_turns_fails_before_any_model_loads(tiny_model_dir, tool_config, tmp_path,
                                                                               capsys, monkeypatch):
    from reinforge.cli import main

    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loaded.append(a))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1"}],
                                "agent_name": "tool_agent", "reward_model": {"ground_truth": "2"}}) + "\n")
    # drops every assistant turn but the last (as templates that hide earlier reasoning do): a trajectory's
    # earlier tokens would change once a tool turn follows
    template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\\n"
                "{{ m.content }}<|im_end|>\\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
    assert main(["train", f"model.path={tiny_model_dir}", f"data.train_files=[{data}]", "data.train_batch_size=1",
                 "rollout.n=2", f"rollout.multi_turn.tool_config_path={tool_config}",
                 f"data.chat_template={json.dumps(template)}", f"trainer.output_dir={tmp_path / 'run'}",
                 "trainer.device=cpu"]) != 0
    err = capsys.readouterr().err
    assert "tool_agent rows need tool turns rendered by data.chat_template, but" in err, err
    assert "renders an assistant turn differently once tool messages follow it" in err, err
    assert not loaded and not (tmp_path / "run" / "checkpoints").exists()


def test_agent_rows_seed_each_sample_by_its_index_among_its_prompts_samples():
    """A member's share may start inside a prompt's samples (its third, say): the row is seeded as that sample."""
    import numpy as np

    from reinforge.protocol import Batch, samples_of
    from reinforge.rollout.noise import sample_seed
    from reinforge.workers.agent_rollout import agent_rows

    prompts = Batch.from_dict(tensors={"input_ids": torch.ones(2, 3, dtype=torch.long),
                                       "attention_mask": torch.ones(2, 3, dtype=torch.long)},
                              non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    share = samples_of(prompts, 3).split(3)[1]  # the second of three members: sample 2 of a, sample 0 of b
    rows, samplings = agent_rows(share, SamplingParams(max_tokens=4), [11, 22])
    assert [row["request_id"] for row in rows] == ["a/2", "b/0"]
    assert [sampling.seed for sampling in samplings] == [sample_seed(11, 2), sample_seed(22, 0)]


def test_a_members_padding_trajectories_run_no_tool_and_count_nowhere(tiny_model_dir, tmp_path):
    """A share whose last row is padding (a copy of another member's row): no loop runs for it, so its tools (a
    sandbox, a side effect) do not run a second time for the row it copies, and it counts in no metric of the
    rollout, the engine's work included."""
    from reinforge.controller.dispatch import PADDING_ROWS

    log = tmp_path / "calls.log"
    (tmp_path / "logged_tools.py").write_text(TOOLS_PY.replace(
        '    return "echo:" + text', f'    open({str(log)!r}, "a").write(text + "\\n")\n    return "echo:" + text'))
    tool_config = tmp_path / "logged.yaml"
    tool_config.write_text(f"tools:\n  - class_name: {tmp_path / 'logged_tools.py'}:echo\n")
    worker = ActorRolloutWorker(agent_config(tiny_model_dir, tool_config, "native"), total_training_steps=1)
    batch = prompt_batch(worker.tokenizer, rows=2, samples=1)
    padded = Batch.concat([batch, batch.index([0])])
    padded.meta[PADDING_ROWS] = 1
    sampling = SamplingParams(max_tokens=160, temperature=1.0)
    alone = worker.generate(batch, sampling, seed=5)
    calls_alone = log.read_text().splitlines()
    log.unlink()
    with_padding = worker.generate(padded, sampling, seed=5)
    assert calls_alone and sorted(log.read_text().splitlines()) == sorted(calls_alone)
    assert torch.equal(with_padding["responses"][:2], alone["responses"]) and len(with_padding) == 3
    for name in ("rollout/num_generated_tokens", "num_turns/mean", "agent/num_tool_calls/mean",
                 "rollout/num_decode_rows", "rollout/prefill_tokens", "rollout/prefix_cache_hit_tokens"):
        assert with_padding.meta["rollout_metrics"][name] == alone.meta["rollout_metrics"][name]


class _FakeToolTrajectories:
    """The agent runner of ``_ToolRows``: each row's trajectory made three tool calls, all raising where its
    ``extra_info`` says ``fail``, none otherwise."""

    tools = {"echo": None}
    ran: list[str] = []
    """The request ids of the rows whose trajectories ran, over every member."""

    def run(self, rows, samplings, client):
        from reinforge.agent import AgentLoopOutput

        self.ran.extend(row["request_id"] for row in rows)
        raised = [3.0 if row["extra_info"].get("fail") else 0.0 for row in rows]
        return [AgentLoopOutput(row["prompt_ids"], [7, 8], [1, 1], [0.0, 0.0], num_turns=4,
                                metrics={"num_tool_calls": 3.0, "tool_errors": count, "tool_raised": count})
                for row, count in zip(rows, raised, strict=True)]


def _tool_rows_worker(runner: type = _FakeToolTrajectories):
    """A generating worker whose rollout side runs ``runner`` (``_FakeToolTrajectories``) instead of a model (engine,
    weights and tokenizer stand-ins): its agent path and its tool failure check are the real ones."""
    import contextlib
    from types import SimpleNamespace

    from reinforge.agent.runner import ToolFailureCheck
    from reinforge.controller import Dispatch, Worker, register
    from reinforge.workers.rollout_side import RolloutSide

    class ToolRows(Worker):
        def __init__(self):
            side = RolloutSide.__new__(RolloutSide)
            side.config, side.device = Config(), torch.device("cpu")
            side.tokenizer = SimpleNamespace(pad_token_id=0)
            side.rollout_engine = SimpleNamespace(sleep=lambda abandon=False: None, generate=lambda requests: [])
            side.weights = SimpleNamespace(awake=lambda phases: contextlib.nullcontext())
            side.rollout_model, side.agent_runner = None, runner()
            side.tool_failure_check = ToolFailureCheck(sorted(side.agent_runner.tools))
            self.side = side

        @register(dispatch=Dispatch.DP_COMPUTE)
        def generate(self, batch, sampling, seed=0):
            return self.side.generate(batch, sampling, seed)

        @register(dispatch=Dispatch.ONE_TO_ALL)
        def compute_log_prob(self, batch):
            raise NotImplementedError

        rollout_copy_weights = load_rollout_weights = compute_log_prob

    return ToolRows


def _tool_rollouts(failing_rows: list[bool], members: int, rollouts: int = 3, path: str = "step"):
    """``rollouts`` generations of one row per entry of ``failing_rows`` on a generating group of ``members``, by
    ``path``: a step's (``RLTrainer._generate_scored``, scoring left out), validation's, or an off-policy mode's
    (``TrainerCalls.generate``); the exception that stopped them, else None."""
    from pathlib import Path
    from types import SimpleNamespace

    import numpy as np

    from reinforge.controller import WorkerGroup
    from reinforge.protocol import samples_of
    from reinforge.trainer.rl_trainer import RLTrainer

    rows = len(failing_rows)
    prompts = Batch.from_dict(tensors={"input_ids": torch.ones(rows, 3, dtype=torch.long),
                                       "attention_mask": torch.ones(rows, 3, dtype=torch.long)},
                              non_tensors={"uid": np.array([f"u{row}" for row in range(rows)], dtype=object),
                                           "agent_name": np.array(["tool_agent"] * rows, dtype=object),
                                           "extra_info": np.array([{"fail": fail} for fail in failing_rows],
                                                                  dtype=object),
                                           "data_source": np.array(["x"] * rows, dtype=object)})
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.config = Config()
    trainer.config.rollout.n = trainer.config.rollout.val_kwargs.n = 1
    trainer.step, trainer.total_steps, trainer.train_loader, trainer.run_dir = 0, 10, [prompts], Path(".")
    trainer.val_loader, trainer.mode, trainer.rollout, trainer.pad_token_id = [prompts], None, None, 0
    trainer.score = lambda batch, timing=None: Batch()
    trainer.reward = SimpleNamespace(score=lambda batch: Batch.from_dict({"token_level_scores": torch.zeros(rows, 2)}))
    trainer.actor_rollout = WorkerGroup(_tool_rows_worker(), num_members=members, timeout_s=30)
    try:
        for _ in range(rollouts):
            if path == "step":
                trainer._generate_scored(prompts, {}, {})
            elif path == "validation":
                trainer.validate()
            else:
                calls = trainer._mode_calls()
                calls.generate(samples_of(prompts, 1), calls.sampling, trainer.step).result()
            trainer.step += 1
    except Exception as error:  # noqa: BLE001 - the outcome compared
        return error
    finally:
        trainer.actor_rollout.shutdown()
    return None


@pytest.mark.parametrize(("rows", "members"), [(3, 2), (5, 4)])
def test_each_row_of_an_uneven_split_runs_its_trajectory_once(rows, members):
    """A batch that does not split evenly over the members (the last share ends with padding rows, or is padding
    alone): each row's loop, and so its tools, runs once over the group, and the gathered batch has the rows."""
    from reinforge.controller import WorkerGroup

    prompts = Batch.from_dict(tensors={"input_ids": torch.ones(rows, 3, dtype=torch.long),
                                       "attention_mask": torch.ones(rows, 3, dtype=torch.long)},
                              non_tensors={"uid": [f"u{row}" for row in range(rows)],
                                           "agent_name": ["tool_agent"] * rows, "extra_info": [{}] * rows})
    group = WorkerGroup(_tool_rows_worker(), num_members=members, timeout_s=30)
    _FakeToolTrajectories.ran.clear()
    try:
        output = group.generate(prompts, SamplingParams(max_tokens=4), 0)
    finally:
        group.shutdown()
    assert sorted(_FakeToolTrajectories.ran) == [f"u{row}/0" for row in range(rows)]
    assert len(output) == rows and output["num_turns"].tolist() == [4] * rows
    assert output.meta["rollout_metrics"]["agent/tool_raised"] == 0


class _ImageTrajectories(_FakeToolTrajectories):
    """Each row's trajectory carries its prompt's images (a tool's, where its ``extra_info`` names ``tool_image``),
    and its prompt is the row's as many times as ``extra_info`` says (an agent that renders its own prompt)."""

    def run(self, rows, samplings, client):
        from reinforge.agent import AgentLoopOutput
        from reinforge.protocol import MULTI_MODAL_KEY

        return [AgentLoopOutput(row["prompt_ids"] * row["extra_info"].get("prompt_copies", 1), [7, 8], [1, 1],
                                [0.0, 0.0], num_turns=2,
                                multi_modal_inputs=row.get(MULTI_MODAL_KEY) or row["extra_info"].get("tool_image"))
                for row in rows]


@pytest.mark.parametrize("with_images", [[2, 3], [0, 1]])
@pytest.mark.parametrize("where", ["prompt", "tool"])
def test_members_whose_shares_differ_in_images_or_prompt_widths_gather_the_one_member_batch(with_images, where):
    """Four tool rows of which only some have images (the prompt's, or a tool's with text prompts), or whose agents
    render prompts of other lengths: on two members, whose shares then have the images column or not and prompts of
    other widths, the gathered batch is the one member's, images and padding included."""
    from reinforge.controller import WorkerGroup
    from reinforge.protocol import LEFT_PADDED, MULTI_MODAL_KEY

    image = {"pixel_values": torch.ones(4, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    images = [image if row in with_images else {} for row in range(4)]
    extra = [{"prompt_copies": 1 + (row in with_images)} for row in range(4)]
    columns = {"uid": [f"u{row}" for row in range(4)], "agent_name": ["tool_agent"] * 4}
    if where == "prompt":
        columns[MULTI_MODAL_KEY] = images
    else:
        extra = [info | ({"tool_image": images[row]} if images[row] else {}) for row, info in enumerate(extra)]
    prompts = Batch.from_dict(tensors={"input_ids": torch.arange(12).reshape(4, 3) + 1,
                                       "attention_mask": torch.ones(4, 3, dtype=torch.long)},
                              non_tensors=columns | {"extra_info": extra})
    gathered = []
    for members in (1, 2):
        group = WorkerGroup(_tool_rows_worker(_ImageTrajectories), num_members=members, timeout_s=30)
        try:
            gathered.append(group.generate(prompts, SamplingParams(max_tokens=4), 0))
        finally:
            group.shutdown()
    alone, split = gathered
    assert list(split[MULTI_MODAL_KEY]) == list(alone[MULTI_MODAL_KEY]) == images
    assert split["prompts"].shape[1] == 6 and repr(split.meta[LEFT_PADDED]) == repr(alone.meta[LEFT_PADDED])
    for name, value in alone.tensors.items():
        assert torch.equal(split[name], value), name


class _SegmentTrajectories(_FakeToolTrajectories):
    """Rows whose ``extra_info`` gives ``segments`` are an external agent's trajectories, which report them."""

    def run(self, rows, samplings, client):
        from reinforge.agent import AgentLoopOutput

        return [AgentLoopOutput(row["prompt_ids"], [7, 8], [1, 1], [0.0, 0.0], num_turns=2,
                                metrics={"num_segments": row["extra_info"]["segments"]}
                                if "segments" in row["extra_info"] else {}) for row in rows]


def test_a_mean_over_some_trajectories_is_the_one_member_mean_on_several():
    """agent/num_segments/mean is over the external agents' trajectories alone: a share with one of them among four
    rows and a share of four weigh 1 and 4 (not 4 and 4), so two members log the one-member mean (7/5, not 2)."""
    from reinforge.controller import WorkerGroup

    extra = [{"segments": 3.0}, {}, {}, {}] + [{"segments": 1.0}] * 4
    prompts = Batch.from_dict(tensors={"input_ids": torch.ones(8, 3, dtype=torch.long),
                                       "attention_mask": torch.ones(8, 3, dtype=torch.long)},
                              non_tensors={"uid": [f"u{row}" for row in range(8)], "agent_name": ["tool_agent"] * 8,
                                           "extra_info": extra})
    for members in (1, 2):
        group = WorkerGroup(_tool_rows_worker(_SegmentTrajectories), num_members=members, timeout_s=30)
        try:
            metrics = group.generate(prompts, SamplingParams(max_tokens=4), 0).meta["rollout_metrics"]
        finally:
            group.shutdown()
        assert metrics["agent/num_segments/mean"] == pytest.approx(7 / 5) and metrics["num_turns/mean"] == 2


def test_a_share_of_padding_alone_reports_no_rate_of_its_own():
    """The last member's share is padding alone: it generates nothing, so it reports no rollout/* rate or count for
    the group to average with the others' (a tokens_per_s of 0 would halve the group's)."""
    from reinforge.controller.dispatch import PADDING_ROWS

    share = Batch.from_dict(tensors={"input_ids": torch.ones(2, 3, dtype=torch.long),
                                     "attention_mask": torch.ones(2, 3, dtype=torch.long)},
                            non_tensors={"uid": ["u0", "u1"], "agent_name": ["tool_agent"] * 2,
                                         "extra_info": [{}] * 2}, meta={PADDING_ROWS: 2})
    output = _tool_rows_worker()().generate(share, SamplingParams(max_tokens=4), 0)
    assert len(output) == 2 and not any(name.startswith("rollout/") for name in output.meta["rollout_metrics"])


@pytest.mark.parametrize("path", ["step", "validation", "one_step_off"])
def test_a_members_share_whose_tool_calls_all_failed_does_not_stop_a_batch_where_others_succeeded(path):
    """Rows 0-3 fail every tool call, rows 4-7 succeed: on two members the first member's share fails three rollouts
    in a row, the batch does not; the run goes on, as on one member."""
    for members in (1, 2):
        assert _tool_rollouts([True] * 4 + [False] * 4, members, path=path) is None


@pytest.mark.parametrize(("rows", "path"), [(8, "step"), (7, "step"), (7, "validation"), (7, "one_step_off")])
def test_a_batch_whose_tool_calls_all_failed_stops_with_the_one_member_line(rows, path):
    """Every row's calls failed (seven rows: the second member's share ends with a padding row, left out of the
    count): on two members the third rollout raises the ToolFailure one member raises, word for word, and not
    before."""
    from reinforge.agent.runner import TOOL_FAILURE_STEPS, ToolFailure

    alone, split = (_tool_rollouts([True] * rows, members, path=path) for members in (1, 2))
    assert isinstance(alone.__cause__, ToolFailure) and isinstance(split, ToolFailure)
    assert str(split) == str(alone.__cause__)
    assert f"every one of the {3 * rows} tool calls" in str(split) and "(tools: echo)" in str(split)
    assert _tool_rollouts([True] * rows, 2, rollouts=TOOL_FAILURE_STEPS - 1, path=path) is None


def test_a_share_of_single_turn_rows_takes_the_agent_path_when_its_batch_has_agent_rows(tiny_model_dir, tool_config):
    """Split over members, a batch mixing single-turn and tool rows gives one member single-turn rows alone: it must
    return the agent path's columns as the others do, or the gathered shares do not concatenate."""
    from reinforge.data.prompt_loader import AGENT_LOOPS

    worker = ActorRolloutWorker(agent_config(tiny_model_dir, tool_config, "hf"), total_training_steps=1)
    share = prompt_batch(worker.tokenizer, rows=2, samples=1)
    share.non_tensors["agent_name"] = ["single_turn"] * 2
    sampling = SamplingParams(max_tokens=8, temperature=1.0)
    assert "num_turns" not in worker.generate(share, sampling, seed=5)
    share.meta[AGENT_LOOPS] = True
    assert "num_turns" in worker.generate(share, sampling, seed=5)
