"""Process groups: `init_mesh` for torchrun, `launch` for local CPU ranks, group resolution.

Every distributed object takes `group=`: a ProcessGroup, a 1-D DeviceMesh, or None for the
default group. There is no global process-group singleton.
"""

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from multiprocessing import forkserver

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Long enough for a slow interpreter-mode kernel, short enough that a dead peer is noticed.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("TPLAYERS_TIMEOUT_S", "120")))


# a 2-D tensor-parallel mesh's ranks (flattened, in order) -> the group of all of them
_GRID_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def register_grid_group(ranks, group: dist.ProcessGroup) -> None:
    """The flattened group of the grid over `ranks`, made by every rank of the world at once
    (`init_mesh`, the test pools' meshes): `resolve_group` of that grid looks it up."""
    _GRID_GROUPS[tuple(int(r) for r in ranks)] = group


# (data-parallel ranks, expert-parallel ranks) -> this rank's expert-data-parallel group: the
# replicas of its experts (expert parallelism folded over the data-parallel ranks)
_EXPERT_DATA_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def register_expert_data_group(dp_ranks, ep_ranks, group: dist.ProcessGroup) -> None:
    """The expert-data-parallel group of this rank, for its data-parallel and expert-parallel
    groups (`init_mesh(ep=)`, the test pools' meshes): `expert_data_group` looks it up."""
    _EXPERT_DATA_GROUPS[tuple(int(r) for r in dp_ranks), tuple(int(r) for r in ep_ranks)] = group


def expert_data_group(dp_group, ep_group) -> dist.ProcessGroup:
    """The group of this rank's expert replicas: the ranks of `dp_group` holding the same experts
    as this one (the same position in their expert group). Made by `init_mesh(dp=..., ep=...)`."""
    dp, ep = (tuple(dist.get_process_group_ranks(g)) for g in (dp_group, ep_group))
    if (dp, ep) not in _EXPERT_DATA_GROUPS:
        raise ValueError(
            f"the expert group {list(ep)} and the data-parallel group {list(dp)} do not come from one mesh: make "
            "them with tplayers.init_mesh(dp=..., ep=...) (mesh['dp'], mesh['ep'])"
        )
    return _EXPERT_DATA_GROUPS[dp, ep]


# (data-parallel ranks, context-parallel ranks) -> the group of both: the replicas of this rank's
# weights, which data parallelism reduces gradients over
_CONTEXT_DATA_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def register_context_data_group(dp_ranks, cp_ranks, group: dist.ProcessGroup) -> None:
    """The dp x cp group of this rank (`init_mesh(cp=)`, the test pools' meshes)."""
    _CONTEXT_DATA_GROUPS[tuple(int(r) for r in dp_ranks), tuple(int(r) for r in cp_ranks)] = group


def context_data_group(dp_group, cp_group) -> dist.ProcessGroup:
    """Every replica of this rank's weights: its data-parallel ranks times its context-parallel
    ranks (each holds other tokens of the same weights). Made by `init_mesh(dp=..., cp=...)`."""
    dp, cp = (tuple(dist.get_process_group_ranks(g)) for g in (dp_group, cp_group))
    if len(dp) == 1:
        return cp_group
    if (dp, cp) not in _CONTEXT_DATA_GROUPS:
        raise ValueError(
            f"the context group {list(cp)} and the data-parallel group {list(dp)} do not come from one mesh: make "
            "them with tplayers.init_mesh(dp=..., cp=...) (mesh['dp'], mesh['cp'])"
        )
    return _CONTEXT_DATA_GROUPS[dp, cp]


GRID_AXES = ("tp_r", "tp_c")


def is_grid(group) -> bool:
    """Whether `group` is a 2-D tensor-parallel mesh (`init_mesh(tp=(r, c))["tp_r", "tp_c"]`)."""
    return isinstance(group, DeviceMesh) and group.ndim == 2


