import re

import pytest
import torch
from transformers import LlamaModel, Qwen2Model

from reinforge.models import ValueModel
from reinforge.models.value_model import VALUE_HEAD_FILE


def test_value_model_from_causal_lm_folder(tiny_model_dir):
    critic = ValueModel.from_pretrained(tiny_model_dir)
    assert isinstance(critic.backbone, (Qwen2Model, LlamaModel))
    assert critic.value_head.weight.dtype == torch.float32
    assert critic.value_head.weight.abs().sum() > 0, "small random head, so the body gets gradient at once"
    assert torch.count_nonzero(critic.value_head.bias) == 0

    input_ids = torch.randint(3, 100, (2, 6))
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    values = critic(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    assert values.shape == (2, 6)
    assert values.dtype == torch.float32

    # a left-padded row gives the same values on its tokens as the unpadded row
    unpadded = critic(input_ids[:1, 2:])
    torch.testing.assert_close(values[0, 2:], unpadded[0], atol=1e-5, rtol=1e-5)


def test_backbone_weights_come_from_the_causal_lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = ValueModel.from_pretrained(tiny_model_dir)
    torch.testing.assert_close(critic.backbone.get_input_embeddings().weight, causal_lm.get_input_embeddings().weight)
    torch.testing.assert_close(critic.backbone.layers[0].mlp.up_proj.weight, causal_lm.model.layers[0].mlp.up_proj.weight)


def test_gradient_reaches_head_and_backbone(tiny_model_dir):
    critic = ValueModel.from_pretrained(tiny_model_dir, gradient_checkpointing=True)
    critic.train()
    values = critic(torch.randint(3, 100, (2, 5)))
    (values - 1.0).pow(2).mean().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert critic.backbone.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert critic.backbone.get_input_embeddings().weight.grad.abs().sum() > 0


def test_save_and_load_round_trip(tiny_model_dir, tmp_path):
    critic = ValueModel.from_pretrained(tiny_model_dir, seed=3)
    with torch.no_grad():
        critic.value_head.bias.fill_(0.5)
    out_dir = critic.save_pretrained(tmp_path / "critic")
    assert (out_dir / VALUE_HEAD_FILE).is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["critic"]

    reloaded = ValueModel.from_pretrained(out_dir, seed=99)
    input_ids = torch.randint(3, 100, (3, 4))
    torch.testing.assert_close(reloaded(input_ids), critic(input_ids))


def test_same_seed_same_head_in_bfloat16(tiny_model_dir):
    first = ValueModel.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, seed=5)
    second = ValueModel.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, seed=5)
    assert torch.equal(first.value_head.weight, second.value_head.weight)
    assert first.backbone.get_input_embeddings().weight.dtype == torch.bfloat16
    values = first(torch.randint(3, 100, (1, 4)))
    assert values.dtype == torch.float32 and values.shape == (1, 4)


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ValueModel.from_pretrained(tmp_path / "nope")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_critic_on_cuda_in_bfloat16(tiny_model_dir, tmp_path):
    critic = ValueModel.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, device="cuda", gradient_checkpointing=True)
    critic.train()
    values = critic(torch.randint(3, 100, (2, 8), device="cuda"))
    assert values.dtype == torch.float32 and values.device.type == "cuda"
    values.sum().backward()
    assert critic.backbone.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    reloaded = ValueModel.from_pretrained(critic.save_pretrained(tmp_path / "critic"), dtype=torch.bfloat16, device="cuda")
    assert torch.equal(reloaded.value_head.weight, critic.value_head.weight)


def test_a_bart_causal_lms_critic_reads_its_decoder_alone(tmp_path):
    """BART's causal LM is its decoder; AutoModel builds the encoder-decoder, which read each sequence through a fresh
    encoder with its tokens shifted (values up to 2 from the decoder's). Its decoder numbers positions itself, so it
    scores padded rows, each sequence's values those of the sequence alone; saved, the critic reloads so."""
    from transformers import BartConfig, BartForCausalLM

    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.forward import build_position_ids, response_values, runs_padded
    from reinforge.models import build_char_tokenizer, save_hf_folder
    from reinforge.protocol import Batch

    tokenizer = build_char_tokenizer()
    config = BartConfig(vocab_size=len(tokenizer), d_model=32, decoder_layers=1, decoder_attention_heads=4,
                        decoder_ffn_dim=64, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64,
                        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    causal_lm = BartForCausalLM(config).eval()
    critic = ValueModel.from_pretrained(save_hf_folder(causal_lm, tokenizer, tmp_path / "bart")).eval()
    use_varlen_attention(critic.backbone)
    assert runs_padded(critic)
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    responses = torch.tensor([[11, 12, 13], [14, 15, 0]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    batch = Batch.from_dict(tensors={"prompts": prompts, "responses": responses,
                                     "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
                                     "position_ids": build_position_ids(attention_mask)})
    with torch.no_grad():
        values = response_values(critic, batch)
        for row, (start, count) in enumerate([(2, 3), (0, 2)]):
            ids = batch["input_ids"][row][attention_mask[row].bool()][None]
            hidden = causal_lm.model.decoder(input_ids=ids).last_hidden_state[0]
            alone = critic.value_head(hidden[3 - start:3 - start + count]).squeeze(-1)
            torch.testing.assert_close(values[row, :count], alone, atol=1e-5, rtol=0)
        reloaded = ValueModel.from_pretrained(critic.save_pretrained(tmp_path / "critic")).eval()
        torch.testing.assert_close(reloaded(ids), critic(ids), atol=1e-6, rtol=0)


def test_a_critic_folder_whose_weights_do_not_fit_its_config_is_refused_before_they_load(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """The actor's one line for weights of other shapes than config.json builds, for critic.model_path, read from the
    safetensors headers: no weight is read (the load's own error pointed at transformers' report table)."""
    import json
    import shutil

    import transformers

    from reinforge.models.value_model import check_critic_folder

    folder = tmp_path / "resized"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    with pytest.raises(ValueError) as refusal:
        check_critic_folder(str(folder))
    message = str(refusal.value)
    assert re.fullmatch(rf"critic\.model_path={re.escape(str(folder))}: its weights do not fit its config\.json "
                        r"\(model\.\S+ is \[[0-9, ]+\] in the weights, \[[0-9, ]+\] in the model config\.json builds, "
                        r"and \d+ more tensors\); fix config\.json's sizes to the weights', or point critic\.model_path "
                        "at the folder they came with", message)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", None)  # refused before any load
    with pytest.raises(ValueError) as refusal:
        ValueModel.from_pretrained(folder)
    assert str(refusal.value) == message
    check_critic_folder(str(tiny_model_dir))  # its own config fits


def test_a_critic_of_as_many_rows_as_the_policy_reads_ids_in_is_taken(tiny_model_dir, tmp_path):
    """The ids the critic reads are the policy's tokenizer's within the policy's own rows: a critic of the policy's
    rows is not refused where the tokenizer names more ids than the policy has (a padded or cut vocabulary)."""
    import json
    import shutil

    from reinforge.models import load_tokenizer
    from reinforge.models.value_model import check_critic_reads_policy_ids

    folder = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    check_critic_reads_policy_ids(str(folder), tokenizer, policy_rows=200)
    with pytest.raises(ValueError, match=r"the critic reads the policy's token ids, 201 of them, but its embedding "
                                         r"has 200 rows \(vocab_size in its config\.json\)"):
        check_critic_reads_policy_ids(str(folder), tokenizer, policy_rows=201)
