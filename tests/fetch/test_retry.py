"""The fetch layer's retry policy (bootseer/fetch/retry.py), the arithmetic the engine and the registry share."""

from __future__ import annotations

import math

import pytest

from bootseer.fetch.retry import RetryPolicy, is_permanent
from bootseer.fetch.source import Changed, NotADirectory, NotFound, PermanentError, TransientError


def test_permanent_answers_are_not_retried_and_everything_else_is_until_the_deadline():
    policy = RetryPolicy(timeout=10)
    for exc in (NotFound("x"), NotADirectory("x"), PermanentError("x"), Changed("x")):
        assert is_permanent(exc) and policy.gives_up(exc, 1, 100.0, 100.0)
    for exc in (TransientError("x"), OSError("reset"), TimeoutError("slow"), RuntimeError("bug")):
        assert not is_permanent(exc)
        assert not policy.gives_up(exc, 50, 100.0, 109.9)
        assert policy.gives_up(exc, 1, 100.0, 110.0)


def test_a_zero_timeout_means_one_attempt_with_no_deadline_of_its_own():
    policy = RetryPolicy(timeout=0)
    assert policy.deadline(5.0) == math.inf
    assert policy.gives_up(TransientError("x"), 1, 5.0, 5.0)


def test_max_attempts_bounds_the_attempts_within_the_deadline():
    policy = RetryPolicy(timeout=60, max_attempts=3)
    assert not policy.gives_up(TransientError("x"), 2, 0.0, 1.0)
    assert policy.gives_up(TransientError("x"), 3, 0.0, 1.0)


def test_the_backoff_doubles_with_jitter_up_to_its_cap_and_never_waits_past_the_deadline():
    policy = RetryPolicy(timeout=60, first_delay=0.05, max_delay=2.0)
    for attempts, cap in ((1, 0.05), (2, 0.1), (3, 0.2), (6, 1.6), (7, 2.0), (30, 2.0)):
        delays = [policy.delay(attempts) for _ in range(200)]
        assert all(cap / 2 <= d <= cap for d in delays), (attempts, min(delays), max(delays))
        assert max(delays) - min(delays) > 0  # jittered: callers that failed together spread out
    assert policy.wait(30, first_attempt=0.0, now=59.5) <= 0.5
    assert policy.wait(30, first_attempt=0.0, now=61.0) == 0.0


@pytest.mark.parametrize("fields", [{"timeout": -1}, {"max_attempts": 0}, {"first_delay": 0},
                                    {"first_delay": 3, "max_delay": 2}])
def test_a_policy_that_makes_no_sense_is_refused(fields):
    with pytest.raises(ValueError):
        RetryPolicy(**fields)
