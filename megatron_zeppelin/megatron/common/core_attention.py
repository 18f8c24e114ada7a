"""Zeppelin core attention for Megatron-Core's ``SelfAttention``.

Megatron hands core attention q ``[tokens, 1, heads, head_dim]`` and k/v ``[tokens, 1,
kv_heads, head_dim]`` (after RoPE) in the rank's *linear* layout and expects ``[tokens, 1,
heads * head_dim]`` back (multi-latent attention: q/k ``[tokens, heads, qk_head_dim +
qk_pos_emb_head_dim]``, v ``[tokens, heads, v_head_dim]``, 3-D, and ``[tokens, 1, heads *
v_head_dim]`` back). Zeppelin core attention:

1. moves q, k, v to the attention layout (one all-to-all over the pool: ``runtime/remap.py``);
2. runs the attention engine on the plan's rings (``runtime/engine.py``), with the layer's
   sliding window (``model.layer_window``: Megatron's ``window_size`` and per-layer pattern);
3. moves the output back to the linear layout.

Two classes with Megatron's core-attention constructor and forward signatures:
``ZeppelinCoreAttention`` (a ``MegatronModule``, any registered kernel backend) and, when
Transformer Engine is importable, ``te_core_attention_class()`` -> a ``TEDotProductAttention``
subclass that runs the same path on zeppelin-packed batches and TE's own otherwise. Both take a
``ZeppelinAttentionState`` (process groups and options, shared by all layers of a model)
through the layer spec's params.
"""
from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_zeppelin.config import ClusterSpec, ConfigError, HardwareProfile, hardware_for
from megatron_zeppelin.megatron.common.model import layer_window
from megatron_zeppelin.megatron.common.packing import ZeppelinPackedSeqParams
from megatron_zeppelin.megatron.common.sink import SinkMixin
from megatron_zeppelin.plan import Plan
from megatron_zeppelin.runtime import kernels
from megatron_zeppelin.runtime.engine import AttentionEngine
from megatron_zeppelin.runtime.remap import RemapIndex, build_remap_index, to_attention_layout, \
    to_linear_layout
from megatron_zeppelin.runtime.shift import ShiftIndex, build_shift_index
from megatron_zeppelin.runtime.transport import get_transport


@dataclasses.dataclass
class _Runtime:
    plan: Plan
    remap: RemapIndex | None
    engine: AttentionEngine
    ready: torch.cuda.Event | None = None  # CUDA: the end of its index copies (prepare)
    shifts: dict[int, ShiftIndex] = dataclasses.field(default_factory=dict)  # k -> MTP shift


# runtimes prepared ahead kept when a plan that was not prepared is used (bounded memory)
_KEEP_AHEAD = 2


