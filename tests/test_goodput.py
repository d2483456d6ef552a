"""Choosing each round's k in a speculative batch from measured costs and acceptance."""

from __future__ import annotations

import random

import pytest

from worker.schedule.goodput import (
    PROBE_AFTER,
    START_ROUNDS,
    Acceptance,
    Goodput,
    PassCost,
    expected_tokens,
)


def test_pass_cost_is_a_line_through_what_was_measured():
    cost = PassCost()
    assert cost.predict(10) == 0.0
    cost.record(8, 0.080)
    assert cost.predict(40) == pytest.approx(0.080)  # one size: flat
    cost.record(40, 0.200)
    cost.record(24, 0.140)
    assert cost.predict(16) == pytest.approx(0.110, abs=0.005)
    assert cost.predict(56) == pytest.approx(0.260, abs=0.005)
    for _ in range(20):  # the machine slows down: the running average follows
        cost.record(8, 0.160)
    assert cost.seen[8] == pytest.approx(0.160, rel=0.01)


def test_acceptance_estimate_converges_to_the_per_token_rate():
    rng = random.Random(0)
    for p in (0.1, 0.5, 0.8):
        est = Acceptance()
        seen = []
        for _ in range(300):
            k = rng.choice((1, 2, 4, 6))
            a = 0
            while a < k and rng.random() < p:
                a += 1
            est.update(a, k)
            seen.append(est.rate(0.5))
        late = sum(seen[100:]) / len(seen[100:])
        assert late == pytest.approx(p, abs=0.12), p
    assert Acceptance().rate(0.3) == pytest.approx(0.3)  # nothing seen: the prior
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1


def _measured(g: Goodput, b: int, pass_s, draft_s: float, per_token: float = 0.0) -> None:
    """Costs: a target pass over n tokens takes pass_s(n); each draft pass draft_s."""
    for k in (0, 1, 3, g.cap):
        g.measured(b, k, k * draft_s, pass_s(b * (k + 1)), k * draft_s + pass_s(b * (k + 1)), 0)
    g.per_token = per_token


def _rows(p: float, b: int) -> list[Acceptance]:
    rows = []
    for _ in range(b):
        a = Acceptance()
        for _ in range(20):  # a rejection after p/(1-p) accepted tokens on average
            a.update(round(p / (1 - p)), 99)
        rows.append(a)
    return rows


def test_memory_bound_target_and_a_good_draft_draft_the_most():
    g = Goodput(6)
    _measured(g, 8, lambda n: 0.050 + 0.0001 * n, 0.002)  # weights dominate
    assert g.best(_rows(0.9, 8), [64] * 8) == 6


def test_compute_bound_target_never_drafts():
    # Every verified token costs as much as a plain step's: verifying k + 1 to emit
    # fewer than k + 1 never pays, whatever the acceptance.
    g = Goodput(6)
    _measured(g, 8, lambda n: 0.010 * n, 0.001)
    assert g.best(_rows(0.9, 8), [64] * 8) == 0


def test_this_cpu_like_costs_pick_a_middle_k_and_low_acceptance_plain():
    # About what the 12x1024 target measures here: 75 ms for 8 tokens, +3.3 ms a token.
    g = Goodput(6)
    _measured(g, 8, lambda n: 0.048 + 0.0033 * n, 0.0015)
    mid = g.best(_rows(0.85, 8), [64] * 8)
    assert 1 <= mid < 6
    assert g.best(_rows(0.2, 8), [64] * 8) == 0  # a draft that is mostly wrong
    assert g.best(_rows(0.85, 8), [1] * 8) == 0  # one token left each: nothing to gain
    assert g.best(_rows(0.85, 2), [64] * 2) > mid  # fewer rows: the weights dominate more


def test_it_measures_both_ends_first_and_probes_the_draft_while_plain():
    g = Goodput(4)
    rows, left = _rows(0.0, 2), [50, 50]
    for _ in range(START_ROUNDS):  # nothing measured: the most, a few rounds
        assert g.choose(rows, left) == 4
        g.measured(2, 4, 0.004, 0.050, 0.060, 2)
    assert g.choose(rows, left) == 0  # then plain, the other end
    g.measured(2, 0, 0.0, 0.020, 0.025, 2)
    ks = []
    for _ in range(2 * PROBE_AFTER + 2):
        ks.append(g.choose(rows, left))
    assert ks.count(1) == 2 and set(ks) == {0, 1}  # a draft that never agrees: plain,
    first = ks.index(1)  # with one probe after every PROBE_AFTER plain rounds
    assert ks.index(1, first + 1) - first == PROBE_AFTER + 1


def test_the_pairs_measured_acceptance_is_the_starting_prior():
    assert Goodput(4, prior=0.9).pooled.rate(0.5, weight=0) == pytest.approx(0.9)
    assert Goodput(4).pooled.rate(0.1, weight=0) == pytest.approx(0.5)
    g = Goodput(4, prior=0.9)
    for _ in range(30):  # the batch's own rounds take over: 1 accepted, then rejected
        g.pooled.add(8, 8)
    assert g.pooled.rate(0.9, weight=0) == pytest.approx(0.5, abs=0.03)
