"""RL-Focal engine: Decider -> (call the chosen models) -> Fusion, plus feedback and MAPPO updates.

A query is either greedy (both agents take their most likely action) or explored (both sample, and log the
probability of what they sampled): online a share ``explore_rate`` of the queries is explored, and only explored
queries train the policies (:mod:`rlens.focal.mappo`).

The engine holds the agents, the critic, the per-stream outcome windows and the experience buffer. It does no
I/O: callers (the replay harness, the streaming worker and learner) call :meth:`FocalEngine.decide`,
call the models in ``Decision.called``, then :meth:`FocalEngine.fuse`; once feedback arrives they add the
outcome to the stream's window (:meth:`FocalEngine.observe`) and the rewarded transition to the experience
buffer (:meth:`FocalEngine.remember`); :meth:`FocalEngine.update` runs MAPPO on the buffer.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from rlens.focal.agents import CentralCritic, Decider, Fusion
from rlens.focal.budget import BudgetController, fit_pool, logit_shift
from rlens.focal.calibration import Calibrations, pool_votes
from rlens.focal.config import FocalConfig
from rlens.focal.features import (
    critic_state_dim,
    critic_states,
    decider_obs_dim,
    decider_observation,
    fusion_feature_dim,
    fusion_observation,
    fusion_observations,
    model_features_in_decider_obs,
    padded_choices,
    reliability_weighted_log_probs,
    stack_rows,
)
from rlens.focal.greedy import GreedyActor, voted_answers
from rlens.focal.mappo import Transition, mappo_update
from rlens.focal.propensity import serving_propensity
from rlens.focal.supervised import fit_fusion
from rlens.focal.window import OutcomeWindow


@dataclass
class Decision:
    key: Hashable  # stream key (task) the query belongs to
    pool: np.ndarray  # bool [M]: models whose answers the Fusion agent uses
    called: np.ndarray  # bool [M]: models to call (the pool, plus the rest of it on a window-refresh probe)
    state: np.ndarray  # Decider observation
    pool_logp: float  # log-probability of ``pool`` under the Decider
    explored: bool  # the pool was sampled (and the Fusion agent will sample its answer); False: greedy
    offset: float = 0.0  # the budget's offset when it was taken (a cap's part under 0): FocalEngine.shift
    cap: float | None = None  # the query's own budget (a share of the pool's cost): greedy, cut to fit (fit_pool)
    open_ended: bool = False  # its choices are the models' own answers: no calibrated vote


@dataclass
class Answer:
    answer: int  # index among the question's valid choices
    distribution: np.ndarray  # [C_valid]
    features: np.ndarray  # Fusion observation [C_valid, F]
    answer_logp: float  # log-probability of ``answer`` under the Fusion agent
    critic_state: np.ndarray  # centralized critic's input: Decider observation + the fused pool's answers


class FocalEngine:
    def __init__(
        self, n_models: int, model_costs: np.ndarray | None = None, config: FocalConfig | None = None, seed: int = 0
    ):
        self.cfg = config or FocalConfig()
        self.n_models = n_models
        costs = np.ones(n_models) if model_costs is None else np.asarray(model_costs, dtype=np.float64)
        self.model_costs = costs  # each model's cost in the pool's units
        self.cost_share = costs / costs.sum()
        self.rng = np.random.default_rng(seed)
        self.torch_rng = torch.Generator().manual_seed(seed)
        n_metrics = len(self.cfg.metrics)
        with torch.random.fork_rng(devices=[]):  # seeded initialisation without touching the global RNG
            torch.manual_seed(seed)
            marginal = self.cfg.marginal_diversity
            self.decider = Decider(
                decider_obs_dim(n_models, n_metrics, marginal),
                n_models,
                self.cfg.hidden,
                model_features_in_decider_obs(n_models, n_metrics),
            )
            self.fusion = Fusion(
                fusion_feature_dim(n_models), self.cfg.hidden, reliability_weighted_log_probs(n_models)
            )
            self.critic = CentralCritic(
                decider_obs_dim(n_models, n_metrics, marginal),
                critic_state_dim(n_models, n_metrics, marginal),
                self.cfg.hidden,
            )
        self.greedy = GreedyActor(self.decider, self.fusion)  # greedy actions in NumPy, on views of the same weights
        params = [*self.decider.parameters(), *self.fusion.parameters(), *self.critic.parameters()]
        # one kernel per step for all tensors: the same numbers, faster
        self.optimizer = torch.optim.Adam(params, lr=self.cfg.lr, eps=1e-5, foreach=True)
        self.windows: dict[Hashable, OutcomeWindow] = {}
        # queries asked per stream, counted up to cfg.first_probes (None: unknown, and no first-query probes)
        self.asked: dict[Hashable, int] | None = {}
        # each model's calibration per stream (None: greedy answers without a calibrated vote)
        self.calibrations = (
            Calibrations(n_models, self.cfg.calibration_rows, self.cfg.calibration_refit, self.cfg.joint_rows)
            if self.cfg.calibration_rows > 0
            else None
        )
        self.previous_pool: OrderedDict[Hashable, np.ndarray] = OrderedDict()  # at most cfg.max_streams, LRU
        # the cost the user sets (None: the cost weight alone)
        self.budget = (
            BudgetController(self.cfg.budget, self.cfg.budget_rate, cap=self.cfg.budget_cap)
            if self.cfg.budget is not None
            else None
        )
        self.stream_budgets = {  # streams with a budget of their own (keys as strings)
            str(stream): BudgetController(budget, self.cfg.budget_rate, cap=self.cfg.budget_cap)
            for stream, budget in self.cfg.stream_budgets
        }
        self.prices = self.cost_share * n_models  # what a budget's offset is multiplied by, per model
        self.everyone = np.ones(n_models, dtype=bool)  # the whole pool (read-only: decisions share it)
        self.everyone.flags.writeable = False
        self.no_logits = np.zeros(n_models)  # without a Decider: fit_pool takes the cheapest models first
        self.buffer: list[Transition] = []
        self.explored_buffered = 0  # explored transitions in the buffer

    # --- acting -----------------------------------------------------------------------------------------
    def window(self, key: Hashable) -> OutcomeWindow:
        if key not in self.windows:
            self.windows[key] = OutcomeWindow(self.n_models, self.cfg.window)
        return self.windows[key]

    def load_state(self, windows: dict, pools: dict, fits: dict, asked: dict | None = None) -> None:
        """A batch's state as the service keeps it (Redis), handed in: its streams' windows (replacing every other
        stream's), their last pools, the calibration fits the learner last published (kept with calibrations), and
        the queries each stream was asked before (a stream not in it: none; None: unknown)."""
        self.windows = dict(windows)
        self.asked = None if asked is None else dict(asked)
        if self.calibrations is not None:
            self.calibrations.streams = dict(fits)
        for key, pool in pools.items():
            self.remember_pool(key, pool)

    def follow(self, served: FocalEngine) -> None:
        """Read the windows and calibrations of the engine that serves (a candidate's agents, scored in shadow)."""
        self.windows = served.windows
        self.calibrations = served.calibrations

    def coins(self, caps: list[float | None]) -> tuple[list[bool], list[bool]]:
        """The queries' coins, each query's own: is it a probe (every model called, ``probe_rate``), is it explored
        (``explore_rate``); the probes' coins are drawn first, then the explorations'. A query with a budget of its
        own (its ``cap`` not None) is neither, though its coins are drawn."""
        cfg, rng = self.cfg, self.rng
        probes = [cfg.probe_rate > 0 and rng.random() < cfg.probe_rate for _ in caps]
        explored = [cfg.explore_rate > 0 and rng.random() < cfg.explore_rate for _ in caps]
        return (
            [probe and cap is None for probe, cap in zip(probes, caps)],
            [explore and cap is None for explore, cap in zip(explored, caps)],
        )

    def first_queries(self, keys: list[Hashable], caps: list[float | None]) -> list[bool]:
        """Which queries of a batch (their streams' ``keys``, their own budgets ``caps``) call every model for being
        among their stream's first ``first_probes``: those without a budget of their own, while the budget their
        stream is met under has not been overspent (its offset not below 0). A stream's queries are counted
        (:attr:`asked`, up to ``first_probes``), and a window with as many rows counts as well (a warm start's); none
        while the counts are unknown."""
        asked, first = self.asked, self.cfg.first_probes
        if asked is None or first <= 0:
            return [False] * len(keys)
        out = []
        for key, cap in zip(keys, caps):
            window = self.windows.get(key)
            seen = max(asked.get(key, 0), window.count if window is not None else 0)
            if seen >= first:
                out.append(False)
                continue
            asked[key] = asked.get(key, 0) + 1
            budget = self.budget_of(key)  # looked up only for a stream still in its first queries
            out.append(cap is None and (budget is None or budget.offset >= 0))
        return out

    def reset_windows(self, known: bool = True) -> None:
        """Every stream's state forgotten; ``known`` False: the streams' query counts are unknown too (Redis
        unreachable), so no stream probes its first queries."""
        self.asked = {} if known else None
        self.windows.clear()
        self.previous_pool.clear()
        if self.calibrations is not None:
            self.calibrations.clear()

    def remember_pool(self, key: Hashable, pool: np.ndarray) -> None:
        """The stream's previous pool (part of the Decider's next observation); LRU-bounded."""
        self.previous_pool[key] = pool
        self.previous_pool.move_to_end(key)
        if len(self.previous_pool) > self.cfg.max_streams:
            self.previous_pool.popitem(last=False)

    def _state(self, key: Hashable, n_choices: int) -> np.ndarray:
        previous = self.previous_pool.get(key, self.everyone)
        return decider_observation(
            self.window(key),
            previous,
            n_choices,
            self.cfg.metrics,
            self.cfg.recent_rewards,
            self.cfg.decider_sees,
            self.cfg.marginal_diversity,
        )

    def budget_of(self, key: Hashable) -> BudgetController | None:
        """The budget stream ``key`` is met under: its own, or the deployment's (None: the cost weight alone)."""
        return self.stream_budgets.get(str(key), self.budget) if self.stream_budgets else self.budget

    def _offset(self, key: Hashable) -> float:
        budget = self.budget_of(key)
        return budget.shift if budget is not None else 0.0

    def decide(
        self,
        key: Hashable,
        n_choices: int,
        greedy: bool,
        probe: bool = False,
        rollouts: int = 1,
        cap: float | None = None,
    ) -> list[Decision]:
        """Choose the pool for one query of stream ``key`` (before any model is called); ``n_choices`` 0: open-ended.

        ``rollouts`` > 1 draws that many pools from the same state (parallel environments over one recorded
        question, used in the warm start); the first one becomes the stream's previous pool. ``cap``: the query's own
        budget (:meth:`decide_batch`).
        """
        if cap is not None:
            return self.decide_batch([(key, n_choices, probe, greedy)], [cap])
        state = self._state(key, n_choices)
        offset = self._offset(key)
        if self.cfg.use_decider and greedy:
            pool, logp = self.greedy.pools(state[None], self.shift(offset))
            pools, pool_logps = (pool if rollouts == 1 else pool.repeat(rollouts, 0)), [float(logp[0])] * rollouts
        elif self.cfg.use_decider:
            with torch.inference_mode():
                pools_t, logps = self.decider.act(torch.from_numpy(state).expand(rollouts, -1), False, self.torch_rng)
            pools, pool_logps = pools_t.numpy().astype(bool), logps.tolist()
        else:
            pools, pool_logps = np.ones((rollouts, self.n_models), dtype=bool), [0.0] * rollouts
        self.remember_pool(key, pools[0])
        decisions = [
            Decision(key, pool, self.everyone if probe else pool, state, logp, not greedy, offset, None, n_choices == 0)
            for pool, logp in zip(pools, pool_logps)
        ]
        if rollouts == 1:  # served (rollouts: the warm start's parallel environments)
            self.spent(decisions)
        return decisions

    def shift(self, offsets: float | np.ndarray) -> float | np.ndarray:
        """The greedy Decider's logit shift under budget ``offsets`` (one, or one per query); 0 without a budget."""
        return 0.0 if self.budget is None and not self.stream_budgets else logit_shift(offsets, self.prices)

    def spent(self, decisions: list[Decision]) -> None:
        """What served decisions called, to the budget each one's stream is met under."""
        if self.budget is None and not self.stream_budgets:
            return
        for decision in decisions:
            budget = self.budget_of(decision.key)
            if budget is not None:
                budget.observe(float(self.cost_share[decision.called].sum()))

    @torch.inference_mode()
    def decide_batch(
        self, queries: list[tuple[Hashable, int, bool, bool]], caps: list[float | None] | None = None
    ) -> list[Decision]:
        """:meth:`decide` for a batch of (key, n_choices, probe, greedy), in order, with one Decider forward per
        distinct state. ``caps``: each query's own budget, or None; a query with one is greedy, no probe, and its
        pool is cut to cost at most that share of the pool's cost (:func:`rlens.focal.budget.fit_pool`).

        A state depends only on the stream's window, its previous pool and the choice count; windows do not change
        within a batch, so queries that share those share the observation and the forward (and, greedy, the pool).
        The decisions equal those of calling :meth:`decide` query by query (under a budget, the batch's queries of a
        stream share its offset: it moves after the batch).
        """
        cache: dict[tuple, dict] = {}
        decisions = []
        everyone = self.everyone
        for i, (key, n_choices, probe, greedy) in enumerate(queries):
            cap = caps[i] if caps is not None else None
            if cap is not None:
                probe, greedy = False, True
            offset = self._offset(key)
            previous = self.previous_pool.get(key, everyone)
            slot = (key, n_choices, previous.tobytes())
            if slot not in cache:
                cache[slot] = {"state": self._state(key, n_choices)}
            known = cache[slot]
            state = known["state"]
            if not self.cfg.use_decider:
                pool, logp = everyone, 0.0
                if cap is not None:
                    pool = fit_pool(pool, self.no_logits, self.cost_share, cap)
            elif greedy:
                if "greedy" not in known:
                    greedy_pools, greedy_logps = self.greedy.pools(state[None], self.shift(offset))
                    known["greedy"] = (greedy_pools[0], float(greedy_logps[0]))
                pool, logp = known["greedy"]
                if cap is not None:
                    pool, logp = self._fit(pool, logp, state, offset, cap)
            else:
                if "logits" not in known:
                    known["logits"] = self.decider.logits(torch.from_numpy(state)[None])
                pools_t, logps = self.decider.sample(known["logits"], False, self.torch_rng)
                pool, logp = pools_t[0].numpy().astype(bool), float(logps[0])
            self.remember_pool(key, pool)
            decisions.append(
                Decision(key, pool, everyone if probe else pool, state, logp, not greedy, offset, cap, n_choices == 0)
            )
        self.spent(decisions)
        return decisions

    def _fit(self, pool: np.ndarray, logp: float, state: np.ndarray, offset: float, cap: float) -> tuple:
        """The greedy ``pool`` (log-probability ``logp``) cut to the query's cap, and the Decider's log-probability
        of the cut pool."""
        if float(self.cost_share[pool].sum()) <= cap + 1e-9:
            return pool, logp
        logits = self.greedy.decider_logits(state[None])[0] + self.shift(offset)
        fitted = fit_pool(pool, logits, self.cost_share, cap)
        return fitted, float(np.where(fitted, -np.logaddexp(0, -logits), -np.logaddexp(0, logits)).sum())

    def fusion_features(self, decision: Decision, probs: np.ndarray) -> np.ndarray:
        """The Fusion's observation [C, F] for the pool of ``decision`` and the models' distributions ``probs`` [M, C]."""
        window = self.window(decision.key)
        return fusion_observation(
            probs * decision.pool[:, None], decision.pool, window.reliability(), window.label_prior(probs.shape[1])
        )

    def fuse_batch(
        self,
        decisions: list[Decision],
        probs: list[np.ndarray],
        calibrated: list[np.ndarray | None] | None = None,
    ) -> list[Answer]:
        """:meth:`fuse` for a batch (``probs[i]`` [M, C_i]): one Fusion forward over choices padded to the widest for
        the explored queries (torch, sampled), one for the greedy ones (NumPy); ``calibrated``: the queries'
        :meth:`calibrated_rows`, if known."""
        features, critic = self._fusion_inputs(decisions, probs)
        answers = np.zeros(len(decisions), dtype=np.int64)
        logps = np.zeros(len(decisions))
        dists: list[np.ndarray] = [np.empty(0)] * len(decisions)
        explored = [i for i, d in enumerate(decisions) if d.explored]
        greedy = [i for i, d in enumerate(decisions) if not d.explored]
        for rows in (explored, greedy):
            if not rows:
                continue
            padded, mask = padded_choices([features[i] for i in rows])
            if rows is explored:
                with torch.inference_mode():
                    sampled = self.fusion.act(
                        torch.from_numpy(padded),
                        torch.from_numpy(mask),
                        torch.ones(len(rows), dtype=torch.bool),
                        self.torch_rng,
                    )
                chosen, chosen_logp, dist = (t.numpy() for t in sampled)
            else:
                votes = self._votes(
                    [decisions[i] for i in rows],
                    [probs[i] for i in rows],
                    [decisions[i].pool for i in rows],
                    None if calibrated is None else [calibrated[i] for i in rows],
                )
                chosen, chosen_logp, dist = self.greedy.answers(padded, mask, votes)
            answers[rows], logps[rows] = chosen, chosen_logp
            for j, i in enumerate(rows):
                dists[i] = dist[j, : len(features[i])].copy()
        return [Answer(int(answers[i]), dists[i], f, float(logps[i]), critic[i]) for i, f in enumerate(features)]

    def _fusion_inputs(
        self,
        decisions: list[Decision],
        probs: list[np.ndarray],
        critic_too: bool = True,
        pools: list[np.ndarray] | None = None,
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each query's Fusion observation and critic state (:meth:`fusion_features`, :func:`critic_state`; no
        critic state without ``critic_too``), computed together for the queries with the same number of choices;
        ``pools``: the pools to fuse, if not the decisions' own."""
        pools = [d.pool for d in decisions] if pools is None else pools
        features: list[np.ndarray] = [np.empty(0)] * len(decisions)
        critic: list[np.ndarray] = [np.empty(0)] * len(decisions)
        by_width: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(probs):
            by_width[p.shape[1]].append(i)
        for width, index in by_width.items():
            windows = [self.window(decisions[i].key) for i in index]
            stacked, group_pools = stack_rows([probs[i] for i in index]), stack_rows([pools[i] for i in index])
            group_features = fusion_observations(
                stacked * group_pools[:, :, None],
                group_pools,
                stack_rows([w.reliability() for w in windows]),
                stack_rows([w.label_prior(width) for w in windows]),
            )
            for j, i in enumerate(index):
                features[i] = group_features[j]
            if critic_too:
                group_critic = critic_states(stack_rows([decisions[i].state for i in index]), stacked, group_pools)
                for j, i in enumerate(index):
                    critic[i] = group_critic[j]
        return features, critic

    def fuse(self, decision: Decision, probs: np.ndarray) -> Answer:
        """Answer distribution over the valid choices from the pool's distributions ``probs`` [M, C_valid]; the
        answer is sampled from it for an explored decision, its mode otherwise.

        Rows of models outside the pool are ignored (zeroed), whatever they hold.
        """
        (answer,) = self.fuse_batch([decision], [probs])
        return answer

    def greedy_pool(self, decision: Decision) -> np.ndarray:
        """The pool the greedy Decider takes in the decision's state (the decision's own pool when it was greedy)."""
        return self.greedy_pools([decision])[0]

    def greedy_pools(self, decisions: list[Decision], every: bool = False) -> list[np.ndarray]:
        """:meth:`greedy_pool` for a batch, with one Decider forward over the explored decisions' states (``every``:
        over all of them, as another policy's greedy pools in the same states)."""
        pools = [d.pool for d in decisions]
        explored = [i for i, d in enumerate(decisions) if every or d.explored]
        if explored and not self.cfg.use_decider:
            for i in explored:
                cap = decisions[i].cap
                pools[i] = (
                    self.everyone if cap is None else fit_pool(self.everyone, self.no_logits, self.cost_share, cap)
                )
        elif explored:
            states = np.stack([decisions[i].state for i in explored])
            greedy = self.greedy.pools(states, self.shift(np.array([decisions[i].offset for i in explored])))[0]
            for j, i in enumerate(explored):
                d = decisions[i]
                pools[i] = greedy[j] if d.cap is None else self._fit(greedy[j], 0.0, d.state, d.offset, d.cap)[0]
        return pools

    def propensity(self, decision: Decision, answer: Answer, greedy_pool: np.ndarray | None = None) -> float:
        """The serving mixture's probability of this decision's pool and answer (:mod:`rlens.focal.propensity`);
        ``greedy_pool``: :meth:`greedy_pool` of the decision, if known. A greedy decision took the greedy pool and
        its answer is the Fusion's mode, so only an explored one is compared with them."""
        if decision.cap is not None:  # greedy always, its own budget's cut: nothing else could be served
            return 1.0
        if not decision.explored:
            return serving_propensity(self.cfg.explore_rate, decision.pool_logp, answer.answer_logp, True, True)
        greedy_pool = self.greedy_pool(decision) if greedy_pool is None else greedy_pool
        return serving_propensity(
            self.cfg.explore_rate,
            decision.pool_logp,
            answer.answer_logp,
            bool((greedy_pool == decision.pool).all()),
            answer.answer == int(np.argmax(answer.distribution)),
        )

    def greedy_answer(
        self,
        decision: Decision,
        probs: np.ndarray,
        called: np.ndarray | None = None,
        answered: np.ndarray | None = None,
    ) -> int:
        """The answer the greedy policy would have given from the same state (what exploring an explored query
        cost); changes no state. ``called`` / ``answered``: the models that were asked and those that answered
        (default: all); -1 when the greedy pool holds a model that was not asked, or none of it answered."""
        called = self.everyone if called is None else called
        return self.greedy_actions([decision], [probs], [called], [answered])[0][0]

    def greedy_actions(
        self,
        decisions: list[Decision],
        probs: list[np.ndarray],
        called: list[np.ndarray],
        answered: Sequence[np.ndarray | None],
        pools: list[np.ndarray] | None = None,
        known: list[tuple[np.ndarray, np.ndarray]] | None = None,
        calibrated: list[np.ndarray | None] | None = None,
    ) -> list[tuple[int, np.ndarray | None]]:
        """:meth:`greedy_answer` for a batch, with one Fusion forward, each answer with the Fusion's own distribution
        over the query's choices on that pool (what an explored answer there is sampled from: no vote), None where
        the answer is -1. ``pools``: the decisions' greedy pools, if known (:meth:`greedy_pools` of them as explored);
        ``known``: per decision, a pool that answered and its Fusion observation, already computed (the served
        answer's), reused where the greedy pool's answering part is it; ``calibrated``: the queries'
        :meth:`calibrated_rows` of the models that answered, if known."""
        if pools is None:
            pools = self.greedy_pools(decisions, every=True)
        result: list[tuple[int, np.ndarray | None]] = [(-1, None)] * len(decisions)
        if not decisions:
            return result
        greedy, asked = np.stack(pools), np.stack(called)
        answering = np.stack([asked[i] if a is None else a for i, a in enumerate(answered)])
        fused = greedy & answering  # a model that was not asked gave no answer either
        usable = ~(greedy & ~asked).any(1) & fused.any(1)
        rows = np.flatnonzero(usable).tolist()
        if rows:
            if known is None:
                features: list[np.ndarray] = [np.empty(0)] * len(rows)
                new = list(range(len(rows)))
            else:  # the rows whose observation is not known yet
                features = [known[i][1] for i in rows]
                new = np.flatnonzero((fused[rows] != np.stack([known[i][0] for i in rows])).any(1)).tolist()
            if new:
                computed, _ = self._fusion_inputs(
                    [decisions[rows[j]] for j in new],
                    [probs[rows[j]] for j in new],
                    critic_too=False,
                    pools=[fused[rows[j]] for j in new],
                )
                for j, f in zip(new, computed):
                    features[j] = f
            votes = self._votes(
                [decisions[i] for i in rows],
                [probs[i] for i in rows],
                [fused[i] for i in rows],
                None if calibrated is None else [calibrated[i] for i in rows],
            )
            own_log = self.greedy.fusion_log_probs(*padded_choices(features))
            chosen, _, _ = voted_answers(own_log, votes)
            own = np.exp(own_log)
            for j, i in enumerate(rows):
                result[i] = (int(chosen[j]), own[j, : features[j].shape[0]])
        return result

    def calibrated_rows(
        self, decisions: list[Decision], probs: list[np.ndarray], models: list[np.ndarray], for_vote: bool = False
    ) -> list[np.ndarray | None]:
        """Each query's calibrated rows on its stream for ``models`` (bool [M] each; [M, C],
        :meth:`StreamCalibration.calibrated_rows`, ``for_vote`` as there): computed once, they give the served pool,
        a greedy or a candidate's pool its vote, and the log its calibrations. None without calibrations, for an
        open-ended query."""
        if self.calibrations is None:
            return [None] * len(decisions)
        return [
            None if d.open_ended else self.calibrations(d.key).calibrated_rows(p, m, for_vote)
            for d, p, m in zip(decisions, probs, models)
        ]

    def _votes(
        self,
        decisions: list[Decision],
        probs: list[np.ndarray],
        pools: list[np.ndarray],
        calibrated: list[np.ndarray | None] | None = None,
    ) -> np.ndarray | None:
        """Each pool's calibrated vote on its stream [B, C_max] (zeros past a query's choices, where a member is not
        calibrated yet, and for an open-ended query), what the greedy Fusion adds to its log-probabilities; None
        without calibrations. ``calibrated``: the queries' :meth:`calibrated_rows`, if known (covering the pools)."""
        if self.calibrations is None:
            return None
        if calibrated is None:
            calibrated = self.calibrated_rows(decisions, probs, pools, for_vote=True)
        votes = np.zeros((len(decisions), max(p.shape[1] for p in probs)))
        by_width: dict[int, list[tuple[int, np.ndarray]]] = defaultdict(list)
        for i, rows in enumerate(calibrated):
            if rows is not None:
                by_width[rows.shape[1]].append((i, rows))
        for width, group in by_width.items():  # :func:`pool_votes` of the queries with as many choices at once
            index = np.array([i for i, _ in group])
            priors = np.stack([self.calibrations(decisions[i].key).prior(width) for i in index])
            found, voted = pool_votes(
                np.stack([rows for _, rows in group]), np.stack([pools[i] for i in index]), priors
            )
            votes[index[voted], :width] = found[voted]
        for i, d in enumerate(decisions):  # a pool's joint fit replaces its vote where it predicts better
            joint = None if d.open_ended else self.calibrations(d.key).joint(probs[i], pools[i])
            if joint is not None:
                votes[i, : len(joint)] = joint
        return votes

    def reward(self, pool: np.ndarray, correct: bool) -> float:
        """The Decider's reward: +1 / -1 for the final answer minus alpha times the pool's share of the whole pool's cost."""
        return self.fusion_reward(correct) - self.cfg.alpha * float(self.cost_share[pool].sum())

    @staticmethod
    def fusion_reward(correct: bool) -> float:
        """The Fusion agent's reward: +1 / -1 for its answer (it does not choose the pool, so it pays no cost)."""
        return 1.0 if correct else -1.0

    # --- feedback and learning ----------------------------------------------------------------------------
    def observe(
        self,
        key: Hashable,
        predictions: np.ndarray,
        label: int,
        reward: float,
        probs: np.ndarray | None = None,
        pool: np.ndarray | None = None,
    ) -> None:
        """Feedback for one query of stream ``key``: add its outcome to the window (and, with ``probs``, the called
        models' distributions [M, C], to the stream's calibrations, with ``pool``, the pool that answered).

        ``predictions`` int [M] holds each called model's chosen choice and -1 for models not called;
        ``label`` is -1 when the feedback is a bare reward.
        """
        self.window(key).push(predictions, label, reward)
        if self.calibrations is not None and probs is not None:
            self.calibrations(key).push(probs, np.asarray(predictions) >= 0, label, pool)

    def remember(
        self,
        decision: Decision,
        answer: Answer | None,
        reward: float,
        fusion_reward: float,
        critic_input: np.ndarray | None = None,
        label: int = -1,
    ) -> None:
        """Keep one rewarded transition for the next update (``answer`` None: the Fusion agent did not act, and
        ``critic_input``, the critic's state, is then required; ``label``: the correct choice, -1 if unknown; a
        label that is none of the choices, as when no model answered right, teaches the Fusion nothing: kept as -1)."""
        critic_view = answer.critic_state if answer is not None else critic_input
        if critic_view is None:
            raise ValueError("remember needs the critic's state: an answer that carries it, or critic_input")
        self.explored_buffered += decision.explored
        self.buffer.append(
            Transition(
                state=decision.state,
                critic_state=critic_view,
                pool=decision.pool.astype(np.float32),
                pool_logp=decision.pool_logp,
                reward=reward,
                fusion_reward=fusion_reward,
                explored=decision.explored,
                fusion_features=None if answer is None else answer.features,
                answer=-1 if answer is None else answer.answer,
                answer_logp=0.0 if answer is None else answer.answer_logp,
                label=label if answer is not None and label < len(answer.features) else -1,
            )
        )

    def fit_fusion(self, features: list[np.ndarray], labels: list[int]) -> dict[str, float]:
        """Supervised pre-training of the Fusion agent (:func:`rlens.focal.supervised.fit_fusion`)."""
        cfg = self.cfg
        return fit_fusion(
            self.fusion,
            self.optimizer,
            features,
            labels,
            cfg.fusion_supervised_epochs,
            cfg.minibatch_size,
            cfg.max_grad_norm,
            self.torch_rng,
        )

    def update_due(self) -> bool:
        """Online: ``update_period`` explored transitions are buffered (or, whatever the exploration, 16 times as
        many transitions in all, so the critic still learns and the buffer stays bounded)."""
        return self.explored_buffered >= self.cfg.update_period or len(self.buffer) >= 16 * self.cfg.update_period

    def clear_buffer(self) -> None:
        self.restore_buffer([])

    def restore_buffer(self, transitions: list[Transition]) -> None:
        self.buffer = transitions
        self.explored_buffered = sum(t.explored for t in transitions)

    def update(self, train_decider: bool = True, train_fusion: bool = True, envs: int = 1) -> dict[str, float]:
        """One MAPPO update on the buffered transitions, then clear them.

        The buffer holds ``envs`` interleaved parallel environments (step-major); each environment's GAE is
        bootstrapped with the value of its last state.
        """
        if not self.buffer:
            return {}
        stats = mappo_update(
            self.decider,
            self.fusion,
            self.critic,
            self.optimizer,
            self.buffer,
            envs,
            self.cfg,
            train_decider=train_decider and self.cfg.use_decider,
            train_fusion=train_fusion,
            generator=self.torch_rng,
        )
        self.clear_buffer()
        return stats

    # --- checkpoints ----------------------------------------------------------------------------------------
    def policy_state(self) -> dict[str, torch.Tensor]:
        """Flat tensor dict of every network's weights (safetensors-compatible keys)."""
        state = {}
        for name, module in (("decider", self.decider), ("fusion", self.fusion), ("critic", self.critic)):
            state.update({f"{name}.{k}": v.detach().clone() for k, v in module.state_dict().items()})
        return state

    def load_policy_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, module in (("decider", self.decider), ("fusion", self.fusion), ("critic", self.critic)):
            prefix = f"{name}."
            module.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
