"""``reinforge bench rollout``: rollout throughput of the native engine against transformers' generate.

The standard workload: the Qwen2.5-0.5B architecture with random bf16 weights built in code,
64 prompts of 128 random tokens, n=8 samples each (512 sequences), exactly 512 generated
tokens per sample (EOS ignored), temperature 1, top-p 1, no top-k. It reports the native
engine's tokens/s and peak memory, transformers' ``generate`` on the same requests (all
prompts, first ``--hf-tokens`` tokens only, tokens/s extrapolated; its later steps are slower,
so the ratio is conservative), and a greedy check: the engine against ``generate`` run one
prompt at a time on prompts of mixed lengths (fraction of identical sequences, repeated in
float32 when bf16 is not 100%), with log-probs against a plain forward over prompt+response.
``--context-sweep`` instead decodes a few sequences to long contexts and reports the decode step's time
against the context it reads, beside its bandwidth floor (``rollout_context.py``); ``--model`` picks another
shape of ``bench.shapes`` (random weights). ``--cpu`` runs a tiny model as a smoke test (no timing claims).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import sys
import time

import torch
from torch import nn

from reinforge.rollout.base import GenerationRequest, SamplingParams

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True)


def build_model(config_kwargs: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    from reinforge.models.export import default_dtype

    config = Qwen2Config(**config_kwargs)
    with device, default_dtype(dtype):
        model = Qwen2ForCausalLM(config)
    return model.eval()


def random_prompts(num_prompts: int, lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (lengths[i % len(lengths)],), generator=generator).tolist()
            for i in range(num_prompts)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_check(model: nn.Module, prompts: list[list[int]], max_tokens: int, engine_kwargs: dict) -> dict:
    """Engine greedy tokens vs ``generate`` (one prompt at a time); engine log-probs vs a plain forward."""
    from reinforge.rollout.native import NativeEngine

    device = next(model.parameters()).device
    engine = NativeEngine(model, **engine_kwargs)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    completions = engine.generate([GenerationRequest(prompt, sampling) for prompt in prompts])
    engine.sleep()
    identical, first_divergence, log_prob_errors, hf_errors = 0, [], [], []

    def forward_log_probs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0].cpu()

    with torch.no_grad():
        for prompt, samples in zip(prompts, completions, strict=True):
            tokens = samples[0].token_ids
            input_ids = torch.tensor([prompt], device=device)
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                    temperature=None, top_p=None, top_k=None, output_logits=True,
                                    return_dict_in_generate=True)
            reference = output.sequences[0, len(prompt):].tolist()
            identical += tokens == reference
            first_divergence.append(next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False))
                                          if a != b), None))
            errors = (forward_log_probs(prompt, tokens) - torch.tensor(samples[0].log_probs)).abs()
            log_prob_errors.append(errors)
            hf_logits = torch.stack(output.logits, 1)[0].float()
            hf_log_probs = torch.log_softmax(hf_logits, -1).gather(1, output.sequences[0, len(prompt):, None])[:, 0]
            hf_errors.append((forward_log_probs(prompt, reference) - hf_log_probs.cpu()).abs())
    errors, hf_errors = torch.cat(log_prob_errors), torch.cat(hf_errors)
    return {"num_prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "max_tokens": max_tokens,
            "fraction_identical": identical / len(prompts), "first_divergence": first_divergence,
            "max_abs_log_prob_error": errors.max().item(), "mean_abs_log_prob_error": errors.mean().item(),
            "hf_generate_vs_forward_max_abs_log_prob_error": hf_errors.max().item(),
            "hf_generate_vs_forward_mean_abs_log_prob_error": hf_errors.mean().item()}


def measure_native(model: nn.Module, requests: list[GenerationRequest], engine_kwargs: dict) -> dict:
    from reinforge.rollout.native import NativeEngine

    device = next(model.parameters()).device
    engine = NativeEngine(model, **engine_kwargs)
    memory_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    engine.wake_up()
    warmup = [GenerationRequest(requests[0].prompt_token_ids, SamplingParams(max_tokens=8, n=2, ignore_eos=True))]
    engine.generate(warmup)  # compiles the Triton kernels and captures the CUDA graphs
    _synchronize(device)
    warmup_s = time.perf_counter() - start
    memory_awake = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    completions = engine.generate(requests)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(sample.token_ids) for samples in completions for sample in samples)
    metrics = dict(engine.last_metrics)
    engine.sleep()
    memory_asleep = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    result = {"tokens_per_s": num_tokens / elapsed, "num_tokens": num_tokens, "time_s": elapsed,
              "warmup_and_capture_s": warmup_s, "engine_metrics": metrics}
    if device.type == "cuda":
        result.update(memory_before_wake_gb=memory_before / 2**30, memory_awake_gb=memory_awake / 2**30,
                      memory_after_sleep_gb=memory_asleep / 2**30,
                      peak_memory_gb=metrics.get("rollout/peak_memory_gb", 0.0))
    return result


def measure_hf(model: nn.Module, requests: list[GenerationRequest], hf_tokens: int) -> dict:
    """transformers' ``generate`` sampling the same requests (equal-length prompts: no padding), first tokens only."""
    device = next(model.parameters()).device
    sampling = requests[0].sampling
    input_ids = torch.tensor([request.prompt_token_ids for request in requests], device=device)

    def run(max_new_tokens: int) -> torch.Tensor:
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                              num_return_sequences=sampling.n, max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=0, eos_token_id=None, pad_token_id=0)

    run(2)
    _synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        output = run(hf_tokens)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    num_tokens = (output.shape[1] - input_ids.shape[1]) * output.shape[0]
    return {"tokens_per_s": num_tokens / elapsed, "num_tokens": num_tokens, "time_s": elapsed,
            "note": f"all {len(requests)} prompts x n={sampling.n} in one generate call, first {hf_tokens} tokens "
                    "of each sample; tokens/s extrapolated to the full length (later steps are slower)"}


