"""Redis windows against a real redis-server: rows round-trip into OutcomeWindow, updates apply once per query,
windows are bounded and expire, concurrent updates from many clients lose nothing."""

import asyncio

import numpy as np
import pytest
from redis.asyncio import Redis

from rlens.focal.window import OutcomeWindow
from rlens.local.servers import LocalRedis
from rlens.service.common.windows import RedisWindows, pushed_since


@pytest.fixture(scope="module")
def redis_url():
    server = LocalRedis()
    yield server.url
    server.stop()


def run(coroutine):
    return asyncio.run(coroutine)


async def fresh(url: str, **options) -> tuple[Redis, RedisWindows]:
    redis = Redis.from_url(url)
    await redis.flushdb()
    return redis, RedisWindows(redis, n_models=3, size=4, **options)


def test_rows_round_trip_into_the_same_window_as_in_memory(redis_url):
    async def scenario():
        redis, windows = await fresh(redis_url)
        reference = OutcomeWindow(3, 4)
        rows = [
            ([0, 1, -1], 0, 0.9),
            ([1, 1, 2], 1, 0.8),
            ([2, -1, 2], -1, -1.0),
            ([0, 0, 0], 0, 1.0),
            ([1, 2, 1], 1, 0.5),
        ]
        for i, (predictions, label, reward) in enumerate(rows):
            assert await windows.apply("task-a", f"q{i}", predictions, label, reward)
            reference.push(np.array(predictions), label, reward)
        loaded = await windows.load(["task-a", "task-b"])
        window, empty = loaded["task-a"], loaded["task-b"]
        assert window.n_rows == 4 and empty.n_rows == 0  # bounded to W; a missing key is a cold window
        np.testing.assert_allclose(window.reliability(), reference.reliability())
        assert window.recent_reward(4) == pytest.approx(reference.recent_reward(4))
        assert await redis.llen(windows.window_key("task-a")) == 4
        await redis.aclose()

    run(scenario())


def test_rows_pushed_since_an_earlier_read_by_hand():
    a, b, c, d, e = (f"[{i},0.5,0,0,0]".encode() for i in range(5))
    assert pushed_since([a, b, c], [a, b, c], 4) == 0  # nothing new
    assert pushed_since([a, b, c], [a, b, c, d], 4) == 1  # room left: appended
    assert pushed_since([a, b, c, d], [b, c, d, e], 4) == 1  # full: the oldest trimmed
    assert pushed_since([a, b, c, d], [c, d, e, a], 4) == 2
    assert pushed_since([], [a, b], 4) == 2  # a cold window: every row new
    assert pushed_since([a, b, c, d], [c, d], 4) is None  # trimmed by hand (keep_last): no ring trims that way
    assert pushed_since([a, b, c, d], [a, b], 4) is None
    assert pushed_since([a, b, c, d], [e, e, e, e], 4) is None  # more than half new (or started again)
    assert pushed_since([a, b, c, d], [], 4) is None
    # equal rows: any overlap that fits gives the same window, the fewest pushed is taken
    assert pushed_since([a, a, a, a], [a, a, a, a], 4) == 0 and pushed_since([a, a, b], [a, a, b, a], 4) == 1


def in_order(window: OutcomeWindow) -> list:
    """A window's rows, oldest first: (predictions, label, reward)."""
    index = (window.count - window.n_rows + np.arange(window.n_rows)) % window.size
    return [(window.predictions[i].tolist(), int(window.labels[i]), float(window.rewards[i])) for i in index]


