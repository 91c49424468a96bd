"""What one learner checkpoint costs as what the learner holds grows: N experiences waiting for their feedback (the
state of a stack whose clients send no feedback) and N recent query ids, then 100 new experiences and 100 joins
since the checkpoint before (5 s of traffic at 40 queries/s); and what restoring that state costs.

    python -m bench.service.checkpoint [--held 1000 10000 100000] [--repeats 5] [--no-restore]
        [--out bench/out/checkpoint.json]

Each checkpoint is the learner's own (``LearnerCore.checkpoint``: weights, optimizer, state, fsynced), on the local
disk; a fresh engine (empty experience buffer). Seconds are the median of ``--repeats`` checkpoints, beside the
first one, which writes everything held on the learner's thread, and a compaction of the journals (everything
held written again, once per as many changes as are held, in a thread of its own): the checkpoint that starts it,
those during it (each after the same traffic), its time, and the checkpoint after it. The bytes are what the
checkpoint directory holds afterwards; peak RSS is the process's so far.
``--no-restore`` skips the restore, which holds a second learner as large as the first (1,000,000 held then fits
in 24 GB).
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

from bench.common.args import add_out, arguments, write_json
from bench.common.machine import machine_facts
from bench.common.stacks import uniform_experience
from bench.service.learner import Record
from rlens.checkpoint import CheckpointStore
from rlens.focal.engine import FocalEngine
from rlens.messages import Experience
from rlens.service.common.security import FeedbackTokens, PolicySigner, generate_secrets
from rlens.service.common.windows import RedisWindows
from rlens.service.learner.core import LearnerCore
from rlens.service.learner.online import FocalOnlineTrainer

MODELS = [f"m{i}" for i in range(5)]


def learner(directory: Path, secrets: dict, held: int) -> LearnerCore:
    engine = FocalEngine(5, seed=0)
    return LearnerCore(
        FocalOnlineTrainer(engine, MODELS),
        MODELS,
        RedisWindows(Redis.from_url("redis://127.0.0.1:1"), 5, 128),  # never reached: no join before the clock
        CheckpointStore(directory),
        PolicySigner(secrets["RLENS_POLICY_SIGNING_KEY"]),
        FeedbackTokens(secrets["RLENS_FEEDBACK_SECRET"]),
        pending_limit=held + 1000,
        pending_bytes=2**40,
        pending_per_stream=held + 1000,
        done_limit=held,
    )


async def hold(core: LearnerCore, template: Experience, first: int, n: int, offset: int) -> None:
    """``n`` experiences with ids ``q{first}``..., each waiting for its feedback."""
    for i in range(first, first + n):
        message = template.model_copy(update={"query_id": f"q{i}", "stream": f"s{i % 1000}"})
        await core.on_experience(message, Record("rlens.experience", offset + i, message.model_dump_json().encode()))


async def traffic(core: LearnerCore, template: Experience, next_id: int) -> int:
    """200 new experiences and 100 joins (the trainer aside); the next free id."""
    await hold(core, template, next_id, 200, 0)
    for i in range(next_id, next_id + 100):
        core.experience.pop(f"q{i}")
        core.done.add(f"q{i}", time.time())  # the oldest recent id goes: they stay at `held`
    return next_id + 200


async def compact(core: LearnerCore, template: Experience, next_id: int) -> dict:
    """A compaction of the journals in their threads: the checkpoint that starts it (the snapshot), the checkpoints
    meanwhile (each after the same traffic as above), the time until they have finished, and the checkpoint that
    then records the new generations."""
    floors = {name: journal.floor for name, journal in core.journals.items()}
    for journal in core.journals.values():
        journal.floor = -(2**62)  # due now
    started = time.perf_counter()
    core.checkpoint()
    start_s = time.perf_counter() - started
    for name, journal in core.journals.items():
        journal.floor = floors[name]
    meanwhile = []
    while not all(j.compaction is None or j.compaction.done.is_set() for j in core.journals.values()):
        next_id = await traffic(core, template, next_id)
        tick = time.perf_counter()
        core.checkpoint()
        meanwhile.append(time.perf_counter() - tick)
        await asyncio.sleep(0.2)
    compaction_s = time.perf_counter() - started
    next_id = await traffic(core, template, next_id)
    tick = time.perf_counter()
    core.checkpoint()
    assert all(j.compaction is None for j in core.journals.values())
    return {
        "compaction_start_s": start_s,
        "compaction_s": compaction_s,
        "checkpoints_during": len(meanwhile),
        "checkpoint_during_s": statistics.median(meanwhile) if meanwhile else None,
        "checkpoint_during_s_max": max(meanwhile, default=None),
        "compaction_switch_s": time.perf_counter() - tick,
    }


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


async def measure(held: int, repeats: int, restore: bool = True) -> dict:
    secrets = generate_secrets()
    template = uniform_experience()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        core = learner(directory, secrets, held)
        for i in range(held):  # the recent query ids, as if `held` queries had been joined
            core.done.add(f"done-{i}", float(i))
        await hold(core, template, 0, held, 0)
        started = time.perf_counter()
        core.checkpoint()  # the first writes everything held: what a compaction of the journals costs
        first_s = time.perf_counter() - started
        seconds, next_id = [], held
        for _ in range(repeats):
            next_id = await traffic(core, template, next_id)
            started = time.perf_counter()
            core.checkpoint()
            seconds.append(time.perf_counter() - started)
        compaction = await compact(core, template, next_id)
        size = directory_bytes(directory)
        core.checkpoints.close()
        restore_s = None
        if restore:
            started = time.perf_counter()
            restored = learner(directory, secrets, held)
            restore_s = time.perf_counter() - started
            assert len(restored.experience) == len(core.experience) and len(restored.done) == len(core.done)
            restored.checkpoints.close()
    return {
        "held": held,
        "checkpoint_s": statistics.median(seconds),
        "checkpoint_s_max": max(seconds),
        "first_checkpoint_s": first_s,
        **compaction,
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "restore_s": restore_s,
        "directory_mb": size / 2**20,
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--held", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-restore", action="store_true", help="skip the restore (a second learner in memory)")
    add_out(parser, "bench/out/checkpoint.json")
    args = parser.parse_args()
    results: dict = {"machine": machine_facts(), "pid": os.getpid(), "runs": []}
    print(f"machine: {results['machine']}", flush=True)
    for held in args.held:
        run = asyncio.run(measure(held, args.repeats, not args.no_restore))
        results["runs"].append(run)
        print(
            f"held {held:>9,}: checkpoint {1000 * run['checkpoint_s']:8.1f} ms (max {1000 * run['checkpoint_s_max']:.1f}),"
            f" the first (everything) {run['first_checkpoint_s']:6.2f} s,"
            + (f" restore {run['restore_s']:6.2f} s," if run["restore_s"] is not None else "")
            + f" on disk {run['directory_mb']:7.1f} MB, peak RSS {run['max_rss_gb']:.1f} GB;"
            f" a compaction: started in {1000 * run['compaction_start_s']:.0f} ms, done in"
            f" {run['compaction_s']:.2f} s, {run['checkpoints_during']} checkpoints meanwhile"
            + (
                f" ({1000 * run['checkpoint_during_s']:.1f} ms, max {1000 * run['checkpoint_during_s_max']:.1f})"
                if run["checkpoints_during"]
                else ""
            )
            + f", the one after {1000 * run['compaction_switch_s']:.0f} ms",
            flush=True,
        )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
