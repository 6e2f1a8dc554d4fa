"""``tenplex run --in-place``: each node's torchrun supervises only its own workers; the workers form the job's
worlds themselves (:mod:`tenplex.elastic.worlds`).

May import: ``tenplex.errors`` and the standard library (no torch: the launcher parses before torchrun loads).

torchrun's elastic agent stops and restarts every local worker on any membership change of its rendezvous, so
survivors cannot keep their processes while torchrun owns the cross-node world. In place, each node's torchrun
runs ``--standalone`` (a rendezvous of this node alone): it restarts its workers after a crash, counted against
``--max-restarts`` as before, and nothing else. The user's ``--rdzv-endpoint`` (a ``tenplex rendezvous serve``
store) and ``--rdzv-id`` go to the workers instead, with the smallest number of workers the first world waits for
(``--nnodes MIN`` times ``--nproc-per-node``), the most it may have (``MAX`` times it) and the last call: how long
the first world still waits for late starters once no worker registered (``--rdzv-conf last_call_timeout``,
default :data:`LAST_CALL_S`, as tenplex run sets it for torchrun's rendezvous).

Without torchrun (:mod:`.light_launch`): when every option is one that in place needs, ``tenplex run
--in-place`` neither imports torch nor runs torchrun; any other torchrun option keeps torchrun ``--standalone``.
"""

from __future__ import annotations

from ..errors import ConfigError

# torchrun options that describe the cross-node rendezvous: in place, the workers' business, not torchrun's
LAST_CALL_S = "2"
_RENDEZVOUS = ("--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend", "--rdzv-conf",
               "--rdzv_conf", "--rdzv-id", "--rdzv_id", "--nnodes", "--standalone")


def local_argv(options: list[str], given, without) -> tuple[list[str], dict[str, str]]:
    """(torchrun options for this node alone, the workers' in-place environment) from the user's options;
    ``given``/``without`` are the launcher's option readers."""
    endpoint = given(options, "--rdzv-endpoint", "--rdzv_endpoint")
    if not endpoint:
        raise ConfigError("tenplex run --in-place needs --rdzv-endpoint HOST:PORT of a rendezvous store that no "
                          "agent owns (start one with `tenplex rendezvous serve`): the workers form the worlds there")
    nnodes = given(options, "--nnodes") or "1"
    per_node = given(options, "--nproc-per-node", "--nproc_per_node") or "1"
    try:
        low, _, high = nnodes.partition(":")
        min_workers, max_workers = int(low) * int(per_node), int(high or low) * int(per_node)
    except ValueError:
        raise ConfigError(f"--in-place needs numbers for --nnodes ({nnodes!r}) and --nproc-per-node "
                          f"({per_node!r})") from None
    conf = dict(item.partition("=")[::2] for item in (given(options, "--rdzv-conf", "--rdzv_conf") or "").split(",")
                if item)
    env = {"TENPLEX_IN_PLACE": "1", "TENPLEX_RDZV_ENDPOINT": endpoint,
           "TENPLEX_RDZV_ID": given(options, "--rdzv-id", "--rdzv_id") or "none",
           "TENPLEX_MIN_WORKERS": str(min_workers), "TENPLEX_MAX_WORKERS": str(max_workers),
           "TENPLEX_LAST_CALL": conf.get("last_call_timeout", LAST_CALL_S).strip()}
    return [*without(options, *_RENDEZVOUS), "--standalone"], env
