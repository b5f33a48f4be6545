"""``reinforge bench agent``: multi-turn agent rollout speed, many trajectories at once on the native engine,
tools sleeping meanwhile.

    reinforge bench agent --out agent.json        # CUDA, the 0.5B standard model
    reinforge bench agent --cpu --out agent.json  # tiny model: a smoke test

Workload: the Qwen2.5-0.5B architecture with random bf16 weights (as ``reinforge bench``), 256
trajectories, each a 128-token random prompt and 1 to 4 assistant turns of 128 to 512 sampled
tokens (drawn per trajectory with a fixed seed; EOS ignored, so the lengths are exact; about 800 a
trajectory, next to the standard benchmarks' 512-token responses; ``--turn-tokens`` sets them), with a
tool call between turns that sleeps 50-500 ms and returns 32 tokens (response_mask 0). The loop
is registered here (``bench_turns``) and runs on ``reinforge.agent.AgentRunner`` exactly as a
training rollout does, every trajectory its own asyncio task, turns joining the engine's running
batch through ``generate_async``.

Reported:
- agent rollout: sampled tokens / wall time of the whole rollout, the engine-busy fraction
  (wall time inside engine steps that had work, over the rollout's wall time; the device may stay
  busy a little longer, as decode steps are launched ahead) and the GPU-busy fraction (``nvidia-smi``'s
  utilization.gpu every 50 ms, ``reinforge.bench.gpu_busy``; also for single-turn); the prefix cache's share of the turns'
  prompt tokens;
- single-turn rate: the same 256 prompts, each generating its trajectory's total sampled tokens in
  one request, with ``engine.generate`` (the rate a single-turn rollout of these tokens gets);
- synchronous turns: the same trajectories run turn by turn with a barrier, as a batched
  synchronous loop does (all turn-k generations together, then all turn-k tool calls, then turn k+1);
- serial: a few trajectories run one after another (generate, tool, generate, ...), extrapolated to
  all 256;
- for the agent, single-turn and synchronous runs, the engine's steps: prefill steps (and their wall
  time, launch to tokens read back), decode steps and the mean batch of a decode step (each prefill
  step stalls every running sequence, so an agent rollout that prefills every arriving turn on its
  own does many more steps than the other two);
- the critical-path bound: the slowest trajectory's sampled tokens at the single-turn run's step
  time plus its tool sleeps, which no scheduler can beat, and the agent/single-turn ratio it allows.
A trajectory's next turn prefills only its new tokens (the prefix cache; ``--no-prefix-cache``
prefills the whole context); prefill tokens are counted in no rate. ``--admission-wait`` and
``--admission-fraction`` set how arriving turns are batched (``NativeEngine``'s
``max_admission_wait`` and ``admission_fraction``); several comma-separated values run the agent
rollout once per pair, e.g. ``--admission-wait 0,8,16,32``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import torch

from reinforge.agent import AGENT_LOOPS, AgentLoop, AgentLoopOutput, AgentRunner, AsyncEngineClient, register_agent_loop
from reinforge.bench.gpu_busy import GpuBusy
from reinforge.bench.rollout import QWEN25_05B, TINY, build_model, environment, print_rows, random_prompts
from reinforge.config.schema import MultiTurnConfig
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.counters import count_metrics


class TimedEngine(NativeEngine):
    """The native engine, adding up the wall time of its steps that had work."""

    busy_s = 0.0

    def _step(self, batch_arrivals: bool = False) -> bool:
        start = time.perf_counter()
        ran = super()._step(batch_arrivals)
        if ran:
            self.busy_s += time.perf_counter() - start
        return ran


def plan(num_trajectories: int, seed: int, turn_range: tuple[int, int], max_turns: int,
         sleep_range: tuple[float, float]) -> list[dict[str, Any]]:
    """Each trajectory's turn lengths and tool sleeps, fixed by the seed."""
    rng = random.Random(seed)
    trajectories = []
    for _ in range(num_trajectories):
        num_turns = rng.randint(1, max_turns)
        trajectories.append({"turn_tokens": [rng.randint(*turn_range) for _ in range(num_turns)],
                             "sleeps": [rng.uniform(*sleep_range) for _ in range(num_turns - 1)]})
    return trajectories


