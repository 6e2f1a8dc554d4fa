"""A worker of tests/test_elastic_supervisor.py: ``supervised_worker.py OUT PLAN``.

Appends one JSON line per start to ``OUT/slot-LOCAL_RANK.jsonl`` (its pid and the environment the supervisor
gave it), then acts on ``PLAN`` (JSON: {local rank: [action of the 1st start, of the 2nd, ...]}): an exit code,
``"wait"`` (until ``OUT/release`` exists), ``"release"`` (create it, exit 0), ``"after-1"`` (wait until slot 1's
last process is gone, exit 0), once slot 0 started. SIGTERM appends ``{"term": pid}`` and exits 0 (a planned
leave). No torch.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

ENV = ("LOCAL_RANK", "RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TENPLEX_DEVICES",
       "TENPLEX_IN_PLACE", "TENPLEX_RDZV_ENDPOINT", "TENPLEX_RDZV_ID", "TENPLEX_MIN_WORKERS", "TENPLEX_HOST",
       "TENPLEX_STORE_ADDRESS", "TENPLEX_AGENT_PID", "MASTER_ADDR", "MASTER_PORT")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main(out: Path, plan: dict) -> int:
    slot = os.environ["LOCAL_RANK"]
    mine = out / f"slot-{slot}.jsonl"
    start = len([d for d in lines(mine) if "pid" in d])

    def leave(signum, frame):
        with open(mine, "a") as f:
            f.write(json.dumps({"term": os.getpid()}) + "\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, leave)
    with open(mine, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **{k: os.environ.get(k) for k in ENV}}) + "\n")
    while slot != "0" and not lines(out / "slot-0.jsonl"):
        time.sleep(0.05)  # slot 0 is up (its SIGTERM handler too) before another acts
    actions = plan.get(slot, ["wait"])
    action = actions[start] if start < len(actions) else 0
    if action == "release":
        (out / "release").touch()
        return 0
    while action == "wait" and not (out / "release").exists():
        time.sleep(0.05)
    while action == "after-1" and (not lines(out / "slot-1.jsonl") or
                                   Path(f"/proc/{lines(out / 'slot-1.jsonl')[-1]['pid']}").exists()):
        time.sleep(0.05)  # slot 1's process is reaped once its supervisor has seen it exit
    return action if isinstance(action, int) else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), json.loads(sys.argv[2])))
