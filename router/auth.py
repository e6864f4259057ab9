"""Bearer-token authentication shared by the gRPC and HTTP front doors.

Tokens come from a file (one per line: `TOKEN`, or `TENANT TOKEN` to name who holds it;
`#` starts a comment) and/or from an environment variable (comma-separated, same forms),
never from the repo or the config file itself. A presented token is compared with every
known token in constant time (hmac.compare_digest, no early exit), so timing does not say
how much of a guess was right. The tenant a token maps to is the identity the server uses
for per-tenant cache isolation.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path

from router.config import AuthConfig

DEFAULT_TENANT = "default"


class AuthSetupError(ValueError):
    """Auth is configured but its tokens cannot be read; the message says what to fix."""


class Authenticator:
    def __init__(self, tokens: dict[str, str]):  # token -> tenant
        self._tokens = [(t.encode(), tenant) for t, tenant in tokens.items()]

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
            tokens |= _parse(text.splitlines(), f"auth.token_file {path}")
        if cfg.token_env is not None:
            value = os.environ.get(cfg.token_env, "")
            if not value.strip():
                raise AuthSetupError(f"auth.token_env names ${cfg.token_env}, which is unset or empty; "
                                     f"export {cfg.token_env}=TOKEN[,TOKEN...] or unset auth.token_env")
            tokens |= _parse(value.split(","), f"${cfg.token_env}")
        if (cfg.token_file is not None or cfg.token_env is not None) and not tokens:
            raise AuthSetupError("auth is configured but no token was found; add at least one token")
        return cls(tokens)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant for an `Authorization: Bearer TOKEN` value; None if it is not a known
        token. With auth off every caller is the default tenant."""
        if not self.enabled:
            return DEFAULT_TENANT
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            presented = ""
        given = presented.strip().encode()
        found = None
        for token, tenant in self._tokens:  # every token compared: no early exit
            if hmac.compare_digest(token, given) and given:
                found = tenant
        return found


def _parse(lines: list[str], where: str) -> dict[str, str]:
    out = {}
    for n, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise AuthSetupError(f"{where}, entry {n}: expected 'TOKEN' or 'TENANT TOKEN', got {len(fields)} fields")
        tenant, token = fields if len(fields) == 2 else (DEFAULT_TENANT, fields[0])
        if ":" in tenant:
            raise AuthSetupError(f"{where}, entry {n}: tenant names may not contain ':' (it separates salts)")
        if len(token) < 16:
            raise AuthSetupError(f"{where}, entry {n}: tokens must be at least 16 characters "
                                 "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        out[token] = tenant
    return out


def cache_salt(tenant: str, requested: str | None = None) -> str | None:
    """The prefix-cache salt for a request, the same at both doors: the caller's tenant, so
    tenants never share cached prefixes (nor learn of each other's prompts through cache
    timing); a request's own salt (vLLM's `cache_salt`) narrows it further, within the tenant.
    The default tenant (auth off, or a token listed without a tenant) keeps the unsalted chain,
    so its block hashes are the documented ones the offline engine uses. Tenant names hold no
    ':', so "TENANT:SALT" never equals another tenant's salt."""
    if requested is None:
        return None if tenant == DEFAULT_TENANT else tenant
    return f"{tenant}:{requested}"
