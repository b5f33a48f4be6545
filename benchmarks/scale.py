"""One device call: ``reinforge bench train`` over model sizes and settings, TRL beside it, one table.

    OUT=dir PYTHONPATH=. python3 benchmarks/scale.py CASE [CASE ...] [--deadline-s 570]

A case is ``NAME:SIZE[:bench args, comma separated]``, e.g. ``1.5b:1.5b`` (defaults: the memory
planner's settings), ``1.5b_80:1.5b:--gpu-memory-gib,80``, ``trl_1.5b:1.5b:trl``; an item ``env:NAME=VALUE`` sets an
environment variable of that case's process (``env:PYTORCH_ALLOC_CONF=expandable_segments:True``). Each runs in
its own process (an out-of-memory error in one leaves the next a clean device), with the
time left before the deadline; a case that cannot start in time is skipped and says so. Models
(random Qwen2.5 weights, the character tokenizer) are written once per size. Everything lands
in ``$OUT/scale.json`` (each case's bench JSON: per-step rows, medians, the plan with its
estimate per phase) and ``$OUT/scale.log`` (each case's last lines); the table is printed last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "scale_out"))
MODELS = Path(os.environ.get("MODELS", "/tmp/reinforge_models"))


def model_dir(size: str) -> Path:
    """The model folder of ``size``, written by a child process (this one never holds the device)."""
    folder = MODELS / size
    if not (folder / "model" / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from reinforge.bench.train import "
                        "write_model; write_model(Path(sys.argv[1]), tiny=False, size=sys.argv[2])", str(folder), size],
                       check=True)
    return folder / "model"


def run_case(name: str, size: str, extra: list[str], seconds: float) -> dict:
    path = OUT / f"{name}.json"
    env = os.environ | dict(item.removeprefix("env:").split("=", 1) for item in extra if item.startswith("env:"))
    args = [item for item in extra if not item.startswith("env:")]
    if args[:1] == ["trl"]:
        command = [sys.executable, "benchmarks/trl_grpo.py", "--model-dir", str(model_dir(size)), "--json", str(path),
                   *args[1:]]
    elif "--cpu" in args:  # a smoke test of this script: the bench's tiny model
        command = [sys.executable, "-m", "reinforge", "bench", "train", "--json", str(path), *args]
    else:
        command = [sys.executable, "-m", "reinforge", "bench", "train", "--model", size, "--model-dir",
                   str(model_dir(size)), "--json", str(path), *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, env=env)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode() + (error.stderr or b"").decode() if isinstance(error.stdout, bytes) \
            else (error.stdout or "") + (error.stderr or "")
        code = "timeout"
    result = json.loads(path.read_text()) if path.is_file() else {}
    path.unlink(missing_ok=True)
    lines = [line for line in output.splitlines() if "it/s]" not in line and "s/it]" not in line]
    result |= {"name": name, "size": size, "args": extra, "exit": code, "wall_s": time.perf_counter() - start,
               "tail": lines[-25:]}
    return result


def row(result: dict) -> str:
    name, exit_code = result["name"], result["exit"]
    if "best" in result or result.get("args", [""])[:1] == ["trl"]:
        best = result.get("best") or {}
        return f"{name:<18} trl step {best.get('step_s', float('nan')):6.2f} s  peak {best.get('peak_memory_gb', 0):5.1f} GiB  exit {exit_code}"
    median = result.get("median", {})
    plan = result.get("plan", {})
    estimated = plan.get("estimated_gb", {})
    settings = plan.get("settings", {})
    knobs = (f"mb {settings.get('micro_batch_tokens')} ck {settings.get('checkpoint_layers')} "
             f"keep {int(bool(settings.get('keep_rollout_memory')))} oo {int(bool(settings.get('optimizer_offload')))}"
             if settings else "")
    return (f"{name:<18} step {median.get('step_s', float('nan')):6.2f} roll {median.get('rollout_s', float('nan')):5.2f} "
            f"upd {median.get('update_actor_s', float('nan')):5.2f} mfu {median.get('mfu') or 0:.3f} "
            f"peak r/u {median.get('rollout_peak_gb', 0):5.1f}/{median.get('update_peak_gb', 0):5.1f} "
            f"est {estimated.get('rollout', 0):5.1f}/{estimated.get('update', 0):5.1f} "
            f"exp {int(bool(result.get('expandable_segments')))} retries {median.get('alloc_retries', 0):.0f} reserved {median.get('reserved_peak_gb', 0):5.1f} "
            f"host {median.get('host_peak_gb', 0):4.1f} (anon {median.get('host_rssanon_gb', 0):4.1f} "
            f"pinned {median.get('host_rssshmem_gb', 0):4.1f})  {knobs}  "
            f"exit {exit_code}")


def main(argv: list[str]) -> int:
    deadline_s = 570.0
    if "--deadline-s" in argv:
        index = argv.index("--deadline-s")
        deadline_s = float(argv[index + 1])
        argv = argv[:index] + argv[index + 2:]
    OUT.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = []
    for case in argv:
        name, size, *rest = case.split(":", 2)
        extra = [item for item in (rest[0].split(",") if rest else []) if item]
        left = deadline_s - (time.perf_counter() - start)
        if left < 45:
            results.append({"name": name, "size": size, "args": extra, "exit": "skipped (deadline)"})
            continue
        results.append(run_case(name, size, extra, left - 10))
        print(row(results[-1]), flush=True)
        (OUT / "scale.json").write_text(json.dumps(results, indent=1))
    with open(OUT / "scale.log", "w") as log:
        for result in results:
            log.write(f"==== {result['name']} ({result['size']} {' '.join(result['args'])}) exit {result['exit']}\n")
            log.write("\n".join(result.get("tail", [])) + "\n")
    print("\n".join(row(result) for result in results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
