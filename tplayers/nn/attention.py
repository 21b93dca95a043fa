"""Head-split self-attention: `ParallelAttention` and the rotary embedding it applies per head.

n = TP size, rank r. The query heads are split evenly over the group; the key / value heads
follow the query heads that read them:

    num_kv_heads % n == 0   rank r holds q heads [r*Hq/n, (r+1)*Hq/n) and kv heads
                            [r*Hkv/n, (r+1)*Hkv/n): q_proj, k_proj and v_proj are all
                            column-parallel, Shard(0) of HF's own (out, in) weights.
    n % num_kv_heads == 0   (TP larger than the number of kv heads, MQA included) the n/Hkv
                            ranks r with r // (n/Hkv) == h share kv head h. k_proj / v_proj
                            then hold the whole (Hkv*D, K) weight on every rank, Replicate();
                            each rank multiplies only its head's D rows.

The one QKV GEMM per forward is `column_parallel_linear` on the concatenation of the local
q / k / v rows, so the input is all-gathered (sequence_parallel) or its gradient all-reduced
once, not once per projection. Attention itself is local: RoPE on the local heads, then
`scaled_dot_product_attention` (the flash-attention kernel, kernels/flash_attention.py, on the
Triton backend); o_proj is row-parallel (all-reduce, or reduce-scatter along
the sequence with sequence_parallel).
"""

from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from tplayers.backend import register, token_bucket, uses_triton
from tplayers.distributed import refuse_grid, resolve_group
from tplayers.functional.auto_overlap import check_overlap
from tplayers.functional.collectives import copy_to_tp_region
from tplayers.functional.context import AttentionOptions, local_attention
from tplayers.functional.linear import column_parallel_linear
from tplayers.functional.sequence import whole_length
from tplayers.nn.linear import ColumnParallelLinear, RowParallelLinear, _ParallelLinear
from tplayers.placement import SharesGroups, even_sizes, shard_range


class ReplicatedLinear(_ParallelLinear):
    """The whole nn.Linear weight / bias on every rank of `group`, placement Replicate().

    A parameter holder: ParallelAttention reads a slice of its rows and routes the weight
    through `copy_to_tp_region`, whose backward all-reduces the gradient, so every rank ends
    with the whole gradient (each rank contributed the rows of the kv head it used)."""

    _placements = {"weight": Replicate(), "bias": Replicate()}

    def __init__(self, in_features, out_features, bias=True, *, group=None, device=None, dtype=None):
        super().__init__(in_features, out_features, group=group, sequence_parallel=False, overlap=False)
        self._init_parameters(bias, device, dtype)

    def _set_shards(self, weight, bias, device):
        self.weight = nn.Parameter(weight.to(device=device, copy=True))
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.to(device=device, copy=True)))
        self._tag_parameters()

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (replicated on {self.tp_size} ranks), "
            f"bias={self.bias is not None}"
        )


def attend(q, k, v, layer, seq, attention_mask, position_ids, position_embeddings):
    """The attention of `layer`'s local heads (its local_heads, local_kv_heads, head_dim, causal,
    inv_freq): q (B, S, hq * D), k / v (B, S, hkv * D) -> (B, S, hq * D). RoPE, GQA's shared
    key / value heads, the padding and causal masks."""
    D, hq, hkv = layer.head_dim, layer.local_heads, layer.local_kv_heads
    B = q.shape[0]
    q = q.view(B, seq, hq, D).transpose(1, 2)  # (B, hq, S, D)
    k = k.view(B, seq, hkv, D).transpose(1, 2)  # (B, hkv, S, D)
    v = v.view(B, seq, hkv, D).transpose(1, 2)
    if position_embeddings is None and layer.inv_freq is not None:
        if position_ids is None:
            position_ids = torch.arange(seq, device=q.device)[None]
        position_embeddings = rope_cos_sin(position_ids, layer.inv_freq, q.dtype)
    if position_embeddings is not None:
        cos, sin = position_embeddings
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    key = (token_bucket(B * seq), hq, hkv, token_bucket(seq), D, int(layer.causal), int(attention_mask is not None))
    if uses_triton(q, "attention", key if q.is_cuda else ()):  # the flash kernel: GQA unexpanded, masks from metadata
        out = _flash(q, k, v, layer.causal, seq, attention_mask)
    else:
        out = _sdpa(q, k, v, layer.causal, seq, attention_mask)
    return out.transpose(1, 2).reshape(B, seq, hq * D)  # (B, S, hq*D)


