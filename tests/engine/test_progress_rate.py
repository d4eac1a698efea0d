"""A long count said with its rate and time left (``progress.StepRate``, ``rated``), on a fake clock: the CLI's stderr
lines and the app's bar read the same words."""

from __future__ import annotations

from kvscope.engine.progress import StepRate, rated


class FakeClock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_and_time_left_are_measured_from_the_first_report():
    clock = FakeClock()
    rate = StepRate("token pass: requests", clock)
    assert rate.words(1_000, 100_000) == "token pass: requests: 1,000/100,000"  # the first report: nothing measured yet
    clock.now += 4.0
    # 4,000 more requests in 4 s: 1,000 a second; 95,000 left: 95 s
    assert rate.words(5_000, 100_000) == "token pass: requests: 5,000/100,000 · 1,000 requests/s · about 1 min 35 s left"
    clock.now += 90.0
    # 99,000 requests in 94 s since the first report: 1,053.2 a second; nothing left, so no time left said
    assert rate.words(100_000, 100_000) == "token pass: requests: 100,000/100,000 · 1,053 requests/s"


def test_a_slow_count_keeps_a_decimal_and_hours_read_as_hours():
    clock = FakeClock()
    rate = StepRate("audit steps", clock)
    rate.words(0, 10_000)
    clock.now += 4.0
    assert rate.words(10, 10_000) == "audit steps: 10/10,000 · 2.5 steps/s · about 1 h 06 min left"  # 9,990 / 2.5 = 3,996 s


def test_the_last_moments_read_as_under_a_second():
    clock = FakeClock()
    rate = StepRate("rewrite: requests", clock)
    rate.words(1, 4)
    clock.now += 0.3
    assert rate.words(3, 4) == "rewrite: requests: 3/4 · 6.7 requests/s · under 1 s left"  # 1 left at 6.7 a second: 0.15 s


def test_the_rate_follows_a_pass_that_slows_down():
    clock = FakeClock()
    rate = StepRate("token pass: requests", clock, window=2)
    rate.words(0, 1_000)
    for done in (100, 200):  # 100 a second
        clock.now += 1.0
        rate.words(done, 1_000)
    for done in (210, 220):  # then 10 a second: the last two reports alone set the rate
        clock.now += 1.0
        said = rate.words(done, 1_000)
    assert said == "token pass: requests: 220/1,000 · 10 requests/s · about 1 min 18 s left"


def test_no_time_passed_or_no_step_done_says_the_count_alone():
    clock = FakeClock()
    rate = StepRate("token pass: requests", clock)
    rate.words(10, 50)
    assert rate.words(20, 50) == "token pass: requests: 20/50"  # the clock did not move
    clock.now += 1.0
    assert rate.words(10, 50) == "token pass: requests: 10/50"  # no step since the first report


def test_rated_passes_the_words_and_the_count_on():
    clock, said = FakeClock(), []
    progress = rated("token pass: requests", lambda text, done, total: said.append((text, done, total)), clock)
    progress(2, 8)
    clock.now += 2.0
    progress(6, 8)
    assert said == [("token pass: requests: 2/8", 2, 8), ("token pass: requests: 6/8 · 2.0 requests/s · about 1 s left", 6, 8)]