class ZeppelinAttentionState:
    """What every zeppelin core attention of one model shares.

    pool_group: the process group of the pool (its ranks are the plan's ranks).
    route_group: a second group over the same ranks for global inter-node steps (``None``:
        inter-node rings use plain ring P2P). router_topology: for ``inter_mode='routed'``.
    backend: attention kernel backend (None: ``ZEPPELIN_ATTENTION_BACKEND``); transport:
        ``direct``/``staged`` (None: ``ZEPPELIN_TRANSPORT``); device: where the runtime's
        index tensors live (None: the inputs' device at the first layer); windows: the
        layers' sliding windows (None: full causal), whose ring blocks are prepared ahead.
    shifts: the shifts within documents (``runtime/shift.py``) prepared with each plan's runtime
        (multi-token prediction sets ``(1,)``: ``shift_index``).
    The runtime (remap index + engine, every index tensor on the device) of a micro-batch is
    built once per plan: by ``prepare(plan)`` ahead of the step (the data iterator calls it
    when it has planned the next micro-batch, on its own thread), else by the first layer that
    sees the plan. The runtime of the previous plan is closed when the next one is used; the
    runtimes prepared for later plans are kept (the iterator may prepare micro-batch i+1
    before micro-batch i reaches its first layer). ``keep_used``: how many runtimes of plans
    used before stay ready for reuse (0: none); Megatron's interleaved pipeline schedule runs
    model chunk c+1 on micro-batches chunk c ran just before, so it sets the micro-batches in
    flight (``builds`` counts the runtimes built).
    """

    def __init__(self, pool_group: dist.ProcessGroup, *, backend: str | None = None,
                 inter_mode: str = "ring", route_group: dist.ProcessGroup | None = None,
                 router_topology=None, timeout_s: float | None = None,
                 transport: str | None = None, device: torch.device | str | None = None,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        self.pool_group, self.backend, self.inter_mode = pool_group, backend, inter_mode
        self.windows = tuple(windows)
        _refuse_window_limit(backend, self.windows)
        self.route_group, self.router_topology, self.timeout_s = route_group, router_topology, \
            timeout_s
        self.transport = get_transport(transport)
        if device is not None and torch.device(device).type == "cuda" and \
                torch.device(device).index is None:  # this thread's GPU, not the planner's
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.rank = dist.get_rank(pool_group)
        self.probe = None  # runtime.probe.Probe when the profile is fitted (train.py sets it)
        self.shifts: tuple[int, ...] = ()  # PackedGPTModel sets (1,) when it has MTP layers
        self._runtime: _Runtime | None = None
        self._ahead: dict[int, _Runtime] = {}  # id(plan) -> runtime prepared ahead
        self.keep_used, self.builds = 0, 0
        self._used: dict[int, _Runtime] = {}  # id(plan) -> runtime used before, oldest first
        self._lock = threading.Lock()

    def prepare(self, plan: Plan) -> None:
        """Build the runtime of ``plan`` now (thread-safe), so that its first layer finds it."""
        runtime = self._build(plan, self.device)
        if self.device is not None and torch.device(self.device).type == "cuda":
            # this thread's copies are ordered before the first layer's stream, whichever
            runtime.ready = torch.cuda.Event()
            runtime.ready.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._ahead[id(plan)] = runtime

    def preparing(self, planner: Callable[[list[int]], Plan]) -> Callable[[list[int]], Plan]:
        """``planner`` that also prepares each plan's runtime (``prepare``), for the data
        iterator, which plans the next micro-batch on its own thread while one trains."""
        def plan_and_prepare(lengths: list[int]) -> Plan:
            plan = planner(lengths)
            self.prepare(plan)
            return plan
        return plan_and_prepare

    def _build(self, plan: Plan, device) -> _Runtime:
        """The plan's remap index and engine (the softmax scale is each call's: ``forward``)."""
        self.builds += 1
        remapped = plan.remaps
        engine = AttentionEngine(plan, self.rank, self.pool_group, backend=self.backend,
                                 timeout_s=self.timeout_s, inter_mode=self.inter_mode,
                                 route_group=self.route_group,
                                 router_topology=self.router_topology, transport=self.transport,
                                 device=device, windows=self.windows)
        engine.probe = self.probe
        remap = None
        if remapped:
            remap = build_remap_index(plan, self.rank, transport=self.transport,
                                      timeout_s=self.timeout_s)
            remap = dataclasses.replace(remap, probe=self.probe)
            remap = remap.to(device) if device is not None else remap
        shifts = {k: self._shift(plan, k, device) for k in self.shifts}
        return _Runtime(plan, remap, engine, shifts=shifts)

    def _shift(self, plan: Plan, k: int, device) -> ShiftIndex:
        index = build_shift_index(plan, self.rank, k, transport=self.transport,
                                  timeout_s=self.timeout_s)
        return index.to(device) if device is not None else index

    def shift_index(self, plan: Plan, device: torch.device, k: int = 1) -> ShiftIndex:
        """The shift by ``k`` within documents of ``plan``'s linear layout on this rank, built
        with the plan's runtime (ahead, when ``k`` is in ``shifts``), else now."""
        runtime = self.runtime(plan, device)
        index = runtime.shifts.get(k)
        if index is None:
            index = runtime.shifts[k] = self._shift(plan, k, device)
        if index.local_src.device.type != torch.device(device).type:  # prepared on the host
            index = runtime.shifts[k] = index.to(device)
        return index

    def runtime(self, plan: Plan, device: torch.device) -> _Runtime:
        if self._runtime is not None and self._runtime.plan is plan:
            return self._runtime
        used = self._used.pop(id(plan), None)
        if used is not None and used.plan is plan:
            self._retire()
            self._runtime = used
            return used
        if used is not None:
            used.engine.close()
        with self._lock:  # runtimes are prepared, and used, in the order of the plans
            keys = list(self._ahead)
            older = keys[:keys.index(id(plan))] if id(plan) in self._ahead else \
                keys[:max(0, len(keys) - _KEEP_AHEAD)]
            stale = [self._ahead.pop(key) for key in older]
            ahead = self._ahead.pop(id(plan), None)  # the next plans' runtimes stay
        for old in stale:
            old.engine.close()
        self._retire()
        if ahead is None or ahead.plan is not plan:
            if ahead is not None:
                ahead.engine.close()
            ahead = self._build(plan, device)
        if ahead.ready is not None:
            torch.cuda.current_stream(device).wait_event(ahead.ready)
        if ahead.remap is not None:
            ahead = dataclasses.replace(ahead, remap=ahead.remap.to(device))
        self._runtime = ahead
        return self._runtime

    def _retire(self) -> None:
        """Put the current runtime aside for reuse (``keep_used``), else close it."""
        if self._runtime is None:
            return
        if self.keep_used:
            self._used[id(self._runtime.plan)] = self._runtime
            while len(self._used) > self.keep_used:
                self._used.pop(next(iter(self._used))).engine.close()
        else:
            self._runtime.engine.close()
        self._runtime = None

    def close(self) -> None:
        while self._used:
            self._used.popitem()[1].engine.close()
        if self._runtime is not None:
            self._runtime.engine.close()
            self._runtime = None


def _refuse_window_limit(backend: str | None, windows: tuple[int | None, ...]) -> None:
    """A model with sliding windows on an explicit backend that cannot run windowed rings
    (``KernelBackend.window_limit``: ``te``) is refused at set-up, naming the flags, instead
    of failing at the first ring block."""
    name, windowed = backend or kernels.configured(), [w for w in windows if w is not None]
    limit = name != kernels.AUTO and windowed and kernels.get(name).window_limit
    if limit:
        raise ConfigError(f"--zeppelin-attention-backend={name} with a sliding window of "
                          f"{windowed[0]} tokens (--window-size): {limit}; use "
                          "--zeppelin-attention-backend "
                          f"{' or '.join(kernels.WINDOW_BACKENDS)}")


def planning_hardware(cluster: ClusterSpec, backend: str | None, device: torch.device | str,
                      dtype: torch.dtype, head_dim: int) -> HardwareProfile:
    """The hardware profile the planner's cost model should use: the one of the attention
    kernel that will run (``config.hardware_for``) for ``backend`` (None/``auto``: what the
    engine picks) on ``device``/``dtype``/``head_dim``. When no profile describes that kernel
    (e.g. the math path on CUDA), the cluster's own profile, with a warning saying so.
    ConfigError when the backend cannot run there (not installed, or refuses the tensors)."""
    try:
        kernel = kernels.backend_for(backend, device, dtype, head_dim).kernel
    except (ValueError, ImportError) as exc:  # a backend that cannot run here: say so now
        raise ConfigError(f"--zeppelin-attention-backend={backend}: {exc}") from None
    try:
        return hardware_for(cluster, kernel)
    except ConfigError as exc:
        warnings.warn(f"{exc}; planning with the cluster's profile {cluster.hardware!r} instead",
                      RuntimeWarning, stacklevel=2)
        return hardware_for(cluster)


def zeppelin_attention(state: ZeppelinAttentionState, query: Tensor, key: Tensor, value: Tensor,
                       params: ZeppelinPackedSeqParams, scale: Optional[float],
                       window: Optional[int] = None, sink: Optional[Tensor] = None) -> Tensor:
    """Remap q/k/v to the attention layout, run the plan's rings, remap the output back.

    query ``[tokens, 1, heads, d]``, key ``[tokens, 1, kv_heads, d]``, value ``[tokens, 1,
    kv_heads, dv]`` (or all 3-D without the 1: packed multi-latent attention) in the rank's
    linear layout; returns ``[tokens, 1, heads * dv]`` in the linear layout. window: sliding
    window ``L`` (None: full causal); sink: attention-sink logits ``[heads]`` (``sink.py``,
    None for the vanilla softmax). The last ``params.pad_tokens`` tokens
    (sequence-parallel padding) belong to no sequence: they skip the remap and the engine, and
    their output is zero.
    """
    if params.plan is None or params.rank != state.rank:
        raise ValueError(f"zeppelin core attention needs packed params with the plan of this "
                         f"rank ({state.rank}); got plan={params.plan is not None}, "
                         f"rank={params.rank}")
    real = params.num_tokens
    if query.shape[0] != real + params.pad_tokens:
        raise ValueError(f"q holds {query.shape[0]} tokens but the packed params describe "
                         f"{real} + {params.pad_tokens} pad tokens")
    runtime = state.runtime(params.plan, query.device)
    if query.dim() == 3:  # packed multi-latent attention: [tokens, heads, dim]
        query, key, value = query[:, None], key[:, None], value[:, None]
    heads = query.shape[2]
    q, k, v = query[:real, 0], key[:real, 0], value[:real, 0]
    if runtime.remap is not None:
        # one all-to-all for q, k and v: [tokens, heads * d + kv_heads * (d + dv)]
        shapes = [x.shape[1:] for x in (q, k, v)]
        qkv = to_attention_layout(torch.cat([x.flatten(1) for x in (q, k, v)], dim=1),
                                  runtime.remap, state.pool_group)
        q, k, v = (x.reshape(-1, *shape) for x, shape in zip(
            qkv.split([shape.numel() for shape in shapes], dim=1), shapes))
    out = runtime.engine.forward(q.contiguous(), k.contiguous(), v.contiguous(), scale, window,
                                 sink)
    if runtime.remap is not None:
        out = to_linear_layout(out, runtime.remap, state.pool_group)
    out = out.reshape(out.shape[0], 1, heads * value.shape[3])  # explicit: 0 rows happen
    if params.pad_tokens:
        out = torch.cat([out, out.new_zeros(params.pad_tokens, 1, out.shape[2])])
    return out


class ZeppelinCoreAttention(SinkMixin, MegatronModule):
    """Megatron core attention running Zeppelin's remap + attention engine (pure torch path).

    Constructor and forward follow ``DotProductAttention`` (megatron-core 0.16.1); the extra
    ``zeppelin_state`` comes from the layer spec's params.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 zeppelin_state: ZeppelinAttentionState | None = None) -> None:
        super().__init__(config=config)
        if zeppelin_state is None:
            raise ValueError("zeppelin_state=None: build the layer with "
                             "get_gpt_layer_zeppelin_spec(state)")
        _refuse_dropout(config, attention_dropout)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"attn_mask_type={attn_mask_type} is invalid: zeppelin attention "
                             "is causal")
        self.state, self.softmax_scale = zeppelin_state, softmax_scale
        self.zeppelin_state = zeppelin_state  # the name PackedGPTModel finds it by (as TE's)
        self.window = layer_window(config, max(1, layer_number))
        self._init_sink(config, pg_collection)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[ZeppelinPackedSeqParams] = None) -> Tensor:
        if not isinstance(packed_seq_params, ZeppelinPackedSeqParams):
            raise ValueError("zeppelin core attention needs ZeppelinPackedSeqParams (from the "
                             f"zeppelin data iterator); got {type(packed_seq_params).__name__}")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by zeppelin core attention")
        return zeppelin_attention(self.state, query, key, value, packed_seq_params,
                                  self.softmax_scale, self.window, self.sink(query))


def _refuse_dropout(config: TransformerConfig, attention_dropout: Optional[float]) -> None:
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(f"attention_dropout={dropout} is not supported by zeppelin core "
                         "attention (Megatron-LM: --attention-dropout 0.0)")


def te_core_attention_class() -> type:
    """A ``TEDotProductAttention`` subclass that runs zeppelin on zeppelin-packed batches.

    Raises ImportError naming the extra when Transformer Engine is not installed.
    """
    try:  # megatron-core's TE module imports even without TE installed: ask for TE itself
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError as exc:
        raise ImportError("Transformer Engine is not installed: pip install "
                          "'megatron-zeppelin[te]' (or use the NGC PyTorch image)") from exc
    return zeppelin_te_attention(TEDotProductAttention)


def zeppelin_te_attention(base: type) -> type:
    """``base`` (megatron-core's ``TEDotProductAttention``) running zeppelin on zeppelin-packed
    batches and itself on any other. Its constructor arguments are read by name through
    ``base``'s signature, positional or keyword: TE keeps no ``softmax_scale`` attribute (it
    hands the scale to its kernels' modules), so the subclass keeps the one megatron-core
    passes (None: the engine's ``head_dim ** -0.5``, TE's default too)."""
    signature = inspect.signature(base.__init__)

    class ZeppelinTEDotProductAttention(base):
        """TE core attention; zeppelin-packed batches go through remap + the zeppelin engine."""

        def __init__(self, config: TransformerConfig, *args,
                     zeppelin_state: ZeppelinAttentionState | None = None, **kwargs) -> None:
            given = signature.bind_partial(self, config, *args, **kwargs).arguments
            _refuse_dropout(config, given.get("attention_dropout"))
            super().__init__(config, *args, **kwargs)
            if zeppelin_state is None:
                raise ValueError("zeppelin_state=None: build the layer with "
                                 "get_gpt_layer_zeppelin_spec(state)")
            self.zeppelin_state = zeppelin_state
            self.zeppelin_softmax_scale = given.get("softmax_scale")
            self.zeppelin_window = layer_window(config, max(1, given.get("layer_number", 1)))

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None, **kwargs):
            if isinstance(packed_seq_params, ZeppelinPackedSeqParams):
                return zeppelin_attention(self.zeppelin_state, query, key, value,
                                          packed_seq_params, self.zeppelin_softmax_scale,
                                          self.zeppelin_window, self._zeppelin_sink(query))
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params, **kwargs)

        def _zeppelin_sink(self, query):
            """TE's sink logits (``softmax_offset``, a parameter when learnable; 0 for
            off-by-one), None for the vanilla softmax. Not run on a GPU yet."""
            if getattr(self.config, "softmax_type", "vanilla") == "vanilla":
                return None
            offset = getattr(self, "softmax_offset", None)
            if offset is None:
                return query.new_zeros(query.shape[-2], dtype=torch.float32)
            return offset.reshape(-1).to(query.device)

    return ZeppelinTEDotProductAttention
