"""The step rules of a running batch (``worker.schedule.step``): pure, on constructed views.

No Redis, no MLX, no monkeypatching: each rule is a function of a view of the batch and
the frozen config. The end-to-end behaviour these rules make (jobs joining, running
beside, preempting, the time share) is ``tests/test_interactive.py``'s.
"""

from __future__ import annotations

import dataclasses

import pytest

from schemas import keys
from worker.schedule.step import (
    BatchView,
    StepConfig,
    Waiting,
    joins,
    kept_rows,
    leavers,
    model_waits,
    owed_after_beside,
    owed_after_step,
    place_for_one,
    plan,
    preempt_for_room,
    preempted,
    prefill_budget,
    where,
)

CFG = StepConfig()
SINGLE = 0.1  # a step of one sequence, measured: 0.1 s


@pytest.mark.parametrize(
    ("decode_s", "step_s", "expected"),
    [
        (None, None, True),  # no step yet: it joins
        (None, 1.0, False),  # every step so far prefilled, each 10x a single one: beside
        (None, 0.15, True),  # ... each 1.5x: it joins
        (0.15, 1.0, True),  # steps that only decoded count once measured
        (1.0, 0.15, False),
    ],
)
def test_the_join_rule_counts_prefilling_steps_until_a_step_only_decodes(
    decode_s, step_s, expected
):
    """Early in a batch every step carries prompts: those steps stand for the batch's
    (joining on "nothing measured" sent 4 requests into a batch of 32 on a CPU: 14 s
    each, against 1.1 s beside it)."""
    view = BatchView(size=8, decode_s=decode_s, step_s=step_s, smallest_step_s=SINGLE)
    assert joins(view, CFG) is expected


def test_while_prompts_prefill_a_joiner_compares_the_steps_that_carry_them():
    prefilling = BatchView(size=8, step_s=0.15, prefill_steps=3, smallest_step_s=SINGLE)
    assert joins(prefilling, CFG)
    assert not joins(dataclasses.replace(prefilling, step_s=0.5), CFG)
    assert not joins(dataclasses.replace(prefilling, smallest_step_s=None), CFG)


def test_with_no_small_size_measured_it_runs_beside_except_in_a_group():
    view = BatchView(size=96, step_s=1.5, decode_s=1.5)
    assert not joins(view, CFG)
    assert joins(dataclasses.replace(view, in_group=True), CFG)  # (no side batch there)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_the_operators_choice_overrides_the_measured_rule(mode):
    cheap = BatchView(size=2, decode_s=SINGLE, smallest_step_s=SINGLE)
    dear = BatchView(size=96, decode_s=10.0, smallest_step_s=SINGLE)
    cfg = StepConfig(join_mode=mode)
    assert joins(cheap, cfg) is joins(dear, cfg) is (mode == "always")
    with pytest.raises(ValueError, match="join mode"):
        StepConfig(join_mode="sometimes")


def test_a_place_at_the_cap_is_taken_from_the_batch_down_to_its_floor():
    assert place_for_one(BatchView(size=7, cap=8, own=7), CFG) == "free"
    assert place_for_one(BatchView(size=8, cap=8, own=8), CFG) == "preempt"
    assert place_for_one(BatchView(size=8, cap=8, own=3), CFG) == "preempt"
    assert place_for_one(BatchView(size=8, cap=8, own=2), CFG) == "full"  # a quarter of 8
    assert place_for_one(BatchView(size=1, cap=1, own=1), CFG) == "full"  # at least one


def test_the_batch_job_that_joined_last_gives_its_place_up():
    # (False: an interactive job's row, or a streamed one: never preempted)
    assert preempted([True, True, False, True, False]) == 3
    assert preempted([True, False]) == 0
    assert preempted([True]) == 0


def test_the_token_budget_holds_only_while_someone_may_wait():
    """Prompt tokens a step may prefill: what the engine prefills in the budget's seconds
    at the speed it measured (1,000 tokens/s here)."""
    alone = BatchView(size=32, own=32, prefill_rate=1000.0)
    short, long = int(CFG.prefill_budget_s * 1000), int(CFG.quiet_budget_s * 1000)
    assert (short, long) == (500, 4000)
    assert prefill_budget(alone, CFG) == long
    assert prefill_budget(dataclasses.replace(alone, own=31), CFG) == short
    assert prefill_budget(dataclasses.replace(alone, beside=1), CFG) == short
    seen = dataclasses.replace(alone, since_ahead_s=CFG.quiet_s - 0.1)
    assert prefill_budget(seen, CFG) == short
    quiet = dataclasses.replace(alone, since_ahead_s=CFG.quiet_s + 0.1)
    assert prefill_budget(quiet, CFG) == long
    # no speed measured yet: 0 (the engine's least chunk per sequence)
    assert prefill_budget(dataclasses.replace(seen, prefill_rate=None), CFG) == 0
    whole = StepConfig(prefill_budget_s=None)  # (no budget at all: whole chunks)
    assert prefill_budget(seen, whole) is None


