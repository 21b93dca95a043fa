"""2-D tensor parallelism (tplayers.nn.GridLinear): a column-type / row-type pair over tp_r x tp_c
grids (2, 2), (1, 4), (4, 1), with and without bias, square and not, sizes that do not divide,
against the unsharded pair: output, every gradient, and every parameter after clipped steps;
bytes per axis; negative controls."""

import pytest
import torch
from torch import nn

import tplayers
from tplayers.functional.collectives import gather_from_tp_region
from tplayers.plan.grid import grid_mlp_bytes
from tplayers.testing import RemoteError, assert_close, logits_of, shard_of

pytestmark = pytest.mark.multirank

GRIDS = [(2, 2), (1, 4), (4, 1)]


def own_slice(t, dim, group, unit=1):
    """This rank's slice as torch.chunk splits it (`shard_of`): the reference, not the library's split."""
    return shard_of(t, dim, torch.distributed.get_rank(group), torch.distributed.get_world_size(group), unit)


def pair(hidden, ffn, bias):
    torch.manual_seed(0)
    return nn.Linear(hidden, ffn, bias=bias), nn.Linear(ffn, hidden, bias=bias)


def block(first, second, x):
    return second(nn.functional.gelu(first(x)))


def grid_pair(rank, world, group, grid, hidden, ffn, bias, swap=False, steps=2, overlap="auto", sp=False):
    """The pair over the grid: x split along the features over tp_c (and along the sequence over
    tp_r with `sp`), the output gathered back; `steps` SGD steps clipped at 0.5 on both sides."""
    mesh = tplayers.init_mesh(tp=grid)["tp_r", "tp_c"]
    groups = {axis: mesh.get_group(axis) for axis in ("tp_r", "tp_c")}
    ref_first, ref_second = pair(hidden, ffn, bias)
    axes = ("tp_c", "tp_r") if swap else ("tp_r", "tp_c")  # the negative control swaps them
    kw = dict(mesh=mesh, overlap=overlap, sequence_parallel=sp)
    first = tplayers.nn.GridLinear.from_linear(ref_first, out_axis=axes[0], **kw)
    second = tplayers.nn.GridLinear.from_linear(ref_second, out_axis=axes[1], **kw)
    seq = 8 if sp else 5
    x = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(2))
    # this rank's part of the residual stream: features over tp_c, the sequence over tp_r with sp
    local = (lambda t: own_slice(own_slice(t, 1, groups["tp_r"]), -1, groups["tp_c"])) if sp else (
        lambda t: own_slice(t, -1, groups["tp_c"]))  # fmt: skip

    def gathered(y):
        y = gather_from_tp_region(y, groups["tp_c"], dim=-1, total=hidden)
        return gather_from_tp_region(y, groups["tp_r"], dim=1) if sp else y

    params, ref_params = (
        [*first.parameters(), *second.parameters()],
        [*ref_first.parameters(), *ref_second.parameters()],
    )
    opt, ref_opt = torch.optim.SGD(params, lr=0.3), torch.optim.SGD(ref_params, lr=0.3)
    for _ in range(steps):
        x_local = local(x).detach().clone().requires_grad_()
        ref_x = x.clone().requires_grad_()
        out = gathered(block(first, second, x_local))
        ref_out = block(ref_first, ref_second, ref_x)
        assert_close(out, ref_out, msg=lambda m: f"output: {m}")
        (out * weights).sum().backward()
        (ref_out * weights).sum().backward()
        assert_close(x_local.grad, local(ref_x.grad), msg=lambda m: f"input grad: {m}")
        for layer, ref, out_axis in ((first, ref_first, "tp_r"), (second, ref_second, "tp_c")):
            in_axis = "tp_c" if out_axis == "tp_r" else "tp_r"
            expected = own_slice(own_slice(ref.weight.grad, 0, groups[out_axis]), 1, groups[in_axis])
            assert_close(layer.weight.grad, expected, msg=lambda m: f"weight grad: {m}")
            if bias:
                assert_close(layer.bias.grad, own_slice(ref.bias.grad, 0, groups[out_axis]), msg=lambda m: f"{m}")
        norm = tplayers.clip_grad_norm_(params, 0.5)
        ref_norm = nn.utils.clip_grad_norm_(ref_params, 0.5)
        assert_close(norm, ref_norm, msg=lambda m: f"clipped norm: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for layer, ref, out_axis in ((first, ref_first, "tp_r"), (second, ref_second, "tp_c")):
        in_axis = "tp_c" if out_axis == "tp_r" else "tp_r"
        expected = own_slice(own_slice(ref.weight.detach(), 0, groups[out_axis]), 1, groups[in_axis])
        assert_close(layer.weight.detach(), expected, msg=lambda m: f"weight after the steps: {m}")
    return True


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize(("hidden", "ffn", "bias", "sp"), [(8, 12, True, False), (12, 8, False, False),
                         (10, 7, True, False), (8, 12, True, True), (10, 7, False, True)],
                         ids=["wide", "narrow", "uneven", "wide-sp", "uneven-sp"])  # fmt: skip
def test_a_grid_pair_matches_the_unsharded_pair(pool, grid, hidden, ffn, bias, sp):
    """Column-type then row-type with a GeLU between, no re-layout: output, input / weight / bias
    gradients, the clipped global norm and the weights after two clipped SGD steps; with `sp`
    the sequence split over tp_r (gathered by the first, reduce-scattered by the second)."""
    assert all(pool.run(grid_pair, 4, grid, hidden, ffn, bias, False, 2, "auto", sp))


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sp"])
def test_swapping_the_axes_fails_the_comparison(pool, sp):
    """The negative control: the same shapes on a 2 x 2 grid, the two axes' groups swapped."""
    for reply in pool.run(grid_pair, 4, (2, 2), 8, 8, True, True, 2, "auto", sp, return_exceptions=True):
        assert isinstance(reply, RemoteError) and "Tensor-likes are not close" in str(reply), reply


def grid_bytes(rank, world, group, grid, hidden, ffn, tokens):
    mesh = tplayers.init_mesh(tp=grid)["tp_r", "tp_c"]
    first, second = pair(hidden, ffn, False)
    first = tplayers.nn.GridLinear.from_linear(first, mesh=mesh, out_axis="tp_r")
    second = tplayers.nn.GridLinear.from_linear(second, mesh=mesh, out_axis="tp_c")
    x = torch.randn(1, tokens, first.in_features_per_rank, requires_grad=True)
    with tplayers.count_bytes() as sent:
        block(first, second, x).sum().backward()
    return sent.total()


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_bytes_per_axis_are_the_grid_formula(pool, grid):
    """A pair of T tokens: forward all-reduces T x ffn / r over tp_c and T x hidden / c over
    tp_r; backward the input gradients, T x hidden / c over tp_r (the first layer's) and
    T x ffn / r over tp_c (the second's): 2 (n-1)/n x 4 bytes each; the planner's
    `grid_mlp_bytes` gives the same."""
    r, c = grid
    hidden, ffn, tokens = 8, 16, 6
    expected = 2 * (
        2 * (c - 1) / c * tokens * ffn / r * 4  # first layer's output / second layer's input grad, over tp_c
        + 2 * (r - 1) / r * tokens * hidden / c * 4  # second layer's output / first layer's input grad, over tp_r
    )
    planned = grid_mlp_bytes(tokens, hidden, ffn, r, c, 4, gated=False)
    assert sum(planned.values()) == expected, planned
    for total in pool.run(grid_bytes, 4, grid, hidden, ffn, tokens):
        assert total == expected, (total, expected)


def grid_on_a_line(rank, world, group):
    tplayers.nn.GridLinear(4, 4, mesh=tplayers.init_mesh(tp=4)["tp"])


def test_a_mesh_that_is_not_a_grid_is_refused(pool):
    for reply in pool.run(grid_on_a_line, 4, return_exceptions=True):
        assert "a 2-D tensor-parallel mesh has dims ('tp_r', 'tp_c')" in str(reply), reply


def mlp_on_grid(rank, world, group, grid, activation, sp=False):
    """ParallelMLP handed the 2-D mesh: a GridLinear pair (gate / up pairs kept together over
    tp_r), equal to the unsharded MLP (`sp`: the sequence split over tp_r too); GridLinear built
    by its own class either way."""
    mesh = tplayers.init_mesh(tp=grid)["tp_r", "tp_c"]
    row, col = mesh.get_group("tp_r"), mesh.get_group("tp_c")
    torch.manual_seed(0)
    gate, up, down = nn.Linear(8, 10, bias=False), nn.Linear(8, 10, bias=False), nn.Linear(10, 8, bias=False)
    if activation == "swiglu":
        mlp = tplayers.nn.ParallelMLP.from_modules(gate, up, down, group=mesh, sequence_parallel=sp)
        ref = down(nn.functional.silu(gate(X)) * up(X))
    else:
        mlp = tplayers.nn.ParallelMLP.from_linears(gate, down, activation="gelu", group=mesh, sequence_parallel=sp)
        ref = down(nn.functional.gelu(gate(X)))
    x_local = own_slice(own_slice(X, 1, row) if sp else X, -1, col).detach().clone().requires_grad_()
    out = gather_from_tp_region(mlp(x_local), col, dim=-1, total=8)
    out = gather_from_tp_region(out, row, dim=1) if sp else out
    assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    full = (
        gate.weight.grad if activation != "swiglu" else torch.stack((gate.weight.grad, up.weight.grad), 1).flatten(0, 1)
    )
    expected = own_slice(own_slice(full, 0, mesh.get_group("tp_r"), 2 if activation == "swiglu" else 1), 1, col)
    assert_close(mlp.in_proj.weight.grad, expected)
    column = tplayers.nn.GridLinear(8, 6, mesh=mesh)
    row = tplayers.nn.GridLinear.from_linear(nn.Linear(6, 8), mesh=mesh, out_axis="tp_c")
    assert (column.out_axis, row.out_axis) == ("tp_r", "tp_c")
    return True


X = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(("activation", "sp"), [("swiglu", False), ("gelu", False), ("swiglu", True)],
                         ids=["swiglu", "gelu", "swiglu-sp"])  # fmt: skip
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_parallel_mlp_takes_a_grid(pool, grid, activation, sp):
    assert all(pool.run(mlp_on_grid, 4, grid, activation, sp))


def one_dimensional_class_on_a_grid(rank, world, group, which):
    mesh = tplayers.init_mesh(tp=(2, 2))["tp_r", "tp_c"]
    if which == "column":
        tplayers.ColumnParallelLinear(8, 8, group=mesh)
    elif which == "row":
        tplayers.RowParallelLinear.from_linear(nn.Linear(8, 8), group=mesh)
    else:
        tplayers.ParallelAttention(16, 4, group=mesh)


@pytest.mark.parametrize(
    ("which", "grid_class"),
    [("column", "GridLinear(..., out_axis='tp_r')"), ("row", "GridLinear(..., out_axis='tp_c')"),
     ("attention", "GridAttention")],
)  # fmt: skip
def test_a_1d_class_handed_a_grid_refuses_naming_the_grid_class(pool, which, grid_class):
    """A class is what it says: handed a 2-D mesh, a 1-D layer refuses (it would otherwise split over
    the grid flattened, a different layer), naming the grid class to build instead."""
    for reply in pool.run(one_dimensional_class_on_a_grid, 4, which, return_exceptions=True):
        assert isinstance(reply, RemoteError) and f"tplayers.nn.{grid_class} with mesh=" in str(reply), reply


# -- an HF model on the grid ----------------------------------------------------------------------
def hf_on_grid(rank, world, group, family, grid, zero_stage=None, sp=False, norms_over=None):
    """A tiny Llama-style model through parallelize(group=2-D mesh): the state dict round trip,
    logits, loss, every gradient and every parameter after two clipped AdamW steps equal to the
    unsharded model's (and with ZeRO-3 over dp, and the sequence split over tp_r, when asked)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import VOCAB, tiny_model

    dp = 1 if zero_stage is None else 2
    full_mesh = tplayers.init_mesh(dp=dp, tp=grid)
    mesh = full_mesh["tp_r", "tp_c"]
    config = dict(num_key_value_heads=4) if grid[0] == 4 else {}  # 2 key/value heads leave 2 of 4 rows none
    reference = tiny_model(family, **config)
    model = tplayers.parallelize(tiny_model(family, **config), group=mesh, sequence_parallel=sp)
    for module in model.modules():  # the negative control (only) sums the norms' gradients over another axis
        if sp and norms_over is not None and isinstance(module, tplayers.ParallelRMSNorm):
            module.sequence_group = mesh.get_group(norms_over)
    state = tplayers.gather_state_dict(model)
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert_close(state[key], value, exact=True, msg=lambda m, k=key: f"{k}: {m}")
    replica = full_mesh["dp"].get_local_rank() if zero_stage is not None else 0
    length = 7 if sp else 8  # under sequence parallelism parts of different lengths (4, 3 / 2, 2, 2, 1 over tp_r)
    ids = torch.randint(3, VOCAB, (2 * dp, length), generator=torch.Generator().manual_seed(1))
    if zero_stage is not None:
        tplayers.data_parallel(model, group=full_mesh["dp"], zero_stage=zero_stage)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        mine = ids[2 * replica : 2 * replica + 2]
        out, ref_out = model(mine, labels=mine), reference(ids, labels=ids)
        if zero_stage is None:
            assert_close(logits_of(model, out, mine), ref_out.logits, msg=lambda m: f"logits: {m}")
        out.loss.backward()
        ref_out.loss.backward()
        if zero_stage is None:
            grads, expected = tplayers.hf.gather_grads(model), {k: p.grad for k, p in reference.named_parameters()}
            for key, value in expected.items():
                assert_close(grads[key], value, msg=lambda m, k=key, s=step: f"{k} grad, step {s}: {m}")
        norm = tplayers.clip_grad_norm_(model.parameters(), 0.5)
        ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        assert_close(norm, ref_norm, msg=lambda m: f"clipped norm: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    state = tplayers.gather_state_dict(model)
    for key, value in reference.state_dict().items():
        assert_close(state[key], value, msg=lambda m, k=key: f"{k} after two steps: {m}")
    return True


@pytest.mark.parametrize(("family", "sp"), [("llama", False), ("qwen2", False), ("llama", True), ("qwen2", True)],
                         ids=["llama", "qwen2-bias", "llama-sp", "qwen2-bias-sp"])  # fmt: skip
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_an_hf_model_on_a_grid_matches_unsharded(pool, family, sp, grid):
    assert all(pool.run(hf_on_grid, grid[0] * grid[1], family, grid, None, sp))


def test_norm_gradients_summed_over_the_wrong_axis_fail_the_comparison(pool):
    """The negative control of sequence sharding on a grid: the norms' weight gradients summed over
    tp_c instead of tp_r (the axis the sequence is split over)."""
    for reply in pool.run(hf_on_grid, 4, "llama", (2, 2), None, True, "tp_c", return_exceptions=True):
        assert isinstance(reply, RemoteError) and "layernorm.weight grad, step 0" in str(reply), reply


def short_sequence_on_a_grid(rank, world, group):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import tiny_model

    mesh = tplayers.init_mesh(tp=(4, 1))["tp_r", "tp_c"]
    model = tplayers.parallelize(tiny_model("llama", num_key_value_heads=4), group=mesh, sequence_parallel=True)
    model(torch.ones(1, 3, dtype=torch.long))


def test_a_sequence_shorter_than_tp_r_is_refused_on_every_rank(pool):
    for reply in pool.run(short_sequence_on_a_grid, 4, return_exceptions=True):
        assert isinstance(reply, RemoteError) and "no sequence (dimension 1) of at least 4 tokens" in str(reply)


@pytest.mark.tplayers
@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sp"])
def test_a_grid_with_zero3_over_the_replicas_matches_unsharded(tplayers_pool, sp):
    """3-D: a 2 x 2 grid x DP 2 with ZeRO-3 over the replicas (8 ranks): loss, clipped norm and
    every parameter after two clipped steps equal to the unsharded model on the whole batch
    (with and without the sequence split over tp_r)."""
    assert all(tplayers_pool.run(hf_on_grid, 8, "llama", (2, 2), 3, sp))


def checkpoints_across(rank, world, group, path):
    """Model and AdamW state saved on the 2 x 2 grid load at 1-D TP 4 (and the reverse): the same
    full state, and the next step equal on both sides."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import VOCAB, tiny_model

    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss_fn(model, batch):
        return model(batch, labels=batch).loss

    def build(layout):
        model = tplayers.parallelize(tiny_model("llama"), group=layout)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)

    grid = tplayers.init_mesh(tp=(2, 2))["tp_r", "tp_c"]
    models = {"grid": build(grid), "line": build(group)}
    for model, opt in models.values():
        tplayers.train_step(model, opt, [ids], loss_fn)
    for source, target in (("grid", "line"), ("line", "grid")):
        tplayers.save_checkpoint(path / source, model=models[source][0], optimizer=models[source][1])
        fresh = build(grid if target == "grid" else group)
        tplayers.load_checkpoint(path / source, model=fresh[0], optimizer=fresh[1])
        expected, got = tplayers.gather_state_dict(models[source][0]), tplayers.gather_state_dict(fresh[0])
        for key, value in expected.items():
            assert_close(got[key], value, exact=True, msg=lambda m, k=key, s=source: f"from the {s} {k}: {m}")
        for model, opt in (models[source], fresh):
            tplayers.train_step(model, opt, [ids], loss_fn)
        expected, got = tplayers.gather_state_dict(models[source][0]), tplayers.gather_state_dict(fresh[0])
        for key, value in expected.items():
            assert_close(got[key], value, msg=lambda m, k=key, s=source: f"from the {s}, a step on, {k}: {m}")
    return True


