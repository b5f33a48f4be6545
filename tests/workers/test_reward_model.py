"""The reward-model worker: its scores are transformers' own, its inputs re-rendered by hand's rules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

from reinforge.config import Config
from reinforge.engine.packing import plan_packing
from reinforge.models import build_char_tokenizer, save_hf_folder
from reinforge.models.reward_model import check_reward_model
from reinforge.protocol import Batch
from reinforge.workers.reward_model import RewardInputs, RewardModelWorker, layout

PLAIN_TEMPLATE = ("{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")
"""A chat template unlike the policy's ChatML: ``[role] content`` lines, no special tokens."""


def save_tiny_reward_model(folder: Path, head: type = Qwen2ForSequenceClassification, chat_template: str | None = None,
                           num_labels: int = 1, seed: int = 0, extra_tokens: tuple[str, ...] = ()) -> Path:
    """A tiny Qwen2 classification model (num_labels=1, pad_token_id set) with the char tokenizer, saved."""
    tokenizer = build_char_tokenizer(extra_tokens) if chat_template is None else build_char_tokenizer(
        extra_tokens, chat_template=chat_template)
    if chat_template == "":
        tokenizer.chat_template = None
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, num_labels=num_labels, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = head(config).float()
        with torch.no_grad():  # a zero-initialised token head's bias would hide an off-by-one position
            model.score.weight.normal_(0, 1.0)
            if model.score.bias is not None:
                model.score.bias.fill_(0.25)
    return save_hf_folder(model, tokenizer, folder)


def rm_config(policy_dir: Path, rm_dir: Path, **reward_model: object) -> Config:
    config = Config()
    config.model.path = str(policy_dir)
    config.trainer.device = "cpu"
    config.actor.max_tokens_per_micro_batch = 24
    config.reward.reward_model.enable = True
    config.reward.reward_model.model_path = str(rm_dir)
    for key, value in reward_model.items():
        setattr(config.reward.reward_model, key, value)
    return config


def policy_batch(sequences: list[tuple[list[int], list[int]]], uids: list[str]) -> Batch:
    """Rows in the rollout layout from (prompt ids, response ids), with uids and a raw prompt each."""
    prompt_width = max(len(prompt) for prompt, _ in sequences)
    response_width = max(len(response) for _, response in sequences)
    rows = len(sequences)
    prompts = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.zeros(rows, response_width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    response_mask = torch.zeros(rows, response_width)
    for row, (prompt, response) in enumerate(sequences):
        prompts[row, prompt_width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[row, prompt_width - len(prompt):] = 1
        responses[row, :len(response)] = torch.tensor(response)
        response_mask[row, :len(response)] = 1
    return Batch.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": response_mask,
                 "input_ids": torch.cat([prompts, responses], 1),
                 "attention_mask": torch.cat([prompt_mask, response_mask.long()], 1)},
        non_tensors={"uid": np.array(uids, dtype=object),
                     "raw_prompt": np.array([[{"role": "user", "content": "hi"}]] * rows + [None], dtype=object)[:-1]})


def random_batch(ending_in_pad: bool = False) -> Batch:
    """Two prompts of four samples each, of mixed lengths; no pad token (id 0) inside a sequence, and with
    ``ending_in_pad`` two samples of each prompt ending in one or two of it (an EOS that is also the pad token)."""
    generator = torch.Generator().manual_seed(3)
    sequences, uids = [], []
    for uid, prompt_length in (("a", 5), ("b", 3)):
        prompt = torch.randint(3, 60, (prompt_length,), generator=generator).tolist()
        for length, num_pads in ((1, 1), (4, 0), (7, 2), (2, 0)):
            response = torch.randint(3, 60, (length,), generator=generator).tolist()
            sequences.append((prompt, response + [0] * num_pads * ending_in_pad))
            uids.append(uid)
    return policy_batch(sequences, uids)


def transformers_scores(rm_dir: Path, batch: Batch, head: type) -> torch.Tensor:
    """Each row's score by transformers' own forward over its tokens alone."""
    model = head.from_pretrained(rm_dir).eval()
    scores = []
    with torch.no_grad():
        for row in range(len(batch)):
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()][None]
            logits = model(input_ids=ids).logits
            scores.append(logits[0, -1, 0] if head is Qwen2ForTokenClassification else logits[0, 0])
    return torch.stack(scores)


