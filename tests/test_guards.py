"""Guards where other code meets a parallelized model: torch's DDP / FSDP1 over ranks holding
different shards, and tensor-parallel ranks given different batches, raise on every rank with a
message naming the fix, before anything is overwritten or trained."""

import warnings

import pytest
import torch
from torch import nn

import tplayers
from tplayers.testing.meshes import layout_mesh

pytestmark = pytest.mark.multirank

VOCAB = 64


def tiny_llama():
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def wrappers_over_shards(rank, world, group):
    """TP 2 x DP 2: torch's DDP / FSDP1 over the world or the TP group raise; DDP over mesh['dp']
    (replicas of the same shards) is built and leaves every shard as it was."""
    mesh = layout_mesh(2, 1, 2)
    model = tiny_llama()
    tplayers.parallelize(model, group=mesh["tp"], verify=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    said = {}
    wrappers = {
        "DistributedDataParallel": lambda: nn.parallel.DistributedDataParallel(model),
        "DistributedDataParallel(process_group=tp)": lambda: nn.parallel.DistributedDataParallel(
            model, process_group=mesh["tp"].get_group()
        ),
        "FullyShardedDataParallel": lambda: torch.distributed.fsdp.FullyShardedDataParallel(model),
    }
    for name, wrap in wrappers.items():
        try:
            wrap()
        except ValueError as e:
            said[name] = str(e)
    nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())  # the right group: fine
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if k in before)
    return said, unchanged


def test_torch_data_parallel_wrappers_over_shards_raise(pool):
    for said, unchanged in pool.run(wrappers_over_shards, 4, mesh=(2, 1, 2)):
        assert said.keys() == {"DistributedDataParallel", "DistributedDataParallel(process_group=tp)",
                               "FullyShardedDataParallel"}, said  # fmt: skip
        for message in said.values():
            assert "overlaps the tensor-parallel group" in message and "tplayers.data_parallel" in message, message
        assert unchanged


def different_inputs(rank, world, group, grid, same):
    mesh = layout_mesh(1, 1, 2, 2) if grid else layout_mesh(1, 1, 4)
    model = tiny_llama()
    tplayers.parallelize(model, group=mesh["tp_r", "tp_c"] if grid else mesh["tp"])  # the self-check runs first
    seed = 0 if same else rank
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    try:
        model(ids, labels=ids)
    except ValueError as e:
        return str(e)
    # checked once: a later forward costs nothing (here ranks see different ids and nothing is said)
    model(torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank + 1)))
    return None


@pytest.mark.parametrize("grid", [False, True], ids=["tp4", "grid2x2"])
def test_tensor_parallel_ranks_given_different_inputs_raise(pool, grid):
    said = pool.run(different_inputs, 4, grid, False, mesh=(1, 1, 2, 2) if grid else (1, 1, 4))
    for message in said:
        assert message is not None and "were given different inputs (input_ids, labels: ranks [1, 2, 3]" in message
        assert "DistributedSampler" in message
    assert pool.run(different_inputs, 4, grid, True, mesh=(1, 1, 2, 2) if grid else (1, 1, 4)) == [None] * 4
