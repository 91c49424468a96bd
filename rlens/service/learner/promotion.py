"""The learner's side of guarded promotion (:mod:`rlens.service.learner.gate` judges): the candidates it proposes,
the promotions and roll-backs it publishes, signed, and what it shows of them (log, dashboard, metrics)."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from rlens.messages import Experience, Policy, RLAEExperience
from rlens.service.common.metrics import LearnerMetrics
from rlens.service.common.policy import encode_policy
from rlens.service.common.security import PolicySigner
from rlens.service.learner.dashboard import Dashboard
from rlens.service.learner.gate import Gate
from rlens.service.learner.numbers import PolicyNumbers

log = logging.getLogger("rlens.learner")


class Learner(Protocol):
    """What promotion reads and moves of the learner (:class:`rlens.service.learner.core.LearnerCore`)."""

    trainer: Any
    numbers: PolicyNumbers
    models: list[str]
    signer: PolicySigner
    stats: Any
    dashboard: Dashboard
    metrics: LearnerMetrics | None


class Promotion:
    def __init__(self, gate: Gate, core: Learner):
        self.gate, self.core = gate, core
        self.outbox: list[Policy] = []  # candidates, promotions and roll-backs, until the app publishes them
        gate.champion_tensors = core.trainer.policy_tensors()  # the workers start from the same seeded weights

    def restored(self, state: dict | None, tensors: dict) -> None:
        """After a restart the gate goes on where the checkpoint left it: the champion, the candidate and its evidence
        (the records after the checkpoint are read again, and count once), probation, trust. Without the gate in the
        checkpoint (its learner promoted directly, or came before the gate was kept) what the workers serve is learned
        from the policy topic's history."""
        if state is None:
            self.gate.champion_tensors = None
            return
        gate = self.gate
        gate.restore(state, tensors)
        if gate.candidate is not None:
            log.info(
                "the gate resumes: candidate v%d (epoch %d, %s) with %d queries of evidence, champion %s",
                gate.candidate[1],
                gate.candidate[0],
                gate.kind,
                len(gate.evidence),
                f"v{gate.champion[1]} (epoch {gate.champion[0]})" if gate.champion else "the seeded policy",
            )
        self.show()

    def served(self, order: tuple[int, int], tensors, operator: bool) -> None:
        """A live policy read on the policy topic that this learner did not publish: what the workers serve, from
        the topic's history; an operator's choice, whose predecessor goes on probation (the candidate is dropped)."""
        gate = self.gate
        if gate.champion is not None and order <= gate.champion:
            return
        if not operator and gate.candidate is not None and order >= gate.candidate:
            # a restarted learner's candidate whose verdict went out after the checkpoint: its promotion sends its
            # predecessor to probation, anything else (a roll back, a line withdrawn) ends it
            if order == gate.candidate and gate.kind == "challenger":
                gate.promoted()
            else:
                gate.dropped()
            gate.champion, gate.champion_tensors = order, tensors
            if gate.previous is not None:  # else the learner's next update is the next candidate
                self.propose()
            self.show()
            return
        if operator:
            replaced = gate.champion_tensors
            gate.candidate = gate.candidate_tensors = None
            gate.champion, gate.champion_tensors, gate.previous = order, tensors, replaced
            self.propose()
        else:
            gate.champion, gate.champion_tensors = order, tensors
        self.show()

    def warm_started(self) -> None:
        """A fresh learner's warm start (offline training the operator chose) is the first champion, live at once:
        it replaces the seeded, untrained policy, which has no more evidence for it. What is learned online from it
        is judged. (As the first candidate, behind the untrained policy, it cost RLAE 6.6 points of served exact
        match on clean streams and 10 on sabotaged ones: docs/benchmarks-history.md.)"""
        gate, core = self.gate, self.core
        gate.champion, gate.champion_tensors = core.numbers.newest, core.trainer.policy_tensors()
        self.outbox.append(self.encode(gate.champion_tensors, core.numbers.version, "live", note="warm start"))
        log.info("policy v%d (epoch %d), warm-started, is the first champion", core.numbers.version, core.numbers.epoch)
        self.show()

    def first_policy(self) -> Policy | None:
        """The seeded policy (the weights the workers serve from their start) published live under the next number,
        as a warm start's is, so that an operator always has a version to roll back to; None for a gate that already
        knows its champion."""
        gate, numbers = self.gate, self.core.numbers
        if gate.champion is not None or gate.champion_tensors is None:
            return None
        version = numbers.next()
        gate.champion = numbers.newest
        log.info("policy v%d (epoch %d), the seeded policy, is the first champion", version, numbers.epoch)
        self.show()
        return self.encode(gate.champion_tensors, version, "live", note="the seeded policy")

    def take(self) -> list[Policy]:
        taken, self.outbox = self.outbox, []
        return taken

    def observe(self, experience: Experience, label: int) -> None:
        """A joined, labelled query: the current candidate's evidence, and a verdict when one is due."""
        self.gate.observe(experience, label)
        self.judge()

    def observe_split(self, experience: RLAEExperience, reward: float) -> None:
        """A rewarded rlae query of the current A/B split: the candidate's evidence, and a verdict when one is due."""
        self.gate.observe_split(experience, reward)
        self.judge()

    def propose(self) -> None:
        """The champion a promotion replaced, on probation; else the newest weights, as the next challenger. One
        candidate at a time: the learner trains on while one is judged."""
        gate, core = self.gate, self.core
        if gate.candidate is not None:
            return
        if gate.previous is not None:
            version = core.numbers.next()  # a new number: workers score only candidates newer than the champion
            gate.propose(core.numbers.newest, gate.previous, "probation")
            calls = gate.shadow_calls()
            self.outbox.append(self.encode(gate.previous, version, "candidate", share=gate.share(), shadow_calls=calls))
            log.info("the replaced champion, as v%d, is scored against the promoted one", version)
            return
        if core.numbers.version <= 0 or (gate.champion is not None and core.numbers.newest <= gate.champion):
            return
        tensors = core.trainer.policy_tensors()
        gate.propose(core.numbers.newest, tensors)
        self._published_candidate()

    def advance(self) -> None:
        """Holdback: the learner's newest weights replace the line's candidate at once (not a champion on
        probation)."""
        gate, core = self.gate, self.core
        if gate.candidate is not None and gate.kind != "line":
            return
        if gate.champion is not None and core.numbers.newest <= gate.champion:
            return
        gate.advance(core.numbers.newest, core.trainer.policy_tensors())
        if gate.share() is None:
            self._published_line()
        else:
            self._published_candidate()

    def _published_line(self) -> None:
        """rl_focal, holdback: the line's newest weights live, and the champion as a candidate under the next number
        (the workers score only candidates newer than what they serve): scored in shadow beside the line."""
        gate, core = self.gate, self.core
        assert gate.candidate_tensors is not None and gate.champion_tensors is not None
        line = core.numbers.version
        self.outbox.append(self.encode(gate.candidate_tensors, line, "live", note="the learner's line"))
        champion = core.numbers.next()
        self.outbox.append(
            self.encode(gate.champion_tensors, champion, "candidate", note="the champion, scored beside the line")
        )
        log.info("policy v%d (epoch %d) serves, the champion scored beside it", line, core.numbers.epoch)

    def updated(self) -> None:
        """The learner made an update: the next candidate (gated), or the line's newest (holdback, trusted)."""
        if self.gate.serves_updates:
            self.advance()
        else:
            self.propose()

    def _published_candidate(self) -> None:
        gate, core = self.gate, self.core
        assert gate.candidate_tensors is not None
        self.outbox.append(self.encode(gate.candidate_tensors, core.numbers.version, "candidate", share=gate.share()))
        log.info(
            "policy v%d (epoch %d) published as a candidate, scored against the champion",
            core.numbers.version,
            core.numbers.epoch,
        )

    def judge(self) -> None:
        gate, core = self.gate, self.core
        looked = gate.last
        verdict = gate.verdict()
        if gate.last is not looked:  # a new look at the evidence
            self.show()
        if verdict is None:
            return
        epoch, version = gate.candidate or (0, 0)
        e = gate.last
        assert e is not None and gate.candidate_tensors is not None
        shown = f"candidate − champion reward {e.value:+.3f} [{e.low:+.3f}, {e.high:+.3f}] over {e.n} queries"
        if verdict == "inconclusive":  # holdback: the line serves on, judged again on fresh evidence
            log.info("the line up to policy v%d (epoch %d) serves on, not judged yet: %s", version, epoch, shown)
            gate.restart()
            self.show()
            return
        line = gate.kind == "line"
        if line and verdict == "roll back":
            epoch, version = self.withdraw_line(shown)
        elif verdict in ("promote", "roll back"):
            note = f"rolled back: {shown}" if verdict == "roll back" else f"promoted: {shown}"
            if line and gate.share() is None:  # a line already serves: a new number, and the workers stop scoring
                core.numbers.next()
                epoch, version = gate.candidate = core.numbers.newest
            self.outbox.append(self.encode(gate.candidate_tensors, version, "live", epoch, note))
            gate.promoted()
        else:
            gate.dropped()
        core.stats.count_verdict(verdict)
        if gate.config.holdback is not None:
            if verdict == "roll back":  # what was rolled back is not trained on further
                assert gate.champion_tensors is not None
                core.trainer.load_policy(gate.champion_tensors)
            if verdict in ("promote", "resume"):
                gate.trusted = True
            elif line and verdict == "roll back":  # its own training went wrong: what it trains next is a challenger
                gate.trusted = False
        if line and verdict == "roll back":
            log.error("the learner's line rolled back to the champion, as v%d (epoch %d): %s", version, epoch, shown)
        elif verdict == "roll back":
            log.error("rolled back to the replaced champion, as v%d (epoch %d): %s", version, epoch, shown)
        else:
            (log.warning if verdict == "drop" else log.info)(
                "policy v%d (epoch %d): %s; %s", version, epoch, verdict, shown
            )
        core.dashboard.observe_verdict(verdict, version, e)
        if core.metrics is not None:
            core.metrics.candidates.labels(verdict.replace(" ", "_")).inc()
        if not gate.serves_updates:  # else the next update starts the next line
            self.propose()
        self.show()

    def withdraw_line(self, shown: str) -> tuple[int, int]:
        """Holdback: the champion served everywhere again, under a number above the line's. The (epoch, version)
        published."""
        gate, core = self.gate, self.core
        assert gate.champion_tensors is not None
        version = core.numbers.next()
        self.outbox.append(self.encode(gate.champion_tensors, version, "live", note=f"line rolled back: {shown}"))
        gate.candidate = gate.candidate_tensors = None
        gate.champion = core.numbers.newest
        return gate.champion

    def show(self) -> None:
        """The gate's state on the dashboard and in the metrics."""
        gate, core = self.gate, self.core
        champion = gate.champion[1] if gate.champion else None
        candidate = gate.candidate[1] if gate.candidate else None
        estimate = gate.last if gate.candidate else None
        core.dashboard.observe_gate(champion, candidate, gate.kind, estimate, len(gate.evidence))
        if core.metrics is not None:
            core.metrics.candidate_events.set(len(gate.evidence) if gate.candidate else 0)
            for bound in ("value", "low", "high"):
                core.metrics.candidate_estimate.labels(bound).set(
                    getattr(estimate, bound) if estimate else float("nan")
                )

    def encode(
        self,
        tensors,
        version: int,
        stage: str,
        epoch: int | None = None,
        note: str = "",
        share: float | None = None,
        shadow_calls: float | None = None,
    ) -> Policy:
        core = self.core
        epoch = core.numbers.epoch if epoch is None else epoch
        strategy = core.trainer.strategy
        return encode_policy(
            tensors, version, epoch, core.models, strategy, core.signer, stage, note, share, shadow_calls
        )

    def announcement(self) -> Policy | None:
        """The champion this learner promoted, if it knows its weights."""
        gate = self.gate
        if gate.champion is None or gate.champion_tensors is None:
            return None
        return self.encode(gate.champion_tensors, gate.champion[1], "live", gate.champion[0])
