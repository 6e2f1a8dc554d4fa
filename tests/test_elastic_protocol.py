"""The in-place protocol as a state machine and its pure decisions (tenplex.elastic.protocol): no processes."""

from __future__ import annotations

import itertools

import pytest

from tenplex.elastic.protocol import (TRANSITIONS, Event, Generation, Keys, Liveness, Member, ProtocolError, State,
                                      Worker, change_wanted, last_call_over, node_order, overdue, propose,
                                      ready_to_propose, reasons, warming_up)


def _walk(*events: Event) -> Worker:
    w = Worker()
    for e in events:
        w.on(e)
    return w


def test_the_documented_sequences_reach_their_states():
    start = (Event.REGISTERED, Event.PUBLISHED_IN, Event.FORMED)
    assert _walk(*start).state == State.TRAINING
    # a planned change: agree, drain, wait warm, next generation, train again
    planned = _walk(*start, Event.CHANGE_AGREED, Event.DRAINED, Event.PUBLISHED_IN, Event.FORMED)
    assert planned.state == State.TRAINING
    assert [h[2] for h in planned.history] == [State.WARM, State.FORMING, State.TRAINING, State.DRAINING,
                                               State.WARM, State.FORMING, State.TRAINING]
    assert _walk(*start, Event.PEER_LOST, Event.DRAINED).state == State.WARM
    # a second failure while draining, and while forming: one more change, never a dead end
    assert _walk(*start, Event.CHANGE_AGREED, Event.PEER_LOST, Event.DRAINED).state == State.WARM
    assert _walk(Event.REGISTERED, Event.PUBLISHED_IN, Event.FORM_FAILED, Event.PUBLISHED_IN,
                 Event.FORMED).state == State.TRAINING
    assert _walk(*start, Event.CHANGE_AGREED, Event.LEFT).state == State.LEAVING
    assert _walk(*start, Event.FINISHED).state == State.DONE
    # left out of a generation: stay warm for the next one
    assert _walk(Event.REGISTERED, Event.PUBLISHED_OUT, Event.PUBLISHED_IN).state == State.FORMING


def test_every_state_is_reachable_and_every_non_terminal_state_can_reach_training_or_an_end():
    reachable, frontier = {State.STARTING}, [State.STARTING]
    while frontier:
        s = frontier.pop()
        for (a, _), b in TRANSITIONS.items():
            if a == s and b not in reachable:
                reachable.add(b)
                frontier.append(b)
    assert reachable == set(State)
    terminal = {State.LEAVING, State.DONE}
    for s in set(State) - terminal:
        seen, todo = {s}, [s]
        while todo:
            x = todo.pop()
            for (a, _), b in TRANSITIONS.items():
                if a == x and b not in seen:
                    seen.add(b)
                    todo.append(b)
        assert State.TRAINING in seen or seen & terminal, s
    assert not [k for k in TRANSITIONS if k[0] in terminal]


@pytest.mark.parametrize("state,event", [(s, e) for s, e in itertools.product(State, Event)
                                         if (s, e) not in TRANSITIONS][:12])
def test_an_event_the_state_does_not_allow_is_refused_with_what_is_allowed(state, event):
    w = Worker()
    w.state = state
    with pytest.raises(ProtocolError, match=f"event '{event.value}' in state '{state.value}'"):
        w.on(event)
    assert w.state == state


def test_every_pair_outside_the_table_is_refused():
    for state, event in itertools.product(State, Event):
        w = Worker()
        w.state = state
        if (state, event) in TRANSITIONS:
            assert w.on(event) == TRANSITIONS[(state, event)]
        else:
            with pytest.raises(ProtocolError):
                w.on(event)


def _members(*spec: tuple[int, str, int]) -> dict[int, Member]:
    return {w: Member(w, h, lr, 1000 + w) for w, h, lr in spec}


