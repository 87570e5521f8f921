"""The serde's ``SerdeProcessor``: LMCache's ``AsyncSerdeProcessor`` with a batch's
objects spread over its ``max_workers`` threads.

LMCache 0.5.6's ``AsyncSerdeProcessor`` runs each submitted task on one pool thread,
and a task is a whole batch: the ``StorageManager``'s prefetch hands the serde every
chunk of an L2 hit in one ``submit_deserialize`` (a store, every chunk of a write in one
``submit_serialize``). So ``max_workers`` threads decode one batch on one of them, one
chunk after another, however many cores are free.

:class:`ParallelSerdeProcessor` keeps LMCache's class and its task contract, through its
public methods only: a batch of ``n`` objects is submitted to the parent as ``n``
one-object tasks, which its pool runs ``max_workers`` at a time, and the batch's own task
id reports once all of them have: ``True`` when every object succeeded, ``False`` when
any failed, as LMCache's one try around a batch does (a refused value still fails its
whole batch; the L2 wrapper reports every key of a failed batch as missed). Each part's
completion signals the parent's event fd, so LMCache's poll loop wakes once per object
and finds the batch pending until the last one.

With one worker, a batch of one object, an empty batch, and lists of different lengths
go to the parent as they are (one task: the empty batch succeeds, the mismatched one fails, as LMCache's
``zip(strict=True)`` makes them).
"""

from __future__ import annotations

import threading

from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

__all__ = ["ParallelSerdeProcessor"]


class _Batch:
    """A submitted batch: its parts' parent task ids and the results popped so far."""

    __slots__ = ("parts", "ok")

    def __init__(self, parts: list[int]) -> None:
        self.parts, self.ok = parts, True


class ParallelSerdeProcessor(AsyncSerdeProcessor):
    """``AsyncSerdeProcessor`` whose batches run object by object over its ``max_workers``
    threads; results, failures and event fds as the parent's (see the module docstring)."""

    def __init__(self, serializer, deserializer, max_workers: int = 1) -> None:
        super().__init__(serializer, deserializer, max_workers=max_workers)
        self._split = max_workers > 1  # one worker runs a batch's parts in order anyway
        self._batch_lock = threading.Lock()
        self._next_batch = 0
        self._batches: dict[str, dict[int, _Batch]] = {"serialize": {}, "deserialize": {}}

    def submit_serialize(self, src_objs, dst_objs, keys) -> int:
        """As the parent's; the batch's objects are serialized in parallel."""
        return self._submit("serialize", super().submit_serialize, src_objs, dst_objs, keys)

    def query_serialize_result(self, task_id: int) -> bool | None:
        return self._query("serialize", super().query_serialize_result, task_id)

    def submit_deserialize(self, src_objs, dst_objs, keys) -> int:
        """As the parent's; the batch's objects are deserialized in parallel."""
        return self._submit("deserialize", super().submit_deserialize, src_objs, dst_objs, keys)

    def query_deserialize_result(self, task_id: int) -> bool | None:
        return self._query("deserialize", super().query_deserialize_result, task_id)

    def _submit(self, kind: str, submit, src_objs, dst_objs, keys) -> int:
        src_objs, dst_objs, keys = list(src_objs), list(dst_objs), list(keys)
        with self._batch_lock:  # a query of this id waits until its parts are registered
            task_id = self._next_batch
            self._next_batch += 1
            if self._split and len(src_objs) > 1 and len(src_objs) == len(dst_objs) == len(keys):
                parts = [submit([s], [d], [k]) for s, d, k in zip(src_objs, dst_objs, keys)]
            else:
                parts = [submit(src_objs, dst_objs, keys)]
            self._batches[kind][task_id] = _Batch(parts)
        return task_id

    def _query(self, kind: str, query, task_id: int) -> bool | None:
        with self._batch_lock:
            batch = self._batches[kind].get(task_id)
            if batch is None:
                return None  # unknown, or already reported (the parent's contract)
            waiting = []
            for part in batch.parts:
                r = query(part)
                if r is None:
                    waiting.append(part)
                else:
                    batch.ok = batch.ok and bool(r)
            batch.parts = waiting
            if waiting:
                return None
            del self._batches[kind][task_id]
            return batch.ok
