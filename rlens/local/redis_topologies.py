"""Real Redis topologies on loopback (the tests' and the failover benchmark's): a Redis Cluster of 6
``redis-server --cluster-enabled`` processes (3 masters, 3 replicas, made by ``redis-cli --cluster create``) and a
Sentinel set (a master, a replica, three Sentinels), each on free ports, nothing persisted, all stopped by
:meth:`stop`."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from redis import Redis

from rlens.local.servers import LocalProcess
from rlens.ports import free_port

REDIS = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"
VOLATILE = ["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]


def wait_until(check, timeout_s: float, what: str) -> None:
    """Poll ``check`` every 0.2 s until it is true; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:g} s")
        time.sleep(0.2)


class _LocalServers:
    """Redis processes by port, each killed alone or all stopped."""

    servers: dict[int, LocalProcess]

    def kill(self, port: int) -> None:
        self.servers[port].process.kill()
        self.servers[port].process.wait()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


class LocalRedisCluster(_LocalServers):
    """``url`` (``redis+cluster://``) names every node as a startup node."""

    def __init__(self, directory: Path, masters: int = 3):
        directory = directory.resolve()  # redis-server opens its files after a chdir to --dir
        directory.mkdir(parents=True, exist_ok=True)
        self.ports = [free_port() for _ in range(2 * masters)]
        self.servers = {}
        for port in self.ports:
            bus = free_port()
            self.servers[port] = LocalProcess(
                [REDIS, "--port", str(port), "--cluster-enabled", "yes", "--cluster-port", str(bus)]
                + ["--cluster-config-file", str(directory / f"nodes-{port}.conf"), "--cluster-node-timeout", "2000"]
                + ["--dir", str(directory), *VOLATILE],
                port,
                "redis-server (cluster)",
            )
        created = subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            + ["--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if created.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]} {created.stderr[-2000:]}")
        wait_until(self.healthy, 60, "the cluster's state ok on every node")
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def info(self, port: int) -> dict[str, str]:
        return Redis(port=port, socket_timeout=2).execute_command("CLUSTER INFO")  # parsed by redis-py

    def healthy(self) -> bool:
        try:
            return all(
                self.info(p)["cluster_state"] == "ok" for p in self.ports if self.servers[p].process.poll() is None
            )
        except Exception:
            return False

    def master_of(self, key: str) -> int:
        """The port of the master that holds ``key``'s slot now."""
        for port in self.ports:
            if self.servers[port].process.poll() is not None:
                continue
            client = Redis(port=port, socket_timeout=2)
            slot = client.execute_command("CLUSTER KEYSLOT", key)
            for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise RuntimeError("no live node answers")


class LocalRedisSentinels(_LocalServers):
    """``url`` (``redis+sentinel://``) names the three Sentinels and the master's service name."""

    SERVICE = "rlens-master"

    def __init__(self, directory: Path):
        directory = directory.resolve()  # redis-server opens its files after a chdir to --dir
        directory.mkdir(parents=True, exist_ok=True)
        self.master_port, self.replica_port = free_port(), free_port()
        here = ["--dir", str(directory), *VOLATILE]  # a replica writes what it was sent to its folder
        self.servers = {
            self.master_port: LocalProcess([REDIS, "--port", str(self.master_port), *here], self.master_port, "master"),
            self.replica_port: LocalProcess(
                [REDIS, "--port", str(self.replica_port), "--replicaof", "127.0.0.1", str(self.master_port), *here],
                self.replica_port,
                "redis replica",
            ),
        }
        self.sentinel_ports = [free_port() for _ in range(3)]
        for port in self.sentinel_ports:
            config = directory / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
                f"sentinel failover-timeout {self.SERVICE} 5000\n"
            )
            self.servers[port] = LocalProcess([REDIS, str(config), "--sentinel"], port, "redis sentinel")
        wait_until(lambda: self.replica_in_sync(), 30, "the replica in sync")
        self.url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{self.SERVICE}"

    def replica_in_sync(self) -> bool:
        info = Redis(port=self.replica_port, socket_timeout=2).info("replication")
        return info.get("master_link_status") == "up"

    def master(self) -> int:
        host, port = Redis(port=self.sentinel_ports[0], socket_timeout=2).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE
        )
        return int(port)