def test_checkpoints_move_between_the_grid_and_1d(pool, tmp_path):
    assert all(pool.run(checkpoints_across, 4, tmp_path))


def split_grid_model(rank, world, group):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import tiny_model

    model = tplayers.parallelize(tiny_model("llama"), group=tplayers.init_mesh(tp=(2, 2))["tp_r", "tp_c"])
    tplayers.pipeline_split(model)


def test_stages_over_the_grids_own_ranks_are_refused(pool):
    """pipeline_split over the ranks that hold the grid's shards (the world here) is refused by
    the grid's flattened group in the records, before anything is split."""
    for reply in pool.run(split_grid_model, 4, return_exceptions=True):
        assert isinstance(reply, RemoteError) and "the pipeline group" in str(reply), reply


def grid_model_bytes(rank, world, group, grid, sp=False):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_families import VOCAB, tiny_model

    config = dict(num_key_value_heads=4) if grid[0] == 4 else {}
    mesh = tplayers.init_mesh(tp=grid)["tp_r", "tp_c"]
    model = tplayers.parallelize(tiny_model("llama", **config), group=mesh, vocab_parallel_logits=True,
                                 sequence_parallel=sp)  # fmt: skip
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with tplayers.count_bytes() as sent:
        logits = model(ids[:, :-1]).logits
        tplayers.vocab_parallel_cross_entropy(logits, ids[:, 1:], group=mesh, vocab_size=VOCAB).backward()
    by_axis = sent.by_axis()
    return sent.total(), by_axis["tp"]


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_the_planner_prices_a_grid_model_exactly(pool, grid, sp):
    """One forward + backward of the tiny Llama (2 layers, 2 x 8 tokens, vocabulary-parallel
    logits and loss) on the grid sends what `plan.estimate` says for Layout(tp=grid): the
    blocks' bytes per axis (`grid_tp_bytes_per_layer`), the entry / exit gathers and the
    vocabulary-parallel edges over the whole grid; with the sequence split over tp_r too."""
    from tplayers import plan

    r, c = grid
    spec = plan.ModelSpec(layers=2, hidden=32, heads=4, kv_heads=4 if r == 4 else 2, head_dim=8, ffn_hidden=64,
                          vocab=96, seq_len=8, max_positions=64)  # fmt: skip
    layout = plan.Layout(tp=grid, micro_batch=2, sequence_parallel=sp)
    est = plan.estimate(spec, plan.ClusterSpec.preset("h100", num_gpus=4), layout,
                        "fp32-adam", assumptions=plan.Assumptions(implementation="tplayers"))  # fmt: skip
    planned = est.comm_bytes_by_group["tp"]
    assert planned == sum(est.comm_bytes_by_axis.values())
    for total, tp in pool.run(grid_model_bytes, 4, grid, sp):
        assert total == tp == planned, (total, planned, est.comm_bytes_by_axis)


