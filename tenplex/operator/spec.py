"""A TenplexJob's ``spec``, parsed and validated.

May import: ``tenplex.elastic.policy``, ``tenplex.errors`` and the standard
library. Pure. The CRD's OpenAPI schema rejects most bad specs at the API
server; this catches the rest (and everything when the CRD is an old one), so
that a bad spec becomes the ``Failed`` phase with a message naming the field
instead of an operator crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..elastic.policy import choose
from ..errors import ConfigError


class SpecError(ConfigError):
    """A TenplexJob spec the operator cannot run; ``field`` is its path, e.g. ``spec.maxNodes``."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class JobSpec:
    image: str
    command: tuple[str, ...]
    min_nodes: int
    max_nodes: int
    gpus_per_node: int = 1
    min_gpus_per_node: int = 1  # a node with fewer free GPUs than gpus_per_node still qualifies with this many
    max_tp: int = 8
    pp: int | None = None
    pinned: Mapping[int, str] = field(default_factory=dict)
    env: tuple[tuple[str, str], ...] = ()
    dataset: str | None = None
    replicas: int | None = None
    save_interval: int | None = None
    durable: str | None = None  # s3://BUCKET/PREFIX: the job's durable tier (tenplex run --durable)
    in_place: bool = False  # survivors keep their processes across worlds (tenplex run --in-place)
    grace_seconds: int = 120
    backoff_limit: int = 6
    resources: Mapping[str, Any] = field(default_factory=dict)
    template: Mapping[str, Any] = field(default_factory=dict)

    def parallel(self, nodes: int | Sequence[int]) -> str:
        """The parallel configuration (``tenplex.elastic.policy``) as status shows it, of ``nodes`` nodes of
        ``gpus_per_node`` or of nodes with these GPU counts (a node that lost GPUs runs fewer workers)."""
        sizes = [self.gpus_per_node] * nodes if isinstance(nodes, int) else list(nodes)
        if not sizes:
            return ""
        c = choose(sum(sizes), sizes, max_tp=self.max_tp, pp=self.pp, pinned=dict(self.pinned))
        return c.degrees() + (f" ({len(c.idle)} idle)" if c.idle else "")

    def tolerations(self, resource: str) -> list[dict[str, Any]]:
        """The worker pod's tolerations: the template's, and the accelerator's taint as the store DaemonSet's.

        GPU nodes are often tainted with their resource name (``nvidia.com/gpu``) so that only pods that use the
        GPUs land there; the worker uses them (what the ExtendedResourceToleration admission plugin would add).
        """
        own: list[dict[str, Any]] = []
        if "/" in resource:  # an extended resource (`cpu` is no taint)
            own.append({"key": resource, "operator": "Exists", "effect": "NoSchedule"})
        theirs = (self.template.get("spec") or {}).get("tolerations") or []
        return own + [dict(t) for t in theirs if isinstance(t, Mapping) and t not in own]


def _count(spec: Mapping[str, Any], key: str, path: str, *, default: int | None = None, minimum: int = 1) -> int:
    """An integer >= ``minimum``; required unless it has a ``default``."""
    value = spec.get(key, default)
    if value is None:
        raise SpecError(f"{path}.{key}", "is required")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpecError(f"{path}.{key}", f"must be an integer >= {minimum}, got {value!r}")
    return value


def _optional_count(spec: Mapping[str, Any], key: str, path: str, *, minimum: int = 1) -> int | None:
    return None if spec.get(key) is None else _count(spec, key, path, minimum=minimum)


def _text(spec: Mapping[str, Any], key: str, path: str) -> str:
    value = spec.get(key)
    if not isinstance(value, str) or not value:
        raise SpecError(f"{path}.{key}", f"must be a non-empty string, got {value!r}")
    return value


def _durable(spec: Mapping[str, Any], path: str) -> str | None:
    """``spec.durable``: an ``s3://BUCKET/PREFIX`` location, or None."""
    if spec.get("durable") is None:
        return None
    value = _text(spec, "durable", path)
    if not value.startswith("s3://") or not value[5:].split("/", 1)[0]:
        raise SpecError(f"{path}.durable", f"must be s3://BUCKET/PREFIX (the prefix names the job), got {value!r}")
    return value


def _flag(spec: Mapping[str, Any], key: str, path: str) -> bool:
    """A boolean, false when absent (or null)."""
    value = spec.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, got {value!r}")
    return value


def _mapping(spec: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key}", f"must be an object, got {value!r}")
    return value


