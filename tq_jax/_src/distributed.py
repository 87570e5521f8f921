"""Sharing ``compress``/``decompress`` work across processes with ``jax.distributed``.

Every process reads the same inputs (a shared filesystem: NFS, Filestore, GCS FUSE,
Lustre, ...) and computes the same plans. The codec units (one blob to encode or
decode each) are dealt out deterministically: largest first, each to the process with
the least work so far, ties to the lowest process index. Each process writes the
output bytes of its units to part files in a shared *parts directory*. After a
barrier, output file ``j`` is assembled by process ``j % num_processes`` — header,
pass-through tensors copied from the input, and the parts in order — into a temporary
file renamed over OUT; a last barrier ends the run and process 0 removes the parts.
Since the bytes of every unit are fixed by the plan, OUT is byte-identical to a
one-process run.

Processes agree at each step through the coordination service that
``jax.distributed.initialize`` starts (its key-value store and barriers; no
collectives, so it works on any backend). A failure on one process is reported to all
of them at the next barrier, and every process exits with that one-line reason.
"""

from __future__ import annotations

import itertools
import os
import shutil
from typing import Callable, NamedTuple

from tq_jax._src import batch as _batch

__all__ = ["Cluster", "initialize", "assign", "run_distributed", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 6 * 3600  # barrier timeout: the slowest process's whole share of the work
_COPY_BYTES = 16 << 20
_runs = itertools.count()


class Cluster(NamedTuple):
    """This process's place among the processes of a ``jax.distributed`` job."""

    index: int
    count: int
    client: object  # the coordination-service client
    timeout_ms: int
    run: str  # key prefix shared by the processes for this run

    def agree(self, phase: str, fn: Callable[[], str],
              plain_errors: tuple[type[BaseException], ...] = ()) -> list[str]:
        """Run ``fn`` here, then share its result (or failure) with every process.

        Returns every process's result, in process order. If any process failed, all
        raise :class:`~tq_jax._src.batch.BatchError` naming the first failed process (the
        failing process re-raises its own exception). The failure is shared as its
        message alone for a :class:`~tq_jax._src.batch.BatchError` or one of
        ``plain_errors`` (errors written for a person), else prefixed by its type.
        """
        key = f"{self.run}/{phase}"
        local_exc = None
        try:
            status = "ok:" + fn()
        except Exception as e:  # reported to the others, re-raised below
            local_exc = e
            plain = isinstance(e, (_batch.BatchError, *plain_errors))
            status = "err:" + " ".join(str(e).split()) if plain else f"err:{type(e).__name__}: {e}"
        self.client.key_value_set(f"{key}/{self.index}", status)
        self.client.wait_at_barrier(key, self.timeout_ms)
        statuses = [
            self.client.blocking_key_value_get(f"{key}/{q}", self.timeout_ms) for q in range(self.count)
        ]
        if local_exc is not None:
            raise local_exc
        for q, s in enumerate(statuses):
            if s.startswith("err:"):
                raise _batch.BatchError(f"process {q} of {self.count} failed: {s[4:]}")
        return [s[3:] for s in statuses]


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, auto: bool = False,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Cluster | None:
    """Join a ``jax.distributed`` job; None when running as a single process.

    With ``coordinator`` (``host:port`` of process 0), ``num_processes`` and
    ``process_id``, or with ``auto`` (cluster auto-detection: TPU pods, SLURM, Open MPI,
    ...), calls :func:`jax.distributed.initialize` first. A job initialised by the
    caller beforehand is used as is. Must run before anything touches a JAX device.
    """
    import jax

    if (coordinator is not None or auto) and not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return None
    return Cluster(jax.process_index(), jax.process_count(), _coordination_client(), int(timeout_s * 1000),
                   f"tq_jax/run{next(_runs)}")


_NO_CLIENT = (
    "tq_jax._src.distributed needs the client of the coordination service that "
    "jax.distributed.initialize starts (its key-value store and barriers), but this jax "
    "({version}) does not keep it where jax 0.10 does (jax._src.distributed.global_state.client): "
    "{why}. Run the job as one process, or use the jax version pinned in pyproject.toml."
)


def _coordination_client():
    """The coordination-service client of an initialised ``jax.distributed`` job.

    jax (0.10.2) has no public accessor for it: ``jax.distributed`` offers
    ``initialize``/``is_initialized``/``shutdown`` only, and its own multihost
    utilities read the private ``global_state``. This is the one place tq_jax reads a
    private jax name; a jax that moves it raises an error saying so, not an
    ``AttributeError`` mid-run.
    """
    import jax

    try:
        from jax._src.distributed import global_state

        client = global_state.client
    except (ImportError, AttributeError) as e:
        raise RuntimeError(_NO_CLIENT.format(version=jax.__version__, why=f"{type(e).__name__}: {e}")) from e
    if client is None:
        raise RuntimeError(_NO_CLIENT.format(version=jax.__version__, why="jax.distributed is initialised but "
                                             "global_state.client is None"))
    return client


def assign(sizes: list[int], count: int) -> list[int]:
    """Owner process of each work item: largest first to the least-loaded process."""
    owners = [0] * len(sizes)
    load = [0] * count
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(count), key=lambda q: (load[q], q))
        owners[i] = p
        load[p] += sizes[i]
    return owners


