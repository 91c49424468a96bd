"""The worker and learner cores without Kafka, against a real redis-server and real replay backends: the join
(either order, duplicates, invalid labels, expiry, eviction), rewards, exactly-once window updates, checkpoints
(round trip, resume), policy verification, and answering with cold windows or failing models."""

import asyncio
import base64
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from rlens.backends import Backend, BackendError, create_backend

from rlens.focal.config import FocalConfig
from rlens.service.common.metrics import StreamLabels, WorkerMetrics
from rlens.focal.engine import FocalEngine
from rlens.messages import Experience, Feedback, Query
from rlens.checkpoint import CheckpointStore
from rlens.service.learner.core import LearnerCore
from rlens.service.common.policy import PolicyError, decode_policy, encode_policy
from rlens.service.common.windows import RedisWindows
from rlens.service.learner.online import FocalOnlineTrainer
from rlens.service.worker.core import FocalWorker
from rlens.local.load import queries_of
from trust import SIGNER, TOKENS, VERIFIER, token


class Record:
    """A consumer record's coordinates (what the learner keeps of a feedback message)."""

    def __init__(self, offset: int, value: bytes = b"{}", timestamp: int | None = None):
        self.topic, self.partition, self.offset, self.key, self.value, self.timestamp = (
            "rlens.feedback",
            0,
            offset,
            b"k",
            value,
            timestamp,
        )


def windows_for(url: str, n_models: int = 5) -> RedisWindows:
    return RedisWindows(Redis.from_url(url), n_models, 128)


def experience(engine: FocalEngine, qid: str, stream: str = "s", answer: int = 1, n_choices: int = 4) -> Experience:
    decision = engine.decide(stream, n_choices, greedy=False)[0]  # explored: it trains the policies
    probs = np.full((engine.n_models, n_choices), 1 / n_choices)
    fused = engine.fuse(decision, probs)
    return Experience(
        query_id=qid,
        stream=stream,
        policy_version=0,
        n_choices=n_choices,
        decider_state=decision.state.tolist(),
        critic_state=fused.critic_state.tolist(),
        pool=decision.pool.tolist(),
        pool_logp=decision.pool_logp,
        predictions=[answer] * engine.n_models,
        fusion_features=fused.features.tolist(),
        answer_index=answer,
        answer_logp=fused.answer_logp,
        explored=True,
    )


def learner(tmp_path: Path, url: str, **options) -> LearnerCore:
    models = [f"m{i}" for i in range(5)]
    return LearnerCore(
        FocalOnlineTrainer(FocalEngine(5, seed=0), models),
        models,
        windows_for(url),
        CheckpointStore(tmp_path / "ckpt"),
        SIGNER,
        TOKENS,
        **options,
    )


def fb(qid: str, on: str = "s", **outcome) -> Feedback:
    """Feedback that carries the token of its answer on stream ``on``."""
    return Feedback(query_id=qid, token=token(qid, on), **outcome)


def test_join_in_either_order_ignores_duplicates_and_rewards_correctly(tmp_path, redis_server):
    async def scenario():
        await Redis.from_url(redis_server.url).flushdb()
        core = learner(tmp_path, redis_server.url)
        worker_engine = FocalEngine(5, seed=0)
        assert await core.on_experience(experience(worker_engine, "a", answer=1), Record(0)) == (None, None)
        await core.on_feedback(fb("a", label=1), Record(0))  # experience first
        await core.on_feedback(fb("b", label=2), Record(1))  # feedback first
        await core.on_experience(experience(worker_engine, "b", answer=1), Record(0))
        await core.on_feedback(fb("a", label=1), Record(2))  # duplicate feedback
        await core.on_experience(experience(worker_engine, "b", answer=1), Record(0))  # redelivered experience
        await core.on_feedback(fb("c", reward=0.25), Record(3))  # bare reward
        await core.on_experience(experience(worker_engine, "c"), Record(0))
        assert core.stats.windows_applied == 0 and len(core.window_backlog) == 3  # queued until the batch ends
        await core.apply_windows()  # what the app does after each batch of records
        assert core.stats.joined == 3 and core.stats.duplicates == 2 and core.stats.windows_applied == 3
        rewards = [t.reward for t in core.trainer.engine.buffer]
        pool_cost = [
            core.trainer.engine.cfg.alpha
            * core.trainer.engine.cost_share[np.asarray(experience(worker_engine, "x").pool)].sum()
        ] * 2
        assert (
            rewards[0] == pytest.approx(1 - pool_cost[0])
            and rewards[1] == pytest.approx(-1 - pool_cost[1])
            and rewards[2] == 0.25
        )
        window = (await core.windows.load(["s"]))["s"]
        assert window.n_rows == 3 and list(window.labels[:3]) == [1, 2, -1]

    asyncio.run(scenario())