def grid_attention_and_norm(rank, world, group, grid, num_heads, num_kv_heads, padding, sp=False):
    """GridAttention / ParallelRMSNorm / VocabParallelEmbedding built on the grid against HF's
    LlamaAttention, an unsharded RMSNorm and nn.Embedding: outputs, input and every weight gradient
    (`sp`: the sequence split over tp_r as well)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_attention import AttnCase, hf_attention, padding_mask
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.manual_seed(0)  # the same reference weights on every rank
    mesh = tplayers.init_mesh(tp=grid)["tp_r", "tp_c"]
    groups = {axis: mesh.get_group(axis) for axis in ("tp_r", "tp_c")}
    case = AttnCase(num_heads, num_kv_heads, hidden_per_head=4, bias=True, padding=padding)
    config, ref = hf_attention(case)
    H, S = config.hidden_size, 8 if sp else 6
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, S, H, generator=g), torch.randn(2, S, H, generator=g)
    mask = None if padding == "none" else padding_mask(case, S, g)
    x_ref = x.clone().requires_grad_()
    pos = torch.arange(S)[None]
    ref(x_ref, position_embeddings=LlamaRotaryEmbedding(config)(x_ref, pos),
        attention_mask=create_causal_mask(config, x_ref, mask, None, position_ids=pos))[0].backward(dy)  # fmt: skip
    layer = tplayers.nn.GridAttention.from_hf_llama(ref, mesh=mesh, sequence_parallel=sp)

    def local(t):  # this rank's part of the residual stream
        return own_slice(own_slice(t, 1, groups["tp_r"]) if sp else t, -1, groups["tp_c"])

    x_mine = local(x).clone().requires_grad_()
    y = layer(x_mine, attention_mask=mask)
    y.backward(local(dy))
    y_ref = ref(x, position_embeddings=LlamaRotaryEmbedding(config)(x, pos),
                attention_mask=create_causal_mask(config, x, mask, None, position_ids=pos))[0]  # fmt: skip
    assert_close(y.detach(), local(y_ref.detach()), msg=lambda m: f"output: {m}")
    assert_close(x_mine.grad, local(x_ref.grad), msg=lambda m: f"input grad: {m}")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        mine, theirs = getattr(layer, name), getattr(ref, name)
        expected = own_slice(own_slice(theirs.weight.grad, 0, mine.out_group, mine.out_unit), 1, mine.in_group,
                             mine.in_unit)  # fmt: skip
        assert_close(mine.weight.grad, expected, msg=lambda m, n=name: f"{n} weight grad: {m}")
        bias = own_slice(theirs.bias.grad, 0, mine.out_group, mine.out_unit)
        assert_close(mine.bias.grad, bias, msg=lambda m, n=name: f"{n} bias grad: {m}")

    weight = torch.rand(H, generator=g) + 0.5
    norm = tplayers.ParallelRMSNorm.from_weight(weight, 1e-6, group=mesh, sequence_parallel=sp)
    ref_norm = nn.RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        ref_norm.weight.copy_(weight)
    x_ref = x.clone().requires_grad_()
    ref_norm(x_ref).backward(dy)
    x_mine = local(x).clone().requires_grad_()
    out = norm(x_mine)
    out.backward(local(dy))
    assert_close(out.detach(), local(ref_norm(x).detach()), msg=lambda m: f"norm: {m}")
    assert_close(x_mine.grad, local(x_ref.grad), msg=lambda m: f"norm input grad: {m}")
    assert_close(norm.weight.grad, own_slice(ref_norm.weight.grad, 0, groups["tp_c"]), msg=lambda m: f"{m}")

    table = nn.Embedding(11, H)
    embedding = tplayers.VocabParallelEmbedding.from_embedding(table, group=mesh)  # over all r x c ranks
    ids = torch.randint(0, 11, (2, S), generator=g)
    assert embedding.tp_size == world
    embedding(ids).backward(dy)
    table(ids).backward(dy)
    assert_close(embedding.weight.grad, own_slice(table.weight.grad, 0, embedding.group), msg=lambda m: f"{m}")
    return True


@pytest.mark.parametrize(
    ("grid", "heads", "kv_heads", "padding", "sp"),
    [((2, 2), 4, 2, "none", False), ((1, 4), 2, 1, "right", False), ((4, 1), 8, 4, "left", False),
     ((2, 2), 6, 2, "none", False), ((2, 2), 4, 2, "right", True), ((4, 1), 8, 4, "left", True)],
    ids=["2x2-gqa", "1x4-mqa-right-pad", "4x1-left-pad", "2x2-3-heads-per-row", "2x2-sp-right-pad", "4x1-sp-left-pad"],
)  # fmt: skip
def test_the_standalone_layers_take_a_grid(pool, grid, heads, kv_heads, padding, sp):
    assert all(pool.run(grid_attention_and_norm, 4, grid, heads, kv_heads, padding, sp))


def refused_attention(rank, world, group):
    mesh = tplayers.init_mesh(tp=(4, 1))["tp_r", "tp_c"]
    tplayers.nn.GridAttention(16, 4, 2, mesh=mesh)  # 2 kv heads over tp_r = 4


def test_attention_a_grid_cannot_split_is_refused(pool):
    for reply in pool.run(refused_attention, 4, return_exceptions=True):
        assert isinstance(reply, RemoteError) and "leave a rank none" in str(reply), reply


def grid_pair_choices(rank, world, group, grid, overlap):
    """The pair under `overlap`, exact against the unsharded one; the overlap engine's choices."""
    from tplayers.functional.auto_overlap import overlap_choices

    with overlap_choices() as log:
        grid_pair(rank, world, group, grid, 12, 8, True, steps=1, overlap=overlap)
    mesh = tplayers.init_mesh(tp=grid)["tp_r", "tp_c"]
    axes = {axis: tuple(torch.distributed.get_process_group_ranks(mesh.get_group(axis))) for axis in ("tp_r", "tp_c")}
    return {axis: [c.overlap for c in log if c.ranks == ranks] for axis, ranks in axes.items()}


