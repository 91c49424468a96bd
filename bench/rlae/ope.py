"""Off-policy evaluation of RLAE's continuous span weights on the zoo's generation stream (issue 35, item 6).

    python -m bench.rlae.ope [--zoo DIR] [--seeds 0 1 2] [--episodes 1024] [--concentrations 1 2 5 10 20 50 100]
                             [--out bench/out/rlae-ope.json]

The zoo's 4 specialists, span 4, as ``bench.rlae.zoo``. Per seed, RLAE-PPO trains on the training split, its policy
kept after every update. Its final policy then serves two logged streams with weights sampled at every span (what
a worker with every request explored logs: each span's observation, weights and their density, and the episode's
exact match): a validation split (400 other training tasks, seed 101) and the test stream (8 blocks of 50 tasks).
Candidates (20 per seed): the kept policies (untrained to final: "policies"), the uniform weights and the simplex
grid of step 0.5 (each single model, each pair evenly: "fixed weights"); each one's true value is its greedy
decoding of the split. Estimates:
the kernel estimator of :mod:`rlens.rlae.ope` (IPS and its self-normalised form) at each concentration. The
concentration is chosen on the validation split (the lowest RMSE over candidates and seeds) and reported on the
test stream: bias, RMSE, 95 % interval coverage, Spearman correlation of estimated and true values per seed, and
the median effective sample size.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.accuracy.ope import spearman
from bench.common.args import add_out, add_seeds, arguments, write_json
from bench.common.machine import machine_facts
from bench.rlae.zoo import FAMILIES, SPECIALISTS
from rlens.progress import quiet_transformers
from rlens.evaluation.ope import Estimate, ips, snips
from rlens.rlae.agent import RLAEConfig, Span, make_policy
from rlens.rlae.decode import TokenEnsemble
from rlens.evaluation.rlae import correct, decode, simplex_grid
from rlens.rlae.observe import SentenceEncoder, obs_dim
from rlens.rlae.ope import episode_weights, kernel_log_density
from rlens.rlae.train import RLAEAgent, RLAETrainer, rollout
from rlens.settings import settings
from rlens.zoo.build import load_backend, load_zoo
from rlens.zoo.tasks import GenerationTask, generation_split, generation_stream

ESTIMATORS = {"ips": ips, "snips": snips}


def logged_stream(
    ensemble: TokenEnsemble, agent: RLAEAgent, tasks: list[GenerationTask], seed: int, batch: int = 64
) -> tuple[list[Span], np.ndarray, np.ndarray]:
    """The agent's sampled decoding of ``tasks``: every span (in order), each span's episode, each episode's reward."""
    generator = torch.Generator().manual_seed(seed)
    spans: list[Span] = []
    episode: list[int] = []
    rewards: list[float] = []
    for start in range(0, len(tasks), batch):
        _, record, batch_rewards = rollout(ensemble, agent, tasks[start : start + batch], False, generator)
        for k, episode_spans in enumerate(record):
            spans += episode_spans
            episode += [start + k] * len(episode_spans)
        rewards += batch_rewards.tolist()
    return spans, np.array(episode), np.array(rewards)


def greedy_weights(candidate: RLAEAgent | np.ndarray, obs: np.ndarray) -> np.ndarray:
    """A candidate's greedy weights [S, M] in the logged states ``obs`` [S, D]."""
    if isinstance(candidate, RLAEAgent):
        with torch.no_grad():
            action, _, _ = candidate.policy.act(torch.from_numpy(obs.astype(np.float32)), greedy=True)
        return candidate.policy.weights(action).double().numpy()
    w = np.asarray(candidate, dtype=np.float64)
    return np.tile(w / w.sum(), (len(obs), 1))


def estimates(
    candidate: RLAEAgent | np.ndarray, log: tuple[list[Span], np.ndarray, np.ndarray], concentrations: list[float]
) -> dict[str, dict[float, Estimate]]:
    spans, episode, rewards = log
    obs = np.stack([s.obs for s in spans])
    actions = np.stack([s.action for s in spans]).astype(np.float64)
    logging = np.array([s.logp for s in spans])
    greedy = greedy_weights(candidate, obs)
    out: dict[str, dict[float, Estimate]] = {name: {} for name in ESTIMATORS}
    for kappa in concentrations:
        w = episode_weights(kernel_log_density(greedy, actions, kappa), logging, episode, len(rewards))
        for name, estimator in ESTIMATORS.items():
            out[name][kappa] = estimator(rewards, w, np.ones(len(w)))
    return out


