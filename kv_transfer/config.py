"""Transfer settings: the `transfer` sub-config of the root config."""
from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator

from engine.hosts import is_wildcard

NODE_HOST = "node"
__all__ = ["NODE_HOST", "TransferConfig", "is_wildcard"]


class TransferConfig(BaseModel):
    """Where this process binds and how long any one step may block.

    host: the address this process listens on and advertises (the receiver's rendezvous
      store and, on both sides, gloo's pair sockets). Loopback by default; a wildcard is
      refused so nothing ever listens on every interface. NODE_HOST ("node"): the address of
      the machine each worker runs on (its Ray node's, see on_node), for workers spread over
      several machines or pods, where one fixed address cannot be every worker's.
    port_range: inclusive range the rendezvous store tries in order; None lets the OS pick.
      gloo's own pair sockets always use an ephemeral port on `host`.
    timeout_s: the bound on each blocking step of a transfer (header, ack, payload).
    connect_timeout_s: the bound on joining a pair (rendezvous plus group setup).
    hold_timeout_s: how long KV may wait for its other side: a prefill worker drops an
      export whose send never started, a decode worker frees blocks reserved for a request
      that was never admitted (its KV never came, or came and its stream did not: e.g. the
      router died between its calls); swept on a timer (kv_transfer/leases.py), not only by
      the next request.
    backend: gloo moves CPU tensors; nccl moves CUDA tensors (the header and ack still go
      over a gloo group); auto picks nccl when CUDA and NCCL are available, else gloo.
    recv_buffer_mib: the largest receive buffer a decode worker keeps per channel, reused
      across requests; a bigger payload gets a buffer of its own, freed after the write
      (kv_transfer/recv_buffers.py).
    auth_key (not a field: no file or flag sets it, no dump prints it): the cluster's secret
      that authenticates pair joins (kv_transfer.rendezvous). The cluster makes a random one
      when it starts (`with_secret`) and hands it to its workers with these settings. None:
      joins and verdicts carry an HMAC under an empty key, so only the pairing's ticket
      (which never enters the store) stands between a stranger and a join (tests and tools only).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port_range: tuple[int, int] | None = None
    timeout_s: float = Field(30.0, gt=0.0)
    connect_timeout_s: float = Field(60.0, gt=0.0)
    hold_timeout_s: float = Field(120.0, gt=0.0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    recv_buffer_mib: float = Field(256.0, ge=0.0)
    _auth_key: SecretStr | None = PrivateAttr(None)

    @field_validator("host")
    @classmethod
    def _no_wildcard(cls, host: str) -> str:
        if host != NODE_HOST and is_wildcard(host):
            raise ValueError(f"host {host!r} would listen on every interface; name one address")
        return host

    @property
    def auth_key(self) -> SecretStr | None:
        return self._auth_key

    def with_secret(self, key: str | None = None) -> TransferConfig:
        """These settings with `key` (default: a fresh random one) as the auth_key, unless one
        is set already."""
        if self._auth_key is not None:
            return self
        out = self.model_copy()
        out._auth_key = SecretStr(key or secrets.token_hex(32))
        return out

    def on_node(self, node_ip: str) -> TransferConfig:
        """These settings for a worker on the machine at `node_ip`: host "node" becomes it."""
        return self.model_copy(update={"host": node_ip}) if self.host == NODE_HOST else self

    @model_validator(mode="after")
    def _check_ports(self) -> TransferConfig:
        if self.port_range is not None:
            lo, hi = self.port_range
            if not 1 <= lo <= hi <= 65535:
                raise ValueError(f"port_range {self.port_range} must satisfy 1 <= lo <= hi <= 65535")
        return self
