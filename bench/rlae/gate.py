"""Guarded promotion for ``rlae`` (issue 35): served exact match with every update live (direct), through the gate's
A/B split (gated: a candidate serves ``--split``) and with holdback (every update serves at once, the champion
``--holdback`` of the queries), for a clean learner, a sabotaged one (it trains on the reward turned upside down,
1 − exact match; the feedback stays honest) and a bad policy an operator forces live.

    python -m bench.rlae.gate [--zoo DIR] [--queries 2400] [--seeds 0 1 2] [--stream-seed 7] [--warm]
        [--min-events 100] [--max-events 100] [--delta 0.02] [--split 0.2] [--holdback 0.2]
        [--scenarios direct-clean gated-clean holdback-clean ...]
        [--out bench/out/rlae-gate.json]

No Kafka: a real rlae worker (the zoo's 4 specialists in process, MiniLM, span 4, at most 16 tokens, weights
sampled) and a real learner core (PPO every 64 rewarded answers, as the service's defaults), the learner's policies
handed to the worker as the policy topic would, each answer's feedback (its reference) at once. Traffic: the zoo's
generation stream, the family switching every 100 queries (``--stream-seed`` + the seed). ``--warm``: the learner
starts from an offline run of 1,024 episodes on the training split (live at once; gated, the first champion). *Forced*: halfway,
an operator sets the untrained policy live again (signed, as ``rlens policy promote`` does). Prints served exact
match overall and over the last third, the share the candidates served, and the gate's verdicts.
Portable numerics (as `rlens replay`), so a seed serves the same figures on any x86-64 machine with the same zoo
(`rlens zoo build` trains it with them too).
"""

from __future__ import annotations

import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")  # portable numerics (as `rlens replay`): before torch loads
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import asyncio  # noqa: E402
import shutil  # noqa: E402
from dataclasses import replace  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common.args import add_out, add_seeds, arguments, write_json  # noqa: E402
from bench.common.machine import machine_facts  # noqa: E402
from bench.rlae.online import FAMILIES, MODELS, MAX_TOKENS, SPAN, offline_run  # noqa: E402
from bench.robustness.gate import SIGNER, TOKENS, record  # noqa: E402
from rlens.checkpoint import CheckpointStore  # noqa: E402
from rlens.progress import quiet_transformers  # noqa: E402
from rlens.local.load import open_ended_queries  # noqa: E402
from rlens.messages import Feedback  # noqa: E402
from rlens.rlae.agent import make_policy  # noqa: E402
from rlens.rlae.decode import TokenEnsemble  # noqa: E402
from rlens.rlae.observe import SentenceEncoder, obs_dim  # noqa: E402
from rlens.rlae.train import RLAEAgent  # noqa: E402
from rlens.service.common.policy import PolicyHistory, encode_policy  # noqa: E402
from rlens.service.learner.core import LearnerCore  # noqa: E402
from rlens.service.learner.gate import Gate, GateConfig  # noqa: E402
from rlens.service.learner.online import RLAEOnlineTrainer  # noqa: E402
from rlens.service.worker.rlae import RLAEWorker  # noqa: E402
from rlens.settings import settings  # noqa: E402
from rlens.zoo.build import load_backend, load_zoo  # noqa: E402
from rlens.zoo.tasks import exact_match, generation_stream  # noqa: E402

BATCH = 32
CASES = ("clean", "sabotaged", "forced")