@pytest.mark.parametrize("ending_in_pad", [False, True])
@pytest.mark.parametrize("head", [Qwen2ForSequenceClassification, Qwen2ForTokenClassification])
def test_scores_equal_transformers_forward_at_the_last_token(tiny_model_dir, tmp_path, head, ending_in_pad):
    """transformers' sequence classifier reads its score at the last token that is not its pad token, its token
    classifier at the last token: the worker reads each where transformers does."""
    rm_dir = save_tiny_reward_model(tmp_path / "rm", head)
    worker = RewardModelWorker(rm_config(tiny_model_dir, rm_dir))
    assert worker.inputs.policy_tokenizer is None  # same vocabulary and template: the policy's ids as they are
    assert worker.model.use_kernels is False  # transformers' own modules, no kernels from the Hub
    batch = random_batch(ending_in_pad)
    scored = worker.compute_rm_score(batch)
    expected = transformers_scores(rm_dir, batch, head)
    last = (batch["response_mask"].sum(-1) - 1).long()
    rows = torch.arange(len(batch))
    torch.testing.assert_close(scored["rm_scores"][rows, last], expected, atol=1e-5, rtol=0)
    assert float(scored["rm_scores"].abs().sum()) == pytest.approx(float(expected.abs().sum()), abs=1e-4)
    assert not scored["rm_truncated"].any()
    # the split into micro-batches changes nothing
    worker.max_tokens = 4096
    torch.testing.assert_close(worker.compute_rm_score(batch)["rm_scores"], scored["rm_scores"], atol=1e-5, rtol=0)


CLASSIFIER_HEADED = {  # decoder families whose token classifier names its head ``classifier``
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),  # packs rows
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),  # its attention calls no function of the table: padded rows
}


@pytest.mark.parametrize("model_type", sorted(CLASSIFIER_HEADED))
def test_a_decoder_token_classifier_whose_head_is_named_classifier_scores_as_transformers_does(
        tiny_model_dir, tmp_path, model_type):
    from transformers import AutoConfig, AutoModelForTokenClassification

    tokenizer = build_char_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  num_labels=1, **CLASSIFIER_HEADED[model_type])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForTokenClassification.from_config(config).float()
        with torch.no_grad():
            model.classifier.weight.normal_(0, 1.0)
            model.classifier.bias.fill_(0.25)
    rm_dir = save_hf_folder(model, tokenizer, tmp_path / "rm")
    check_reward_model(str(rm_dir))
    worker = RewardModelWorker(rm_config(tiny_model_dir, rm_dir))
    batch = random_batch()
    scored = worker.compute_rm_score(batch)
    reference = AutoModelForTokenClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        expected = torch.stack([reference(input_ids=batch["input_ids"][row][batch["attention_mask"][row].bool()][None])
                                .logits[0, -1, 0] for row in range(len(batch))])
    last = (batch["response_mask"].sum(-1) - 1).long()
    torch.testing.assert_close(scored["rm_scores"][torch.arange(len(batch)), last], expected, atol=1e-5, rtol=0)


def test_an_encoders_token_classifier_is_still_refused(tmp_path):
    from transformers import AutoConfig, AutoModelForTokenClassification

    tokenizer = build_char_tokenizer()
    config = AutoConfig.for_model("bert", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64, pad_token_id=tokenizer.pad_token_id,
                                  num_labels=1)
    folder = save_hf_folder(AutoModelForTokenClassification.from_config(config), tokenizer, tmp_path / "rm")
    with pytest.raises(ValueError, match=r"is a BertForTokenClassification \(model_type='bert'\) whose head "
                                         r"\(classifier: Linear\) is not a linear layer named 'score'"):
        check_reward_model(str(folder))


HYBRID_FAMILIES = {
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, head_dim=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
}
"""Families whose decoder has layers beside its attention that carry a state along the row: Gated DeltaNet
(Qwen3.5, Qwen3-Next) and Mamba (Jamba, Zamba)."""


