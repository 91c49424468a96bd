"""The one logging setup of every service process (worker, learner, gateway): one line per record, time first.

aiokafka's group-join chatter is left out: its INFO lines, and the "Heartbeat failed ... because it is
rebalancing" warning that every consumer logs while its group forms (expected at each start, no fault).
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def _not_a_rebalance(record: logging.LogRecord) -> bool:
    return "because it is rebalancing" not in record.getMessage()


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    coordinator = logging.getLogger("aiokafka.consumer.group_coordinator")
    if _not_a_rebalance not in coordinator.filters:
        coordinator.addFilter(_not_a_rebalance)
