"""Replay harness: RL-Focal, its ablations and every baseline on the same test stream of a recorded dataset.

The RL-Focal variants are independent runs (warm start + online), spread over worker processes; progress is
reported in "steps" (one step = one question seen by one variant, warm-start passes included).

Numerics: an RL run is chaotic in floating-point rounding (one flipped decision changes every later one), and
torch's CPU kernels round differently per instruction set (AVX-512, AVX2, ...). With ``numerics="portable"``
(the default) each variant runs in a fresh process with torch's scalar kernels and MKL's conditional numerical
reproducibility mode (:data:`PORTABLE_NUMERICS`), so a seed gives the same figures on any x86-64 machine with the
same package versions; ``"native"`` uses the fastest kernels of this CPU (the same figures only on the same kind
of CPU).
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Literal

import numpy as np
import torch

from rlens.evaluation import baselines
from rlens.records.recorded import RecordedDataset
from rlens.focal.config import FocalConfig
from rlens.focal.engine import FocalEngine
from rlens.focal.policy_file import load_policy, save_policy
from rlens.drift import DriftMonitor, drift_figures
from rlens.focal.schedule import OnlineTrace, Reaction, run_online, warm_start, warm_start_steps
from rlens.evaluation.protocols import Protocol, split
from rlens.evaluation.results import CostPoint, DriftResult, MethodResult, ReplayResults
from rlens.numerics import PORTABLE_NUMERICS, environment

# name -> (changes to the configuration, description)
RL_VARIANTS: dict[str, tuple[dict, str]] = {
    "rl_focal": ({}, "RL-Focal: Decider (focal diversity + other metrics) and Fusion, MAPPO"),
    "rl_focal_all_models": ({"use_decider": False}, "ablation: no Decider, Fusion over the whole pool"),
    "rl_focal_no_diversity": ({"metrics": ()}, "ablation: Decider without diversity metrics"),
    "rl_focal_kappa": ({"metrics": ("kappa",)}, "ablation: Fleiss' kappa instead of focal diversity"),
    "rl_focal_paper_decider": (
        {"decider_sees": "paper"},
        "ablation: the paper's Decider observation (pool bits and diversity metrics only)",
    ),
    "rl_focal_marginal": (
        {"marginal_diversity": True},
        "variant: the Decider also sees each model's marginal effect on the pool's focal diversity",
    ),
    "rl_focal_uncalibrated": (
        {"calibration_rows": 0},
        "ablation: the greedy Fusion's distribution alone, without its pool's calibrated vote",
    ),
}
# what a replay runs unless asked (the marginal one measured no gain)
DEFAULT_VARIANTS = [name for name in RL_VARIANTS if name != "rl_focal_marginal"]
PROGRESS_EVERY = 50
Numerics = Literal["portable", "native"]


@dataclass
class ReplayRun:
    results: ReplayResults
    test: RecordedDataset
    answers: dict[str, np.ndarray]  # method -> answer (choice index) per test question
    pool_size: np.ndarray  # RL-Focal's pool per test question
    models_called: np.ndarray  # RL-Focal's calls per test question (probes included)
    cost_share: np.ndarray  # RL-Focal's share of the whole pool's cost per test question (probes included)


def variant_steps(config: FocalConfig, n_warm: int, n_test: int, variant: str) -> int:
    return warm_start_steps(replace(config, **RL_VARIANTS[variant][0]), n_warm) + n_test


@dataclass(frozen=True)
class DriftOptions:
    """How the online stream meets drift: ``one_stream`` puts every question on one window key (the task unknown,
    as in the service, so task switches are drift inside it; otherwise each task is its own key); the learner's
    detector (:class:`rlens.drift.DriftMonitor`) is fed every outcome, and ``reaction`` applies on its detections."""

    one_stream: bool = False
    reaction: Reaction = "none"
    keep: int = 5


@dataclass(frozen=True)
class PolicyFiles:
    """``start``: a pre-trained policy (:mod:`rlens.focal.policy_file`) every variant starts from instead of the warm
    start; ``save``: where the main variant's final policy goes."""

    start: Path | None = None
    save: Path | None = None


