"""Probation's detection delay and false roll-backs on evidence whose truth is known (issue 61): the gate alone
(:class:`rlens.service.learner.gate.Gate`, its replay estimate and its anytime-valid bounds), no service.

    python -m bench.robustness.anytime [--seeds 0 ... 49] [--worse 0 0.02 0.05 0.1 0.3] [--gate 400 4000 50]
        [--shadow-calls 1.0] [--out bench/out/anytime.json]

A promoted policy on probation, worse than the one it replaced by ``worse`` of accuracy: per query the replaced
one is right with probability 0.6, the promoted one with 0.6 − worse; half the queries give both the same draw (a
question both find easy or hard), the others independent ones. Rewards ±1 (alpha 0), delta 0.02. The replaced one's
pool needs a model the served pool lacks: its answer is known on the 20 % probes, and on the ``--shadow-calls``
share of the queries, where the workers call that model too (the service's RLENS_GATE_SHADOW_CALLS, 1 by default;
0: the probes only, the rest the reward model's). Per effect: the share of runs rolled back, and the
queries until then (median, 90th percentile, max), looked at every ``every`` queries through the anytime-valid bounds
up to ``max_events`` and past it while the probation is watched on (to WATCH × max_events), and the share by
``max_events``, against the one look the gate used to make (the normal 95 % interval at ``min_events``).
"""

from __future__ import annotations

import numpy as np

from bench.common.args import add_out, add_seeds, arguments, write_json
from bench.common.machine import machine_facts
from rlens.messages import Behaviour, Experience, Shadow
from rlens.service.learner.gate import WATCH, Gate, GateConfig

ACCURACY = 0.6  # the replaced policy's
PROBES = 0.2


def shadowed_experience(
    i: int,
    champion_right: bool,
    candidate_right: bool | None,
    probe: bool,
    explore_rate: float = 0.0,
    explored: list[float] | None = None,
    called: bool = False,
) -> Experience:
    pool = [True, True, False]
    behaviour = Behaviour(
        explore_rate=explore_rate,
        probe=probe,
        greedy_pool=pool,
        greedy_answer=0,
        propensity=1.0,
        model_probs=[[0.9, 0.1], [0.8, 0.2], [0.5, 0.5] if probe or called else []],
        reliability=[0.7, 0.6, 0.5],
        label_prior=[0.5, 0.5],
    )
    candidate_pool = [True, False, True]  # needs model 2: known on probes, and where it was ``called`` for it
    answer = (0 if candidate_right else 1) if probe or candidate_right is not None else -1
    return Experience(
        query_id=f"q{i}",
        stream="s",
        policy_version=0,
        n_choices=2,
        decider_state=[0.0] * 4,
        critic_state=[0.0] * 4,
        pool=pool,
        pool_logp=0.0,
        predictions=[0, 0, -1],
        fusion_features=[[0.0], [0.0]],
        answer_index=0 if champion_right else 1,
        answer_logp=0.0,
        behaviour=behaviour,
        shadow=Shadow(
            epoch=1,
            version=2,
            pool=candidate_pool,
            answer=answer,
            explored=explored if answer >= 0 and explored else [],
        ),
    )


def probation(worse: float, seed: int, config: GateConfig, shadow_calls: float = 1.0) -> dict:
    """One probation: when it was rolled back (or passed), and the one-look verdict at min_events."""
    rng = np.random.default_rng(seed)
    gate = Gate(config, np.full(3, 1 / 3), 0.0)
    gate.propose((1, 2), {}, "probation")
    one_look = None
    for i in range(WATCH * config.max_events):  # a probation leaning to the replaced one is watched past max_events
        u = rng.random()
        v = u if rng.random() < 0.5 else rng.random()
        promoted, replaced, probe = bool(u < ACCURACY - worse), bool(v < ACCURACY), bool(rng.random() < PROBES)
        called = bool(rng.random() < shadow_calls)
        known = replaced if probe or called else None
        gate.observe(shadowed_experience(i, promoted, known, probe, called=called), label=0)
        if i + 1 == config.min_events:
            one_look = bool(gate.estimate().low > config.delta)
        verdict = gate.verdict()
        if verdict is not None:
            return {"verdict": verdict, "at": i + 1, "one_look_rolled_back": one_look}
    return {"verdict": None, "at": WATCH * config.max_events, "one_look_rolled_back": one_look}


def main() -> None:
    p = arguments(__doc__)
    add_seeds(p, list(range(50)))
    p.add_argument("--worse", type=float, nargs="+", default=[0.0, 0.02, 0.05, 0.1, 0.3])
    p.add_argument("--gate", type=int, nargs=3, default=[400, 4000, 50], metavar=("MIN", "MAX", "EVERY"))
    p.add_argument("--shadow-calls", type=float, default=GateConfig.shadow_calls, help="RLENS_GATE_SHADOW_CALLS")
    add_out(p, "bench/out/anytime.json")
    args = p.parse_args()
    config = GateConfig(min_events=args.gate[0], max_events=args.gate[1], every=args.gate[2], delta=0.02)
    print(machine_facts())
    rows = []
    for worse in args.worse:
        runs = [probation(worse, seed, config, args.shadow_calls) for seed in args.seeds]
        delays = [r["at"] for r in runs if r["verdict"] == "roll back"]
        row = {
            "worse": worse,
            "runs": len(runs),
            "rolled_back": len(delays) / len(runs),
            "by_max_events": sum(d <= config.max_events for d in delays) / len(runs),
            "delay_median": float(np.median(delays)) if delays else None,
            "delay_p90": float(np.percentile(delays, 90)) if delays else None,
            "delay_max": max(delays) if delays else None,
            "one_look_rolled_back": sum(bool(r["one_look_rolled_back"]) for r in runs) / len(runs),
            "passed_early": sum(r["verdict"] == "passed" and r["at"] < config.max_events for r in runs) / len(runs),
        }
        rows.append(row)
        print(
            f"{100 * worse:4.0f} points worse: rolled back in {100 * row['rolled_back']:5.1f} % of {len(runs)} runs"
            + f" ({100 * row['by_max_events']:.1f} % by {config.max_events})"
            + (
                f" after {row['delay_median']:.0f} queries (p90 {row['delay_p90']:.0f}, max {row['delay_max']})"
                if delays
                else ""
            )
            + f"; one look at {config.min_events}: {100 * row['one_look_rolled_back']:.1f} %"
        )
    write_json(
        args.out, {"machine": machine_facts(), "gate": args.gate, "shadow_calls": args.shadow_calls, "rows": rows}
    )


if __name__ == "__main__":
    main()
