"""The chain from preferences to a better policy, on the CPU: a tiny policy learns by SFT to answer yes or no
about half the time; ``reinforge rm`` learns from pairs that prefer yes, and its held-out accuracy rises well
above chance; GRPO with that reward model as its only reward, and DPO on the same pairs, each raise the rate at
which the policy says yes to questions it never saw."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from reinforge.cli import main
from reinforge.models import load_causal_lm, load_tokenizer, save_tiny_model

pytestmark = pytest.mark.slow

CPU_RUN = ["trainer.loggers=[jsonl]", "trainer.device=cpu", "optim.warmup_ratio=0", "optim.schedule=constant"]


def question(index: int) -> list[dict]:
    return [{"role": "user", "content": f"question {index}?"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def preference_pairs(num_pairs: int, first_question: int, rng: random.Random) -> list[dict]:
    return [{"prompt": question(first_question + index),
             "chosen": [{"role": "assistant", "content": rng.choice(("yes", "yes, sure", "ok yes"))}],
             "rejected": [{"role": "assistant", "content": rng.choice(("no", "no, sorry", "ok no"))}]}
            for index in range(num_pairs)]


def final_model(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "hf"


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@torch.no_grad()
def yes_rate(model_dir: Path, num_samples: int = 128) -> float:
    """The share of sampled answers (temperature 1) to unseen questions that say yes."""
    tokenizer = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), dtype=torch.float32, device="cpu").eval()
    prompts = [tokenizer.apply_chat_template(question(5000 + index), tokenize=False, add_generation_prompt=True)
               for index in range(num_samples)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    output = model.generate(**encoded, do_sample=True, max_new_tokens=6, temperature=1.0,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    answers = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum("yes" in answer for answer in answers) / num_samples


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chain")
    conversations = [{"messages": question(index) + [{"role": "assistant", "content": "yes" if index % 2 else "no"}]}
                     for index in range(64)]
    sft_data = write_jsonl(root / "sft.jsonl", conversations)
    base = save_tiny_model(root / "model")
    assert main(["sft", f"model.path={base}", f"data.train_files=[{sft_data}]",
                 "data.batch_size=16", "data.max_length=64", f"trainer.output_dir={root / 'sft'}",
                 "trainer.total_steps=40", "optim.lr=1e-2", *CPU_RUN]) == 0
    rng = random.Random(0)
    return {"root": root, "base": base, "policy": final_model(root / "sft"),
            "pairs": write_jsonl(root / "pairs.jsonl", preference_pairs(64, 0, rng)),
            "val_pairs": write_jsonl(root / "val_pairs.jsonl", preference_pairs(32, 1000, rng))}


def pair_run(chain: dict[str, Path], run: str, *overrides: str) -> list[str]:
    return [f"data.train_files=[{chain['pairs']}]", f"data.val_files=[{chain['val_pairs']}]", "data.batch_size=16",
            "data.max_length=48", "trainer.max_tokens_per_micro_batch=4096",
            f"trainer.output_dir={chain['root'] / run}", *CPU_RUN, *overrides]


def test_a_reward_model_trained_by_rm_makes_grpo_say_yes_more_often(chain):
    before = yes_rate(chain["policy"])
    assert 0.3 < before < 0.7  # the SFT policy says yes about half the time

    rm_dir = chain["root"] / "rm"
    # from the untrained causal LM: the score head starts new
    assert main(["rm", f"model.path={chain['base']}", *pair_run(chain, "rm", "trainer.total_steps=12", "optim.lr=1e-3")]) == 0
    metrics = metrics_of(rm_dir)
    assert metrics[0]["eval_accuracy"] < 0.7 and metrics[-1]["eval_accuracy"] >= 0.95  # held-out pairs

    prompts = chain["root"] / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": question(index), "data_source": "chat/yes"}
                                         for index in range(64)]), prompts)
    grpo_dir = chain["root"] / "grpo"
    assert main(["train", f"model.path={chain['policy']}", f"data.train_files=[{prompts}]",
                 "data.train_batch_size=8", "data.max_prompt_length=32", "data.max_response_length=6", "rollout.n=4",
                 f"trainer.output_dir={grpo_dir}", "trainer.loggers=[jsonl]", "trainer.total_steps=10",
                 "trainer.val_before_train=false", "actor.optim.lr=5e-4", "reward.reward_model.enable=true",
                 f"reward.reward_model.model_path={final_model(rm_dir)}"]) == 0
    steps = metrics_of(grpo_dir)
    assert all(step["critic/score/mean"] == pytest.approx(step["reward_model/score/mean"], abs=1e-6) for step in steps)
    after = yes_rate(final_model(grpo_dir))
    assert after >= before + 0.15, (before, after)


def test_dpo_on_the_same_pairs_makes_the_policy_say_yes_more_often(chain):
    before = yes_rate(chain["policy"])
    dpo_dir = chain["root"] / "dpo"
    assert main(["dpo", f"model.path={chain['policy']}",
                 *pair_run(chain, "dpo", "trainer.total_steps=10", "optim.lr=1e-3", "dpo.beta=0.5")]) == 0
    assert metrics_of(dpo_dir)[-1]["eval_rewards/accuracies"] >= 0.9
    after = yes_rate(final_model(dpo_dir))
    assert after >= before + 0.2, (before, after)
