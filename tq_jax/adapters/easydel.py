"""EasyDeL's eSurge serving and ``model.generate`` on tq_jax's compressed KV cache.

::

    import easydel as ed
    from tq_jax.adapters import easydel as tq_easydel

    model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
        path, config_kwargs=ed.EasyDeLBaseConfigDict(attn_mechanism="ragged_page_attention_v3"))
    tq_easydel.use(model, "turbo-4")        # or None (4/4 bits), "turbo-3.5", "turbo-2.5", a tq_jax.Options
    engine = ed.eSurge(model=model, tokenizer=path, max_model_len=4096, max_num_seqs=16)
    with model.mesh:                         # or EasyDeL's own generation loop
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=False)

Under eSurge every layer's K/V live in a :class:`tq_jax._src.kvcache.ragged.Pool` (packed
TurboQuant codes and float16 norms, plus small exact pools for each sequence's recent
window and sinks), written once per token and read by :func:`tq_jax._src.kvcache.ragged.attend`,
which scores the codes directly. eSurge's scheduler, page allocator and batch preparation
are EasyDeL's own: the pool takes the page indices eSurge gives. Under ``model.generate``
(which builds no ragged metadata) every layer holds a per-sequence
:class:`tq_jax._src.kvcache.KVCache` instead (:class:`SequenceCacheView`), written by
:func:`tq_jax._src.kvcache.append` and read by :func:`tq_jax._src.kvcache.attend`; left padding is
dropped when the prompt is written, other padding is refused.

This module only maps names: the caches and their attention are :mod:`tq_jax._src.kvcache`
and :mod:`tq_jax._src.kvcache.ragged` (tested without EasyDeL). EasyDeL has no registry of cache
classes, so it makes five changes to the installed package, each of which dispatches on
this module's own types or settings and otherwise calls EasyDeL's code unchanged
(:func:`install`; :func:`uninstall` undoes them):

1. ``EasyGenerationMixin._create_standard_ragged_page_cache_config``: for a model that
   carries settings (:func:`use`), the ragged cache config is a :class:`CodesCacheConfig`.
2. ``RaggedPagesCacheView.init``: a :class:`CodesCacheConfig` gives a :class:`CodesCacheView`.
3. ``_RaggedPageAttn.forward_native`` (the ``ragged_page_attention_v3`` operation's):
   a :class:`CodesCacheView` is attended by :func:`tq_jax._src.kvcache.ragged.attend`, a
   :class:`SequenceCacheView` by :func:`tq_jax._src.kvcache.attend`. This is where EasyDeL
   dispatches its own ``TurboQuantRaggedPagesCacheView``, one level down.
4. ``EasyGenerationMixin.init_operations_cache``: for a model that carries settings and
   no ragged (or unified) config given — ``model.generate``'s call; eSurge always passes
   its config — a ``HybridCache`` of :class:`SequenceCacheView`, one per layer.
5. ``EasyGenerationMixin.prepare_inputs_for_generation``: for a model that carries
   settings, the prompt's padding is checked (left padding only) and each row's leading
   padding passed on as ``starts``, which (4) gives the cache.

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

from tq_jax._src import kvcache
from tq_jax._src import options as _options
from tq_jax._src.kvcache import ragged
from tq_jax._src.kvcache import state as _kv_state

__all__ = ["EASYDEL_VERSION", "CONFIG_KEY", "CodesCacheConfig", "CodesCacheView", "SequenceCacheView", "install",
           "uninstall", "installed", "use", "settings", "rpa_slots", "cache_nbytes"]

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
    "tq_jax's ragged pool was called without ragged paged attention metadata (page tables, KV lengths, query "
    "starts), which only eSurge builds in EasyDeL {version}: a cache made with ragged_config= needs them. For "
    "model.generate let it build its own cache (init_operations_cache without ragged_config gives tq_jax's "
    "per-sequence cache); to serve, use eSurge (ed.eSurge(model=model, ...))."
)
PADDING = (
    "model.generate on tq_jax's cache takes left-padded prompts only, but row {row}'s mask is {mask}: tq_jax._src.kvcache "
    "keeps each sequence's tokens contiguous from position 0 and attends causally, so it can drop leading padding "
    "but cannot mask a token after the first real one. {why}Pass attention_mask= with zeros only before each "
    "prompt (a tokenizer with padding_side='left'), or generate the rows one by one."
)
NO_PAD_MASK = (
    "Without attention_mask EasyDeL masks every pad_token_id ({pad}) token of the prompt, so a prompt may contain it "
    "only as leading padding; with attention_mask= the ids themselves are not checked. "
)
TRACED_PROMPT = (
    "model.generate on tq_jax's cache checks the prompt's padding before it builds the cache, so the prompt (input_ids "
    "and attention_mask) must be concrete: call model.generate outside jax.jit."
)
OWN_MASK_INFO = (
    "model.generate on tq_jax's cache was given mask_info=: the cache attends causally over each sequence's tokens "
    "and cannot apply an arbitrary mask. Pass attention_mask= (left padding only) instead."
)
GENERATE_WINDOW = (
    "this layer attends over a sliding window of {window} tokens, shorter than model.generate's {max_len}: "
    "tq_jax._src.kvcache.attend sees every earlier token of the sequence, so it would attend past the window. Generate "
    "at most {window} tokens in all (prompt + new), serve it with eSurge (whose ragged attention honours the window), "
    "or with EasyDeL's own cache (tq_easydel.use(model, False))."
)
NOT_ATTENTION_ONLY = (
    "model.generate on tq_jax's cache serves models whose every layer is ragged paged attention, but layer {layer}'s "
    "cache is a {view}: serve this model with EasyDeL's own cache (tq_easydel.use(model, False))."
)
UNSUPPORTED = (
    "{what} is not supported by tq_jax's ragged attention (tq_jax._src.kvcache.ragged.attend takes a softmax scale and "
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
            (:func:`tq_jax._src.kvcache.ragged.init_pool`'s defaults: 128 or 256, and 4).
        max_seqs: sequences whose window and sinks are kept at once: eSurge's
            ``max_num_seqs``.
        num_pages: pages per layer; default: as many as the bytes eSurge would have
            given a bfloat16 cache buy (its ``hbm_utilization`` budget).

    Raises:
        ValueError: what :func:`tq_jax._src.kvcache.ragged.init_pool` refuses, checked on a
            one-head probe pool.
    """
    opts = _options_of(options)
    # a probe pool large enough for any window and sinks asked for: the pool eSurge builds
    # is sized by its own budget, so the probe must not bound them (validates, allocates nothing)
    asked = sum(x for x in (window, sinks) if isinstance(x, int) and not isinstance(x, bool) and x > 0)
    pages = max(64, -(-asked // 16) + 2)
    probe = jax.eval_shape(lambda: ragged.init_pool(pages, 16, 1, 64, options=opts, window=window, sinks=sinks,
                                                    max_seqs=max_seqs))
    del probe
    if num_pages is not None and (not isinstance(num_pages, int) or num_pages < 1):
        raise ValueError(f"`num_pages` must be None or an int >= 1, got {num_pages!r}: pages per layer of the pool.")
    return {"options": dataclasses.asdict(opts), "window": window, "sinks": sinks, "max_seqs": int(max_seqs),
            "num_pages": num_pages}


def _options_of(options) -> _options.Options:
    """``options`` as :func:`tq_jax._src.kvcache.init` takes them, or a stored :func:`settings` dict."""
    return _options.Options(**options) if isinstance(options, dict) else _kv_state.resolve_options(options, {})


def use(model, options=None, **kwargs):
    """Serve ``model`` on tq_jax's cache: :func:`install`, then store :func:`settings` on its
    text config (``options=False`` removes them). Returns ``model``.

    The model's ``attn_mechanism`` must be ``ragged_page_attention_v3`` (eSurge's default
    on CPU and TPU; on GPU pass it explicitly). Call it before building the eSurge engine,
    which sizes the cache when it starts, or before ``model.generate``, which builds a
    per-sequence cache of ``max_length`` tokens on each call (``window`` and ``sinks``
    clipped to it; ``max_seqs`` and ``num_pages`` are eSurge's and unused there).

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


# --------------------------------------------------------------------------- model.generate's cache


@auto_pytree
class SequenceCacheView(RaggedPagesCacheView):
    """One layer's per-sequence cache for ``model.generate``: a :class:`tq_jax._src.kvcache.KVCache`
    (batch rows, each sequence's tokens contiguous from position 0, exact window and sinks).

    ``pads`` (int32 ``[batch]``) counts each row's leading padding not yet dropped: the
    first :meth:`concatenate_to_cache` (the prompt) shifts row ``b``'s K/V left by
    ``pads[b]`` and stores ``q_len - pads[b]`` tokens, then sets ``pads`` to 0. The
    prompt's queries stay where they are: :func:`tq_jax._src.kvcache.attend` places query ``j``
    of row ``b`` at ``lengths[b] - q_len + j = j - pads[b]``, the position its key got, and
    a padding query (a negative position) sees nothing. ``kv_pages`` is a placeholder
    scalar, as in :class:`CodesCacheView`.
    """

    cache: kvcache.KVCache = None
    pads: jax.Array = None

    @classmethod
    def create(cls, cache: kvcache.KVCache, pads, layer_index: int, partition_manager=None) -> "SequenceCacheView":
        return cls(metadata=None, layer_index=layer_index, kv_pages=jnp.zeros((), jnp.float32),
                   partition_manager=partition_manager or PartitionManager(PartitionAxis()), cache=cache,
                   pads=jnp.asarray(pads, jnp.int32))

    def concatenate_to_cache(self, key, value, cache_metadata=None) -> "SequenceCacheView":
        """Append this step's K/V (``[batch, q_len, kv_heads, head_dim]``, RoPE applied)
        through :func:`tq_jax._src.kvcache.append`, the prompt's leading padding dropped."""
        n = key.shape[1]
        cache = self.cache
        if not cache.config.paged:
            # Each row owns pool page b (docs/kvcache.md). Beam search gathers every leaf along
            # the batch axis between steps, codes and page table alike, so the rows' codes have
            # moved with them and the table is the identity again.
            cache = dataclasses.replace(cache, page_table=jnp.arange(cache.lengths.shape[0], dtype=jnp.int32)[:, None])
        pads = jnp.minimum(self.pads, n)
        src = jnp.minimum(jnp.arange(n, dtype=jnp.int32)[None, :] + pads[:, None], n - 1)[:, :, None, None]
        k = jnp.take_along_axis(key, src, axis=1)
        v = jnp.take_along_axis(value, src, axis=1)
        cache = kvcache.append(cache, k, v, new_lengths=n - pads)
        return self.replace(cache=cache, pads=jnp.zeros_like(self.pads))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer_index={self.layer_index}, cache={self.cache.config})"

    __str__ = __repr__


def _settings_of(model):
    return getattr(model.config.get_text_config(), CONFIG_KEY, None)


def _leading_pads(model, input_ids, pad_token_id, attention_mask, mask_info) -> np.ndarray:
    """Each prompt row's leading padding under the mask EasyDeL's generate uses (the
    attention mask, else ``input_ids != pad_token_id``); refuses any other padding."""
    if mask_info is not None:
        raise ValueError(OWN_MASK_INFO)
    try:
        if attention_mask is not None:
            mask, why = np.asarray(attention_mask).astype(bool), ""
        else:
            pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
            pad = np.asarray(pad_token_id if pad is None else pad).item()
            mask, why = np.asarray(input_ids) != pad, NO_PAD_MASK.format(pad=pad)
    except jax.errors.TracerArrayConversionError:
        raise ValueError(TRACED_PROMPT) from None
    mask = mask.reshape(mask.shape[0], -1)
    starts = (np.cumsum(mask, axis=-1) == 0).sum(-1)
    for row, (m, s) in enumerate(zip(mask, starts)):
        if s == m.shape[0] or not m[s:].all():
            shown = "".join("1" if x else "0" for x in m)
            raise ValueError(PADDING.format(row=row, mask=shown if len(shown) <= 64 else shown[:60] + "...", why=why))
    return starts.astype(np.int32)


def _sequence_cache(model, values: dict, batch_size: int, max_length: int, starts, dtype=None):
    """``model.generate``'s cache: a HybridCache of :class:`SequenceCacheView`, one
    :func:`tq_jax._src.kvcache.init` cache of ``max_length`` tokens per layer, exact tokens in
    ``dtype`` (default the model's ``kvdtype``)."""
    from easydel.caching import HybridCache

    text = model.config.get_text_config()
    for layer, view in sorted(model.get_operations_cache_view().items()):
        if view is not RaggedPagesCacheView:
            raise ValueError(NOT_ATTENTION_ONLY.format(layer=layer, view=getattr(view, "__name__", view)))
    heads, head_dim = _ed_generation._resolve_standard_ragged_layer_geometry(text_config=text, layer_idx=None)
    dtype = text.kvdtype if dtype is None else dtype
    dtype = getattr(jnp, dtype) if isinstance(dtype, str) else dtype
    clip = lambda n: None if n is None else min(int(n), int(max_length))  # noqa: E731
    pads = jnp.zeros((batch_size,), jnp.int32) if starts is None else \
        jnp.broadcast_to(jnp.asarray(starts, jnp.int32), (batch_size,))
    cache = kvcache.init(int(batch_size), int(max_length), int(heads), int(head_dim),
                         options=_options.Options(**values["options"]), window=clip(values["window"]),
                         sinks=clip(values["sinks"]), dtype=dtype)
    mesh = getattr(text, "mesh", None)
    if mesh is not None:
        cache = jax.device_put(cache, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    shared = text.get_kv_shared_layer_mapping()
    views = [None if i in shared else SequenceCacheView.create(cache, pads, i, text.partition_manager)
             for i in range(text.num_hidden_layers)]
    return HybridCache(views=views)


# --------------------------------------------------------------------------- attention


def _window_tokens(logits_soft_cap, sliding_window, softmax_aux):
    """The tokens a sliding window lets a query see (None: all), after refusing what
    neither attention of tq_jax serves."""
    if logits_soft_cap is not None:
        raise ValueError(UNSUPPORTED.format(what=f"logits_soft_cap={logits_soft_cap}"))
    if softmax_aux is not None:
        raise ValueError(UNSUPPORTED.format(what="a learned softmax sink (softmax_aux)"))
    if isinstance(sliding_window, (tuple, list)):
        left, right = sliding_window
        if right not in (0, None):
            raise ValueError(UNSUPPORTED.format(what=f"a two-sided sliding window {tuple(sliding_window)}"))
        sliding_window = left + 1
    return None if sliding_window is None else int(sliding_window)


def _attend_sequences(query, cache_view: SequenceCacheView, softmax_scale=None, logits_soft_cap=None,
                      sliding_window=None, softmax_aux=None, **_):
    """``model.generate``'s attention: :func:`tq_jax._src.kvcache.attend` (which scales by
    ``1/sqrt(head_dim)``) on the query rescaled to the model's softmax scale."""
    window = _window_tokens(logits_soft_cap, sliding_window, softmax_aux)
    max_len = cache_view.cache.config.max_len
    if window is not None and window < max_len:
        raise ValueError(GENERATE_WINDOW.format(window=window, max_len=max_len))
    head_dim = query.shape[-1]
    factor = 1.0 if softmax_scale is None else float(softmax_scale) * head_dim ** 0.5
    q = query if abs(factor - 1.0) < 1e-6 else (query.astype(jnp.float32) * factor)
    q = q.reshape(cache_view.cache.lengths.shape[0], -1, *query.shape[-2:])  # EasyDeL flattens [batch * q_len, ...]
    out = kvcache.attend(cache_view.cache, q).astype(query.dtype).reshape(query.shape)
    return AttentionOutput(attention_weights=None, attention_outputs=out, cache_view=cache_view)


def _attend(query, cache_view: CodesCacheView, cache_metadata, softmax_scale=None, logits_soft_cap=None,
            sliding_window=None, softmax_aux=None, **_):
    sliding_window = _window_tokens(logits_soft_cap, sliding_window, softmax_aux)
    md = unwrap_metadata(cache_metadata, "ragged")
    out = ragged.attend(cache_view.pool, query, *_rpa_args(md), sm_scale=softmax_scale, sliding_window=sliding_window)
    return AttentionOutput(attention_weights=None, attention_outputs=out, cache_view=cache_view)


# --------------------------------------------------------------------------- install


_PATCHES = {}  # (owner, name) -> the original attribute


def installed() -> bool:
    return bool(_PATCHES)


def install() -> None:
    """Make the five changes the module docstring lists (idempotent)."""
    if _PATCHES:
        return
    mixin, view, op = _ed_generation.EasyGenerationMixin, RaggedPagesCacheView, _ed_rpa._RaggedPageAttn
    make_config = mixin.__dict__["_create_standard_ragged_page_cache_config"]
    init_cache = mixin.__dict__["init_operations_cache"]
    prepare = mixin.__dict__["prepare_inputs_for_generation"]
    view_init = view.__dict__["init"].__func__
    forward = op.__dict__["forward_native"]

    @functools.wraps(make_config)
    def create_config(self, *args, **kwargs):
        base = make_config(self, *args, **kwargs)
        values = _settings_of(self)
        return base if values is None else _codes_config(base, values)

    @functools.wraps(init_cache)
    def init_operations_cache(self, batch_size, max_length, **kwargs):
        values = _settings_of(self)
        if values is None or kwargs.get("ragged_config") is not None or kwargs.get("unified_config") is not None:
            return init_cache(self, batch_size, max_length, **kwargs)
        return _sequence_cache(self, values, batch_size, max_length, kwargs.get("starts"), kwargs.get("dtype"))

    @functools.wraps(prepare)
    def prepare_inputs_for_generation(self, input_ids, max_length, pad_token_id, starts=None, shardings=None,
                                      attention_mask=None, token_type_ids=None, mask_info=None):
        if _settings_of(self) is not None:
            starts = _leading_pads(self, input_ids, pad_token_id, attention_mask, mask_info)
        return prepare(self, input_ids, max_length, pad_token_id, starts=starts, shardings=shardings,
                       attention_mask=attention_mask, token_type_ids=token_type_ids, mask_info=mask_info)

    @functools.wraps(view_init)
    def init(cls, config, *args, **kwargs):
        if isinstance(config, CodesCacheConfig):
            return CodesCacheView.init(config, *args, **kwargs)
        return view_init(cls, config, *args, **kwargs)

    @functools.wraps(forward)
    def forward_native(self, *args, **kwargs):
        cache_view = kwargs.get("cache_view")
        if isinstance(cache_view, SequenceCacheView) and not args:
            return _attend_sequences(**kwargs)
        if isinstance(cache_view, CodesCacheView) and not args:
            return _attend(**kwargs)
        return forward(self, *args, **kwargs)

    for owner, name, new in ((mixin, "_create_standard_ragged_page_cache_config", create_config),
                             (mixin, "init_operations_cache", init_operations_cache),
                             (mixin, "prepare_inputs_for_generation", prepare_inputs_for_generation),
                             (view, "init", classmethod(init)), (op, "forward_native", forward_native)):
        _PATCHES[(owner, name)] = owner.__dict__[name]
        setattr(owner, name, new)


def uninstall() -> None:
    """Restore EasyDeL's originals; models already carrying settings keep them (unused)."""
    while _PATCHES:
        (owner, name), original = _PATCHES.popitem()
        setattr(owner, name, original)
