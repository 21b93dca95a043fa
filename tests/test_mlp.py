"""SwiGLU kernel vs its reference in the interpreter; ParallelMLP (SwiGLU and GeLU) against the
unsharded nn.Linear block (Llama's down(silu(gate(x)) * up(x)), GPT-2's proj(gelu(fc(x)))):
forward and every gradient, on 1-4 local ranks, both backends, sequence parallel, overlap."""

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import tplayers
from tplayers.nn.mlp import ParallelMLP, fuse_gate_up, unfuse_gate_up
from tplayers.testing import assert_close, assert_shard_close, examples, kernel_device, kernel_generator, shard_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --- the SwiGLU kernel -------------------------------------------------------------------------


def strided_pair(m, n, dtype, layout, gen):
    """Two (m, n) tensors: the halves of one fused (m, 2n) buffer ('fused'), its interleaved
    stride-2 columns as ParallelMLP lays them out ('interleaved': the backward's paired kernel),
    column-major ('transposed'), windows of a larger buffer ('sliced') or 'contiguous'."""
    if layout == "interleaved":
        buf = torch.randn(m, 2 * n, generator=gen).to(dtype)
        return buf[:, 0::2], buf[:, 1::2]
    if layout == "fused":
        buf = torch.randn(m, 2 * n, generator=gen).to(dtype)
        return buf[:, :n], buf[:, n:]
    if layout == "transposed":
        return tuple(torch.randn(n, m, generator=gen).to(dtype).t() for _ in range(2))
    if layout == "sliced":
        return tuple(torch.randn(m + 3, n + 5, generator=gen).to(dtype)[2 : 2 + m, 1 : 1 + n] for _ in range(2))
    return tuple(torch.randn(m, n, generator=gen).to(dtype) for _ in range(2))


@pytest.mark.interpreter
@pytest.mark.kernel
@settings(max_examples=examples(30))
@given(
    m=st.integers(1, 80),
    n=st.integers(1, 80),
    dtype=st.sampled_from(DTYPES),
    in_layout=st.sampled_from(["interleaved", "fused", "transposed", "sliced", "contiguous"]),
    out_layout=st.sampled_from(["interleaved", "fused", "transposed", "sliced", "contiguous", "new"]),
    scale=st.sampled_from([1.0, 8.0]),  # 8: sigmoid saturates (exp overflows in the interpreter)
    seed=st.integers(0, 2**16),
)
def test_swiglu_kernel_matches_reference(m, n, dtype, in_layout, out_layout, scale, seed):
    from tplayers.kernels.swiglu import INTERPRET, swiglu, swiglu_backward, swiglu_backward_ref, swiglu_ref

    assert INTERPRET == (kernel_device() == "cpu")
    gen = kernel_generator(seed)
    gate, up = strided_pair(m, n, dtype, in_layout, gen)
    gate.mul_(scale)  # in place: keeps the layout
    dh = strided_pair(m, n, dtype, "sliced", gen)[0]
    if out_layout == "new":
        h_out = dgate_out = dup_out = None
    else:
        h_out = strided_pair(m, n, dtype, out_layout, gen)[0]
        dgate_out, dup_out = strided_pair(m, n, dtype, out_layout, gen)

    h = swiglu(gate, up, out=h_out)
    dgate, dup = swiglu_backward(dh, gate, up, dgate=dgate_out, dup=dup_out)
    if out_layout != "new":  # written in place, no copies
        assert h is h_out and dgate is dgate_out and dup is dup_out
    assert h.dtype == dgate.dtype == dup.dtype == dtype
    # Both compute in fp32 and round once: the table's tolerance for the dtype.
    assert_close(h, swiglu_ref(gate, up))
    expected_dgate, expected_dup = swiglu_backward_ref(dh, gate, up)
    assert_close(dgate, expected_dgate)
    assert_close(dup, expected_dup)


