#!/usr/bin/env bash
# Apache Kafka on loopback for the tests and benchmarks: one broker in KRaft mode (broker and controller in one
# process), its jars fetched from Maven Central once into a cache folder.
#   infra/kafka/kafka.sh start [PORT]   start it (default port 19092), wait until it answers, print its address
#   infra/kafka/kafka.sh stop           stop it (SIGTERM, then SIGKILL) and delete its data
#   infra/kafka/kafka.sh fetch          only fetch the jars
# Settings: KAFKA_VERSION (4.1.1), RLENS_KAFKA_CACHE (~/.cache/rlens/kafka-VERSION), RLENS_KAFKA_RUN (/tmp/rlens-kafka:
# data, configuration, log and pid). Needs Java 17 and Maven.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=${KAFKA_VERSION:-4.1.1}
cache=${RLENS_KAFKA_CACHE:-$HOME/.cache/rlens/kafka-$version}
run=${RLENS_KAFKA_RUN:-/tmp/rlens-kafka}

fetch() {
    if ! ls "$cache"/libs/kafka_2.13-"$version".jar >/dev/null 2>&1; then
        echo "fetching Apache Kafka $version from Maven Central into $cache" >&2
        mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies -Dkafka.version="$version" \
            -DoutputDirectory="$cache/libs.tmp" >&2
        rm -rf "$cache/libs" && mv "$cache/libs.tmp" "$cache/libs"
    fi
}

java_() {
    java -Xms256m -Xmx768m -XX:+UseG1GC -Dlog4j2.configurationFile="$here/log4j2.properties" \
        -Drlens.kafka.log="$run/kafka.log" -cp "$cache/libs/*" "$@"
}

start() {
    local port=${1:-19092}
    local controller=$((port + 1))
    fetch
    stop_quietly
    mkdir -p "$run/data"
    cat >"$run/server.properties" <<CONF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$controller
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$run/data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# the tests' fast rebalances use 2 s sessions; Kafka's default minimum is 6 s
group.min.session.timeout.ms=1000
CONF
    java_ kafka.tools.StorageTool format -t "$(java_ kafka.tools.StorageTool random-uuid)" \
        -c "$run/server.properties" >"$run/format.log" 2>&1
    nohup java -Xms256m -Xmx768m -XX:+UseG1GC -Dlog4j2.configurationFile="$here/log4j2.properties" \
        -Drlens.kafka.log="$run/kafka.log" -cp "$cache/libs/*" kafka.Kafka "$run/server.properties" \
        >"$run/stdout.log" 2>&1 &
    echo $! >"$run/pid"
    for _ in $(seq 1 240); do
        if (echo >/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then
            echo "127.0.0.1:$port"
            return 0
        fi
        if ! kill -0 "$(cat "$run/pid")" 2>/dev/null; then
            echo "Kafka exited; its output:" >&2
            tail -n 30 "$run/stdout.log" "$run/kafka.log" >&2 || true
            return 1
        fi
        sleep 0.5
    done
    echo "Kafka did not open port $port within 120 s (see $run)" >&2
    return 1
}

stop_quietly() {
    if [ -f "$run/pid" ]; then
        local pid
        pid=$(cat "$run/pid")
        if kill "$pid" 2>/dev/null; then
            for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$run/pid"
    fi
    rm -rf "$run/data"
}

case "${1:-}" in
    start) start "${2:-19092}" ;;
    stop) stop_quietly ;;
    fetch) fetch ;;
    *) echo "usage: $0 start [PORT] | stop | fetch" >&2; exit 2 ;;
esac