def run_variant(
    variant: str,
    data: RecordedDataset,
    warm_index: np.ndarray,
    test_index: np.ndarray,
    config: FocalConfig,
    seed: int,
    report: Callable[[int], None] | None,
    drift: DriftOptions = DriftOptions(),
    policies: PolicyFiles = PolicyFiles(),
) -> OnlineTrace:
    """Warm start (when there is a warm split; a pre-trained policy instead, with ``policies.start``) then online
    operation, for one RL-Focal variant; the main variant's final policy to ``policies.save``."""
    torch.set_num_threads(1)
    engine = FocalEngine(data.n_models, data.model_costs, replace(config, **RL_VARIANTS[variant][0]), seed=seed)
    if policies.start is not None:
        load_policy(engine, data.model_names, policies.start)
    elif len(warm_index):
        warm_start(engine, data.subset(warm_index), report)
    trace = run_online(
        engine,
        data.subset(test_index),
        report,
        stream="one" if drift.one_stream else None,
        drift=DriftMonitor(),
        reaction=drift.reaction,
        keep=drift.keep,
    )
    if policies.save is not None and variant == "rl_focal":
        save_policy(engine, data.model_names, policies.save)
    return trace


class _Batched:
    """Turns per-step progress calls into one message every PROGRESS_EVERY steps (cheap across processes)."""

    def __init__(self, sink: Callable[[int], None]):
        self.sink, self.pending = sink, 0

    def __call__(self, n: int) -> None:
        self.pending += n
        if self.pending >= PROGRESS_EVERY:
            self.sink(self.pending)
            self.pending = 0

    def flush(self) -> None:
        if self.pending:
            self.sink(self.pending)
            self.pending = 0


_progress_queue = None  # a worker process's queue of progress counts, set by _init_worker


def _init_worker(progress_queue) -> None:
    global _progress_queue
    _progress_queue = progress_queue


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Processes started inside ignore SIGINT from their first instruction (an ignored signal stays ignored across
    exec, and Python then installs no handler): Ctrl-C reaches the parent alone, which stops them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass(frozen=True)
class _Job:
    """One RL-Focal run of a replay: a variant under a configuration, with its policy files."""

    variant: str
    config: FocalConfig
    policies: PolicyFiles


def _job_in_worker(job: _Job, data, warm_index, test_index, seed, drift) -> OnlineTrace:
    report = _Batched(_progress_queue.put) if _progress_queue is not None else None
    trace = run_variant(job.variant, data, warm_index, test_index, job.config, seed, report, drift, job.policies)
    if report:
        report.flush()
    return trace


def _run_jobs(
    jobs: list[_Job], data, warm_index, test_index, seed, workers, progress, drift, numerics: Numerics
) -> list[OnlineTrace]:
    """Each job's trace, in order; in this process only for native numerics with one worker (or one job).

    On KeyboardInterrupt (Ctrl-C) the job processes are terminated at once and the interrupt goes on up."""
    if numerics == "native" and (workers <= 1 or len(jobs) == 1):
        traces = []
        for job in jobs:
            report = _Batched(progress) if progress else None
            traces.append(
                run_variant(job.variant, data, warm_index, test_index, job.config, seed, report, drift, job.policies)
            )
            if report:
                report.flush()
        return traces
    context = multiprocessing.get_context("spawn")
    progress_queue = context.SimpleQueue()

    def drain() -> None:
        while not progress_queue.empty():
            n = progress_queue.get()
            if progress:
                progress(n)

    with environment(PORTABLE_NUMERICS if numerics == "portable" else {}), _sigint_ignored():
        pool = context.Pool(max(1, min(workers, len(jobs))), _init_worker, (progress_queue,))
    try:
        pending = [pool.apply_async(_job_in_worker, (job, data, warm_index, test_index, seed, drift)) for job in jobs]
        while not all(r.ready() for r in pending):
            drain()
            time.sleep(0.1)
        drain()
        traces = [r.get() for r in pending]
        pool.close()
        return traces
    finally:
        pool.terminate()  # at once on an error or Ctrl-C; a no-op for a pool already closed and done
        pool.join()


