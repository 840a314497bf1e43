"""Sampling rules of runtime/sampling.py: greedy, repetition penalty, temperature, top-k, top-p, seeded draws."""

import torch
from hotneurons.runtime.sampling import Sampling, draw, sample


def test_sampling_rules():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert sample(logits, [], Sampling(), gen) == 1
    tied = torch.tensor([0.5, 2.0, 2.0, -1.0], dtype=torch.float16)  # greedy takes the first of equal maxima
    assert sample(tied, [], Sampling(), gen) == 1
    assert sample(logits, [1], Sampling(repetition_penalty=2.0), gen) == 2  # 3/2 < 2
    assert sample(logits, [], Sampling(temperature=5.0, top_k=1), gen) == 1
    assert sample(logits, [], Sampling(temperature=5.0, top_p=1e-6), gen) == 1
    draws = [sample(logits, [], Sampling(temperature=1.0, top_k=2), torch.Generator().manual_seed(s))
             for s in range(40)]
    assert set(draws) == {1, 2}
    again = [sample(logits, [], Sampling(temperature=1.0, top_k=2), torch.Generator().manual_seed(s))
             for s in range(40)]
    assert draws == again  # seeded


def test_draw_follows_the_distribution():
    """draw against the distribution it samples: 20k seeded draws from fresh random probabilities (zeros included)
    land in each bin at its probability within 4 standard deviations; a zero-probability bin is never drawn."""
    g = torch.Generator().manual_seed(7)
    probs = torch.rand(12, generator=g, dtype=torch.float64)
    probs[[0, 5, 11]] = 0.0
    probs /= probs.sum()
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs.float(), g) for _ in range(n)]), minlength=12).double()
    assert counts[[0, 5, 11]].sum() == 0
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 4 * sd + 1).all(), (counts, n * probs)
