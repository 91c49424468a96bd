"""Apache Kafka as ``rlens up``'s broker: one KRaft node (broker and controller in one JVM) on loopback, its data in
the work folder, its jars fetched from Maven Central once (the same cache as ``infra/kafka/kafka.sh``).

tansu, the other embedded broker, keeps its log in memory and reads it by listing every batch a partition holds, so
its latency grows minute by minute under load; Apache Kafka indexes its log on disk, holds its latency, and keeps
the topics and the consumer groups' offsets across a restart of the stack.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

from rlens.local.servers import LocalProcess
from rlens.ports import free_port, port_taken

VERSION = "4.1.1"
FILES = Path(__file__).parent / "kafka_files"  # the pom the jars are fetched by, the broker's log configuration
JAVA_MIN = 17
HEAP = ["-Xms256m", "-Xmx768m", "-XX:+UseG1GC"]

SERVER = """process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={data}
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# offset commits answered at once: Kafka 4 holds each up to 5 ms to batch its writes, and a worker's next batch waits
# for the commit of the last one
group.coordinator.append.linger.ms=0
# one node, no follower to keep up to date: its controller writes a no-op record every 5 s, not every 0.5 s (idle, its
# metadata log's thread took 0.004 of a core)
metadata.max.idle.interval.ms=5000
# threads for one machine's few clients, not Kafka's server defaults (8, 3, 10): each idle thread polls every 300 ms
# (idle, with no client, 0.016 against 0.019 of a core: docs/benchmarks-history.md, 2026-12-02)
num.io.threads=2
num.network.threads=1
background.threads=2
"""


def jars() -> Path:
    """Where the jars are kept: ``$RLENS_KAFKA_CACHE/libs`` (default ``~/.cache/rlens/kafka-4.1.1/libs``)."""
    cache = os.environ.get("RLENS_KAFKA_CACHE") or Path.home() / ".cache" / "rlens" / f"kafka-{VERSION}"
    return Path(cache) / "libs"


def fetched() -> bool:
    return (jars() / f"kafka_2.13-{VERSION}.jar").is_file()


def java_problem() -> str | None:
    """Why no Apache Kafka can run here (no Java, or one older than 17), or None."""
    java = shutil.which("java")
    if java is None:
        return f"no `java` on the PATH (Apache Kafka needs Java {JAVA_MIN} or later)"
    try:
        said = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`java -version` failed: {exc}"
    found = re.search(r'version "(\d+)(?:\.(\d+))?', said)
    if found is None:
        return f"`java -version` said no version: {said.strip()[:200]!r}"
    major = int(found.group(2) or 0) if found.group(1) == "1" else int(found.group(1))
    return None if major >= JAVA_MIN else f"Java {major} found; Apache Kafka needs {JAVA_MIN} or later"


def fetch() -> Path:
    """The jars, fetched with Maven into :func:`jars` first if they are not there (about 100 MB, once)."""
    where = jars()
    if fetched():
        return where
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError(
            f"Apache Kafka's jars are not in {where} and there is no `mvn` to fetch them from Maven Central "
            "(Debian: apt-get install maven); or pass --broker tansu"
        )
    staging = where.with_name("libs.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    command = [mvn, "-q", "-B", "-f", str(FILES / "pom.xml"), "dependency:copy-dependencies"]
    done = subprocess.run(
        [*command, f"-Dkafka.version={VERSION}", f"-DoutputDirectory={staging}"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"Maven could not fetch Apache Kafka {VERSION}: {(done.stdout + done.stderr)[-1500:]}")
    shutil.rmtree(where, ignore_errors=True)
    staging.rename(where)
    return where


class LocalKafka(LocalProcess):
    """Apache Kafka on ``port`` (its controller on a port of its own), its data, configuration and log in
    ``folder``: formatted on the first start (or with ``fresh``, its data deleted first), started again on its data
    after. ``bootstrap`` is its address."""

    STOP_S = 60.0  # a controlled shutdown: the logs closed cleanly, no recovery at the next start
    # How long its clients' fetches wait for data (RLENS_KAFKA_FETCH_MAX_WAIT_MS and
    # RLENS_KAFKA_BACKGROUND_FETCH_MAX_WAIT_MS, unless set). Apache Kafka answers a waiting fetch as soon as a record
    # comes, so on the request path (the workers' queries, the gateway's replies) the wait costs no latency: it is
    # how often an idle consumer asks. Its price: after a rebalance, a consumer's first fetch of its new partitions
    # may wait behind the one in flight, up to this long. Off the request path (the learner's fetches, the policy
    # readers') the same: the learner's fetches wait for RLENS_LEARNER_FETCH_MIN_BYTES (1 byte unless set) or that
    # long, whichever comes first; an idle learner took 0.003 of a core more at 500 ms (BENCHMARKS.md).
    FETCH_MAX_WAIT_MS = 5000
    BACKGROUND_FETCH_MAX_WAIT_MS = 5000

    def __init__(self, port: int, folder: Path, fresh: bool = False):
        folder = folder.resolve()
        if fresh:
            shutil.rmtree(folder / "data", ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "server.properties"
        config.write_text(SERVER.format(port=port, controller=controller_port(folder), data=folder / "data"))
        java = [
            shutil.which("java") or "java",
            *HEAP,
            f"-Dlog4j2.configurationFile={FILES / 'log4j2.properties'}",
            f"-Drlens.kafka.log={folder / 'kafka.log'}",
            "-cp",
            f"{jars()}/*",
        ]
        if not (folder / "data" / "meta.properties").is_file():
            formatted = subprocess.run(
                [*java, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id()}", "-c", str(config)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if formatted.returncode != 0:
                raise RuntimeError(
                    f"Apache Kafka's storage format failed: {(formatted.stdout + formatted.stderr)[-1500:]}"
                )
        super().__init__([*java, "kafka.Kafka", str(config)], port, f"Apache Kafka {VERSION}", startup_s=180.0)
        self.bootstrap = f"127.0.0.1:{port}"


def cluster_id() -> str:
    """A random cluster id as Kafka's ``random-uuid`` writes it: a UUID in URL-safe base64, never one that starts with
    ``-`` (one in 64 would, and a command line would read it as an option)."""
    while (cluster := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
        pass
    return cluster


def controller_port(folder: Path) -> int:
    """The controller's port: the one this folder's broker used before if it is free, else a free one (kept)."""
    kept = folder / "controller.port"
    before = kept.read_text().strip() if kept.is_file() else ""
    if before.isdigit() and not port_taken(int(before)):
        return int(before)
    port = free_port()
    kept.write_text(str(port))
    return port
