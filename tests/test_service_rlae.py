"""The rlae strategy of the streaming service on real models (the zoo's specialists, MiniLM): the worker answers
open-ended queries with the agent's span weights and isolates a query that cannot be decoded; the learner joins
experience with reference feedback, rewards exact match, updates the agent online, checkpoints and resumes
exactly, warm-starts from an offline run; and the whole path on the wire (tansu broker, redis-server, processes)."""

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from rlens.backends.hf import TransformersBackend
from rlens.checkpoint import CheckpointStore
from rlens.messages import DeadLetter, Feedback, Query
from rlens.rlae.agent import RLAEConfig, Span, make_policy
from rlens.rlae.decode import TokenEnsemble
from rlens.rlae.observe import obs_dim
from rlens.rlae.train import RLAEAgent, RLAETrainer
from rlens.service.common.kafka import Topics
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.gate import Gate, GateConfig
from rlens.local.load import open_ended_queries, play
from rlens.service.learner.online import RLAEOnlineTrainer
from rlens.service.worker.rlae import RLAEWorker
from rlens.local.stack import LocalStack, write_zoo_pool
from rlens.settings import settings
from rlens.zoo.tasks import exact_match, generation_split
from brokers import stack_for_tests
from trust import SIGNER, TOKENS, VERIFIER, token

MODELS = ["arith-char", "count-bpe", "order-char"]
CFG = RLAEConfig(span=2, max_tokens=6, episodes_per_update=8, rollout_batch=8, minibatch_size=8, hidden=16)
FAMILIES = ["arithmetic", "counting", "ordering"]


class Record:
    """A consumer record's coordinates (what the learner keeps of a feedback message)."""

    def __init__(self, offset: int, value: bytes = b"{}"):
        self.topic, self.partition, self.offset, self.key, self.value = "rlens.feedback", 0, offset, b"k", value


@pytest.fixture(scope="module")
def ensemble(quick_zoo):
    return TokenEnsemble([TransformersBackend.load(quick_zoo / name) for name in MODELS])


def new_worker(ensemble, encoder, explore: bool = True, seed: int = 0, split: float = 0.2) -> RLAEWorker:
    agent = RLAEAgent(make_policy(obs_dim(len(MODELS)), len(MODELS), CFG, seed=0), encoder, CFG, len(MODELS))
    return RLAEWorker(
        ensemble, agent, MODELS, None, VERIFIER, TOKENS, stop=["\n"], explore=explore, seed=seed, name="w", split=split
    )


def new_learner(tmp_path: Path, gate: Gate | None = None) -> LearnerCore:
    trainer = RLAEOnlineTrainer(
        make_policy(obs_dim(len(MODELS)), len(MODELS), CFG, seed=0), CFG, MODELS, seed=0, rehearsal=2
    )
    return LearnerCore(trainer, MODELS, None, CheckpointStore(tmp_path / "ckpt"), SIGNER, TOKENS, gate=gate)


def test_worker_answers_open_ended_queries_with_span_weights_and_isolates_a_failing_one(ensemble, encoder):
    worker = new_worker(ensemble, encoder, explore=False)
    tasks = generation_split(FAMILIES, 6, seed=3)
    queries = [q for q, _ in open_ended_queries(tasks, "t")]
    assert worker.rejects(queries[0]) is None
    assert "answers open-ended queries" in worker.rejects(
        Query(query_id="mc", stream="s", prompt="p", choices=["a", "b"])
    )
    assert "merges every model" in worker.rejects(Query(query_id="cap", stream="s", prompt="p", budget=0.5))
    too_long = Query(
        query_id="long",
        stream="s",
        prompt="Q: add: " + "1+" * (2 * max(b.max_length for b in ensemble.backends)) + "1=\nA:",
    )
    out = asyncio.run(worker.handle(queries[:3] + [too_long] + queries[3:]))
    # the same queries without the bad one
    alone = asyncio.run(new_worker(ensemble, encoder, explore=False).handle(queries))
    answers = {a.query_id: a for a in out.answers}
    assert (
        len(out.answers) == 7
        and len(out.experience) == 6
        and worker.stats.answered == 6
        and worker.stats.no_model_answered == 1
    )
    assert (
        answers["long"].answer == ""
        and answers["long"].answered_models == []
        and "exceeds the window" in answers["long"].failures[0].reason
    )
    for expected, experience in zip(alone.answers, out.experience):
        answer = answers[expected.query_id]
        assert (
            answer.strategy == "rlae"
            and answer.answer_index == -1
            and answer.answer == experience.text == expected.answer
        )
        assert answer.span_weights == expected.span_weights and len(experience.spans) == len(answer.span_weights) >= 1
        for span, weights in zip(experience.spans, answer.span_weights):
            assert sum(weights) == pytest.approx(1.0) and len(span.obs) == obs_dim(len(MODELS))
            # the experience holds the action that set the weights of its span
            np.testing.assert_allclose(
                worker.agent.policy.weights(torch.tensor(span.action)).numpy(), weights, atol=1e-6
            )