def grid_groups(mesh: DeviceMesh) -> dict:
    """{"tp_r": group, "tp_c": group} of a 2-D tensor-parallel mesh, checked."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != GRID_AXES:
        raise ValueError(
            f"a 2-D tensor-parallel mesh has dims {GRID_AXES} (tplayers.init_mesh(tp=(r, c))['tp_r', 'tp_c']), "
            f"got {mesh!r}"
        )
    return {axis: mesh.get_group(axis) for axis in GRID_AXES}


def refuse_grid(group, layer: str, grid_layer: str) -> None:
    """A 1-D layer handed a 2-D mesh: refused, naming the grid's layer (resolve_group would take
    the grid flattened, a different layer than the one asked for)."""
    if is_grid(group):
        raise ValueError(
            f"{layer} splits over a 1-D group, not a 2-D tensor-parallel mesh: on the grid build "
            f"tplayers.nn.{grid_layer} with mesh=<the mesh>"
        )


def resolve_group(group) -> dist.ProcessGroup:
    """A ProcessGroup from `group` (ProcessGroup, 1-D DeviceMesh or None for the default group).
    A 2-D tensor-parallel mesh (`init_mesh(tp=(r, c))["tp_r", "tp_c"]`) gives its every rank, the
    grid flattened: the group a grid model's vocabulary-parallel edges and losses run over."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call tplayers.init_mesh() or launch()")
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim == 2 and tuple(group.mesh_dim_names or ()) == ("tp_r", "tp_c"):
            ranks = tuple(group.mesh.flatten().tolist())
            if ranks not in _GRID_GROUPS:  # a mesh made elsewhere: flattened now (every rank must be here)
                register_grid_group(ranks, group._flatten("tp").get_group())
            return _GRID_GROUPS[ranks]
        if group.ndim != 1:
            raise ValueError(f"group must be a 1-D DeviceMesh, got {group.ndim} dims {group.mesh_dim_names}")
        return group.get_group()
    return group


def _init_cpu_process_group(rank: int, world_size: int, port: int) -> None:
    # torchrun's variables too: libraries that read them (accelerate, HF Trainer) see the same
    # distributed run under `launch` as under torchrun
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=DEFAULT_TIMEOUT,
    )


def init_mesh(*, dp: int = 1, pp: int = 1, cp: int = 1, tp: int | tuple[int, int] = 1, ep: int = 1) -> DeviceMesh:
    """A (dp, pp, tp) DeviceMesh; initialises torch.distributed from torchrun's env vars if needed.

    `cp` > 1: a (dp, pp, cp, tp) mesh, context parallelism between the pipeline and the tensor-
    parallel ranks; `mesh["cp"]` is the group `parallelize(context_group=)` splits the sequence
    over, and the dp x cp group (registered here) is what `data_parallel` reduces gradients over.
    `tp=(r, c)`: a (dp, pp, tp_r, tp_c) mesh, whose `mesh["tp_r", "tp_c"]` is the 2-D
    tensor-parallel grid (`tplayers.nn.GridLinear`).

    `ep`: expert parallelism folded over the data-parallel ranks (`ep` divides `dp`): the mesh's
    dims are then ("edp", "ep", "pp", "tp"), with "dp" their first two flattened; `mesh["ep"]`
    is the expert group (consecutive data-parallel ranks, for `parallelize(expert_group=)`),
    `mesh["edp"]` the replicas of each rank's experts (`data_parallel` reduces expert weights
    over it).

    Called again with the same sizes in the same world, it returns the same mesh: no new process
    groups (each keeps a thread polling its connections, which slows every later collective)."""
    grid = tp if isinstance(tp, tuple) else None
    if grid is not None and len(grid) != 2:
        raise ValueError(f"tp must be an int or a pair (r, c), got {tp!r}")
    for name, size in (("dp", dp), ("pp", pp), ("cp", cp),
                       *((("tp_r", grid[0]), ("tp_c", grid[1])) if grid else (("tp", tp),))):  # fmt: skip
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    if not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(
            f"ep must be a positive int dividing dp ({dp}): expert parallelism folds over the replicas, got {ep!r}"
        )
    if ep > 1 and grid:
        raise ValueError("init_mesh: ep with a 2-D tensor-parallel grid is not supported")
    if cp > 1 and (grid or ep > 1):
        raise ValueError("init_mesh: cp with a 2-D tensor-parallel grid or with ep is not supported")
    tp_size = grid[0] * grid[1] if grid else tp
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != dp * pp * cp * tp_size:
        names, sizes = ("dp*pp*cp*tp", f"{dp}*{pp}*{cp}*{tp_size}") if cp > 1 else ("dp*pp*tp", f"{dp}*{pp}*{tp_size}")
        raise ValueError(f"world size {world_size} != {names} = {sizes} = {dp * pp * cp * tp_size}")
    # One GPU per local rank, or CPU ranks on gloo when there are not enough GPUs for that.
    if dist.is_initialized():
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        device_type = "cuda" if enough_gpus else "cpu"
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "MASTER_ADDR" in os.environ:  # torchrun (or a user) set up the rendezvous
            dist.init_process_group(backend, timeout=DEFAULT_TIMEOUT)
        else:  # a single process started by hand: a private one-rank world
            init = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend, init_method=init, rank=0, world_size=1, timeout=DEFAULT_TIMEOUT)
    # the same sizes again in the same world: the same mesh (torch would make new process groups,
    # and every group's connections keep a thread polling them, which slows every later collective)
    key = (device_type, dp, pp, cp, tp, ep)
    default = dist.distributed_c10d._get_default_group()
    made = _MESHES.get(key)
    if made is not None and made[0] is default:
        return made[1]
    mesh = _new_mesh(device_type, dp, pp, cp, tp, ep)
    _MESHES[key] = (default, mesh)
    return mesh