def test_feedback_with_a_label_outside_the_choices_is_dead_lettered(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url)
        await core.on_feedback(fb("z", label=7), Record(5, b'{"query_id": "z", "label": 7}'))
        policy, dead = await core.on_experience(experience(FocalEngine(5, seed=0), "z", n_choices=4), Record(0))
        assert policy is None and "label 7 is not one of query z's 4 choices" in dead.reason
        assert base64.b64decode(dead.value_b64) == b'{"query_id": "z", "label": 7}' and dead.offset == 5
        assert core.stats.joined == 0 and core.stats.invalid_feedback == 1

    asyncio.run(scenario())


def test_pending_halves_are_bounded_expire_by_event_time_and_are_dead_lettered(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url, pending_limit=3, pending_ttl_s=3600)
        engine = FocalEngine(5, seed=0)
        hour = 3600 * 1000  # record timestamps are milliseconds
        for i in range(5):  # an old stream read long after it was written: nothing expires by the wall clock
            await core.on_experience(experience(engine, f"e{i}"), Record(i, timestamp=1_000_000 + i))
        assert list(core.experience) == ["e2", "e3", "e4"] and core.stats.evicted == 2 and core.stats.expired == 0
        dropped = core.take_dead_letters()
        assert [d.offset for d in dropped] == [0, 1] and all(
            "pending experience reached the bound (3 halves" in d.reason for d in dropped
        )
        # an hour of event time after e4
        await core.on_feedback(fb("late", label=0), Record(9, timestamp=1_000_004 + hour))
        assert list(core.experience) == ["e4"] and list(core.feedback) == ["late"] and core.stats.expired == 2
        assert all(
            "no feedback within 3600 s (event time); not trained on" in d.reason for d in core.take_dead_letters()
        )
        # bytes bound too: one large feedback pushes the older halves out
        small = learner(tmp_path / "bytes", redis_server.url, pending_bytes=1000)
        for i in range(3):
            await small.on_feedback(fb(f"f{i}", reference="x" * 300), Record(i, value=b"v" * 400))
        assert list(small.feedback) == ["f1", "f2"] and small.feedback.bytes == 800 and small.stats.evicted == 1
        # a flood of experience on one stream key drops that stream's own halves, not the other streams'
        quota = learner(tmp_path / "quota", redis_server.url, pending_per_stream=2)
        await quota.on_experience(experience(engine, "other", stream="quiet"), Record(0))
        for i in range(5):
            await quota.on_experience(experience(engine, f"junk{i}", stream="flood"), Record(1 + i))
        assert list(quota.experience) == ["other", "junk3", "junk4"] and quota.experience.streams.keys() == {
            "quiet",
            "flood",
        }
        assert all("reached its stream's quota (2 halves)" in d.reason for d in quota.take_dead_letters())

    asyncio.run(scenario())