def summary(rows: list[dict], split: str, name: str, kappa: float, group: str | None = None) -> dict:
    """Bias, RMSE, coverage, Spearman per seed and median ESS of one estimator and concentration over the rows (of
    one ``group`` of candidates, or all)."""
    rows = [r for r in rows if group is None or r["group"] == group]
    errors, covered, ess, ranks = [], [], [], []
    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        values = [r[split]["estimates"][name][str(kappa)]["value"] for r in mine]
        truths = [r[split]["truth"] for r in mine]
        ranks.append(spearman(values, truths))
        for r, value, truth in zip(mine, values, truths):
            e = r[split]["estimates"][name][str(kappa)]
            if np.isfinite(value):
                errors.append(value - truth)
            covered.append(e["low"] <= truth <= e["high"])
            ess.append(e["ess"])
    err = np.array(errors)
    return {
        "bias": float(err.mean()) if len(err) else float("nan"),
        "rmse": float(np.sqrt((err**2).mean())) if len(err) else float("nan"),
        "coverage": float(np.mean(covered)),
        "spearman": float(np.nanmean(ranks)),
        "spearman_per_seed": ranks,
        "median_ess": float(np.median(ess)),
    }


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--zoo", type=Path, default=None)
    add_seeds(parser)
    parser.add_argument("--episodes", type=int, default=1024, help="the logging policy's training episodes")
    parser.add_argument("--concentrations", type=float, nargs="+", default=[1, 2, 5, 10, 20, 50, 100])
    add_out(parser, "bench/out/rlae-ope.json")
    args = parser.parse_args()
    print(f"machine: {machine_facts()}", flush=True)
    torch.set_num_threads(1)
    quiet_transformers()
    models = {m.name: m for m in load_zoo(args.zoo or settings().service.zoo_dir)}
    ensemble, encoder = TokenEnsemble([load_backend(models[name]) for name in SPECIALISTS]), SentenceEncoder()
    n_models = len(SPECIALISTS)
    cfg = RLAEConfig(span=4, episodes=args.episodes)
    train = generation_split(FAMILIES, 1000, seed=100)
    splits = {
        "validation": generation_split(FAMILIES, 400, seed=101),
        "test": generation_stream(FAMILIES, 8, 50, seed=7),
    }
    fixed = {"uniform": np.ones(n_models)} | {
        "grid " + "/".join(f"{x:g}" for x in w): w for w in simplex_grid(n_models, 0.5)
    }
    fixed_truth = {
        split: {name: float(correct(decode(ensemble, tasks, w, cfg), tasks).mean()) for name, w in fixed.items()}
        for split, tasks in splits.items()
    }
    rows = []
    started = time.perf_counter()
    for seed in args.seeds:
        kept: list[dict] = []  # the policy at run()'s start, then after each update (it reports each)
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = RLAETrainer(ensemble, encoder, SPECIALISTS, cfg, Path(run_dir), seed)
            trainer.run(train, lambda n, reward: kept.append(copy.deepcopy(trainer.policy.state_dict())))
            trainer.store.close()
        logs = {split: logged_stream(ensemble, trainer.agent, tasks, seed) for split, tasks in splits.items()}
        candidates: dict[str, RLAEAgent | np.ndarray] = dict(fixed)
        for update, state in enumerate(kept):
            policy = make_policy(obs_dim(n_models), n_models, cfg, seed)
            policy.load_state_dict(state)
            candidates[f"ppo after {update * cfg.episodes_per_update} episodes"] = RLAEAgent(
                policy.eval(), encoder, cfg, n_models
            )
        for name, candidate in candidates.items():
            row: dict = {"seed": seed, "candidate": name, "group": "fixed" if name in fixed else "policy"}
            for split, tasks in splits.items():
                truth = (
                    fixed_truth[split][name]
                    if name in fixed
                    else float(correct(decode(ensemble, tasks, candidate, cfg), tasks).mean())
                )
                found = estimates(candidate, logs[split], args.concentrations)
                row[split] = {
                    "truth": truth,
                    "logged_reward": float(logs[split][2].mean()),
                    "estimates": {n: {str(k): e.to_dict() for k, e in by.items()} for n, by in found.items()},
                }
            rows.append(row)
            best = row["test"]["estimates"]["snips"][str(args.concentrations[len(args.concentrations) // 2])]
            print(
                f"seed {seed} {name:28s} test truth {row['test']['truth']:.3f}, snips "
                f"{best['value']:.3f} [{best['low']:.3f}, {best['high']:.3f}] ESS {best['ess']:.0f} "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    chosen = {
        name: min(args.concentrations, key=lambda k: summary(rows, "validation", name, k)["rmse"])
        for name in ESTIMATORS
    }
    groups = {"all": None, "policies": "policy", "fixed weights": "fixed"}
    report = {
        split: {
            group: {
                name: {str(k): summary(rows, split, name, k, members) for k in args.concentrations}
                for name in ESTIMATORS
            }
            for group, members in groups.items()
        }
        for split in splits
    }
    for name, kappa in chosen.items():
        for split in splits:
            for group in groups:
                s = report[split][group][name][str(kappa)]
                print(
                    f"{name:5s} kappa {kappa:g} (chosen on validation), {split:10s} {group:13s}: bias "
                    f"{s['bias']:+.3f} rmse {s['rmse']:.3f} coverage {100 * s['coverage']:.0f} % spearman "
                    f"{s['spearman']:.2f} median ESS {s['median_ess']:.0f}",
                    flush=True,
                )
    write_json(
        args.out,
        {
            "machine": machine_facts(),
            "episodes": args.episodes,
            "concentrations": args.concentrations,
            "chosen": chosen,
            "report": report,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
