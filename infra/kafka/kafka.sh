#!/usr/bin/env bash
# Apache Kafka on loopback for the tests and benchmarks: one broker in KRaft mode (broker and controller in one
# process), or a cluster of three, its jars fetched from Maven Central once into a cache folder.
#   infra/kafka/kafka.sh start [PORT]     start one (default port 19092), wait until it answers, print its address
#   infra/kafka/kafka.sh cluster [PORT]   start three (ports PORT, PORT+10, PORT+20; replication 3, min.insync 2),
#                                         wait until all answer, print the bootstrap list
#   infra/kafka/kafka.sh kill N           kill -9 node N (1-3) of the cluster, its data left on disk
#   infra/kafka/kafka.sh restart N        start node N again on its data
#   infra/kafka/kafka.sh stop             stop everything started here (SIGTERM, then SIGKILL) and delete its data
#   infra/kafka/kafka.sh fetch            only fetch the jars
# Settings: KAFKA_VERSION (4.1.1), RLENS_KAFKA_CACHE (~/.cache/rlens/kafka-VERSION), RLENS_KAFKA_RUN (/tmp/rlens-kafka:
# data, configuration, log, GC log (node-N/gc.log) and pid), RLENS_KAFKA_JVM (the JVM's heap and compiler options,
# "-Xms256m -Xmx768m -XX:+UseG1GC"; docs/benchmarks-history.md compares others). Needs Java 17 and Maven.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
files=$(cd "$here/../../rlens/local/kafka_files" && pwd)  # the pom the jars are fetched by, the log configuration
version=${KAFKA_VERSION:-4.1.1}
cache=${RLENS_KAFKA_CACHE:-$HOME/.cache/rlens/kafka-$version}
run=${RLENS_KAFKA_RUN:-/tmp/rlens-kafka}
read -r -a jvm <<<"${RLENS_KAFKA_JVM:--Xms256m -Xmx768m -XX:+UseG1GC}"

fetch() {
    if ! ls "$cache"/libs/kafka_2.13-"$version".jar >/dev/null 2>&1; then
        echo "fetching Apache Kafka $version from Maven Central into $cache" >&2
        mvn -q -B -f "$files/pom.xml" dependency:copy-dependencies -Dkafka.version="$version" \
            -DoutputDirectory="$cache/libs.tmp" >&2
        rm -rf "$cache/libs" && mv "$cache/libs.tmp" "$cache/libs"
    fi
}

java_() {
    java "${jvm[@]}" -Dlog4j2.configurationFile="$files/log4j2.properties" \
        -Drlens.kafka.log="$run/kafka.log" -cp "$cache/libs/*" "$@"
}

# node N's configuration: its own data, broker port $1 + 10 (N - 1) and controller port + 1, voters of all nodes
write_config() {
    local node=$1 base=$2 count=$3 voters="" i
    for i in $(seq 1 "$count"); do
        voters="${voters:+$voters,}$i@127.0.0.1:$((base + 10 * (i - 1) + 1))"
    done
    local port=$((base + 10 * (node - 1))) replicas=$((count < 3 ? count : 3)) isr=$((count < 3 ? 1 : 2))
    mkdir -p "$run/node-$node/data"
    cat >"$run/node-$node/server.properties" <<CONF
process.roles=broker,controller
node.id=$node
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$((port + 1))
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$run/node-$node/data
num.partitions=1
default.replication.factor=$replicas
min.insync.replicas=$isr
offsets.topic.replication.factor=$replicas
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=$replicas
transaction.state.log.min.isr=$isr
share.coordinator.state.topic.replication.factor=$replicas
share.coordinator.state.topic.min.isr=$isr
group.initial.rebalance.delay.ms=0
# offset commits answered at once, not held up to 5 ms to batch the coordinator's writes (docs/service.md)
group.coordinator.append.linger.ms=0
# the tests' fast rebalances use 2 s sessions; Kafka's default minimum is 6 s
group.min.session.timeout.ms=1000
# a killed broker is fenced (and its partitions led elsewhere) within 3 s, not 9
broker.session.timeout.ms=3000
broker.heartbeat.interval.ms=1000
# threads for one machine's few clients, not Kafka's server defaults (rlens/local/kafka.py)
num.io.threads=2
num.network.threads=1
background.threads=2
CONF
    if [ "$count" = 1 ]; then  # one node: its controller's no-op record every 5 s, not 0.5 (rlens/local/kafka.py)
        echo "metadata.max.idle.interval.ms=5000" >>"$run/node-$node/server.properties"
    fi
    echo "$port" >"$run/node-$node/port"
}

launch() {  # node N on its configuration and data; waits until its port answers
    local node=$1 port
    port=$(cat "$run/node-$node/port")
    nohup java "${jvm[@]}" -Xlog:gc:file="$run/node-$node/gc.log":time,uptime \
        -Dlog4j2.configurationFile="$files/log4j2.properties" -Drlens.kafka.log="$run/node-$node/kafka.log" \
        -cp "$cache/libs/*" kafka.Kafka "$run/node-$node/server.properties" \
        >"$run/node-$node/stdout.log" 2>&1 &
    echo $! >"$run/node-$node/pid"
}

wait_for() {  # node N's port, within 120 s
    local node=$1 port
    port=$(cat "$run/node-$node/port")
    for _ in $(seq 1 240); do
        if (echo >/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then
            return 0
        fi
        if ! kill -0 "$(cat "$run/node-$node/pid")" 2>/dev/null; then
            echo "Kafka node $node exited; its output:" >&2
            tail -n 30 "$run/node-$node/stdout.log" "$run/node-$node/kafka.log" >&2 || true
            return 1
        fi
        sleep 0.5
    done
    echo "Kafka node $node did not open port $port within 120 s (see $run/node-$node)" >&2
    return 1
}

start_nodes() {  # COUNT nodes from PORT: formatted with one cluster id, started, answering
    local base=$1 count=$2 id i addresses=""
    fetch
    stop_quietly
    id=$(java_ kafka.tools.StorageTool random-uuid)
    for i in $(seq 1 "$count"); do
        write_config "$i" "$base" "$count"
        java_ kafka.tools.StorageTool format -t "$id" -c "$run/node-$i/server.properties" >"$run/node-$i/format.log" 2>&1
    done
    for i in $(seq 1 "$count"); do launch "$i"; done
    for i in $(seq 1 "$count"); do
        wait_for "$i"
        addresses="${addresses:+$addresses,}127.0.0.1:$(cat "$run/node-$i/port")"
    done
    echo "$addresses"
}

kill_node() {  # kill -9 node N; its data stays
    local pid
    pid=$(cat "$run/node-$1/pid")
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
}

stop_quietly() {
    local pidfile pid
    for pidfile in "$run"/node-*/pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
    done
    for pidfile in "$run"/node-*/pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
    rm -rf "$run"/node-*
}

case "${1:-}" in
    start) start_nodes "${2:-19092}" 1 ;;
    cluster) start_nodes "${2:-19092}" 3 ;;
    kill) kill_node "${2:?which node: 1, 2 or 3}" ;;
    restart) launch "${2:?which node: 1, 2 or 3}" && wait_for "$2" ;;
    stop) stop_quietly ;;
    fetch) fetch ;;
    *) echo "usage: $0 start [PORT] | cluster [PORT] | kill N | restart N | stop | fetch" >&2; exit 2 ;;
esac