def _sdpa(q, k, v, causal, seq, attention_mask):
    """torch's SDPA, K / V expanded for GQA, the padding and causal masks as one boolean mask."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:  # GQA / MQA: each local kv head serves hq / hkv consecutive query heads
        k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    if attention_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S) keys to attend
    if causal:
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    has_key = mask.any(-1, keepdim=True)  # (B, 1, S, 1): rows with no key output zeros
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key) * has_key


def _flash(q, k, v, causal, seq, attention_mask):
    """kernels/flash_attention.py through `local_attention`: positions 0..S-1, one document, the
    padding keys hidden (a query that sees no key outputs zeros, as the SDPA path gives)."""
    B = q.shape[0]
    pos = torch.arange(seq, dtype=torch.int32, device=q.device).expand(B, seq).contiguous()
    q_doc = torch.zeros((B, seq), dtype=torch.int32, device=q.device)
    k_doc = q_doc if attention_mask is None else torch.where(attention_mask.bool(), 0, -1).to(torch.int32)
    opts = AttentionOptions(scale=q.shape[-1] ** -0.5, causal=causal)
    return local_attention(q, k, v, pos, q_doc, pos, k_doc, opts)


def _attention_recipe(key, dtype, device):
    """Forward and backward of both paths on heads of the class `key` (tplayers.backend.register): the rows
    `key[0]` as batch x sequence `key[3]`, HF's (B, H, S, D) views."""
    tokens, hq, hkv, seq, D, causal, masked = key
    B = max(1, tokens // seq)
    q = torch.randn(B, seq, hq, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, seq, hkv, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_() for _ in "kv")
    mask = torch.ones(B, seq, dtype=torch.long, device=device) if masked else None
    do = torch.randn(B, hq, seq, D, device=device, dtype=dtype)

    def step(fn):
        return lambda: fn(q, k, v, bool(causal), seq, mask).backward(do)

    return step(_flash), step(_sdpa)


register("attention", _attention_recipe)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """HF's default RoPE inverse frequencies, (head_dim/2,) fp32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rope_cos_sin(position_ids, inv_freq, dtype):
    """cos, sin (B, S, D) for position_ids (B, S), as LlamaRotaryEmbedding computes them (fp32, then cast)."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x (B, h, S, D) rotated by cos / sin (B, S, D): the Llama rotate_half convention."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def head_dims(layer, hidden_size, num_heads, num_kv_heads, head_dim, rope_theta):
    """(num_kv_heads, head_dim) with their defaults, checked, and set on `layer` with hidden_size
    and num_heads (the 1-D and the grid attention alike)."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = hidden_size // num_heads if head_dim is None else head_dim
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) is not divisible by num_kv_heads ({num_kv_heads})")
    if rope_theta is not None and head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    layer.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim = (
        hidden_size, num_heads, num_kv_heads, head_dim,
    )  # fmt: skip
    return num_kv_heads, head_dim


def add_rope(layer, rope_theta, device):
    """`layer.rope_theta` and its RoPE inverse frequencies, a non-persistent buffer (None: no RoPE)."""
    layer.rope_theta = rope_theta
    buffer_device = "cpu" if device is None or torch.device(device).type == "meta" else device
    inv_freq = None if rope_theta is None else rope_inv_freq(layer.head_dim, rope_theta).to(buffer_device)
    layer.register_buffer("inv_freq", inv_freq, persistent=False)


def from_hf_llama(cls, attn, config, device, dtype, **kwargs):
    """`cls` (ParallelAttention or GridAttention) holding this rank's shards of an HF LlamaAttention;
    `kwargs`: the layer's own (its group or mesh among them)."""
    config = attn.config if config is None else config
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{cls.__name__}.from_hf_llama: rope_type {rope_type!r} is not supported (only 'default')")
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    dtype = dtype or q.weight.dtype
    layer = cls(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, attn.head_dim,
        bias=o.bias is not None, qkv_bias=q.bias is not None, rope_theta=rope_theta, device="meta", dtype=dtype,
        **kwargs,
    )  # fmt: skip
    device = device or q.weight.device
    for mine, theirs in ((layer.q_proj, q), (layer.k_proj, k), (layer.v_proj, v), (layer.o_proj, o)):
        bias = None if theirs.bias is None else theirs.bias.detach().to(dtype)
        mine._set_shards(theirs.weight.detach().to(dtype), bias, device)
    if layer.inv_freq is not None:
        layer.inv_freq = layer.inv_freq.to(device)
    return layer


def _splits_evenly(num_heads, num_kv_heads, tp) -> bool:
    """Whether the query heads divide by tp and the key/value heads either split with them or
    are fewer than the ranks, a whole number of ranks each (the layouts of the module docstring)."""
    return num_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)


