"""Mixture-of-experts training (engine.moe): grouped experts, router statistics, the aux loss; fp32 on the CPU."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from reinforge.config.schema import Config
from reinforge.engine.moe import (
    RECORD_ATTRIBUTE,
    RouterRecorder,
    is_moe,
    load_balancing_loss,
    prepare_moe_training,
    router_aux_loss_coef,
    router_outputs,
    trained_aux_loss_coef,
    use_grouped_experts,
    without_router_logits_output,
)
from reinforge.engine.train_step import MiniBatchCounts
from reinforge.models.tiny import tiny_config
from reinforge.protocol import Batch
from reinforge.workers.actor_loss import actor_loss, no_grad_rows

MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "phimoe", "gpt_oss")
"""Families of ``reinforge.models.tiny``; PhiMoE's and GPT-OSS's routers are called ``router``, not ``gate``."""


def tiny_moe(model_type: str, experts_implementation: str = "eager", vocab_size: int = 64, **overrides):
    """A tiny model of ``reinforge.models.tiny`` (two layers; DeepSeek's first dense), random weights of std 0.2."""
    config = tiny_config(model_type, vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=experts_implementation)
    with torch.no_grad():
        for parameter in model.parameters():  # transformers initialises routers and experts to near zero
            if parameter.dim() > 1:
                parameter.normal_(std=0.2)
    return model


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_grouped_experts_equal_transformers_loop_over_experts_output_and_gradients(model_type):
    model = tiny_moe(model_type)
    input_ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))

    def run():
        model.zero_grad()
        logits = model(input_ids).logits
        logits.square().mean().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    looped, looped_grads = run()
    assert model.config._experts_implementation == "eager"
    line = use_grouped_experts(model)
    assert model.config._experts_implementation == "grouped_mm" and "grouped GEMMs" in line
    grouped, grouped_grads = run()
    torch.testing.assert_close(grouped, looped, atol=1e-5, rtol=1e-5)
    assert grouped_grads.keys() == looped_grads.keys()
    assert any(".experts." in name for name in grouped_grads)
    for name, grad in grouped_grads.items():
        torch.testing.assert_close(grad, looped_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_dense_models_are_left_as_they_are(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not is_moe(model) and use_grouped_experts(model) is None and RouterRecorder.attach(model) is None


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "phimoe", "gpt_oss"])
def test_recorded_aux_loss_is_transformers_load_balancing_loss(model_type):
    model = tiny_moe(model_type, experts_implementation="grouped_mm", output_router_logits=True,
                     router_aux_loss_coef=0.01)
    input_ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    recorder = RouterRecorder(model)
    with recorder.recording_forward():
        outputs = model(input_ids, labels=input_ids)
    recorded = recorder.take(with_grad=True)
    assert recorded is not None and len(recorder.routers) == 2
    torch.testing.assert_close(recorded.aux_loss, outputs.aux_loss, atol=1e-6, rtol=1e-6)
    outputs_again = model(input_ids)  # not recording: nothing kept
    assert outputs_again is not None and recorder.take(with_grad=False) is None