def test_an_update_every_T_checkpoints_and_publishes_a_verified_policy(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url)
        engine = FocalEngine(5, seed=0)
        policies = []
        for i in range(core.trainer.engine.cfg.update_period):
            await core.on_experience(experience(engine, f"q{i}"), Record(0))
            policy, _ = await core.on_feedback(fb(f"q{i}", label=i % 4), Record(i))
            policies += [policy] if policy else []
        assert [p.version for p in policies] == [1] and core.stats.updates == 1 and not core.trainer.engine.buffer
        tensors = decode_policy(policies[0], engine.policy_state(), core.models, "rl_focal", VERIFIER)
        assert all(torch.equal(tensors[k], v) for k, v in core.trainer.engine.policy_state().items())
        assert (tmp_path / "ckpt" / "LATEST").read_text().startswith("v00000001")

    asyncio.run(scenario())


def test_a_shard_hands_each_join_on_and_the_trainer_trains_on_each_query_once_as_one_learner_would(
    tmp_path, redis_server
):
    """The same 64 pairs through one learner, and through a shard and a trainer with every transition handed on
    twice (a shard's re-join after a crash): the same rewards in the buffer, the same policy after the update."""

    async def scenario():
        await Redis.from_url(redis_server.url).flushdb()
        one = learner(tmp_path / "one", redis_server.url)
        shard = learner(tmp_path / "shard", redis_server.url, role="shard", shard=1)
        trainer = learner(tmp_path / "trainer", redis_server.url, role="trainer")
        engine = FocalEngine(5, seed=0)
        policies = []
        for i in range(one.trainer.engine.cfg.update_period):
            e, f = experience(engine, f"q{i}"), fb(f"q{i}", label=i % 4)
            await one.on_experience(e, Record(0))
            policies += [(await one.on_feedback(f, Record(i)))[0]]
            await shard.on_experience(e, Record(0))
            assert await shard.on_feedback(f, Record(i)) == (None, None)  # a shard never updates
            if i == 2:
                rewards = [t.reward for t in one.trainer.engine.buffer]
        assert not shard.trainer.engine.buffer and shard.stats.joined == 64 and not shard.checkpoint_due()
        handed = shard.take_handed()
        assert [t.query_id for t in handed] == [f"q{i}" for i in range(64)] and {t.shard for t in handed} == {1}
        assert [t.label for t in handed] == [i % 4 for i in range(64)]
        assert [t.reward for t in handed[:3]] == rewards
        trained = []
        for i, t in enumerate(handed + handed[:10]):  # the first ten handed on again
            trained += [(await trainer.on_transition(t, Record(i)))[0]]
        assert trainer.stats.joined == 64 and trainer.stats.duplicates == 10 and trainer.stats.updates == 1
        mine, theirs = [p for p in policies if p], [p for p in trained if p]
        assert len(mine) == len(theirs) == 1
        assert all(
            torch.equal(a, b)
            for a, b in zip(one.trainer.engine.policy_state().values(), trainer.trainer.engine.policy_state().values())
        )
        assert trainer.versions.tallies[0].row(0)["events"] == 64

    asyncio.run(scenario())


def test_checkpoint_round_trip_resumes_exactly(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url)
        engine = FocalEngine(5, seed=0)
        for i in range(70):  # one update at 64, then 6 transitions in the buffer
            await core.on_experience(experience(engine, f"q{i}"), Record(0))
            core.already_seen(Record(i))
            await core.on_feedback(fb(f"q{i}", label=1), Record(i))
        await core.on_experience(experience(engine, "pending"), Record(0))
        core.checkpoint()
        core.checkpoints.close()  # one learner per checkpoint directory: the first one leaves
        resumed = learner(tmp_path, redis_server.url)
        assert resumed.version == 1 and resumed.stats == core.stats and resumed.offsets.read == {"rlens.feedback:0": 70}
        assert (
            list(resumed.experience) == ["pending"] and len(resumed.trainer.engine.buffer) == 6 and "q5" in resumed.done
        )
        assert all(
            torch.equal(resumed.trainer.engine.policy_state()[k], v)
            for k, v in core.trainer.engine.policy_state().items()
        )
        a, b = core.trainer.engine.optimizer.state_dict(), resumed.trainer.engine.optimizer.state_dict()
        assert all(
            torch.equal(a["state"][i]["exp_avg_sq"], b["state"][i]["exp_avg_sq"])
            and float(a["state"][i]["step"]) == float(b["state"][i]["step"])
            for i in a["state"]
        )
        assert resumed.already_seen(Record(69)) and not resumed.already_seen(Record(70))
        # same buffer, weights, optimizer, RNG
        assert core.trainer.engine.update() == pytest.approx(resumed.trainer.engine.update())

    asyncio.run(scenario())


