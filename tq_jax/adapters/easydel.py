"""EasyDeL's eSurge serving on tq_jax's compressed KV cache.

::

    import easydel as ed
    from tq_jax.adapters import easydel as tq_easydel

    model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        path, config_kwargs=ed.EasyDeLBaseConfigDict(attn_mechanism="ragged_page_attention_v3"))
    tq_easydel.use(model, "turbo-4")        # or None (4/4 bits), "turbo-3.5", "turbo-2.5", a tq_jax.Options
    engine = ed.eSurge(model=model, tokenizer=path, max_model_len=4096, max_num_seqs=16)

Every layer's K/V then live in a :class:`tq_jax.kvcache.ragged.Pool` (packed TurboQuant
codes and float16 norms, plus small exact pools for each sequence's recent window and
sinks), written once per token and read by :func:`tq_jax.kvcache.ragged.attend`, which
scores the codes directly. eSurge's scheduler, page allocator and batch preparation are
EasyDeL's own: the pool takes the page indices eSurge gives.

This module only maps names: the cache and its attention are :mod:`tq_jax.kvcache.ragged`
(tested without EasyDeL). EasyDeL has no registry of cache classes, so it makes three
changes to the installed package, each of which dispatches on this module's own types and
otherwise calls EasyDeL's code unchanged (:func:`install`; :func:`uninstall` undoes them):

1. ``EasyGenerationMixin._create_standard_ragged_page_cache_config``: for a model that
   carries settings (:func:`use`), the ragged cache config is a :class:`CodesCacheConfig`.
2. ``RaggedPagesCacheView.init``: a :class:`CodesCacheConfig` gives a :class:`CodesCacheView`.
3. ``_RaggedPageAttn.forward_native`` (the ``ragged_page_attention_v3`` operation's):
   a :class:`CodesCacheView` is attended by :func:`tq_jax.kvcache.ragged.attend`. This is
   where EasyDeL dispatches its own ``TurboQuantRaggedPagesCacheView``, one level down.

They are checked against easydel ``EASYDEL_VERSION`` only: importing this module under any
other version raises ImportError.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import options as _options
from tq_jax.kvcache import ragged
from tq_jax.kvcache import state as _kv_state

__all__ = ["EASYDEL_VERSION", "CONFIG_KEY", "CodesCacheConfig", "CodesCacheView", "install", "uninstall",
           "installed", "use", "settings", "rpa_slots", "cache_nbytes"]

EASYDEL_VERSION = "0.3.0"
INSTALL = 'pip install -e ".[easydel]"  (from a tq-jax clone: easydel 0.3.0 with its jax 0.9.2 pins)'
CONFIG_KEY = "tq_jax_kv_cache"  # the model config attribute use() sets: a JSON-able dict

try:
    _found = importlib.metadata.version("easydel")
except importlib.metadata.PackageNotFoundError:
    raise ImportError(f"tq_jax.adapters.easydel needs easydel=={EASYDEL_VERSION}, which is not installed: "
                      f"{INSTALL}") from None
if _found != EASYDEL_VERSION:
    raise ImportError(
        f"tq_jax.adapters.easydel is checked against easydel=={EASYDEL_VERSION}, found easydel {_found}: it "
        f"changes three EasyDeL internals (see the module docstring) whose names and signatures differ between "
        f"versions. Install the tested version with {INSTALL}."
    )

import easydel.infra.mixins.generation as _ed_generation  # noqa: E402
from easydel.caching import RaggedPagesCacheConfig, RaggedPagesCacheView  # noqa: E402
from easydel.caching._abstracts import unwrap_metadata  # noqa: E402
from easydel.operations._attention_outputs import AttentionOutput  # noqa: E402
from easydel.operations.kernels import ragged_page_attention as _ed_rpa  # noqa: E402
from eformer.escale import PartitionAxis, PartitionManager  # noqa: E402
from eformer.pytree import auto_pytree, field  # noqa: E402

NO_METADATA = (
    "tq_jax's cache was called without ragged paged attention metadata (page tables, KV lengths, query starts): "
    "EasyDeL {version}'s model.generate does not build it, and fails the same way on EasyDeL's own ragged cache. "
    "Generate with eSurge (ed.eSurge(model=model, ...)), which drives the cache; or, for model.generate, remove "
    "the settings (tq_easydel.use(model, False)) and load the model with attn_mechanism='vanilla'."
)
UNSUPPORTED = (
    "{what} is not supported by tq_jax's ragged attention (tq_jax.kvcache.ragged.attend takes a softmax scale and "
    "a sliding window only); serve this model with EasyDeL's own cache (tq_easydel.use(model, False) removes the "
    "settings)."
)


# --------------------------------------------------------------------------- settings


def settings(options=None, *, window: int | None = None, sinks: int | None = None,
             max_seqs: int = ragged.DEFAULT_MAX_SEQS, num_pages: int | None = None) -> dict:
    """The settings :func:`use` stores on a model config: a JSON-able dict.

    Args:
        options: None (4-bit keys and values), a preset name of :data:`tq_jax.PRESETS`
            (``"turbo-4"``, ``"turbo-3.5"``, ``"turbo-2.5"``) or a :class:`tq_jax.Options`.
        window, sinks: each sequence's recent and first tokens read exactly
            (:func:`tq_jax.kvcache.ragged.init_pool`'s defaults: 128 or 256, and 4).
        max_seqs: sequences whose window and sinks are kept at once: eSurge's
            ``max_num_seqs``.
        num_pages: pages per layer; default: as many as the bytes eSurge would have
            given a bfloat16 cache buy (its ``hbm_utilization`` budget).

    Raises:
        ValueError: what :func:`tq_jax.kvcache.ragged.init_pool` refuses, checked on a
            one-head probe pool.
    """
    opts = _options_of(options)
    probe = jax.eval_shape(lambda: ragged.init_pool(64, 16, 1, 64, options=opts, window=window, sinks=sinks,
                                                    max_seqs=max_seqs))  # validates, allocates nothing
    del probe
    if num_pages is not None and (not isinstance(num_pages, int) or num_pages < 1):
        raise ValueError(f"`num_pages` must be None or an int >= 1, got {num_pages!r}: pages per layer of the pool.")
    return {"options": dataclasses.asdict(opts), "window": window, "sinks": sinks, "max_seqs": int(max_seqs),
            "num_pages": num_pages}


def _options_of(options) -> _options.Options:
    """``options`` as :func:`tq_jax.kvcache.init` takes them, or a stored :func:`settings` dict."""
    return _options.Options(**options) if isinstance(options, dict) else _kv_state.resolve_options(options, {})


def use(model, options=None, **kwargs):
    """Serve ``model`` on tq_jax's cache: :func:`install`, then store :func:`settings` on its
    text config (``options=False`` removes them). Returns ``model``.

    The model's ``attn_mechanism`` must be ``ragged_page_attention_v3`` (eSurge's default
    on CPU and TPU; on GPU pass it explicitly). Call it before building the eSurge engine,
    which sizes the cache when it starts.

    Raises:
        ValueError: another attention mechanism, EasyDeL's own TurboQuant configured as
            well, a model whose layers differ in KV geometry, bad settings.
    """
    text = model.config.get_text_config()
    if options is False:
        if hasattr(text, CONFIG_KEY):
            delattr(text, CONFIG_KEY)
        return model
    attn = getattr(text, "attn_mechanism", None)
    attn = getattr(attn, "value", attn)
    if attn != "ragged_page_attention_v3":
        raise ValueError(
            f"tq_jax's cache serves EasyDeL's ragged paged attention, but this model's attn_mechanism is {attn!r}: "
            f"load it with config_kwargs=ed.EasyDeLBaseConfigDict(attn_mechanism='ragged_page_attention_v3')."
        )
    if getattr(text, "kv_cache_quantization_config", None) is not None:
        raise ValueError(
            f"this model also sets kv_cache_quantization_config={text.kv_cache_quantization_config!r}: EasyDeL's "
            f"own KV quantization and tq_jax's cache exclude each other; drop one of them."
        )
    if _ed_generation._has_mixed_standard_ragged_geometry(text_config=text):
        raise ValueError("this model's layers differ in KV heads or head_dim; the adapter keeps one pool shape for "
                         "every layer, so it serves uniform models only.")
    values = settings(options, **kwargs)
    install()
    setattr(text, CONFIG_KEY, values)
    return model


# --------------------------------------------------------------------------- the cache


@auto_pytree
class CodesCacheConfig(RaggedPagesCacheConfig):
    """EasyDeL's ragged cache config (pages, page size, geometry: eSurge's scheduler reads
    it) plus the pool's settings (:func:`settings`' fields)."""

    options: dict = field(pytree_node=False, default=None)
    window: int | None = field(pytree_node=False, default=None)
    sinks: int | None = field(pytree_node=False, default=None)
    max_seqs: int = field(pytree_node=False, default=ragged.DEFAULT_MAX_SEQS)

    def pool_kwargs(self) -> dict:
        return dict(options=_options.Options(**self.options), dtype=self.kvdtype, window=self.window,
                    sinks=self.sinks, max_seqs=self.max_seqs)


def _pool_bytes(num_pages: int, config) -> int:
    shapes = jax.eval_shape(lambda: ragged.init_pool(num_pages, config.page_size, config.num_kv_heads,
                                                     config.k_headdim, **config.pool_kwargs()))
    return ragged.nbytes(shapes)


def _codes_config(base, values: dict) -> CodesCacheConfig:
    """``base`` (EasyDeL's bfloat16 config) as a :class:`CodesCacheConfig` of the same page
    budget in bytes, or of ``values["num_pages"]`` pages."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    config = CodesCacheConfig(**fields, options=values["options"], window=values["window"], sinks=values["sinks"],
                              max_seqs=values["max_seqs"])
    num_pages = values["num_pages"]
    if num_pages is None:
        shape, _ = base.get_shape_and_axes()  # one layer's bfloat16 pages
        budget = int(np.prod(shape)) * jnp.dtype(base.kvdtype).itemsize
        n = base.num_pages
        per_page = _pool_bytes(n + 1, config) - _pool_bytes(n, config)
        fixed = _pool_bytes(n, config) - n * per_page
        num_pages = max((budget - fixed) // per_page, 1)
    return config.replace(num_pages=int(num_pages), version="v3")


@auto_pytree
class CodesCacheView(RaggedPagesCacheView):
    """One layer's pool. ``kv_pages`` (EasyDeL's bfloat16 pages) is a placeholder scalar, as
    in EasyDeL's ``TurboQuantRaggedPagesCacheView``."""

    pool: ragged.Pool = None

    @classmethod
    def init(cls, config: CodesCacheConfig, layer_index: int | None = None, *, mesh=None, partition_manager=None,
             quantizer=None) -> "CodesCacheView":
        pool = ragged.init_pool(config.num_pages, config.page_size, config.num_kv_heads, config.k_headdim,
                                **config.pool_kwargs())
        if mesh is not None:
            pool = jax.device_put(pool, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        return cls(metadata=config, layer_index=layer_index or 0, kv_pages=jax.device_put(np.zeros((), np.float32)),
                   partition_manager=partition_manager or PartitionManager(PartitionAxis()), pool=pool)

    def concatenate_to_cache(self, key, value, cache_metadata) -> "CodesCacheView":
        """Quantize this step's K/V (``[batch, tokens, kv_heads, head_dim]``, flat over
        sequences) into the slots their sequences' page indices give."""
        md = unwrap_metadata(cache_metadata, "ragged")
        k = key.reshape(-1, *key.shape[-2:])
        v = value.reshape(-1, *value.shape[-2:])
        kv_lens, pages, cu, num_seqs = _rpa_args(md)
        slots, positions = rpa_slots(kv_lens, pages, cu, num_seqs, k.shape[0], self.metadata.page_size)
        return self.replace(pool=ragged.write(self.pool, k, v, slots, positions=positions))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer_index={self.layer_index}, pool={self.pool.config})"

    __str__ = __repr__


def _rpa_args(md):
    if md is None:
        raise ValueError(NO_METADATA.format(version=EASYDEL_VERSION))
    kv_lens = md.context_lens.astype(jnp.int32)
    return kv_lens, md.pages_tables[: kv_lens.shape[0]].astype(jnp.int32), md.query_start_loc.astype(jnp.int32), \
        jnp.reshape(md.num_seqs, (-1,))[:1].astype(jnp.int32)


def rpa_slots(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens: int, page_size: int):
    """Each flat token's slot and position from ragged paged attention's arguments.

    Token ``t`` of sequence ``s`` (rows ``cu_q_lens[s]..cu_q_lens[s+1]``) sits at position
    ``kv_lens[s] - q_len_s + (t - cu_q_lens[s])``, in slot ``page_indices[s, p // page_size]
    * page_size + p % page_size``; tokens past ``cu_q_lens[num_seqs]`` are padding (slot -1).
    This is how tpu-inference's and EasyDeL's RPA v3 kernels place the K/V they write.

    Returns:
        ``(slot_mapping, positions)``, int32 ``[num_tokens]`` each.
    """
    n_seq = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    live_seqs = jnp.minimum(jnp.reshape(num_seqs, (-1,))[0], n_seq)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32), n_seq - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    col = jnp.clip(pos // page_size, 0, page_indices.shape[1] - 1)
    page = page_indices[seq, col]
    live = (t < cu_q_lens[live_seqs]) & (pos >= 0) & (page >= 0)
    return jnp.where(live, page * page_size + pos % page_size, -1), jnp.where(live, pos, 0)


def cache_nbytes(cache) -> int:
    """Bytes of every :class:`CodesCacheView` pool in an EasyDeL cache (``HybridCache``)."""
    return sum(ragged.nbytes(v.pool) for v in getattr(cache, "views", ()) if isinstance(v, CodesCacheView))


# --------------------------------------------------------------------------- attention


def _attend(query, cache_view: CodesCacheView, cache_metadata, softmax_scale=None, logits_soft_cap=None,
            sliding_window=None, softmax_aux=None, **_):
    if logits_soft_cap is not None:
        raise ValueError(UNSUPPORTED.format(what=f"logits_soft_cap={logits_soft_cap}"))
    if softmax_aux is not None:
        raise ValueError(UNSUPPORTED.format(what="a learned softmax sink (softmax_aux)"))
    if isinstance(sliding_window, (tuple, list)):
        left, right = sliding_window
        if right not in (0, None):
            raise ValueError(UNSUPPORTED.format(what=f"a two-sided sliding window {tuple(sliding_window)}"))
        sliding_window = left + 1
    md = unwrap_metadata(cache_metadata, "ragged")
    out = ragged.attend(cache_view.pool, query, *_rpa_args(md), sm_scale=softmax_scale,
                        sliding_window=None if sliding_window is None else int(sliding_window))
    return AttentionOutput(attention_weights=None, attention_outputs=out, cache_view=cache_view)


# --------------------------------------------------------------------------- install


_PATCHES = {}  # (owner, name) -> the original attribute


def installed() -> bool:
    return bool(_PATCHES)


def install() -> None:
    """Make the three changes the module docstring lists (idempotent)."""
    if _PATCHES:
        return
    mixin, view, op = _ed_generation.EasyGenerationMixin, RaggedPagesCacheView, _ed_rpa._RaggedPageAttn
    make_config = mixin.__dict__["_create_standard_ragged_page_cache_config"]
    view_init = view.__dict__["init"].__func__
    forward = op.__dict__["forward_native"]

    @functools.wraps(make_config)
    def create_config(self, *args, **kwargs):
        base = make_config(self, *args, **kwargs)
        values = getattr(self.config.get_text_config(), CONFIG_KEY, None)
        return base if values is None else _codes_config(base, values)

    @functools.wraps(view_init)
    def init(cls, config, *args, **kwargs):
        if isinstance(config, CodesCacheConfig):
            return CodesCacheView.init(config, *args, **kwargs)
        return view_init(cls, config, *args, **kwargs)

    @functools.wraps(forward)
    def forward_native(self, *args, **kwargs):
        if isinstance(kwargs.get("cache_view"), CodesCacheView) and not args:
            return _attend(**kwargs)
        return forward(self, *args, **kwargs)

    for owner, name, new in ((mixin, "_create_standard_ragged_page_cache_config", create_config),
                             (view, "init", classmethod(init)), (op, "forward_native", forward_native)):
        _PATCHES[(owner, name)] = owner.__dict__[name]
        setattr(owner, name, new)


def uninstall() -> None:
    """Restore EasyDeL's originals; models already carrying settings keep them (unused)."""
    while _PATCHES:
        (owner, name), original = _PATCHES.popitem()
        setattr(owner, name, original)