def tool_tokens(vocab_size: int, count: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def register_bench_loop(tool_output: list[int]) -> None:
    if "bench_turns" in AGENT_LOOPS:
        return

    @register_agent_loop("bench_turns")
    class BenchTurns(AgentLoop):
        """Turns of planned lengths with a sleeping tool between them (the row's ``turn_tokens`` and ``sleeps``)."""

        async def run(self, sampling: SamplingParams, **row: Any) -> AgentLoopOutput:
            prompt, response, mask, log_probs = list(row["prompt_ids"]), [], [], []
            turn_seconds = []  # (submitted, returned) of each turn's generation, perf_counter
            for turn, num_tokens in enumerate(row["turn_tokens"]):
                turn_sampling = SamplingParams(max_tokens=num_tokens, temperature=1.0, ignore_eos=True,
                                               seed=row["seed"] + turn)
                submitted = time.perf_counter()
                completion = await self.context.client.generate(prompt + response, turn_sampling, "")
                turn_seconds.append((submitted, time.perf_counter()))
                response += completion.token_ids
                mask += [1] * len(completion.token_ids)
                log_probs += completion.log_probs
                if turn < len(row["sleeps"]):
                    await asyncio.sleep(row["sleeps"][turn])
                    response += tool_output
                    mask += [0] * len(tool_output)
                    log_probs += [0.0] * len(tool_output)
            return AgentLoopOutput(prompt, response, mask, log_probs, num_turns=2 * len(row["turn_tokens"]),
                                   extra={"turn_seconds": turn_seconds})


def step_counts(metrics: dict[str, float]) -> dict:
    """Prefill steps (and their time), decode steps and the mean decode batch of a span's ``count_metrics``."""
    return {"prefill_steps": int(metrics["rollout/num_prefill_steps"]),
            "prefill_s": metrics["rollout/prefill_s"],
            "decode_steps": int(metrics["rollout/num_decode_steps"]),
            "decode_batch_mean": metrics["rollout/decode_batch_mean"]}


def forget_cached_prefixes(engine: TimedEngine) -> None:
    """Each run starts from an empty prefix cache (the runs share prompts)."""
    if engine.scheduler is not None:
        engine.scheduler.block_manager.reset_prefix_cache()


def run_agents(engine: TimedEngine, prompts: list[list[int]], trajectories: list[dict],
               gpu: GpuBusy | None = None) -> dict:
    rows = [{"prompt_ids": prompt, "agent_name": "bench_turns", "seed": 1000 * index, **trajectory}
            for index, (prompt, trajectory) in enumerate(zip(prompts, trajectories, strict=True))]
    runner = AgentRunner(tokenizer=None, config=MultiTurnConfig())
    forget_cached_prefixes(engine)
    engine.busy_s = 0.0
    counts = engine.counts()
    start = time.perf_counter()
    outputs = runner.run(rows, [SamplingParams()] * len(rows), AsyncEngineClient(engine))
    end = time.perf_counter()
    elapsed = end - start
    sampled = sum(sum(output.response_mask) for output in outputs)
    span = count_metrics(counts, engine.counts())
    return {"time_s": elapsed, "sampled_tokens": sampled, "tokens_per_s": sampled / elapsed,
            "last_trajectory": last_trajectory(outputs, trajectories, start, elapsed, span),
            "engine_busy_fraction": engine.busy_s / elapsed, "gpu_busy_fraction": gpu.mean(start, end) if gpu else None,
            "prefix_cache_hit_tokens": span["rollout/prefix_cache_hit_tokens"],
            "prefill_tokens": span["rollout/prefill_tokens"],
            "prefix_cache_hit_rate": span["rollout/prefix_cache_hit_rate"],
            "admission_wait": engine.max_admission_wait, "admission_fraction": engine.admission_fraction,
            **step_counts(span)}


def last_trajectory(outputs: list[AgentLoopOutput], trajectories: list[dict], start: float, elapsed: float,
                    span: dict) -> dict:
    """Where the trajectory that returned last spent its time: each turn's generation (submitted to returned)
    against its tokens at the run's mean decode-step time; the rest of a turn's time is its wait to be admitted,
    prefill steps (its own and others') and the read-back of its last token."""
    index = max(range(len(outputs)), key=lambda i: outputs[i].extra["turn_seconds"][-1][1])
    turns = outputs[index].extra["turn_seconds"]
    decode_step_s = (elapsed - span["rollout/prefill_s"]) / max(span["rollout/num_decode_steps"], 1)
    generate_s = [done - submitted for submitted, done in turns]
    tokens = trajectories[index]["turn_tokens"]
    result = {"index": index, "finished_s": turns[-1][1] - start, "first_submitted_s": turns[0][0] - start,
              "turn_tokens": tokens, "generate_s": generate_s,
              "between_turns_s": [turns[k + 1][0] - turns[k][1] for k in range(len(turns) - 1)],
              "planned_sleeps_s": trajectories[index]["sleeps"]}
    result["decode_step_s"] = decode_step_s
    result["generate_over_tokens_s"] = [g - n * decode_step_s for g, n in zip(generate_s, tokens, strict=True)]
    return result


def run_single_turn(engine: TimedEngine, prompts: list[list[int]], trajectories: list[dict],
                    gpu: GpuBusy | None = None) -> dict:
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=sum(t["turn_tokens"]), ignore_eos=True, seed=i))
                for i, (prompt, t) in enumerate(zip(prompts, trajectories, strict=True))]
    engine.busy_s = 0.0
    counts = engine.counts()
    start = time.perf_counter()
    completions = engine.generate(requests)
    end = time.perf_counter()
    elapsed = end - start
    sampled = sum(len(samples[0].token_ids) for samples in completions)
    return {"time_s": elapsed, "sampled_tokens": sampled, "tokens_per_s": sampled / elapsed,
            "engine_busy_fraction": engine.busy_s / elapsed, "gpu_busy_fraction": gpu.mean(start, end) if gpu else None,
            **step_counts(count_metrics(counts, engine.counts()))}


