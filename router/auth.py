"""Bearer-token authentication shared by the gRPC and HTTP front doors.

Tokens come from a file (one per line: `TOKEN`, or `TENANT TOKEN` to name who holds it;
`#` starts a comment) and/or from an environment variable (comma-separated, same forms),
never from the repo or the config file itself. A presented token is compared with every
known token in constant time (hmac.compare_digest, no early exit), so timing does not say
how much of a guess was right. The tenant a token maps to is the identity the server uses
for per-tenant cache isolation: a token listed without a tenant is a tenant of its own
(`anon-` and a hash of the token), so two such holders never share cached prefixes. A token
listed twice (in one source or across the file and the variable) is a start-up error: which
tenant it means would otherwise depend on the order the sources were read.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from router.config import AuthConfig

DEFAULT_TENANT = "default"


class AuthSetupError(ValueError):
    """Auth is configured but its tokens cannot be read; the message says what to fix."""


class Authenticator:
    def __init__(self, tokens: dict[str, str], metrics_tokens: tuple[str, ...] = ()):  # token -> tenant
        self._tokens = [(t.encode(), tenant) for t, tenant in tokens.items()]
        self._metrics_tokens = [t.encode() for t in metrics_tokens]  # scope: GET /metrics alone

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @classmethod
    def from_config(cls, cfg: AuthConfig) -> Authenticator:
        tokens: dict[str, str] = {}
        if cfg.token_file is not None:
            path = Path(cfg.token_file).expanduser()
            try:
                text = path.read_text()
            except OSError as exc:
                raise AuthSetupError(f"auth.token_file {path}: {exc.strerror or exc}; "
                                     "create it (one token per line) or unset auth.token_file") from None
            _add(tokens, _parse(text.splitlines(), f"auth.token_file {path}"), f"auth.token_file {path}")
        if cfg.token_env is not None:
            value = os.environ.get(cfg.token_env, "")
            if not value.strip():
                raise AuthSetupError(f"auth.token_env names ${cfg.token_env}, which is unset or empty; "
                                     f"export {cfg.token_env}=TOKEN[,TOKEN...] or unset auth.token_env")
            _add(tokens, _parse(value.split(","), f"${cfg.token_env}"), f"${cfg.token_env}")
        if (cfg.token_file is not None or cfg.token_env is not None) and not tokens:
            raise AuthSetupError("auth is configured but no token was found; add at least one token")
        scrapers: dict[str, str] = {}
        if cfg.metrics_token_env is not None:
            if not tokens:
                raise AuthSetupError("auth.metrics_token_env needs auth.token_file or auth.token_env: with no API "
                                     "token every route would be open but /metrics")
            where = f"${cfg.metrics_token_env}"
            scrapers = _parse(os.environ.get(cfg.metrics_token_env, "").split(","), where)  # unset: none
            _add(dict(tokens), scrapers, where)  # a token is an API token or a scraper's, not both
        return cls(tokens, tuple(scrapers))

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant for an `Authorization: Bearer TOKEN` value; None if it is not a known
        API token (a metrics-only token included). With auth off every caller is the default tenant."""
        if not self.enabled:
            return DEFAULT_TENANT
        given = _presented(authorization)
        found = None
        for token, tenant in self._tokens:  # every token compared: no early exit
            if hmac.compare_digest(token, given) and given:
                found = tenant
        return found

    def may_scrape(self, authorization: str | None) -> bool:
        """Whether the caller may read /metrics: any API token, or a metrics-only one."""
        given = _presented(authorization)
        scraper = False
        for token in self._metrics_tokens:
            scraper |= hmac.compare_digest(token, given) and bool(given)
        return self.tenant(authorization) is not None or scraper


def _presented(authorization: str | None) -> bytes:
    scheme, _, presented = (authorization or "").strip().partition(" ")
    return presented.strip().encode() if scheme.lower() == "bearer" else b""


def _add(tokens: dict[str, str], more: dict[str, str], where: str) -> None:
    twice = [t for t in more if t in tokens]
    if twice:
        raise AuthSetupError(f"{where}: a token is listed again ({_hint(twice[0])}; it was read already): "
                             "list each token once, with the tenant it belongs to")
    tokens.update(more)


def _hint(token: str) -> str:
    return f"the one starting {token[:4]!r}"  # enough to find it, too little to use it


def anonymous_tenant(token: str) -> str:
    """The tenant of a token listed without one: its own, named by a hash (never the token)."""
    return "anon-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def _parse(lines: list[str], where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise AuthSetupError(f"{where}, entry {n}: expected 'TOKEN' or 'TENANT TOKEN', got {len(fields)} fields")
        tenant, token = fields if len(fields) == 2 else (anonymous_tenant(fields[0]), fields[0])
        if ":" in tenant:
            raise AuthSetupError(f"{where}, entry {n}: tenant names may not contain ':' (it separates salts)")
        if len(token) < 16:
            raise AuthSetupError(f"{where}, entry {n}: tokens must be at least 16 characters "
                                 "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        if token in out:
            raise AuthSetupError(f"{where}, entry {n}: a token is listed twice ({_hint(token)}): "
                                 "list each token once, with the tenant it belongs to")
        out[token] = tenant
    return out


def cache_salt(tenant: str, requested: str | None = None) -> str | None:
    """The prefix-cache salt for a request, the same at both doors: the caller's tenant, so
    tenants never share cached prefixes (nor learn of each other's prompts through cache
    timing); a request's own salt (vLLM's `cache_salt`) narrows it further, within the tenant.
    The default tenant (auth off, or tokens listed as tenant "default") keeps the unsalted chain,
    so its block hashes are the documented ones the offline engine uses. Tenant names hold no
    ':', so "TENANT:SALT" never equals another tenant's salt."""
    if requested is None:
        return None if tenant == DEFAULT_TENANT else tenant
    return f"{tenant}:{requested}"
