"""``reinforge bench train --model 0.5b,1.5b,3b,7b --trl [--out DIR] [--deadline-s S]``: the standard table.

Each size (a shape of ``shapes.py``) runs in a process of its own (an out-of-memory error in one leaves the
next a clean device): first its model is written (random weights and the character tokenizer, in a temporary
folder removed after the size), then ``reinforge bench train`` on it, then with ``--trl`` TRL's GRPOTrainer on
the same folder and workload (``benchmarks/trl_grpo.py`` of the source checkout; where reinforge trains a LoRA
adapter, by ``--lora`` or the shape's own, TRL trains the same adapter). Every case's JSON (its results
and a ``case`` record, ``table.py``) lands in ``--out`` (``bench_out`` by default) as soon as it ends, its
output streams through prefixed by its name, and one markdown table is printed last. ``--deadline-s``
bounds the whole invocation: each process gets the time left (a ``bench train`` case as its own
``--deadline-s``, so that it stops between steps and reports the steps done; one still running at the
deadline is ended), and a case that cannot start in time is skipped. The command exits 1 when a case gave no
result (``failed_cases``; TRL running out of memory is one). This process never touches the device.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from reinforge.bench.shapes import SHAPES
from reinforge.bench.table import environment, render_table, write_json

TRL_SCRIPT = Path("benchmarks") / "trl_grpo.py"
TRL_OPTIONS = ("--steps", "--prompts", "--n", "--prompt-tokens", "--response-tokens", "--gpu-memory-gib")
"""Case options that TRL's script takes too (the workload and the memory cap); the rest are reinforge's own."""
MIN_CASE_S = 45.0
"""A case is not started with less time than this left before the deadline."""
MARGIN_S = 10.0
"""Kept back from each process's time for the table at the end."""