def run_synchronous_turns(engine: TimedEngine, prompts: list[list[int]], trajectories: list[dict],
                          tool_output: list[int]) -> dict:
    contexts = [list(prompt) for prompt in prompts]
    counts = engine.counts()
    start, sampled = time.perf_counter(), 0
    for turn in range(max(len(t["turn_tokens"]) for t in trajectories)):
        active = [i for i, t in enumerate(trajectories) if turn < len(t["turn_tokens"])]
        requests = [GenerationRequest(contexts[i], SamplingParams(max_tokens=trajectories[i]["turn_tokens"][turn],
                                                                  ignore_eos=True, seed=1000 * i + turn))
                    for i in active]
        for i, samples in zip(active, engine.generate(requests), strict=True):
            contexts[i] += samples[0].token_ids
            sampled += len(samples[0].token_ids)
        sleeps = [trajectories[i]["sleeps"][turn] for i in active if turn < len(trajectories[i]["sleeps"])]
        if sleeps:  # the turn's tool calls run together; the next turn waits for the slowest
            time.sleep(max(sleeps))
            for i in active:
                if turn < len(trajectories[i]["sleeps"]):
                    contexts[i] += tool_output
    elapsed = time.perf_counter() - start
    return {"time_s": elapsed, "sampled_tokens": sampled, "tokens_per_s": sampled / elapsed,
            **step_counts(count_metrics(counts, engine.counts()))}