def _part_path(parts_dir: str, fi: int, ei: int, ui: int) -> str:
    return os.path.join(parts_dir, f"{fi:05d}.{ei:06d}.{ui:06d}.part")


def run_distributed(cluster: Cluster, open_plans: Callable[[], tuple], devices,
                    parts_dir: str, make_progress: Callable[[int], object] | None = None,
                    plain_errors: tuple[type[BaseException], ...] = ()) -> tuple:
    """Write every plan's OUT, sharing the codec units among the processes.

    Args:
        cluster: from :func:`initialize`.
        open_plans: called once in every process; returns ``(plans, sources)``, one
            :class:`~tq_jax._src.batch.FilePlan` and its open source per file. A failure here
            (a missing input, say) is reported to every process.
        devices: this process's local devices.
        parts_dir: a directory on a filesystem every process can read and write.
        make_progress: ``total_bytes -> object with update(n) and close()``.
        plain_errors: the caller's own error types, shared by message alone like
            :class:`~tq_jax._src.batch.BatchError` (see :meth:`Cluster.agree`).

    Returns:
        ``(plans, sources)``; the caller closes the sources.
    """
    opened: list = []

    def plan():
        opened.extend(open_plans())
        return "|".join(p.fingerprint() for p in opened[0])

    fps = cluster.agree("plan", plan, plain_errors)
    plans, sources = opened
    if len(set(fps)) != 1:
        raise _batch.BatchError(
            "processes planned different outputs: every process must see the same input files "
            "and the same options (is the input on a shared filesystem?)"
        )

    work = [
        (fi, ei, ui, u)
        for fi, p in enumerate(plans)
        for ei, e in enumerate(p.entries)
        for ui, u in enumerate(e.units)
        if u.kind != "raw"
    ]
    owners = assign([w[3].in_nbytes for w in work], cluster.count)
    mine = [w for w, o in zip(work, owners) if o == cluster.index]
    assembled = [fi for fi in range(len(plans)) if fi % cluster.count == cluster.index]
    total = sum(w[3].in_nbytes for w in mine) + sum(
        u.in_nbytes for fi in assembled for e in plans[fi].entries for u in e.units if u.kind == "raw"
    )
    bar = make_progress(total) if make_progress else None
    progress = bar.update if bar else (lambda n: None)

    def encode():
        os.makedirs(parts_dir, exist_ok=True)
        for turn, (fi, ei, ui, u) in enumerate(mine):
            data = _batch.produce(sources[fi], u, devices, turn)
            path = _part_path(parts_dir, fi, ei, ui)
            tmp = f"{path}.{cluster.index}.tmp"
            with open(tmp, "wb") as f:
                f.write(_batch.byte_view(data))
            os.replace(tmp, path)
            progress(u.in_nbytes)
        return ""

    def assemble():
        for fi in assembled:
            plan = plans[fi]
            sizes = {
                (ei, ui): os.path.getsize(_part_path(parts_dir, fi, ei, ui))
                for ei, e in enumerate(plan.entries)
                for ui, u in enumerate(e.units)
                if u.kind != "raw"
            }
            w = _batch.open_writer(plan, *plan.finalize(sizes))
            try:
                for ei, e in enumerate(plan.entries):
                    for ui, u in enumerate(e.units):
                        if u.kind == "raw":
                            w.write(_batch.produce(sources[fi], u, devices))
                            progress(u.in_nbytes)
                            continue
                        path = _part_path(parts_dir, fi, ei, ui)
                        n = 0
                        with open(path, "rb") as f:
                            while chunk := f.read(_COPY_BYTES):
                                w.write(chunk)
                                n += len(chunk)
                        if n != sizes[ei, ui]:
                            raise _batch.BatchError(f"part {path} changed while being copied")
                w.commit()
            except BaseException:
                w.abort()
                raise
            for ei, e in enumerate(plan.entries):
                for ui, u in enumerate(e.units):
                    if u.kind != "raw":
                        os.unlink(_part_path(parts_dir, fi, ei, ui))
        return ""

    try:
        cluster.agree("encode", encode, plain_errors)
        cluster.agree("assemble", assemble, plain_errors)
    finally:
        if bar is not None:
            bar.close()
        if cluster.index == 0:
            shutil.rmtree(parts_dir, ignore_errors=True)
    return plans, sources
