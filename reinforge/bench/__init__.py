"""Benchmarks behind ``reinforge bench``, each on a fixed workload with a ``--cpu`` smoke mode:

- ``rollout`` (the default): the native engine against transformers' ``generate`` (``rollout.py``);
- ``train``: full RL steps phase by phase, one model size in this process or several, TRL beside each,
  in processes of their own with one markdown table at the end (``train.py``, ``sizes.py``, ``table.py``);
- ``agent``: multi-turn agent rollouts with sleeping tools (``agent.py``);
- ``modes``: the sync, one_step_off and async training modes on a long-tailed workload (``modes.py``);
- ``dpo``: DPO steps of ``reinforge dpo`` against TRL's DPOTrainer (``dpo.py``);
- ``serve``: concurrent chat requests through ``reinforge serve``'s HTTP endpoint against the same in process (``serve.py``);
- ``table``: one table from the JSON files that ``train --out DIR`` wrote, over one or more folders;
- ``kernels``: one-off sweeps of single CUDA kernels (decode attention's tilings, decode products, a rollout's
  kernels, the soft-capped attention's tilings, the varlen attention kernels), no CPU mode (``kernels/``).

They measure; nothing in the library imports them.
"""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "rollout": "rollout tokens/s of the native engine against transformers' generate (the default)",
    "train": "full GRPO/PPO steps timed phase by phase; --model 0.5b,1.5b,3b,7b --trl for the standard table",
    "agent": "multi-turn agent rollouts: tools sleeping between turns, every trajectory its own task",
    "modes": "sync against one_step_off against async training on a long-tailed workload",
    "dpo": "DPO steps (64 pairs of 512-token completions on a 1.5B shape); --trl runs TRL's DPOTrainer beside it",
    "serve": "256 concurrent chat requests through the HTTP endpoint against the same requests in process",
    "table": "one markdown table from the JSON files of `bench train --out DIR` runs (DIR [DIR ...])",
    "kernels": "one CUDA kernel sweep into OUT.json: WHICH OUT.json (decode-attention, decode-products, "
               "rollout-kernels, softcap-attention, varlen-attention)",
}


def bench_main(argv: list[str]) -> int:
    """``reinforge bench [SUBCOMMAND] ...``: SUBCOMMAND defaults to ``rollout``."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: reinforge bench [rollout|train|agent|modes|dpo|serve|table|kernels] [options]   (--help after one for its options)")
        width = max(map(len, SUBCOMMANDS))
        for name, summary in SUBCOMMANDS.items():
            print(f"  {name:<{width}}  {summary}")
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        print(f"reinforge bench: unknown benchmark {argv[0]!r}; give one of {', '.join(SUBCOMMANDS)} "
              "(reinforge bench --help lists them)", file=sys.stderr)
        return 2
    name, rest = (argv[0], argv[1:]) if argv and argv[0] in SUBCOMMANDS else ("rollout", argv)
    if name == "train":
        from reinforge.bench.train import bench_train_main

        return bench_train_main(rest)
    if name == "agent":
        from reinforge.bench.agent import agent_main

        return agent_main(rest)
    if name == "modes":
        from reinforge.bench.modes import modes_main

        return modes_main(rest)
    if name == "dpo":
        from reinforge.bench.dpo import dpo_main

        return dpo_main(rest)
    if name == "serve":
        from reinforge.bench.serve import serve_bench_main

        return serve_bench_main(rest)
    if name == "table":
        from reinforge.bench.table import table_main

        return table_main(rest)
    if name == "kernels":
        from reinforge.bench.kernels import kernels_main

        return kernels_main(rest)
    from reinforge.bench.rollout import bench_main as rollout_main

    return rollout_main(rest)