def run_serial(engine: TimedEngine, prompts: list[list[int]], trajectories: list[dict], tool_output: list[int],
               num_measured: int) -> dict:
    start, sampled = time.perf_counter(), 0
    for i in range(num_measured):
        context = list(prompts[i])
        for turn, num_tokens in enumerate(trajectories[i]["turn_tokens"]):
            [samples] = engine.generate([GenerationRequest(context, SamplingParams(
                max_tokens=num_tokens, ignore_eos=True, seed=1000 * i + turn))])
            context += samples[0].token_ids
            sampled += len(samples[0].token_ids)
            if turn < len(trajectories[i]["sleeps"]):
                time.sleep(trajectories[i]["sleeps"][turn])
                context += tool_output
    elapsed = time.perf_counter() - start
    scale = len(trajectories) / num_measured
    return {"measured_trajectories": num_measured, "measured_time_s": elapsed,
            "time_s_extrapolated": elapsed * scale, "tokens_per_s": sampled / elapsed}


def agent_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="reinforge bench agent",
                                     description="multi-turn agent rollout speed on the native engine")
    parser.add_argument("--cpu", action="store_true", help="tiny model on the CPU: a smoke test, no timing claims")
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--trajectories", type=int, default=None)
    parser.add_argument("--serial", type=int, default=None, help="trajectories timed one after another")
    parser.add_argument("--full-workload", action="store_true",
                        help="with --cpu: the GPU run's workload (trajectories, turn lengths, tool sleeps) on the tiny "
                             "model, for step counts like the GPU run's (its times are the CPU's own)")
    parser.add_argument("--turn-tokens", default=None,
                        help="MIN,MAX sampled tokens of a turn (default 128,512 on the GPU); the critical-path bound "
                             "rises with longer turns, as the tools' sleeps weigh less")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="prefill every turn's whole context (the engine's prefix cache off)")
    parser.add_argument("--admission-wait", default="16",
                        help="decode steps an arriving turn may wait for others to join its prefill (comma list)")
    parser.add_argument("--admission-fraction", default="0.0625",
                        help="waiting turns, as a fraction of the running ones, prefilled at once (comma list)")
    args = parser.parse_args(argv)
    if not args.cpu:
        return run(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for OpenMP: more threads only wait on each other
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # tests call main() in their own process


def run(args: argparse.Namespace) -> int:
    admissions = admission_settings(args.admission_wait, args.admission_fraction)
    full_workload = dict(trajectories=256, prompt_len=128, turn_range=(128, 512), max_turns=4, sleep_range=(0.05, 0.5),
                         tool_tokens=32, serial=4)
    if args.cpu:
        device, dtype, arch = torch.device("cpu"), torch.float32, TINY
        settings = dict(trajectories=8, prompt_len=16, turn_range=(4, 16), max_turns=4, sleep_range=(0.005, 0.05),
                        tool_tokens=32, serial=2)
        if args.full_workload:
            settings = dict(full_workload, serial=1)
    else:
        if not torch.cuda.is_available():
            print("reinforge bench agent needs a CUDA GPU; pass --cpu for the smoke test on a tiny model", file=sys.stderr)
            return 2
        device, dtype, arch = torch.device("cuda"), torch.bfloat16, QWEN25_05B
        settings = full_workload
    settings["trajectories"] = args.trajectories or settings["trajectories"]
    settings["serial"] = args.serial or settings["serial"]
    if args.turn_tokens:
        low, high = (int(value) for value in args.turn_tokens.split(","))
        settings["turn_range"] = (low, high)
    trajectories = plan(settings["trajectories"], 0, settings["turn_range"], settings["max_turns"],
                        settings["sleep_range"])
    prompts = random_prompts(settings["trajectories"], [settings["prompt_len"]], arch["vocab_size"], seed=2)
    tool_output = tool_tokens(arch["vocab_size"], settings["tool_tokens"], seed=3)
    register_bench_loop(tool_output)
    longest = settings["prompt_len"] + max(sum(t["turn_tokens"]) for t in trajectories) \
        + settings["tool_tokens"] * settings["max_turns"] + 16
    model = build_model(arch, dtype, device)
    engine = TimedEngine(model, eos_token_ids=[arch["vocab_size"] - 1], max_model_len=longest,
                         max_num_seqs=max(settings["trajectories"], 8), gpu_memory_utilization=0.5,
                         enable_prefix_caching=not args.no_prefix_cache, max_admission_wait=admissions[0][0],
                         admission_fraction=admissions[0][1])
    settings["prefix_cache"] = not args.no_prefix_cache
    # Warm-up, untimed: one whole single-turn and one whole agent rollout, so that Triton's compilation and the
    # lazy CUDA-graph capture of every decode batch size are paid before any timed run (else the first timed run
    # pays them, and a sweep's later runs look faster only for coming later).
    run_single_turn(engine, prompts, trajectories)
    run_agents(engine, prompts, trajectories)
    results: dict = {"environment": environment(device), "settings": settings,
                     "num_turns_total": sum(len(t["turn_tokens"]) for t in trajectories),
                     "tool_seconds_total": sum(sum(t["sleeps"]) for t in trajectories)}
    gpu = GpuBusy()
    try:
        results["single_turn"] = run_single_turn(engine, prompts, trajectories, gpu)
        results["agent"] = run_agents(engine, prompts, trajectories, gpu)
        results["agent_admission_sweep"] = []
        for wait, fraction in admissions[1:]:
            engine.scheduler.max_admission_wait, engine.scheduler.admission_fraction = wait, fraction
            engine.max_admission_wait, engine.admission_fraction = wait, fraction
            results["agent_admission_sweep"].append(run_agents(engine, prompts, trajectories, gpu))
    finally:
        gpu.close()
    forget_cached_prefixes(engine)
    results["synchronous_turns"] = run_synchronous_turns(engine, prompts, trajectories, tool_output)
    forget_cached_prefixes(engine)
    results["serial"] = run_serial(engine, prompts, trajectories, tool_output, settings["serial"])
    engine.sleep()
    results["agent_vs_single_turn"] = results["agent"]["tokens_per_s"] / results["single_turn"]["tokens_per_s"]
    results["critical_path"] = critical_path(trajectories, results["single_turn"])
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)
    print_table(results)
    return 0


