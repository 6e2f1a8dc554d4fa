"""The configurations ``tenplex bench compare`` measures, shared with ``bench simulate --validate``.

May import: only the standard library (it imports nothing).
"""

BASE = ("dp=2,tp=2,pp=2 on 2 hosts x 4 devices", 2, 2, 2, 2, 4, "none")
CHANGES = [
    # (name, dp, tp, pp, hosts, devices per host, sharding)
    ("dp 2->1", 1, 2, 2, 2, 2, "none"),
    ("tp 2->4, pp 2->1", 2, 4, 1, 2, 4, "none"),
    ("pp 2->4, tp 2->1", 2, 1, 4, 2, 4, "none"),
    ("hosts 2->4", 2, 2, 2, 4, 2, "none"),
    ("ZeRO-1 on", 2, 2, 2, 2, 4, "optimizer"),
    ("FSDP on", 2, 2, 2, 2, 4, "full"),
]
# --quick: a tiny model on 2 hosts x 1 device and one change, so that the few DCP process groups start fast
QUICK_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 512}
QUICK_BASE = ("dp=2 on 2 hosts x 1 device", 2, 1, 1, 2, 1, "none")
QUICK_CHANGES = [("dp 2->1, tp 1->2", 1, 2, 1, 2, 1, "none")]
