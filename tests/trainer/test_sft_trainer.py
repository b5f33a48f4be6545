"""The SFT trainer: assistant-only loss masks, packing, micro-batching, the run folder and resume."""

from __future__ import annotations

import json

import pytest
import torch

from reinforge.config import ConfigError, load_sft_config
from reinforge.data.sft_dataset import collate_sft, pack_examples, tokenize_conversation
from reinforge.models import build_char_tokenizer, build_tiny_causal_lm
from reinforge.models.loading import checkpointing_enabled
from reinforge.trainer.sft_trainer import SFTTrainer, token_log_probs

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": "3"},
    {"role": "tool", "content": "ok"},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def trained_text(tokenizer, example) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    runs, current = [], []
    for token_id, trained in zip(example.input_ids, example.loss_mask, strict=True):
        if trained:
            current.append(token_id)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


MARKED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                   "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}"
                   "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML with TRL's {% generation %} markers around each reply and its <|im_end|>."""
MARKED_BEFORE_END = MARKED_TEMPLATE.replace("<|im_end|>{% endgeneration %}", "{% endgeneration %}<|im_end|>")
"""The markers around each reply only: its <|im_end|> is written after the block."""


@pytest.mark.parametrize("template", [None, MARKED_TEMPLATE, MARKED_BEFORE_END])
def test_only_assistant_tokens_and_their_end_of_turn_are_trained(tokenizer, template):
    """A {% generation %} block that leaves the end of turn out still trains it: else the model never learns to stop."""
    example = tokenize_conversation(tokenizer, CONVERSATION, template)
    assert trained_text(tokenizer, example) == ["3<|im_end|>", "4<|im_end|>"]
    assert tokenizer.decode(example.input_ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                                                 chat_template=template)


@pytest.mark.parametrize("template", [None, MARKED_TEMPLATE, MARKED_BEFORE_END])
def test_an_empty_reply_trains_its_end_of_turn(tokenizer, template):
    """An empty reply is the model stopping at once: its <|im_end|> is trained, also where a {% generation %} block
    leaves the end of turn out and so marks no token of that reply."""
    conversation = [*CONVERSATION[:2], {"role": "assistant", "content": ""}, *CONVERSATION[3:]]
    example = tokenize_conversation(tokenizer, conversation, template)
    assert trained_text(tokenizer, example) == ["<|im_end|>", "4<|im_end|>"]


def test_an_empty_reply_ends_its_turn_but_a_reply_the_template_leaves_unmarked_stays_untrained(tokenizer):
    """A template whose {% generation %} block marks the last reply alone: an empty last reply trains its end of turn,
    the earlier reply the template chose not to mark trains nothing (as TRL trains it)."""
    last_only = MARKED_BEFORE_END.replace("m['role'] == 'assistant' %}", "m['role'] == 'assistant' and loop.last %}")
    conversation = [*CONVERSATION[:5], {"role": "assistant", "content": ""}]
    example = tokenize_conversation(tokenizer, conversation, last_only)
    assert trained_text(tokenizer, example) == ["<|im_end|>"] and example.loss_mask[-1] == 1


def test_single_turn_masks_header_and_trailing_newline(tokenizer):
    example = tokenize_conversation(tokenizer, CONVERSATION[1:3])
    prompt = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert sum(example.loss_mask) == 2  # "3" and <|im_end|>
    assert example.loss_mask.index(1) == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert example.loss_mask[-1] == 0  # the "\n" after <|im_end|>


TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(',') }}"
                 "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