def critical_path(trajectories: list[dict], single_turn: dict) -> dict:
    """A lower bound on the agent rollout's time, from its longest chain of dependent work.

    A trajectory's turns and tool calls run one after another: its sampled tokens take at least one
    decode step each, and its tools sleep in between. At the single-turn run's mean step time (which
    decodes ~100 sequences at once; a step of a few sequences is somewhat faster), the slowest
    trajectory bounds the whole rollout, and so the agent/single-turn ratio any scheduler can reach."""
    step_s = single_turn["time_s"] / (single_turn["decode_steps"] + single_turn["prefill_steps"])
    chains = [(sum(t["turn_tokens"]) * step_s + sum(t["sleeps"]), sum(t["turn_tokens"]), sum(t["sleeps"]))
              for t in trajectories]
    time_s, tokens, sleep_s = max(chains)
    sampled = sum(sum(t["turn_tokens"]) for t in trajectories)
    return {"step_s": step_s, "time_s": time_s, "tokens": tokens, "tool_sleep_s": sleep_s,
            "max_ratio": sampled / time_s / single_turn["tokens_per_s"]}


def admission_settings(waits: str, fractions: str) -> list[tuple[int, float]]:
    """(max_admission_wait, admission_fraction) pairs from two comma lists (a single value pairs with every other)."""
    wait_values = [int(value) for value in waits.split(",")]
    fraction_values = [float(value) for value in fractions.split(",")]
    if len(wait_values) > 1 and len(fraction_values) > 1 and len(wait_values) != len(fraction_values):
        raise SystemExit(f"--admission-wait gives {len(wait_values)} values and --admission-fraction "
                         f"{len(fraction_values)}; give as many of each, or one of either")
    count = max(len(wait_values), len(fraction_values))
    wait_values *= count if len(wait_values) == 1 else 1
    fraction_values *= count if len(fraction_values) == 1 else 1
    return list(zip(wait_values, fraction_values, strict=True))