class _OpNames(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "phimoe", "gpt_oss"])
def test_router_statistics_score_each_layer_once_and_count_the_experts_the_routers_chose(model_type):
    """Qwen3-MoE's, Mixtral's and OLMoE's routers choose the top-k the loss counts, and DeepSeek V3's loss counts the
    experts its routers chose: one softmax (sigmoid) per layer and no second top-k, with the statistics of ranking
    the softmax again, bit for bit, and their gradient. PhiMoE's and GPT-OSS's routers choose otherwise: the loss
    ranks the same softmax it sums."""
    model = tiny_moe(model_type, experts_implementation="grouped_mm")
    recorder = RouterRecorder(model)
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    token_weights = torch.tensor([0.0, 1.0, 2.0, 3.0]).repeat(6)
    with recorder.recording_forward():
        model(input_ids)
    logits, expert_ids = zip(*(getattr(router, RECORD_ATTRIBUTE) for router in recorder.routers), strict=True)
    ops = _OpNames()
    with ops:
        recorded = recorder.take(with_grad=True, token_weights=token_weights)
    scores = "sigmoid" if model_type == "deepseek_v3" else "_softmax"
    ranks_again = model_type in ("phimoe", "gpt_oss")
    assert ops.names.count(scores) == len(recorder.routers)
    assert ops.names.count("topk") == (len(recorder.routers) if ranks_again else 0)
    ranked_again = router_outputs(list(logits), list(expert_ids), True, token_weights, recorder.scoring,
                                  None if model_type == "deepseek_v3" else model.config.num_experts_per_tok)
    assert torch.equal(recorded.aux_loss, ranked_again.aux_loss)
    assert torch.equal(recorded.expert_counts, ranked_again.expert_counts)
    gradients = [torch.autograd.grad(loss, recorder.routers[0].weight, retain_graph=True)[0]
                 for loss in (recorded.aux_loss, ranked_again.aux_loss)]
    assert torch.equal(*gradients) and gradients[0].abs().sum() > 0


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_aux_loss_of_a_packed_pass_is_that_of_transformers_padded_forward(model_type, share_prompts):
    """Shared prompts run once in a packed row but count once per sample; padding counts not at all."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_packing import grouped_batch

    from reinforge.engine.attention import use_varlen_attention
    from reinforge.engine.forward import response_log_probs, routed_token_weights
    from reinforge.engine.packing import attach_plan

    model = tiny_moe(model_type, experts_implementation="grouped_mm", output_router_logits=True,
                     router_aux_loss_coef=0.01)
    batch = grouped_batch(num_prompts=2, samples=3)
    batch = batch.index([row for row in range(len(batch)) if batch["response_mask"][row].any()])
    padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], labels=batch["input_ids"]).aux_loss
    use_varlen_attention(model)
    without_router_logits_output(model)
    recorder = RouterRecorder(model)
    micro = attach_plan(batch, share_prompts=share_prompts)
    with recorder.recording_forward():
        response_log_probs(model, micro)
    weights = routed_token_weights(model, micro)
    assert weights.shape[0] == micro.meta["packing_plan"].num_tokens and weights.max() == (3 if share_prompts else 1)
    recorded = recorder.take(with_grad=False, token_weights=weights)
    torch.testing.assert_close(recorded.aux_loss, padded, atol=1e-6, rtol=1e-6)
    with recorder.recording_forward():
        response_log_probs(model, micro)
    with pytest.raises(ValueError, match="routes other tokens"):
        recorder.take(with_grad=False, token_weights=weights[1:])


def test_aux_loss_of_a_padded_pass_counts_the_tokens_where_its_rows_ran_them():
    """A model whose attention takes no packed row runs each row with its tokens first (left padding moved after
    them): the routers' token weights follow, so the padding counts not at all."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_packing import grouped_batch

    from reinforge.engine.forward import packs_rows, response_log_probs, routed_token_weights

    model = tiny_moe("qwen3_moe", experts_implementation="grouped_mm", output_router_logits=True,
                     router_aux_loss_coef=0.01)
    batch = grouped_batch(num_prompts=2, samples=3)
    batch = batch.index([row for row in range(len(batch)) if batch["response_mask"][row].any()])
    assert not batch["attention_mask"][:, 0].all()  # rows with left padding
    padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], labels=batch["input_ids"]).aux_loss
    without_router_logits_output(model)
    assert not packs_rows(model)
    recorder = RouterRecorder(model)
    with recorder.recording_forward():
        response_log_probs(model, batch)
    recorded = recorder.take(with_grad=False, token_weights=routed_token_weights(model, batch))
    torch.testing.assert_close(recorded.aux_loss, padded, atol=1e-6, rtol=1e-6)


TINY_MOE_SHAPE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=32, moe_intermediate_size=32, head_dim=16, max_position_embeddings=128,
                      num_experts_per_tok=2, num_experts=4, num_local_experts=4, n_routed_experts=4, pad_token_id=0)
"""A tiny config of a family ``reinforge.models.tiny`` does not build (each family reads the keys it knows)."""


