"""Device ids: ``HOST/INDEX`` strings such as ``h0/3``. The host part defines locality.

May import: only the standard library and ``tenplex.errors``. Pure.
"""

from __future__ import annotations

from .errors import ConfigError


def parse_device(device: str) -> tuple[str, int]:
    """Split ``"h0/3"`` into ``("h0", 3)``; raise ConfigError on anything else."""
    host, sep, index = str(device).rpartition("/")
    if not sep or not host or not index.isdigit():
        raise ConfigError(f"device id {device!r} is not of the form HOST/INDEX, for example 'h0/3'")
    return host, int(index)


def host_of(device: str) -> str:
    return parse_device(device)[0]


def device_id(host: str, index: int) -> str:
    return f"{host}/{index}"


def make_devices(hosts: int, devices_per_host: int, prefix: str = "h") -> list[str]:
    """``hosts * devices_per_host`` ids, host-major: h0/0, h0/1, …, h1/0, …"""
    if hosts < 1 or devices_per_host < 1:
        raise ConfigError(f"need at least one host and one device per host, got hosts={hosts}, "
                          f"devices_per_host={devices_per_host}")
    return [device_id(f"{prefix}{h}", i) for h in range(hosts) for i in range(devices_per_host)]


def parse_host_addresses(text: str, what: str = "--stores") -> dict[str, str]:
    """``"h0=127.0.0.1:7070,h1=…"`` -> {host: address}: the one parser of HOST=ADDRESS lists.

    ``what`` names the option or variable in the error (``--stores``, ``TENPLEX_STORES``).
    """
    addresses: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        host, sep, address = (s.strip() for s in item.partition("="))
        if not sep or not host or not address:
            why = "has no '='" if not sep else "lacks the host" if not host else "lacks the address"
            raise ConfigError(f"{what} takes comma-separated HOST=ADDRESS pairs (e.g. h0=127.0.0.1:7070); "
                              f"{item!r} {why}")
        if host in addresses:
            raise ConfigError(f"{what} names host {host!r} twice ({addresses[host]} and {address}); give each host "
                              f"one address")
        addresses[host] = address
    return addresses
