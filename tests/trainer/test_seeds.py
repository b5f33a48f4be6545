"""One generation seed per step, the same in every mode: runs keep their samples across releases of reinforge."""

from reinforge.trainer.seeds import step_seed


def test_the_step_seed_is_pinned():
    assert [step_seed(0, 0), step_seed(0, 5), step_seed(2, 3)] == [0, 5, 2_000_009]


def test_no_two_steps_of_nearby_run_seeds_share_a_seed():
    seeds = [step_seed(seed, step) for seed in range(100) for step in range(1_000)]
    assert len(set(seeds)) == len(seeds)
