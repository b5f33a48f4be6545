"""rollout.noise: seeded Gumbel noise, a pure function of (sample seed, position, column)."""

from __future__ import annotations

import math

import torch

from reinforge.rollout.noise import gumbel_noise, noise_keys, sample_seed, uniform_from_bits


def test_noise_is_gumbel_distributed():
    noise = gumbel_noise(noise_keys([7, 8], [0, 0]), 200_000)
    assert noise.shape == (2, 200_000) and noise.dtype == torch.float32 and torch.isfinite(noise).all()
    for row in noise.double():  # Gumbel(0, 1): mean is Euler's constant, variance pi^2 / 6
        assert abs(float(row.mean()) - 0.5772) < 0.01
        assert abs(float(row.var()) - math.pi ** 2 / 6) < 0.03


def test_a_rows_noise_depends_on_its_seed_and_position_alone():
    seeds, positions = [3, 2**63 - 1, 11, 3], [5, 10**6, 0, 6]  # the largest seed wraps around 64 bits
    together = gumbel_noise(noise_keys(seeds, positions), 512)
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        assert torch.equal(together[row], gumbel_noise(noise_keys([seed], [position]), 512)[0])
    assert not torch.equal(together[0], together[3])  # the next position draws anew


def test_sample_seeds_are_stable_and_distinct():
    assert sample_seed(1234, 0) == sample_seed(1234, 0)
    seeds = {sample_seed(request, index) for request in range(50) for index in range(8)}
    assert len(seeds) == 400 and all(0 <= seed < 2**63 for seed in seeds)


def test_no_hash_gives_a_uniform_of_0_or_1():
    """The extreme hashes map strictly inside (0, 1): a uniform of 1 would be +inf noise, a token drawn whatever
    its probability (once in 2^24 columns, about once per hundred draws from a 150k vocabulary)."""
    bits = torch.tensor([0, 1, 2**31, 2**32 - 2**9, 2**32 - 1], dtype=torch.int64)
    uniform = uniform_from_bits(bits)
    assert float(uniform.min()) > 0.0 and float(uniform.max()) < 1.0
    assert torch.isfinite(-torch.log(-torch.log(uniform))).all()
    top = torch.arange(2**32 - 2**12, 2**32, dtype=torch.int64)  # the largest hashes: distinct values below 1
    assert float(uniform_from_bits(top).max()) == 1.0 - 2.0 ** -24
