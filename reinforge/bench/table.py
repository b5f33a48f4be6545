"""The standard training table: ``reinforge bench train --model SIZES --trl`` cases as one markdown table.

Each case (one size's ``bench train`` run, or TRL's beside it) is a JSON file of ``--out DIR`` holding the
run's results and a ``case`` record: its kind, size and options, exit status, and the environment (GPU,
versions, commit, UTC date). ``reinforge bench table DIR [DIR ...]`` reads the cases of several folders (a
later folder's case replaces an earlier one of the same size and options) and prints the table again: sizes
measured in separate runs end up in one table. A header line names the command, the machine, the versions,
the commits and the dates; each cell holds one figure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from reinforge.atomic_files import replaced_atomically
from reinforge.bench.shapes import SHAPES
from reinforge.engine.perf import DATASHEET_BF16_FLOPS, MEASURED_BF16_FLOPS, table_flops

SIZE_ORDER = tuple(SHAPES)
VERSIONS = ("torch", "transformers", "triton", "trl")


def environment(repo: Path | None = None) -> dict:
    """The machine (first visible GPU's name and memory, read by ``nvidia-smi`` so that this process never
    holds the device), the versions of Python and the packages, the commit and the UTC date."""
    info: dict = {"gpu": None, "gpu_memory_gib": None, "python": platform.python_version(),
                  "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "commit": commit(repo)}
    for name in VERSIONS:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    import torch  # its own version names the CUDA build (2.11.0+cu130); importing it does not touch the device

    info["torch"] = torch.__version__
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
        visible = [line for line in done.stdout.splitlines() if line.strip()]
        if done.returncode == 0 and visible:
            name, memory_mib = (field.strip() for field in visible[first_visible_index(len(visible))].split(",", 1))
            info["gpu"], info["gpu_memory_gib"] = name, round(float(memory_mib) / 1024, 1)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    return info


def first_visible_index(count: int) -> int:
    """The index nvidia-smi gives the first device of CUDA_VISIBLE_DEVICES (0 when unset or not an index)."""

    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) < count else 0


def commit(repo: Path | None = None) -> str | None:
    """``git rev-parse --short HEAD`` of the source checkout reinforge runs from, with ``+changes`` when its
    tracked files differ from that commit (a copied tree whose ``.git`` is older names no commit it is not);
    None outside a checkout."""
    folder = repo or Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        if done.returncode != 0 or not done.stdout.strip():
            return None
        changed = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() + ("+changes" if changed.returncode != 0 or changed.stdout.strip() else "")


def write_json(path: Path, data: object) -> None:
    """``data`` as indented JSON in ``path``, whole or not at all (a ``*.tmp`` file beside it, which no ``*.json``
    glob reads, renamed over it), so a process ended mid-write leaves the earlier file or none."""
    with replaced_atomically(path, durable=False) as temporary:
        temporary.write_text(json.dumps(data, indent=1))


def load_cases(paths: list[Path]) -> list[dict]:
    """The case records of the JSON files in ``paths`` (folders or files), later ones replacing earlier ones."""
    cases: dict[tuple, dict] = {}
    for path in paths:
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        for file in files:
            try:
                data = json.loads(file.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(data, dict) and isinstance(data.get("case"), dict):
                case = data["case"]
                cases[(case["kind"], case["size"], tuple(case.get("options", [])))] = data
    return list(cases.values())


def column_key(case: dict) -> tuple:
    size = case["size"]
    return (SIZE_ORDER.index(size) if size in SIZE_ORDER else len(SIZE_ORDER), size, tuple(case.get("options", [])))


def render_table(results: list[dict]) -> str:
    """The header line and the markdown table (one column per size and options) of these cases' results."""
    columns: dict[tuple, dict[str, dict]] = {}
    for result in results:
        case = result["case"]
        columns.setdefault(column_key(case), {})[case["kind"]] = result
    keys = sorted(columns)
    same_options = len({key[2] for key in keys}) == 1  # then the header's command names them, not each column
    labels = [key[1] if same_options else " ".join([key[1], *key[2]]) for key in keys]
    environments = [result["case"].get("environment", {}) for result in results]
    gpu = _joined(environments, "gpu")
    datasheet, measured = _peak(DATASHEET_BF16_FLOPS, gpu), _peak(MEASURED_BF16_FLOPS, gpu)
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, kind: str, cell) -> None:
        rows.append((label, [_cell(columns[key].get(kind), cell) for key in keys]))

    add("micro-batch tokens (planner)", "reinforge", lambda r: _setting(r, "micro_batch_tokens", "{:d}"))
    add("checkpointed layers (planner)", "reinforge", lambda r: _setting(r, "checkpoint_layers", "{:d}"))
    add("optimizer on the CPU (planner)", "reinforge", lambda r: _setting(r, "optimizer_offload", "yes/no"))
    add("rollout memory kept (planner)", "reinforge", lambda r: _setting(r, "keep_rollout_memory", "yes/no"))
    add("layers kept gathered in the update (planner)", "reinforge", lambda r: _setting(r, "keep_gathered", "yes/no"))
    add("step s", "reinforge", lambda r: _number(r["median"].get("step_s"), "{:.2f}") + _compiling(r))
    add("rollout s", "reinforge", lambda r: _number(r["median"].get("rollout_s"), "{:.2f}"))
    add("update s", "reinforge", lambda r: _number(r["median"].get("update_actor_s"), "{:.2f}"))
    add(f"MFU vs datasheet{_tflops(datasheet)}", "reinforge", lambda r: _number(r["median"].get("mfu"), "{:.1%}"))
    add(f"MFU vs measured peak{_tflops(measured)}", "reinforge",
        lambda r: _number(r["median"].get("mfu_measured_peak"), "{:.1%}"))
    add(f"MFU with attention vs datasheet{_tflops(datasheet)}", "reinforge",
        lambda r: _number(r["median"].get("mfu_with_attention"), "{:.1%}"))
    add("rollout bandwidth floor s", "reinforge", lambda r: _number(r["median"].get("rollout_floor_s"), "{:.2f}"))
    add("rollout / floor", "reinforge", lambda r: _number(r["median"].get("rollout_over_floor"), "{:.2f}"))
    add("rollout floor s, a prompt's blocks read once for its samples", "reinforge",
        lambda r: _number(r["median"].get("rollout_floor_shared_prompts_s"), "{:.2f}"))
    add("rollout floor s, products at the matrix rate", "reinforge",
        lambda r: _number(r["median"].get("rollout_floor_roofline_s"), "{:.2f}"))
    add("peak GiB, rollout", "reinforge", lambda r: _number(r["median"].get("rollout_peak_gb"), "{:.1f}"))
    add("peak GiB, update", "reinforge", lambda r: _number(r["median"].get("update_peak_gb"), "{:.1f}"))
    add("planner's estimate GiB, rollout", "reinforge",
        lambda r: _number(r.get("plan", {}).get("estimated_gb", {}).get("rollout"), "{:.1f}"))
    add("planner's estimate GiB, update", "reinforge",
        lambda r: _number(r.get("plan", {}).get("estimated_gb", {}).get("update"), "{:.1f}"))
    if any("trl" in columns[key] for key in keys):
        add("TRL step s", "trl", _trl_step)
        rows.append(("TRL generate s, each call", [_trl_generate(columns[key].get("trl")) for key in keys]))
        add("TRL peak GiB", "trl", lambda r: _number((r.get("best") or {}).get("peak_memory_gb"), "{:.1f}"))
        add("TRL gradient checkpointing", "trl", lambda r: "yes" if r["best"]["checkpointing"] else "no")
        rows.append(("TRL step / reinforge step", [_ratio(columns[key]) for key in keys]))
    lines = [header(results), "", "| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    lines += ["", family_table(columns, keys, labels)]
    return "\n".join(lines)


FAMILY_COLUMNS = ("family", "shape", "step s", "rollout s", "update s", "MFU (active params)", "peak GiB",
                  "TRL step s", "TRL / reinforge")


def family_table(columns: dict[tuple, dict[str, dict]], keys: list[tuple], labels: list[str]) -> str:
    """One row per case: its family and shape (parameters, full or LoRA), the phases, MFU on the active
    parameters, the peak, and where TRL ran beside it, TRL's step and the ratio of the steps."""
    with_trl = any("trl" in columns[key] for key in keys)
    names = FAMILY_COLUMNS if with_trl else FAMILY_COLUMNS[:-2]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for key, label in zip(keys, labels, strict=True):
        ours = columns[key].get("reinforge")
        trl = columns[key].get("trl")
        shape = (ours or {}).get("shape") or {}
        name = key[1]
        family = shape.get("family") or (SHAPES[name].family if name in SHAPES else "–")
        cells = [family, _shape_cell(label, shape),
                 _cell(ours, lambda r: _number(r["median"].get("step_s"), "{:.2f}") + _compiling(r)),
                 _cell(ours, lambda r: _number(r["median"].get("rollout_s"), "{:.2f}")),
                 _cell(ours, lambda r: _number(r["median"].get("update_actor_s"), "{:.2f}")),
                 _cell(ours, lambda r: _number(r["median"].get("mfu"), "{:.1%}")),
                 _cell(ours, lambda r: _number(r["median"].get("peak_memory_gb"), "{:.1f}")),
                 _cell(trl, _trl_step),
                 _ratio(columns[key])][:len(names)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _shape_cell(label: str, shape: dict) -> str:
    """``olmoe-1b-7b, 6.9B (1.3B active), full``: the name, the parameters and the training."""
    if not shape:
        return label
    params, active = shape.get("params"), shape.get("active_params")
    sizes = f"{params / 1e9:.1f}B" if params else ""
    if params and active and active < params:
        sizes += f" ({active / 1e9:.1f}B active)"
    return ", ".join(part for part in (label, sizes, shape.get("training")) if part)


def header(results: list[dict]) -> str:
    """One line: the command, the machine, the versions, the commit(s) and the UTC date(s)."""
    environments = [result["case"].get("environment", {}) for result in results]
    memory = _joined(environments, "gpu_memory_gib", "{:g} GiB")
    machine = f"{_joined(environments, 'gpu') or 'no GPU'}" + (f" ({memory})" if memory else "")
    versions = ", ".join(f"{name} {_joined(environments, name) or 'n/a'}" for name in ("torch", "transformers", "triton"))
    versions += f", Python {_joined(environments, 'python') or 'n/a'}"
    if any(result["case"]["kind"] == "trl" for result in results):
        versions += f", trl {_joined(environments, 'trl') or 'n/a'}"
    return (f"`{command(results)}` on {machine}; {versions}; commit {_joined(environments, 'commit') or 'unknown'}; "
            f"{_joined(environments, 'date') or 'date unknown'} (UTC)")


def command(results: list[dict]) -> str:
    """The one command that runs every column (several, joined by '; ', when the columns' options differ)."""
    groups: dict[tuple, dict] = {}
    for result in sorted(results, key=lambda r: column_key(r["case"])):
        case = result["case"]
        group = groups.setdefault(tuple(case.get("options", [])), {"sizes": [], "trl": False})
        if case["size"] not in group["sizes"]:
            group["sizes"].append(case["size"])
        group["trl"] |= case["kind"] == "trl"
    return "; ".join(" ".join([f"reinforge bench train --model {','.join(group['sizes'])}",
                               *(["--trl"] if group["trl"] else []), *options])
                     for options, group in groups.items())


def _joined(environments: list[dict], key: str, form: str = "{}") -> str:
    values = [form.format(env[key]) for env in environments if env.get(key) is not None]
    return " / ".join(dict.fromkeys(values))


def _peak(table: dict[str, float], gpu: str) -> float | None:
    return table_flops(gpu, table) if gpu and " / " not in gpu else None


def _tflops(flops: float | None) -> str:
    return f" ({flops / 1e12:.0f} TFLOP/s)" if flops else ""


def _number(value, form: str) -> str:
    return "–" if value is None else form.format(value)


def _setting(result: dict, name: str, form: str) -> str:
    value = result.get("plan", {}).get("settings", {}).get(name)
    if value is None:
        return "–"
    return ("yes" if value else "no") if form == "yes/no" else form.format(int(value))


def _cell(result: dict | None, cell) -> str:
    """The figure of a finished case, or what stopped it (out of memory, timeout, skipped, failed)."""
    if result is None:
        return "–"
    status = result["case"].get("status", "ok")
    if status != "ok":
        return status
    try:
        return cell(result)
    except (KeyError, TypeError, ValueError):
        return "–"


FIRST_STEP_ONLY = " (first step only)"
"""Beside a TRL time from a run that made one step: it counts from training's start (data, warm-up), not a steady
step, so it and its ratio are not the medians the other cells are."""


FIRST_STEP_COMPILING = " (first step only, compiling)"
"""Beside a reinforge time whose median is of its first step alone (``--steps 1``, or a deadline after it): that step
compiles the layers and captures the rollout's graphs, so it is no steady step."""


def _compiling(result: dict) -> str:
    return FIRST_STEP_COMPILING if result.get("median_steps") == [1] else ""


def _trl_generate(result: dict | None) -> str:
    """The seconds of each ``generate`` call of TRL's run (one a step): a step is at least its generation, so a
    run of one step, or one that then ran out of memory or time, still bounds its steady step from below. Without
    a finished run, the calls of the last try that made any, beside what stopped it."""
    if result is None:
        return "–"
    best = result.get("best") or {}
    calls = best.get("generate_s") or next((run["generate_s"] for run in reversed(result.get("runs") or [])
                                             if run.get("generate_s")), [])
    timed = ", ".join(f"{seconds:.2f}" for seconds in calls)
    status = result["case"].get("status", "ok")
    if status == "ok":
        return timed or "–"
    return f"{timed} ({status})" if timed else status


def _steady_lower_bound(best: dict) -> float | None:
    """A run of one step whose next step's ``generate`` call ended before the run did: its steady step is longer
    than that generation (a step is at least its generation, and the first call's warm-up is not in the second)."""
    calls = best.get("generate_s") or []
    return float(calls[1]) if best.get("first_step_only") and len(calls) >= 2 else None


def _trl_step(result: dict) -> str:
    best = result.get("best") or {}
    bound = _steady_lower_bound(best)
    if bound is not None:
        return f"more than {bound:.2f} (its second step's generation alone; its first step {best['step_s']:.2f})"
    return _number(best.get("step_s"), "{:.2f}") + (FIRST_STEP_ONLY if best.get("first_step_only") else "")


def _ratio(column: dict[str, dict]) -> str:
    ours, theirs = column.get("reinforge"), column.get("trl")
    try:
        step = ours["median"]["step_s"]
        trl_step = theirs["best"]["step_s"]
    except (KeyError, TypeError):
        return "–"
    if not step:
        return "–"
    bound = _steady_lower_bound(theirs["best"])
    if bound is not None:
        return f"more than {int(bound / step * 10) / 10:.1f}" + _compiling(ours)  # rounded down: a lower bound
    return (f"{trl_step / step:.1f}" + (FIRST_STEP_ONLY if theirs["best"].get("first_step_only") else "")
            + _compiling(ours))


def table_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="reinforge bench table", description="one markdown table from the JSON "
                                     "files that `reinforge bench train --out DIR` wrote, over one or more runs")
    parser.add_argument("paths", nargs="+", type=Path, metavar="DIR", help="folders (or JSON files) of cases")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        print(f"reinforge bench table: {', '.join(missing)} does not exist; give the --out folders of "
              "`reinforge bench train` runs", file=sys.stderr)
        return 2
    results = load_cases(args.paths)
    if not results:
        print(f"reinforge bench table: no case of `reinforge bench train --out` in {', '.join(map(str, args.paths))}",
              file=sys.stderr)
        return 2
    print(render_table(results))
    return 0