def test_a_checkpoint_holds_no_halves_and_a_resume_ignores_journal_lines_written_after_it(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url, done_limit=50)
        engine = FocalEngine(5, seed=0)
        for i in range(60):  # 60 joins: the newest 50 ids are kept
            await core.on_experience(experience(engine, f"q{i}"), Record(0))
            await core.on_feedback(fb(f"q{i}", label=1), Record(i))
        for i in range(30):
            await core.on_experience(experience(engine, f"held{i}"), Record(0))
        core.checkpoint()
        await core.on_experience(experience(engine, "held-later"), Record(0))
        await core.on_feedback(fb("held0", label=1), Record(60))  # joined: held no longer, a recent id
        await core.apply_windows()  # the joins' outcomes reach Redis (none left in the checkpoint's backlog)
        core.checkpoint()
        state = (core.checkpoints.latest() / "state.json").read_text()
        assert "held" not in state and "q59" not in state  # the halves and ids are in the journals
        at_checkpoint = list(core.experience), list(core.done.items.items())
        await core.on_experience(experience(engine, "after"), Record(0))
        core._write_journals()  # a checkpoint that wrote its journals, then the process died
        core.checkpoints.close()
        resumed = learner(tmp_path, redis_server.url, done_limit=50)
        assert (list(resumed.experience), list(resumed.done.items.items())) == at_checkpoint
        assert list(resumed.experience)[-1] == "held-later" and "held0" in resumed.done and "q10" not in resumed.done
        assert resumed.experience.items["held-later"].message == core.experience.items["held-later"].message
        assert resumed.experience.bytes == core.experience.bytes - core.experience.items["after"].size

    asyncio.run(scenario())


def test_a_checkpoint_from_before_the_journals_still_resumes(tmp_path, redis_server):
    async def scenario():
        core = learner(tmp_path, redis_server.url)
        engine = FocalEngine(5, seed=0)
        await core.on_experience(experience(engine, "held"), Record(0))
        held = core.experience.items["held"]
        state = {  # what LearnerCore.checkpoint wrote until 2026-11-27
            "offsets": {},
            "experience": [["held", held.at, held.size, held.message.model_dump(), held.record]],
            "feedback": [],
            "clock": core.clock,
            "done": [["q1", 1.0]],
            "window_backlog": [],
            "stats": {},
        }
        core.trainer.save(core.checkpoints, 1, state, {})
        core.checkpoints.close()
        resumed = learner(tmp_path, redis_server.url)
        assert list(resumed.experience) == ["held"] and resumed.experience.items["held"].message == held.message
        assert "q1" in resumed.done and resumed.version == 1

    asyncio.run(scenario())


