"""The watchdog's decisions, one process, with an in-memory store standing in for torchrun's.

The real thing (processes that hang, stop or skip a collective) is in
tests/distributed/test_watchdog.py; these check the rules it applies.
"""

import json
import time

import pytest

from keel.distributed.hang_report import build_hang_report, collective_divergence
from keel.distributed.process_group import CollectiveGuard
from keel.distributed.watchdog import Progress, Watchdog, WatchdogSettings


class MemoryStore:
    """The part of c10d's Store API the watchdog uses."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def delete_key(self, key):
        return self.data.pop(key, None) is not None

    def wait(self, keys, timeout):
        assert self.check(keys), f"would wait for {keys}"


class Alarmed(Exception):
    pass


def watchdog(tmp_path, *, world_size=2, store=None, hang=1.0, stall=None) -> Watchdog:
    settings = WatchdogSettings(
        hang_timeout_s=hang,
        stall_timeout_s=stall,
        on_stall="warn",
        diagnostics_dir=tmp_path / "diagnostics",
        interval_s=0.05,
    )
    dog = Watchdog(settings, rank=0, world_size=world_size, store=store)

    def alarm(reason):
        raise Alarmed(reason)

    dog.alarm = alarm
    return dog


def idle_for(progress: Progress, seconds: float) -> None:
    progress.changed = time.monotonic() - seconds


def test_no_progress_in_a_step_is_a_hang(tmp_path):
    dog = watchdog(tmp_path, hang=1.0)
    with dog.progress.phase("step", 1.0):
        idle_for(dog.progress, 0.5)
        dog._check_hang()  # within the limit
        idle_for(dog.progress, 1.5)
        with pytest.raises(Alarmed, match="no progress for 1.5 s .* phase 'step'"):
            dog._check_hang()


def test_slow_phases_have_their_own_limit(tmp_path):
    """A checkpoint save idle for longer than hang_timeout_s is not a hang."""
    dog = watchdog(tmp_path, hang=1.0)
    with dog.progress.phase("checkpoint save", 1800.0):
        idle_for(dog.progress, 60.0)
        dog._check_hang()
    with dog.progress.phase("prepare", None):  # unwatched
        idle_for(dog.progress, 1e6)
        dog._check_hang()


def test_one_process_never_hangs_on_peers(tmp_path):
    dog = watchdog(tmp_path, world_size=1)
    with dog.progress.phase("step", 1.0):
        idle_for(dog.progress, 100.0)
        dog._check_hang()


def test_waiting_for_a_rank_that_still_works_is_not_a_hang(tmp_path):
    """Rank 0 waits in a collective while rank 1 generates slowly, marking each round: slow,
    not stuck. Once rank 1 stops moving too (or has finished), it is a hang."""
    store = MemoryStore()
    dog = watchdog(tmp_path, store=store, hang=1.0)
    with dog.progress.phase("step", 1.0):
        idle_for(dog.progress, 5.0)
        store.set("hb/1", json.dumps({"beat": 9, "idle_s": 0.3}))
        dog._check_hang()
        dog._check_hang()  # asked first again: the rank it waited on
        store.set("hb/1", json.dumps({"beat": 10, "idle_s": 1.4}))
        with pytest.raises(Alarmed, match="no progress for 5.0 s"):
            dog._check_hang()
        store.set("hb/1", json.dumps({"beat": 11, "idle_s": 0.0, "done": True}))
        with pytest.raises(Alarmed):
            dog._check_hang()


def test_a_frozen_peer_heartbeat_is_a_hang_in_any_phase(tmp_path):
    store = MemoryStore()
    dog = watchdog(tmp_path, store=store, hang=0.2)
    store.set("hb/1", json.dumps({"beat": 7}))
    with dog.progress.phase("checkpoint save", 1800.0):
        dog._check_peer()  # first sight
        store.set("hb/1", json.dumps({"beat": 8}))
        dog._check_peer()  # it moved
        time.sleep(0.3)
        with pytest.raises(Alarmed, match="rank 1 sent no heartbeat for"):
            dog._check_peer()


def test_a_finished_peer_is_not_frozen(tmp_path):
    store = MemoryStore()
    dog = watchdog(tmp_path, store=store, hang=0.1)
    store.set("hb/1", json.dumps({"beat": 3, "done": True}))
    dog._check_peer()
    time.sleep(0.2)
    dog._check_peer()


def test_stall_limit_is_auto_after_warm_up(tmp_path):
    dog = watchdog(tmp_path, world_size=1)
    assert dog.stall_limit()[0] == 600.0  # warm-up
    for seconds in (30.0, 20.0, 10.0, 1.0, 2.0, 3.0):
        dog.progress.step_seconds.append(seconds)
    limit, why = dog.stall_limit()
    assert limit == 60.0 and "median step 2.00 s" in why  # max(60, 10 x 2)
    for _ in range(10):
        dog.progress.step_seconds.append(9.0)
    assert dog.stall_limit()[0] == 90.0
    fixed = watchdog(tmp_path, world_size=1, stall=5.0)
    assert fixed.stall_limit() == (5.0, "watchdog.stall_timeout_s")


def test_a_stalled_step_is_reported_once(tmp_path, capsys):
    dog = watchdog(tmp_path, world_size=1, stall=0.1)
    dog.progress.step_begin(4)
    dog.progress.step_started -= 1.0
    dog._check_stall()
    dog._check_stall()
    err = capsys.readouterr().err
    assert err.count("step 4 has run for") == 1 and "Thread MainThread" in err
    assert len(list((tmp_path / "diagnostics").glob("stall-step-00000004-*.txt"))) == 1


def beat(rank, step, point, collectives, where="x"):
    return {
        "rank": rank,
        "beat": 1,
        "pid": 100 + rank,
        "ppid": 1,
        "host": "h",
        "step": step,
        "point": point,
        "where": where,
        "idle_s": 9.0,
        "phase": "step",
        "collectives": collectives,
    }


def test_report_names_the_late_and_the_silent_ranks(tmp_path):
    beats = {
        0: beat(0, 5, 40, [[3, "all_reduce_sum", "float64[1]", 5]]),
        1: beat(1, 5, 12, [[2, "barrier", "", 4]], where="step 5: step begin"),
        2: beat(2, 5, 33, [[3, "all_reduce_sum", "float64[1]", 5]]),
    }
    text = build_hang_report("stuck", beats, live={0, 1}, diagnostics=tmp_path)
    assert "not responding (no heartbeat; stopped, killed or frozen): rank(s) 2" in text
    assert "behind the others: rank(s) 1" in text
    assert "rank 2 (NOT RESPONDING, its last heartbeat" in text
    assert "rank 1 (alive, h pid 101): at step 5: step begin (mark 12, phase 'step')" in text
    assert (
        "first differ at #3: rank 0: all_reduce_sum(float64[1]) at step 5; rank 1: not "
        "reached (still at step 5: step begin)" in text
    )


def test_divergence_of_shapes_and_agreement():
    agree = {r: beat(r, 2, 10, [[0, "all_reduce_sum", "float64[2]", 2]]) for r in (0, 1)}
    assert "agree" in collective_divergence(agree)
    differ = {
        0: beat(0, 2, 10, [[0, "gather_objects", "dict", 2]]),
        1: beat(1, 2, 10, [[0, "gather_objects", "list", 2]]),
    }
    assert (
        "first differ at #0: rank 0: gather_objects(dict) at step 2; rank 1: "
        "gather_objects(list) at step 2" in collective_divergence(differ)
    )


def test_the_guard_stops_mismatched_collectives_before_the_backend(tmp_path):
    store = MemoryStore()
    dog = watchdog(tmp_path, store=store)
    dog.progress.step_begin(3)
    guard = CollectiveGuard(rank=0, world_size=2, store=store, watchdog=dog)
    store.set("fp/0/1", json.dumps(["all_reduce_sum", "float64[1]", 3]))
    assert guard.before("all_reduce_sum", "float64[1]")  # same call on both ranks
    store.set("fp/1/1", json.dumps(["all_reduce_sum", "float64[5]", 3]))
    with pytest.raises(
        Alarmed,
        match=r"collective #1 differs: rank 0: all_reduce_sum"
        r"\(float64\[2\]\) at step 3; rank 1: all_reduce_sum"
        r"\(float64\[5\]\)",
    ):
        guard.before("all_reduce_sum", "float64[2]")


def test_a_run_with_the_watchdog_off(tiny_model_dir, tmp_path):
    """watchdog.enabled=false: no thread, no marks in the model, the run is the same."""
    from keel.config import load_config
    from keel.train.run import run_training

    data = tmp_path / "qa.json"
    data.write_text(json.dumps([{"instruction": "Hi?", "output": "Hello."}] * 4))
    base = {
        "model": {"path": str(tiny_model_dir), "cache_dir": str(tmp_path / "cache")},
        "data": {"datasets": [str(data)], "cutoff_len": 64},
        "train": {"max_steps": 2, "precision": "fp32", "threads": 1},
        "output": {"dir": str(tmp_path / "out")},
    }
    result = run_training(
        load_config(None, ["watchdog.enabled=false"], base=base), log=lambda _m: None
    )
    assert len(result.losses) == 2


class DeadStore(MemoryStore):
    def set(self, key, value):
        raise TimeoutError("store did not answer")


def test_a_store_that_stops_answering_is_a_hang_too(tmp_path):
    """Under srun the store lives in rank 0's process; if it is stopped, so is the store."""
    dog = watchdog(tmp_path, store=DeadStore(), hang=0.2)
    raised = []

    def alarm(reason):
        raised.append(reason)
        dog._stop.set()

    dog.alarm = alarm
    dog.start()
    dog._thread.join(timeout=10)
    assert raised and "the rendezvous store has not answered" in raised[0]
    assert dog.store is None  # the report is written without it
