"""The job settings a launcher passes to the training-loop API in the environment (the operator's worker pods).

May import: ``tenplex.errors`` and the standard library.

``TENPLEX_MAX_TP`` and ``TENPLEX_PP`` (whole numbers >= 1), ``TENPLEX_PINNED``
(a JSON object: world size -> configuration such as ``"tp=2,pp=2"``),
``TENPLEX_REPLICAS`` and ``TENPLEX_SAVE_INTERVAL`` (whole numbers >= 0) and
``TENPLEX_DATASET`` (a path) become :class:`tenplex.elastic.Job`'s
``max_tp``, ``pp``, ``pinned``, ``replicas``, ``save_every`` and ``dataset``
wherever the script leaves that argument out. An unset or empty variable
means "not set"; a malformed one is a :class:`~tenplex.errors.ConfigError`
naming it. :func:`env_from_settings` writes them (the operator's pods), so the
names and the format live here only.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..errors import ConfigError

_COUNTS = {"TENPLEX_MAX_TP": ("max_tp", 1), "TENPLEX_PP": ("pp", 1), "TENPLEX_REPLICAS": ("replicas", 0),
           "TENPLEX_SAVE_INTERVAL": ("save_every", 0)}


def env_from_settings(max_tp: int | None = None, pp: int | None = None, pinned: Mapping[int, str] | None = None,
                      replicas: int | None = None, save_every: int | None = None,
                      dataset: str | None = None) -> dict[str, str]:
    """The environment that :func:`settings_from_env` reads back as these settings (None: left out)."""
    counts = {"max_tp": max_tp, "pp": pp, "replicas": replicas, "save_every": save_every}
    env = {var: str(counts[argument]) for var, (argument, _) in _COUNTS.items() if counts[argument] is not None}
    if pinned:
        env["TENPLEX_PINNED"] = json.dumps({str(k): v for k, v in sorted(pinned.items())})
    if dataset:
        env["TENPLEX_DATASET"] = dataset
    return env


def settings_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Job arguments from ``environ`` (only the variables that are set), by argument name."""
    found: dict[str, Any] = {}
    for var, (argument, minimum) in _COUNTS.items():
        text = environ.get(var, "").strip()
        if not text:
            continue
        if not text.isdigit() or int(text) < minimum:
            raise ConfigError(f"{var}={text!r}: expected a whole number >= {minimum}")
        found[argument] = int(text)
    text = environ.get("TENPLEX_PINNED", "").strip()
    if text:
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"TENPLEX_PINNED is not JSON ({e}); expected an object such as "
                              f'{{"4": "tp=2,pp=2"}}') from None
        if not isinstance(doc, dict) or not all(k.isdigit() and int(k) >= 1 and isinstance(v, str)
                                                for k, v in doc.items()):
            raise ConfigError(f"TENPLEX_PINNED={text!r}: expected an object from world sizes to configurations, "
                              f'such as {{"4": "tp=2,pp=2"}}')
        found["pinned"] = {int(k): v for k, v in doc.items()}
    text = environ.get("TENPLEX_DATASET", "").strip()
    if text:
        found["dataset"] = text
    return found
