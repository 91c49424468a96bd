"""The learner's offset bookkeeping: per partition, the offset after the last record its state reflects, and the
same as of its newest checkpoint (how far Kafka may commit). A record below the first is a redelivery, or, when the
partition's log now ends below it, a new log (a broker that lost its data)."""

from __future__ import annotations

import logging

from aiokafka.structs import TopicPartition

log = logging.getLogger("rlens.learner")


def partition_key(record) -> str:
    """A record's partition as ``"topic:partition"`` (how offsets are kept and checkpointed)."""
    return f"{record.topic}:{record.partition}"


def partition_of(key: str) -> TopicPartition:
    """``"topic:partition"`` → its TopicPartition."""
    topic, partition = key.rsplit(":", 1)
    return TopicPartition(topic, int(partition))


class Offsets:
    def __init__(self, read: dict[str, int] | None = None):
        self.read: dict[str, int] = dict(read or {})  # "topic:partition" -> offset after the last record reflected
        self.checkpointed: dict[str, int] = dict(self.read)  # the same, as of the newest checkpoint

    def already_seen(self, record) -> bool:
        """True for a record the state already reflects (re-delivered after a restart); else mark it read."""
        key = partition_key(record)
        if record.offset < self.read.get(key, 0):
            return True
        self.read[key] = record.offset + 1
        return False

    def below(self, records) -> set[str]:
        """The partitions of records below the offsets the state reflects (redeliveries, or a new log)."""
        return {partition_key(r) for r in records if r.offset < self.read.get(partition_key(r), 0)}

    def new_logs(self, ends: dict[str, int]) -> None:
        """Partitions (key → where its log ends now, below our offset) that restarted from offset 0: read them anew.
        One line for them all: a broker that starts empty (``rlens up``'s embedded one keeps its topics in memory)
        makes every partition of a topic new at once."""
        log.warning(
            "%d partition(s) end below the offsets this learner reached (%s): new logs, read from their start "
            "(a broker that started empty or lost its data; the checkpoint's policy and windows carry over)",
            len(ends),
            ", ".join(f"{key} at {end} < {self.read[key]}" for key, end in sorted(ends.items())),
        )
        for key in ends:
            self.read[key] = 0
            self.checkpointed[key] = 0

    def moved(self) -> bool:
        """Whether records were read since the newest checkpoint."""
        return self.read != self.checkpointed

    def checkpointed_now(self) -> None:
        self.checkpointed = dict(self.read)

    def to_commit(self, topic: str) -> dict[TopicPartition, int]:
        """How far Kafka may commit ``topic``: the newest checkpoint's offsets, never past them."""
        partitions = {partition_of(key): offset for key, offset in self.checkpointed.items()}
        return {tp: offset for tp, offset in partitions.items() if tp.topic == topic}
