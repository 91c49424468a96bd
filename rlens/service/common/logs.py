"""The one logging setup of every service process (worker, learner, gateway): JSON lines (python-json-logger) where
no one reads a terminal, as in a container, and one text line per record on a terminal (``RLENS_LOG_FORMAT``: auto,
json, text). Every record carries the process's role and strategy; a record about a query also carries its id,
stream, tenant and the serving policy version (:func:`query_fields`). No record holds a prompt or an answer's text.

aiokafka's group-join chatter is left out: its INFO lines, and the "Heartbeat failed ... because it is
rebalancing" warning that every consumer logs while its group forms (expected at each start, no fault).
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from rlens.messages import TENANT_MARK, ModelFailureRecord

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
JSON_FIELDS = "%(levelname)s %(name)s %(message)s"  # the time is added, ISO 8601 in UTC


def _not_a_rebalance(record: logging.LogRecord) -> bool:
    return "because it is rebalancing" not in record.getMessage()


class ProcessFields(logging.Filter):
    """The process's role and strategy on every record."""

    def __init__(self, role: str, strategy: str):
        super().__init__()
        self.role, self.strategy = role, strategy

    def filter(self, record: logging.LogRecord) -> bool:
        record.role, record.strategy = self.role, self.strategy
        return True


class StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is when the record comes, not as it was at the setup: a command run
    in process (a test's CLI runner) swaps stderr and closes its own afterwards."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def json_lines(form: str) -> bool:
    return form == "json" or (form == "auto" and not sys.stderr.isatty())


def setup_logging(role: str = "", strategy: str = "", form: str = "auto") -> None:
    handler = StderrHandler()
    if json_lines(form):
        handler.setFormatter(
            JsonFormatter(JSON_FIELDS, rename_fields={"levelname": "level", "name": "logger"}, timestamp="time")
        )
    else:
        handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(ProcessFields(role, strategy))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python's warnings as records too, not bare lines on stderr
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # "generated new fontManager" on a new machine
    coordinator = logging.getLogger("aiokafka.consumer.group_coordinator")
    if _not_a_rebalance not in coordinator.filters:
        coordinator.addFilter(_not_a_rebalance)
    warn_unknown_variables(logging.getLogger("rlens.settings").warning)


def warn_unknown_variables(warn) -> None:
    """Each ``RLENS_*`` variable that sets nothing (a typo, a guessed name), with the closest name, through ``warn``."""
    import os

    from rlens.config_file import unknown_variables
    from rlens.settings import variables

    for line in unknown_variables(os.environ, set(variables())):
        warn(line)


def log_unanswered(query_id: str, stream: str, policy_version: int, failures: list[ModelFailureRecord]) -> None:
    """One warning per query that no model answered, each model's failure in full (up to 500 characters each): the
    client gets only the models' names and the kinds of failure."""
    details = "; ".join(f"{f.model}: {f.reason[:500]}" for f in failures) or "no model was called"
    logging.getLogger("rlens.worker").warning(
        "no model answered: %s", details, extra=query_fields(query_id, stream, policy_version)
    )


def query_fields(query_id: str, stream: str, policy_version: int | None = None) -> dict:
    """What a record about one query carries (``extra=``): its id, stream, tenant (a gateway tenant's stream) and
    the policy version that served it."""
    tenant = stream[1:].split("/", 1)[0] if stream.startswith(TENANT_MARK) else None
    fields = {"query_id": query_id, "stream": stream, "tenant": tenant}
    return fields | ({"policy_version": policy_version} if policy_version is not None else {})