def environment(device: torch.device) -> dict:
    import transformers

    info = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def bench_main(argv: list[str]) -> int:
    from reinforge.bench.train import _positive_int, _positive_rate

    parser = argparse.ArgumentParser(prog="reinforge bench rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny model on the CPU: a smoke test, no timing claims")
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--num-prompts", type=_positive_int, default=None)
    parser.add_argument("--n", type=_positive_int, default=None, help="samples per prompt")
    parser.add_argument("--prompt-len", type=_positive_int, default=None)
    parser.add_argument("--gen-len", type=_positive_int, default=None)
    parser.add_argument("--hf-tokens", type=_positive_int, default=None, help="tokens per sample for the generate baseline")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers generate baseline")
    parser.add_argument("--skip-greedy-check", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: time the engine's phases and a decode step's pieces (rollout_profile.py) instead")
    parser.add_argument("--context-sweep", action="store_true",
                        help="decode a few sequences to long contexts (default 8 x 1 of 128 + 32,640 tokens) and "
                             "report the decode step's time per context bucket beside its bandwidth floor")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="with --context-sweep: the engine's KV cache, auto (the model dtype) or fp8 "
                             "(rollout.kv_cache_dtype); the floor counts its bytes")
    parser.add_argument("--shared-prefix-decode", choices=["on", "off"], default="off",
                        help="whether a decode step reads a prompt's blocks once for its n samples (on) or once for "
                             "each sample (off)")
    parser.add_argument("--model", default=None, metavar="SHAPE",
                        help="a model shape of reinforge.bench.shapes, random weights (default: Qwen2.5-0.5B)")
    parser.add_argument("--bandwidth-tbps", type=_positive_rate, default=None, metavar="TB/S",
                        help="the device memory rate the floor divides by (default: an H200's copy, bench.floor)")
    args = parser.parse_args(argv)
    from reinforge.bench.shapes import SHAPES

    if args.model is not None and args.model not in SHAPES:
        parser.error(f"--model {args.model} is no model shape; give one of {', '.join(SHAPES)}")
    if args.context_sweep and args.profile:
        parser.error("--context-sweep and --profile are two runs of their own; give one of them")
    if args.context_sweep and args.gen_len is not None and args.gen_len < 2:
        parser.error(f"--gen-len {args.gen_len} with --context-sweep decodes no step (a sequence's first token is its "
                     "prefill's); give --gen-len 2 or more")
    if args.kv_cache_dtype != "auto" and not args.context_sweep:
        parser.error(f"--kv-cache-dtype {args.kv_cache_dtype} applies to --context-sweep; add it or drop the flag")
    if args.profile and (args.cpu or not torch.cuda.is_available()):
        print("reinforge bench rollout --profile needs a CUDA device (it times kernels); drop --profile or --cpu",
              file=sys.stderr)
        return 2

    if args.cpu:
        device, dtype, arch = torch.device("cpu"), torch.float32, TINY
        defaults = dict(num_prompts=4, n=2, prompt_len=16, gen_len=16, hf_tokens=16)
        if args.context_sweep:
            defaults |= dict(num_prompts=2, n=1, gen_len=200)
        check_lengths, check_tokens = [3, 17, 30, 64], 16
    else:
        if not torch.cuda.is_available():
            print("reinforge bench rollout needs a CUDA GPU; pass --cpu for the smoke test on a tiny model",
                  file=sys.stderr)
            return 2
        device, dtype, arch = torch.device("cuda"), torch.bfloat16, QWEN25_05B
        defaults = dict(num_prompts=64, n=8, prompt_len=128, gen_len=512, hf_tokens=64)
        if args.context_sweep:
            defaults |= dict(num_prompts=8, n=1, gen_len=32768 - 128)
        check_lengths, check_tokens = [7, 33, 64, 100, 128, 200, 257, 300], 64
    settings = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    results: dict = {"environment": environment(device), "settings": settings}

    if args.model is not None and not args.cpu:
        from reinforge.bench.rollout_context import build_shape_model
        from reinforge.bench.shapes import shape_config

        arch = shape_config(args.model)
        model = build_shape_model(args.model, dtype, device)
    else:
        model = build_model(arch, dtype, device)
    if args.context_sweep:
        return run_context_sweep(args, results, model, settings, arch["vocab_size"])
    max_model_len = max(settings["prompt_len"] + settings["gen_len"], max(check_lengths) + check_tokens) + 16
    num_seqs = settings["num_prompts"] * settings["n"]
    engine_kwargs = dict(eos_token_ids=[arch["vocab_size"] - 1], max_model_len=max_model_len,
                         max_num_seqs=max(num_seqs, 8), gpu_memory_utilization=0.5, weights_fixed=True,
                         shared_prefix_decode=args.shared_prefix_decode == "on")
    results["shared_prefix_decode"] = args.shared_prefix_decode

    if not args.skip_greedy_check and not args.profile:
        check_prompts = random_prompts(len(check_lengths), check_lengths, arch["vocab_size"], seed=1)
        results["greedy_check"] = {str(dtype).removeprefix("torch."): greedy_check(model, check_prompts, check_tokens,
                                                                                    engine_kwargs)}
        if results["greedy_check"][str(dtype).removeprefix("torch.")]["fraction_identical"] < 1.0 \
                and dtype != torch.float32:
            model32 = copy.deepcopy(model).float()
            results["greedy_check"]["float32"] = greedy_check(model32, check_prompts, check_tokens, engine_kwargs)
            del model32
            if device.type == "cuda":
                torch.cuda.empty_cache()

    prompts = random_prompts(settings["num_prompts"], [settings["prompt_len"]], arch["vocab_size"], seed=2)
    sampling = SamplingParams(max_tokens=settings["gen_len"], temperature=1.0, top_p=1.0, top_k=-1, n=settings["n"],
                              ignore_eos=True)
    requests = [GenerationRequest(prompt, sampling, request_id=str(i)) for i, prompt in enumerate(prompts)]
    if args.profile:
        from reinforge.bench.rollout_profile import print_profile, profile_rollout

        results["profile"] = profile_rollout(model, requests, engine_kwargs)
        if args.out:
            with open(args.out, "w") as file:
                json.dump(results, file, indent=2)
        print_profile(results["profile"])
        return 0
    results["native"] = measure_native(model, requests, engine_kwargs)
    if not args.skip_hf:
        results["hf_generate"] = measure_hf(model, requests, settings["hf_tokens"])
        results["speedup_vs_generate"] = results["native"]["tokens_per_s"] / results["hf_generate"]["tokens_per_s"]

    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)
    print_table(results)
    return 0


