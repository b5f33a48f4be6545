"""The transformers backend: wraps ``model.generate`` behind the rollout-engine interface.

It works for any causal LM transformers can load and is the fallback where the native engine
does not support an architecture. It generates with the training model itself (same
parameters, nothing to copy), so ``sync_weights`` has nothing to do. Requests with equal
sampling parameters are batched together, prompts left-padded.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from reinforge.rollout.base import Completion, GenerationRequest, SamplingParams


class HFEngine:
    def __init__(self, model: nn.Module, *, pad_token_id: int, eos_token_ids: list[int], max_batch_size: int = 256):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.last_metrics: dict[str, float] = {}

    def sync_weights(self, model: nn.Module) -> None:
        self.model = model

    def wake_up(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        results: list[list[Completion] | None] = [None] * len(requests)
        groups: dict[SamplingParams, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[request.sampling].append(index)
        for sampling, indices in groups.items():
            per_call = max(1, self.max_batch_size // sampling.n)
            for start in range(0, len(indices), per_call):
                chunk = indices[start:start + per_call]
                completions = self._generate_same_params([requests[i].prompt_token_ids for i in chunk], sampling)
                for index, samples in zip(chunk, completions, strict=True):
                    results[index] = samples
        return [samples for samples in results if samples is not None]

    @torch.no_grad()
    def _generate_same_params(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        device = next(self.model.parameters()).device
        longest = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, longest - len(prompt):] = 1
        stop_ids = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        kwargs = dict(
            max_new_tokens=sampling.max_tokens,
            do_sample=not sampling.greedy,
            num_return_sequences=sampling.n,
            pad_token_id=self.pad_token_id,
            eos_token_id=None if sampling.ignore_eos else stop_ids,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        if sampling.ignore_eos:
            kwargs["min_new_tokens"] = sampling.max_tokens
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k if sampling.top_k > 0 else None,
                          min_p=sampling.min_p if sampling.min_p > 0 else None)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                output = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                             **kwargs)
        finally:
            self.model.train(was_training)
        generated = output.sequences[:, longest:].cpu()
        logits = torch.stack(output.logits, dim=1).float() if output.logits else torch.zeros(len(generated), 0, 1)
        scale = 1.0 if sampling.greedy else sampling.temperature
        log_probs = torch.log_softmax(logits / scale, dim=-1)
        token_log_probs = log_probs.gather(-1, generated.to(log_probs.device).unsqueeze(-1)).squeeze(-1).cpu()
        completions: list[list[Completion]] = []
        stop_set = set(stop_ids)
        for row in range(len(prompts)):
            samples = []
            for sample in range(sampling.n):
                flat = row * sampling.n + sample
                token_ids = generated[flat].tolist()
                length, finish_reason = len(token_ids), "length"
                if not sampling.ignore_eos:
                    for position, token in enumerate(token_ids):
                        if token in stop_set:
                            length, finish_reason = position + 1, "stop"
                            break
                samples.append(Completion(token_ids[:length], token_log_probs[flat, :length].tolist(), finish_reason))
            completions.append(samples)
        return completions
