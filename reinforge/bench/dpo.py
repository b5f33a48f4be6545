"""``reinforge bench dpo``: DPO steps of ``reinforge dpo`` on a fixed workload, TRL's DPOTrainer beside it.

    reinforge bench dpo [--model 1.5b] [--trl] [--trl-deadline-s 300] [--trl-precompute-ref] [--steps 4]
                        [--pairs 64] [--prompt-tokens 128] [--response-tokens 512] [--max-tokens auto|N]
                        [--checkpointing auto|on|off] [--json out.json]
    reinforge bench dpo --cpu          (a tiny model and workload: the smoke test)

The workload: ``--pairs`` pairs a step, each a prompt of ``--prompt-tokens`` random letters and two
completions of ``--response-tokens`` tokens (random letters, then EOS), on a model of the bench shape
``--model`` with random weights and the character tokenizer (one token a letter), bf16 compute with float32
master weights, AdamW lr 1e-6, beta 0.1, the sigmoid loss; the micro-batch budget and gradient checkpointing
are the memory planner's unless ``--max-tokens`` or ``--checkpointing`` fix them, and the printed line names the
plan. The step time is the median wall time of steps
2.. (the first warms up); the reference pass (once, before step 1) is reported apart, as are the packed
tokens a step computes (a pair's prompt once). The reference pass covers every pair of the run (``--pairs`` x
``--steps``) and compiles the graphs the steps then run, in its first micro-batch, timed apart; its pairs a
second after that are set beside a step's.
``--trl`` then runs ``benchmarks/trl_dpo.py`` of the source checkout on the same model folder and workload, in
a process of its own bounded by ``--trl-deadline-s``, and prints the ratio of the steps, and the ratio with
reinforge's reference pass spread over its steps when TRL's reference runs in every step (TRL's default;
``--trl-precompute-ref`` precomputes it as reinforge does). No checkpoint is written.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from reinforge.bench.table import write_json

TRL_SCRIPT = Path("benchmarks") / "trl_dpo.py"
TRL_GRACE_S = 60.0
"""How long TRL's script may run past its deadline (the step under way, writing its results) before it is ended."""


def write_pairs(path: Path, args: argparse.Namespace) -> Path:
    """Plain pairs with an explicit prompt; the tokenizer appends EOS to each completion."""
    rng = random.Random(0)

    def letters(count: int) -> str:
        return "".join(rng.choice(string.ascii_letters) for _ in range(count))

    with open(path, "w") as handle:
        for _ in range(args.pairs * args.steps):
            handle.write(json.dumps({"prompt": letters(args.prompt_tokens), "chosen": letters(args.response_tokens - 1),
                                     "rejected": letters(args.response_tokens - 1)}) + "\n")
    return path


def run_reinforge(args: argparse.Namespace, model_dir: Path, folder: Path) -> dict:
    from reinforge.config.preference_schema import load_dpo_config
    from reinforge.trainer.preference.dpo_trainer import DPOTrainer

    pairs = write_pairs(folder / "pairs.jsonl", args)
    overrides = [f"model.path={model_dir}", f"data.train_files=[{pairs}]", f"data.batch_size={args.pairs}",
                 f"data.max_length={args.prompt_tokens + args.response_tokens}", "data.shuffle=false",
                 f"trainer.max_tokens_per_micro_batch={args.max_tokens}", f"trainer.output_dir={folder / 'run'}",
                 f"trainer.total_steps={args.steps}", "trainer.loggers=[jsonl]", "optim.lr=1e-6",
                 "optim.warmup_ratio=0", "optim.schedule=constant", "dpo.beta=0.1", "dpo.loss_type=sigmoid",
                 f"model.dtype={'float32' if args.cpu else 'bfloat16'}",
                 f"trainer.device={'cpu' if args.cpu else 'auto'}",
                 "model.gradient_checkpointing=" + {"on": "true", "off": "false"}.get(args.checkpointing, "auto")]
    marks: dict[str, list[float]] = {"steps": []}
    reference: dict[str, float] = {}
    plan: dict[str, str] = {}

    class TimedDPOTrainer(DPOTrainer):
        def before_training(self) -> None:
            plan["line"] = self.memory_plan.line
            super().before_training()
            reference.update(self.reference_metrics)

        def train_step(self, batch):
            start = time.perf_counter()
            metrics = super().train_step(batch)
            marks["steps"].append(time.perf_counter() - start)
            return metrics

        def save(self) -> Path:  # the bench measures steps; a 1.5B checkpoint would take longer than them
            return self.run_dir

    if not args.cpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = TimedDPOTrainer(load_dpo_config(None, overrides))
    trainer.fit()
    steps = marks["steps"]
    step_s = statistics.median(steps[1:] or steps)
    return {"step_s": step_s, "step_times_s": steps, "reference_pass_s": reference["timing_s/reference_pass"],
            "reference_pass_pairs": int(reference["reference/num_pairs"]),
            "reference_first_micro_batch_s": reference["timing_s/reference_first_micro_batch"],
            "reference_pairs_per_s": reference["perf/reference_pairs_per_s"],
            "training_pairs_per_s": args.pairs / step_s, "pairs": args.pairs, "memory_plan": plan["line"],
            "packed_tokens_per_step": args.pairs * (args.prompt_tokens + 2 * args.response_tokens),
            "peak_memory_gb": 0.0 if args.cpu else torch.cuda.max_memory_allocated() / 2**30}