def test_a_task_switch_raises_drift_events_on_the_outcome_and_the_models_and_detectors_survive_a_restart(
    tmp_path, redis_server
):
    """The worker answers 1 and every model predicts 1: right while the labels are 1, wrong after they switch to 0."""
    from rlens.drift import DriftMonitor

    async def scenario():
        await Redis.from_url(redis_server.url).flushdb()
        core = learner(tmp_path, redis_server.url, drift=DriftMonitor(), drift_keep=5)
        engine = FocalEngine(5, seed=0)
        events = []
        for i in range(400):
            await core.on_experience(experience(engine, f"d{i}", stream="switch"), Record(0))
            await core.on_feedback(fb(f"d{i}", "switch", label=1 if i < 200 else 0), Record(i))
            events += core.take_drift_events()
        await core.apply_windows()
        window = (await core.windows.load(["switch"]))["switch"]
        core.checkpoint()
        core.checkpoints.close()
        resumed = learner(tmp_path, redis_server.url, drift=DriftMonitor())
        return events, core, resumed, window

    events, core, resumed, window = asyncio.run(scenario())
    last = max(e.position for e in events)  # every signal counts one value per join here: positions are join counts
    assert core.stats.drift_reactions == len({e.position for e in events})
    assert window.n_rows == min(128, 5 + 400 - last)  # trimmed to 5 at the last detection, then filled again
    outcome = [e for e in events if e.signal == "outcome"]
    first = outcome[0].position
    assert outcome and 200 < first <= 260 and outcome[0].mean_before == 1.0
    # the last 20 values: those before the switch were right
    assert outcome[0].mean_after == pytest.approx(max(0, 200 - (first - 20)) / 20)
    assert (
        outcome[0].stream == "switch"
        and outcome[0].query_id == f"d{outcome[0].position - 1}"
        and outcome[0].detector == "adwin"
    )
    assert {e.signal for e in events} >= {"outcome", "model:m0", "model:m4"} and not [
        e for e in events if e.signal == "confidence"
    ]
    assert resumed.drift.to_json() == core.drift.to_json()  # the detectors' state came back with the checkpoint


def focal_policy(engine: FocalEngine, version: int, models: list[str], epoch: int = 1):
    return encode_policy(engine.policy_state(), version, epoch, models, "rl_focal", SIGNER)


def test_policies_are_verified_before_loading():
    engine, models = FocalEngine(3, seed=0), ["a", "b", "c"]
    good = focal_policy(FocalEngine(3, seed=1), 2, models)
    assert set(decode_policy(good, engine.policy_state(), models, "rl_focal", VERIFIER)) == set(engine.policy_state())
    blob = bytearray(base64.b64decode(good.weights_b64))
    blob[-1] ^= 0xFF  # one flipped byte in the weights
    tampered = good.model_copy(update={"weights_b64": base64.b64encode(bytes(blob)).decode()})
    with pytest.raises(PolicyError, match="SHA-256 mismatch"):
        decode_policy(tampered, engine.policy_state(), models, "rl_focal", VERIFIER)
    with pytest.raises(PolicyError, match="this pool is"):
        decode_policy(good, engine.policy_state(), ["a", "b", "x"], "rl_focal", VERIFIER)
    with pytest.raises(PolicyError, match="is an rl_focal policy, this worker runs rlae"):
        decode_policy(good, engine.policy_state(), models, "rlae", VERIFIER)
    # signed, for this pool, but a 4-model policy's tensors
    four_models = focal_policy(FocalEngine(4, seed=0), 2, models)
    with pytest.raises(PolicyError, match="do not fit this worker"):
        decode_policy(four_models, engine.policy_state(), models, "rl_focal", VERIFIER)


class Broken(Backend):
    def score_choices(self, query):
        raise BackendError("model server is down")


def test_worker_answers_with_cold_windows_and_without_failed_models(zoo, redis_server):
    async def scenario():
        backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
        backends[zoo.model_names[2]] = Broken()
        dead_redis = RedisWindows(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), 5, 128)
        core = FocalWorker(FocalEngine(5, seed=0), zoo.model_names, backends, dead_redis, VERIFIER, TOKENS)
        queries = [q for q, _ in queries_of(zoo, None, "t")[:8]]
        out = await core.handle(queries)
        assert len(out.answers) == 8 and core.stats.cold_window_batches == 1
        for answer in out.answers:
            assert zoo.model_names[2] not in answer.answered_models
            if zoo.model_names[2] in answer.called_models:
                assert (
                    answer.failures[0].model == zoo.model_names[2]
                    and "model server is down" in answer.failures[0].reason
                )
        # a newer verified policy is swapped in before the next batch, an older one is ignored
        core.receive_policy(focal_policy(FocalEngine(5, seed=7), 3, zoo.model_names))
        core.receive_policy(focal_policy(FocalEngine(5, seed=8), 2, zoo.model_names))
        assert core.policy_version == 0
        await core.handle(queries[:1])
        assert core.policy_version == 3 and torch.equal(
            core.engine.policy_state()["fusion.linear.weight"],
            FocalEngine(5, seed=7).policy_state()["fusion.linear.weight"],
        )

    asyncio.run(scenario())


