"""The native engine on every dense family of the architecture table equals transformers.

Tiny float32 models of each family, windows smaller than the sequences (every family that has them) and
Gemma's soft-caps on: greedy tokens equal ``generate``'s, sampled tokens' log-probs are those of a plain
transformers forward within 1e-5, on the PyTorch path and on the Triton path (compiled on a GPU, else in
Triton's interpreter, which takes long enough to mark it slow). Windows that slide on every layer also give their blocks back to the pool as
sequences grow, and a prefix-cache hit over such a sequence samples what a full prefill does.
"""

from __future__ import annotations

import pytest
import torch

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.hf import CACHE_KWARG
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.block_manager import RELEASED
from tests.released_configs import RELEASED_CONFIGS, released_model

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3")
UNWINDOWED = ("llama", "olmo2")
"""Families whose layers never slide (the others get a window of WINDOW keys)."""
WINDOW = 6
PROMPT_LENGTHS = [13, 5, 21]
NUM_NEW_TOKENS = 10
INTERPRETED_NEW_TOKENS = 4
"""On the Triton path in the interpreter: still decodes the 5-token prompt past the window and the 13-token one across
a block, in a third of the interpreter's time."""
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def family_model(family: str, dtype: torch.dtype = torch.float32, num_layers: int = 4) -> torch.nn.Module:
    window = None if family in UNWINDOWED else WINDOW
    model = build_tiny_causal_lm(family, vocab_size=128, num_layers=num_layers, sliding_window=window, seed=3)
    return model.to(DEVICE, dtype).eval()


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length,), generator=generator).tolist() for length in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt], device=DEVICE)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt):].tolist()


def hf_log_probs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=DEVICE)).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0].cpu()


def make_engine(model: torch.nn.Module, use_triton: bool, **options) -> NativeEngine:
    options = {"block_size": 4, "max_num_seqs": 8, "num_kv_blocks": 64, **options}
    return NativeEngine(model, eos_token_ids=[], max_model_len=64, use_triton=use_triton, **options)


def triton_path(use_triton: bool) -> None:
    if use_triton:
        pytest.importorskip("triton")


TRITON_FAMILIES = ("gemma2",)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_greedy_tokens_are_generates(family):
    model = family_model(family)
    engine = make_engine(model, False)
    greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0)
    batch = prompts(PROMPT_LENGTHS)
    completions = engine.generate([GenerationRequest(prompt, greedy) for prompt in batch])
    for prompt, (completion,) in zip(batch, completions, strict=True):
        assert completion.token_ids == hf_greedy(model, prompt, NUM_NEW_TOKENS), family


@pytest.mark.parametrize("family, use_triton", [
    *((family, False) for family in DENSE_FAMILIES),
    # the interpreter takes 20 s a family; gemma2 runs the kernels the others add (window, soft-cap, gemma norms,
    # gelu), which tests/rollout/native/test_triton_kernels.py also checks one by one with partial rotary and
    # padded head dims; every family runs the Triton path on the GPU (the gpu-marked test below)
    *(pytest.param(family, True, marks=pytest.mark.slow) for family in TRITON_FAMILIES),
])
def test_sampled_log_probs_are_a_transformers_forwards(family, use_triton):
    triton_path(use_triton)
    interpreted = use_triton and DEVICE == "cpu"
    # in the interpreter, two layers: Gemma 2's sliding one and its full one (each kernel runs once a layer)
    model = family_model(family, num_layers=2 if interpreted else 4)
    engine = make_engine(model, use_triton)
    sampling = SamplingParams(n=2, max_tokens=INTERPRETED_NEW_TOKENS if interpreted else NUM_NEW_TOKENS,
                              temperature=1.0, seed=7)
    batch = prompts(PROMPT_LENGTHS, seed=2)
    completions = engine.generate([GenerationRequest(prompt, sampling) for prompt in batch])
    for prompt, samples in zip(batch, completions, strict=True):
        for sample in samples:
            expected = hf_log_probs(model, prompt, sample.token_ids)
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)


def test_bfloat16_on_the_pytorch_path_samples_generates_tokens():
    """OLMo 2's rotary module keeps its cos/sin tables in float32 under a bf16 model: q and k rotate in float32 and
    are rounded back before the cache (a float32 key into the bf16 cache failed)."""
    model = family_model("olmo2", torch.bfloat16)
    engine = make_engine(model, False)
    for prompt, completion in greedy_matches_generate(model, engine, prompts(PROMPT_LENGTHS)):
        assert (torch.tensor(completion.log_probs) - hf_log_probs(model, prompt, completion.token_ids)).abs().max() < 2e-2