def trl_script() -> Path | None:
    """``benchmarks/trl_grpo.py`` of the checkout this reinforge runs from, or of the working directory."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / TRL_SCRIPT).is_file():
            return root / TRL_SCRIPT
    return None


def run_sizes(args: argparse.Namespace, argv: list[str]) -> int:
    script = None
    if args.trl:
        script = trl_script()
        if script is None:
            print(f"reinforge bench train --trl runs {TRL_SCRIPT} of a reinforge source checkout, found neither "
                  f"beside this installation nor in {Path.cwd()}; run it from a clone of the repository, or drop "
                  "--trl", file=sys.stderr)
            return 2
        missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
        if missing:
            print(f"reinforge bench train --trl needs {' and '.join(missing)}: pip install -e '.[bench]' in the "
                  "checkout (or pip install trl datasets), or drop --trl", file=sys.stderr)
            return 2
    if not args.cpu and not _cuda_available():
        print("reinforge bench train needs a CUDA device; pass --cpu for a smoke test on a tiny model", file=sys.stderr)
        return 2
    out = args.out or Path("bench_out")
    out.mkdir(parents=True, exist_ok=True)
    runner = CaseRunner(args, argv, out, environment())
    for size in args.sizes:
        if args.cpu:  # the tiny model, written by the case itself
            runner.run_reinforge(size, args.model_dir)
            continue
        if args.model_dir is not None:  # one size's folder written earlier (--model-dir): reused, not written again
            runner.run_reinforge(size, args.model_dir)
            if script is not None:
                runner.run_trl(size, args.model_dir, script)
            continue
        with tempfile.TemporaryDirectory(prefix=f"reinforge_bench_{size}_") as scratch:
            model_dir = runner.write_model(size, Path(scratch))
            if model_dir is None:
                continue
            runner.run_reinforge(size, model_dir)
            if script is not None:
                runner.run_trl(size, model_dir, script)
    print(f"\ncase results: {out}/*.json (reinforge bench table {out} prints this table again)\n", flush=True)
    print(render_table(runner.results), flush=True)
    return 1 if failed_cases(runner.results) else 0


def failed_cases(results: list[dict]) -> list[str]:
    """``size kind`` of each case that gave no result: a reinforge case not ok, a TRL case neither ok nor out of
    memory (TRL running out of memory is what its column reports)."""
    return [f"{r['case']['size']} {r['case']['kind']}" for r in results
            if r["case"]["status"] not in (("ok",) if r["case"]["kind"] == "reinforge" else ("ok", "OOM"))]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class CaseRunner:
    """Runs the cases one after another against one deadline and keeps their results."""

    def __init__(self, args: argparse.Namespace, argv: list[str], out: Path, env: dict):
        self.args, self.argv, self.out, self.env = args, argv, out, env
        self.start = time.monotonic()
        self.results: list[dict] = []

    def seconds_left(self) -> float | None:
        if self.args.deadline_s is None:
            return None
        return self.args.deadline_s - (time.monotonic() - self.start)

    def write_model(self, size: str, folder: Path) -> Path | None:
        """The size's model folder, written by a process of its own; None (a skipped case recorded) when it fails."""
        code = ("import sys; from pathlib import Path; from reinforge.bench.train import write_model; "
                "write_model(Path(sys.argv[1]), tiny=False, size=sys.argv[2])")
        status, _, tail = self.run_process(f"{size} model", [sys.executable, "-c", code, str(folder), size])
        if status == "ok":
            return folder / "model"
        self.record("reinforge", size, {}, status if status != "ok" else "failed", None, 0.0,
                    ["writing the model failed:", *tail])
        return None

    def run_reinforge(self, size: str, model_dir: Path | None) -> None:
        path = self.out / case_file("reinforge", size, self.args.case_options)
        left = self.seconds_left()
        command = [sys.executable, "-m", "reinforge", "bench", "train", "--model", size, "--json", str(path),
                   *(["--model-dir", str(model_dir)] if model_dir else []), *self.args.case_options,
                   # its own deadline, before this process's: it stops between steps and reports the ones done
                   *(["--deadline-s", f"{max(left - 2 * MARGIN_S, 1.0):.0f}"] if left is not None else [])]
        self.run_case("reinforge", size, command, path)

    def run_trl(self, size: str, model_dir: Path, script: Path) -> None:
        path = self.out / case_file("trl", size, self.args.case_options)
        options = self.args.case_options
        passed = [item for index, flag in enumerate(options) if flag in TRL_OPTIONS
                  for item in (flag, options[index + 1])]
        shape = SHAPES[size]
        script = script.with_name(shape.trl_script)  # its workload's twin (a vision-language shape's has images)
        rank, targets = shape.adapter(getattr(self.args, "lora", 0))
        if rank:  # reinforge trains an adapter (--lora, or the shape's own): TRL trains the same one (peft)
            passed += ["--lora-rank", str(rank), "--lora-targets", ",".join(targets)]
        command = [sys.executable, str(script), "--model-dir", str(model_dir), "--json", str(path), *passed,
                   "--checkpointing", getattr(self.args, "trl_checkpointing", "auto")]
        left = self.seconds_left()
        if left is not None:  # it stops between steps before this one ends it, and writes the steps it made
            command += ["--deadline-s", f"{max(left - 2 * MARGIN_S, 1.0):.0f}"]
        self.run_case("trl", size, command, path, env=trl_environment(os.environ))

    def run_case(self, kind: str, size: str, command: list[str], path: Path, env: dict[str, str] | None = None
                 ) -> None:
        path.unlink(missing_ok=True)  # a result left by an earlier run must not pass for this one's
        started = time.monotonic()
        status, code, tail = self.run_process(f"{size} {kind}", command, env)
        data = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:
                status = "failed"
        if status == "ok" and not data:
            status = "failed"
        if kind == "trl" and status == "timeout" and (data.get("best") or {}).get("step_s") is not None:
            data["best"]["ended_at_deadline"] = True  # the steps it wrote before it was ended stand
            status = "ok"
        if kind == "trl" and data and data.get("best") is None:
            errors = " ".join(run.get("error", "") for run in data.get("runs", []))
            status = "OOM" if "out of memory" in errors else "failed"
        self.record(kind, size, data, status, code, time.monotonic() - started, tail, env)

    def record(self, kind: str, size: str, data: dict, status: str, code: int | None, wall_s: float,
               tail: list[str], env: dict[str, str] | None = None) -> None:
        result = dict(data)
        result["case"] = {"kind": kind, "size": size, "options": self.args.case_options, "status": status,
                          "exit": code, "wall_s": wall_s, "argv": self.argv, "environment": self.env,
                          "tail": tail[-25:]}
        if env is not None:
            result["case"]["alloc_conf"] = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF")
        write_json(self.out / case_file(kind, size, self.args.case_options), result)
        self.results.append(result)
        print(f"[{size} {kind}] {summary(result)}", flush=True)

    def run_process(self, name: str, command: list[str], env: dict[str, str] | None = None
                    ) -> tuple[str, int | None, list[str]]:
        """(status, exit code, last lines) of a process run to its end or to the deadline, in ``env`` (this
        process's by default); its output streams through, each line prefixed by ``name``."""
        left = self.seconds_left()
        if left is not None and left < MIN_CASE_S:
            print(f"[{name}] skipped: {max(left, 0):.0f} s left before the deadline", flush=True)
            return "skipped", None, []
        env = (os.environ if env is None else env) | {"PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   start_new_session=True)  # its own process group: a timeout ends its children too
        timed_out = threading.Event()

        def stop() -> None:
            timed_out.set()
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(left - MARGIN_S, stop) if left is not None else None
        if timer is not None:
            timer.start()
        tail: collections.deque[str] = collections.deque(maxlen=60)
        try:
            assert process.stdout is not None
            for raw in process.stdout:
                line = raw.rstrip("\n").split("\r")[-1]
                if not line.strip() or "it/s]" in line or "s/it]" in line:  # progress bars
                    continue
                tail.append(line)
                print(f"[{name}] {line}", flush=True)
            code = process.wait()
        except BaseException:
            stop()
            process.wait()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        text = "\n".join(tail)
        if timed_out.is_set():
            status = "timeout"
        elif code == 0:
            status = "ok"
        else:
            status = "OOM" if "OutOfMemoryError" in text or "CUDA out of memory" in text else f"failed (exit {code})"
        return status, code, list(tail)


def trl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """TRL's process environment: ``environ`` with PyTorch's expandable segments unless it configures the allocator
    itself. TRL's update allocates and frees each micro-batch's activations beside the cache ``generate`` left;
    without them a 3.8B update ran out of memory with 55.6 GiB reserved but unallocated (fragments), which is the
    allocator's fault, not a size TRL needs."""
    env = dict(environ)
    if not env.get("PYTORCH_ALLOC_CONF") and not env.get("PYTORCH_CUDA_ALLOC_CONF"):
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    return env


def case_file(kind: str, size: str, options: list[str]) -> str:
    """``reinforge_7b.json``, ``trl_0.5b.json``, ``reinforge_7b_lora-32.json``: letters, digits, '.', '_', '-'."""
    slug = "".join(f"_{option.lstrip('-')}" if option.startswith("--") else f"-{option}" for option in options)
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{kind}_{size}{slug}") + ".json"


def summary(result: dict) -> str:
    case = result["case"]
    if case["status"] != "ok":
        return f"{case['status']} after {case['wall_s']:.0f} s"
    if case["kind"] == "trl":
        best = result["best"]
        only = " (first step only, from training's start)" if best.get("first_step_only") else ""
        return f"TRL step {best['step_s']:.2f} s{only}, peak {best['peak_memory_gb']:.1f} GiB"
    median = result["median"]
    return (f"step {median.get('step_s', 0):.2f} s, rollout {median.get('rollout_s', 0):.2f} s, "
            f"update {median.get('update_actor_s', 0):.2f} s, peak {median.get('peak_memory_gb', 0):.1f} GiB")