def test_workers_share_each_streams_previous_pool_through_redis(zoo, redis_server):
    """The Decider's observation starts with the stream's previous pool: whichever worker answered the stream last,
    the next worker sees that pool, not its own stale one."""

    async def scenario():
        backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
        await Redis.from_url(redis_server.url).flushdb()
        first, second = (
            FocalWorker(
                FocalEngine(5, seed=s), zoo.model_names, backends, windows_for(redis_server.url), VERIFIER, TOKENS
            )
            for s in (0, 1)
        )
        queries = [q.model_copy(update={"stream": "shared"}) for q, _ in queries_of(zoo, None, "p")[:3]]
        await second.handle(queries[:1])
        with torch.no_grad():  # the first worker's Decider now calls only model 4
            first.engine.decider.heads.bias.fill_(-50.0)
            first.engine.decider.heads.bias[4] = 50.0
        await first.handle(queries[1:2])
        assert first.engine.previous_pool["shared"].tolist() == [False] * 4 + [True]
        out = await second.handle(queries[2:3])
        assert out.experience[0].decider_state[:5] == [0.0, 0.0, 0.0, 0.0, 1.0]  # the first worker's pool

    asyncio.run(scenario())


def test_shadow_calls_score_the_policy_to_roll_back_to_exactly_and_leave_the_served_answers_alone(zoo, redis_server):
    """A candidate published with ``shadow_calls`` (the learner's policy to roll back to) makes the worker call the
    models its pool needs beside the served pool's: its answer is known on every query, where without them only the
    probes knew it; the served answers stay the same."""

    def forced(engine: FocalEngine, models: list[int]) -> dict:
        with torch.no_grad():  # the Decider calls only these models
            engine.decider.heads.bias.fill_(-50.0)
            engine.decider.heads.bias[models] = 50.0
        return engine.policy_state()

    async def scenario():
        await Redis.from_url(redis_server.url).flushdb()
        backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
        candidate = forced(FocalEngine(5, seed=1), [4])
        outputs = {}
        for calls in (None, 1.0):
            engine = FocalEngine(5, config=FocalConfig(first_probes=0), seed=0)  # the coin's probes alone
            forced(engine, [0, 1])
            worker = FocalWorker(engine, zoo.model_names, backends, windows_for(redis_server.url), VERIFIER, TOKENS)
            policy = encode_policy(candidate, 1, 1, zoo.model_names, "rl_focal", SIGNER, "candidate", "", None, calls)
            assert worker.receive_policy(policy) is None
            stream = f"shadow-calls-{calls}"  # each its own stream: the same cold windows and previous pools
            queries = [q.model_copy(update={"stream": stream}) for q, _ in queries_of(zoo, None, "c")[:40]]
            outputs[calls] = await worker.handle(queries)
        plain, called = outputs[None], outputs[1.0]
        assert [a.answer_index for a in plain.answers] == [a.answer_index for a in called.answers]
        assert all(e.shadow is not None and e.shadow.pool == [False] * 4 + [True] for e in called.experience)
        assert all(e.shadow is not None and e.shadow.answer >= 0 for e in called.experience)
        assert all(zoo.model_names[4] in a.called_models for a in called.answers)
        unknown = [e for e in plain.experience if e.shadow is not None and e.shadow.answer < 0]
        assert len(unknown) >= 30  # all but the probes (5 %)
        assert called.shadow_calls == len(unknown) and plain.shadow_calls == 0  # one added call on each of those
        assert all(e.pool == [True, True, False, False, False] for e in called.experience)  # the served pool's

    asyncio.run(scenario())