@pytest.mark.interpreter
@pytest.mark.kernel
@pytest.mark.parametrize("m, n", [(1, 1), (5, 7), (70, 3), (64, 64), (33, 130)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_on_interleaved_pairs(m, n, dtype, monkeypatch):
    """ParallelMLP's layout takes the paired kernel (and only it), with the reference's result."""
    from tplayers.kernels import swiglu as kernels

    launched = []
    real_launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda k, *a, **kw: (launched.append(k), real_launch(k, *a, **kw)))
    gen = kernel_generator(m * 1000 + n)
    gate, up = strided_pair(m, n, dtype, "interleaved", gen)
    dgate, dup = strided_pair(m, n, dtype, "interleaved", gen)
    dh = torch.randn(m, n, generator=gen).to(dtype)
    kernels.swiglu_backward(dh, gate, up, dgate=dgate, dup=dup)
    assert launched == [kernels._swiglu_bwd_pairs_kernel]
    expected_dgate, expected_dup = kernels.swiglu_backward_ref(dh, gate, up)
    assert_close(dgate, expected_dgate)
    assert_close(dup, expected_dup)


def test_swiglu_reference_gradients_match_autograd():
    from tplayers.kernels.swiglu_ref import swiglu_backward_ref, swiglu_ref

    gen = torch.Generator().manual_seed(0)
    gate, up, dh = (torch.randn(17, 23, generator=gen, dtype=torch.float64) * 4 for _ in range(3))
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    h = nn.functional.silu(g) * u
    h.backward(dh)
    assert_close(swiglu_ref(gate.float(), up.float()), h.detach().float())
    dgate, dup = swiglu_backward_ref(dh.float(), gate.float(), up.float())
    assert_close(dgate, g.grad.float())
    assert_close(dup, u.grad.float())
    with pytest.raises(AssertionError):  # negative control: the gradients swapped
        assert_close(dup, g.grad.float())


def test_swiglu_argument_errors():
    from tplayers.kernels.swiglu_ref import swiglu_backward_ref, swiglu_ref

    a = torch.randn(4, 6)
    with pytest.raises(ValueError, match="up has shape"):
        swiglu_ref(a, torch.randn(4, 5))
    with pytest.raises(TypeError, match="up is torch.float16"):
        swiglu_ref(a, a.half())
    with pytest.raises(TypeError, match="fp32/fp16/bf16"):
        swiglu_ref(a.long(), a.long())
    with pytest.raises(ValueError, match="dgate must have shape"):
        swiglu_backward_ref(a, a, a, dgate=torch.empty(4, 5))


def test_fused_gate_up_layout():
    """Rank r's slice of the fused weight in whole pairs interleaves its rows of gate and of up
    row by row (so each GEMM output tile pairs gate and up columns), also where F does not divide
    by n (12 over 5: 3, 3, 3, 3, 0 pairs), and unfusing inverts it."""
    F, H = 12, 5
    gate, up = torch.randn(F, H), torch.randn(F, H)
    fused = fuse_gate_up(gate, up)
    for n in (1, 2, 3, 4, 5):
        for r in range(n):
            rows = shard_of(torch.arange(F), 0, r, n)  # torch.chunk's split: a reference from outside
            start, size = (int(rows[0]) if rows.numel() else 0), rows.numel()
            shard = fused[2 * start : 2 * (start + size)]
            assert torch.equal(shard[0::2], shard_of(gate, 0, r, n)) and torch.equal(shard[1::2], shard_of(up, 0, r, n))
    back = unfuse_gate_up(fused)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)
    with pytest.raises(ValueError, match="needs an even number of rows"):
        unfuse_gate_up(fused[:-1])


# --- ParallelMLP against the unsharded block ---------------------------------------------------


@dataclass(frozen=True)
class MLPCase:
    batch: int
    seq_per_rank: int
    hidden: int
    ffn_per_rank: int
    activation: str = "swiglu"
    dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    bias: bool = False
    overlap: bool | str = "auto"
    backend: str = "torch"
    wrong_layout: bool = False  # negative control: gate|up fused as a plain concatenation
    seed: int = 0
    ffn: int | None = None  # a width that does not divide (ffn_per_rank is then its ceil-share)