def tiny_family(model_type: str, **overrides):
    """A tiny model of any transformers MoE family; routers, experts and correction biases random (std 0.2, 1)."""
    config = AutoConfig.for_model(model_type, **{**TINY_MOE_SHAPE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("bias"):  # a router's correction bias, which changes the experts it chooses
                buffer.normal_(std=1.0)
    return model


@pytest.mark.parametrize("model_type", ["phimoe", "gpt_oss", "granitemoe", "ernie4_5_moe", "qwen2_moe", "minimax"])
def test_routers_of_any_name_record_transformers_aux_loss_over_a_padded_batch(model_type):
    """transformers' loss counts the top-k of the softmax of what its routers return, whichever experts they chose
    (Ernie 4.5's correction bias chooses others); the routing metrics count the chosen ones."""
    model = tiny_family(model_type, output_router_logits=True, router_aux_loss_coef=0.01)
    input_ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    expected = model(input_ids, attention_mask=attention_mask, labels=input_ids).aux_loss
    recorder, line = prepare_moe_training(model)
    assert recorder is not None and "grouped GEMMs" in line and "not reported" not in line
    assert model.config._experts_implementation == "grouped_mm" and recorder.routers
    with recorder.recording_forward():
        model(input_ids, attention_mask=attention_mask)
    recorded = recorder.take(with_grad=False, token_weights=attention_mask.reshape(-1).float())
    torch.testing.assert_close(recorded.aux_loss, expected, atol=1e-6, rtol=1e-6)
    assert recorded.expert_counts.shape[0] == len(recorder.routers)
    assert (recorded.expert_counts.sum(dim=1) == (12 + 7) * 2).all()  # each layer: top-2 slots of unpadded tokens
    assert recorded.load_imbalance >= 1.0


@pytest.mark.parametrize("model_type", ["phimoe", "gpt_oss"])
def test_a_sequence_classifiers_aux_loss_is_its_causal_lms(model_type):
    """A reward model's classifier computes no loss of its own: its routers' loss is its causal LM's, which the run
    trains (PhiMoE's counts the top-k of the softmax, not the experts its sparse mixer samples in training)."""
    from transformers import AutoModelForSequenceClassification

    model = tiny_family(model_type, output_router_logits=True, router_jitter_noise=0.5, num_hidden_layers=1, num_labels=1)
    classifier = AutoModelForSequenceClassification.from_config(model.config)
    classifier.model.load_state_dict(model.model.state_dict())
    input_ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    model.train()
    expected = model(input_ids, attention_mask=attention_mask, labels=input_ids).aux_loss
    recorder, line = prepare_moe_training(classifier.train())
    assert recorder.loss_form == "transformers" and "no aux loss can be trained" not in line
    with recorder.recording_forward():
        classifier(input_ids, attention_mask=attention_mask)
    recorded = recorder.take(with_grad=False, token_weights=attention_mask.reshape(-1).float())
    torch.testing.assert_close(recorded.aux_loss, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "jetmoe", "qwen2"])
def test_preparing_moe_training_walks_the_module_tree_once(monkeypatch, model_type):
    """A fused mixture of experts, an unfused one (JetMoE) and a dense model: one walk of the module tree each."""
    import sys

    from torch import nn

    model = tiny_moe(model_type) if model_type == "qwen3_moe" else tiny_family(model_type)
    walks = []
    modules = nn.Module.modules

    def counted(self):
        if self is model and sys._getframe(1).f_globals["__name__"] == "reinforge.engine.moe":
            walks.append(sys._getframe(1).f_code.co_name)
        return modules(self)

    monkeypatch.setattr(nn.Module, "modules", counted)
    recorder, line = prepare_moe_training(model)
    assert (recorder is not None) == (model_type == "qwen3_moe") and (line is None) == (model_type == "qwen2")
    assert len(walks) == 1, walks


def test_a_router_whose_choices_are_not_recorded_trains_without_metrics_and_refuses_an_aux_loss():
    """Llama 4's router returns (scores, logits), not the experts it chose: no metrics; no aux loss it can weigh."""
    model = tiny_family("llama4_text", intermediate_size_mlp=32)
    recorder, line = prepare_moe_training(model)
    assert recorder is None and "routing metrics are not reported" in line and "Llama4Router" in line
    with pytest.raises(ValueError, match=r"^actor.router_aux_loss_coef=0.01 asks .* Llama4ForCausalLM.* set actor"):
        router_aux_loss_coef(model.config, 0.01, "actor.router_aux_loss_coef")
    assert router_aux_loss_coef(model.config, 0.0, "actor.router_aux_loss_coef") == 0.0


def test_jetmoes_declared_weight_is_read_and_an_unrecorded_router_never_trains_a_weight_as_zero():
    """JetMoE names its weight aux_loss_coef and its experts are not fused: asked by its config, the loss is refused
    in one line, where it trained silently without one."""
    model = tiny_family("jetmoe", output_router_logits=True)
    recorder, line = prepare_moe_training(model)
    assert recorder is None and "not reported" in line
    assert router_aux_loss_coef(model.config, 0.0, "trainer.router_aux_loss_coef") == 0.0
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01 \(trainer.router_aux_loss_coef=None\) asks"):
        router_aux_loss_coef(model.config, None, "trainer.router_aux_loss_coef")
    qwen3 = tiny_family("qwen3_moe")  # a recorded family: the guard lets its weight through, and refuses it unrecorded
    assert trained_aux_loss_coef(qwen3, RouterRecorder(qwen3), 0.01, "actor.router_aux_loss_coef") == 0.01
    with pytest.raises(ValueError, match=r"^actor.router_aux_loss_coef=0.01 asks .* Qwen3MoeForCausalLM's routers are "
                                         r"not recorded .* set actor.router_aux_loss_coef=0"):
        trained_aux_loss_coef(qwen3, None, 0.01, "actor.router_aux_loss_coef")


def test_a_family_whose_router_scoring_is_unknown_reports_metrics_but_refuses_an_aux_loss(tmp_path):
    """GLM-4.5's routers choose by sigmoid scores and a correction bias, and transformers computes no loss for them:
    their balance metrics are the chosen experts', but no loss of theirs can be weighed; refused before weights
    load."""
    from reinforge.config import ConfigError
    from reinforge.config.schema import ModelConfig
    from reinforge.trainer.preflight import check_router_aux_loss_has_experts

    model = tiny_family("glm4_moe", first_k_dense_replace=0)
    recorder, line = prepare_moe_training(model)
    assert recorder is not None and recorder.loss_form is None and "no aux loss can be trained" in line
    with recorder.recording_forward():
        model(torch.randint(1, 64, (1, 8)))
    assert recorder.take(with_grad=False).load_imbalance >= 1.0
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="cannot compute Glm4MoeForCausalLM's"):
        check_router_aux_loss_has_experts("actor.router_aux_loss_coef", 0.01, ModelConfig(path=str(tmp_path)))
    check_router_aux_loss_has_experts("actor.router_aux_loss_coef", 0.0, ModelConfig(path=str(tmp_path)))
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.02  # the config asks
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.02"):
        check_router_aux_loss_has_experts("actor.router_aux_loss_coef", None, ModelConfig(path=str(tmp_path)))


