"""A pool of local gloo ranks started once and reused for many multi-rank checks.

`WorkerPool(world_size=4)` starts the ranks and, on each, a process group over the first k
ranks for every k <= world_size, so one pool serves every TP size. `pool.run(fn, tp, *args)`
calls `fn(rank, tp, group, *args)` on ranks 0..tp-1 and returns their results. A rank that
raises makes `run` raise a RankError carrying that rank's traceback; ranks left waiting in a
collective, and ranks that died, are replaced by restarting the pool, so a failure costs
seconds, not a collective timeout.
"""

import datetime
import faulthandler
import os
import pickle
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tplayers.backend import backend_kept
from tplayers.distributed import RankError, free_port, rank_context
from tplayers.testing.meshes import group_of, mesh_ranks, prepare_mesh

# After one rank fails, how long the others get to report (they may be failing too).
_GRACE_S = 3.0
# How much longer than a task's deadline the parent waits: the late ranks dump their stacks first.
_DUMP_WAIT_S = 1.5


@dataclass
class RemoteError:
    """An exception raised on a rank, as returned by `run(..., return_exceptions=True)`."""

    rank: int
    type_name: str
    message: str
    traceback: str


def _worker(rank, world_size, port, tasks, results, timeout_s, dump_dir):
    # A task still running at its deadline has every thread's stack written here, for the parent.
    dump = open(os.path.join(dump_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115  (open for the worker's life)
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        groups = {k: group_of(range(k)) for k in range(1, world_size + 1)}
        results.put((rank, -1, "ready", None))
    except BaseException:
        results.put((rank, -1, "error", RemoteError(rank, "StartupError", "", traceback.format_exc())))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, tp, args, deadline_s, mesh = task
        if mesh is not None:  # every rank takes part in creating the groups, members or not
            prepare_mesh(*mesh)
        if rank >= tp:
            continue
        dump.seek(0)
        dump.truncate()
        if deadline_s is not None:
            faulthandler.dump_traceback_later(deadline_s, file=dump)
        try:
            # Pickled here so that an unpicklable result is an error, not a lost reply.
            with backend_kept():  # a task that selects a backend selects it for itself, not the next
                results.put((rank, task_id, "ok", pickle.dumps(fn(rank, tp, groups[tp], *args))))
        except BaseException as e:
            results.put((rank, task_id, "error", RemoteError(rank, type(e).__name__, str(e), traceback.format_exc())))
        finally:
            faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int = 4, *, timeout_s: float = 300.0, collective_timeout_s: int = 120):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._procs = []
        self._task_id = 0

    def _start(self):
        ctx = rank_context(__name__)
        self._dumps = tempfile.TemporaryDirectory(prefix="tplayers-pool-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    rank,
                    self.world_size,
                    port,
                    self._tasks[rank],
                    self._results,
                    self.collective_timeout_s,
                    self._dumps.name,
                ),  # fmt: skip
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        try:
            replies = self._collect(-1, range(self.world_size), self.timeout_s)
        except BaseException:
            self.close()
            raise
        errors = [v for v in replies.values() if isinstance(v, RemoteError)]
        if errors:
            self.close()
            raise RankError(f"worker pool failed to start:\n{errors[0].traceback}")

    def _stacks(self, ranks) -> str:
        """The stacks the late ranks dumped at their deadline (where each one hung)."""
        out = []
        for rank in ranks:
            path = os.path.join(self._dumps.name, f"rank{rank}.txt")
            text = open(path).read().strip() if os.path.exists(path) else ""  # noqa: SIM115
            out.append(f"\n--- rank {rank} ---\n{text or '(no stack dumped)'}")
        return "".join(out)

    def close(self):
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._procs = []

    def _collect(self, task_id, ranks, timeout_s):
        """Replies of `ranks` for `task_id`: {rank: value or RemoteError}; stops early on an error."""
        replies, deadline, first_error_at = {}, time.monotonic() + timeout_s, None
        ranks = set(ranks)
        while ranks - replies.keys():
            now = time.monotonic()
            if first_error_at is not None and now - first_error_at > _GRACE_S:
                break
            if now > deadline:
                late = sorted(ranks - replies.keys())
                raise TimeoutError(f"ranks {late} gave no answer in {timeout_s:.0f}s", late)
            try:
                rank, tid, status, value = self._results.get(timeout=0.2)
            except queue.Empty:
                for r in ranks - replies.keys():
                    code = self._procs[r].exitcode
                    if code is not None:
                        replies[r] = RemoteError(r, "ProcessDied", f"exit code {code}", f"rank {r} died (exit {code})")
                        first_error_at = first_error_at or time.monotonic()
                continue
            if tid != task_id:
                continue  # a late reply of a task that was given up on
            replies[rank] = pickle.loads(value) if status == "ok" else value
            if status == "error" and first_error_at is None:
                first_error_at = time.monotonic()
        return replies

    def run(self, fn, tp: int, *args, return_exceptions: bool = False, timeout_s=None, what=None, mesh=None):
        """`fn(rank, tp, group, *args)` on ranks 0..tp-1 -> list of results, rank order.

        timeout_s: this task's deadline (default the pool's): ranks still running then have
        their stacks dumped, the pool restarts, and a TimeoutError shows where each was.
        mesh: (dp, pp, tp) or (dp, pp, tp_r, tp_c), `tp` ranks in all: the task may call
        `layout_mesh(*mesh)`; ("ep", dp, ep, pp, tp): `expert_mesh(dp, ep, pp, tp)`."""
        if mesh is not None and mesh_ranks(mesh) != tp:
            raise ValueError(f"mesh {mesh} does not have {tp} ranks")
        if not 1 <= tp <= self.world_size:
            raise ValueError(f"tp must be in 1..{self.world_size}, got {tp}")
        if not self._procs:
            self._start()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn, tp, args, timeout_s, mesh))
        try:
            # The parent waits a little longer than the workers' dump deadline, so the dumps exist.
            replies = self._collect(self._task_id, range(tp), timeout_s + _DUMP_WAIT_S if timeout_s else self.timeout_s)
        except TimeoutError as e:
            stacks = self._stacks(e.args[1] if len(e.args) > 1 else ())
            self.close()
            raise TimeoutError(f"{what or getattr(fn, '__name__', 'task')}: {e.args[0]}{stacks}") from None
        missing = [r for r in range(tp) if r not in replies]
        errors = [replies[r] for r in range(tp) if isinstance(replies.get(r), RemoteError)]
        if missing or any(e.type_name == "ProcessDied" for e in errors):
            self.close()  # ranks stuck in a collective, or dead: start afresh next time
        if errors and not (return_exceptions and not missing):
            # A dead rank is the cause; its peers' connection errors are only the effect.
            errors.sort(key=lambda e: e.type_name != "ProcessDied")
            first = errors[0]
            headline = (
                f"rank {first.rank} died ({first.message})"
                if first.type_name == "ProcessDied"
                else (f"rank {first.rank} of {tp} raised {first.type_name}: {first.message}")
            )
            others = "".join(f"\nthen rank {e.rank} raised {e.type_name}: {e.message[:200]}" for e in errors[1:])
            waiting = f"\n(ranks {missing} were left waiting and have been restarted)" if missing else ""
            error = RankError(f"{headline}\n{first.traceback}{others}{waiting}")
            error.errors = errors  # every failing rank's RemoteError, the cause first
            raise error
        return [replies[r] for r in range(tp)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._procs:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=5)
        self.close()