def test_node_order_keeps_hosts_consecutive_and_in_their_old_order():
    previous = Generation(3, (4, 5, 0, 1), hosts=("h1", "h1", "h0", "h0"))
    members = _members((0, "h0", 0), (1, "h0", 1), (5, "h1", 1), (4, "h1", 0), (7, "h2", 0), (6, "h2", 1))
    assert node_order(previous, members) == (4, 5, 0, 1, 7, 6)   # h1 as before, h0, the new h2 by local rank
    assert node_order(None, members) == (0, 1, 4, 5, 7, 6)       # first generation: hosts by first worker id


def test_reasons_name_each_kind_of_change():
    prev = Generation(1, (0, 1, 2), hosts=("h0", "h1", "h2"))
    assert reasons(None, {0}, set()) == ("start",)
    assert reasons(prev, {0, 1, 2, 3}, set()) == ("join",)
    assert reasons(prev, {0, 1}, {2}) == ("leave",)
    assert reasons(prev, {0, 1}, set()) == ("lost",)
    assert reasons(prev, {0, 3}, {2}) == ("join", "leave", "lost")


def test_a_proposal_waits_for_every_expected_worker_unless_it_left_or_died():
    prev = Generation(2, (0, 1, 2), hosts=("h0", "h1", "h2"))
    registered = {0, 1, 2, 3}
    assert not ready_to_propose(prev, registered, arrived={0, 1}, leaving=set(), dead=set())
    assert not ready_to_propose(prev, registered, arrived={0, 1, 3}, leaving=set(), dead=set())
    assert ready_to_propose(prev, registered, arrived={0, 1, 3}, leaving=set(), dead={2})
    assert ready_to_propose(prev, registered, arrived={0, 1, 3}, leaving={2}, dead=set())
    # the first generation waits for min_workers; later ones go on with whoever survived
    assert not ready_to_propose(None, {0, 1}, arrived={0, 1}, leaving=set(), dead=set(), min_workers=3)
    assert ready_to_propose(None, {0, 1, 2}, arrived={0, 1, 2}, leaving=set(), dead=set(), min_workers=3)
    assert not ready_to_propose(prev, {0, 1, 2}, arrived=set(), leaving=set(), dead={0, 1, 2})
    # an arrival proves a worker alive: a slow heartbeat does not drop it
    assert ready_to_propose(prev, {0, 1, 2}, arrived={0, 1, 2}, leaving=set(), dead={1})


def test_propose_numbers_the_next_generation_and_ranks_survivors_first():
    prev = Generation(2, (0, 1, 2), hosts=("h0", "h1", "h2"))
    arrived = _members((0, "h0", 0), (2, "h2", 0), (3, "h3", 0))
    nxt = propose(prev, arrived, leaving=set())
    assert nxt == Generation(3, (0, 2, 3), ("join", "lost"))
    assert nxt.hosts == ("h0", "h2", "h3") and nxt.rank_of(2) == 1 and nxt.rank_of(1) is None
    assert Generation.from_json(nxt.to_json()) == nxt and Generation.from_json(nxt.to_json()).hosts == nxt.hosts
    assert propose(None, arrived, {3}).members == (0, 2)


def test_change_wanted_flags_joins_leaves_and_lost_members():
    gen = Generation(1, (0, 1), hosts=("h0", "h1"))
    assert change_wanted(gen, {0, 1}, set(), set()) == ()
    assert change_wanted(gen, {0, 1, 2}, set(), set()) == ("join",)
    assert change_wanted(gen, {0, 1, 2}, {2}, set()) == ()          # a joiner that left again wants nothing
    assert change_wanted(gen, {0, 1}, {1}, set()) == ("leave",)
    assert change_wanted(gen, {0, 1}, set(), {1}) == ("lost",)
    assert change_wanted(gen, {0, 1}, {1}, {1}) == ("leave",)       # it left, then its heartbeat stopped


def _node(first: int, host: str, size: int) -> dict[int, Member]:
    """A node's ``size`` workers with ids from ``first``, each announcing ``size`` (its launcher's local world)."""
    return {first + i: Member(first + i, host, i, 1000 + first + i, size) for i in range(size)}