def test_a_rows_tools_column_is_rendered_by_the_template_and_not_trained(tokenizer, tmp_path):
    """TRL's SFT rows carry their tool schemas in a tools column: the template shows them to the model, as a tool
    rollout will; ignored, they would teach the model tool calls without ever showing it the tools."""
    from reinforge.data.sft_dataset import SFTDataset

    rows = [{"messages": CONVERSATION[1:3], "tools": TOOLS}, {"messages": CONVERSATION[1:3], "tools": json.dumps(TOOLS)},
            {"messages": CONVERSATION[1:3]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = SFTDataset([path], tokenizer, max_length=512, chat_template=TOOL_TEMPLATE)
    with_tools, as_text, without = dataset.examples
    assert with_tools == as_text
    assert tokenizer.decode(with_tools.input_ids).startswith("<|im_start|>system\ntools: calc<|im_end|>")
    assert "tools" not in tokenizer.decode(without.input_ids)
    assert trained_text(tokenizer, with_tools) == trained_text(tokenizer, without) == ["3<|im_end|>"]
    path.write_text(json.dumps({"messages": CONVERSATION[1:3], "tools": "calc"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 of .*rows.jsonl has a 'tools' column that is not valid JSON"):
        SFTDataset([path], tokenizer, max_length=512, chat_template=TOOL_TEMPLATE)


def test_plain_text_rows_are_trained_as_text_without_the_chat_template(tokenizer, tmp_path):
    """TRL's standard rows: a prompt and completion string (or a text string) are tokenized as text, the completion
    and the EOS trained; the chat template would teach the model a format its plain prompts never have."""
    from reinforge.api.inputs import as_conversations
    from reinforge.data.sft_dataset import SFTDataset

    rows = as_conversations([{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"},
                             {"text": "3+3=6"}])
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pair, _, text = SFTDataset([path], tokenizer, max_length=512).examples
    assert tokenizer.decode(pair.input_ids) == "1+1=2<|im_end|>"
    assert trained_text(tokenizer, pair) == ["2<|im_end|>"]
    assert trained_text(tokenizer, text) == ["+3=6<|im_end|>"]  # all but the first token, which nothing predicts
    merging = build_char_tokenizer(extra_tokens=["=2"])  # a token across the prompt's end is the completion's, as in TRL
    assert trained_text(merging, SFTDataset([path], merging, max_length=512).examples[0]) == ["=2<|im_end|>"]
    path.write_text(json.dumps({"content": "3+3=6"}) + "\n")  # TRL's dataset_text_field names another column
    assert SFTDataset([path], tokenizer, max_length=512, text_key="content").examples == [text]


@pytest.mark.parametrize("template", [None, MARKED_TEMPLATE])
def test_a_conversational_pair_trains_its_completion_not_the_replies_of_its_prompt(tokenizer, tmp_path, template):
    """TRL's conversational prompt/completion rows: the prompt's own assistant turns are context (TRL's
    completion_only_loss); a string completion is one assistant message."""
    from reinforge.api.inputs import as_conversations
    from reinforge.data.sft_dataset import SFTDataset

    rows = as_conversations([{"prompt": CONVERSATION[:5], "completion": CONVERSATION[5:]},
                             {"prompt": CONVERSATION[:5], "completion": "4"}])
    path = tmp_path / "rows.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    pair, with_string = SFTDataset([path], tokenizer, max_length=512, chat_template=template).examples
    assert pair == with_string
    assert pair.input_ids == tokenize_conversation(tokenizer, CONVERSATION, template).input_ids
    assert trained_text(tokenizer, pair) == ["4<|im_end|>"]


def test_a_sharegpt_row_trains_as_its_chat_messages(tokenizer, tmp_path):
    """ShareGPT's ``conversations`` of ``from``/``value`` turns (human, gpt, system) are the chat row they name."""
    from reinforge.data.sft_dataset import SFTDataset

    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": speakers[message["role"]], "value": message["content"]} for message in CONVERSATION
             if message["role"] != "tool"]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"conversations": turns, "id": "a1"}) + "\n")
    (example,) = SFTDataset([path], tokenizer, max_length=512).examples
    messages = [message for message in CONVERSATION if message["role"] != "tool"]
    assert example.input_ids == tokenize_conversation(tokenizer, messages).input_ids
    assert trained_text(tokenizer, example) == ["3<|im_end|>", "4<|im_end|>"]


def test_loss_on_all_trains_every_token_of_a_row(tokenizer, tmp_path):
    """data.loss_on=all: TRL's SFT of a conversation without assistant_only_loss (of a pair without
    completion_only_loss): every token but the first, which nothing predicts."""
    from reinforge.data.sft_dataset import SFTDataset

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"prompt": "1+1=", "completion": "2"}))
    conversation, pair = SFTDataset([path], tokenizer, max_length=512, loss_on="all").examples
    assert conversation.input_ids == tokenize_conversation(tokenizer, CONVERSATION).input_ids
    for example in (conversation, pair):
        assert example.loss_mask == [0] + [1] * (len(example.input_ids) - 1)
    assert trained_text(tokenizer, pair) == ["+1=2<|im_end|>"]


