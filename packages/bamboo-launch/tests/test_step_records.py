"""The job's step records survive the node that writes them (`bamboo.launch.step_records`): the node that takes
the writing over writes the record of the step before once, only when the node that left did not get it out."""

from __future__ import annotations

from bamboo.launch.events import EtcdEventLog, Step, read_etcd_events
from bamboo.launch.step_records import StepRecords, recorded, worker_records_prefix, worker_writer
from bamboo.membership import MembershipStore


def _step(step: int, generation: int = 0, loss: float = 2.0) -> Step:
    return Step(t=float(step), step=step, samples=8, loss=loss, nodes_active=4, duration_s=0.5,
                generation=generation)


def test_a_node_that_starts_writing_returns_the_record_it_held_of_the_step_just_before() -> None:
    records = StepRecords()
    assert records.settle(_step(4), writes=False) is None  # the shadow holds step 4's record
    assert records.settle(_step(5), writes=True) == _step(4)  # it writes step 5: step 4's may be lost
    assert records.held is None
    assert records.settle(_step(6), writes=True) is None  # a writer all along holds nothing


def test_nothing_is_recovered_across_layouts_or_a_gap() -> None:
    records = StepRecords()
    records.settle(_step(4, generation=0), writes=False)
    assert records.settle(_step(5, generation=1), writes=True) is None  # a new layout: its own first step
    records.settle(_step(7), writes=False)
    assert records.settle(_step(9), writes=True) is None  # not the step just before


def _steps_in_etcd(membership: MembershipStore) -> list[tuple[int, float]]:
    return sorted((e.step, e.loss) for e in read_etcd_events(membership.kv, membership.keys.job) if isinstance(e, Step))


def test_the_new_writer_writes_the_lost_record_once_and_not_one_the_dead_writer_got_out(
    membership: MembershipStore,
) -> None:
    job, kv = membership.keys.job, membership.kv
    dead = EtcdEventLog(kv, job, worker_writer("node3", 101), 0.0)  # the writer before the one that left
    dead.write(_step(3, loss=1.5))
    dead.close()  # it got step 3 out; its step 4 died with it
    shadow = EtcdEventLog(kv, job, worker_writer("node2", 202), 0.0)
    records = StepRecords()
    departed = [worker_records_prefix(job, "node3")]
    assert recorded(kv, departed, _step(3)) and not recorded(kv, departed, _step(4))
    records.after_step(_step(3), writes=False, events=shadow, kv=kv, departed=lambda: departed)
    records.after_step(_step(4), writes=False, events=shadow, kv=kv, departed=lambda: departed)
    records.after_step(_step(5), writes=True, events=shadow, kv=kv, departed=lambda: departed)
    records.after_step(_step(6), writes=True, events=shadow, kv=kv, departed=lambda: departed)
    assert shadow.flush()  # (the recovered record is queued on the writer's thread before step 5's is written)
    assert _steps_in_etcd(membership) == [(3, 1.5), (4, 2.0), (5, 2.0), (6, 2.0)]  # step 4 once, step 3 once
    # the dead writer did get step 4 out: the shadow does not write it again
    again = StepRecords()
    again.settle(_step(4, generation=1), writes=False)
    EtcdEventLog(kv, job, worker_writer("node3", 102), 0.0).write(_step(4, generation=1, loss=9.0))
    again.after_step(_step(5, generation=1), writes=True, events=shadow, kv=kv, departed=lambda: departed)
    shadow.close()
    generation_1 = [(e.step, e.loss) for e in read_etcd_events(kv, job) if isinstance(e, Step) and e.generation == 1]
    assert sorted(generation_1) == [(4, 9.0), (5, 2.0)]