def total_steps(
    data: RecordedDataset,
    protocol: Protocol,
    config: FocalConfig,
    variants: list[str],
    pretrained: bool = False,
    budgets: tuple[float | None, ...] = (),
) -> int:
    """The progress steps of a replay (no warm start from a pre-trained policy), its budgets' runs included."""
    warm_index, test_index = split(data, protocol)
    n_warm = 0 if pretrained else len(warm_index)
    runs = [*variants, *["rl_focal"] * len(other_budgets(config, budgets))]
    return sum(variant_steps(config, n_warm, len(test_index), v) for v in runs)


def replay(
    data: RecordedDataset,
    protocol: Protocol,
    seed: int = 0,
    config: FocalConfig | None = None,
    variants: list[str] | None = None,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
    drift: DriftOptions = DriftOptions(),
    numerics: Numerics = "portable",
    policies: PolicyFiles = PolicyFiles(),
    budgets: tuple[float | None, ...] = (),
) -> ReplayRun:
    """Run every method on the test stream of ``protocol`` and collect results.json's content (with RL-Focal's
    drift detections and recovery figures). ``numerics``: see the module docstring. ``budgets``: RL-Focal also runs
    under each (``FocalConfig.budget``; None: the cost weight alone), for its accuracy against cost (``cost_curve``)."""
    started = time.perf_counter()
    config = config or FocalConfig()
    variants = list(DEFAULT_VARIANTS) if variants is None else variants
    unknown = set(variants) - set(RL_VARIANTS)
    if unknown:
        raise ValueError(f"unknown RL-Focal variants {sorted(unknown)}; known: {sorted(RL_VARIANTS)}")
    warm_index, test_index = split(data, protocol)
    if len(test_index) == 0:
        raise ValueError("the test stream is empty: every task has too few questions for this protocol")
    warm, test = data.subset(warm_index), data.subset(test_index)
    jobs = [_Job(v, config, policies) for v in variants]
    budgets = other_budgets(config, budgets)
    jobs += [_Job("rl_focal", replace(config, budget=b), PolicyFiles(policies.start)) for b in budgets]
    found_traces = _run_jobs(jobs, data, warm_index, test_index, seed, workers, progress, drift, numerics)
    traces = dict(zip(variants, found_traces))

    valid_positions = [np.flatnonzero(row) for row in test.choice_mask]
    found = {
        variant: (
            np.array([valid_positions[i][a] for i, a in enumerate(traces[variant].answers)]),
            float(traces[variant].models_called.mean()),
            RL_VARIANTS[variant][1],
            float(traces[variant].cost_share.mean()),
        )
        for variant in variants
    }
    found.update(_baselines(data, warm, test, protocol))
    main = traces.get("rl_focal") or next(iter(traces.values()))
    results = ReplayResults(
        protocol=protocol.value,
        seed=seed,
        n_test=len(test_index),
        dataset=data.name,
        models=data.model_names,
        methods=_method_results(data, test, found, traces),
        config=config.to_dict(),
        elapsed_s=round(time.perf_counter() - started, 2),
        numerics=numerics,
        drift=_drift_result(main, drift, test),
        cost_curve=_cost_curve(traces, config, dict(zip(budgets, found_traces[len(variants) :])), data) or None,
    )
    answers = {name: predicted for name, (predicted, *_) in found.items()}
    return ReplayRun(results, test, answers, main.pool_size, main.models_called, main.cost_share)