class ParallelAttention(SharesGroups, nn.Module):
    """Causal self-attention with its heads split over `group` (MHA, GQA, MQA).

    Shapes (n = TP size, D = head_dim, Hq / Hkv = num_heads / num_kv_heads):
        x (B, S, H) replicated, or (B, S/n, H) seq-sharded with sequence_parallel=True
        q_proj   ColumnParallelLinear  weight (Hq*D/n, H)                         Shard(0)
        k_proj, v_proj                 weight (Hkv*D/n, H) Shard(0) when n | Hkv,
                                       else (Hkv*D, H) Replicate() (see the module docstring)
        o_proj   RowParallelLinear     weight (H, Hq*D/n)                         Shard(1)
        y (B, S, H), or (B, S/n, H) with sequence_parallel=True.

    forward(x, attention_mask=None, position_ids=None, position_embeddings=None):
    `attention_mask` (B, S) of 1 (attend) / 0 (padding key), combined with the causal mask
    (causal=True); a query row with no key left outputs zeros (what SDPA does on CPU, made
    explicit so no backend turns it into NaN). `position_ids` (B, S) or (1, S), default
    0..S-1; `position_embeddings` an HF-style (cos, sin) pair of (B, S, D) that replaces
    the RoPE computed from `rope_theta` (None: no rotary embedding). Masks and positions
    always describe the whole sequence S, also under sequence parallelism.

    Gradients: q / o shards get their slices of the unsharded gradient as in the linear
    layers. A replicated k / v weight gets the whole gradient on every rank: the rows of kv
    head h are summed over the ranks that share h by the all-reduce in `copy_to_tp_region`'s
    backward (the rows of the other heads are zero on each rank before the sum). The cost of
    replication: each rank stores Hkv*D*H parameters per projection instead of D*H (Hkv < n
    here, so at most n-1 heads), and backward all-reduces that much. The placement stays the
    plain Replicate() record, so clipping, ZeRO and checkpointing need nothing new. The local
    q / k / v rows are concatenated each forward (a weight-sized copy) so one GEMM and one
    input collective serve all three.
    """

    def __init__(
        self, hidden_size, num_heads, num_kv_heads=None, head_dim=None, *, bias=False, qkv_bias=None,
        causal=True, group=None, sequence_parallel=False, overlap="auto", rope_theta=10000.0,
        device=None, dtype=None,
    ):  # fmt: skip
        super().__init__()
        refuse_grid(group, "ParallelAttention", "GridAttention")
        self.group = resolve_group(group)
        self.tp_size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        num_kv_heads, head_dim = head_dims(self, hidden_size, num_heads, num_kv_heads, head_dim, rope_theta)
        self.causal, self.sequence_parallel = causal, sequence_parallel
        self.overlap = check_overlap(overlap, "ParallelAttention")
        self.by_whole_heads = not _splits_evenly(num_heads, num_kv_heads, self.tp_size)
        if self.by_whole_heads:
            # Whole heads as evenly as they go (9 over 2: 5, 4; 14 over 4: 4, 4, 3, 3; a rank holds
            # none only with fewer heads than ranks); each local query head gets its own copy of
            # the kv head it reads (the kv weights whole on every rank, as below), also where the
            # heads straddle two kv groups.
            self.head_split = even_sizes(num_heads, self.tp_size)
            start, self.local_heads = shard_range(num_heads, self.tp_size, rank, self.head_split)
            per_group = num_heads // num_kv_heads
            self.kv_replicated, self.local_kv_heads, self.kv_head_start = True, self.local_heads, start // per_group
            kv_heads = [h // per_group for h in range(start, start + self.local_heads)]
            self._kv_rows = (
                torch.arange(head_dim) + torch.tensor(kv_heads, dtype=torch.long)[:, None] * head_dim
            ).flatten()
        else:
            self.head_split = None  # torch.chunk's split: even here
            self.local_heads = num_heads // self.tp_size
            self.kv_replicated = num_kv_heads < self.tp_size
            self.local_kv_heads = 1 if self.kv_replicated else num_kv_heads // self.tp_size
            # The first kv head this rank holds (replicated case: the one its query heads read).
            self.kv_head_start = rank // (self.tp_size // num_kv_heads) if self.kv_replicated else 0
            self._kv_rows = slice(self.kv_head_start * head_dim, (self.kv_head_start + 1) * head_dim)
        # the widest rank's q / k / v rows: every rank asks the overlap question about one shape
        self._widest_qkv = 3 * -(-num_heads // self.tp_size) * head_dim if self.by_whole_heads else None
        qkv_bias = bias if qkv_bias is None else qkv_bias
        kw = dict(group=self.group, device=device, dtype=dtype)
        kv_cls = ReplicatedLinear if self.kv_replicated else ColumnParallelLinear
        split = dict(split_unit=head_dim, split_sizes=self.head_split)
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, qkv_bias, **split, **kw)
        self.k_proj = kv_cls(hidden_size, num_kv_heads * head_dim, qkv_bias, **kw)
        self.v_proj = kv_cls(hidden_size, num_kv_heads * head_dim, qkv_bias, **kw)
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, hidden_size, bias, sequence_parallel=sequence_parallel, overlap=overlap,
            **split, **kw,
        )  # fmt: skip
        add_rope(self, rope_theta, device)

    @classmethod
    def from_hf_llama(cls, attn, config=None, *, group=None, device=None, dtype=None, **kwargs):
        """The layer holding this rank's shards of an HF LlamaAttention (Mistral / Qwen2 alike:
        separate q / k / v / o nn.Linear). Sizes and rope_theta come from `config` (default
        `attn.config`); only the default RoPE type is supported."""
        return from_hf_llama(cls, attn, config, device, dtype, group=group, **kwargs)

    def _qkv_weight_and_bias(self):
        """The local q / k / v rows stacked: weight ((hq + 2 hkv) * D, H), bias likewise or None."""
        k_w, v_w = self.k_proj.weight, self.v_proj.weight
        k_b, v_b = self.k_proj.bias, self.v_proj.bias
        if self.kv_replicated:
            rows = self._kv_rows
            # Identity forward; backward all-reduces the (mostly zero) whole-weight gradient.
            k_w, v_w = (copy_to_tp_region(w, self.group)[rows] for w in (k_w, v_w))
            if k_b is not None:
                k_b, v_b = (copy_to_tp_region(b, self.group)[rows] for b in (k_b, v_b))
        weight = torch.cat([self.q_proj.weight, k_w, v_w])
        bias = None if self.q_proj.bias is None else torch.cat([self.q_proj.bias, k_b, v_b])
        return weight, bias

    def _check_inputs(self, x, attention_mask, position_ids, position_embeddings):
        """Every rank sees the same shapes, so every rank raises here, before any collective."""
        name = type(self).__name__
        weight = self.q_proj.weight
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a Tensor, got {type(x).__name__}")
        if x.dtype != weight.dtype:
            raise TypeError(f"{name}: input dtype {x.dtype} does not match the weight dtype {weight.dtype}")
        if x.device != weight.device:
            raise ValueError(f"{name}: input is on {x.device} but the weight is on {weight.device}")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"{name}: input must be (batch, seq, {self.hidden_size}), got {tuple(x.shape)}")
        batch = x.shape[0]
        seq = whole_length(x.shape[1], self.tp_size) if self.sequence_parallel else x.shape[1]
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, seq):
            raise ValueError(
                f"{name}: attention_mask must be (batch, seq) = {(batch, seq)}, got {tuple(attention_mask.shape)}"
            )
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch)
                                         or position_ids.shape[1] != seq):  # fmt: skip
            raise ValueError(f"{name}: position_ids must be ({batch} or 1, {seq}), got {tuple(position_ids.shape)}")
        if position_embeddings is not None:
            for t in position_embeddings:
                if t.dim() != 3 or t.shape[0] not in (1, batch) or tuple(t.shape[1:]) != (seq, self.head_dim):
                    expected = f"({batch} or 1, {seq}, {self.head_dim})"
                    raise ValueError(f"{name}: position_embeddings must be {expected}, got {tuple(t.shape)}")
        return seq

    def forward(self, x, attention_mask=None, position_ids=None, position_embeddings=None):
        seq = self._check_inputs(x, attention_mask, position_ids, position_embeddings)
        D, hq, hkv = self.head_dim, self.local_heads, self.local_kv_heads
        weight, bias = self._qkv_weight_and_bias()
        qkv = column_parallel_linear(
            x,
            weight,
            bias,
            self.group,
            sequence_parallel=self.sequence_parallel,
            overlap=self.overlap,
            widest=self._widest_qkv,
        )  # (B, S, (hq + 2 hkv) * D)
        q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
        out = attend(q, k, v, self, seq, attention_mask, position_ids, position_embeddings)
        return self.o_proj(out)

    def __deepcopy__(self, memo):
        memo[id(self.group)] = self.group  # a copy shares the process group; the projections re-tag placements
        copy = self.__class__.__new__(self.__class__)
        memo[id(self)] = copy
        for key, value in self.__dict__.items():
            copy.__dict__[key] = deepcopy(value, memo)
        return copy

    def extra_repr(self):
        kv = "replicated" if self.kv_replicated else f"{self.local_kv_heads} per rank"
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads} ({self.local_heads} per rank of "
            f"{self.tp_size}), num_kv_heads={self.num_kv_heads} ({kv}), head_dim={self.head_dim}, "
            f"causal={self.causal}, sequence_parallel={self.sequence_parallel}, rope_theta={self.rope_theta}"
        )