def run_context_sweep(args: argparse.Namespace, results: dict, model: nn.Module, settings: dict,
                      vocab_size: int) -> int:
    from reinforge.bench.floor import COPY_BYTES_PER_S
    from reinforge.bench.rollout_context import context_sweep, print_sweep

    prompts = random_prompts(settings["num_prompts"], [settings["prompt_len"]], vocab_size, seed=2)
    num_seqs = settings["num_prompts"] * settings["n"]
    engine_kwargs = dict(eos_token_ids=[vocab_size - 1], max_model_len=settings["prompt_len"] + settings["gen_len"] + 16,
                         max_num_seqs=max(num_seqs, 8), gpu_memory_utilization=0.5, kv_cache_dtype=args.kv_cache_dtype,
                         weights_fixed=True)
    rate = args.bandwidth_tbps * 1e12 if args.bandwidth_tbps else COPY_BYTES_PER_S
    results["model"] = "tiny" if args.cpu else args.model or "0.5b"
    results["context_sweep"] = context_sweep(model, prompts, settings["n"], settings["gen_len"], engine_kwargs, rate)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)
    env = results["environment"]
    print(f"reinforge bench rollout --context-sweep  {env['date']}  {env.get('gpu', env['device'])}  "
          f"model {results['model']}  torch {env['torch']}")
    print_sweep(results["context_sweep"])
    return 0


