"""Which models beside the actor a config needs: a critic by the estimator (or critic.enable), a reference by KL."""

from reinforge.algorithms.roles import critic_enabled, reference_needed
from reinforge.config import load_config


def test_the_critic_follows_the_estimator_unless_critic_enable_says_otherwise():
    assert critic_enabled(load_config(None, ["algorithm.adv_estimator=gae"]))
    assert not critic_enabled(load_config(None, ["algorithm.adv_estimator=grpo"]))
    assert critic_enabled(load_config(None, ["algorithm.adv_estimator=grpo", "critic.enable=true"]))


def test_a_reference_is_needed_for_a_kl_loss_or_a_kl_penalty_in_the_reward():
    assert not reference_needed(load_config(None, []))
    assert reference_needed(load_config(None, ["actor.use_kl_loss=true"]))
    assert reference_needed(load_config(None, ["algorithm.use_kl_in_reward=true"]))
