"""Policy versions: the policy topic read as the workers read it (served, find, the one before, the next order), an
operator's republished policy (signed, taken by a worker), reward and accuracy per version (hand-computed), and the
learner adopting an operator's policy: a forced bad one is rolled back on its own (gated)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from bench.robustness.gate import SIGNER, VERIFIER, simulate
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.messages import Policy
from rlens.service.common.policy import PolicyError, PolicyHistory, decode_policy, encode_policy
from rlens.service.common.security import PolicySigner, generate_secrets
from rlens.service.learner.gate import GateConfig
from rlens.service.learner.versions import VersionStats

MODELS = ["a", "b", "c"]


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return FocalEngine(3, [1.0, 1.0, 1.0], FocalConfig(), seed=seed).policy_state()


def published(seed: int, version: int, epoch: int = 100, stage: str = "live", signer=SIGNER) -> bytes:
    policy = encode_policy(tensors(seed), version, epoch, MODELS, "rl_focal", signer, stage)
    return policy.model_dump_json().encode()


def test_the_whole_policy_is_signed_but_its_weights_encoding():
    """Every field but the signature and the weights' base64 (their SHA-256 is signed): a change to any is a bad
    signature, the time it was published included (issue 60: a replayed operator's policy with a fresh time). An unset
    ``shadow_calls`` is not in the signed bytes (a policy signed before the field existed verifies), a set one is."""
    policy = Policy.model_validate_json(published(0, 3))
    fields = policy.model_dump(mode="json", exclude={"signature", "weights_b64", "shadow_calls"})
    assert policy.signed_bytes() == json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
    assert VERIFIER.verify(policy.signed_bytes(), policy.signature)
    for change in (
        {"created_at": policy.created_at + 60},
        {"version": 4},
        {"epoch": 101},
        {"stage": "candidate"},
        {"origin": "operator"},
        {"note": "x"},
        {"share": 0.5},
        {"shadow_calls": 1.0},
        {"models": ["a", "c", "b"]},
        {"sha256": "0" * 64},
    ):
        assert not VERIFIER.verify(policy.model_copy(update=change).signed_bytes(), policy.signature), change


def test_a_candidates_share_is_signed_so_that_it_cannot_be_changed_on_the_way():
    """rlae: the share of the queries a candidate serves is the learner's, signed with it; a worker rejects the
    same policy with another share."""
    policy = encode_policy(tensors(0), 3, 100, MODELS, "rl_focal", SIGNER, "candidate", share=0.8)
    decode_policy(policy, tensors(1), MODELS, "rl_focal", VERIFIER)
    with pytest.raises(PolicyError, match="signature"):
        decode_policy(policy.model_copy(update={"share": 0.99}), tensors(1), MODELS, "rl_focal", VERIFIER)


def test_a_replayed_operators_policy_is_never_adopted_again(tmp_path, redis_server):
    """Issue 60: an old `rlens policy rollback` record published again, as it was or with a fresh time, changes
    nothing: operators' policies are ordered by their signed (epoch, version), and the time is signed."""
    from redis.asyncio import Redis

    from rlens.checkpoint import CheckpointStore
    from rlens.service.common.windows import RedisWindows
    from rlens.service.learner.core import LearnerCore
    from rlens.service.learner.online import FocalOnlineTrainer
    from trust import TOKENS

    core = LearnerCore(
        FocalOnlineTrainer(FocalEngine(3, [1.0, 1.0, 1.0], FocalConfig(), seed=0), MODELS),
        MODELS,
        RedisWindows(Redis.from_url(redis_server.url), 3, 16),
        CheckpointStore(tmp_path / "ckpt"),
        SIGNER,
        TOKENS,
    )
    history = PolicyHistory.of([published(1, 1), published(2, 2)], VERIFIER)
    rollback = history.republish(history.find(1), SIGNER, "rolled back to v1 by an operator")  # v3
    later = PolicyHistory.of([published(1, 1), published(2, 2), rollback.model_dump_json().encode()], VERIFIER)
    promote = later.republish(later.find(2), SIGNER, "promoted v2 by an operator")  # v4
    core.on_policy(rollback)
    core.on_policy(promote)
    assert core.operator_seen == (100, 4)
    weights = {k: v.clone() for k, v in core.trainer.policy_tensors().items()}
    assert core.on_policy(rollback) == [] and core.operator_seen == (100, 4)
    fresh = rollback.model_copy(update={"created_at": rollback.created_at + 3600})
    assert core.on_policy(fresh) == [] and core.operator_seen == (100, 4)
    assert all(torch.equal(v, weights[k]) for k, v in core.trainer.policy_tensors().items())
    core.checkpoints.close()


def test_the_history_reads_the_topic_as_the_workers_do():
    forger = PolicySigner(generate_secrets()["RLENS_POLICY_SIGNING_KEY"])
    history = PolicyHistory.of(
        [
            published(0, 1, epoch=100),
            published(1, 2, epoch=100),
            published(1, 3, epoch=100, stage="candidate"),
            b"not json",
            published(2, 9, epoch=100, signer=forger),
            published(1, 1, epoch=200),  # a restarted learner announces the weights of v2 under its epoch
            published(3, 2, epoch=200, stage="candidate"),
        ],
        VERIFIER,
    )
    assert [(p.epoch, p.version) for p in history.policies] == [(100, 1), (100, 2), (100, 3), (200, 1), (200, 2)]
    assert len(history.rejected) == 2 and "bad signature" in history.rejected[1]
    served = history.served()
    assert served is not None and (served.epoch, served.version) == (200, 1)
    before = history.before_served()  # v2 of epoch 100 has the same weights: the one before is v1
    assert before is not None and (before.epoch, before.version) == (100, 1)
    assert history.find(2).epoch == 200 and history.find(2, epoch=100).stage == "live"
    with pytest.raises(PolicyError, match="no policy v7"):
        history.find(7)
    assert history.next_order() == (200, 3)


def test_an_operators_policy_is_signed_and_served_by_a_worker():
    history = PolicyHistory.of([published(0, 1), published(1, 2), published(2, 3, stage="candidate")], VERIFIER)
    candidate = history.find(3)
    promoted = history.republish(candidate, SIGNER, "promoted v3 by an operator")
    assert (promoted.epoch, promoted.version, promoted.stage, promoted.origin) == (100, 4, "live", "operator")
    assert promoted.sha256 == candidate.sha256 and VERIFIER.verify(promoted.signed_bytes(), promoted.signature)
    loaded = decode_policy(promoted, tensors(9), MODELS, "rl_focal", VERIFIER)
    assert all(torch.equal(loaded[k], v) for k, v in tensors(2).items())
    altered = promoted.model_copy(update={"note": "promoted by someone else"})  # the note is signed too
    assert not VERIFIER.verify(altered.signed_bytes(), altered.signature)
    assert PolicyHistory.of([], VERIFIER).next_order()[1] == 1


def test_reward_and_accuracy_per_version_by_hand():
    stats = VersionStats(keep=2)
    for reward, correct in ((1.0, True), (0.0, False), (1.0, True)):
        assert stats.observe(5, reward, correct) is None
    stats.observe(6, 0.5, None)
    row = stats.rows()[0]
    # mean 2/3, sample sd sqrt(1/3), half-width 1.96 sqrt(1/3) / sqrt(3) = 0.6533
    assert row["events"] == 3 and row["reward"] == pytest.approx(2 / 3)
    assert row["reward_high"] - row["reward"] == pytest.approx(1.96 / 3, abs=1e-4)
    # Wilson, p = 2/3, n = 3, z = 1.96: centre (0.6667 + 0.6403) / 2.2805 = 0.5731, spread 0.8334 / 2.2805 = 0.3654
    assert row["accuracy"] == pytest.approx(2 / 3)
    assert row["accuracy_low"] == pytest.approx(0.5731 - 0.3654, abs=1e-3)
    assert row["accuracy_high"] == pytest.approx(0.5731 + 0.3654, abs=1e-3)
    assert stats.rows()[1]["accuracy"] is None and math.isclose(stats.rows()[1]["reward"], 0.5)
    assert stats.observe(7, 1.0, True) == 5  # the oldest version is let go
    again = VersionStats(keep=2)
    again.load_json(json.loads(json.dumps(stats.to_json())))
    assert again.rows() == stats.rows()


def test_a_bad_policy_an_operator_forces_live_is_rolled_back(zoo, redis_server, tmp_path):
    """Gated: the warm-started champion serves; an operator forces weights whose Fusion is turned upside down; the
    learner puts the champion it replaced on probation and rolls back to it on the evidence."""
    gate = GateConfig(min_events=200, max_events=2000, every=25, delta=0.02)
    run = simulate(zoo, redis_server.url, tmp_path, gate, warm=True, sabotage=False, n=2400, forced_at=1200)
    versions = [version for version, _ in run.served]
    assert run.forced is not None and run.core.stats.rollbacks >= 1 and run.core.operator_seen > (0, 0)
    forced = versions.index(run.forced)
    back = forced + versions.count(run.forced)  # served only until the learner rolled it back
    assert back < len(versions) and all(v > run.forced for v in versions[back:])
    during = np.mean([ok for _, ok in run.served[forced:back]])
    after = np.mean([ok for _, ok in run.served[back:]])
    assert after > during + 0.15, (during, after)  # the forced policy was bad, and it is gone


def test_without_the_gate_an_operators_policy_is_served_and_trained_on(zoo, redis_server, tmp_path):
    """Direct promotion: the forced policy serves until the learner's next update, which starts from its weights."""
    run = simulate(zoo, redis_server.url, tmp_path, None, warm=False, sabotage=False, n=900, forced_at=448)
    versions = [version for version, _ in run.served]
    assert run.forced in versions and run.core.operator_seen > (0, 0) and run.core.stats.rollbacks == 0
    assert max(versions) > run.forced  # the learner's next versions supersede it
