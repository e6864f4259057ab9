"""Router and front-door settings."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import Frozen as _Frozen


class RouterConfig(_Frozen):
    max_running: int = Field(256, ge=1)  # requests dispatched to workers at once
    max_waiting: int = Field(1024, ge=0)  # beyond this many waiting, new requests are refused at once
    # The same bound in prompt tokens, so a burst of long prompts cannot queue unbounded memory.
    max_waiting_tokens: int = Field(1_000_000, ge=0)
    health_interval_s: float = Field(1.0, gt=0)
    health_timeout_s: float = Field(5.0, gt=0)
    # kv_aware: lowest estimated TTFT from the prefix index (docs/ARCHITECTURE.md, "Routing");
    # least_loaded, round_robin, random: baselines that ignore the index.
    policy: Literal["kv_aware", "least_loaded", "round_robin", "random"] = "kv_aware"
    # Load-balance guard: a prefill worker whose queued prefill tokens exceed the least loaded
    # worker's by more than max(balance_slack_tokens, balance_slack_prompts * this prompt's
    # length) is not chosen, whatever it has cached. In prompts as well as tokens: a fixed
    # 8,192 is less than one prompt of a long-context trace (Mooncake's average 12k), where it
    # barred every worker with anything queued and so decided most picks by load alone.
    balance_slack_tokens: int = Field(8192, ge=0)
    balance_slack_prompts: float = Field(8.0, ge=0)
    # What one cached prompt token is worth against one queued token. Above 1: skipping a cached
    # prefix costs the fleet its compute again, which every later request queues behind, not
    # only this request's TTFT (docs/ARCHITECTURE.md, "Routing", has the measurement).
    cache_weight: float = Field(6.0, ge=0)
    # A cached prefix shorter than this fraction of the prompt counts as no hit (see router/policy.py).
    min_hit_fraction: float = Field(0.25, ge=0, le=1)
    # Loading one token's KV back from the host or disk tier, as a fraction of computing it.
    host_load_cost: float = Field(0.1, ge=0)
    disk_load_cost: float = Field(0.3, ge=0)
    index_timeout_s: float = Field(0.5, gt=0)  # a prefix query slower than this counts as Redis down
    # A prompt routed to a worker counts as cached there for this long, before its events arrive.
    recent_route_ttl_s: float = Field(5.0, ge=0)
    # A request whose worker dies continues elsewhere from the tokens already sent, at most this
    # many times; then the client gets UNAVAILABLE with the count of tokens it already has.
    max_migrations: int = Field(2, ge=0)
    # Disaggregated: a prompt whose KV fits on no decode worker right now (every paired one's pool
    # is full) waits this long for blocks to free, in arrival order, before it is refused with 503.
    decode_wait_s: float = Field(30.0, ge=0)


class IndexConfig(_Frozen):
    """Where the prefix index and the worker leases live in Redis, and how workers keep them."""

    key_prefix: str = Field("brigade", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")  # every key is PREFIX:...
    lease_ttl_s: float = Field(10.0, gt=0)  # a worker not heard from for this long is dead
    publish_interval_s: float = Field(0.05, gt=0)  # how often a worker sends its batched cache events


class IndexLink(_Frozen):
    """What a worker or router needs to reach the index: the Redis URL (password and all) and its settings."""

    redis_url: str
    index: IndexConfig = IndexConfig()


class AuthConfig(_Frozen):
    """Bearer tokens for both front doors (router/auth.py). Auth is on when either is set."""

    token_file: str | None = None  # one token per line: TOKEN or TENANT TOKEN
    token_env: str | None = None  # the name of an env var holding TOKEN[,TOKEN...]
    public_health: bool = True  # health checks (probes) need no token
    # The name of an env var holding TOKEN[,TOKEN...] good for GET /metrics only (a scraper's),
    # refused everywhere else. Unset or empty: none. Needs token_file or token_env.
    metrics_token_env: str | None = None


class TLSConfig(_Frozen):
    cert_file: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _both(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TLS needs both cert_file and key_file (or neither)")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class FrontDoorConfig(_Frozen):
    """What the gRPC and HTTP front doors share: auth, TLS, message limits."""

    auth: AuthConfig = AuthConfig()
    tls: TLSConfig = TLSConfig()
    max_message_bytes: int = Field(4 << 20, ge=1024)  # larger requests: RESOURCE_EXHAUSTED / 413
    # gRPC calls served at once (streams included); more are RESOURCE_EXHAUSTED at once, so a
    # flood of slow or idle calls cannot pile up handlers without bound.
    max_concurrent_rpcs: int = Field(1024, ge=1)
    # HTTP connections open at once; more get 503 at once, with no thread spent on them.
    max_connections: int = Field(2048, ge=1)
    # The request line and headers must all arrive within this, and a body at least this fast
    # (after the same grace): a slow client cannot hold a thread (router/http/guards.py).
    header_timeout_s: float = Field(10.0, gt=0)
    min_body_bytes_per_s: float = Field(32768.0, gt=0)
    # Long prompts (router/tokenize_slots.py) tokenized at once, each on a core of its own with the
    # GIL released, and how many more may wait for a turn; beyond, 429 / RESOURCE_EXHAUSTED at once.
    max_concurrent_tokenizations: int = Field(2, ge=1)
    max_waiting_tokenizations: int = Field(64, ge=0)