# (device type, dp, pp, cp, tp, ep) -> (the default group it was made in, the mesh)
_MESHES: dict[tuple, tuple] = {}


def _new_mesh(device_type, dp, pp, cp, tp, ep) -> DeviceMesh:
    grid = tp if isinstance(tp, tuple) else None
    if grid:
        mesh = init_device_mesh(device_type, (dp, pp, *grid), mesh_dim_names=("dp", "pp", "tp_r", "tp_c"))
        # the grid's flattened group (resolve_group) is made by every rank of the world: now, while all are here
        grid = mesh["tp_r", "tp_c"]
        register_grid_group(grid.mesh.flatten().tolist(), grid._flatten("tp").get_group())
        return mesh
    if cp > 1:
        mesh = init_device_mesh(device_type, (dp, pp, cp, tp), mesh_dim_names=("dp", "pp", "cp", "tp"))
        flat = mesh["dp", "cp"]._flatten("dp_cp")  # made by every rank, now
        register_context_data_group(_ranks(mesh["dp"]), _ranks(mesh["cp"]), flat.get_group())
        return mesh
    if ep > 1:
        mesh = init_device_mesh(device_type, (dp // ep, ep, pp, tp), mesh_dim_names=("edp", "ep", "pp", "tp"))
        flat = mesh["edp", "ep"]._flatten("dp")
        register_expert_data_group(_ranks(flat), _ranks(mesh["ep"]), mesh["edp"].get_group())
        return mesh
    return init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


def _ranks(mesh) -> list:
    return dist.get_process_group_ranks(mesh.get_group())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankError(RuntimeError):
    """A rank raised or died; carries the failing rank's traceback."""


# the environment the forkserver started in (it starts once per process); None before
_SERVER_ENV: dict | None = None
_PER_CALL_ENV = ("PYTEST_CURRENT_TEST",)  # set anew by pytest for every test; no import reads it


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _PER_CALL_ENV}


def rank_context(module: str | None = None):
    """Local ranks forked from a server that imported tplayers and `module` once: a fresh
    interpreter per rank, as spawn gives, without every rank importing torch again (seconds per
    rank on a few cores). The server's imports read the environment it started in (TRITON_INTERPRET,
    TPLAYERS_*), so once this process's environment differs from that, ranks are spawned instead."""
    global _SERVER_ENV
    if _SERVER_ENV is None:
        if getattr(forkserver._forkserver, "_forkserver_address", True) is not None:
            return mp.get_context("spawn")  # a server someone else started, in an environment unknown to us
        _SERVER_ENV = _environment()
    elif _SERVER_ENV != _environment():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tplayers"] + ([module] if module and module != "__main__" else []))
    return ctx


def _launch_entry(fn, rank, world_size, port, results, args):
    try:
        torch.set_num_threads(1)
        _init_cpu_process_group(rank, world_size, port)
        # Pickled here, not in the queue's feeder thread, so an unpicklable result is an error
        # with a traceback instead of a lost reply.
        value = pickle.dumps(fn(rank, world_size, *args))
        if dist.is_initialized():  # rank 0 hosts the store: it must not exit while another rank still
            dist.barrier()  # creates groups through it (a rank that failed is reported by the others' parent)
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, nprocs: int, *args, timeout: float | None = None):
    """Run `fn(rank, world_size, *args)` on `nprocs` local CPU ranks (gloo); return each rank's result.

    The ranks are CPU processes on this machine, whatever GPUs it has: the embedded default for
    trying and testing; torchrun and `init_mesh` are the way onto GPUs.

    The first rank to raise or die stops the others at once and its traceback is raised here as
    a RankError, so a failure never leaves the other ranks waiting for a collective.
    `fn` must be picklable (a module-level function).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = rank_context(getattr(fn, "__module__", None))
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_launch_entry, args=(fn, rank, nprocs, port, results, args)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    outputs, deadline = {}, None if timeout is None else time.monotonic() + timeout
    try:
        while len(outputs) < nprocs:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                # Exit code 0 without a reply is a death too (e.g. os._exit(0) inside fn).
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outputs]
                if dead and results.empty():
                    raise RankError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"launch: ranks {sorted(set(range(nprocs)) - set(outputs))} timed out") from None
                continue
            if status == "error":
                raise RankError(f"rank {rank} of {nprocs} failed:\n{value}")
            outputs[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outputs) == nprocs else 0)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(nprocs)]