def test_template_that_drops_earlier_turns_is_refused(tokenizer):
    template = "{% for m in messages[-1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match=r"^the chat template drops message 0 \(system\): it writes none of its content"):
        tokenize_conversation(tokenizer, CONVERSATION, template)


def test_packed_rows_give_each_conversation_its_unpacked_log_probs(tokenizer):
    model = build_tiny_causal_lm(vocab_size=len(tokenizer), seed=0).eval()
    examples = [tokenize_conversation(tokenizer, CONVERSATION[1:3]),
                tokenize_conversation(tokenizer, CONVERSATION),
                tokenize_conversation(tokenizer, CONVERSATION[4:6])]
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        unpacked = collate_sft(examples, pad)
        expected = (token_log_probs(model, unpacked) * unpacked["loss_mask"]).sum()
        packed_rows = pack_examples(examples, max_length=1000)
        assert len(packed_rows) == 1
        packed = collate_sft(packed_rows, pad, packed=True)
        got = (token_log_probs(model, packed) * packed["loss_mask"]).sum()
    assert packed["loss_mask"].sum() == unpacked["loss_mask"].sum()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


OUTSIDE_FAMILIES = {
    "opt": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96, word_embed_proj_dim=64,
                max_position_embeddings=128),
    "mamba": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, state_size=8),
    "bart": dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2,
                 encoder_attention_heads=4, encoder_ffn_dim=128, max_position_embeddings=128),
    "rwkv": dict(hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128,
                 context_length=128),
}
"""Tiny causal LMs whose forward does not keep a packed row's conversations apart by their position ids alone."""