def greedy_matches_generate(model, engine, batch):
    """The engine's greedy completions of ``batch``, each checked against transformers' greedy tokens: (prompt,
    completion) pairs."""
    greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0)
    pairs = list(zip(batch, [completion for (completion,) in engine.generate([GenerationRequest(p, greedy)
                                                                            for p in batch])], strict=True))
    for prompt, completion in pairs:
        assert completion.token_ids == hf_greedy(model, prompt, NUM_NEW_TOKENS)
    return pairs


@pytest.mark.parametrize("family", UNWINDOWED)
def test_a_window_the_models_masks_never_apply_is_not_applied(family):
    """A ``sliding_window`` left in the config of a family whose masks never slide: sampled log-probs are still those
    of transformers' forward, which attends to every earlier token."""
    model = family_model(family)
    model.config.sliding_window = WINDOW
    engine = make_engine(model, False)
    sampling = SamplingParams(n=2, max_tokens=NUM_NEW_TOKENS, temperature=1.0, seed=7)
    batch = prompts(PROMPT_LENGTHS, seed=2)
    for prompt, samples in zip(batch, engine.generate([GenerationRequest(p, sampling) for p in batch]), strict=True):
        for sample in samples:
            torch.testing.assert_close(torch.tensor(sample.log_probs), hf_log_probs(model, prompt, sample.token_ids),
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(RELEASED_CONFIGS))
def test_released_configs_sample_generates_tokens_and_a_forwards_log_probs(name):
    """The config structure of released checkpoints (tests/released_configs.py): greedy tokens are generate's and
    sampled tokens' log-probs those of a plain forward, past every window."""
    model = released_model(name, vocab_size=128, seed=3).to(DEVICE).eval()
    engine = make_engine(model, False)
    batch = prompts(PROMPT_LENGTHS)
    greedy_matches_generate(model, engine, batch)
    sampling = SamplingParams(n=2, max_tokens=NUM_NEW_TOKENS, temperature=1.0, seed=7)
    for prompt, samples in zip(batch, engine.generate([GenerationRequest(p, sampling) for p in batch]), strict=True):
        for sample in samples:
            torch.testing.assert_close(torch.tensor(sample.log_probs), hf_log_probs(model, prompt, sample.token_ids),
                                       atol=1e-5, rtol=0)


