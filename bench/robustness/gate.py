"""Guarded promotion against a learner whose training goes wrong (issue 35): served accuracy with every update live
(direct) and through the gate, for a clean learner and a sabotaged one (it trains on another choice's label with the
reward's sign flipped; the feedback stays honest).

    python -m bench.robustness.gate [--data DIR [--tasks tune]] [--queries 2400] [--seeds 0 1 2] [--gate 200 600 25]
        [--shadow-calls 1.0] [--scenarios ...] [--out bench/out/gate.json]

No Kafka: a real worker (the bundled stream's models as replay backends, 20 % explored, 20 % probes, an update every
32 explored joins) and a real learner core share a redis-server; the learner's policies reach the worker as the
policy topic would bring them. The bundled stream (or ``--data``, a recorded dataset such as bbh_dev), cycled with
fresh query ids, feedback at once. Prints served accuracy overall and over the last third, and the gate's verdicts.
Promotions: direct, gated, and holdback (every update serves at once, the champion scored in shadow beside it).
The ``-warm`` scenarios (``--scenarios gated-warm-sabotaged ...``, not run by default) warm-start the learner on the
paper protocol's warm split, as the service's ``--warm-start`` does (that policy is the first champion, live at
once), and stream its test split.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
from redis.asyncio import Redis

from bench.common.args import add_out, add_seeds, arguments, write_json
from bench.common.machine import machine_facts
from rlens.backends import create_backend
from rlens.drift import DriftMonitor
from rlens.checkpoint import CheckpointStore
from rlens.records.dataset import load_dataset, save_dataset
from rlens.evaluation.protocols import Protocol, split, task_half
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.local.load import queries_of
from rlens.local.servers import LocalRedis
from rlens.messages import Feedback
from rlens.service.common.policy import PolicyHistory, encode_policy
from rlens.service.common.security import FeedbackTokens, PolicySigner, generate_secrets
from rlens.service.common.windows import RedisWindows
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.gate import Gate, GateConfig
from rlens.service.learner.online import FocalOnlineTrainer
from rlens.service.worker.core import FocalWorker
from rlens.settings import settings

SECRETS = generate_secrets()
SIGNER = PolicySigner(SECRETS["RLENS_POLICY_SIGNING_KEY"])
VERIFIER = SIGNER.verifier()
TOKENS = FeedbackTokens(SECRETS["RLENS_FEEDBACK_SECRET"])
GATE = GateConfig(min_events=200, max_events=600, every=25, delta=0.02)  # scaled to a 2,400-query stream
RESET = replace(GATE, drift_reset=True)  # a drift detection restarts the candidate's evidence
HOLDBACK = replace(GATE, holdback=0.2)  # every update serves at once, the champion scored in shadow beside it
SCENARIOS = [  # (promotion, gate, case); "-one": the whole stream on one key (task switches are drift in it)
    ("direct", None, "clean"),
    ("direct", None, "sabotaged"),
    ("direct", None, "forced"),
    ("gated", GATE, "clean"),
    ("gated", GATE, "sabotaged"),
    ("gated", GATE, "forced"),
    ("gated-one", GATE, "clean"),
    ("gated-reset-one", RESET, "clean"),
    ("direct-warm", None, "clean"),  # "-warm": warm-started, as the service's --warm-start (not run by default)
    ("direct-warm", None, "sabotaged"),
    ("gated-warm", GATE, "clean"),
    ("gated-warm", GATE, "sabotaged"),
    ("holdback", HOLDBACK, "clean"),
    ("holdback", HOLDBACK, "sabotaged"),
    ("holdback", HOLDBACK, "forced"),
    ("holdback-warm", HOLDBACK, "clean"),
    ("holdback-warm", HOLDBACK, "sabotaged"),
]
DEFAULT = [s for s in SCENARIOS if not s[0].endswith("-warm")]


CONFIG = FocalConfig(explore_rate=0.2, probe_rate=0.2, update_period=32)


def record(topic: str, offset: int):
    return SimpleNamespace(
        topic=topic, partition=0, offset=offset, key=b"k", value=b"{}", timestamp=int(time.time() * 1000)
    )


def simulate(
    zoo,
    url: str,
    workdir: Path,
    gate: GateConfig | None,
    warm: bool,
    sabotage: bool,
    n: int,
    seed: int = 0,
    forced_at: int | None = None,
    one_stream: bool = False,
    restart_at: int | None = None,
    test_split: bool = False,
) -> SimpleNamespace:
    """``n`` queries of the bundled stream through a worker; the learner joins each with its label's feedback.
    ``gate`` None: every update goes live (direct promotion). ``forced_at``: from that query on, an operator forces
    a bad policy live (the served one with its Fusion's scores turned upside down), as ``rlens policy promote``
    would. ``one_stream``: every query on one stream key, so the task switches are drift in it (the learner's
    detector runs in every scenario; with ``drift_reset`` its detections restart the candidate's evidence).
    ``restart_at`` (a multiple of 32): there the learner checkpoints, stops and a new one resumes. ``warm``: the
    learner is warm-started on the paper protocol's warm split; with ``test_split`` the stream is its test split
    (otherwise the whole stream, warm questions included). Returns
    the worker, the learner core (and the one ``restart_at`` stopped), (served version, right) per query, the models
    each query called, whether the shadow's answer was right where known (None elsewhere), the versions scored in
    shadow and the forced version."""

    async def scenario():
        redis = Redis.from_url(url)
        await redis.flushdb()
        names = zoo.model_names
        warm_index, test_index = split(zoo, Protocol.paper)  # the warm split trains the first champion
        stream = zoo.subset(test_index) if test_split else zoo
        backends = {name: create_backend("replay", dataset=stream, model=i) for i, name in enumerate(names)}
        m = zoo.n_models
        worker = FocalWorker(
            FocalEngine(m, zoo.model_costs, CONFIG, seed=seed),
            names,
            backends,
            RedisWindows(redis, m, 128, calibration_rows=CONFIG.calibration_rows),
            VERIFIER,
            TOKENS,
        )

        def learner() -> LearnerCore:  # a new one resumes from the checkpoint directory's newest checkpoint
            engine = FocalEngine(m, zoo.model_costs, CONFIG, seed=seed)
            trainer = FocalOnlineTrainer(engine, names)
            if sabotage:  # training goes wrong: another choice's label, the reward's sign flipped (feedback honest)
                honest = trainer.remember

                def remember(experience, feedback, reward):
                    wrong = feedback.model_copy(update={"label": (feedback.label + 1) % experience.n_choices})
                    honest(experience, wrong, -reward)

                trainer.remember = remember
            return LearnerCore(
                trainer,
                names,
                RedisWindows(Redis.from_url(url), m, 128, calibration_rows=CONFIG.calibration_rows),
                CheckpointStore(workdir / "learner"),
                SIGNER,
                TOKENS,
                drift=DriftMonitor(),  # detections only (no reaction), for the gate's drift_reset
                gate=None if gate is None else Gate(gate, engine.cost_share, CONFIG.alpha),
            )

        core = learner()
        if warm:
            core.warm_start(save_dataset(zoo.subset(warm_index), workdir / "warm"))
        served, calls, shadow_right, shadowed, published, forced, stopped = [], [], [], set(), [], None, None
        announced = core.announcement()  # as the learner's app does at its start (a warm start's policy, if any)
        if announced is not None:
            assert worker.receive_policy(announced) is None
            published.append(announced)
        traffic = queries_of(stream, None, "t")
        if one_stream:
            traffic = [(q.model_copy(update={"stream": "one"}), label) for q, label in traffic]
        for start in range(0, n, 32):
            for policy in core.take_policies():
                assert worker.receive_policy(policy) is None
                published.append(policy)
            if restart_at is not None and start == restart_at:  # the learner stops (a checkpoint) and starts again
                core.checkpoint()  # after what it produced was published, as the service's record batches do
                core.checkpoints.close()
                stopped, core = core, learner()
            if forced_at is not None and forced is None and start >= forced_at:
                upside_down = {k: -v if k.startswith("fusion.") else v for k, v in worker.policy_tensors().items()}
                bad = encode_policy(upside_down, 1, core.epoch, names, "rl_focal", SIGNER)
                forced = PolicyHistory(published, []).republish(bad, SIGNER, "forced live by the simulation")
                for policy in [forced, *core.on_policy(forced)]:
                    assert worker.receive_policy(policy) is None
                    published.append(policy)
            batch = [traffic[i % len(traffic)] for i in range(start, min(start + 32, n))]
            batch = [
                (q.model_copy(update={"query_id": f"{q.query_id}-{i}"}), label)
                for i, (q, label) in enumerate(batch, start)
            ]
            out = await worker.handle([q for q, _ in batch])
            for i, (experience, answer, (q, label)) in enumerate(zip(out.experience, out.answers, batch)):
                served.append((worker.policy_version, answer.answer_index == label))
                calls.append(len(answer.called_models))
                shadow = experience.shadow
                shadow_right.append(shadow.answer == label if shadow is not None and shadow.answer >= 0 else None)
                if shadow is not None:
                    shadowed.add(shadow.version)
                joined = [
                    await core.on_experience(experience, record("rlens.experience", start + i)),
                    await core.on_feedback(
                        Feedback(query_id=q.query_id, token=answer.feedback_token, label=label),
                        record("rlens.feedback", start + i),
                    ),
                ]
                for policy, _ in joined:
                    if policy is not None:  # direct promotion: an update goes live at once
                        assert worker.receive_policy(policy) is None
                        published.append(policy)
            await core.apply_windows()
        await redis.aclose()
        return SimpleNamespace(
            worker=worker,
            core=core,
            stopped=stopped,
            served=served,
            calls=calls,
            shadow_right=shadow_right,
            shadowed=shadowed,
            forced=forced.version if forced else None,
        )

    return asyncio.run(scenario())


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--data", type=Path, default=None, help="recorded dataset (default: the bundled stream)")
    parser.add_argument("--queries", type=int, default=2400)
    parser.add_argument(
        "--scenarios", nargs="+", default=None, help="only these, as promotion-case (gated-reset-clean, direct-forced)"
    )
    parser.add_argument("--tasks", default="all", choices=["all", "tune", "holdout"], help="a recorded dataset's half")
    parser.add_argument(
        "--gate",
        nargs=3,
        type=int,
        default=None,
        metavar=("MIN", "MAX", "EVERY"),
        help="the gate's events (200 600 25)",
    )
    parser.add_argument(
        "--shadow-calls", type=float, default=GATE.shadow_calls, help="RLENS_GATE_SHADOW_CALLS (probation's evidence)"
    )
    add_seeds(parser)
    add_out(parser, "bench/out/gate.json")
    args = parser.parse_args()
    print(machine_facts())
    zoo = load_dataset(args.data or settings().service.demo_data)
    if args.tasks != "all":
        zoo = task_half(zoo, args.tasks)
    redis = LocalRedis()
    rows = []
    try:
        for seed in args.seeds:
            for promotion, gate, case in SCENARIOS:
                chosen = (
                    f"{promotion}-{case}" in args.scenarios if args.scenarios else (promotion, gate, case) in DEFAULT
                )
                if not chosen:
                    continue
                forced_at = args.queries // 2 if case == "forced" else None
                if gate is not None and args.gate:
                    gate = replace(gate, min_events=args.gate[0], max_events=args.gate[1], every=args.gate[2])
                if gate is not None:
                    gate = replace(gate, shadow_calls=args.shadow_calls)
                with tempfile.TemporaryDirectory() as workdir:
                    one = promotion.endswith("-one")
                    run = simulate(
                        zoo,
                        redis.url,
                        Path(workdir),
                        gate,
                        promotion.endswith("-warm"),
                        case == "sabotaged",
                        args.queries,
                        seed,
                        forced_at,
                        one,
                        test_split=promotion.endswith("-warm"),
                    )
                ok = [right for _, right in run.served]
                core = run.core
                row = {
                    "seed": seed,
                    "promotion": promotion,
                    "case": case,
                    "served": float(np.mean(ok)),
                    "last_third": float(np.mean(ok[-len(ok) // 3 :])),
                    "promotions": core.stats.promotions,
                    "rollbacks": core.stats.rollbacks,
                    "dropped": core.stats.dropped_candidates,
                    "updates": core.stats.updates,
                    "models_called": float(np.mean(run.calls)),
                }
                if run.forced is not None:
                    versions = [version for version, _ in run.served]
                    start = versions.index(run.forced)
                    row["forced_served"] = sum(v == run.forced for v in versions)  # queries until it was replaced
                    row["after_forced"] = float(np.mean(ok[start + row["forced_served"] :] or [float("nan")]))
                    during = range(start, start + row["forced_served"])
                    # how much worse it was: the replaced champion's accuracy in shadow, where known, minus its own
                    paired = [(run.shadow_right[i], ok[i]) for i in during if run.shadow_right[i] is not None]
                    row["forced_worse"] = float(np.mean([a - b for a, b in paired])) if paired else None
                    row["forced_known"] = len(paired) / max(len(during), 1)
                    row["calls_before"] = float(np.mean(run.calls[:start]))
                    row["calls_forced"] = float(np.mean([run.calls[i] for i in during] or [float("nan")]))
                rows.append(row)
                print(
                    f"seed {seed} {promotion:6s} {case:9s} served {100 * row['served']:.1f} % "
                    f"(last third {100 * row['last_third']:.1f} %); promoted {row['promotions']}, rolled back "
                    f"{row['rollbacks']}, dropped {row['dropped']} of {row['updates']} updates; "
                    f"{row['models_called']:.2f} models called a query"
                    + (
                        f"; the forced policy served {row['forced_served']} queries, "
                        + (
                            f"{100 * row['forced_worse']:.1f} points worse on the {100 * row['forced_known']:.0f} % "
                            "where known, "
                            if row["forced_worse"] is not None  # known where a champion was scored in shadow
                            else "how much worse not known (no champion in shadow), "
                        )
                        + f"{row['calls_forced']:.2f} models called a query ({row['calls_before']:.2f} before)"
                        if run.forced
                        else ""
                    ),
                    flush=True,
                )
    finally:
        redis.stop()
    write_json(
        args.out,
        {
            "machine": machine_facts(),
            "data": str(args.data or "bundled"),
            "queries": args.queries,
            "shadow_calls": args.shadow_calls,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
