"""The upload backlog: newest first, retries after a backoff, done stays done."""

from __future__ import annotations

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_sidecar.backlog import Backlog
from jitckpt_sidecar.staging import Staged


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def staged(step: int, created_at: float = 500.0, save_id: str = "") -> Staged:
    manifest = m.Manifest(
        step, "periodic", 0, 1, 1, (m.FileEntry("a", 1),), created_at, save_id=save_id
    )
    return Staged(f"/x/staging/checkpoint-{step}", manifest)


def test_the_newest_waiting_checkpoint_is_taken_first():
    """Offered 10, 30, 20: taken 30, then 20, then 10."""
    backlog = Backlog(FakeClock())
    for step in (10, 30, 20):
        assert backlog.offer(staged(step))
    order = []
    while (item := backlog.take(timeout=0)) is not None:
        order.append(item.step)
        backlog.done(item)
    assert order == [30, 20, 10]


def test_a_checkpoint_offered_during_an_upload_goes_next():
    """While 20 is in flight, 40 arrives: after 20 comes 40, then the older 10."""
    backlog = Backlog(FakeClock())
    backlog.offer(staged(10))
    backlog.offer(staged(20))
    first = backlog.take(timeout=0)
    assert first is not None
    backlog.offer(staged(40))
    backlog.done(first)
    assert [backlog.take(timeout=0).step, backlog.waiting()[0].step] == [40, 10]


def test_offers_of_queued_in_flight_or_done_checkpoints_are_ignored():
    """The same staged checkpoint is never queued twice nor again after its upload."""
    backlog = Backlog(FakeClock())
    assert backlog.offer(staged(10))
    assert not backlog.offer(staged(10))
    item = backlog.take(timeout=0)
    assert not backlog.offer(staged(10))
    backlog.done(item)
    assert not backlog.offer(staged(10))
    assert backlog.offer(staged(10, created_at=999.0))  # re-staged by a new commit


def test_a_failed_checkpoint_waits_out_its_backoff_while_others_go():
    """A retry after 5 s is not handed out before then; an older one goes meanwhile."""
    clock = FakeClock()
    backlog = Backlog(clock)
    backlog.offer(staged(10))
    backlog.offer(staged(20))
    failed = backlog.take(timeout=0)
    backlog.retry(failed, 5.0)
    assert backlog.take(timeout=0).step == 10
    backlog.done(staged(10))
    assert backlog.take(timeout=0) is None
    clock.now += 5.0
    assert backlog.take(timeout=0).step == 20


def test_queue_length_and_lag_count_waiting_and_in_flight():
    """Length counts every checkpoint not yet in S3; lag is the newest one's age, 0 when none."""
    backlog = Backlog(FakeClock())
    assert (len(backlog), backlog.lag(now=600.0), backlog.idle()) == (0, 0.0, True)
    backlog.offer(staged(10, created_at=500.0))
    backlog.offer(staged(20, created_at=550.0))
    backlog.take(timeout=0)
    assert (len(backlog), backlog.lag(now=600.0), backlog.idle()) == (2, 50.0, False)


def test_a_paused_store_hands_out_nothing_then_the_newest_first():
    """While the store is paused (its failure) nothing goes; then the newest, whatever order
    the failed ones came back in."""
    clock = FakeClock()
    backlog = Backlog(clock)
    for step in (10, 20, 30):
        backlog.offer(staged(step))
    failed = backlog.take(timeout=0)
    backlog.retry(failed, 0.0)
    backlog.pause(8.0)
    backlog.offer(staged(40))
    assert backlog.take(timeout=0) is None
    clock.now += 8.0
    order = []
    while (item := backlog.take(timeout=0)) is not None:
        order.append(item.step)
        backlog.done(item)
    assert order == [40, 30, 20, 10]


def test_the_drain_cuts_pauses_and_backoffs_short():
    """hurry(1) lets a store paused for a minute and a checkpoint backed off for a minute go
    within a second."""
    clock = FakeClock()
    backlog = Backlog(clock)
    backlog.offer(staged(10))
    backlog.offer(staged(20))
    backlog.retry(backlog.take(timeout=0), 60.0)
    backlog.pause(60.0)
    backlog.hurry(1.0)
    assert backlog.take(timeout=0) is None
    clock.now += 1.0
    assert backlog.take(timeout=0).step == 20


def test_oldest_age_is_the_age_of_the_oldest_pending_checkpoint():
    """Through an outage the oldest pending checkpoint ages while the newest stays young."""
    backlog = Backlog(FakeClock())
    assert backlog.oldest_age(now=600.0) == 0.0
    backlog.offer(staged(10, created_at=100.0))
    backlog.offer(staged(20, created_at=590.0))
    backlog.take(timeout=0)
    assert (backlog.oldest_age(now=600.0), backlog.lag(now=600.0)) == (500.0, 10.0)


def test_another_save_of_a_waiting_step_takes_its_place():
    """Save A of 50 waits to retry when save B of 50 is staged: B goes, A is never handed out."""
    backlog = Backlog(FakeClock())
    a, b = staged(50, save_id="a"), staged(50, created_at=600.0, save_id="b")
    backlog.offer(a)
    backlog.retry(backlog.take(timeout=0), 30.0)
    assert backlog.offer(b)
    assert backlog.take(timeout=0) is b
    backlog.done(b)
    assert backlog.take(timeout=0) is None
    assert not backlog.offer(b)


def test_another_save_of_the_step_in_flight_replaces_it_and_goes_next():
    """B offered while A of the same step is in flight: A is `replaced` (its upload stops), a
    retry of A does not queue it again, and B goes next."""
    backlog = Backlog(FakeClock())
    a, b = staged(50, save_id="a"), staged(50, created_at=600.0, save_id="b")
    backlog.offer(a)
    flying = backlog.take(timeout=0)
    assert not backlog.replaced(flying)
    assert backlog.offer(b)
    assert backlog.replaced(flying)
    backlog.retry(flying, 0.0)
    assert backlog.take(timeout=0) is b
    assert not backlog.replaced(b)


def test_a_dropped_save_leaves_the_queue_and_frees_the_worker():
    """A save whose staged directory holds another save by now is dropped: nothing of it is
    handed out again, and the next checkpoint can go."""
    backlog = Backlog(FakeClock())
    a = staged(50, save_id="a")
    backlog.offer(a)
    backlog.offer(staged(40, save_id="c"))
    backlog.drop(backlog.take(timeout=0))
    assert backlog.take(timeout=0).step == 40
    assert backlog.offer(a)  # offered again by a scan: it is not done
