"""The pull schedule of one destination (tenplex.transform.schedule): every source busy at once, different
destinations starting at different sources, replicas taking over queued pieces, failed sources given nothing."""

from tenplex.transform.schedule import LOCAL, Pull, Schedule


def _pieces(source, n, replicas=(), nbytes=10):
    return [Pull(source, nbytes, lambda server: None, frozenset(replicas)) for _ in range(n)]


def test_streams_spread_over_sources_and_destinations_start_apart():
    pieces = _pieces("h0", 4) + _pieces("h1", 4)  # h0's pieces all come first, as a plan lists them
    first = Schedule(pieces, start=0)
    assert [first.take()[1] for _ in range(4)] == ["h0", "h1", "h0", "h1"]
    second = Schedule(pieces, start=1)
    assert [second.take()[1] for _ in range(4)] == ["h1", "h0", "h1", "h0"]


def test_the_source_with_fewest_pulls_in_flight_goes_next():
    schedule = Schedule(_pieces("h0", 3) + _pieces("h1", 3) + _pieces(LOCAL, 1))
    taken = [schedule.take()[1] for _ in range(3)]
    assert sorted(taken) == sorted([LOCAL, "h0", "h1"])
    schedule.done("h1")
    assert schedule.take()[1] == "h1"


def test_an_idle_replica_takes_over_the_end_of_a_busy_queue():
    slow = _pieces("h0", 5, replicas={"h1"})
    schedule = Schedule(slow + _pieces("h1", 1))
    assert schedule.take() == (slow[0], "h0")
    own = schedule.take()
    assert own[1] == "h1" and own[0] not in slow
    schedule.done("h1")
    assert schedule.take() == (slow[4], "h1")  # stolen from the end; h0 keeps working from the front
    # both have one pull in flight: h0 ranks first and takes its own front, then h1 steals again from the end
    assert schedule.take() == (slow[1], "h0")
    assert schedule.take() == (slow[3], "h1")


def test_failed_sources_get_nothing_and_replicas_take_their_queue():
    failed = {"h0"}
    stranded = _pieces("h0", 1)
    held = _pieces("h0", 2, replicas={"h1"})
    schedule = Schedule(held + stranded, failed=lambda h: h in failed)
    got = [schedule.take() for _ in range(3)]
    assert [server for _, server in got[:2]] == ["h1", "h1"] and {p for p, _ in got[:2]} == set(held)
    assert got[2] == (stranded[0], "h0")  # no replica: run as planned, where the reader falls back or fails
    assert schedule.take() is None


def test_a_destination_queues_its_small_region_batches_before_its_large_pulls():
    from tenplex.box import Box
    from tenplex.transform.progress import Counters
    from tenplex.transform.staging import _Work, _queue_batches

    class _NoReplicas:  # the batch's regions are held by their planned source only
        def holders(self, tensor, box):
            return {}

    class _Target:
        itemsize = 4

    work = _Work()
    work.pulls = _pieces("h1", 2, nbytes=16 << 20)  # large pulls, queued while the shards were indexed
    work.small = {"h1": [("h1/0", "bias", Box((i,), (1,)), _Target()) for i in range(3)]}
    _queue_batches(work, _NoReplicas(), Counters(lambda message: None), None)
    assert [p.nbytes for p in work.pulls] == [12, 16 << 20, 16 << 20]
    assert Schedule(work.pulls).take()[0] is work.pulls[0]  # so the batch is the first pull from h1


def test_local_copies_take_one_stream_while_pulls_wait():
    schedule = Schedule(_pieces(LOCAL, 3) + _pieces("h0", 2))
    assert sorted(schedule.take()[1] for _ in range(3)) == sorted([LOCAL, "h0", "h0"])  # h0's queue is now empty
    assert schedule.take()[1] == LOCAL  # nothing waits for a link any more: local copies may use every stream
