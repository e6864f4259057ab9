"""Transfer settings: the `transfer` sub-config of the root config."""
from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NODE_HOST = "node"


def is_wildcard(host: str) -> bool:
    """True for any spelling of "every interface" ("", "*", 0.0.0.0, "0", "::", "::0", "[::]", ...)."""
    h = host.strip().strip("[]")
    if h in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:  # a name; socket.bind also reads "0" as 0.0.0.0
        return h == "0"


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
      exported request nobody pulled, a decode worker frees blocks reserved for a payload
      that never came (e.g. the router died between the two calls); swept on a timer
      (kv_transfer/leases.py), not only by the next request.
    backend: gloo moves CPU tensors; nccl moves CUDA tensors (the header and ack still go
      over a gloo group); auto picks nccl when CUDA and NCCL are available, else gloo.
    recv_buffer_mib: the largest receive buffer a decode worker keeps per channel, reused
      across requests; a bigger payload gets a buffer of its own, freed after the write
      (kv_transfer/recv_buffers.py).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port_range: tuple[int, int] | None = None
    timeout_s: float = Field(30.0, gt=0.0)
    connect_timeout_s: float = Field(60.0, gt=0.0)
    hold_timeout_s: float = Field(120.0, gt=0.0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    recv_buffer_mib: float = Field(256.0, ge=0.0)

    @field_validator("host")
    @classmethod
    def _no_wildcard(cls, host: str) -> str:
        if is_wildcard(host):
            raise ValueError(f"host {host!r} would listen on every interface; name one address")
        return host

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