@pytest.mark.parametrize("model_type", sorted(HYBRID_FAMILIES))
def test_a_backbone_whose_recurrent_layers_would_carry_one_sequence_into_the_next_scores_padded_rows(
        tiny_model_dir, tmp_path, model_type):
    """Their attention takes packed rows, but their linear-attention or Mamba layers would carry the state of one
    packed sequence into the next (scores up to 1.8 from transformers' own): the reward model runs padded rows and
    scores each sequence as transformers does alone."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from reinforge.engine.forward import runs_padded

    tokenizer = build_char_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id, num_labels=1,
                                  **HYBRID_FAMILIES[model_type])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config).float()
        with torch.no_grad():
            model.score.weight.normal_(0, 1.0)
    rm_dir = save_hf_folder(model, tokenizer, tmp_path / "rm")
    worker = RewardModelWorker(rm_config(tiny_model_dir, rm_dir))
    batch = random_batch()
    scored = worker.compute_rm_score(batch)
    last = (batch["response_mask"].sum(-1) - 1).long()
    torch.testing.assert_close(scored["rm_scores"][torch.arange(len(batch)), last],
                               transformers_scores(rm_dir, batch, AutoModelForSequenceClassification), atol=1e-5, rtol=0)
    assert runs_padded(worker.model)


def save_tiny_vision_language_classifier(folder: Path, text_pad_token_id: int | None) -> Path:
    """A tiny Gemma 3 sequence classifier (num_labels=1) with the char tokenizer, saved: its config keeps
    ``pad_token_id`` in its text config only, as a vision-language checkpoint's does."""
    from transformers import Gemma3Config, Gemma3ForSequenceClassification

    tokenizer = build_char_tokenizer()
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=256,
                         pad_token_id=text_pad_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8), mm_tokens_per_image=4, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForSequenceClassification(config).float()
        with torch.no_grad():
            model.score.weight.normal_(0, 1.0)
    return save_hf_folder(model, tokenizer, folder)


@pytest.mark.parametrize("ending_in_pad", [False, True])
def test_a_vision_language_classifier_is_read_before_its_text_configs_pad_token(tiny_model_dir, tmp_path,
                                                                                 ending_in_pad):
    """Gemma 3's and Qwen3.5's classifiers keep pad_token_id in their text config, where transformers' pooling reads
    it; their top-level config has none (the worker failed with an AttributeError at start-up)."""
    from transformers import AutoModelForSequenceClassification

    rm_dir = save_tiny_vision_language_classifier(tmp_path / "rm", text_pad_token_id=0)
    worker = RewardModelWorker(rm_config(tiny_model_dir, rm_dir))
    assert worker.inputs.classifier_pad_token_id == 0
    batch = random_batch(ending_in_pad)
    scored = worker.compute_rm_score(batch)
    last = (batch["response_mask"].sum(-1) - 1).long()
    torch.testing.assert_close(scored["rm_scores"][torch.arange(len(batch)), last],
                               transformers_scores(rm_dir, batch, AutoModelForSequenceClassification), atol=1e-5, rtol=0)


def test_inputs_longer_than_max_length_are_cut_on_the_right_and_counted(tiny_model_dir, tmp_path):
    rm_dir = save_tiny_reward_model(tmp_path / "rm")
    worker = RewardModelWorker(rm_config(tiny_model_dir, rm_dir, max_length=8))
    batch = random_batch()
    scored = worker.compute_rm_score(batch)
    lengths = batch["attention_mask"].sum(-1)
    assert scored["rm_truncated"].tolist() == (lengths > 8).tolist()
    model = Qwen2ForSequenceClassification.from_pretrained(rm_dir).eval()
    row = int(torch.nonzero(lengths > 8)[0])
    ids = batch["input_ids"][row][batch["attention_mask"][row].bool()][:8][None]
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0, 0]
    last = int(batch["response_mask"][row].sum()) - 1
    assert float(scored["rm_scores"][row, last]) == pytest.approx(float(expected), abs=1e-5)


