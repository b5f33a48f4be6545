"""``reinforge serve MODEL_OR_CHECKPOINT``: the OpenAI-compatible endpoint on one model.

MODEL_OR_CHECKPOINT is an HF model folder (or hub id), a run folder (its newest valid checkpoint), a checkpoint folder
(``RUN/checkpoints/step_N``: its ``hf/`` folder, where a LoRA run keeps the merged model; one whose ``hf/`` weights
were removed is served after ``reinforge export``), or a peft adapter folder (merged into the base model its
``adapter_config.json`` names). The native engine generates where it supports the model; the hf backend otherwise,
said in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def resolve_model_folder(path: str) -> tuple[str, str | None]:
    """(the HF folder or hub id to load, the adapter folder to merge or None)."""
    from reinforge.models.loading import is_local_path

    folder = Path(path).expanduser()
    if not folder.exists() and is_local_path(path):  # /models/x or ./run: no hub id
        raise FileNotFoundError(f"{path} does not exist (looked for {folder.resolve()}); pass an HF model folder or hub "
                                "id, a run folder, a checkpoint folder or a LoRA adapter folder")
    if not folder.exists():
        return path, None  # a hub id; loading says so if it is not one
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is a file; pass an HF model folder, a run folder or a checkpoint folder")
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        import json

        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{folder}/adapter_config.json names no base_model_name_or_path, so there is no model to "
                             "merge the adapter into; set it to the base model's folder")
        return str(base), str(folder)
    if (folder / "config.json").is_file():
        return str(folder), None
    checkpoint = folder
    if (folder / "checkpoints").is_dir():  # a run folder: its newest sealed checkpoint whose hf/ model loads
        steps = sorted((step for step in (folder / "checkpoints").glob("step_*") if step.name[5:].isdigit()),
                       key=lambda step: int(step.name[5:]), reverse=True)
        skipped = []
        for step in steps:
            problem = _servable_problem(step)
            if problem is None:
                checkpoint = step
                break
            skipped.append(f"{step.name}: {problem}")
        else:
            listed = f" ({'; '.join(skipped)})" if skipped else ""
            raise FileNotFoundError(f"run folder {folder} has no sealed checkpoint with a whole hf/ model{listed}; "
                                    "give a checkpoint folder after `reinforge export`, or an HF folder")
        if skipped:
            logger.warning("reading %s, the newest complete checkpoint of %s; skipped %s", checkpoint.name, folder,
                           "; ".join(skipped))
        else:
            logger.info("reading %s, the newest checkpoint of %s", checkpoint.name, folder)
    if (checkpoint / "hf" / "config.json").is_file():
        if not _has_weights(checkpoint / "hf"):
            raise FileNotFoundError(f"{checkpoint / 'hf'} holds no weights; run `reinforge export {checkpoint} OUT` and "
                                    "give OUT")
        return str(checkpoint / "hf"), None
    raise FileNotFoundError(f"{folder} is neither an HF model folder (config.json), a checkpoint (hf/), a run folder "
                            "(checkpoints/) nor a LoRA adapter (adapter_config.json); pass one of those")


def _servable_problem(checkpoint: Path) -> str | None:
    """Why a run's checkpoint folder cannot be served as it is (None where it can): not sealed (written whole, its
    manifest last), or an ``hf/`` model without weights or cut off."""
    from reinforge.models.loading import check_model_folder

    if not (checkpoint / "manifest.json").is_file():
        return "not sealed (its writing was interrupted)"
    try:
        check_model_folder(checkpoint / "hf", "the model")
    except FileNotFoundError as error:
        return str(error)
    return None


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def load_model(path: str, adapter: str | None, dtype_name: str, device: Any) -> tuple[Any, Any]:
    from reinforge.models.loading import load_causal_lm, load_tokenizer, resolve_dtype

    model = load_causal_lm(path, dtype=resolve_dtype(dtype_name, device), device=device)
    tokenizer = load_tokenizer(adapter if adapter and (Path(adapter) / "tokenizer_config.json").is_file() else path)
    if adapter is not None:
        try:
            from peft import PeftModel
        except ImportError:
            raise ValueError(f"{adapter} is a LoRA adapter and merging it needs peft; pip install 'reinforge[lora]' "
                             "or serve the merged model (RUN/checkpoints/step_N/hf)") from None
        if not merge_adapter_folder(model, Path(adapter)):
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    return model, tokenizer


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens generation ends at: the tokenizer's EOS and the generation config's (Gemma's <end_of_turn>,
    Llama 3's <|eot_id|>)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos] if eos is not None else [])}
                  - {None})


def build_client(model: Any, tokenizer: Any, rollout: str, max_model_len: int, gpu_memory_utilization: float,
                 max_num_seqs: int) -> tuple[Any, str]:
    """The token client over the chosen engine, and the engine's name."""
    from reinforge.agent.runner import AsyncEngineClient, BatchingClient

    eos_ids = eos_token_ids(model, tokenizer)
    if rollout == "native":
        from reinforge.rollout.native import NativeEngine, hf_fallback_notice, unsupported_reason

        reason = unsupported_reason(model)
        if reason is None:
            # nothing trains the served model: the engine reads its weights in place rather than copying them
            engine = NativeEngine(model, eos_token_ids=eos_ids, max_model_len=max_model_len,
                                  gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                                  weights_fixed=True, tokenizer=tokenizer)
            return AsyncEngineClient(engine), "native"
        logger.warning(hf_fallback_notice(reason, "--rollout native"))
    from reinforge.rollout.hf import HFEngine

    return BatchingClient(HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos_ids,
                                   tokenizer=tokenizer)), "hf"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="reinforge serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="HF model folder or hub id, run folder, checkpoint folder or LoRA adapter folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="generation requests at once; one more is answered 429 with Retry-After")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + reply tokens (default: the model's context, at most 8192)")
    parser.add_argument("--max-n", type=int, default=128,
                        help="choices one request may ask for (n); a request over it is answered 400")
    parser.add_argument("--max-logprob-entries", type=int, default=1_000_000,
                        help="logprob entries one response may hold, n * max_tokens * (top_logprobs + 1); a request "
                             "that could hold more is answered 400")
    parser.add_argument("--max-tokens", type=int, default=1024, help="reply tokens when a request sets no max_tokens")
    parser.add_argument("--rollout", choices=("native", "hf"), default="native")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on an accelerator), bfloat16, float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--served-model-name", default=None, help="the model id /v1/models lists (default: MODEL)")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template file to use instead of the model's")
    parser.add_argument("--tool-format", default="hermes", help="tool-call format of the replies (reinforge.agent)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """One ValueError for a setting no request could be answered with, before the model loads."""
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: allow at least 1 request at a time")
    if args.max_n < 1:
        raise ValueError(f"--max-n {args.max_n}: every request asks for at least 1 choice; give at least 1")
    if args.max_logprob_entries < 1:
        raise ValueError(f"--max-logprob-entries {args.max_logprob_entries}: a request with logprobs holds at least 1 "
                         "entry; give at least 1")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: a request without max_tokens could sample nothing; give "
                         "at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len {args.max_model_len}: a prompt and its reply need at least 2 tokens; give "
                         "the tokens a request may hold, or leave it out for the model's context")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: give a fraction of the "
                         "accelerator's memory above 0 and at most 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: give a TCP port from 0 (any free one) to 65535")
    check_port_free(args.host, args.port)


def check_port_free(host: str, port: int) -> None:
    """One ValueError when ``host:port`` cannot be listened on (another server holds it, or the host is not this
    machine's), before the model loads: aiohttp would say so only once the weights were in memory."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: not an address this machine can listen on ({error.strerror}); give an "
                         "address such as 127.0.0.1 or 0.0.0.0") from None
    family, kind, protocol, _, address = infos[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: a closing socket is no owner
        try:
            probe.bind(address)
        except OSError as error:
            raise ValueError(f"--port {port}: {host}:{port} cannot be listened on ({error.strerror}); stop the "
                             "server that holds it, or give another --port (0 takes any free one)") from None


def serve_main(argv: list[str]) -> int:
    args = parse_args(argv)
    check_args(args)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ValueError("reinforge serve needs aiohttp; pip install 'reinforge[serve]'") from None
    import torch

    from reinforge.serve.app import OpenAIEndpoint
    from reinforge.serve.chat import ChatCodec
    from reinforge.serve.service import GenerationService

    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path, adapter = resolve_model_folder(args.model)
    model, tokenizer = load_model(path, adapter, args.dtype, device)
    context = int(getattr(model.config, "max_position_embeddings", 8192) or 8192)
    max_model_len = args.max_model_len or min(context, 8192)
    client, engine_name = build_client(model, tokenizer, args.rollout, max_model_len, args.gpu_memory_utilization,
                                       max_num_seqs=min(args.max_concurrency, 512))
    codec = None
    if chat_template or getattr(tokenizer, "chat_template", None):
        codec = ChatCodec(tokenizer, chat_template, args.tool_format)
    else:
        logger.warning("the tokenizer has no chat template: /v1/chat/completions answers 400; pass --chat-template")
    service = GenerationService(client, tokenizer, args.served_model_name or args.model, codec=codec,
                                max_model_len=max_model_len, default_max_tokens=args.max_tokens,
                                eos_token_ids=tuple(eos_token_ids(model, tokenizer)),
                                vocab_size=model.get_input_embeddings().weight.shape[0], max_n=args.max_n,
                                max_logprob_entries=args.max_logprob_entries)
    endpoint = OpenAIEndpoint(service, max_concurrency=args.max_concurrency)

    async def run() -> None:
        url = await endpoint.start(args.host, args.port)
        print(f"serving {args.model} at {url}/v1 ({engine_name} engine on {device}, at most {args.max_concurrency} "
              "requests at once); Ctrl-C stops", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await endpoint.close()

    asyncio.run(run())
    return 0


def merge_adapter_folder(model: Any, adapter: Path) -> bool:
    """Merge a plain LoRA adapter folder (reinforge's ``adapter/``) into ``model`` by name, W + (alpha / r) B A, as
    ``reinforge export`` does; False (nothing changed) for a folder this cannot read exactly (rank or alpha patterns,
    DoRA, another PEFT method, names the model lacks): peft merges those.

    Not peft's loader: on transformers 5 it maps every target named gate_proj/up_proj/down_proj of a DeepSeek, Qwen-MoE
    or OLMoE model onto the fused experts, dropping the trained adapters of the dense and shared-expert MLPs."""
    import json

    from reinforge.engine.lora import merge_lora_weights, read_adapter_config, read_adapter_weights, transposed_layers

    config_file, weights_file = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if not (config_file.is_file() and weights_file.is_file()):
        return False
    saved = json.loads(config_file.read_text())
    if (saved.get("peft_type", "LORA") != "LORA" or saved.get("use_dora") or saved.get("rank_pattern")
            or saved.get("alpha_pattern") or saved.get("use_rslora") or saved.get("target_parameters")):
        return False
    state = model.state_dict()
    adapters = read_adapter_weights(adapter)
    if any(f"{name.split('.lora_')[0]}.weight" not in state for name in adapters):
        return False
    scaling, _ = read_adapter_config(adapter)
    merged = merge_lora_weights(dict(state) | adapters, scaling, transposed_layers(model))
    model.load_state_dict({name: tensor.to(state[name].device) for name, tensor in merged.items()})
    return True