def trl_script() -> Path | None:
    """``benchmarks/trl_dpo.py`` of the checkout this reinforge runs from, or of the working directory."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / TRL_SCRIPT).is_file():
            return root / TRL_SCRIPT
    return None


def run_trl(args: argparse.Namespace, model_dir: Path, folder: Path) -> dict:
    """TRL's script in a process of its own, within ``--trl-deadline-s``: it stops training after the step that
    passes the deadline, and is ended (with its children) ``TRL_GRACE_S`` later if it is still running."""
    script = trl_script()
    if script is None:
        return {"error": f"{TRL_SCRIPT} not found: run from a source checkout of reinforge"}
    out = folder / "trl.json"
    command = [sys.executable, str(script), "--model-dir", str(model_dir), "--steps", str(args.steps),
               "--pairs", str(args.pairs), "--prompt-tokens", str(args.prompt_tokens), "--response-tokens",
               str(args.response_tokens), "--checkpointing", args.trl_checkpointing, "--deadline-s",
               str(args.trl_deadline_s), "--json", str(out), *(["--precompute-ref"] if args.trl_precompute_ref else [])]
    process = subprocess.Popen(command, start_new_session=True)  # its own group: a kill ends its children too
    try:
        returncode = process.wait(timeout=args.trl_deadline_s + TRL_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return {"error": f"benchmarks/trl_dpo.py was still running {args.trl_deadline_s + TRL_GRACE_S:.0f} s after "
                         "it started and was ended (its last 'trl: ...' line above says where it was)"}
    if not out.is_file():
        return {"error": f"benchmarks/trl_dpo.py exited {returncode} without results"}
    return json.loads(out.read_text()).get("best") or {"error": "every TRL run failed (see its output above)"}


def _budget(value: str) -> int | str:
    """--max-tokens: auto or a number of tokens."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither auto nor a number of tokens") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reinforge bench dpo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.5b", help="a bench shape (reinforge.bench.shapes), default 1.5b")
    parser.add_argument("--cpu", action="store_true", help="a tiny model and workload on the CPU (smoke test)")
    parser.add_argument("--trl", action="store_true", help="also run TRL's DPOTrainer on the same workload")
    parser.add_argument("--trl-checkpointing", choices=["auto", "both", "on", "off"], default="auto",
                        help="TRL's gradient checkpointing (auto: off, on when off runs out of memory)")
    parser.add_argument("--trl-deadline-s", type=float, default=300.0,
                        help="TRL's script stops training after the step that passes this many seconds from its "
                             "start, and is ended 60 s later")
    parser.add_argument("--trl-precompute-ref", action="store_true",
                        help="TRL computes the reference log-probs once before training, as reinforge does (its "
                             "default: a reference forward in every step)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=64, help="pairs a step")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=512, help="tokens of each completion")
    parser.add_argument("--max-tokens", type=_budget, default="auto",
                        help="packed tokens of one micro-batch (auto: the memory planner's choice)")
    parser.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                        help="gradient checkpointing of every decoder layer (auto: the memory planner's choice)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser


def dpo_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.cpu:
        args.pairs, args.prompt_tokens, args.response_tokens, args.steps = 4, 8, 16, 2
        if args.max_tokens != "auto":
            args.max_tokens = max(args.max_tokens, 2 * (args.prompt_tokens + args.response_tokens))
        if args.trl:
            raise SystemExit("reinforge bench dpo: --trl compares on a GPU; drop --trl or --cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("reinforge bench dpo needs a CUDA device; --cpu runs the smoke test")
    from reinforge.bench.train import write_model

    with tempfile.TemporaryDirectory(prefix="bench_dpo_") as temporary:
        folder = Path(temporary)
        model_dir = write_model(folder, tiny=args.cpu, size=args.model)
        results = {"model": "tiny" if args.cpu else args.model, "reinforge": run_reinforge(args, model_dir, folder)}
        ours = results["reinforge"]
        print(f"reinforge dpo: step {ours['step_s']:.2f} s ({args.pairs} pairs, {args.prompt_tokens} + 2 x "
              f"{args.response_tokens} tokens each, {ours['training_pairs_per_s']:.1f} pairs/s), reference pass "
              f"{ours['reference_pass_s']:.2f} s for {ours['reference_pass_pairs']} pairs (its first micro-batch, "
              f"compiling, {ours['reference_first_micro_batch_s']:.2f} s; then {ours['reference_pairs_per_s']:.1f} "
              f"pairs/s), step 1 {ours['step_times_s'][0]:.2f} s, peak "
              f"{ours['peak_memory_gb']:.1f} GiB; {ours['memory_plan']}", flush=True)
        if args.trl:
            gc.collect()  # the trainer's model and optimizer, before TRL's process takes the device
            torch.cuda.empty_cache()
            results["trl"] = run_trl(args, model_dir, folder)
            trl = results["trl"]
            if "step_s" in trl:
                results["speedup_vs_trl"] = trl["step_s"] / ours["step_s"]
                # TRL's reference forward is in its step by default; reinforge's is the pass before step 1
                with_reference = ours["step_s"] + (ours["reference_pass_s"] / args.steps
                                                   if trl.get("reference") == "in every step" else 0.0)
                results["speedup_vs_trl_reference_included"] = trl["step_s"] / with_reference
                print(f"trl DPOTrainer: step {trl['step_s']:.2f} s (reference {trl.get('reference')}, setup "
                      f"{trl.get('setup_s', 0.0):.1f} s{', stopped at its deadline' if trl.get('stopped_at_deadline') else ''}"
                      f"); reinforge is {results['speedup_vs_trl']:.2f}x faster a step, "
                      f"{results['speedup_vs_trl_reference_included']:.2f}x with its reference pass spread over "
                      f"the {args.steps} steps")
            else:
                print(f"trl DPOTrainer: {results['trl']['error']}")
    if args.json:
        write_json(args.json, results)
    return 0