def test_a_model_prepared_for_training_scores_packed_rows_whatever_its_output_router_logits():
    """DPO, reward-model training and the judge prepare their models with ``prepare_for_training`` alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_packing import grouped_batch

    from reinforge.engine.forward import response_log_probs
    from reinforge.engine.fused import prepare_for_training
    from reinforge.engine.packing import attach_plan

    model = tiny_moe("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.01)
    prepare_for_training(model, torch.device("cpu"))
    log_probs, _ = response_log_probs(model, attach_plan(grouped_batch(num_prompts=2, samples=2), share_prompts=True))
    assert torch.isfinite(log_probs).all() and model.config.output_router_logits  # the config itself is kept


def test_router_metrics_of_a_hand_built_routing():
    # layer 1: 4 tokens, top-2 over 4 experts; slots per expert 3, 3, 2, 0 -> max 3 over mean 2, one unused
    first = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 2]])
    # layer 2: slots 2, 2, 2, 2 -> balanced, none unused
    second = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    logits = [torch.zeros(4, 4), torch.zeros(4, 4)]
    outputs = router_outputs(logits, [first, second], with_grad=False)
    assert outputs.load_imbalance.item() == pytest.approx((1.5 + 1.0) / 2)
    assert outputs.unused_experts.item() == pytest.approx(0.5)
    # uniform router probabilities: aux = E x sum_e share_e x 1/E = sum of the top-k shares = top_k
    assert outputs.aux_loss.item() == pytest.approx(2.0)
    # one expert takes every probability and every first slot: E x (1/2) x 1 = 2 for a top-1 loss of 4 experts
    peaked = torch.tensor([[30.0, 0, 0, 0]]).repeat(4, 1)
    assert load_balancing_loss([peaked], top_k=1).item() == pytest.approx(4.0, rel=1e-6)


def _micro_batch() -> tuple[Batch, MiniBatchCounts]:
    mask = torch.ones(2, 3)
    micro = Batch.from_dict(tensors={"response_mask": mask, "advantages": torch.zeros(2, 3)})
    return micro, MiniBatchCounts(num_tokens=12.0, num_sequences=4.0, max_response_length=3)


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_aux_loss_reaches_the_gradient_only_when_its_weight_is_not_zero(coef):
    model = tiny_moe("qwen3_moe", experts_implementation="grouped_mm")
    recorder = RouterRecorder(model)
    input_ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    with recorder.recording_forward():
        logits = model(input_ids).logits
    router = recorder.take(with_grad=bool(coef))
    log_probs = torch.log_softmax(logits[0, :6].float(), -1)[:, 0].reshape(2, 3)
    micro, counts = _micro_batch()  # every advantage 0: the policy loss gives no gradient at all
    config = Config()
    loss, metrics = actor_loss(config, micro, counts, log_probs, torch.zeros(2, 3), True, router, coef)
    assert metrics["moe/aux_loss"].item() == pytest.approx(router.aux_loss.item() * 6 / 12)
    assert metrics["moe/load_imbalance"].item() >= 1.0
    loss.backward()
    router_grads = [router.weight.grad for router in recorder.routers]
    if coef:
        assert all(grad is not None and grad.abs().sum() > 0 for grad in router_grads)
    else:
        assert all(grad is None or grad.abs().sum() == 0 for grad in router_grads)


def test_aux_loss_weight_comes_from_the_model_config_unless_set():
    config = AutoConfig.for_model("qwen3_moe", router_aux_loss_coef=0.02, output_router_logits=False)
    assert router_aux_loss_coef(config, None) == 0.0
    config.output_router_logits = True
    assert router_aux_loss_coef(config, None) == 0.02
    assert router_aux_loss_coef(config, 0.0) == 0.0 and router_aux_loss_coef(config, 0.1) == 0.1
    # a vision-language model's text config asks, as transformers' Qwen3-VL-MoE forward reads it
    vision_language = AutoConfig.for_model("qwen3_vl_moe", text_config={"output_router_logits": True,
                                                                        "router_aux_loss_coef": 0.03})
    assert router_aux_loss_coef(vision_language, None) == 0.03
    batch = Batch.from_dict(tensors={"advantages": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)})
    assert no_grad_rows(Config(), batch) is not None
    assert no_grad_rows(Config(), batch, router_aux_loss_coef=0.02) is None  # the aux loss trains every row


@pytest.mark.parametrize("model_type, checkpointed", [(family, False) for family in MOE_FAMILIES]
                         + [("qwen3_moe", True)])
def test_actor_update_of_a_moe_model_logs_router_metrics(tmp_path, model_type, checkpointed):
    from reinforge.models import build_char_tokenizer
    from reinforge.models.export import save_hf_folder
    from reinforge.workers.actor_rollout import ActorRolloutWorker
    from tests.workers.test_actor_rollout import scored_batch

    tokenizer = build_char_tokenizer()
    model = tiny_moe(model_type, vocab_size=len(tokenizer), output_router_logits=True, router_aux_loss_coef=0.01)
    folder = save_hf_folder(model, tokenizer, tmp_path / "moe")
    config = Config()
    config.model.path, config.trainer.device = str(folder), "cpu"
    config.data.train_batch_size, config.actor.max_tokens_per_micro_batch = 3, 12
    config.model.gradient_checkpointing = checkpointed  # recomputed layers run their routers again
    worker = ActorRolloutWorker(config, total_training_steps=2)
    assert worker.router_aux_loss_coef == 0.01 and worker.model.config._experts_implementation == "grouped_mm"
    metrics = worker.update_actor(scored_batch())
    assert metrics["actor/moe/aux_loss"] > 0 and metrics["actor/moe/load_imbalance"] >= 1.0
    num_experts = worker.router_recorder.routers[0].weight.shape[0]
    assert 0 <= metrics["actor/moe/unused_experts"] < num_experts
    assert metrics["actor/grad_norm"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe", "deepseek_v3"])
def test_grouped_experts_on_cuda_in_bf16_match_the_loop(model_type):
    model = tiny_moe(model_type).cuda().to(torch.bfloat16)
    input_ids = torch.randint(0, 64, (1, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        looped = model(input_ids).logits.float()
        use_grouped_experts(model)
        grouped = model(input_ids).logits.float()
    torch.testing.assert_close(grouped, looped, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("device, backend", [
    pytest.param("cpu", "eager", marks=pytest.mark.slow), pytest.param("cuda", "inductor", marks=pytest.mark.gpu)])
def test_compiled_moe_layer_records_its_router_without_graph_breaks(device, backend):
    import torch._dynamo

    from reinforge.engine.fsdp import decoder_layers

    model = tiny_moe("qwen3_moe", experts_implementation="grouped_mm").to(device, torch.bfloat16)
    recorder = RouterRecorder(model)
    layer = decoder_layers(model)[0]
    hidden = torch.randn(1, 32, 64, device=device, dtype=torch.bfloat16)
    position_ids = torch.arange(32, device=device)[None]
    arguments = dict(position_embeddings=model.model.rotary_emb(hidden, position_ids), attention_mask=None,
                     position_ids=position_ids)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(hidden, **arguments)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(layer, backend=backend, dynamic=True)
    with recorder.recording_forward():
        compiled(hidden, **arguments)
    compiled(hidden, **arguments)  # not recording: nothing kept
    recorded = recorder.take(with_grad=False)
    assert recorded is not None and recorded.load_imbalance >= 1.0 and recorder.take(with_grad=False) is None


def test_recording_routers_compiles_one_graph_for_every_layer():
    """Each layer's hook keeps its router's outputs on the router, so the compiled layers, alike but for their
    weights, share one graph while recording (hooks appending to one list made dynamo guard on its length and items
    and compile each layer anew), and record what the uncompiled model does."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from reinforge.engine.fsdp import decoder_layers

    torch.manual_seed(0)
    model = tiny_moe("qwen3_moe", experts_implementation="grouped_mm", num_hidden_layers=3)
    recorder = RouterRecorder(model)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with recorder.recording_forward():
        model(input_ids, use_cache=False)
    expected = recorder.take(with_grad=False)
    torch._dynamo.reset()
    counters.clear()
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, backend="eager", dynamic=True)
    for _ in range(2):
        with recorder.recording_forward():
            model(input_ids, use_cache=False)
        got = recorder.take(with_grad=False)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        for name in ("aux_loss", "load_imbalance", "unused_experts"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name))