def run_mlp(rank, tp, group, case: MLPCase):
    """One rank's check against the unsharded block; raises on any mismatch."""
    tplayers.set_backend(case.backend)
    if case.backend == "triton":  # the kernels themselves run, in the interpreter, not the references
        from tplayers.kernels import swiglu

        assert swiglu.INTERPRET
    torch.manual_seed(case.seed)
    S, H, dt = case.seq_per_rank * tp, case.hidden, case.dtype
    F = case.ffn if case.ffn is not None else case.ffn_per_rank * tp
    gated = case.activation == "swiglu"
    ins = [nn.Linear(H, F, bias=case.bias, dtype=dt) for _ in range(1 + gated)]
    down = nn.Linear(F, H, bias=case.bias, dtype=dt)
    x, dy = torch.randn(case.batch, S, H, dtype=dt), torch.randn(case.batch, S, H, dtype=dt)

    x_ref = x.clone().requires_grad_(True)
    if gated:  # Llama's MLP
        y_ref = down(nn.functional.silu(ins[0](x_ref)) * ins[1](x_ref))
    else:
        approximate = "tanh" if case.activation == "gelu_tanh" else "none"
        y_ref = down(nn.functional.gelu(ins[0](x_ref), approximate=approximate))
    y_ref.backward(dy)

    kw = dict(group=group, sequence_parallel=case.sequence_parallel, overlap=case.overlap)
    if gated:
        mlp = ParallelMLP.from_modules(*ins, down, **kw)
    else:
        mlp = ParallelMLP.from_linears(*ins, down, activation=case.activation, **kw)
    if case.wrong_layout:
        wrong = nn.Linear(H, 2 * F, bias=case.bias, dtype=dt)
        with torch.no_grad():
            wrong.weight.copy_(torch.cat([ins[0].weight, ins[1].weight]))
            if case.bias:
                wrong.bias.copy_(torch.cat([ins[0].bias, ins[1].bias]))
        mlp.in_proj = tplayers.ColumnParallelLinear.from_linear(wrong, **kw)

    sp = case.sequence_parallel
    seq_dim = 1 if sp else None
    x_local = (x.chunk(tp, 1)[rank] if sp else x).clone().requires_grad_(True)
    y = mlp(x_local)
    y.backward(dy.chunk(tp, 1)[rank] if sp else dy)

    shard = dict(rank=rank, num_shards=tp)
    assert_shard_close(y, y_ref.detach(), dim=seq_dim, **shard, msg=lambda m: f"output: {m}")
    assert_shard_close(x_local.grad, x_ref.grad, dim=seq_dim, **shard, msg=lambda m: f"input grad: {m}")
    # Every gradient, through the fused shard's interleaved rows (gate even, up odd): rank r's
    # slice of the unsharded gradient.
    names = ["gate", "up"] if gated else ["fc"]
    for i, (name, lin) in enumerate(zip(names, ins, strict=True)):
        rows = slice(i, None, len(names))
        assert_shard_close(
            mlp.in_proj.weight.grad[rows], lin.weight.grad, dim=0, **shard, msg=lambda m, name=name: f"{name}: {m}"
        )
        if case.bias:
            assert_shard_close(
                mlp.in_proj.bias.grad[rows], lin.bias.grad, dim=0, **shard, msg=lambda m, name=name: f"{name}: {m}"
            )
    assert_shard_close(mlp.out_proj.weight.grad, down.weight.grad, dim=1, **shard, msg=lambda m: f"down: {m}")
    if case.bias:
        assert_shard_close(mlp.out_proj.bias.grad, down.bias.grad, dim=None, **shard, msg=lambda m: f"down: {m}")

    # The exported shards are exactly the unsharded modules' slices, with their placements.
    unsharded = dict(zip([f"{n}_proj" if gated else n for n in names], ins, strict=True))
    unsharded["down_proj" if gated else "proj"] = down
    placements = {n: tplayers.get_placement(p).placement for n, p in mlp.named_parameters()}
    assert placements["in_proj.weight"] == Shard(0) and placements["out_proj.weight"] == Shard(1)
    for name, (tensor, placement) in mlp.unfused_shards().items():
        module, param = name.rsplit(".", 1)
        full = getattr(unsharded[module], param).detach()
        dim = placement.dim if isinstance(placement, Shard) else None
        assert_shard_close(tensor, full, dim=dim, **shard, exact=True, msg=lambda m, name=name: f"export {name}: {m}")
    return mlp.out_proj.bias.grad if case.bias else None


def check_mlp(pool, tp, case):
    bias_grads = pool.run(run_mlp, tp, case)
    if case.bias:  # replicated: the same on every rank, bit for bit
        for g in bias_grads[1:]:
            assert torch.equal(g, bias_grads[0])


@st.composite
def mlp_cases(draw, max_hidden, max_ffn_per_rank, backend):
    tp = draw(st.integers(1, 4))
    ffn_per_rank = draw(st.integers(1, max_ffn_per_rank))
    case = MLPCase(
        batch=draw(st.integers(1, 2)),
        seq_per_rank=draw(st.integers(1, 3)),
        hidden=draw(st.integers(1, max_hidden)),
        ffn_per_rank=ffn_per_rank,
        ffn=draw(st.one_of(st.none(), st.integers(1, ffn_per_rank * tp))),  # any width: uneven, under tp
        activation=draw(st.sampled_from(["swiglu", "swiglu", "gelu", "gelu_tanh"])),
        dtype=draw(st.sampled_from(DTYPES)),
        sequence_parallel=draw(st.booleans()),
        bias=draw(st.booleans()),
        overlap=draw(st.sampled_from(["auto", True, False])),
        backend=backend,
        seed=draw(st.integers(0, 2**16)),
    )
    return tp, case


@pytest.mark.multirank
@settings(max_examples=examples(30))
@given(mlp_cases(32, 10, "torch"))
def test_mlp_matches_unsharded_torch_backend(pool, tp_case):
    check_mlp(pool, *tp_case)