def test_work_beside_the_batch_leaves_it_its_floor_and_it_runs_a_little_ahead():
    owed = owed_after_beside(0.0, 3.0, CFG)  # 3 s beside: the batch is owed 1 s
    assert owed == pytest.approx(1.0)
    owed = owed_after_step(owed, 0.4, CFG)
    assert owed == pytest.approx(0.6)  # still owed: the next waits
    owed = owed_after_step(owed, 10.0, CFG)
    assert owed == -CFG.floor_credit_s  # ahead, up to the bound
    assert owed_after_beside(owed, 1.5, CFG) <= 0  # the next may run at once


def test_the_side_lane_steps_while_the_batch_is_owed_nothing_else_the_batch():
    both = BatchView(size=8, beside=2)
    assert plan(both, CFG).step == "side"
    assert plan(dataclasses.replace(both, owed=0.3), CFG).step == "batch"  # its floor
    # with the batch's lane empty the side lane steps whatever is owed
    assert plan(dataclasses.replace(both, size=0, owed=0.3), CFG).step == "side"
    assert plan(dataclasses.replace(both, beside=0, owed=-1.0), CFG).step == "batch"
    assert plan(BatchView(), CFG).step is None  # neither holds a job: the batch ends


def test_the_floor_gives_the_batch_a_quarter_of_the_time_under_a_flood():
    """Turns simulated with the plan and the floor's two rules: side steps of 0.1 s and
    batch steps of 0.3 s, for a minute of requests that never stop coming."""
    view, clock = BatchView(size=8, beside=4), {"batch": 0.0, "side": 0.0}
    owed = 0.0
    while sum(clock.values()) < 60:
        step = plan(dataclasses.replace(view, owed=owed), CFG).step
        assert step is not None
        took = 0.3 if step == "batch" else 0.1
        clock[step] += took
        owed = (
            owed_after_step(owed, took, CFG)
            if step == "batch"
            else owed_after_beside(owed, took, CFG)
        )
    share = clock["batch"] / sum(clock.values())
    assert CFG.batch_floor - 0.02 <= share <= CFG.batch_floor + 0.05, clock


def test_queues_ahead_are_looked_at_when_due_and_the_batch_is_owed_nothing():
    view = BatchView(size=8, ahead=True, look_due=True)
    assert plan(view, CFG).look
    assert not plan(dataclasses.replace(view, look_due=False), CFG).look
    assert not plan(dataclasses.replace(view, owed=0.1), CFG).look
    assert not plan(dataclasses.replace(view, ahead=False), CFG).look  # none, or stopping
    # the batch's prefill budget: only where it may be cut
    assert plan(view, CFG).budget is None
    budgeted = dataclasses.replace(view, budgeted=True, own=8, prefill_rate=100.0)
    assert plan(budgeted, CFG).budget == prefill_budget(budgeted, CFG) == 400


def test_a_job_for_another_model_waits_the_bound_except_on_the_interactive_queue():
    queues = [keys.INTERACTIVE_QUEUE, keys.DEFAULT_QUEUE, "other"]
    assert model_waits(queues, 30) == [0, 30_000, 30_000]
    assert model_waits(queues, 0) == [0, 0, 0]  # --model-wait 0: every queue in order


# the batch's views a waiting job meets: joining pays (a cheap step) or not (a dear one),
# with a place free, one to take from the batch, or none
CHEAP = BatchView(size=4, cap=8, own=4, decode_s=SINGLE, smallest_step_s=SINGLE)
DEAR = dataclasses.replace(CHEAP, decode_s=10 * SINGLE)
AT_CAP = dataclasses.replace(CHEAP, size=8, own=8)
AT_FLOOR = dataclasses.replace(CHEAP, size=8, own=2)


@pytest.mark.parametrize(
    ("view", "job", "expected"),
    [
        # joining pays and there is a place: it joins, taking one at the cap
        (CHEAP, Waiting(joinable=True, fits_beside=True, side_lane=True), "join"),
        (AT_CAP, Waiting(joinable=True, fits_beside=True, side_lane=True), "preempt"),
        # joining does not pay (or the batch keeps its floor): beside, batched if it can be
        (DEAR, Waiting(joinable=True, fits_beside=True, side_lane=True), "side"),
        (DEAR, Waiting(joinable=True, fits_beside=True, side_lane=False), "alone"),
        (AT_FLOOR, Waiting(joinable=True, fits_beside=True, side_lane=True), "side"),
        # another model's job never joins: beside when it fits, else after the batch
        (CHEAP, Waiting(joinable=False, fits_beside=True, side_lane=False), "alone"),
        (CHEAP, Waiting(joinable=False, fits_beside=False, side_lane=True), "wait"),
        # no room beside: joining, slower than beside, is still sooner than waiting
        (DEAR, Waiting(joinable=True, fits_beside=False, side_lane=True), "join"),
        (dataclasses.replace(DEAR, size=8, own=8), Waiting(True, False, True), "preempt"),
        (AT_FLOOR, Waiting(joinable=True, fits_beside=False, side_lane=True), "wait"),
    ],
)
def test_a_waiting_job_joins_runs_beside_or_waits(view, job, expected):
    """One decision per job taken from a queue ahead, from the view and what the runner
    found of the job (its key, whether its caches fit beside the batch's)."""
    assert where(view, job, CFG) == expected