def test_a_window_read_again_is_the_window_parsed_whole(redis_url):
    """A worker's reads extend the last read's window by the rows pushed since; the window is the same as a reader
    without that memory parses, through appends, the ring's trim, a trim by hand, a window pushed into by its
    holder, and a row that does not fit."""

    async def scenario():
        redis, windows = await fresh(redis_url)
        other = RedisWindows(redis, n_models=3, size=4)
        rng = np.random.default_rng(0)

        async def same() -> None:
            mine, theirs = (
                await windows.load(["s", "t"]),
                await RedisWindows(redis, n_models=3, size=4).load(["s", "t"]),
            )
            for stream in ("s", "t"):
                assert in_order(mine[stream]) == in_order(theirs[stream])

        for i in range(11):  # cold, filling, full and trimmed by the ring, one or two rows a read
            for j in range(1 + i % 2):
                predictions, label = rng.integers(-1, 3, 3).tolist(), int(rng.integers(0, 3))
                await other.apply("s", f"q{i}-{j}", predictions, label, float(rng.random()))
            await same()
        read = (await windows.load(["s"]))["s"]
        assert windows._read["s"][1] is read  # kept, and extended in place by the next read
        await windows.keep_last("s", 2)  # a trim by hand: parsed whole again
        await same()
        (await windows.load(["s"]))["s"].push(np.array([0, 0, 0]), 0, 1.0)  # its holder's own row: not reused
        await same()
        await redis.rpush(windows.window_key("s"), b"[0,50,0,0,0]")  # a reward beyond ±10: skipped
        skipped = windows.skipped_rows
        await same()
        assert windows.skipped_rows == skipped + 1 and "s" not in windows._read  # not kept: parsed whole each time
        await redis.aclose()

    run(scenario())


def test_the_update_script_goes_by_its_digest_and_is_loaded_only_where_missing(redis_url):
    """One round trip a batch of updates: no SCRIPT EXISTS before each pipeline; a server that lost its scripts
    (restarted, flushed) gets the script loaded once and the updates sent again, each applied once."""

    async def scenario():
        redis, windows = await fresh(redis_url)
        assert await windows.apply_many([("s", "q0", [0, 1, 2], 0, 1.0)]) == [True]
        await redis.config_resetstat()
        assert await windows.apply_many([("s", "q1", [0, 1, 2], 1, 1.0), ("s", "q0", [0, 1, 2], 0, 1.0)]) == [
            True,
            False,
        ]
        assert "cmdstat_script|exists" not in await redis.info("commandstats")
        await redis.script_flush()
        assert await windows.apply_many([("s", "q2", [0, 1, 2], 2, 1.0), ("s", "q3", [0, 1, 2], 0, 1.0)]) == [
            True,
            True,
        ]
        stats = await redis.info("commandstats")
        assert stats["cmdstat_script|load"]["calls"] == 1 and "cmdstat_script|exists" not in stats
        assert (await windows.load(["s"]))["s"].n_rows == 4
        await redis.aclose()

    run(scenario())


def test_an_outcome_applies_once_per_query(redis_url):
    async def scenario():
        redis, windows = await fresh(redis_url)
        assert await windows.apply("s", "q1", [0, 0, 0], 0, 1.0)
        assert not await windows.apply("s", "q1", [0, 0, 0], 0, 1.0)
        assert await windows.apply("s", "q2", [1, 0, 0], 0, 1.0)
        assert await redis.llen(windows.window_key("s")) == 2
        with pytest.raises(ValueError, match="pool has 3"):
            await windows.apply("s", "q3", [0, 0], 0, 1.0)
        await redis.aclose()

    run(scenario())


def test_a_batch_of_outcomes_applies_in_one_round_trip_in_order_and_once(redis_url):
    async def scenario():
        redis, windows = await fresh(redis_url)
        await redis.script_flush()  # the script is not cached yet: the pipeline must load it
        applied = await windows.apply_many(
            [
                ("a", "q1", [0, 1, 2], 0, 1.0),
                ("b", "q2", [1, 1, 1], 1, 0.5),
                ("a", "q3", [2, 2, 2], 2, 0.0),
                ("a", "q1", [0, 1, 2], 0, 1.0),
            ]
        )
        assert applied == [True, True, True, False]  # the repeated query counts once
        assert await redis.lrange(windows.window_key("a"), 0, -1) == [b"[0,1.0,0,1,2]", b"[2,0.0,2,2,2]"]
        assert await windows.apply_many([("b", "q2", [1, 1, 1], 1, 0.5), ("b", "q4", [0, 0, 0], 0, 1.0)]) == [
            False,
            True,
        ]
        with pytest.raises(ValueError, match="query q6: predictions for 2 models"):  # checked before anything is sent
            await windows.apply_many([("c", "q5", [0, 0, 0], 0, 1.0), ("c", "q6", [0, 0], 0, 1.0)])
        assert await redis.llen(windows.window_key("c")) == 0
        await redis.aclose()

    run(scenario())


