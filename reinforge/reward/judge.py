"""An LLM as judge (verl calls it a generative reward model): its prompts and how its answers become scores.

The judge reads a prompt built from ``reward.judge.template``, whose ``{prompt}``, ``{response}`` and
``{ground_truth}`` are the sample's problem (its user turns, or the plain prompt), the policy's response
(decoded, special tokens dropped) and the row's reference answer. With ``chat_template`` the text is the
user turn of the judge's own chat template, with the generation prompt.

Its answer becomes a score by one rule (``reward.judge.parse``):
- ``marker``: the number after the last ``marker`` in the judgement (``Score: 7`` -> 7.0);
- ``boxed``: the number in the last ``\\boxed{...}``;
- ``yes_no``: nothing is generated; the score is the judge's probability of ``yes_token`` against
  ``no_token`` as the first token of its answer, ``p(yes) / (p(yes) + p(no))``.
The number is divided by ``scale`` (a judge asked for 0-10 with ``scale: 10`` scores in [0, 1]). A judgement
the rule cannot read is malformed: the sample gets ``fallback_score`` and is counted, never a crash.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PARSE_RULES = ("marker", "boxed", "yes_no")
"""The values of reward.judge.parse."""

FIELDS = ("prompt", "response", "ground_truth")
"""The placeholders a judge template may use."""

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_TEMPLATE_FIELD = re.compile(r"(?<!\{)\{([A-Za-z_][A-Za-z0-9_]*)\}(?!\})")


def template_fields(template: str) -> set[str]:
    """The ``{name}`` placeholders of ``template`` (``{{`` and ``}}`` are literal braces)."""
    return set(_TEMPLATE_FIELD.findall(template))


def check_template(template: str, source: str) -> None:
    """Raises ValueError in one line for a placeholder that is not one of FIELDS, or a template without the response."""
    unknown = sorted(template_fields(template) - set(FIELDS))
    if unknown:
        raise ValueError(f"{source} has the placeholder {{{unknown[0]}}}, which is not one of "
                         f"{', '.join('{' + name + '}' for name in FIELDS)}; write a literal brace as {{{{ or }}}}")
    if "response" not in template_fields(template):
        raise ValueError(f"{source} never shows the judge the response: add {{response}} where it goes")


def problem_text(raw_prompt: Any) -> str:
    """The problem a sample answers: a plain prompt as it is, or the text of a chat prompt's user turns."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    turns = [str(message.get("content", "")) for message in raw_prompt if message.get("role") == "user"]
    return "\n\n".join(turns)


def render(template: str, prompt: str, response: str, ground_truth: Any) -> str:
    """The judge's prompt text for one sample."""
    values = {"prompt": prompt, "response": response, "ground_truth": "" if ground_truth is None else str(ground_truth)}
    pieces, end = [], 0
    for match in _TEMPLATE_FIELD.finditer(template):  # only the template's own text has {{ and }} to unescape
        pieces += [_unescaped(template[end:match.start()]), values[match.group(1)]]
        end = match.end()
    return "".join(pieces) + _unescaped(template[end:])


def _unescaped(text: str) -> str:
    return text.replace("{{", "{").replace("}}", "}")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, position = 0, start + len("\\boxed")
    for index in range(position, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[position + 1:index]
    return None


def parse_judgement(text: str, rule: str, marker: str = "Score:") -> float | None:
    """The number the judgement gives under ``rule`` (marker or boxed), or None where there is none."""
    if rule == "marker":
        at = text.rfind(marker)
        if at < 0:
            return None
        found = _NUMBER.match(text[at + len(marker):].lstrip(" \t*:=\n"))
    elif rule == "boxed":
        inner = _last_boxed(text)
        found = _NUMBER.fullmatch(inner.strip().rstrip("%")) if inner is not None else None
    else:
        raise ValueError(f"reward.judge.parse={rule!r} reads no generated text; it is one of {', '.join(PARSE_RULES)}")
    if found is None:
        return None
    value = float(found.group(0))
    return value if math.isfinite(value) else None


def yes_probability(log_p_yes: float, log_p_no: float) -> float:
    """p(yes) / (p(yes) + p(no)) from the two log-probabilities, computed stably."""
    top = max(log_p_yes, log_p_no)
    yes, no = math.exp(log_p_yes - top), math.exp(log_p_no - top)
    return yes / (yes + no)


@dataclass
class Judgements:
    """The scores of a batch's judgements and what the metrics count."""

    scores: list[float]
    malformed: int
    """Judgements the parse rule could not read (each scored fallback_score)."""
    timed_out: int = 0
    """Samples whose judging ran out of reward.judge.timeout_s (each scored fallback_score)."""

    def metrics(self, seconds: float) -> dict[str, float]:
        count = max(len(self.scores), 1)
        return {"reward/judge/calls": float(len(self.scores)), "reward/judge/malformed": float(self.malformed),
                "reward/judge/timeouts": float(self.timed_out), "reward/judge/time_s": seconds,
                "reward/judge/score/mean": sum(self.scores) / count}


def scores_from_texts(texts: Sequence[str], rule: str, marker: str, scale: float, fallback: float) -> Judgements:
    """Each judgement's score (divided by ``scale``), ``fallback`` where it cannot be read."""
    scores, malformed = [], 0
    for text in texts:
        value = parse_judgement(text, rule, marker)
        if value is None:
            malformed += 1
            scores.append(fallback)
        else:
            scores.append(value / scale)
    return Judgements(scores, malformed)


def read_template(template: str) -> str:
    """reward.judge.template: the text itself, or the contents of the file it names.

    A single line without ``{`` and with a file suffix or a ``/`` that names no file is refused: it is a path
    that was mistyped, not a template.
    """
    from pathlib import Path

    candidate = Path(template).expanduser()
    if "{" not in template and "\n" not in template and len(template) < 4096:
        if candidate.is_file():
            return candidate.read_text()
        if (candidate.suffix or "/" in template) and " " not in candidate.name:
            raise ValueError(f"reward.judge.template={template} names no file (from {Path.cwd()}); give the "
                             "template file's path, or the template's text with {response} in it")
    return template


def _judge_ids(tokenizer: Any, text: str, chat_template: bool) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def judge_prompts(batch: Any, policy_tokenizer: Any, judge_tokenizer: Any, template: str, chat_template: bool,
                  max_prompt_length: int) -> tuple[Any, int]:
    """(the judge's prompts as a left-padded Batch, one row per sample, each its own request; how many were cut).

    ``batch`` holds the policy's samples (prompts, attention_mask, input_ids and the raw_prompt and ground_truth
    columns); a prompt longer than ``max_prompt_length`` keeps its last tokens, where the judge is asked.
    """
    import torch

    from reinforge.protocol import Batch

    prompt_width = batch["prompts"].shape[1]
    raw_prompts = batch.non_tensors.get("raw_prompt")
    truths = batch.non_tensors.get("ground_truth")
    sequences, cut = [], 0
    for row in range(len(batch)):
        response_ids = batch["input_ids"][row, prompt_width:][batch["attention_mask"][row, prompt_width:].bool()]
        response = policy_tokenizer.decode(response_ids.tolist(), skip_special_tokens=True)
        if raw_prompts is not None:
            problem = problem_text(raw_prompts[row])
        else:
            prompt_ids = batch["prompts"][row][batch["attention_mask"][row, :prompt_width].bool()]
            problem = policy_tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)
        text = render(template, problem, response, truths[row] if truths is not None else None)
        ids = _judge_ids(judge_tokenizer, text, chat_template)
        if len(ids) > max_prompt_length:
            cut += 1
            ids = ids[-max_prompt_length:]
        sequences.append(ids)
    width = max(len(ids) for ids in sequences)
    pad = judge_tokenizer.pad_token_id if judge_tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    uids = [f"judge-{row}" for row in range(len(sequences))]
    return Batch.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                                    "position_ids": position_ids},
                           non_tensors={"uid": uids}), cut


