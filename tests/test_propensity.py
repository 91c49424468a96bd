"""The behaviour the worker logs for off-policy evaluation: the serving mixture's propensity of what it served, by
hand-computed cases and against the frequencies of many queries answered by a real worker."""

import asyncio
import math
from collections import Counter

import numpy as np
import pytest
from redis.asyncio import Redis

from rlens.backends import create_backend
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.propensity import serving_propensity
from rlens.local.load import queries_of
from rlens.service.common.windows import RedisWindows
from rlens.service.worker.core import FocalWorker
from trust import TOKENS, VERIFIER


def test_serving_propensity_by_hand():
    # explored branch only: the sampled pool and answer are not the greedy ones
    assert serving_propensity(0.1, math.log(0.2), math.log(0.5), False, True) == pytest.approx(0.1 * 0.2 * 0.5)
    # the greedy action: the greedy branch (0.9) plus the chance the explored branch drew it (0.1 * 0.6 * 0.7)
    assert serving_propensity(0.1, math.log(0.6), math.log(0.7), True, True) == pytest.approx(0.9 + 0.042)
    # the greedy pool with another answer: only the explored branch
    assert serving_propensity(0.25, math.log(0.6), math.log(0.1), True, False) == pytest.approx(0.25 * 0.06)
    assert serving_propensity(0.0, math.log(0.6), math.log(0.7), True, True) == 1.0  # no exploration
    assert serving_propensity(1.0, 0.0, math.log(0.3), True, True) == pytest.approx(0.3)  # always explored
    with pytest.raises(ValueError):
        serving_propensity(1.5, 0.0, 0.0, True, True)


def test_logged_propensities_match_the_frequencies_of_served_actions(zoo):
    """4,000 queries of one question, each on a stream of its own (cold windows, no previous pool, no budget: one
    state), half explored: each served (pool, answer) comes up as often as its logged propensity says."""

    async def scenario():
        backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
        dead = RedisWindows(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), 5, 128)
        engine = FocalEngine(5, config=FocalConfig(explore_rate=0.5, probe_rate=0.0, budget=None), seed=3)
        worker = FocalWorker(engine, zoo.model_names, backends, dead, VERIFIER, TOKENS)
        template = queries_of(zoo, None, "t")[7][0]
        n = 4000
        queries = [template.model_copy(update={"query_id": f"q{i}", "stream": f"s{i}"}) for i in range(n)]
        experience = []
        for start in range(0, n, 250):
            experience += (await worker.handle(queries[start : start + 250])).experience
        return experience

    experience = asyncio.run(scenario())
    served = Counter((tuple(e.pool), e.answer_index) for e in experience)
    logged = {}
    for e in experience:
        logged.setdefault((tuple(e.pool), e.answer_index), set()).add(round(e.behaviour.propensity, 5))
    assert all(len(values) == 1 for values in logged.values())  # one state: one propensity per action (float32 or 64)
    assert sum(next(iter(v)) for v in logged.values()) <= 1.0 + 1e-9
    common = [action for action, count in served.items() if count >= 40]
    assert len(common) >= 3 and any(not experience[0].behaviour.greedy_pool == list(a[0]) for a in common)
    for action in common:
        frequency = served[action] / len(experience)
        assert frequency == pytest.approx(next(iter(logged[action])), abs=0.025), action
    greedy_rows = [e for e in experience if not e.explored]
    assert greedy_rows and all(e.pool == e.behaviour.greedy_pool for e in greedy_rows)
    assert all(e.answer_index == e.behaviour.greedy_answer for e in greedy_rows)
    first = experience[0].behaviour
    assert first.explore_rate == 0.5 and not first.probe
    called = [len(row) > 0 for row in first.model_probs]
    assert called == experience[0].pool or first.probe  # no probes: exactly the pool's models answered
    assert all(abs(sum(row) - 1) < 1e-3 for row in first.model_probs if row)
    explored_greedy = [e for e in experience if e.explored and e.pool == e.behaviour.greedy_pool]
    assert explored_greedy and all(e.behaviour.greedy_answer >= 0 for e in explored_greedy)
    assert np.mean([e.explored for e in experience]) == pytest.approx(0.5, abs=0.03)


def test_without_ope_logging_a_worker_logs_no_behaviour_and_no_shadow_and_gated_promotion_refuses_it(zoo, tmp_path):
    """``RLENS_OPE_LOGGING=false``: the same answers, the experience without its behaviour or a candidate's shadow
    action; a gated rl_focal learner or worker, whose gate would see no evidence, does not start."""
    import json

    from typer.testing import CliRunner

    from rlens.cli import app
    from rlens.service.common.policy import encode_policy
    from rlens.settings import settings
    from trust import SIGNER

    async def answered(ope_logging: bool):
        backends = {name: create_backend("replay", dataset=zoo, model=i) for i, name in enumerate(zoo.model_names)}
        dead = RedisWindows(Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2), 5, 128)
        engine = FocalEngine(5, config=FocalConfig(explore_rate=0.5, probe_rate=0.2), seed=3)
        worker = FocalWorker(engine, zoo.model_names, backends, dead, VERIFIER, TOKENS, ope_logging=ope_logging)
        other = FocalEngine(5, seed=1).policy_state()
        assert (
            worker.receive_policy(encode_policy(other, 1, 1, zoo.model_names, "rl_focal", SIGNER, "candidate")) is None
        )
        return await worker.handle([q for q, _ in queries_of(zoo, None, "t")[:64]])

    logged, plain = asyncio.run(answered(True)), asyncio.run(answered(False))
    assert all(e.behaviour is not None and e.shadow is not None for e in logged.experience)
    assert all(e.behaviour is None and e.shadow is None for e in plain.experience)
    assert [a.answer_index for a in plain.answers] == [a.answer_index for a in logged.answers]
    pool = tmp_path / "pool.json"
    pool.write_text(
        json.dumps({"models": [{"name": "a", "backend": "replay", "path": str(settings().service.demo_data)}]})
    )
    for promotion in ("gated", "holdback"):
        env = {"RLENS_PROMOTION": promotion, "RLENS_OPE_LOGGING": "false", "RLENS_POOL_FILE": str(pool)}
        for role in ("learner", "worker"):
            result = CliRunner().invoke(app, [role], env=env)
            assert result.exit_code != 0 and "RLENS_OPE_LOGGING must stay true" in result.output
