"""The learner's journals: a checkpoint appends only what changed, restoring replays up to the checkpoint's mark and
cuts off what came after, a long file is compacted to the live keys (beside the checkpoints that go on meanwhile),
and old generations go."""

import json
import logging

from rlens.service.learner.journal import Journal
from rlens.service.learner.pending import Pending, PendingHalves, RecentIds
from rlens.messages import Feedback


def replayed(journal: Journal, mark) -> dict:
    state: dict = {}
    for change in journal.restore(mark):
        if change[0] == "+":
            state[change[1]] = change[2]
        else:
            state.pop(change[1], None)
    return state


def test_a_checkpoint_appends_only_its_changes_and_a_restore_stops_at_its_mark(tmp_path):
    journal = Journal(tmp_path, "done", floor=100)
    ids = RecentIds(limit=3)
    ids.add("a", 1.0)
    first = journal.write(ids)  # the first write starts generation 1
    assert first == [1, len(b'["+","a",1.0]\n')]
    for q, at in (("b", 2.0), ("c", 3.0), ("d", 4.0)):  # "d" pushes out "a"
        ids.add(q, at)
    assert ids.changes == [["+", "b", 2.0], ["+", "c", 3.0], ["+", "d", 4.0], ["-", "a"]]
    second = journal.write(ids)
    assert not ids.changes
    path = tmp_path / "done-000001.jsonl"
    assert second[0] == 1 and second[1] == path.stat().st_size
    assert path.read_text().splitlines() == [
        '["+","a",1.0]',
        '["+","b",2.0]',
        '["+","c",3.0]',
        '["+","d",4.0]',
        '["-","a"]',
    ]
    ids.add("e", 5.0)  # written by a checkpoint that never completed
    journal.write(ids)

    resumed, again = Journal(tmp_path, "done", floor=100), RecentIds(limit=4)
    again.replay(resumed.restore(second))
    assert dict(again.items) == {"b": 2.0, "c": 3.0, "d": 4.0} and not again.changes
    assert path.stat().st_size == second[1]  # what came after the mark is cut off before anything is appended
    again.add("f", 6.0)
    assert resumed.write(again) == [1, second[1] + len(b'["+","f",6.0]\n')]
    assert replayed(Journal(tmp_path, "done"), [1, path.stat().st_size]) == {"b": 2.0, "c": 3.0, "d": 4.0, "f": 6.0}