def test_keys_expire(redis_url):
    async def scenario():
        redis, windows = await fresh(redis_url, window_ttl_s=100, dedup_ttl_s=50)
        await windows.apply("s", "q1", [0, 0, 0], 0, 1.0)
        assert 90 <= await redis.ttl(windows.window_key("s")) <= 100
        assert 40 <= await redis.ttl(windows.applied_key("s", "q1")) <= 50
        await redis.aclose()

    run(scenario())


def test_concurrent_duplicated_updates_from_many_clients(redis_url):
    async def scenario():
        redis, _ = await fresh(redis_url)
        clients = [Redis.from_url(redis_url) for _ in range(4)]
        writers = [RedisWindows(c, n_models=3, size=1000) for c in clients]

        async def apply_all(writer: RedisWindows) -> list[bool]:
            return [await writer.apply("s", f"q{i}", [i % 3, 0, 0], i % 3, 1.0) for i in range(200)]

        # 4 clients apply the same 200 outcomes at the same time: every one lands exactly once
        results = await asyncio.gather(*(apply_all(w) for w in writers))
        assert sum(map(sum, results)) == 200
        assert await redis.llen(writers[0].window_key("s")) == 200
        for c in [*clients, redis]:
            await c.aclose()

    run(scenario())


def test_the_streams_last_pools_are_shared_and_bad_ones_ignored(redis_url):
    """One worker saves a stream's pool, another reads it with the windows (one round trip); a value that does not
    fit the pool (wrong length, not 0/1, empty) is ignored, and the pool expires with the window."""

    async def scenario():
        redis, windows = await fresh(redis_url, window_ttl_s=60)
        other = RedisWindows(redis, n_models=3, size=4)
        await windows.apply("a", "q1", [0, 1, 1], 1, 1.0)
        await windows.save_pools({"a": np.array([True, False, True]), "b": np.array([False, True, False])})
        for stream, value in (("short", "10"), ("letters", "1x0"), ("empty", "000")):
            await redis.set(other.pool_key(stream), value)
        state = await other.load_with_pools(["a", "b", "short", "letters", "empty", "none"])
        assert state.windows["a"].n_rows == 1 and state.windows["none"].n_rows == 0
        assert {k: v.tolist() for k, v in state.pools.items()} == {"a": [True, False, True], "b": [False, True, False]}
        assert 0 < await redis.ttl(windows.pool_key("a")) <= 60 and state.asked == {}
        await redis.aclose()

    run(scenario())


def test_the_streams_query_counts_add_up_across_workers_and_expire(redis_url):
    """Two workers add the queries they were asked to their streams' counts; each reads the sum with its windows;
    a count that is not an integer reads as the limit asked for (no more first-query probes), a count read at the
    limit is not read again, and counts expire with the windows."""

    async def scenario():
        redis, windows = await fresh(redis_url, window_ttl_s=60)
        other = RedisWindows(redis, n_models=3, size=4, window_ttl_s=60)
        await windows.save_pools({}, {"a": 3, "b": 0})
        await other.save_pools({}, {"a": 2, "c": 1})
        await redis.set(windows.asked_key("bad"), "x")
        state = await windows.load_with_pools(["a", "b", "c", "bad"], asked=16)
        assert state.asked == {"a": 5, "c": 1, "bad": 16}
        assert (await windows.load_with_pools(["a"])).asked == {}  # not asked for: not read
        assert 0 < await redis.ttl(windows.asked_key("a")) <= 60 and await redis.exists(windows.asked_key("b")) == 0
        await redis.set(windows.asked_key("a"), 20)
        assert (await windows.load_with_pools(["a", "c"], asked=16)).asked == {"a": 20, "c": 1}
        await redis.set(windows.asked_key("a"), 3)  # a count at the limit is not read again (counts only grow)
        await redis.set(windows.asked_key("c"), 4)
        assert (await windows.load_with_pools(["a", "c"], asked=16)).asked == {"a": 16, "c": 4}
        await redis.aclose()

    run(scenario())