def test_reference_worker_scores_a_moe_model_whose_config_asks_for_router_logits(tmp_path):
    from reinforge.models import build_char_tokenizer
    from reinforge.models.export import save_hf_folder
    from reinforge.workers.reference import ReferenceWorker
    from tests.workers.test_actor_rollout import scored_batch

    tokenizer = build_char_tokenizer()
    model = tiny_moe("olmoe", vocab_size=len(tokenizer), output_router_logits=True, router_aux_loss_coef=0.01)
    config = Config()
    config.model.path, config.trainer.device = str(save_hf_folder(model, tokenizer, tmp_path / "moe")), "cpu"
    config.data.train_batch_size, config.actor.max_tokens_per_micro_batch = 3, 12
    log_probs = ReferenceWorker(config).compute_ref_log_prob(scored_batch())["ref_log_probs"]
    assert log_probs.shape == (3, 5) and torch.isfinite(log_probs).all()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_actor_update_of_a_moe_model_on_cuda_runs_grouped_and_compiled(model_type, tmp_path):
    from reinforge.models import build_char_tokenizer
    from reinforge.models.export import save_hf_folder
    from reinforge.workers.actor_rollout import ActorRolloutWorker
    from tests.workers.test_actor_rollout import scored_batch

    tokenizer = build_char_tokenizer()
    model = tiny_moe(model_type, vocab_size=len(tokenizer), output_router_logits=True, router_aux_loss_coef=0.01)
    config = Config()
    config.model.path, config.trainer.device = str(save_hf_folder(model, tokenizer, tmp_path / "moe")), "cuda"
    config.data.train_batch_size, config.actor.max_tokens_per_micro_batch = 3, 12
    config.model.gradient_checkpointing = False  # the compiled layers
    worker = ActorRolloutWorker(config, total_training_steps=2)
    assert worker.model.config._experts_implementation == "grouped_mm"
    first, second = worker.update_actor(scored_batch()), worker.update_actor(scored_batch())
    for metrics in (first, second):
        assert metrics["actor/moe/aux_loss"] > 0 and metrics["actor/moe/load_imbalance"] >= 1.0
        assert metrics["actor/grad_norm"] > 0 and metrics["perf/mfu/actor"] > 0


