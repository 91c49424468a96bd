"""RLAE learning online in the live service: the rlae strategy on the local stack, fed the zoo's generation stream.

    python -m bench.rlae.online [--zoo DIR] [--blocks 24] [--block-size 100] [--rate 40] [--offline-episodes 1024] [--lr 1e-3]
        [--promotions direct gated holdback] [--gate-min-events N] [--gate-max-events N] [--gate-delta 0.02]
        [--gate-split 0.2] [--gate-holdback 0.2] [--out out/bench_rlae_online]

The local stack (tansu broker, redis-server, one learner, one worker) runs the rlae strategy over the zoo's 4
specialists, in process: span 4, at most 16 tokens, stop at a newline, weights sampled from the policy (the
worker's default, so the learner gets on-policy experience), one PPO update per 64 rewarded answers. Traffic:
the zoo's generation stream, the family switching every block (``--seed``, default 7), at R queries/s; each answer's feedback
(the reference text: the learner rewards exact match) is sent as soon as it arrives. Two runs:

- cold: the learner starts from the untrained policy and learns only from the stream;
- warm: the learner is warm-started from an offline `rlens rlae train` run of N episodes on the training split.

``--promotions direct gated holdback`` runs each of those once per promotion: every update live (direct), gated (a
candidate serves ``--gate-split`` of the queries itself and goes live once its reward is shown not worse than the
champion's after ``--gate-min-events`` of its own queries, or is dropped after ``--gate-max-events`` without (equal:
one look, then the newest weights are the next candidate), and holdback (every update serves at once but on ``--gate-holdback``
of the queries, where the champion serves; the learner's line is judged against it after ``--gate-min-events`` of
the champion's queries); the learner's promotions, roll-backs and dropped candidates are reported.

Writes results.json and online.png (rolling exact match of the served answers, and the policy version, against
answers received). With ``--one-stream`` every query has the same stream key, so the family switches are drift
inside it; the learner's drift events (read back from the drift topic) are judged against the switches: delay,
missed switches, false alarms, recovery (rlens.drift.drift_figures), for the ``outcome`` and ``confidence`` signals.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from aiokafka import AIOKafkaConsumer

from bench.common.machine import machine_facts
from bench.common.args import add_out, arguments, write_json
from rlens.progress import quiet_transformers
from rlens.drift import drift_figures
from rlens.messages import DriftEvent
from rlens.rlae.agent import RLAEConfig
from rlens.rlae.decode import TokenEnsemble
from rlens.rlae.observe import SentenceEncoder
from rlens.rlae.train import RLAETrainer
from rlens.service.common.kafka import Topics
from rlens.local.load import LoadReport, open_ended_queries, play
from rlens.local.stack import LocalStack, write_zoo_pool
from rlens.settings import settings
from rlens.zoo.build import load_backend, load_zoo
from rlens.zoo.tasks import generation_split, generation_stream

FAMILIES = ["arithmetic", "counting", "ordering", "pattern"]
MODELS = ["arith-char", "count-bpe", "order-char", "pattern-bpe"]
SPAN, MAX_TOKENS = 4, 16


def offline_run(zoo: Path, episodes: int, out: Path) -> Path:
    """An offline RLAE-PPO run on the training split (what `rlens rlae train` does), for the warm start."""
    torch.set_num_threads(2)
    models = {m.name: m for m in load_zoo(zoo)}
    ensemble = TokenEnsemble([load_backend(models[n]) for n in MODELS])
    cfg = RLAEConfig(span=SPAN, max_tokens=MAX_TOKENS, episodes=episodes)
    RLAETrainer(ensemble, SentenceEncoder(), MODELS, cfg, out, seed=0).run(generation_split(FAMILIES, 1000, seed=100))
    return out


async def drift_events(settings, idle_s: float = 3.0) -> list[DriftEvent]:
    """Every event on the run's drift topic."""
    consumer = AIOKafkaConsumer(
        Topics.from_settings(settings).drift,
        bootstrap_servers=settings.kafka.bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    events, last = [], time.monotonic()
    try:
        while time.monotonic() - last < idle_s:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                events += [DriftEvent.model_validate_json(r.value) for r in records]
                last = time.monotonic()
    finally:
        await consumer.stop()
    return events


def live_run(
    zoo: Path, traffic, rate: float, lr: float, workdir: Path, warm_start: Path | None, gate: dict | None = None
) -> tuple[LoadReport, dict, list[DriftEvent]]:
    """One run of the local stack; ``gate``: the guarded promotion's settings, ``promotion`` among them (None:
    direct)."""
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh learner (no checkpoint of an earlier run to resume)
    pool = write_zoo_pool(zoo, MODELS, workdir / "pool.json")
    config = settings().updated(
        {
            "pool_file": pool,
            "strategy": "rlae",
            "rlae_span": SPAN,
            "rlae_max_tokens": MAX_TOKENS,
            "rlae_lr": lr,
            "kafka_session_timeout_ms": 2000,
            "kafka_heartbeat_ms": 500,
            **(gate or {}),
        }
    )
    stack = LocalStack(config, workdir)
    try:
        stack.start_learner(*(["--warm-start", str(warm_start)] if warm_start else []))
        stack.start_worker()
        stack.wait_ready(180)
        report = asyncio.run(play(stack.settings, traffic, rate=rate, idle_timeout_s=120))
        time.sleep(2.0)  # the last feedback reaches the learner
        events = asyncio.run(drift_events(stack.settings))
    finally:
        stack.stop()
    directory = stack.settings.learner.checkpoint_dir
    state = json.loads((directory / (directory / "LATEST").read_text() / "state.json").read_text())
    return report, state, events


def drift_summary(report: LoadReport, events: list[DriftEvent], families: dict[str, str]) -> dict:
    """Per signal (``outcome``, ``confidence``): detection delays after each family switch, missed switches and
    false alarms (rlens.drift.drift_figures), with the queries in the order they were sent (answers arrive a little
    out of order at block edges) and each task's family."""
    order = sorted(families, key=lambda qid: int(qid.rsplit("-", 1)[1]))
    index = {qid: i for i, qid in enumerate(order)}
    correct = dict(zip(report.query_ids, report.outcomes))
    task = np.array([families[qid] for qid in order])
    out = {}
    for signal in ("outcome", "confidence"):
        found = sorted(index[e.query_id] for e in events if e.signal == signal and e.query_id in index)
        figures = drift_figures(np.array([float(correct.get(qid, False)) for qid in order]), found, task)
        out[signal] = {
            "detections": found,
            "delays": figures.delays,
            "missed_switches": figures.missed_switches,
            "switches": figures.switches,
            "false_alarms_per_1000": figures.false_alarms_per_1000,
            "recovery": figures.recovery,
        }
    return out


def summary(report: LoadReport, state: dict, block_size: int, families: dict[str, str]) -> dict:
    outcomes = np.array(report.outcomes, dtype=float)
    cycle = len(FAMILIES) * block_size
    return {
        "answered": report.answered,
        "duplicates": report.duplicates,
        "no_answer": report.no_answer,
        "accuracy": report.accuracy,
        "first_cycle": float(outcomes[:cycle].mean()),
        "last_cycle": float(outcomes[-cycle:].mean()),
        "per_block": [float(outcomes[i : i + block_size].mean()) for i in range(0, len(outcomes), block_size)],
        "per_family_last_cycle": {
            f: float(
                np.mean(
                    [
                        o
                        for o, s in zip(report.outcomes[-cycle:], [families[q] for q in report.query_ids[-cycle:]])
                        if s == f
                    ]
                )
            )
            for f in FAMILIES
        },
        "policy_versions": max(report.versions),
        "updates": state["stats"]["updates"],
        **{k: state["stats"][k] for k in ("promotions", "rollbacks", "dropped_candidates")},
        "joined": state["stats"]["joined"],
        "queries_per_s": report.answered / report.elapsed_s,
        "p50_ms": report.latency_percentile(50),
        "p99_ms": report.latency_percentile(99),
        "outcomes": report.outcomes,
        "families": [families[q] for q in report.query_ids],
        "versions": report.versions,
    }


def plot(results: dict, block_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    width = block_size
    for name, run in results["runs"].items():
        outcomes = np.array(run["outcomes"], dtype=float)
        x = np.arange(width, len(outcomes) + 1)
        top.plot(
            x,
            np.convolve(outcomes, np.ones(width) / width, mode="valid"),
            label=f"{name} (overall {100 * run['accuracy']:.1f} %)",
        )
        bottom.plot(np.arange(1, len(outcomes) + 1), run["versions"], label=name)
        for signal, marker in (("outcome", "v"), ("confidence", "^")):
            found = run.get("drift", {}).get(signal, {}).get("detections", [])
            top.plot(
                found,
                [0.97 if marker == "v" else 0.92] * len(found),
                marker,
                ms=4,
                ls="none",
                label=f"{name}: drift on {signal}" if found else None,
            )
    streams = next(iter(results["runs"].values()))["families"]
    for b in range(0, len(streams), block_size):
        for ax in (top, bottom):
            ax.axvline(b, color="lightgray", lw=0.7)
        # mid-block: arrival order jitters at the edges
        top.text(b + 3, 0.02, streams[min(b + block_size // 2, len(streams) - 1)][:5], fontsize=7, color="gray")
    for label, value, style in (
        ("offline RLAE-PPO (frozen, greedy)", 0.859, ":"),
        ("best single model", 0.507, "--"),
        ("uniform (GaC)", 0.122, "-."),
    ):
        top.axhline(value, color="black", lw=0.8, ls=style, label=label)
    top.set_ylabel(f"exact match (rolling {width})")
    top.set_ylim(0, 1.02)
    top.legend(fontsize=8, loc="upper left")
    top.set_title(
        "RLAE in the live service: served answers while the learner updates online (family switches every block)",
        fontsize=10,
    )
    bottom.set_ylabel("policy version")
    bottom.set_xlabel("answers received")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=None)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--block-size", type=int, default=100)
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument(
        "--offline-episodes", type=int, default=1024, help="the warm start's offline training (0: no warm run)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of the online updates (RLENS_RLAE_LR)")
    add_out(parser, "out/bench_rlae_online")
    parser.add_argument("--seed", type=int, default=7, help="the stream's seed (task order and tasks)")
    parser.add_argument("--promotions", nargs="+", choices=["direct", "gated", "holdback"], default=["direct"])
    parser.add_argument(
        "--gate-min-events", type=int, default=None, help="RLENS_GATE_MIN_EVENTS (default: the service's for rlae)"
    )
    parser.add_argument(
        "--gate-max-events", type=int, default=None, help="RLENS_GATE_MAX_EVENTS (default: the service's for rlae)"
    )
    parser.add_argument("--gate-delta", type=float, default=0.02, help="gated: RLENS_GATE_DELTA")
    parser.add_argument("--gate-split", type=float, default=0.2, help="gated: RLENS_GATE_SPLIT")
    parser.add_argument("--gate-holdback", type=float, default=0.2, help="holdback: RLENS_GATE_HOLDBACK")
    parser.add_argument(
        "--one-stream",
        action="store_true",
        help="one stream key for all families (the switches are drift inside it), instead of one per family",
    )
    args = parser.parse_args()
    quiet_transformers()
    print(f"machine: {machine_facts()}", flush=True)
    zoo = args.zoo or settings().service.zoo_dir
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = generation_stream(FAMILIES, args.blocks, args.block_size, seed=args.seed)
    runs = {"cold": None}
    if args.offline_episodes:
        started = time.perf_counter()
        shutil.rmtree(args.out / "offline", ignore_errors=True)
        runs["warm"] = offline_run(zoo, args.offline_episodes, args.out / "offline")
        print(f"offline run: {args.offline_episodes} episodes in {time.perf_counter() - started:.0f} s")
    results = {
        "settings": {
            **vars(args),
            "zoo": str(zoo),
            "out": str(args.out),
            "models": MODELS,
            "span": SPAN,
            "max_tokens": MAX_TOKENS,
        },
        "runs": {},
    }
    gate = {
        "gate_min_events": args.gate_min_events,
        "gate_max_events": args.gate_max_events,
        "gate_delta": args.gate_delta,
        "gate_split": args.gate_split,
        "gate_holdback": args.gate_holdback,
    }
    plan = [
        (
            start if promotion == "direct" else f"{start}-{promotion}",
            warm,
            None if promotion == "direct" else {"promotion": promotion, **gate},
        )
        for start, warm in runs.items()
        for promotion in args.promotions
    ]
    for name, warm, gated in plan:
        traffic = open_ended_queries(tasks, f"online-{name}")
        families = {q.query_id: q.stream for q, _ in traffic}
        if args.one_stream:  # the service is not told the family: the switches are drift inside one stream key
            traffic = [(q.model_copy(update={"stream": "all"}), reference) for q, reference in traffic]
        report, state, events = live_run(zoo, traffic, args.rate, args.lr, args.out / name, warm, gated)
        results["runs"][name] = {
            **summary(report, state, args.block_size, families),
            "drift": drift_summary(report, events, families),
        }
        run = results["runs"][name]
        print(
            f"{name}: {100 * run['accuracy']:.1f} % overall, first cycle {100 * run['first_cycle']:.1f} %, last cycle {100 * run['last_cycle']:.1f} %; "
            f"{run['updates']} updates, {run['promotions']} promotions, {run['rollbacks']} roll-backs, "
            f"{run['dropped_candidates']} dropped; {run['answered']} answered ({run['queries_per_s']:.1f}/s, p50 {run['p50_ms']:.0f} ms, p99 {run['p99_ms']:.0f} ms)"
        )
        print("  per block: " + " ".join(f"{100 * a:.0f}" for a in run["per_block"]))
        print(
            "  last cycle per family: "
            + ", ".join(f"{f} {100 * a:.1f}" for f, a in run["per_family_last_cycle"].items())
        )
        for signal, d in run["drift"].items():
            print(
                f"  drift, {signal}: {d['switches'] - d['missed_switches']} of {d['switches']} switches detected, median delay "
                f"{np.median(d['delays']) if d['delays'] else float('nan'):.0f} queries, {d['false_alarms_per_1000']:.1f} false alarms / 1,000; "
                f"median recovery {np.median(d['recovery']):.0f} queries"
            )
    write_json(args.out / "results.json", results, indent=None)
    plot(results, args.block_size, args.out / "online.png")
    print(f"wrote {args.out}/results.json and online.png")


if __name__ == "__main__":
    main()