def test_worker_rejects_a_backend_list_that_is_not_the_pool(zoo):
    with pytest.raises(ValueError, match="not the pool's models"):
        FocalWorker(FocalEngine(2), ["a", "b"], {"b": Broken(), "a": Broken()}, None, VERIFIER, TOKENS)


def test_query_messages_validate():
    with pytest.raises(ValueError):
        Query(query_id="", stream="s", prompt="p", choices=["a", "b"])
    with pytest.raises(ValueError, match="a label, a reference or a reward"):
        Feedback(query_id="q", token="t")


def test_asyncapi_document_and_message_schemas_are_in_sync():
    import json

    from rlens.messages import MESSAGES, SCHEMA_DIR
    from rlens.service.asyncapi import ASYNCAPI_PATH, asyncapi_document

    written, generated = json.loads(ASYNCAPI_PATH.read_text()), asyncapi_document()
    for part in ("channels", "operations"):
        assert set(written[part]) == set(generated[part]), (
            part,
            set(written[part]) ^ set(generated[part]),
            "run python -m rlens.service.asyncapi",
        )
        different = [name for name in written[part] if written[part][name] != generated[part][name]]
        assert not different, (part, different[:3], "run python -m rlens.service.asyncapi")
    assert written == generated, "run python -m rlens.service.asyncapi"
    for name, model in MESSAGES.items():
        assert json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text()) == model.model_json_schema(), (
            "run python -m rlens.service.asyncapi"
        )
    channels = asyncapi_document()["channels"]
    assert {c["address"] for c in channels.values()} == {
        "rlens.queries",
        "rlens.answers",
        "rlens.feedback",
        "rlens.experience",
        "rlens.policy",
        "rlens.dead-letter",
        "rlens.replies.gateway-id",
        "rlens.drift",
        "rlens.spending",
        "rlens.transitions",
    }


def test_a_streams_first_queries_call_every_model_whichever_worker_serves_them(zoo, redis_server):
    """A stream's first ``first_probes`` queries call the whole pool; the count is in Redis, so a second worker
    goes on from where the first left it, and the queries after them call the Decider's pool alone."""

    async def scenario():
        await Redis.from_url(redis_server.url).flushdb()
        backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
        config = FocalConfig(probe_rate=0.0, explore_rate=0.0)
        workers = []
        for seed in (0, 1):
            engine = FocalEngine(5, config=config, seed=seed)
            with torch.no_grad():  # the Decider calls only models 0 and 1
                engine.decider.heads.bias.fill_(-50.0)
                engine.decider.heads.bias[[0, 1]] = 50.0
            windows = windows_for(redis_server.url)
            workers.append(FocalWorker(engine, zoo.model_names, backends, windows, VERIFIER, TOKENS))
        queries = [q.model_copy(update={"stream": "new"}) for q, _ in queries_of(zoo, None, "f")[:30]]
        outs = [await workers[0].handle(queries[:10]), await workers[1].handle(queries[10:30])]
        calls = [len(a.called_models) for out in outs for a in out.answers]
        assert calls == [5] * config.first_probes + [2] * (30 - config.first_probes)
        assert [out.first_probes for out in outs] == [10, config.first_probes - 10]
        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry, StreamLabels(10))
        for batch, out, worker in zip((queries[:10], queries[10:30]), outs, workers):
            metrics.count_batch(batch, out, [], worker)
        assert registry.get_sample_value("rlens_worker_first_probes_total") == config.first_probes
        assert int(await Redis.from_url(redis_server.url).get(windows.asked_key("new"))) == config.first_probes

    asyncio.run(scenario())