def test_pooled_routing_metrics_are_the_whole_batchs_not_a_mean_over_micro_batches():
    """Two micro-batches (or ranks) that each leave an expert unused, but not the same one: the batch uses all four."""
    from reinforge.engine.moe import pooled_routing_metrics

    first = router_outputs([torch.zeros(2, 4)], [torch.tensor([[0, 1], [0, 2]])], with_grad=False)
    second = router_outputs([torch.zeros(2, 4)], [torch.tensor([[3, 1], [3, 2]])], with_grad=False)
    assert first.unused_experts.item() == second.unused_experts.item() == 1.0  # the per-micro-batch mean says 1
    pooled = pooled_routing_metrics(first.expert_counts + second.expert_counts, "actor")
    assert pooled == {"actor/moe/load_imbalance": 1.0, "actor/moe/unused_experts": 0.0}


@pytest.mark.parametrize(("model_type", "dense", "routed"), [
    ("qwen3_moe", {"mlp_only_layers": [0, 1]}, {"mlp_only_layers": [1]}),
    ("qwen3_moe", {"decoder_sparse_step": 3}, {"decoder_sparse_step": 2}),
    ("deepseek_v3", {"first_k_dense_replace": 2, "num_key_value_heads": 4},
     {"first_k_dense_replace": 1, "num_key_value_heads": 4})])