def answer_token_id(tokenizer: Any, answer: str, key: str) -> int:
    """The one token ``answer`` is in the judge's vocabulary; ValueError in one line naming ``key`` otherwise."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        variants = dict.fromkeys(form for word in (answer.strip(), answer.strip()[:1]) if word
                                 for form in (word, f" {word}", word.lower(), f" {word.lower()}"))
        single = [form for form in variants if len(tokenizer(form, add_special_tokens=False)["input_ids"]) == 1]
        hint = f"e.g. {', '.join(map(repr, single))}" if single else "its vocabulary has none of " + ", ".join(
            map(repr, variants))
        raise ValueError(f"{key}={answer!r} is {len(ids)} tokens of the judge's vocabulary; parse=yes_no reads the "
                         f"probability of one token: pick an answer that is one token ({hint})")
    return int(ids[0])


def yes_no_batch(prompts: Any, yes_id: int, no_id: int) -> Any:
    """Each judge prompt twice, followed by the yes token and by the no token: rows 2i (yes) and 2i+1 (no), in the
    scoring layout (prompts, responses, input_ids, attention_mask, position_ids, response_mask)."""
    import torch

    from reinforge.protocol import Batch

    prompt_ids = prompts["input_ids"].repeat_interleave(2, dim=0)
    prompt_mask = prompts["attention_mask"].repeat_interleave(2, dim=0)
    responses = torch.tensor([[yes_id], [no_id]] * len(prompts), dtype=torch.long)
    response_mask = torch.ones_like(responses)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    uids = [str(uid) for uid in prompts.non_tensors["uid"] for _ in range(2)]
    return Batch.from_dict(tensors={"prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                                    "input_ids": torch.cat([prompt_ids, responses], dim=1),
                                    "attention_mask": attention_mask, "position_ids": position_ids},
                           non_tensors={"uid": uids})


def yes_no_scores(log_probs: Any, temperature: float) -> list[float]:
    """p(yes) / (p(yes) + p(no)) per prompt, from ``yes_no_batch``'s response log-probs (2B, >= 1) computed at
    ``temperature`` (logits divided by it: the log-odds are multiplied back; 0, greedy, computes them at 1 as the
    log-prob passes do)."""
    scale = temperature if temperature > 0 else 1.0
    values = log_probs[:, 0].double().tolist()
    scores = []
    for yes, no in zip(values[0::2], values[1::2], strict=True):
        scores.append(yes_probability(yes * scale, no * scale))
    return scores


def unreadable(judgements: Judgements, texts: Sequence[str], rule: str, marker: str) -> str | None:
    """One line when no judgement of a batch could be read (nothing to learn from), else None."""
    if not texts or judgements.malformed < len(texts):
        return None
    sample = texts[0].strip().replace("\n", " ")[:120] or texts[0][:120]  # a blank answer as it was written
    where = f"a number after {marker!r}" if rule == "marker" else "a number in \\boxed{}"
    return (f"none of the judge's {len(texts)} answers has {where} (reward.judge.parse={rule}); the first reads "
            f"{sample!r}: fix reward.judge.template or reward.judge.parse/marker")
