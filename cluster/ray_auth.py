"""Ray must not be reachable by strangers: `brigade serve` refuses a Ray that other machines
can reach (a non-loopback --host, or joining one with --ray-address) unless Ray token auth is
on. Ray's ports run code for whoever connects; its token auth (Ray >= 2.52) is what closes them."""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping


class RayAuthOff(ValueError):
    """Ray would be reachable beyond this machine with token auth off; the message says how to fix it."""


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def token_auth_on(environ: Mapping[str, str] = os.environ) -> bool:
    mode = environ.get("RAY_AUTH_MODE", environ.get("RAY_auth_mode", "disabled"))
    return mode.strip().lower() == "token"


def check_ray_exposure(host: str, ray_address: str | None, environ: Mapping[str, str] = os.environ) -> None:
    """RayAuthOff when Ray would listen beyond loopback, or is joined over the network, with
    RAY_AUTH_MODE anything but "token"."""
    if token_auth_on(environ) or (ray_address is None and _loopback(host)):
        return
    why = f"--ray-address {ray_address}" if ray_address is not None else f"--host {host} (not loopback)"
    raise RayAuthOff(
        f"{why} makes Ray reachable from other machines, and RAY_AUTH_MODE is "
        f"{environ.get('RAY_AUTH_MODE', 'unset')!r}: anyone who reaches Ray's ports could run code in the "
        "cluster. Turn on Ray token auth: export RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN (or "
        "RAY_AUTH_TOKEN_PATH) on every Ray node and here (README, Security); or serve on --host 127.0.0.1")