def print_table(results: dict) -> None:
    env, settings = results["environment"], results["settings"]
    print(f"reinforge bench  {env['date']}  {env.get('gpu', env['device'])}  torch {env['torch']}  "
          f"transformers {env['transformers']}" + (f"  triton {env['triton']}" if env.get("triton") else ""))
    print(f"workload: {settings['num_prompts']} prompts x n={settings['n']}, prompt {settings['prompt_len']} tokens, "
          f"{settings['gen_len']} generated tokens each")
    rows = [("native tokens/s", f"{results['native']['tokens_per_s']:,.0f}"),
            ("native time (s)", f"{results['native']['time_s']:.2f}")]
    if "peak_memory_gb" in results["native"]:
        rows.append(("native peak memory (GiB)", f"{results['native']['peak_memory_gb']:.2f}"))
        rows.append(("memory awake / asleep (GiB)", f"{results['native']['memory_awake_gb']:.2f} / "
                                                    f"{results['native']['memory_after_sleep_gb']:.2f}"))
    if "hf_generate" in results:
        rows.append(("generate tokens/s (extrapolated)", f"{results['hf_generate']['tokens_per_s']:,.0f}"))
        rows.append(("speedup vs generate", f"{results['speedup_vs_generate']:.1f}x"))
    for dtype, check in results.get("greedy_check", {}).items():
        rows.append((f"greedy identical to generate ({dtype})", f"{check['fraction_identical']:.0%} of "
                                                                 f"{check['num_prompts']}"))
        rows.append((f"|log-prob error| max / mean ({dtype})", f"{check['max_abs_log_prob_error']:.2e} / "
                                                               f"{check['mean_abs_log_prob_error']:.2e}"))
        rows.append((f"  same for generate vs forward ({dtype})",
                     f"{check['hf_generate_vs_forward_max_abs_log_prob_error']:.2e} / "
                     f"{check['hf_generate_vs_forward_mean_abs_log_prob_error']:.2e}"))
    print_rows(rows)


def print_rows(rows: list[tuple[str, str]]) -> None:
    """``name  value`` lines, the names padded to one column."""
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    raise SystemExit(bench_main(sys.argv[1:]))
