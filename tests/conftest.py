"""Shared fixtures: a tiny HF model folder and a small arithmetic dataset, built once per session."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (engine.log_prob_kernels, the native rollout engine's) run in Triton's interpreter on
    # the CPU; Triton reads this when it is first imported, so it is set before any test imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread per test process: `make test` runs three processes on a 2-core machine, and a
    # second OpenMP thread per process made every small op wait at a barrier for a descheduled thread
    # (the tiny model's generation took 2-5 s a step instead of 0.05 s; mean_reward_rises[grpo] 102 s).
    torch.set_num_threads(1)
    # the same for the processes tests start (CLI runs, gloo ranks, Ray's workers), which read it at startup
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The collector's youngest generation is collected every 50,000 allocations, not every 700: a test process holds
# torch, transformers and every collected test module, and with the default thresholds collections took about 5% of
# its CPU in the trainer and engine tests (half of that with these). Cyclic garbage is still collected, a little later.
gc.set_threshold(50_000, 20, 10)


@pytest.fixture(autouse=True)
def _agent_loops_as_they_were():
    """A run that registers agent loops (``rollout.multi_turn.openai_agents``) does so in this process's registry;
    each test starts from, and leaves, the registry as the test before found it."""
    from reinforge.agent.loop import AGENT_LOOPS

    before = dict(AGENT_LOOPS)
    yield
    AGENT_LOOPS.clear()
    AGENT_LOOPS.update(before)


ONE_WORKER = {"tests/controller/test_ray_backend.py": "ray", "tests/controller/test_ray_trainer.py": "ray"}
"""Files that run in one ``make test`` worker, under one name, one after the other: they share one Ray instance
(``ray_cluster``, tens of seconds to start on a 2-core machine), which a second worker would start again."""

LONGEST_FIRST = ("ray", "tests/trainer/modes/test_async_mode.py", "tests/trainer/test_rl_trainer_stop_signals.py",
                 "tests/trainer/test_rl_trainer.py", "tests/rollout/test_native_moe_kernels.py",
                 "tests/demo/test_vision_demo.py", "tests/demo/test_demo.py", "tests/test_api.py",
                 "tests/trainer/test_rl_trainer_lora.py", "tests/rollout/test_native_vlm.py", "tests/bench/test_sizes.py",
                 "tests/config/verl/test_upstream_commands.py", "tests/sandbox/test_client.py",
                 "tests/rollout/test_native_long_decode.py", "tests/trainer/test_run_loop.py",
                 "tests/engine/test_families.py", "tests/rollout/test_native_moe.py", "tests/sandbox/test_server.py",
                 "tests/agent/test_retool_recipe.py", "tests/demo/test_agent_demo.py",
                 "tests/rollout/native/test_triton_kernels.py", "tests/engine/test_fused.py",
                 "tests/rollout/native/test_compile_ahead.py", "tests/trainer/preference/test_preference_ranks.py",
                 "tests/bench/test_train_long.py", "tests/trainer/test_rl_trainer_skipped_steps.py",
                 "tests/trainer/preference/test_preference_chain.py")
"""Work units handed out first, in this order: those that take the longest (10 s to two minutes each under ``make
test``), longest first, then files of two or three tests that take 4 to 9 s. The workers then end within a short file
of each other: loadfile's own order (most tests first) would hand out last the files of a few long tests (test_api.py,
test_run_loop.py, test_sizes.py, test_preference_ranks.py), and one of them starting last keeps one worker busy
alone."""


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of ``ONE_WORKER`` as one unit, and the units of ``LONGEST_FIRST`` handed out
    first (then the others, most tests first, as loadfile orders them)."""
    if config.getoption("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(OrderedDict):
        """The work queue, reordered once when the first unit is taken (after it is filled)."""

        ordered = False

        def popitem(self, last: bool = True):
            if not self.ordered:
                self.ordered = True
                for scope in reversed(LONGEST_FIRST):
                    if scope in self:
                        self.move_to_end(scope, last=False)
            return super().popitem(last=last)

    class Scheduling(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = LongestFirst()

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return ONE_WORKER.get(path, path)

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from reinforge.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture(scope="session")
def arithmetic_data_dir(tmp_path_factory) -> Path:
    from reinforge.data.tasks.arithmetic import write_arithmetic_dataset

    folder = tmp_path_factory.mktemp("arithmetic")
    write_arithmetic_dataset(folder, num_train=64, num_test=8, max_digits=2)
    return folder


def pytest_terminal_summary(terminalreporter):
    """The sandbox attack suite's tally (tests/sandbox/test_attacks.py); an attack is contained when its test passed.

    An attack that skipped itself (the memory bomb spread over processes, where the server has no
    cgroups) counts as not contained; a whole suite skipped for want of bwrap counts nothing.
    """
    attacks = [report for outcome in ("passed", "failed", "skipped")
               for report in terminalreporter.stats.get(outcome, [])
               if report.when == "call" and any(key == "sandbox_attack" for key, _ in report.user_properties)]
    if attacks:
        contained = sum(report.passed for report in attacks)
        terminalreporter.write_line(f"sandbox attack suite: {len(attacks)} attacks, {contained} contained")
