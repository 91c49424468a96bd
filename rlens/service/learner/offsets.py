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

    def new_log(self, key: str, log_end: int) -> None:
        """Partition ``key`` restarted from offset 0 (its log ends at ``log_end``, below our offset): read it anew."""
        log.warning(
            "%s ends at offset %d, below the %d this learner reached: a new log (broker data lost?); reading it from the start",
            key,
            log_end,
            self.read[key],
        )
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