def test_a_response_is_re_rendered_in_the_reward_models_template(tiny_model_dir, tmp_path):
    policy_tokenizer = build_char_tokenizer()
    rm_tokenizer = build_char_tokenizer(chat_template=PLAIN_TEMPLATE)
    prompt = policy_tokenizer.apply_chat_template([{"role": "user", "content": "1+2?"}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    response = policy_tokenizer.encode("3<|im_end|>", add_special_tokens=False)
    batch = policy_batch([(list(prompt), response)], ["a"])
    batch.non_tensors["raw_prompt"][0] = [{"role": "user", "content": "1+2?"}]
    inputs = RewardInputs(rm_tokenizer, policy_tokenizer, max_length=64)
    sequences, truncated = inputs.sequences(batch)
    # by hand: the char tokenizer gives byte b the id 3 + b; the EOS string is gone, no special token is added
    assert sequences == [[3 + byte for byte in b"[user] 1+2?\n[assistant] 3\n"]]
    assert truncated == [False]
    # the worker chooses re-rendering because the templates differ, and scores the re-rendered text
    rm_dir = save_tiny_reward_model(tmp_path / "rm", chat_template=PLAIN_TEMPLATE)
    worker = RewardModelWorker(rm_config(tiny_model_dir, rm_dir))
    assert worker.inputs.policy_tokenizer is not None
    scored = worker.compute_rm_score(batch)
    model = Qwen2ForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(sequences)).logits[0, 0]
    assert float(scored["rm_scores"][0, len(response) - 1]) == pytest.approx(float(expected), abs=1e-5)
    # a reward model with the policy's vocabulary but no chat template reads the policy's ids; one with another
    # vocabulary and no template cannot read the responses at all
    plain = save_tiny_reward_model(tmp_path / "plain", chat_template="")
    assert RewardModelWorker(rm_config(tiny_model_dir, plain)).inputs.policy_tokenizer is None
    other = save_tiny_reward_model(tmp_path / "other", chat_template="", extra_tokens=("<x>",))
    with pytest.raises(ValueError, match="has a tokenizer of its own but no chat template"):
        RewardModelWorker(rm_config(tiny_model_dir, other))
    # input_tokenizer=null never re-renders
    assert RewardModelWorker(rm_config(tiny_model_dir, rm_dir, input_tokenizer=None)).inputs.policy_tokenizer is None


def test_layout_shares_the_common_prefix_of_a_group_and_keeps_one_response_token():
    batch = layout([[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8], [4, 4]], ["a", "a", "b", "b"], pad_token_id=0)
    # group b has no common prefix: each keeps its first token as its prompt
    assert batch["prompts"].tolist() == [[5, 6], [5, 6], [0, 5], [0, 4]]
    assert batch["responses"].tolist() == [[7, 8, 0], [9, 0, 0], [6, 7, 8], [4, 0, 0]]
    # each row, prompt and response, is its sequence
    for row, sequence in enumerate([[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8], [4, 4]]):
        assert batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist() == sequence
    with pytest.raises(ValueError, match="sample 1 gives the reward model 1 token"):
        layout([[1, 2], [3]], None, pad_token_id=0)


def test_a_model_that_is_not_a_one_label_classifier_is_refused_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"is not a classification model \(Qwen2ForCausalLM in its config.json\)"):
        check_reward_model(str(tiny_model_dir))
    two = save_tiny_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="has num_labels=2"):
        check_reward_model(str(two))
    with pytest.raises(FileNotFoundError, match=r"does not exist; check reward.reward_model.model_path"):
        check_reward_model(str(tmp_path / "missing"))
    untokenized = save_tiny_reward_model(tmp_path / "untokenized")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (untokenized / name).unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer files \(expected one of tokenizer.json"):
        check_reward_model(str(untokenized))
    typed = save_tiny_reward_model(tmp_path / "typed")
    config = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps(config | {"hidden_size": "sixty"}))
    with pytest.raises(ValueError, match=r"^reward.reward_model.model_path=.*typed: transformers cannot read its "
                                         r"config.json \(.*hidden_size.*'sixty'.*\); fix that value in .*config.json"):
        check_reward_model(str(typed))


ENCODER_CLASSIFIERS = {
    "bert": ("BertForSequenceClassification", "classifier: Linear",
             dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)),
    "bart": ("BartForSequenceClassification", "classification_head: BartClassificationHead",
             dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64)),
}


