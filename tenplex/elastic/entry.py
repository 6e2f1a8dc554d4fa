"""``python -m tenplex.elastic.entry MODE TARGET [ARGS…]``: how ``tenplex run`` starts each worker.

May import: only the standard library (it runs before the user's program, in every worker).

Why: torchrun starts every worker in a session of its own, so killing the
agent, or its process group, leaves the workers running (measured here: a
SIGKILLed agent orphans its workers). A node that dies takes everything on it,
so each worker asks the kernel to SIGKILL it when its agent dies
(``PR_SET_PDEATHSIG``, which survives ``exec``), then becomes the user's
program. MODE is ``script`` (``python -u TARGET``), ``module`` (``python -u -m
TARGET``) or ``exec`` (torchrun's ``--no-python``: run TARGET itself).

May import: the standard library only (it runs before the user's program).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(agent_pid: int | None) -> None:
    """SIGKILL this process when its parent (the agent) dies; exit now if that already happened."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The agent may have died between our fork and the prctl: then nobody would kill us.
    if agent_pid is not None and os.getppid() != agent_pid:
        os._exit(1)


def command(mode: str, target: str, args: list[str]) -> list[str]:
    if mode == "script":
        return [sys.executable, "-u", target, *args]
    if mode == "module":
        return [sys.executable, "-u", "-m", target, *args]
    if mode == "exec":
        return [target, *args]
    raise SystemExit(f"tenplex.elastic.entry: unknown mode {mode!r}; expected script, module or exec")


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m tenplex.elastic.entry {script,module,exec} TARGET [ARGS...]")
    agent = os.environ.get("TENPLEX_AGENT_PID")
    die_with_parent(int(agent) if agent else None)
    argv = command(argv[0], argv[1], argv[2:])
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