def test_learner_trains_the_agent_online_from_reference_feedback_and_workers_load_each_version(
    ensemble, encoder, tmp_path
):
    async def scenario():
        worker, core = new_worker(ensemble, encoder), new_learner(tmp_path)
        initial = {k: v.clone() for k, v in core.trainer.policy.state_dict().items()}
        tasks = generation_split(FAMILIES, 11, seed=4)
        out = await worker.handle([q for q, _ in open_ended_queries(tasks, "q")])
        experience = {e.query_id: e for e in out.experience}
        policies, dead = [], []
        # q-0: bare reward; q-1: only a label (dead letter); q-2 feedback before its experience; the rest references
        for i, task in enumerate(tasks):
            qid = f"q-{i}"
            feedback = (
                Feedback(query_id=qid, token=token(qid, experience[qid].stream), reward=0.5)
                if i == 0
                else Feedback(query_id=qid, token=token(qid, experience[qid].stream), label=1)
                if i == 1
                else Feedback(query_id=qid, token=token(qid, experience[qid].stream), reference=task.reference)
            )
            pair = [core.on_feedback(feedback, Record(i)), core.on_experience(experience[qid], Record(i))]
            for step in pair if i == 2 else pair[::-1]:
                policy, rejected = await step
                policies += [policy] if policy else []
                dead += [rejected] if rejected else []
        # duplicate feedback: ignored
        await core.on_feedback(
            Feedback(query_id="q-3", token=token("q-3", experience["q-3"].stream), reference="dup"), Record(99)
        )
        assert core.stats.joined == 10 and core.stats.duplicates == 1 and core.stats.invalid_feedback == 1
        # the rehearsal memory shares its budget of 2 among the streams of the update (those of q-0, q-2..q-8): each
        # keeps its latest episodes, at least one
        seen = [t.family for i, t in enumerate(tasks[:9]) if i != 1]
        share = max(1, 2 // len(set(seen)))
        assert {s: len(e) for s, e in core.trainer.memory.items()} == {s: min(share, seen.count(s)) for s in set(seen)}
        assert len(dead) == 1 and "needs a reference text or a reward, got only a label" in dead[0].reason
        assert [p.version for p in policies] == [1] and policies[0].strategy == "rlae" and core.trainer.episodes == 2
        rewards = core.stats.last_update["mean_reward"]
        expected = [0.5] + [float(exact_match(experience[f"q-{i}"].text, tasks[i].reference)) for i in range(2, 9)]
        assert rewards == pytest.approx(np.mean(expected))
        # the update changed the agent
        assert any(not torch.equal(initial[k], v) for k, v in core.trainer.policy.state_dict().items())
        worker.receive_policy(policies[0])
        await worker.handle([Query(query_id="next", stream="s", prompt=tasks[0].prompt)])
        assert worker.policy_version == 1
        assert all(
            torch.equal(core.trainer.policy.state_dict()[k], v) for k, v in worker.agent.policy.state_dict().items()
        )
        # a checkpoint with two episodes buffered resumes to the very same next update
        core.checkpoint()
        core.checkpoints.close()
        resumed = new_learner(tmp_path)
        assert (
            resumed.version == 1
            and resumed.trainer.episodes == 2
            and resumed.stats == core.stats
            and "q-10" in resumed.done
        )
        for _ in range(6):
            for c in (core, resumed):
                c.trainer.remember(experience["q-5"], Feedback(query_id="q-5", token="t", reward=1.0), 1.0)
        remembered = sum(len(e) for e in resumed.trainer.memory.values())
        stats = core.trainer.update()
        assert stats == pytest.approx(resumed.trainer.update()) and stats["rehearsed"] == remembered > 0
        assert all(
            torch.equal(resumed.trainer.policy.state_dict()[k], v) for k, v in core.trainer.policy.state_dict().items()
        )

    asyncio.run(scenario())


async def serve_split(worker, core, queries, rewards: dict[bool, float]):
    """One batch answered, each answer rewarded by the arm of the A/B split that served it (0.5 outside a split); the
    learner's policies, published to the worker."""
    out = await worker.handle(queries)
    for e in out.experience:
        reward = rewards[e.split.candidate] if e.split is not None else 0.5
        await core.on_experience(e, Record(0))
        await core.on_feedback(
            Feedback(query_id=e.query_id, token=token(e.query_id, e.stream), reward=reward), Record(0)
        )
    published = core.take_policies()
    for policy in published:
        assert worker.receive_policy(policy) is None
    return out, published


def test_gated_rlae_a_candidate_serves_a_random_share_and_is_promoted_then_rolled_back_on_the_split(
    ensemble, encoder, tmp_path
):
    """Gated promotion for rlae: the learner's update is a candidate, not live; the worker serves it on a random
    share of the queries (each marked with the split and the candidate's version) and the champion on the rest; the
    gate promotes it on the two arms' rewards, then judges the champion it replaced the same way and rolls back to
    it when that one earns more. The rewards are set by the test, so the verdicts are known."""

    async def scenario():
        gate = Gate(GateConfig(min_events=12, max_events=400, every=4, delta=0.02, split=0.5))
        worker, core = new_worker(ensemble, encoder, split=0.1, seed=1), new_learner(tmp_path, gate)
        tasks = generation_split(FAMILIES, 80, seed=6)
        queries = [q for q, _ in open_ended_queries(tasks, "g")]
        # no candidate yet: the champion serves every query, no split; the first update is a candidate, not live
        out, published = await serve_split(worker, core, queries[:8], {})
        assert all(e.split is None and e.policy_version == 0 for e in out.experience)
        assert [(p.stage, p.version) for p in published] == [("candidate", 1)] and core.stats.updates == 1
        candidate = published[0]
        # the candidate serves about half of the queries, the champion the rest, each answer with its version
        out, published = await serve_split(worker, core, queries[8:40], {True: 1.0, False: 0.0})
        served = [(e.split.candidate, e.policy_version, e.split.version) for e in out.experience]
        assert all(version == 1 for _, _, version in served)
        assert {(candidate, version) for candidate, version, _ in served} == {(True, 1), (False, 0)}
        assert 8 <= sum(candidate for candidate, _, _ in served) <= 24
        answers = {a.query_id: a.policy_version for a in out.answers}
        assert all(answers[e.query_id] == e.policy_version for e in out.experience)
        for e in out.experience:  # each arm's spans were drawn from its own policy: their logged densities say so
            span = e.spans[0]
            obs, action = torch.tensor([span.obs]), torch.tensor([span.action])
            agents = (worker.candidate_agent, worker.agent)[:: 1 if e.split.candidate else -1]
            with torch.no_grad():
                own, other = (float(agent.policy.evaluate(obs, action)[0][0]) for agent in agents)
            assert own == pytest.approx(span.logp, abs=1e-4) and other != pytest.approx(span.logp, abs=1e-4)
        # the candidate earned more: promoted (live), and the champion it replaced is the next candidate
        assert core.stats.promotions == 1 and [p.stage for p in published] == ["live", "candidate"]
        assert published[0].version == 1 and "promoted" in published[0].note
        # the weights judged, though the learner trained on meanwhile (2 more updates)
        assert published[0].sha256 == candidate.sha256 and core.stats.updates == 5
        probation = published[1].version
        out, published = await serve_split(worker, core, queries[40:80], {True: 1.0, False: 0.0})
        assert worker.policy_version == 1  # the promoted one, which served the rest
        assert {e.policy_version for e in out.experience if e.split and e.split.candidate} == {probation}
        # the replaced champion earned more on its share: rolled back to it
        assert core.stats.rollbacks == 1 and published[0].stage == "live" and published[0].version == probation
        assert "rolled back" in published[0].note

    asyncio.run(scenario())


def test_holdback_rlae_every_update_serves_at_once_beside_the_champion_and_a_worse_line_is_rolled_back(
    ensemble, encoder, tmp_path
):
    """Holdback promotion for rlae: each update is the candidate at once and serves most of the queries (the newest
    replacing the one before), the champion the holdback share; when the champion's share earns more, the learner's
    line is rolled back: the champion served everywhere again under a newer number, and the learner reset to it. A
    line that earns as much becomes the champion. The rewards are set by the test, so the verdicts are known."""

    async def scenario():
        gate = Gate(GateConfig(min_events=6, max_events=400, every=1, delta=0.02, split=0.5, holdback=0.25))
        worker, core = new_worker(ensemble, encoder, split=0.1, seed=1), new_learner(tmp_path, gate)
        champion = core.trainer.policy_tensors()  # the seeded weights the worker serves
        loaded, load = [], core.trainer.load_policy
        core.trainer.load_policy = lambda tensors: (loaded.append(tensors), load(tensors))  # a spy on the reset
        tasks = generation_split(FAMILIES, 160, seed=7)
        queries = [q for q, _ in open_ended_queries(tasks, "h")]
        out, published = await serve_split(worker, core, queries[:8], {})
        assert all(e.split is None for e in out.experience)
        assert [(p.stage, p.version) for p in published] == [("candidate", 1)]
        # the line serves about 3 in 4 queries; each update replaces the candidate, the evidence goes on
        served, history, at = [], [], 8
        while core.stats.rollbacks == 0 and at < 120:
            out, published = await serve_split(worker, core, queries[at : at + 8], {True: 0.0, False: 1.0})
            served += [(e.split.candidate, e.policy_version) for e in out.experience if e.split is not None]
            history += published
            at += 8
        candidates = [p for p in history[: [p.stage for p in history].index("live")] if p.stage == "candidate"]
        assert core.stats.rollbacks == 1 and core.stats.promotions == 0
        assert {version for candidate, version in served if not candidate} == {0}
        assert len({version for candidate, version in served if candidate}) >= 2  # several updates, one line
        assert 0.6 <= np.mean([candidate for candidate, _ in served]) <= 0.9
        stages = [p.stage for p in history]
        live = history[stages.index("live")]
        assert stages.count("live") == 1 and "line rolled back" in live.note
        assert live.version > max(p.version for p in history[: stages.index("live")])  # above the line's
        assert len(loaded) == 1 and all(torch.equal(champion[k], v) for k, v in loaded[0].items())  # reset to it
        out, _ = await serve_split(worker, core, queries[at : at + 4], {True: 0.0, False: 1.0})
        assert worker.policy_version == live.version
        assert {e.split.version for e in out.experience if e.split is not None} <= {
            p.version for p in history[stages.index("live") :]
        }
        # no longer trusted: the next update is a challenger on the small share, promoted when not worse; the update
        # after it starts a new line
        history = []
        for start in range(at + 4, len(queries), 8):
            out, published = await serve_split(worker, core, queries[start : start + 8], {True: 1.0, False: 1.0})
            history += published
            if core.stats.promotions and any(p.stage == "candidate" for p in history[-len(published) :]):
                break
        stages = [p.stage for p in history]
        assert core.stats.promotions == 1 and stages.count("live") == 1
        promoted = history[stages.index("live")]
        challenger = [p for p in history[: stages.index("live")] if p.stage == "candidate"][-1]
        assert challenger.share == 0.5 and "promoted" in promoted.note and promoted.sha256 == challenger.sha256
        assert [p.share for p in history[stages.index("live") + 1 :]] == [0.75]  # the next line
        assert all(p.share == 0.75 for p in candidates)

    asyncio.run(scenario())


def test_a_restarted_learner_judges_on_where_its_checkpoint_left_off(tmp_path):
    """The gate is in the learner's checkpoint: after a restart the champion, the candidate (its weights, its
    evidence) and whether the learner's updates serve at once are as they were, and the workers' answers for that
    candidate count on. A promotion that went out between the checkpoint and the stop is read back from the policy
    topic: the candidate is the champion, and the one it replaced goes on probation. A fresh learner trusts its
    updates."""
    config = GateConfig(min_events=50, max_events=50, every=25, split=0.5, holdback=0.25)
    core = new_learner(tmp_path, Gate(config))
    gate = core.promotion.gate
    seeded = gate.champion_tensors  # what the workers start from
    gate.trusted = False  # after a roll back: its updates are challengers
    core.numbers.next()  # an update: v1
    core.promotion.updated()
    (candidate,) = core.take_policies()
    assert candidate.share == 0.5 and gate.kind == "challenger"
    gate.evidence.candidate += [1.0, 0.0, 1.0]
    gate.evidence.champion += [0.0, 1.0]
    core.checkpoint()
    promoted = core.promotion.encode(gate.candidate_tensors, 1, "live", note="promoted")  # out after the checkpoint
    core.checkpoints.close()  # the learner stops

    restarted = new_learner(tmp_path, Gate(config))
    again = restarted.promotion.gate
    assert restarted.epoch != core.epoch and not again.trusted
    assert (again.candidate, again.kind, again.line, again.champion) == (gate.candidate, "challenger", gate.line, None)
    assert again.evidence == gate.evidence
    for theirs, ours in ((gate.candidate_tensors, again.candidate_tensors), (seeded, again.champion_tensors)):
        assert ours is not None and all(torch.equal(v, ours[k]) for k, v in theirs.items())
    assert restarted.announcement() is None  # nothing promoted yet: the workers keep the seeded weights
    restarted.on_policy(promoted)
    assert again.champion == (core.epoch, 1) and again.kind == "challenger" and again.candidate is None
    assert again.trusted is False and restarted.take_policies() == []  # holdback: no probation, a challenger next
    restarted.checkpoint()
    restarted.checkpoints.close()
    fresh = new_learner(tmp_path / "fresh", Gate(config))
    assert fresh.promotion.gate.trusted
    fresh.checkpoints.close()
    gated = new_learner(tmp_path, Gate(replace(config, holdback=None)))  # RLENS_PROMOTION changed: champion only
    kept = gated.promotion.gate
    assert kept.champion == (core.epoch, 1) and kept.candidate is None and len(kept.evidence) == 0 and kept.trusted
    gated.checkpoints.close()


def test_a_restarted_gated_learner_puts_a_champion_whose_promotion_it_missed_on_probation(tmp_path):
    config = GateConfig(min_events=50, max_events=50, every=25, split=0.5)
    core = new_learner(tmp_path, Gate(config))
    seeded = core.promotion.gate.champion_tensors
    core.numbers.next()  # an update: v1
    core.promotion.updated()
    core.take_policies()
    core.checkpoint()
    promoted = core.promotion.encode(core.promotion.gate.candidate_tensors, 1, "live", note="promoted")
    core.checkpoints.close()
    restarted = new_learner(tmp_path, Gate(config))
    restarted.on_policy(promoted)
    gate = restarted.promotion.gate
    (probation,) = restarted.take_policies()
    assert gate.champion == (core.epoch, 1) and gate.kind == "probation" and probation.stage == "candidate"
    assert (probation.epoch, probation.version) == gate.candidate == (restarted.epoch, 2)
    assert all(torch.equal(v, gate.candidate_tensors[k]) for k, v in seeded.items())  # the one it replaced
    restarted.checkpoints.close()


def test_learner_warm_starts_from_an_offline_run_of_the_same_models_and_settings(ensemble, encoder, tmp_path):
    offline = RLAETrainer(ensemble, encoder, MODELS, replace(CFG, episodes=8), tmp_path / "run", seed=1)
    offline.run(generation_split(FAMILIES, 8, seed=5))
    core = new_learner(tmp_path)
    core.warm_start(tmp_path / "run")
    assert core.version == 1 and (tmp_path / "ckpt" / "LATEST").read_text().startswith("v00000001")
    assert all(torch.equal(offline.policy.state_dict()[k], v) for k, v in core.trainer.policy.state_dict().items())
    other_span = RLAEOnlineTrainer(make_policy(obs_dim(3), 3, replace(CFG, span=4)), replace(CFG, span=4), MODELS)
    with pytest.raises(ValueError, match="the settings ask for"):
        other_span.warm_start(tmp_path / "run")
    other_observation = RLAEOnlineTrainer(make_policy(obs_dim(3), 3, CFG), replace(CFG, observe="text"), MODELS)
    with pytest.raises(ValueError, match="'observe': 'prompt'.*_OBSERVE"):  # its inputs would mean something else
        other_observation.warm_start(tmp_path / "run")
    other_models = RLAEOnlineTrainer(make_policy(obs_dim(3), 3, CFG), CFG, ["a", "b", "c"])
    with pytest.raises(ValueError, match="was trained on models"):
        other_models.warm_start(tmp_path / "run")
    with pytest.raises(ValueError, match="holds no RLAE checkpoint"):
        other_models.warm_start(tmp_path / "empty")


# a MAPPO policy (1.4 MB here) exceeds Kafka's default 1 MB message size
@pytest.mark.kafka
@pytest.mark.parametrize("variant", ["ppo", "mappo"])
def test_on_the_wire_open_ended_queries_are_answered_learned_from_and_new_policies_reach_the_workers(
    quick_zoo, tmp_path, variant
):
    pool = write_zoo_pool(quick_zoo, MODELS, tmp_path / "pool.json")
    config = settings().updated(
        {
            "pool_file": pool,
            "strategy": "rlae",
            "rlae_variant": variant,
            "rlae_span": 2,
            "rlae_max_tokens": 6,
            "rlae_update_episodes": 16,
            "worker_batch": 8,
            "kafka_session_timeout_ms": 2000,
            "kafka_heartbeat_ms": 500,
        }
    )
    stack = stack_for_tests(config, tmp_path)
    stack.start_learner()
    stack.start_worker()
    stack.start_gateway()
    topics = Topics.from_settings(stack.settings)
    tasks = generation_split(FAMILIES, 52, seed=6)

    async def scenario():
        producer = AIOKafkaProducer(bootstrap_servers=stack.settings.kafka.bootstrap)
        await producer.start()
        await producer.send_and_wait(
            topics.queries, Query(query_id="mc", stream="s", prompt="p", choices=["a", "b"]).model_dump_json().encode()
        )
        await producer.stop()
        first = await play(stack.settings, open_ended_queries(tasks[:48], "a"), rate=50, idle_timeout_s=90)
        await asyncio.sleep(3.0)  # the third policy reaches the worker
        then = await play(stack.settings, open_ended_queries(tasks[48:], "b"), rate=50, idle_timeout_s=60)
        through_gateway = await ask_the_gateway(stack, tasks[0])
        consumer = AIOKafkaConsumer(
            topics.dead_letter,
            bootstrap_servers=stack.settings.kafka.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        dead: list[DeadLetter] = []
        deadline = time.time() + 30
        while time.time() < deadline and not dead:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                dead += [DeadLetter.model_validate_json(r.value) for r in records]
        await consumer.stop()
        return first, then, dead, through_gateway

    try:
        stack.wait_ready(120)
        first, then, dead, (reply, chunks, feedback) = asyncio.run(scenario())
        learner = next(u for name, u in stack.http_urls().items() if name.startswith("learner:"))
        deadline = time.time() + 60  # the gateway's feedback reaches the learner (later on a busy machine)
        while (dashboard := httpx.get(f"{learner}/api/dashboard", timeout=10).json())[
            "joined"
        ] < 53 and time.time() < deadline:
            time.sleep(0.5)
    finally:
        stack.stop()
    directory = stack.settings.learner.checkpoint_dir
    state = json.loads((directory / (directory / "LATEST").read_text() / "state.json").read_text())
    assert first.answered == 48 and first.duplicates == 0 and first.no_answer == 0 and then.answered == 4
    # 52 + the gateway's rated one; 53 - 3 x 16 not yet trained on
    assert state["stats"]["joined"] == 53 and state["stats"]["updates"] == 3 and state["fresh"] == 5
    assert then.policy_versions == {3}  # the workers run the learner's newest version
    assert [d.reason for d in dead] == [
        "multiple-choice query: the rlae worker answers open-ended queries (no choices) only"
    ]
    weights = reply.model_extra["rlens"]["span_weights"]
    assert (
        weights
        and all(len(w) == len(MODELS) and abs(sum(w) - 1) < 1e-3 for w in weights)
        and reply.choices[0].finish_reason in ("stop", "length")
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].model_extra["rlens"]["span_weights"]
    assert feedback == (202, "accepted")
    assert dashboard["strategy"] == "rlae" and dashboard["joined"] == 53 and len(dashboard["policies"]) == 3
    points = [p for s in dashboard["streams"] for p in s["points"]]
    assert points and all(abs(sum(p["composition"]) - 1) < 1e-3 for p in points)  # each model's mean weight


async def ask_the_gateway(stack: LocalStack, task) -> tuple:
    """An open-ended request through the gateway with the official client (plain and streamed), and its feedback."""
    url = next(u for name, u in stack.http_urls().items() if name.startswith("gateway:"))
    key = stack.gateway_key.read_text().strip()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    reply = await client.completions.create(
        model="rlens-rlae", prompt=task.prompt, extra_body={"metadata": {"stream": task.family}}
    )
    stream = await client.chat.completions.create(
        model="rlens-rlae", messages=[{"role": "user", "content": task.prompt}], stream=True
    )
    chunks = [chunk async for chunk in stream]
    with pytest.raises(openai.NotFoundError, match="this deployment does not run rlens-focal"):
        await client.chat.completions.create(
            model="rlens-focal",
            messages=[{"role": "user", "content": "q"}],
            extra_body={"rlens": {"choices": ["a", "b"]}},
        )
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
        response = await http.post("/v1/feedback", json={"id": reply.id, "reference": task.reference})
    return reply, chunks, (response.status_code, response.json()["status"])


def test_cli_errors_for_bad_open_ended_traffic_and_strategy(tmp_path):
    from typer.testing import CliRunner

    from rlens.cli import app

    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"prompt": "Q: add: 1+1=\\nA:", "reference": "2"}\n{"prompt": "no reference"}\n')
    result = CliRunner().invoke(app, ["load", "--tasks", str(bad)])
    assert result.exit_code == 2 and f"{bad}:2: not a task line" in result.output
    result = CliRunner().invoke(app, ["up", "--strategy", "rl_focus"])
    assert result.exit_code == 2 and "--strategy must be rl_focal or rlae" in result.output
    result = CliRunner().invoke(
        app,
        ["up", "--strategy", "rlae", "--zoo-models", "no-such-model", "--workdir", str(tmp_path / "up")],
        env={"RLENS_ZOO_DIR": str(tmp_path)},
    )
    assert result.exit_code == 2 and "build the zoo first" in result.output


def test_the_rehearsal_budget_is_shared_by_the_streams():
    """``rehearsal`` episodes in all: one stream keeps that many of its latest, two streams half each."""
    trainer = RLAEOnlineTrainer(
        make_policy(obs_dim(len(MODELS)), len(MODELS), CFG, seed=0), CFG, MODELS, seed=0, rehearsal=4
    )
    rng = np.random.default_rng(0)

    def episodes(stream: str, n: int) -> list:
        made = []
        for i in range(n):
            span = Span(
                rng.normal(size=obs_dim(len(MODELS))).astype(np.float32),
                np.full(len(MODELS), 1 / len(MODELS), np.float32),
                -1.0,
                0.0,
                reward=float(i % 2),
                last=True,
            )
            made.append((stream, [span]))
        return made

    trainer.fresh = episodes("a", 6)
    trainer.update()
    assert {s: len(kept) for s, kept in trainer.memory.items()} == {"a": 4}
    assert trainer.memory["a"][-1][0].reward == 1.0  # the latest kept: the 6th episode
    trainer.fresh = episodes("b", 6)
    trainer.update()
    assert {s: len(kept) for s, kept in trainer.memory.items()} == {"a": 2, "b": 2}