@pytest.mark.parametrize("model_type", sorted(ENCODER_CLASSIFIERS))
def test_a_classifier_that_pools_elsewhere_than_a_score_at_the_last_token_is_refused_before_it_loads(
        tmp_path, monkeypatch, model_type):
    """BERT's classifier reads the first token, BART's head the last EOS: neither is a linear 'score' at the last
    token, which the worker and reinforge rm read; both refuse it in one line from its config alone."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from reinforge.trainer.preference.rm_trainer import load_reward_model_for_training

    class_name, head, sizes = ENCODER_CLASSIFIERS[model_type]
    tokenizer = build_char_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), num_labels=1,
                                  pad_token_id=tokenizer.pad_token_id, **sizes)
    folder = save_hf_folder(AutoModelForSequenceClassification.from_config(config), tokenizer, tmp_path / "rm")
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained",
                        lambda *args, **kwargs: pytest.fail("the weights loaded"))
    pooling = ("is not a linear layer named 'score'; reinforge reads a reward model's score with that layer at each "
               "sequence's last token, as transformers' decoder classifiers that have one do (Llama's, Qwen's, "
               "Gemma's, GPT-2's sequence classifier, ...), not where another classifier pools (BERT's first token, "
               "BART's last EOS); ")
    with pytest.raises(ValueError) as refusal:
        check_reward_model(str(folder))
    assert str(refusal.value) == (
        f"reward.reward_model.model_path={folder} is a {class_name} (model_type={model_type!r}) whose head ({head}) "
        f"{pooling}use a decoder reward model, such as one `reinforge rm` trains from a causal LM")
    with pytest.raises(ValueError) as refusal:
        load_reward_model_for_training(str(folder), pad_token_id=tokenizer.pad_token_id)
    assert str(refusal.value) == (
        f"model.path={folder} is a {class_name} (model_type={model_type!r}) whose head ({head}) {pooling}start from "
        "a decoder (a causal LM of Llama, Qwen, Mistral, Gemma, Phi-3, GPT-2, ...) or from its one-label classifier")


@pytest.mark.parametrize("share_prompts", [False, True])
def test_the_packing_plan_finds_each_rows_last_token(share_prompts):
    batch = random_batch()
    plan = plan_packing(batch, share_prompts)
    packed_ids = batch["input_ids"].reshape(-1)[plan.source_index]
    last_column = batch["attention_mask"].shape[1] - 1 - batch["attention_mask"].flip(-1).argmax(-1)
    expected = batch["input_ids"][torch.arange(len(batch)), last_column]
    assert packed_ids[plan.last_index].tolist() == expected.tolist()
    flat = torch.arange(len(batch)) * batch["input_ids"].shape[1] + last_column
    assert plan.source_index[plan.last_index].tolist() == flat.tolist()  # the row's own token, not an equal one


def test_the_worker_method_reaches_the_model_in_two_calls(tiny_model_dir, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_paths_to_the_model import path_to_the_model

    worker = RewardModelWorker(rm_config(tiny_model_dir, save_tiny_reward_model(tmp_path / "rm")))
    assert path_to_the_model(worker.model.base_model, worker.compute_rm_score, random_batch()) == [
        "compute_rm_score", "last_token_scores"]


@pytest.mark.gpu
def test_on_cuda_the_weights_wait_on_the_host_and_the_scores_match_transformers(tiny_model_dir, tmp_path):
    rm_dir = save_tiny_reward_model(tmp_path / "rm")
    config = rm_config(tiny_model_dir, rm_dir)
    config.trainer.device = "cuda"
    worker = RewardModelWorker(config)
    assert worker.host_weights is not None and worker.host_weights.pinned and not worker.host_weights.on_device
    before = torch.cuda.memory_allocated()
    batch = random_batch()
    scored = worker.compute_rm_score(batch)
    assert not worker.host_weights.on_device
    assert torch.cuda.memory_allocated() <= before + (1 << 20)  # the weights' memory is given back
    expected = transformers_scores(rm_dir, batch, Qwen2ForSequenceClassification)
    last = (batch["response_mask"].sum(-1) - 1).long()
    # bf16 compute against float32
    torch.testing.assert_close(scored["rm_scores"][torch.arange(len(batch)), last], expected, atol=0.1, rtol=0.05)
    again = worker.compute_rm_score(batch)  # a second call moves the weights back and forth again
    torch.testing.assert_close(again["rm_scores"], scored["rm_scores"])


def test_weights_released_and_restored_score_as_before(tiny_model_dir, tmp_path):
    """The host copy of HostWeights (run here on the CPU, where the worker itself never parks them): the sharded
    weights lose their memory and get it back, and the scores do not change."""
    from reinforge.engine.host_weights import HostWeights

    worker = RewardModelWorker(rm_config(tiny_model_dir, save_tiny_reward_model(tmp_path / "rm")))
    batch = random_batch()
    before = worker.compute_rm_score(batch)["rm_scores"]
    worker.host_weights = HostWeights(worker.model)
    assert worker.host_weights.nbytes == sum(p.numel() * p.element_size() for p in worker.model.parameters())
    worker.host_weights.release()
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in worker.model.parameters())
    scored = worker.compute_rm_score(batch)  # restored for the call, released after it
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in worker.model.parameters())
    torch.testing.assert_close(scored["rm_scores"], before, atol=0, rtol=0)
    # parked before its first forward, as the worker parks them on CUDA (FSDP's lazy setup then sees them restored)
    fresh = RewardModelWorker(rm_config(tiny_model_dir, tmp_path / "rm"))
    fresh.host_weights = HostWeights(fresh.model)
    fresh.host_weights.release()
    torch.testing.assert_close(fresh.compute_rm_score(batch)["rm_scores"], before, atol=0, rtol=0)


def test_input_tokenizer_null_is_refused_when_the_policys_ids_mean_other_tokens_to_the_reward_model(tmp_path):
    from reinforge.workers.reward_model import build_reward_inputs

    rm_dir = save_tiny_reward_model(tmp_path / "rm")
    policy_dir = save_tiny_reward_model(tmp_path / "policy", extra_tokens=("<think>",))  # only its tokenizer is read
    with pytest.raises(ValueError) as refusal:
        build_reward_inputs(rm_config(policy_dir, rm_dir, input_tokenizer=None))
    assert str(refusal.value) == (
        "reward.reward_model.input_tokenizer=null has the reward model read the policy's token ids, but 1 of the "
        f"policy's 260 tokens (first '<think>') have another id or none in the tokenizer of {rm_dir}; set "
        "reward.reward_model.input_tokenizer=auto to re-render the responses in the reward model's chat template")
    wider_rm = save_tiny_reward_model(tmp_path / "wider", extra_tokens=("<think>", "<x>"))  # the policy's ids and more
    assert build_reward_inputs(rm_config(policy_dir, wider_rm, input_tokenizer=None)).policy_tokenizer is None


def test_a_hub_id_that_cannot_load_names_the_reward_model_setting(monkeypatch):
    import transformers

    class Unreachable:
        @staticmethod
        def from_pretrained(path, **kwargs):
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    monkeypatch.setattr(transformers, "AutoConfig", Unreachable)  # as read_model_config imports it
    with pytest.raises(OSError) as refusal:
        check_reward_model("no-such-owner/no-such-reward-model")
    message = str(refusal.value)
    assert message.startswith("'no-such-owner/no-such-reward-model' is not a local folder and could not be loaded "
                              "from the hub (")
    assert message.endswith("; check reward.reward_model.model_path, or download the model first")


def test_a_chat_response_read_as_the_policys_ids_ends_as_the_whole_conversations_rendering(tiny_model_dir, tmp_path):
    """ChatML writes a newline after <|im_end|>; the rollout stops at <|im_end|>. A reward model trained on rendered
    conversations (reinforge rm, TRL) reads its score after that newline, as verl's default re-rendering gives it:
    with input_tokenizer=auto the worker adds it to a response that ended its turn, where a plain prompt's response
    and a cut one stay as they are. input_tokenizer=null reads the policy's ids exactly as sampled (verl's null)."""
    from reinforge.data.preference_dataset import PreferenceKeys, tokenize_pair

    rm_dir = save_tiny_reward_model(tmp_path / "rm")
    for input_tokenizer in ("auto", None):
        worker = RewardModelWorker(rm_config(tiny_model_dir, rm_dir, input_tokenizer=input_tokenizer))
        assert worker.inputs.policy_tokenizer is None  # the policy's ids, as they are
        tokenizer = worker.inputs.rm_tokenizer
        row = {"prompt": [{"role": "user", "content": "1+2?"}], "chosen": [{"role": "assistant", "content": "3"}],
               "rejected": [{"role": "assistant", "content": "4"}]}
        pair = tokenize_pair(tokenizer, row, PreferenceKeys())  # what reinforge rm trains on
        assert tokenizer.decode(pair.chosen_ids) == "3<|im_end|>\n"
        finished = tokenizer.encode("3<|im_end|>", add_special_tokens=False)
        cut = tokenizer.encode("3", add_special_tokens=False)
        batch = policy_batch([(pair.prompt_ids, finished), (pair.prompt_ids, cut), (pair.prompt_ids, finished)],
                             ["a", "a", "b"])
        batch.non_tensors["raw_prompt"][:2] = [row["prompt"], row["prompt"]]
        batch.non_tensors["raw_prompt"][2] = "1+2?"
        sequences, truncated = worker.inputs.sequences(batch)
        ended = pair.chosen_ids if input_tokenizer == "auto" else finished
        assert sequences == [pair.prompt_ids + ended, pair.prompt_ids + cut, pair.prompt_ids + finished]
        assert truncated == [False] * 3
        config = worker.config.data  # unset, the limit holds the longest sample and the newline after its turn
        assert worker.inputs.max_length == (config.max_prompt_length + config.max_response_length
                                            + (input_tokenizer == "auto"))


def test_the_end_of_turn_token_a_response_stopped_at_is_not_re_rendered_as_text():
    """A tokenizer whose EOS is not its template's end of turn (Qwen base's <|endoftext|>, Gemma's <eos>): the
    rollout stops at <|im_end|>, which the reward model's template must not read as part of the answer."""
    policy_tokenizer = build_char_tokenizer()
    policy_tokenizer.eos_token = "<|endoftext|>"
    rm_tokenizer = build_char_tokenizer(chat_template=PLAIN_TEMPLATE)
    for ending in ("<|im_end|>", "<|im_end|><|endoftext|>"):
        response = policy_tokenizer.encode("3" + ending, add_special_tokens=False)
        batch = policy_batch([(policy_tokenizer.encode("1+2?", add_special_tokens=False), response)], ["a"])
        batch.non_tensors["raw_prompt"][0] = [{"role": "user", "content": "1+2?"}]
        sequences, _ = RewardInputs(rm_tokenizer, policy_tokenizer, max_length=64).sequences(batch)
        assert sequences == [[3 + byte for byte in b"[user] 1+2?\n[assistant] 3\n"]], ending


