"""The training job of ``tenplex bench goodput``: one program, run by every mode in the way that mode runs it.

    python -m tenplex.bench.goodput_worker MODE --data DIR --record DIR --steps N [--step-ms MS] …

MODE is ``tenplex`` (under ``tenplex run``, through :class:`tenplex.elastic.Job` in its loop form),
``tenplex-inplace`` (the same under ``tenplex run --in-place``: the survivors keep their process), ``dcp``
(under torchrun, with PyTorch Distributed Checkpoint as its documentation shows it), ``torchft`` (one replica
group per process, its ``Manager`` and ``DistributedDataParallel`` as torchft's ``train_ddp.py`` shows them; both in
:mod:`tenplex.bench.goodput_peers`) or ``reference`` (one process, every step, no events: the losses every mode
must reproduce). The model, the data, the records and the emulated GPU are :mod:`tenplex.bench.goodput_job`'s.
``tenplex-inplace-tp`` and ``reference-tp`` run the tensor-parallel job of :mod:`tenplex.bench.goodput_tp` instead.

May import: torch, ``tenplex.elastic`` (``Job``, ``devices``), ``tenplex.bench.goodput_job``,
``tenplex.bench.goodput_peers``, ``tenplex.bench.goodput_tp`` and the standard library.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tenplex.bench.goodput_job import Record, Shares, build, check_device, run_worlds, state_bytes, train_step


def run_reference(args: argparse.Namespace) -> None:
    model, optimizer = build()
    shares = Shares(args.data, args.global_batch)
    rec = Record(args.record, "reference", "h0", "0")
    rec.write("start", world="reference", size=1, restored_step=None, restore_s=0.0, bytes_read=0)
    for step in range(args.steps):
        ids, tokens = shares.get(step, 1, 0)
        loss = train_step(model, tokens, args.step_ms)
        optimizer.step()
        optimizer.zero_grad()
        rec.write("step", step=step + 1, loss=loss, n=len(ids), dp=1, world="reference")


def run_tenplex(args: argparse.Namespace) -> None:
    """The loop form (``for world in job.worlds(): with world: ...``): one world per process under ``tenplex run``
    (a change restarts the workers), a new world per change in the same process under ``tenplex run --in-place``."""
    import tenplex.elastic

    # save_every None: snapshots at the interval that keeps their cost within 5% of the step time (Job's default).
    run_worlds(args, tenplex.elastic.Job(dataset=args.data, global_batch=args.global_batch, max_tp=1), _train_world)


def _train_world(args: argparse.Namespace, job, world, rec: Record, device: str) -> None:
    """One world: the model built and restored for it, then steps until the end or the world's end."""
    from torch.nn.parallel import DistributedDataParallel

    model, optimizer = build()
    model = DistributedDataParallel(model, process_group=job.group)
    job.restore(model, optimizer)
    r = job.restored
    restored = r.step if r.version is not None else None
    moved = r.plan_stats.get("intra_host_bytes", 0) + r.plan_stats.get("inter_host_bytes", 0)
    membership = getattr(job, "_membership", None)  # in place: when it registered, formed its first world
    phases = {"job": job.started, **(membership.timeline if membership is not None else {})}
    rec.write("start", world=job.world_id, size=job.world_size, restored_step=restored, restore_s=r.seconds,
              bytes_read=state_bytes(model, optimizer) if restored is not None else 0, moved_bytes=moved,
              generation=world.generation, phases=phases)
    dp, rank = job.config.dp, job.coords["dp"]
    while job.step < args.steps and world.active:
        check_device(args.faults, job.host, device)
        batch = job.batch()
        loss = train_step(model, batch.data.long(), args.step_ms)
        optimizer.step()
        optimizer.zero_grad()
        rec.write("step", step=job.step + 1, loss=loss, n=len(batch.ids), dp=dp, rank=rank, world=job.world_id)
        job.step_done()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("tenplex", "tenplex-inplace", "tenplex-inplace-tp", "dcp", "torchft", "reference",
                                    "reference-tp"))
    p.add_argument("--data", required=True, help="packed dataset directory")
    p.add_argument("--record", type=Path, required=True, help="folder of the ranks' JSON lines")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=500.0, help="emulated accelerator time per step")
    p.add_argument("--global-batch", type=int, default=840)
    p.add_argument("--faults", type=Path, default=None, help="folder of the broken devices' files")
    p.add_argument("--checkpoints", type=Path, default=None, help="dcp: the checkpoint folder (shared storage)")
    p.add_argument("--lighthouse", default=None, help="torchft: the lighthouse's address")
    p.add_argument("--timeout", type=float, default=5.0, help="torchft: the process group's timeout")
    args = p.parse_args()
    if args.mode == "reference":
        run_reference(args)
    elif args.mode in ("tenplex", "tenplex-inplace"):
        run_tenplex(args)
    elif args.mode in ("tenplex-inplace-tp", "reference-tp"):
        from tenplex.bench import goodput_tp

        (goodput_tp.run_reference if args.mode == "reference-tp" else goodput_tp.run_tenplex_tp)(args)
    elif args.mode == "dcp":
        from tenplex.bench.goodput_peers import run_dcp

        run_dcp(args)
    else:
        from tenplex.bench.goodput_peers import run_torchft

        run_torchft(args)


if __name__ == "__main__":
    main()