def parse_spec(spec: Mapping[str, Any]) -> JobSpec:
    """Validate a TenplexJob ``spec``; raises :class:`SpecError` naming the first bad field."""
    p = "spec"
    if not isinstance(spec, Mapping):
        raise SpecError(p, f"must be an object, got {spec!r}")
    image = _text(spec, "image", p)
    command = spec.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
        raise SpecError(f"{p}.command", f"must be a non-empty list of strings (the script and its "
                        f"arguments), got {command!r}")
    min_nodes = _count(spec, "minNodes", p)
    max_nodes = _count(spec, "maxNodes", p)
    if min_nodes > max_nodes:
        raise SpecError(f"{p}.minNodes", f"minNodes={min_nodes} is greater than maxNodes={max_nodes}")
    gpus = _count(spec, "gpusPerNode", p, default=1)
    min_gpus = _count(spec, "minGpusPerNode", p, default=gpus)
    if min_gpus > gpus:
        raise SpecError(f"{p}.minGpusPerNode", f"minGpusPerNode={min_gpus} is greater than gpusPerNode={gpus}")

    par = _mapping(spec, "parallel", p)
    dataset = _mapping(spec, "dataset", p)
    job = JobSpec(
        image=image, command=tuple(command), min_nodes=min_nodes, max_nodes=max_nodes, gpus_per_node=gpus,
        min_gpus_per_node=min_gpus, max_tp=_count(par, "maxTp", f"{p}.parallel", default=8),
        pp=_optional_count(par, "pp", f"{p}.parallel"), pinned=_pinned(par, f"{p}.parallel"), env=_env(spec, p),
        dataset=_text(dataset, "path", f"{p}.dataset") if "path" in dataset else None,
        replicas=_optional_count(spec, "replicas", p, minimum=0),
        save_interval=_optional_count(spec, "saveInterval", p),
        durable=_durable(spec, p), in_place=_flag(spec, "inPlace", p),
        grace_seconds=_count(spec, "terminationGracePeriodSeconds", p, default=120, minimum=0),
        backoff_limit=_count(spec, "backoffLimit", p, default=6, minimum=0),
        resources=_mapping(spec, "resources", p), template=_mapping(spec, "template", p))
    _check_every_world(job, p)
    return job


def _pinned(par: Mapping[str, Any], p: str) -> dict[int, str]:
    """``parallel.pinned``: world size -> configuration."""
    pinned: dict[int, str] = {}
    for key, value in _mapping(par, "pinned", p).items():
        if not str(key).isdigit() or int(key) < 1 or not isinstance(value, str):
            raise SpecError(f"{p}.pinned[{key!r}]", f"needs a world size (a positive integer) as key and a "
                            f"configuration such as 'tp=2,pp=2' as value, got {key!r}: {value!r}")
        pinned[int(key)] = value
    return pinned


def _env(spec: Mapping[str, Any], p: str) -> tuple[tuple[str, str], ...]:
    """``env``: (name, value) pairs for the workers."""
    env = []
    for i, item in enumerate(spec.get("env") or []):
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or \
                not isinstance(item.get("value", ""), str):
            raise SpecError(f"{p}.env[{i}]", f"must be {{name: string, value: string}}, got {item!r}")
        env.append((item["name"], item.get("value", "")))
    return tuple(env)


def _check_every_world(job: JobSpec, p: str) -> None:
    """Every world the job may run in must have a configuration: catch a bad pin or pp now, not mid-run.
    pp only fails in worlds smaller than pp and max_tp never does, so the smallest, largest and pinned sizes
    suffice, with full nodes and with every node at minGpusPerNode. A pin for a world of uneven nodes may not
    fit the nodes' shape: decide() checks the world it targets."""
    pinned, gpus, min_gpus = job.pinned, job.gpus_per_node, job.min_gpus_per_node
    min_nodes, max_nodes = job.min_nodes, job.max_nodes
    for world in pinned:
        if world % gpus and min_gpus == gpus:
            raise SpecError(f"{p}.parallel.pinned[{str(world)!r}]", f"world size {world} is not a multiple of "
                            f"gpusPerNode={gpus}, so no world of this job has that size")
    sizes = {min_nodes, max_nodes} | {w // gpus for w in pinned if min_nodes <= w // gpus <= max_nodes}
    for nodes in sorted(sizes):
        for shape in _shapes(nodes, gpus, min_gpus):
            try:
                job.parallel(shape)
            except ConfigError as e:
                world = sum(shape)
                where = f"{p}.parallel.pinned[{str(world)!r}]" if world in pinned else f"{p}.parallel"
                gpus_of = "" if min_gpus == gpus else f" with {'+'.join(map(str, shape))} GPUs"
                raise SpecError(where, f"no parallel configuration for {nodes} nodes{gpus_of} ({world} ranks): "
                                f"{e}") from None


def _shapes(nodes: int, gpus: int, min_gpus: int) -> list[list[int]]:
    """GPU counts per node that :func:`parse_spec` checks for a world of ``nodes`` nodes."""
    return [[gpus] * nodes] + ([[min_gpus] * nodes] if min_gpus < gpus else [])


def check_name(name: str) -> None:
    """A job's name becomes the value of the ``tenplex.io/job`` label, which holds at most 63 characters."""
    if len(name) > 63:
        raise SpecError("metadata.name", f"{name!r} has {len(name)} characters; the label tenplex.io/job "
                        f"allows 63: rename the TenplexJob")