def test_a_plain_text_prompt_is_re_rendered_with_the_reward_models_bos():
    from tokenizers.processors import TemplateProcessing

    policy_tokenizer = build_char_tokenizer()
    rm_tokenizer = build_char_tokenizer(chat_template=PLAIN_TEMPLATE)
    rm_tokenizer.backend_tokenizer.post_processor = TemplateProcessing(  # a Llama-like BOS before every text
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    response = policy_tokenizer.encode("3<|im_end|>", add_special_tokens=False)
    batch = policy_batch([(policy_tokenizer.encode("1+2=", add_special_tokens=False), response)], ["a"])
    batch.non_tensors["raw_prompt"][0] = "1+2="
    sequences, _ = RewardInputs(rm_tokenizer, policy_tokenizer, max_length=64).sequences(batch)
    # a finished answer ends in the reward model's EOS, as rm's (and TRL's) plain pairs do; a cut one does not
    assert sequences == [rm_tokenizer("1+2=3<|im_end|>")["input_ids"]] == [[0] + [3 + byte for byte in b"1+2=3"] + [2]]
    cut = policy_batch([(policy_tokenizer.encode("1+2=", add_special_tokens=False), response[:1])], ["a"])
    cut.non_tensors["raw_prompt"][0] = "1+2="
    assert RewardInputs(rm_tokenizer, policy_tokenizer, max_length=64).sequences(cut)[0] == [
        [0] + [3 + byte for byte in b"1+2=3"]]
    # a chat prompt's BOS is the template's to write: none is added to it
    batch.non_tensors["raw_prompt"][0] = [{"role": "user", "content": "1+2?"}]
    sequences, _ = RewardInputs(rm_tokenizer, policy_tokenizer, max_length=64).sequences(batch)
    assert sequences == [[3 + byte for byte in b"[user] 1+2?\n[assistant] 3\n"]]