def test_a_long_journal_is_compacted_to_the_live_keys_and_old_generations_go(tmp_path):
    journal = Journal(tmp_path, "done", keep=1, floor=2, run=lambda work: work())  # each compaction done at once
    ids = RecentIds(limit=2)
    marks = []
    for i in range(12):
        ids.add(f"q{i}", float(i))  # from the third on, each add also drops the oldest: 2 changes
        marks.append(journal.write(ids))
    # two live ids, floor 2: a file takes changes while it holds at most 2 * 2 + 2 = 6 lines. Generation 1: q0 (1
    # line), q1 (2), q2 and q0 out (4), q3 and q1 out (6); q4 makes 8: a compaction writes generation 2 with q3, q4;
    # the next write appends q5 and q3 out there (4 lines) and records generation 2's mark, ...
    assert [m[0] for m in marks] == [1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert (tmp_path / "done-000004.jsonl").read_text().splitlines() == [
        '["+","q9",9.0]',
        '["+","q10",10.0]',
        '["+","q11",11.0]',
        '["-","q9"]',
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done-000003.jsonl", "done-000004.jsonl"]  # keep 1 + 1
    assert replayed(Journal(tmp_path, "done"), marks[-1]) == {"q10": 10.0, "q11": 11.0}
    assert replayed(Journal(tmp_path, "done"), marks[9]) == {"q8": 8.0, "q9": 9.0}  # an older checkpoint's mark


def test_checkpoints_go_on_during_a_compaction_and_the_first_after_it_records_the_new_generation(tmp_path):
    waiting: list = []
    journal = Journal(tmp_path, "done", keep=1, floor=2, run=waiting.append)  # a compaction runs when the test says
    ids = RecentIds(limit=2)
    marks = []
    for i in range(8):
        ids.add(f"q{i}", float(i))
        marks.append(journal.write(ids))
    # q4's write started a compaction from the snapshot {q3, q4}; until it has run, every write goes to generation 1
    # (and none starts another compaction)
    assert len(waiting) == 1 and [m[0] for m in marks] == [1] * 8
    assert replayed(Journal(tmp_path, "done"), marks[-1]) == {"q6": 6.0, "q7": 7.0}
    waiting.pop()()
    ids.add("q8", 8.0)
    marks.append(journal.write(ids))
    assert marks[-1][0] == 2 and not waiting
    assert (tmp_path / "done-000002.jsonl").read_text().splitlines() == [
        '["+","q3",3.0]',  # the snapshot
        '["+","q4",4.0]',
        '["+","q5",5.0]',  # the writes during the compaction
        '["-","q3"]',
        '["+","q6",6.0]',
        '["-","q4"]',
        '["+","q7",7.0]',
        '["-","q5"]',
        '["+","q8",8.0]',  # this write's
        '["-","q6"]',
    ]
    assert replayed(Journal(tmp_path, "done"), marks[-1]) == {"q7": 7.0, "q8": 8.0}
    assert replayed(Journal(tmp_path, "done"), marks[7]) == {"q6": 6.0, "q7": 7.0}  # generation 1 still restores


def test_a_compaction_in_its_thread_that_fails_is_reported_and_tried_again(tmp_path, caplog):
    journal, ids = Journal(tmp_path, "done", keep=1, floor=0), RecentIds(limit=1)
    (tmp_path / "done-000002.jsonl").mkdir()  # generation 2 cannot be written
    for i in range(3):  # q2's write starts a compaction (4 lines > 2 * 1 + 0)
        ids.add(f"q{i}", float(i))
        journal.write(ids)
    assert journal.compaction is not None and journal.compaction.done.wait(60)
    with caplog.at_level(logging.ERROR, logger="rlens.learner"):
        ids.add("q3", 3.0)
        mark = journal.write(ids)  # reported; generation 1 goes on, and a compaction starts again
    assert "a compaction failed (IsADirectoryError" in caplog.text and mark[0] == 1
    assert journal.compaction is not None and journal.compaction.done.wait(60)
    (tmp_path / "done-000002.jsonl").rmdir()
    ids.add("q4", 4.0)
    assert journal.write(ids)[0] == 1  # the second compaction failed too (the directory was still there)
    assert journal.compaction is not None and journal.compaction.done.wait(60)
    ids.add("q5", 5.0)
    mark = journal.write(ids)
    assert mark[0] == 2 and replayed(Journal(tmp_path, "done"), mark) == {"q5": 5.0}


def test_a_journal_shorter_than_its_mark_says_so_and_keeps_what_it_has(tmp_path, caplog):
    journal, ids = Journal(tmp_path, "done"), RecentIds(limit=2)
    ids.add("a", 1.0)
    ids.add("b", 2.0)
    mark = journal.write(ids)
    path = tmp_path / "done-000001.jsonl"
    path.write_bytes(path.read_bytes()[:-3])  # a torn last line
    with caplog.at_level(logging.ERROR, logger="rlens.learner"):
        assert replayed(Journal(tmp_path, "done"), mark) == {"a": 1.0}
    assert f"holds {mark[1] - 3} of the {mark[1]} bytes" in caplog.text


def test_pending_halves_replay_to_the_same_halves_in_the_same_order():
    halves: PendingHalves[Feedback] = PendingHalves(limit=3, max_bytes=10_000, per_stream=2)
    for i, stream in enumerate(["s", "s", "t", "s"]):  # the third "s" is over its stream's quota: q0 goes
        message = Feedback(query_id=f"q{i}", token="t" * 64, reward=1.0, stream=stream)
        halves.add(f"q{i}", Pending(float(i), 10, message, {"offset": i}))
    halves.pop("q2")
    assert [c[0] for c in halves.changes] == ["+", "+", "+", "+", "-", "-"]
    changes = json.loads(json.dumps(list(halves.as_json(halves.changes))))
    again: PendingHalves[Feedback] = PendingHalves(limit=3, max_bytes=10_000, per_stream=2)
    again.replay(changes, Feedback)
    assert list(again) == list(halves) == ["q1", "q3"]
    assert again.bytes == halves.bytes == 20 and again.streams == halves.streams and not again.changes
    assert again.items["q3"].message == halves.items["q3"].message and again.items["q3"].record == {"offset": 3}