def simulate(
    ensemble: TokenEnsemble,
    encoder: SentenceEncoder,
    traffic: list,
    workdir: Path,
    gate: GateConfig | None,
    split: float,
    case: str,
    seed: int,
    warm: Path | None,
) -> SimpleNamespace:
    """The traffic through a worker and a learner core; ``gate`` None: direct promotion. Returns (served version,
    right, served by a candidate) per query, the learner's stats and the forced version."""
    cfg = replace(settings().rlae_config(), span=SPAN, max_tokens=MAX_TOKENS)  # the service's, as bench.rlae.online
    m = len(MODELS)
    agent = RLAEAgent(make_policy(obs_dim(m), m, cfg, seed).eval(), encoder, cfg, m)
    untrained = {k: v.clone() for k, v in agent.policy.state_dict().items()}
    worker = RLAEWorker(ensemble, agent, MODELS, None, SIGNER.verifier(), TOKENS, ["\n"], seed=seed, split=split)
    trainer = RLAEOnlineTrainer(make_policy(obs_dim(m), m, cfg, seed), cfg, MODELS, seed, settings().rlae.rehearsal)
    if case == "sabotaged":  # training goes wrong: the reward upside down (the feedback honest)
        honest = trainer.remember
        trainer.remember = lambda experience, feedback, reward: honest(experience, feedback, 1.0 - reward)
    shutil.rmtree(workdir, ignore_errors=True)
    core = LearnerCore(
        trainer, MODELS, None, CheckpointStore(workdir), SIGNER, TOKENS, gate=Gate(gate) if gate else None
    )

    published: list = []

    def deliver(policies) -> None:
        for policy in policies:
            if policy is not None:
                assert worker.receive_policy(policy) is None
                published.append(policy)

    async def scenario():
        served, forced = [], None
        for start in range(0, len(traffic), BATCH):
            deliver(core.take_policies())
            if case == "forced" and forced is None and start >= len(traffic) // 2:
                bad = encode_policy(untrained, 1, core.epoch, MODELS, "rlae", SIGNER)
                forced = PolicyHistory(published, []).republish(bad, SIGNER, "forced live by the simulation")
                deliver([forced, *core.on_policy(forced)])
            batch = traffic[start : start + BATCH]
            out = await worker.handle([q for q, _ in batch])
            answers = {a.query_id: a for a in out.answers}
            references = {q.query_id: reference for q, reference in batch}
            for i, e in enumerate(out.experience):
                reference = references[e.query_id]
                served.append(
                    (e.policy_version, exact_match(e.text, reference), e.split is not None and e.split.candidate)
                )
                feedback = Feedback(query_id=e.query_id, token=answers[e.query_id].feedback_token, reference=reference)
                joined = [
                    await core.on_experience(e, record("rlens.experience", start + i)),
                    await core.on_feedback(feedback, record("rlens.feedback", start + i)),
                ]
                deliver(policy for policy, _ in joined)
        return served, forced

    if warm is not None:
        core.warm_start(warm)  # gated: live at once, in the learner's outbox
        if gate is None:
            deliver([core.current_policy()])
    served, forced = asyncio.run(scenario())
    return SimpleNamespace(served=served, stats=core.stats, forced=forced.version if forced else None)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=None)
    parser.add_argument("--queries", type=int, default=2400)
    add_seeds(parser)
    parser.add_argument("--stream-seed", type=int, default=7, help="the stream of seed k is generated with this + k")
    parser.add_argument("--warm", action="store_true", help="start from an offline run (1,024 episodes)")
    parser.add_argument("--min-events", type=int, default=100)
    parser.add_argument("--max-events", type=int, default=100)
    parser.add_argument("--delta", type=float, default=0.02)
    parser.add_argument("--split", type=float, default=0.2, help="gated: the candidate's share")
    parser.add_argument("--holdback", type=float, default=0.2, help="holdback: the champion's share")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=[f"{p}-{c}" for p in ("direct", "gated", "holdback") for c in CASES],
        help="promotion-case pairs (direct-clean, gated-forced, holdback-sabotaged, ...)",
    )
    add_out(parser, "bench/out/rlae-gate.json")
    args = parser.parse_args()
    quiet_transformers()
    torch.set_num_threads(2)
    print(f"machine: {machine_facts()}", flush=True)
    zoo = load_zoo(args.zoo or settings().service.zoo_dir)
    models = {m.name: m for m in zoo}
    ensemble, encoder = TokenEnsemble([load_backend(models[n]) for n in MODELS]), SentenceEncoder()
    gates = {
        "direct": None,
        "gated": GateConfig(args.min_events, args.max_events, every=25, delta=args.delta, split=args.split),
        "holdback": GateConfig(
            args.min_events, args.max_events, every=25, delta=args.delta, split=args.split, holdback=args.holdback
        ),
    }
    blocks = -(-args.queries // 100)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        warm = offline_run(args.zoo or settings().service.zoo_dir, 1024, Path(tmp) / "offline") if args.warm else None
        for seed in args.seeds:
            tasks = generation_stream(FAMILIES, blocks, 100, seed=args.stream_seed + seed)[: args.queries]
            for scenario in args.scenarios:
                promotion, case = scenario.split("-")
                started = time.perf_counter()
                traffic = open_ended_queries(tasks, f"{scenario}-{seed}")
                run = simulate(
                    ensemble,
                    encoder,
                    traffic,
                    Path(tmp) / scenario,
                    gates[promotion],
                    args.split,
                    case,
                    seed,
                    warm,
                )
                right = np.array([ok for _, ok, _ in run.served], dtype=float)
                by_candidate = np.array([c for _, _, c in run.served])
                versions = [v for v, _, _ in run.served]
                row = {
                    "scenario": scenario,
                    "seed": seed,
                    "accuracy": float(right.mean()),
                    "last_third": float(right[-len(right) // 3 :].mean()),
                    "candidate_share": float(by_candidate.mean()),
                    "candidate_accuracy": float(right[by_candidate].mean()) if by_candidate.any() else None,
                    "updates": run.stats.updates,
                    "promotions": run.stats.promotions,
                    "rollbacks": run.stats.rollbacks,
                    "dropped": run.stats.dropped_candidates,
                    "resumed": run.stats.resumed,
                    "seconds": time.perf_counter() - started,
                }
                if run.forced is not None:
                    start = versions.index(run.forced)
                    row["forced_served"] = sum(v == run.forced for v in versions[start:])
                    row["after_forced"] = float(right[start + row["forced_served"] :].mean())
                rows.append(row)
                print(
                    f"seed {seed} {scenario}: {100 * row['accuracy']:.1f} % (last third {100 * row['last_third']:.1f}), "
                    f"candidates served {100 * row['candidate_share']:.0f} %; {row['updates']} updates, "
                    f"{row['promotions']} promotions, {row['rollbacks']} roll-backs, {row['dropped']} dropped, "
                    f"{row['resumed']} resumed"
                    + (f"; the forced policy served {row['forced_served']} queries" if run.forced else "")
                    + f" ({row['seconds']:.0f} s)",
                    flush=True,
                )
    for scenario in args.scenarios:
        values = [100 * r["accuracy"] for r in rows if r["scenario"] == scenario]
        print(f"{scenario}: {np.mean(values):.1f} % ({', '.join(f'{v:.1f}' for v in values)})")
    write_json(
        args.out,
        {
            "machine": machine_facts(),
            "settings": {**vars(args), "zoo": str(args.zoo), "out": str(args.out)},
            "runs": rows,
        },
    )


if __name__ == "__main__":
    main()
