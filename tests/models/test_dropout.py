"""Dropout found and switched off in every form a checkpoint's modules use it (models.dropout)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from reinforge.models.dropout import active_dropout, disable_dropout, dropout_line
from reinforge.models.tiny import build_tiny_causal_lm

CONFIGS = {
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),  # nn.Dropout modules
    "opt": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                word_embed_proj_dim=32, max_position_embeddings=64),  # float rates handed to F.dropout
    "mixtral": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, router_jitter_noise=0.1),  # the router's input jitter
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_model_with_dropout_forwards_in_training_mode_as_in_eval_once_it_is_off(arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **CONFIGS[arch])).float().train()
    ids = torch.randint(0, 64, (2, 9))
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # dropout is on
    found = disable_dropout(model)
    assert found and found[0].startswith("config.") and not active_dropout(model)
    line = dropout_line(model, found)
    assert line.startswith(f"dropout off for RL: {arch} drops activations") and "\n" not in line
    trained = model(input_ids=ids).logits
    with torch.no_grad():
        evaluated = model.eval()(input_ids=ids).logits
    torch.testing.assert_close(trained, evaluated)


def test_a_model_without_dropout_reports_nothing():
    model = build_tiny_causal_lm("qwen2", vocab_size=64)
    assert active_dropout(model) == [] and disable_dropout(model) == []


def test_a_saved_config_keeps_the_checkpoints_own_dropout_rates():
    """Dropout is off while RL trains; hf/ and export keep the rates the checkpoint came with, for later fine-tuning."""
    import copy

    from reinforge.models.dropout import restore_config_dropout

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **CONFIGS["gpt2"]))
    rates = {key: getattr(model.config, key) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    assert disable_dropout(model) and all(getattr(model.config, key) == 0 for key in rates)
    saved = copy.deepcopy(model.config)
    restore_config_dropout(model, saved)
    assert {key: getattr(saved, key) for key in rates} == rates and all(rates.values())
    assert all(getattr(model.config, key) == 0 for key in rates)  # the live model trains without dropout still


def test_phimoes_router_threshold_is_not_taken_for_a_rate():
    """PhiMoE's router masks the experts whose score lies more than ``router_jitter_noise`` (relative) below the top
    one, in eval mode too: switched to 0 it routed otherwise (its eval log-probs moved by several nats), while its
    input noise in training mode, ``input_jitter_noise``, is a rate."""
    model = build_tiny_causal_lm("phimoe", vocab_size=64, seed=0).eval()
    model.config.input_jitter_noise = 0.1
    for module in model.modules():
        if hasattr(module, "input_jitter_noise"):
            module.input_jitter_noise = 0.1
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(8)  # scores far enough apart that the threshold masks some experts
        ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
        before = model(input_ids=ids).logits
        found = disable_dropout(model)
        assert any("input_jitter_noise" in each for each in found), found
        assert not any("router_jitter_noise" in each for each in found), found
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    assert model.config.router_jitter_noise == 0.01 and not active_dropout(model)


def test_phimoes_router_routes_in_training_mode_as_in_eval_once_dropout_is_off():
    """PhiMoE's router samples its experts in training mode (SparseMixer's Gumbel draw) where eval mode takes the
    top ones: the RL training forward then routed otherwise than the rollout. It stays in eval mode after
    ``disable_dropout``, through ``model.train()``, a deep copy and a pickle, and its weights still get gradients."""
    import copy
    import pickle

    model = build_tiny_causal_lm("phimoe", vocab_size=64, seed=0).train()
    for layer in model.model.layers:
        layer.mlp.router.router_jitter_noise = 1.0  # a threshold that masks no expert: each draw has a choice
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # experts sampled
    found = disable_dropout(model)
    assert any("router (samples its experts in training mode)" in each for each in found), found
    assert not active_dropout(model) and disable_dropout(model) == []
    assert dropout_line(model, found).startswith("dropout off for RL: phimoe samples at random in training mode (")
    with torch.no_grad():
        evaluated = model.eval()(input_ids=ids).logits
    for trained in (model.train(), copy.deepcopy(model).train(), pickle.loads(pickle.dumps(model)).train()):
        assert trained.training and not trained.model.layers[0].mlp.router.training
        torch.testing.assert_close(trained(input_ids=ids).logits, evaluated)
    model(input_ids=ids).logits.sum().backward()
    assert model.model.layers[0].mlp.router.weight.grad.abs().sum() > 0