def test_windows_on_every_layer_give_blocks_back_as_sequences_grow():
    model = family_model("mistral")
    engine = make_engine(model, False, block_size=2)
    length = 40
    engine.wake_up()
    scheduler = engine.scheduler
    greedy = SamplingParams(max_tokens=length - 4, temperature=0.0)
    prompt = prompts([4])[0]
    peak = 0
    completion = None
    original_finish = scheduler.finish

    def finish(finished):  # before finished sequences hand everything back: what each still holds
        nonlocal peak
        for seq in scheduler.running:
            held = [block for block in seq.block_table if block != RELEASED]
            peak = max(peak, len(held))
        original_finish(finished)

    scheduler.finish = finish
    (completion,), = engine.generate([GenerationRequest(prompt, greedy)])
    assert completion.token_ids == hf_greedy(model, prompt, length - 4)
    # the window's WINDOW keys span at most 4 blocks of 2, plus the block being filled ahead
    assert 0 < peak <= WINDOW // 2 + 2 < length // 2


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_prefix_cache_hit_under_windows_samples_what_a_full_prefill_does(family):
    model = family_model(family)
    engine = make_engine(model, False, enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0)
    first_prompt = prompts([23], seed=4)[0]
    (first,), = engine.generate([GenerationRequest(first_prompt, greedy)])
    second_prompt = first_prompt + first.token_ids + prompts([5], seed=5)[0]
    hits_before = engine.counters.prefix_hit_tokens
    (second,), = engine.generate([GenerationRequest(second_prompt, greedy)])
    assert engine.counters.prefix_hit_tokens > hits_before
    assert second.token_ids == hf_greedy(model, second_prompt, NUM_NEW_TOKENS)
    torch.testing.assert_close(torch.tensor(second.log_probs),
                               hf_log_probs(model, second_prompt, second.token_ids), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_on_the_gpu_kernels_and_graphs_equal_transformers(family):
    """float32 through the compiled kernels and CUDA graphs: generate's greedy tokens and log-probs; bf16: close."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = family_model(family)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=16, max_num_seqs=8)
    assert engine.runner.decoder.use_triton and engine.runner.cuda_graph_batch_sizes
    greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0)
    batch = prompts(PROMPT_LENGTHS)
    for prompt, (completion,) in zip(batch, engine.generate([GenerationRequest(p, greedy) for p in batch]),
                                     strict=True):
        assert completion.token_ids == hf_greedy(model, prompt, NUM_NEW_TOKENS), family
        torch.testing.assert_close(torch.tensor(completion.log_probs), hf_log_probs(model, prompt,
                                                                                   completion.token_ids),
                                   atol=1e-4, rtol=0)
    model = family_model(family, torch.bfloat16)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=16, max_num_seqs=8)
    sampling = SamplingParams(n=2, max_tokens=NUM_NEW_TOKENS, temperature=1.0, seed=7)
    completions = engine.generate([GenerationRequest(prompt, sampling) for prompt in batch])
    for prompt, samples in zip(batch, completions, strict=True):
        for sample in samples:
            expected = hf_log_probs(model, prompt, sample.token_ids)
            assert (torch.tensor(sample.log_probs) - expected).abs().max() < 0.1, family


@pytest.mark.gpu
def test_on_the_gpu_a_windowed_prefix_hit_runs_flash_with_the_window():
    """bf16 Mistral, window 6: a second turn over cached blocks through the flash varlen kernel's left window
    samples what the padded reference does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = family_model("mistral", torch.bfloat16)
    first_prompt = prompts([30], seed=4)[0]
    greedy = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0)
    results = []
    for flash in (True, False):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=16, max_num_seqs=8)
        engine.runner.decoder.flash_prefix = engine.runner.decoder.context.flash_prefix = flash
        (first,), = engine.generate([GenerationRequest(first_prompt, greedy)])
        second_prompt = first_prompt + first.token_ids + prompts([5], seed=5)[0]
        (second,), = engine.generate([GenerationRequest(second_prompt, greedy)])
        assert engine.counters.prefix_hit_tokens > 0
        results.append(second)
    assert results[0].token_ids == results[1].token_ids
    torch.testing.assert_close(torch.tensor(results[0].log_probs), torch.tensor(results[1].log_probs),
                               atol=2e-2, rtol=0)


def test_a_model_outside_the_table_rolls_out_with_generate_after_one_line_saying_why(caplog):
    from reinforge.config.schema import Config
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.rollout.hf import HFEngine
    from reinforge.workers.rollout_side import build_rollout_engine

    config = Config()
    config.rollout.name = "native"
    model = build_tiny_causal_lm("gpt_neox", vocab_size=300).eval()
    with caplog.at_level("WARNING"):
        engine = build_rollout_engine(config, torch.device("cpu"), build_char_tokenizer(), model)
    assert isinstance(engine, HFEngine)
    [[sample]] = engine.generate([GenerationRequest([5, 6], SamplingParams(max_tokens=2, stop=("an agent's stop",)))])
    assert len(sample.token_ids) <= 2  # the engine reads stop strings: an OpenAI agent's calls may send them
    lines = [record.getMessage() for record in caplog.records if "rollout.name=native" in record.getMessage()]
    assert lines == ["rollout.name=native cannot run this model: GPTNeoXForCausalLM (model_type 'gpt_neox') has no "
                     "entry in the architecture table (reinforge/models/architectures.py); rolling out with the hf "
                     "backend (transformers' generate) instead, roughly 20x slower"]