def test_a_joining_node_is_admitted_in_one_change_once_all_its_workers_registered():
    gen = Generation(1, (0, 1), hosts=("h0", "h0"))
    present = {**_node(0, "h0", 2), **_node(2, "h1", 2)}
    first_only = {w: m for w, m in present.items() if w != 3}
    # one of h1's two workers registered: held back, no change yet
    assert warming_up(first_only, set(gen.members)) == {2}
    assert change_wanted(gen, set(first_only), set(), set(), warming_up(first_only, set(gen.members))) == ()
    # the second registered: both admitted by the same change
    assert warming_up(present, set(gen.members)) == set()
    assert change_wanted(gen, set(present), set(), set(), warming_up(present, set(gen.members))) == ("join",)
    # a sibling that hangs in its start holds its host back only until the batching wait is over
    assert warming_up(first_only, set(gen.members), overdue={2}) == set()
    # a host's workers that are members count: a restarted worker of a running node rejoins at once
    assert warming_up({**_node(0, "h0", 2)}, {0}) == set()
    # a worker announcing a local world of 1 (or an old one that announces none) is never held back
    assert warming_up({0: Member(0, "h0", 0, 1), 1: Member(1, "h1", 0, 2)}, set()) == set()
    # a lost member is flagged at once even while a joiner's host warms up
    assert change_wanted(gen, set(first_only), set(), {1}, {2}) == ("lost",)


def test_the_first_world_waits_for_the_hosts_it_has_workers_of_and_later_ones_never_do():
    h0, h1 = _node(0, "h0", 2), _node(2, "h1", 2)
    partial = {**h0, 2: h1[2]}
    warming = warming_up(partial, set())
    assert warming == {2}
    assert not ready_to_propose(None, set(partial), arrived=set(partial), leaving=set(), dead=set(), warming=warming)
    assert ready_to_propose(None, {0, 1, 2, 3}, arrived={0, 1, 2, 3}, leaving=set(), dead=set(),
                            warming=warming_up({**h0, **h1}, set()))
    assert ready_to_propose(None, {0, 1, 2}, arrived={0, 1, 2}, leaving=set(), dead={2}, warming=warming)
    # a later generation: the change was agreed already (a loss must not wait for a joiner's sibling)
    prev = Generation(1, (0, 1), hosts=("h0", "h0"))
    assert ready_to_propose(prev, {0, 1, 2}, arrived={0, 1, 2}, leaving=set(), dead=set(), warming={2})


def test_the_first_world_has_a_last_call_for_late_starters_and_later_ones_none():
    # nodes launched together: the first world waits until nobody registered for last_call seconds...
    assert not last_call_over(None, registered=3, max_workers=8, quiet_s=1.9, last_call=2.0)
    assert last_call_over(None, registered=3, max_workers=8, quiet_s=2.0, last_call=2.0)
    # ...or until every worker the job may have is there (--nnodes 2 of 2 workers: no wait at all)
    assert last_call_over(None, registered=4, max_workers=4, quiet_s=0.0, last_call=2.0)
    assert not last_call_over(None, registered=4, max_workers=None, quiet_s=0.0, last_call=2.0)
    assert last_call_over(None, registered=1, max_workers=None, quiet_s=0.0, last_call=0.0)  # no last call set
    # a later generation never waits: its change was agreed already
    assert last_call_over(Generation(1, (0, 1)), registered=2, max_workers=8, quiet_s=0.0, last_call=2.0)


def test_overdue_counts_the_wait_on_the_observers_clock():
    assert overdue({0: 10.0, 1: 25.0}, now=40.5, wait=30.0) == {0}
    assert overdue({0: 10.0, 1: 25.0}, now=40.0, wait=30.0) == set()


def test_liveness_counts_a_worker_dead_only_after_its_counter_stood_still_for_the_timeout():
    live = Liveness(timeout=2.0)
    live.observe(0, 5, now=10.0)
    live.observe(1, 9, now=10.0)
    live.observe(0, 6, now=11.5)
    live.observe(1, 9, now=11.5)
    assert live.dead() == set()
    live.observe(0, 7, now=12.1)
    live.observe(1, 9, now=12.1)
    assert live.dead() == {1}                # 1's counter stood still from 10.0 to 12.1
    live.observe(1, 10, now=12.2)            # it was only slow
    assert live.dead() == set()
    live.forget(1)
    live.observe(0, 7, now=100.0)
    assert live.dead() == {0}