def describe_steps(run: dict) -> str:
    return (f"{run['prefill_steps']:,} prefill ({run['prefill_s']:.2f} s) + {run['decode_steps']:,} decode steps, "
            f"{run['decode_batch_mean']:.1f} sequences per decode step")


def describe_last(last: dict) -> str:
    over = sum(last["generate_over_tokens_s"])
    return (f"#{last['index']} returned at {last['finished_s']:.2f} s: {sum(last['turn_tokens'])} tokens in "
            f"{sum(last['generate_s']):.2f} s of generation ({over:+.2f} s over its tokens at "
            f"{last['decode_step_s'] * 1000:.2f} ms a step), {sum(last['between_turns_s']):.2f} s between turns "
            f"({sum(last['planned_sleeps_s']):.2f} s of planned sleeps)")


def print_table(results: dict) -> None:
    env, settings = results["environment"], results["settings"]
    print(f"agent rollout  {env['date']}  {env.get('gpu', env['device'])}  torch {env['torch']}")
    print(f"workload: {settings['trajectories']} trajectories, {results['num_turns_total']} turns of "
          f"{settings['turn_range'][0]}-{settings['turn_range'][1]} tokens, tools sleeping "
          f"{settings['sleep_range'][0] * 1000:.0f}-{settings['sleep_range'][1] * 1000:.0f} ms "
          f"({results['tool_seconds_total']:.1f} s in all), {settings['tool_tokens']} tool tokens per call")
    agent, single = results["agent"], results["single_turn"]
    rows = [
        ("agent rollout tokens/s", f"{agent['tokens_per_s']:,.0f}  ({agent['time_s']:.2f} s; admission wait "
                                   f"{agent['admission_wait']} steps, fraction {agent['admission_fraction']})"),
        ("single-turn engine tokens/s", f"{single['tokens_per_s']:,.0f}  ({single['time_s']:.2f} s)"),
        ("agent / single-turn", f"{results['agent_vs_single_turn']:.0%}"),
        ("critical-path bound", f"{results['critical_path']['time_s']:.2f} s, so at most "
                                f"{results['critical_path']['max_ratio']:.0%} of single-turn (slowest trajectory: "
                                f"{results['critical_path']['tokens']} sampled tokens at "
                                f"{results['critical_path']['step_s'] * 1000:.2f} ms a step + "
                                f"{results['critical_path']['tool_sleep_s']:.2f} s of tools)"),
        ("engine-busy fraction (agent)", f"{agent['engine_busy_fraction']:.0%}"),
        ("GPU-busy fraction (agent / single-turn)", "n/a" if agent["gpu_busy_fraction"] is None else
         f"{agent['gpu_busy_fraction']:.0%} / {single['gpu_busy_fraction']:.0%}"),
        ("prefix cache (agent)", f"{agent['prefix_cache_hit_rate']:.0%} of prompt tokens reused  "
                                 f"({agent['prefill_tokens']:,.0f} prefilled)" if settings.get("prefix_cache", True)
         else "off"),
        ("synchronous turns", f"{results['synchronous_turns']['time_s']:.2f} s  "
                              f"({results['synchronous_turns']['tokens_per_s']:,.0f} tokens/s)"),
        ("serial, extrapolated", f"{results['serial']['time_s_extrapolated']:.1f} s  (from "
                                 f"{results['serial']['measured_trajectories']} trajectories)"),
        ("last trajectory (agent)", describe_last(agent["last_trajectory"])),
        ("steps, agent", describe_steps(agent)),
        ("steps, single-turn", describe_steps(single)),
        ("steps, synchronous turns", describe_steps(results["synchronous_turns"])),
    ]
    for run in results.get("agent_admission_sweep", []):
        rows.append((f"agent, wait {run['admission_wait']}, fraction {run['admission_fraction']}",
                     f"{run['tokens_per_s']:,.0f} tokens/s  ({run['time_s']:.2f} s, "
                     f"{run['tokens_per_s'] / single['tokens_per_s']:.0%}), {describe_steps(run)}"))
    print_rows(rows)