def model_running_code_it_ships() -> torch.nn.Module:
    """A tiny Llama whose class comes from a model folder's own code (as ``trust_remote_code`` loads it, into
    transformers' dynamic ``transformers_modules``) and whose MLPs triple their output: config.json still says
    llama, but the table's Llama is not what it computes."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaMLP

    class TripledMLP(LlamaMLP):
        def forward(self, x):
            return 3.0 * super().forward(x)

    class OwnForCausalLM(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.mlp = TripledMLP(config)

    for cls in (TripledMLP, OwnForCausalLM):
        cls.__module__ = "transformers_modules.own_llama.modeling_own"
    config = build_tiny_causal_lm("llama", vocab_size=300).config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return OwnForCausalLM(config).eval()


def test_a_family_of_the_table_running_the_code_its_folder_ships_rolls_out_with_generate(caplog):
    from reinforge.config.schema import Config
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.rollout.hf import HFEngine
    from reinforge.workers.rollout_side import build_rollout_engine

    config = Config()
    config.rollout.name = "native"
    with caplog.at_level("WARNING"):
        engine = build_rollout_engine(config, torch.device("cpu"), build_char_tokenizer(), model_running_code_it_ships())
    assert isinstance(engine, HFEngine)
    lines = [record.getMessage() for record in caplog.records if "rollout.name=native" in record.getMessage()]
    assert lines == ["rollout.name=native cannot run this model: OwnForCausalLM runs the code its model folder ships "
                     "(model.trust_remote_code), not transformers' 'llama' modules the architecture table "
                     "(reinforge/models/architectures.py) describes; rolling out with the hf backend (transformers' "
                     "generate) instead, roughly 20x slower"]


def hf_log_probs_step_by_step(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs of ``tokens`` after ``prompt`` from a forward over the prompt, then one forward per token over
    the cache (as ``generate`` computes them)."""
    with torch.no_grad():
        output = model(torch.tensor([prompt], device=DEVICE), use_cache=True)
        rows = [output.logits[0, -1]]
        for token in tokens[:-1]:
            cache = getattr(output, CACHE_KWARG)  # transformers 5.24 renamed past_key_values
            output = model(torch.tensor([[token]], device=DEVICE), use_cache=True, **{CACHE_KWARG: cache})
            rows.append(output.logits[0, -1])
    log_probs = torch.log_softmax(torch.stack(rows).float(), dim=-1)
    return log_probs.gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0].cpu()


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
            "original_max_position_embeddings": 16}


def longrope_model() -> torch.nn.Module:
    return build_tiny_causal_lm("phi3", vocab_size=128, num_layers=2, max_position_embeddings=64,
                                rope_parameters=LONGROPE, original_max_position_embeddings=16, seed=1).eval()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_longrope_log_probs_are_the_whole_sequence_forwards_once_a_sequence_crosses(prefix_caching):
    """Within the original 16 positions every forward uses the short factors and a prompt past them the long ones
    from its prefill on. A sequence crossing them is prefilled again in full when its 17th token arrives (as Phi-3's
    generate drops its cache there): each token sampled after that has the log-prob of a forward over the whole
    sequence (the trainer's), each one before it that of a forward over the sequence as it was then."""
    model = longrope_model()
    engine = make_engine(model, False, enable_prefix_caching=prefix_caching)
    sampling = SamplingParams(n=2, max_tokens=14, temperature=1.0, seed=3)
    short, crossing, exactly, long = prompts([2, 10, 16, 20], seed=6)
    completions = engine.generate([GenerationRequest(prompt, sampling) for prompt in (short, crossing, exactly, long)])
    for prompt, samples in zip((short, crossing, exactly, long), completions, strict=True):
        for sample in samples:
            whole = hf_log_probs(model, prompt, sample.token_ids)
            stepwise = hf_log_probs_step_by_step(model, prompt, sample.token_ids)
            # token i sits at position len(prompt) + i; its logits came from a forward over the positions before it
            before = torch.arange(len(sample.token_ids)) + len(prompt) <= 16
            expected = torch.where(before, stepwise, whole) if len(prompt) + len(sample.token_ids) > 16 else whole
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)
    assert engine.scheduler.num_recomputed == 4  # the samples of crossing and exactly


def test_longrope_greedy_tokens_are_generates_across_the_original_length():
    model = longrope_model()
    engine = make_engine(model, False)
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    batch = prompts([5, 12], seed=9)
    completions = engine.generate([GenerationRequest(prompt, greedy) for prompt in batch])
    for prompt, [completion] in zip(batch, completions, strict=True):
        assert completion.token_ids == hf_greedy(model, prompt, 20)


def test_sequences_preempted_under_windows_resume_as_generate_continues():
    """Blocks run short while every sequence holds only its window: preempted sequences give back what they hold,
    are prefilled again in full and continue with generate's tokens."""
    model = family_model("mistral")
    engine = make_engine(model, False, block_size=2, num_kv_blocks=12)
    greedy = SamplingParams(n=4, max_tokens=24, temperature=0.0)  # four samples grow apart from one prompt
    batch = prompts([8], seed=8)
    completions = engine.generate([GenerationRequest(prompt, greedy) for prompt in batch])
    assert engine.last_metrics["rollout/num_preempted"] > 0
    for prompt, samples in zip(batch, completions, strict=True):
        for completion in samples:
            assert completion.token_ids == hf_greedy(model, prompt, 24)
