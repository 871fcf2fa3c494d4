"""One server's limits and defaults, shared by the protocol (validation), the routes and the CLI.

Where they come from (highest first): command-line flags, ``FUSIONRAG_*`` environment
variables (``FUSIONRAG_MAX_BATCH=16``), a YAML file (``--config server.yaml``, keys as the
setting names or the flags' names: ``max_batch`` or ``max-batch``), then the defaults below.
:func:`load_settings` applies that order; constructing :class:`ServerSettings` directly
(tests, the load generator) reads nothing from the environment, so a stray variable never
changes a test's server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from fusionrag.errors import FusionRAGError

ENV_PREFIX = "FUSIONRAG_"


class ServerSettings(BaseModel):
    """Limits and defaults of one server; every limit exists so that bad input gets a 4xx, not an outage."""

    model_config = ConfigDict(validate_assignment=True, extra="forbid", allow_inf_nan=False)  # inf is no timeout

    host: str = Field("127.0.0.1", description="bind address (loopback by default: exposing a server is a choice)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    api_key: str | None = Field(None, description="if set, every route but /health, /ready and /ui needs "
                                                  "'Authorization: Bearer KEY'")
    served_model_name: list[str] | None = Field(
        None, description="the model names clients may ask for, as listed by /v1/models; the first is reported in "
                          "responses; any other name is a 404, as in vLLM (default: the model's name)")
    max_body_bytes: int = Field(1 << 20, ge=1, description="request body limit in bytes")
    max_prompt_tokens: int = Field(8192, ge=1, description="prompt token limit (S + passages + question)")
    max_new_tokens: int = Field(2048, ge=1, description="upper bound on a request's max_tokens")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens of requests that name none (an answer "
                                                           "ends at the model's end of turn first)")
    max_documents: int = Field(64, ge=1, description="passages per request and per POST /v1/documents")
    max_document_chars: int = Field(32_000, ge=1, description="characters per passage")
    max_top_k: int = Field(32, ge=1, description="upper bound on a request's retrieval top_k")
    max_stop: int = Field(8, ge=0, description="stop strings per request")
    max_queue: int = Field(64, ge=0, description="requests waiting for prefill before 429")
    max_batch: int = Field(8, ge=1, description="requests decoded together per step")
    max_num_batched_tokens: int = Field(512, ge=0, description="tokens one step computes: the decoding rows plus a "
                                        "piece of a prefill, so a long prompt does not stall the streams (vLLM's "
                                        "name; a piece is at least 64 tokens; 0: whole prefills between steps)")
    max_document_jobs: int = Field(16, ge=1, description="document jobs pending at once before 429")
    max_job_chunks: int = Field(512, ge=1, description="chunks one document job may add (413 beyond)")
    max_job_tokens: int = Field(131_072, ge=1, description="tokens one document job may add (413 beyond)")
    job_lock_wait_s: float = Field(600.0, ge=0, description="how long a document job waits while another process "
                                                            "(a CLI ingest) holds the store's writer lock")
    default_retrieval: bool = Field(False, description="search the store for chat and completion requests that do "
                                    "not say (retrieval / retrieval_top_k); off: no chunk enters a prompt that did not "
                                    "ask for it, and stored chunks pasted into a prompt are reused where they occur")
    default_method: str = Field("auto", description="method of requests that name none (auto: fusionrag where "
                                                    "reuse pays, full below the break-even context length)")
    default_ratio: float | Literal["auto"] = Field(0.15, description="recompute ratio of requests that name none "
                                                                    "(a share within [0, 1], or auto)")
    default_temperature: float = Field(0.0, ge=0.0, le=2.0,
                                       description="temperature of requests that name none (0: greedy)")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds a request may wait for its next token")
    stall_after_s: float = Field(120.0, ge=0, description="/health says 'degraded' once the busy model thread has "
                                                    "finished nothing for this long")
    explain_keep: int = Field(256, ge=0, description="recent answers kept for GET /v1/explain/{id}")
    preprocess_top_n: int | None = Field(10, description="fused preprocess after adding documents (None: plain)")
    keep_jobs: int = Field(1000, ge=0, description="finished document jobs remembered for GET")
    memory_budget_mb: int = Field(1024, ge=0, description="in-memory KV tier in MiB (0 reads the store directly)")
    device_kv_budget_mb: int = Field(0, ge=0, description="chunk KV kept on the GPU above the memory tier, MiB "
                                                         "(copied on a side stream; 0: none)")
    kv_tier: str | None = Field(None, description="a KV tier shared by servers, between the memory tier and the "
                                                  "disk: redis://HOST:PORT[/DB] or unix:///PATH.sock")
    adhoc_cache_mb: int = Field(2048, ge=0, description="KV of request-supplied passages the store does not hold "
                                                       "(the alternative-path prefix cache), MiB; 0: none kept")
    context_cache_mb: int = Field(1024, ge=0, description="whole contexts (S + chunks) kept after their prefill, "
                                                         "so a new question on the same context prefills only "
                                                         "itself, MiB; 0: off")
    shutdown_timeout_s: float = Field(30.0, gt=0, description="on SIGTERM, seconds open requests may finish before "
                                                             "they are cut off (a second SIGTERM exits at once)")
    header_timeout_s: float = Field(30.0, gt=0, description="seconds a request may take to arrive completely "
                                                           "(half-sent requests are closed)")
    min_reuse_tokens: int | None = Field(None, ge=0, description="context tokens from which method auto reuses "
                                                                 "KV (default: the device's measured break-even)")
    metrics_need_key: bool = Field(False, description="GET /metrics needs the API key too (default: open, as in "
                                                      "vLLM, so a Prometheus scrape needs no token)")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        """One name or several (a list, or comma-separated in an environment variable or YAML string)."""
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",")]
        if value is not None and (not value or any(not isinstance(v, str) or not v.strip() for v in value)):
            raise ValueError("served model names must be non-empty strings")
        return value

    @field_validator("kv_tier")
    @classmethod
    def _tier_url(cls, value: str | None) -> str | None:
        """A malformed tier URL is one line now, not a traceback after the model has loaded."""
        if value is None:
            return None
        from fusionrag.kvcache.redis_source import check_tier_url  # (torch: only when a tier is named)

        try:
            return check_tier_url(value)
        except FusionRAGError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("default_ratio", mode="before")
    @classmethod
    def _ratio(cls, value: Any) -> float | str:
        from fusionrag.online.request import InvalidRequest, check_ratio

        try:  # the one ratio check every door uses
            return check_ratio(value)
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from None

    @field_validator("default_method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        from fusionrag.online.methods import method_info

        try:
            method_info(value)
        except FusionRAGError as exc:  # pydantic reports ValueErrors: one line naming the setting and choices
            raise ValueError(str(exc)) from None
        return value

    def to_json(self) -> dict[str, Any]:
        """The settings for logs and reports, with the API key reduced to whether one is set."""
        d = self.model_dump()
        d["api_key"] = "set" if self.api_key else None
        if self.kv_tier and "@" in self.kv_tier:  # redis://user:password@host: keep the host, not the password
            scheme, _, rest = self.kv_tier.partition("://")
            d["kv_tier"] = f"{scheme}://***@{rest.rpartition('@')[2]}"
        return d


class _Sources(ServerSettings, BaseSettings):
    """ServerSettings read from the environment and a YAML file (init arguments, i.e. flags, first)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_assignment=True,
                                      allow_inf_nan=False)
    _yaml: dict[str, Any] = {}

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _DictSource(settings_cls, cls._yaml)