@pytest.mark.parametrize("overlap", ["auto", True, False])
def test_the_overlap_engine_decides_per_axis(pool, overlap):
    """Each axis' collectives go through the overlap engine on their own group (a choice per
    axis, agreed by that axis' ranks); forced ring and plain paths are exact on a grid."""
    for choices in pool.run(grid_pair_choices, 4, (2, 2), overlap):
        assert choices["tp_r"] and choices["tp_c"], choices  # both axes asked, each on its own group
        if overlap != "auto":
            assert set(choices["tp_r"]) == set(choices["tp_c"]) == {overlap}


def dropout_on_grid(rank, world, group, rates):
    """(refusal or None, every rank's per-layer hidden-state sums) of one training forward of a Llama
    with 3 heads and dropout `rates` (tiny_model sets the config's to 0: set on the model here)."""
    from test_families import tiny_model

    mesh = tplayers.init_mesh(tp=(2, 2))["tp_r", "tp_c"]
    model = tiny_model("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=24)
    for key, value in rates.items():
        setattr(model.config, key, value)
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = rates.get("attention_dropout", 0.0)
    try:
        model = tplayers.parallelize(model, group=mesh, verify=False).train()
    except ValueError as e:
        return str(e), None
    torch.manual_seed(5)
    ids = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(1))
    sums = torch.stack([h.detach().sum() for h in model(ids, output_hidden_states=True).hidden_states])
    out = [torch.empty_like(sums) for _ in range(4)]
    torch.distributed.all_gather(out, sums)
    return None, out


def test_dropout_on_a_grid(pool):
    """Attention dropout over uneven heads (3 over tp_r = 2): the ranks holding the same features
    (same tp_c) stay alike. Dropout on the residual stream (a `hidden_dropout` rate), split over
    tp_c, is refused by name."""
    refusal, sums = pool.run(dropout_on_grid, 4, dict(attention_dropout=0.2))[0]
    assert refusal is None and torch.equal(sums[0], sums[2]) and torch.equal(sums[1], sums[3])
    for refusal, _ in pool.run(dropout_on_grid, 4, dict(hidden_dropout=0.1)):  # as Falcon names it
        assert "dropout on the residual stream" in refusal and "hidden_dropout" in refusal, refusal
