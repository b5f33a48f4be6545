"""verl's key table: every key of verl's PPO trainer is translated or explained, and each translation names ours."""

from pathlib import Path

from reinforge.config import schema_keys
from reinforge.config.verl.keys import VERL_KEYS, NoEquivalent, Rename, SameAsOurs, lookup
from reinforge.config.verl.translate import translate_verl

VERL_KEY_NAMES = (Path(__file__).parent / "verl_ppo_trainer_keys.txt").read_text().split()
"""Every key of verl's ppo_trainer.yaml (its generated flat copy, at the commit the table was written from)."""


def test_every_key_of_verl_ppo_trainer_is_translated_or_explained():
    assert len(VERL_KEY_NAMES) > 400
    unexplained = [key for key in VERL_KEY_NAMES if lookup(key) is None]
    assert unexplained == []


def test_every_key_verl_0_9_1_added_is_translated_or_explained():
    """Keys of verl 0.9.1's ppo_trainer.yaml and ppo_megatron_trainer.yaml missing from the list above."""
    added = (Path(__file__).parent / "verl_0_9_1_trainer_keys.txt").read_text().split()
    assert len(added) > 300
    assert [key for key in added if lookup(key) is None] == []


def test_every_key_of_verl_0_9_1_veomni_and_torchtitan_engines_is_translated_or_explained():
    """Keys of verl 0.9.1's ppo_veomni_trainer.yaml and ppo_torchtitan_trainer.yaml (what model_engine=veomni or
    torchtitan loads) missing from the two lists above."""
    added = (Path(__file__).parent / "verl_0_9_1_engine_keys.txt").read_text().split()
    assert len(added) > 200
    assert [key for key in added if lookup(key) is None] == []


def test_every_translation_names_a_key_of_our_schema():
    ours = schema_keys()
    for verl_key, entry in VERL_KEYS.items():
        assert isinstance(entry, Rename | NoEquivalent | SameAsOurs)
        if isinstance(entry, Rename):
            target = entry.ours.removesuffix(".*")
            assert target in ours, f"{verl_key} -> {entry.ours}, which our schema lacks"


def test_no_verl_key_is_left_untranslated_when_our_schema_has_its_name():
    """A guard for new features: when our schema gains verl's key under the same name, the table must map it."""
    ours = schema_keys()
    prefixes = {"actor_rollout_ref.actor.": "actor.", "actor_rollout_ref.rollout.": "rollout.",
                "actor_rollout_ref.model.": "model.", "actor_rollout_ref.ref.": "ref."}
    stale = []
    for key in {*VERL_KEY_NAMES, *(name for name in VERL_KEYS if not name.endswith(".*"))}:
        _, entry = lookup(key)
        if isinstance(entry, NoEquivalent | SameAsOurs):
            renamed = next((ours_prefix + key[len(prefix):] for prefix, ours_prefix in prefixes.items()
                            if key.startswith(prefix)), key)
            if renamed in ours:
                stale.append(f"{key} -> {renamed}")
    assert stale == []


def test_verls_schedules_translate_to_schedules_of_reinforge():
    from reinforge.config.verl.keys import VERL_SCHEDULES
    from reinforge.engine.optim import LR_SCHEDULES

    assert set(VERL_SCHEDULES.values()) <= set(LR_SCHEDULES)
    assert translate_verl(["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"]).tree["actor"]["optim"] == {
        "schedule": "cosine"}