@pytest.mark.multirank
@pytest.mark.interpreter
@settings(max_examples=examples(12))
@given(mlp_cases(10, 5, "triton"))
def test_mlp_matches_unsharded_triton_backend(pool, tp_case):
    check_mlp(pool, *tp_case)


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("width", ["even", "uneven"])
def test_swiglu_mlp_every_tp_size(pool, tp, sequence_parallel, width):
    """uneven: 2 tp + 1 = 5, 7, 9 features in whole gate / up pairs: [3, 2], [3, 3, 1], [3, 3, 3, 0]."""
    case = MLPCase(batch=2, seq_per_rank=2, hidden=9, ffn_per_rank=3, bias=True, sequence_parallel=sequence_parallel,
                   ffn=2 * tp + 1 if width == "uneven" else None)  # fmt: skip
    check_mlp(pool, tp, case)


@pytest.mark.multirank
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_negative_control_wrong_gate_up_layout_fails(pool, sequence_parallel):
    case = MLPCase(batch=2, seq_per_rank=2, hidden=8, ffn_per_rank=4, sequence_parallel=sequence_parallel)
    with pytest.raises(tplayers.RankError, match="Tensor-likes are not"):
        check_mlp(pool, 2, replace(case, wrong_layout=True))
    check_mlp(pool, 2, case)  # and the pool still works


def run_seeded_init(rank, tp, group, activation, bias):
    """ParallelMLP(H, F) under a seed holds the shards of the nn.Linear modules drawn under it."""
    H, F = 6, 4 * tp
    torch.manual_seed(7)
    mlp = ParallelMLP(H, F, activation=activation, bias=bias, group=group)
    torch.manual_seed(7)
    gated = activation == "swiglu"
    linears = [nn.Linear(H, F, bias=bias) for _ in range(1 + gated)] + [nn.Linear(F, H, bias=bias)]
    names = ["gate_proj", "up_proj", "down_proj"] if gated else ["fc", "proj"]
    shards = mlp.unfused_shards()
    for name, lin in zip(names, linears, strict=True):
        for param in ("weight", "bias") if bias else ("weight",):
            tensor, placement = shards[f"{name}.{param}"]
            dim = placement.dim if isinstance(placement, Shard) else None
            assert placement == Replicate() or dim is not None
            assert_shard_close(tensor, getattr(lin, param).detach(), dim=dim, rank=rank, num_shards=tp, exact=True)
    for p in mlp.parameters():
        assert tplayers.get_placement(p).group is group


def run_errors(rank, tp, group):
    with pytest.raises(ValueError, match="activation must be one of"):
        ParallelMLP(8, 8, activation="relu", group=group)
    mlp = ParallelMLP(8, 8, group=group, sequence_parallel=True)
    with pytest.raises(ValueError, match="does not match the layer's 8"):
        mlp(torch.randn(1, 2, 7))
    with pytest.raises(TypeError, match="does not match the weight dtype"):
        mlp(torch.randn(1, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="builds a GeLU MLP"):
        ParallelMLP.from_linears(nn.Linear(8, 8), nn.Linear(8, 8), activation="swiglu", group=group)


@pytest.mark.multirank
@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("swiglu", True), ("gelu_tanh", True)])
def test_seeded_init_matches_unsharded_modules(pool, activation, bias):
    pool.run(run_seeded_init, 3, activation, bias)


@pytest.mark.multirank
def test_bad_input_raises_on_every_rank_before_collectives(pool):
    pool.run(run_errors, 4)


def run_llama_mlp(rank, tp, group):
    """The real HF LlamaMLP, loaded from its gate_proj / up_proj / down_proj."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        hidden_size=12,
        intermediate_size=8 * tp,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_act="silu",
        mlp_bias=True,
    )
    ref = LlamaMLP(config)
    mlp = ParallelMLP.from_modules(ref.gate_proj, ref.up_proj, ref.down_proj, group=group)
    x = torch.randn(2, 5, 12)
    x_ref, x_local = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref(x_ref).sum().backward()
    mlp(x_local).sum().backward()
    assert_close(x_local.grad, x_ref.grad)
    assert_shard_close(mlp.in_proj.weight.grad[1::2], ref.up_proj.weight.grad, dim=0, rank=rank, num_shards=tp)
    assert_shard_close(mlp.in_proj.weight.grad[0::2], ref.gate_proj.weight.grad, dim=0, rank=rank, num_shards=tp)


@pytest.mark.multirank
def test_hf_llama_mlp(pool):
    pool.run(run_llama_mlp, 2)