class _DictSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self.values = values

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


#: Flags whose name is not their setting's (``--method`` sets ``default_method``); YAML takes either.
FLAG_SETTINGS = {"method": "default_method", "ratio": "default_ratio", "shutdown_timeout": "shutdown_timeout_s",
                 "header_timeout": "header_timeout_s", "request_timeout": "request_timeout_s"}


def setting_name(key: str) -> str:
    """The setting a YAML key names: the setting itself, or its flag (``max-batch``, ``--method``)."""
    key = key.lstrip("-").replace("-", "_")
    return FLAG_SETTINGS.get(key, key)


def load_settings(config_file: str | Path | None = None, **flags: Any) -> ServerSettings:
    """Flags (``None`` = not given) over ``FUSIONRAG_*`` variables over the YAML file over the defaults."""
    values: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise FusionRAGError(f"cannot read the server config {path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise FusionRAGError(f"{path}: the server config must be a mapping of setting names to values")
        loaded = {setting_name(str(k)): v for k, v in loaded.items()}
        unknown = sorted(set(loaded) - set(ServerSettings.model_fields))
        if unknown:
            raise FusionRAGError(f"{path}: unknown settings {', '.join(unknown)} "
                                 f"(known: {', '.join(ServerSettings.model_fields)})")
        values = loaded
    _Sources._yaml = values
    try:
        merged = _Sources(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise FusionRAGError(f"invalid server setting {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    finally:
        _Sources._yaml = {}
    return ServerSettings(**merged.model_dump(exclude_unset=True))  # model_fields_set: what was asked for


def settings_help() -> str:
    """The settings as ``--help`` lists them: name, environment variable, default, what it does."""
    lines = ["settings (flags override FUSIONRAG_* environment variables, which override --config FILE.yaml):"]
    for name, f in ServerSettings.model_fields.items():
        lines.append(f"  {name:<20} {ENV_PREFIX + name.upper():<32} default {f.default!r}: {f.description}")
    return "\n".join(lines)