def test_the_operators_join_choice_decides_where_too():
    job = Waiting(joinable=True, fits_beside=True, side_lane=True)
    assert where(DEAR, job, StepConfig(join_mode="always")) == "join"
    assert where(CHEAP, job, StepConfig(join_mode="never")) == "side"
    # "never" still joins a job that cannot run beside rather than keep it waiting
    cramped = Waiting(joinable=True, fits_beside=False, side_lane=True)
    assert where(CHEAP, cramped, StepConfig(join_mode="never")) == "join"


def test_under_memory_the_fewest_batch_rows_leave_for_a_job_ahead():
    """``freed[i]``: what the last i + 1 own rows leaving frees (they may not free in
    proportion: the batch's buffers are as long as its longest row)."""
    assert preempt_for_room(0, [10, 20]) == 0  # it fits: nobody leaves
    assert preempt_for_room(-5, []) == 0
    assert preempt_for_room(15, [10, 20, 40]) == 2
    assert preempt_for_room(10, [10, 20, 40]) == 1
    assert preempt_for_room(50, [10, 20, 40]) is None  # even all of them: it waits
    assert preempt_for_room(1, []) is None  # none may leave (the floor)


def test_memory_preemption_keeps_a_quarter_of_the_rows_the_batch_takes():
    assert kept_rows(BatchView(cap=8, limit=8), CFG) == 2
    assert kept_rows(BatchView(cap=256, limit=32), CFG) == 8  # auto: the measured limit
    assert kept_rows(BatchView(cap=2, limit=2), CFG) == 1  # at least one


def test_memory_is_given_up_by_the_own_rows_that_joined_last():
    # (False: a row from a queue ahead, or a streamed one)
    assert leavers([True, False, True, True, False, True], keep=2) == [5, 3]
    assert leavers([True, True], keep=2) == []
    assert leavers([False, True], keep=0) == [1]


@pytest.mark.parametrize(
    ("fields", "batch"),
    [
        ({"temperature": 0.9, "seed": 3}, True),  # its own key: the same draws in a batch
        ({"temperature": 0, "seed": 3}, True),
        ({"stream": True}, True),
        ({"n": 2}, True),  # n sequences of the batch
        ({"n": 2, "draft_model": "d"}, True),  # its choices decode plainly: a plain batch
        ({"n": 2, "seed": 3, "speculation": {"method": "prompt_lookup"}}, True),
        ({"temperature": 0.9, "seed": 3, "draft_model": "d"}, False),  # proposals vary
        ({"temperature": 0.9, "seed": 3, "speculation": {"method": "prompt_lookup"}}, False),
        ({"temperature": 0, "seed": 3, "draft_model": "d"}, True),  # greedy: no draws
    ],
)
def test_which_jobs_may_share_a_batch(fields, batch):
    from schemas import ChatRequest
    from worker.schedule.policy import SpeculationPolicy
    from worker.schedule.route import route

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    r = route(ChatRequest.model_validate(body), SpeculationPolicy("always"), 8)
    assert (r.batch is not None) is batch, r


def test_a_job_of_n_choices_joins_only_where_n_places_are_free():
    view = BatchView(size=6, cap=8, limit=8, own=6, step_s=0.1, decode_s=0.1)
    two, three = Waiting(True, True, False, 2), Waiting(True, True, False, 3)
    cfg = dataclasses.replace(CFG, join_mode="always")
    assert where(view, two, cfg) == "join"
    assert where(view, three, cfg) == "alone"  # it fits beside: not a preempt, not a wait
    assert where(view, dataclasses.replace(three, fits_beside=False), cfg) == "wait"
    full = dataclasses.replace(view, size=8)
    assert where(full, Waiting(True, True, False), cfg) == "preempt"  # one sequence: at the cap
    assert where(full, dataclasses.replace(two, fits_beside=False), cfg) == "wait"


def test_a_side_lane_per_key_up_to_the_configured_number():
    from worker.schedule.step import side_lane_free

    cfg = dataclasses.replace(CFG, side_lanes=2)
    assert side_lane_free([], "a", cfg) and side_lane_free(["a"], "b", cfg)
    assert side_lane_free(["a", "b"], "a", cfg)  # its key's lane is open
    assert not side_lane_free(["a", "b"], "c", cfg)  # a third key runs alone
    assert side_lane_free(["a"], None, cfg)  # a job that cannot be batched: a solo lane
    assert not side_lane_free(["a", "b"], None, cfg)  # (counted as one)


def test_solo_lanes_step_first_come_first_served_in_turn_with_keyed_ones():
    from worker.schedule.step import side_turn

    # two keyed lanes (0, 1) and three solo lanes: only the oldest solo (2) takes turns
    assert [side_turn(t, 2, 3) for t in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [side_turn(t, 0, 2) for t in range(3)] == [0, 0, 0]  # solos alone: the oldest
    assert [side_turn(t, 2, 0) for t in range(3)] == [0, 1, 0]