def test_an_aux_loss_for_experts_no_layer_routes_to_is_refused_before_the_model_loads(tmp_path, model_type, dense,
                                                                                      routed):
    """A mixture-of-experts config whose every layer is dense: the weight is refused by preflight from config.json,
    and a loaded model's refusal says why there is no router (it pointed at a line above that was never printed)."""
    from reinforge.config import ConfigError
    from reinforge.config.schema import ModelConfig
    from reinforge.engine.moe import routed_layers
    from reinforge.trainer.preflight import check_router_aux_loss_has_experts

    model = tiny_family(model_type, num_hidden_layers=2, **dense)
    assert routed_layers(model.config) == 0
    assert routed_layers(tiny_family(model_type, num_hidden_layers=2, **routed).config) == 1
    assert prepare_moe_training(model) == (None, None)
    with pytest.raises(ValueError, match=r"^actor.router_aux_loss_coef=0.01 asks .* layers are all dense .* set actor"):
        trained_aux_loss_coef(model, None, 0.01, "actor.router_aux_loss_coef")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^actor.router_aux_loss_coef=0.01 .* model whose layers are all dense .* "
                                          r"set actor.router_aux_loss_coef=0$"):
        check_router_aux_loss_has_experts("actor.router_aux_loss_coef", 0.01, ModelConfig(path=str(tmp_path)))
    check_router_aux_loss_has_experts("actor.router_aux_loss_coef", 0.0, ModelConfig(path=str(tmp_path)))
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.02  # the config asks
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^the model config's router_aux_loss_coef=0.02 .* all dense"):
        check_router_aux_loss_has_experts("actor.router_aux_loss_coef", None, ModelConfig(path=str(tmp_path)))