def _baselines(
    data: RecordedDataset, warm: RecordedDataset, test: RecordedDataset, protocol: Protocol
) -> dict[str, tuple[np.ndarray, float, str, float]]:
    """Every baseline's answers on the test stream, models called per query, description and share of the pool's
    cost per query."""
    found: dict[str, tuple[np.ndarray, float, str, float]] = {}

    def add(name: str, run: baselines.BaselineRun | None, description: str) -> None:
        if run is not None:
            found[name] = (run.answers, run.models_called, description, run.cost_share)

    hindsight = (
        " (chosen in hindsight on the test stream: no warm split)"
        if protocol == Protocol.stream
        else " (chosen on the warm-start split)"
    )
    for j, run in baselines.single_models(test).items():
        add(f"single:{data.model_names[j]}", run, "one model alone")
    add("best_single", baselines.best_single(warm, test), "best single model" + hindsight)
    add(
        "best_single_per_task", baselines.best_single_per_task(warm, test), "best single model of each task" + hindsight
    )
    add("plurality", baselines.plurality(test), "plurality vote of all models (ties: larger summed probability)")
    add("soft_vote", baselines.soft_voting(test), "argmax of the mean distribution of all models")
    add("hedge", baselines.hedge(test), "online Hedge weights over the models, weighted vote")
    add(
        "online_stacking",
        baselines.online_stacking(test),
        "per-task conditional logit on every model's log-probabilities, one SGD step after each label",
    )
    add(
        "stacking",
        baselines.stacking(warm, test),
        "per-task logistic stacking on log-probabilities, fit on the warm-start split",
    )
    add("oracle", baselines.oracle(test), "any model correct (upper bound)")
    return found


def _method_results(
    data: RecordedDataset,
    test: RecordedDataset,
    found: dict[str, tuple[np.ndarray, float, str, float]],
    traces: dict[str, OnlineTrace],
) -> dict[str, MethodResult]:
    """Each method's accuracy, overall and per task, its calls, and (RL-Focal's variants) how often it explored
    and how its greedy answers did."""
    task_names = {int(t): data.task_name(t) for t in np.unique(test.task)}
    methods = {}
    for name, (predicted, calls, description, cost_share) in found.items():
        correct = predicted == test.labels
        per_task = {task_names[t]: float(correct[test.task == t].mean()) for t in task_names}
        exploration = (
            {
                "explored": float(traces[name].explored.mean()),
                "greedy_accuracy": float(traces[name].greedy_correct.mean()),
            }
            if name in traces
            else {}
        )
        methods[name] = MethodResult(
            accuracy=float(correct.mean()),
            per_task=per_task,
            mean_models_called=calls,
            cost_share=round(cost_share, 6),
            description=description,
            **exploration,
        )
    return methods


def other_budgets(config: FocalConfig, budgets: tuple[float | None, ...]) -> tuple[float | None, ...]:
    """The budgets to run besides ``config``'s own: once each, the cost weight alone (None) first, then lowest first."""
    return tuple(sorted({b for b in budgets if b != config.budget}, key=lambda b: -1.0 if b is None else b))


def _cost_curve(
    traces: dict[str, OnlineTrace],
    config: FocalConfig,
    budgeted: dict[float | None, OnlineTrace],
    data: RecordedDataset,
) -> list[CostPoint]:
    """RL-Focal's accuracy against the share of the pool's cost it spent: as run (``config``'s budget, or the cost
    weight alone; when ``rl_focal`` was among the variants), then under each budget in ``budgeted`` (None: the cost
    weight alone; as caps when ``config``'s are), in order; empty without budgets."""
    if not budgeted:
        return []
    runs = [(config.budget, traces["rl_focal"])] if "rl_focal" in traces else []
    runs += list(budgeted.items())
    return [
        CostPoint(
            budget=budget,
            cap=config.budget_cap and budget is not None,
            cost_share=round(float(trace.cost_share.mean()), 6),
            accuracy=float(trace.correct.mean()),
            mean_models_called=float(trace.models_called.mean()),
        )
        for budget, trace in runs
    ]


def _drift_result(main: OnlineTrace, drift: DriftOptions, test: RecordedDataset) -> DriftResult:
    """RL-Focal's drift detections on the test stream, and their delays and recovery at the task switches."""
    detections = [i for i, _ in main.detections]
    figures = drift_figures(main.correct, detections, test.task)
    return DriftResult(
        one_stream=drift.one_stream,
        detector="adwin",
        reaction=drift.reaction,
        detections=detections,
        signals=[signals for _, signals in main.detections],
        delays=figures.delays,
        missed_switches=figures.missed_switches,
        switches=figures.switches,
        false_alarms_per_1000=figures.false_alarms_per_1000,
        recovery=figures.recovery,
    )
