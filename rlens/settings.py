"""All of rlens's configuration from the environment, in one pydantic-settings object (``RLENS_*`` variables)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

PACKAGE_DATA = Path(__file__).parent / "data"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLENS_", extra="ignore")

    shared_data: Path = Field(Path("../shared/datasets"), description="where the shared recorded datasets live")
    zoo_dir: Path = Field(Path.home() / ".cache" / "rlens" / "zoo", description="where `rlens zoo build` puts the model zoo")
    demo_data: Path = Field(PACKAGE_DATA / "zoo_mc", description="the bundled dataset that `rlens demo` replays")
    http_timeout_s: float = Field(30.0, gt=0, description="openai backend: timeout of one HTTP attempt")
    http_retries: int = Field(2, ge=0, description="openai backend: retries after a transport error, timeout or 5xx")
    http_max_concurrency: int = Field(8, ge=1, description="openai backend: requests in flight per model server")


def settings() -> Settings:
    return Settings()