@pytest.mark.parametrize("model_type", sorted(OUTSIDE_FAMILIES))
@pytest.mark.parametrize("packed", [True, False])
def test_each_conversation_trains_on_its_own_log_probs_whatever_the_model_reads_of_a_row(tokenizer, model_type, packed):
    """OPT's own masks and Mamba's state read across a packed row's conversations, which restarting position ids do
    not separate; BART's decoder numbers a left-padded row's positions from its first column and RWKV's state runs
    over the padding: each conversation then runs as a row of its own, its padding after it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **OUTSIDE_FAMILIES[model_type])
    model = AutoModelForCausalLM.from_config(config).eval()
    examples = [tokenize_conversation(tokenizer, CONVERSATION[1:3]), tokenize_conversation(tokenizer, CONVERSATION[4:6]),
                tokenize_conversation(tokenizer, CONVERSATION[:3])]
    expected = 0.0
    with torch.no_grad():
        for example in examples:
            logits = model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1]
            alone = logits.log_softmax(-1).gather(-1, torch.tensor(example.input_ids[1:])[:, None])[:, 0]
            expected += float((alone * torch.tensor(example.loss_mask[1:])).sum())
        rows = pack_examples(examples, max_length=100) if packed else examples
        assert len(rows) == (2 if packed else 3)
        batch = collate_sft(rows, tokenizer.pad_token_id, packed=packed)
        got = float((token_log_probs(model, batch) * batch["loss_mask"]).sum())
    assert got == pytest.approx(expected, abs=1e-4)


def write_chat_rows(path, count: int) -> str:
    with open(path, "w") as handle:
        for index in range(count):
            left, right = index % 7, (3 * index) % 5
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"{left}+{right}?"},
                                                  {"role": "assistant", "content": str(left + right)}]}) + "\n")
    return str(path)


def sft_config(tmp_path, model_dir, *extra: str):
    train = write_chat_rows(tmp_path / "train.jsonl", 32)
    val = write_chat_rows(tmp_path / "val.jsonl", 8)
    return load_sft_config(None, [f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                                  "data.batch_size=8", "data.max_length=64", "trainer.total_steps=6", "optim.lr=3e-3",
                                  "optim.warmup_steps=0", "trainer.device=cpu", "trainer.loggers=[jsonl]",
                                  f"trainer.output_dir={tmp_path / 'run'}", *extra])


def test_sft_run_lowers_the_loss_and_leaves_an_rl_style_run_folder(tmp_path, tiny_model_dir):
    trainer = SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.save_every=3"))
    last = trainer.fit()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and records[-1]["val/loss"] < records[0]["val/loss"]
    assert last["train/loss"] > 0
    assert (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000006"
    final = trainer.final_model_dir()
    assert {"actor_state.pt", "trainer_state.pt", "hf"} <= {path.name for path in final.parent.iterdir()}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final).chat_template


def test_resume_continues_from_the_latest_checkpoint(tmp_path, tiny_model_dir):
    SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=3")).fit()
    resumed = SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=5"))
    resumed.fit()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]
    # Resumed at its last step: nothing trains, and fit() reports what that step logged.
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    again = SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.total_steps=5")).fit()
    assert logged.pop("step") == 5 and again == logged
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 6


def test_micro_batch_budget_does_not_change_the_update(tmp_path, tiny_model_dir):
    weights = []
    for budget in (64, 100000):
        folder = tmp_path / str(budget)
        folder.mkdir()
        trainer = SFTTrainer(sft_config(folder, tiny_model_dir, "trainer.total_steps=1",
                                        f"trainer.max_tokens_per_micro_batch={budget}", "data.packing=true"))
        trainer.train_step(trainer.train_loader.next_batch())
        weights.append(next(trainer.model.parameters()).detach().clone())
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


def test_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="did you mean optim.lr"):
        load_sft_config(None, ["optim.learning_rate=1e-5"])
    with pytest.raises(ConfigError, match="data.truncation"):
        load_sft_config(None, ["data.truncation=left"])
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        load_sft_config(None, ["trainer.total_steps=many"])
    with pytest.raises(ConfigError, match=r"^trainer.router_aux_loss_coef=-0.01 must be a finite number >= 0 \(the "
                                          r"weight of a mixture of experts' load-balancing loss; null: the model "
                                          r"config's\) \(trainer.router_aux_loss_coef: command line\)$"):
        load_sft_config(None, ["trainer.router_aux_loss_coef=-0.01"])


def test_a_router_aux_loss_coef_on_a_model_without_experts_is_refused_before_it_loads(tmp_path, tiny_model_dir):
    """As TRL's SFTTrainer refuses it: a dense model has no router to balance; 0 stays fine."""
    with pytest.raises(ConfigError, match=r"^trainer.router_aux_loss_coef=0.01 weighs a mixture of experts' "
                                          r"load-balancing loss, but model.path=.* is a 'qwen2' model without experts, "
                                          r"which has no router to balance; remove trainer.router_aux_loss_coef or set "
                                          r"it to 0$"):
        SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.router_aux_loss_coef=0.01"))
    assert not (tmp_path / "run").exists()  # refused before the run folder, before the model
    assert SFTTrainer(sft_config(tmp_path, tiny_model_dir, "trainer.router_aux_loss_coef=0")).router_aux_loss_coef == 0


def moe_model_dir(folder, tokenizer, model_type: str, **config):
    """A tiny mixture of experts of ``tests/engine/test_moe.py`` (routers far from uniform), saved with the tokenizer."""
    from reinforge.models.export import save_hf_folder
    from tests.engine.test_moe import tiny_moe

    return save_hf_folder(tiny_moe(model_type, vocab_size=len(tokenizer), **config), tokenizer, folder)


