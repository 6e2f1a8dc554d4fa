"""``tenplex durable status LOCATION``: what a job's bucket holds: durable versions, and flushes not finished.

May import: ``tenplex.durable``, ``tenplex.errors`` and the standard library.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("durable", help="a job's durable tier in object storage (S3)")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = sub.add_parser("status", help="list the durable versions of s3://BUCKET/PREFIX and unfinished flushes")
    status.add_argument("location", help="s3://BUCKET/PREFIX (credentials and endpoint: the AWS_* variables)")
    status.add_argument("--endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL, else AWS)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    from ..durable import Bucket, DurableVersion, durable_versions, parse_url

    parse_url(args.location)  # a malformed location is a usage error before any request
    bucket = Bucket(args.location, endpoint=args.endpoint)
    durable = durable_versions(bucket)
    rows = []
    for version in durable:
        found = DurableVersion(bucket, version)
        state = found.get_json("tenplex.torch_state") if "tenplex.torch_state" in found.json else {}
        rows.append({"version": version, "step": state.get("step"), "objects": len(found.entries),
                     "bytes": sum(entry.nbytes for entry, _ in found.entries)})
    started = sorted({int(k.split("/")[1]) for k in bucket.keys("versions/") if k.split("/")[1].isdigit()}
                     - set(durable))
    if args.json:
        print(json.dumps({"location": args.location, "durable": rows, "unfinished": started}))
        return 0
    print(f"{args.location}: {len(rows)} durable version(s)" + (f"; unfinished flushes: {started}" if started else ""))
    for row in rows:
        print(f"  version {row['version']}  step {row['step']}  {row['objects']} objects  {row['bytes']} bytes")
    return 0