def test_a_stale_slot_is_neither_alive_nor_dead_until_the_timeout_so_it_never_looks_like_a_joiner():
    live = Liveness(timeout=2.0)
    live.observe(0, 5, now=10.0)      # a live worker
    live.observe(1, 3, now=10.0)      # a worker that died before this observer started
    live.observe(0, 6, now=10.1)
    live.observe(1, 3, now=10.1)
    assert live.alive() == {0} and live.dead() == set()
    live.observe(0, 9, now=12.5)
    live.observe(1, 3, now=12.5)
    assert live.alive() == {0} and live.dead() == {1}


def test_an_observer_starved_of_cpu_counts_nobody_dead_for_its_own_silence():
    live = Liveness(timeout=1.0)
    live.observe(0, 5, now=10.0)
    live.observe(0, 40, now=30.0)            # the observer slept 20 s; the worker went on meanwhile
    assert live.dead() == set()


def test_a_worker_known_gone_is_dead_at_once_whatever_its_heartbeat_and_the_evidence_is_named():
    live = Liveness(timeout=600.0)
    live.observe(0, 5, now=10.0)
    live.observe(1, 3, now=10.0)
    live.observe(1, 4, now=10.1)             # heart-beating a moment ago
    live.gone(1)                             # then its process's connection closed
    assert live.dead() == {1} and live.alive() == set()
    assert live.how_dead(1) == "closed" and live.how_dead(0) == "heartbeat"
    assert ready_to_propose(Generation(1, (0, 1)), {0, 1}, arrived={0}, leaving=set(), dead=live.dead())
    live.forget(1)                           # it had left: the leave mark wins
    assert live.dead() == set()


def test_a_worker_marked_gone_that_beats_on_is_alive_again_and_only_the_timeout_can_take_it():
    live = Liveness(timeout=2.0)
    live.observe(2, 7, now=10.0)
    live.observe(2, 8, now=10.1)
    live.gone(2)                             # its connection was reset, but the process lives
    assert live.dead() == {2}
    live.observe(2, 9, now=10.2)             # it beat again
    assert live.dead() == set() and live.alive() == {2} and live.how_dead(2) == "heartbeat"
    live.gone(2)                             # the same (old) mark read again: no news
    assert live.dead() == set()
    live.observe(2, 9, now=12.3)             # then it stood still for the timeout
    assert live.dead() == {2} and live.how_dead(2) == "heartbeat"


def test_a_generation_carries_how_its_lost_members_were_found_dead():
    g = Generation(4, (0, 2), ("lost",), ("h0", "h2"), lost_by=((1, "closed"), (3, "heartbeat")))
    back = Generation.from_json(g.to_json())
    assert back == g and back.lost_by == ((1, "closed"), (3, "heartbeat")) and back.hosts == ("h0", "h2")
    old = '{"number": 2, "members": [0], "reasons": ["lost"], "hosts": ["h0"]}'  # before lost_by existed
    assert Generation.from_json(old).lost_by == ()


def test_member_json_round_trips_and_keys_stay_under_the_job_prefix():
    m = Member(3, "h1", 0, 4242, 2)
    assert Member.from_json(m.to_json()) == m
    assert Member.from_json('{"wid": 3, "host": "h1", "local_rank": 0, "pid": 4242}').local_world == 1
    k = Keys("job-7")
    names = [k.slots, k.latest, k.slot(1), k.heartbeat(1), k.leaving(1), k.arrived(2, 1), k.generation(2),
             k.group(2), k.gone]
    assert all(n.startswith("tenplex/inplace/job-7/") for n in names) and len(set(names)) == len(names)
    assert k.group(2) == "tenplex/inplace/job-7/pg/2/"