def step_gradients(trainer: SFTTrainer, batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The step's metrics and each parameter's gradient summed over its micro-batches, before clipping."""
    gradients: dict[str, torch.Tensor] = {}

    def keep(name: str):
        return lambda grad: gradients.__setitem__(name, gradients.get(name, 0) + grad.detach().clone())

    handles = [parameter.register_hook(keep(name)) for name, parameter in trainer.model.named_parameters()]
    try:
        return trainer.train_step(batch), gradients
    finally:
        for handle in handles:
            handle.remove()


def router_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters() if name.endswith("mlp.gate.weight")]


@pytest.mark.parametrize("model_type, packed, checkpointed", [
    *((family, packed, False) for family in ("qwen3_moe", "mixtral", "olmoe") for packed in (False, True)),
    ("qwen3_moe", True, True)])
def test_a_mixture_of_experts_adds_transformers_aux_loss_where_its_config_asks(tmp_path, tokenizer, model_type, packed,
                                                                               checkpointed):
    """As TRL's SFTTrainer: output_router_logits adds router_aux_loss_coef x transformers' load-balancing loss of the
    padded batch (padding left out by its attention mask; a packed row's conversations count as their own rows), its
    gradient reaching the routers (through recomputed layers too); trainer.router_aux_loss_coef=0 adds none. The
    routing is logged either way."""
    from transformers import AutoModelForCausalLM

    model_dir = moe_model_dir(tmp_path / "moe", tokenizer, model_type, output_router_logits=True,
                              router_aux_loss_coef=0.5)
    examples = [tokenize_conversation(tokenizer, CONVERSATION[1:3]), tokenize_conversation(tokenizer, CONVERSATION),
                tokenize_conversation(tokenizer, CONVERSATION[4:6])]
    padded = collate_sft(examples, tokenizer.pad_token_id)
    batch = collate_sft(pack_examples(examples, 1000), tokenizer.pad_token_id, packed=True) if packed else padded
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    aux_loss = reference(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                         position_ids=padded["position_ids"]).aux_loss
    expected_router_grads = torch.autograd.grad(aux_loss, [parameter for name, parameter in
                                                           reference.named_parameters() if name in router_names(reference)])
    steps = {}
    for coef in (None, 0.0):
        folder = tmp_path / f"coef-{coef}"
        folder.mkdir()
        extra = [] if coef is None else [f"trainer.router_aux_loss_coef={coef}"]
        trainer = SFTTrainer(sft_config(folder, model_dir, "trainer.max_tokens_per_micro_batch=1000",
                                        f"model.gradient_checkpointing={checkpointed}", *extra))
        assert trainer.router_aux_loss_coef == (0.5 if coef is None else 0.0)
        assert checkpointing_enabled(trainer.model) == checkpointed
        steps[coef] = step_gradients(trainer, batch)
    for metrics, _ in steps.values():
        assert metrics["train/moe/aux_loss"] == pytest.approx(aux_loss.item(), rel=1e-5)
        assert metrics["train/moe/load_imbalance"] >= 1.0 and 0 <= metrics["train/moe/unused_experts"] < 4
    (with_aux, with_grads), (without_aux, without_grads) = steps[None], steps[0.0]
    assert with_aux["train/loss"] == pytest.approx(without_aux["train/loss"], rel=1e-6)
    names = router_names(trainer.model)
    assert len(names) == len(expected_router_grads) == 2
    for name, expected in zip(names, expected_router_grads, strict=True):
        torch.testing.assert_close(with_grads[name] - without_grads[name], 0.5 * expected, atol=1e-5, rtol=1e-4)


def test_the_aux_loss_is_weighted_by_each_micro_batchs_share_as_the_token_mean_loss_is(tmp_path, tokenizer):
    """Two micro-batches of the same rows give the gradient and the aux loss of one micro-batch of them all: each
    micro-batch's aux loss counts for its share of the trained tokens, not once per micro-batch."""
    from reinforge.engine.micro_batches import split_by_token_budget

    model_dir = moe_model_dir(tmp_path / "moe", tokenizer, "qwen3_moe", output_router_logits=True,
                              router_aux_loss_coef=0.5)
    rows = [tokenize_conversation(tokenizer, CONVERSATION[1:3]), tokenize_conversation(tokenizer, CONVERSATION[3:6])]
    batch = collate_sft(rows * 2, tokenizer.pad_token_id)
    half_budget = batch["input_ids"].shape[1] * 2
    assert len(split_by_token_budget(batch, half_budget)) == 2
    steps = []
    for budget in (half_budget, 1000):
        folder = tmp_path / str(budget)
        folder.mkdir()
        trainer = SFTTrainer(sft_config(folder, model_dir, f"trainer.max_tokens_per_micro_batch={budget}",
                                        f"data.max_length={min(half_budget, 64)}"))
        steps.append(step_gradients(trainer, batch))
    (split, split_grads), (whole, whole_grads) = steps
    assert split["train/moe/aux_loss"] == pytest.approx(whole["train/moe/aux_loss"], abs=1e-5)
    assert split["train/loss"] == pytest.approx(whole["train/loss"], abs=1e-5)
    assert split_grads.keys() == whole_grads.keys() and set(router_names(trainer.model)) <= split_grads.keys()
    for name, grad in whole_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
