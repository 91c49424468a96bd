"""``rlens ope``: candidate policies estimated on the traffic another policy served (the learner's off-policy log)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rlens.cli.common import POOL, console, fail, needs_extra, service_settings


def ope(
    candidate: list[Path] = typer.Option(
        [],
        "--candidate",
        help="a learner checkpoint directory whose newest policy to estimate (repeat for several; default with "
        "--stack: the stack's learner)",
    ),
    log: list[Path] = typer.Option(
        [], "--log", help="the learner's off-policy log (default: ope-log.jsonl and .1 in $RLENS_CHECKPOINT_DIR)"
    ),
    pool: Path | None = POOL,
    stack: Path | None = typer.Option(
        None,
        "--stack",
        help="the work folder of a running `rlens up`: its learner's log, checkpoints and pool (read beside it)",
    ),
    alpha: float | None = typer.Option(None, min=0.0, help="the reward's cost weight (default: the service's, 0.24)"),
    greedy: bool = typer.Option(
        False,
        "--greedy",
        help="judge the candidates on their greedy actions alone (default: as they would serve, with the logged "
        "exploration, as the gate does)",
    ),
    out: Path = typer.Option(Path("out/ope"), help="where ope.json, ope.md and ope.png go"),
) -> None:
    """Estimate each candidate's reward and accuracy on logged traffic (replay, exact on probes, IPS, SNIPS, DR)."""
    needs_extra("eval", "matplotlib")
    from rlens.evaluation.logged import read_log
    from rlens.evaluation.ope_report import checkpoint_policy, estimate_all, few_probes, write_report
    from rlens.focal.config import FocalConfig
    from rlens.models.pool import PoolConfigError, load_pool_config
    from rlens.service.learner.ope_log import OPE_LOG

    import numpy as np

    s = service_settings(pool)
    if stack is not None:
        from rlens.local.stack import CLIENT_ENV, client_settings

        found = client_settings(stack)
        if found is None:
            fail(f"no stack in {stack}: no {CLIENT_ENV} there (`rlens up --workdir {stack}` writes it)")
        s = found.updated({"pool_file": pool}) if pool else found
        candidate = candidate or [s.learner.checkpoint_dir]
    if not candidate:
        fail("no candidate: pass --candidate (a learner checkpoint directory), or --stack")
    if s.pool.file is None:
        fail("no pool file: pass --pool (the pool the logging service ran) or set RLENS_POOL_FILE")
    try:
        costs = np.array([m.cost for m in load_pool_config(s.pool.file).models])
    except PoolConfigError as exc:
        fail(str(exc))
    paths = log or [
        p for p in (s.learner.checkpoint_dir / (OPE_LOG + ".1"), s.learner.checkpoint_dir / OPE_LOG) if p.is_file()
    ]
    if not paths:
        fail(f"no off-policy log in {s.learner.checkpoint_dir} (the learner writes {OPE_LOG} there); pass --log")
    try:
        queries = read_log(paths)
        policies = [checkpoint_policy(c, costs) for c in candidate]
    except (OSError, ValueError) as exc:
        fail(str(exc))
    if any(len(q.pool) != len(costs) for q in queries):
        fail(f"the log's queries do not have the pool's {len(costs)} models: pass the pool the service ran")
    if not queries:
        fail(f"{', '.join(map(str, paths))}: no labelled query logged yet")
    alpha = FocalConfig.alpha if alpha is None else alpha
    results = estimate_all(queries, policies, costs / costs.sum(), alpha, serving=not greedy)
    table = Table(title=f"{len(queries)} logged queries, {sum(q.probe for q in queries)} probes")
    for column in ("policy", "estimator", "reward [95 % CI]", "accuracy [95 % CI]", "ESS"):
        table.add_column(column)
    for name, metrics in results.items():
        for estimator in ("on-policy", "replay", "exact", "dr", "ips"):
            if estimator in metrics["reward"]:
                r, a = metrics["reward"][estimator], metrics["accuracy"][estimator]
                table.add_row(
                    name,
                    estimator,
                    f"{r.value:+.3f} [{r.low:+.3f}, {r.high:+.3f}]",
                    f"{100 * a.value:.1f} [{100 * a.low:.1f}, {100 * a.high:.1f}]",
                    f"{r.ess:.0f}",
                )
    console.print(table)
    if warning := few_probes(queries):
        console.print(f"[yellow]{warning}[/yellow]")
    console.print("wrote " + ", ".join(str(p) for p in write_report(results, queries, out, serving=not greedy)))
