"""torch <-> JAX conversion in tq_jax.bridge._src.dlpack: zero-copy paths, copies, errors."""

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tq_jax.bridge._src import dlpack  # noqa: E402

DTYPES = list(dlpack.SUPPORTED_DTYPES)  # every dtype the bridge says it carries
assert torch.bfloat16 in DTYPES and torch.float16 in DTYPES and torch.float32 in DTYPES  # LMCache's KV dtypes


def aligned(shape, dtype, offset_elems=0):
    """A tensor starting `offset_elems` elements past a 64-byte boundary."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape))
    raw = torch.empty((n + offset_elems) * itemsize + 64, dtype=torch.uint8)
    start = -raw.data_ptr() % 64
    flat = raw[start : start + (n + offset_elems) * itemsize].view(dtype)
    t = flat[offset_elems:].view(shape)
    if dtype.is_floating_point:
        t.copy_(torch.randn(shape).to(dtype))
    else:
        info = torch.iinfo(dtype)
        t.copy_(torch.randint(max(info.min, -100), min(info.max, 100), shape, dtype=dtype))
    return t


def values(x):
    """float64 numpy copy of a torch tensor or JAX array, for comparisons."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aligned_contiguous_is_zero_copy(dtype):
    t = aligned((2, 3, 64), dtype)
    arr, copied = dlpack.to_jax_ex(t)
    assert not copied
    assert arr.unsafe_buffer_pointer() == t.data_ptr()
    assert arr.shape == (2, 3, 64)
    assert arr.dtype == dlpack._NUMPY_DTYPES[dtype]
    np.testing.assert_array_equal(values(arr), values(t))


def test_zero_copy_aliases_the_tensor_memory():
    t = aligned((128,), torch.float32)
    arr, copied = dlpack.to_jax_ex(t)
    assert not copied
    t[0] = 1234.0
    assert float(np.asarray(arr)[0]) == 1234.0


@pytest.mark.parametrize(
    "dtype, offset", [(torch.uint8, 1), (torch.bfloat16, 1), (torch.float32, 3)], ids=str
)
def test_misaligned_view_is_copied(dtype, offset):
    t = aligned((1024,), dtype, offset_elems=offset)
    assert t.data_ptr() % dlpack.CPU_ALIGNMENT != 0
    arr, copied = dlpack.to_jax_ex(t)
    assert copied
    assert arr.unsafe_buffer_pointer() != t.data_ptr()
    np.testing.assert_array_equal(values(arr), values(t))
    before = values(arr)
    t[0] = t[0] + 1  # the copy must not see later writes to the source
    np.testing.assert_array_equal(values(arr), before)


def test_jax_itself_refuses_to_alias_misaligned_cpu_memory():
    # Guards CPU_ALIGNMENT: jax copies silently under copy=None, raises under copy=False.
    t = torch.empty(1025, dtype=torch.uint8)[1:]
    if t.data_ptr() % 64 == 0:
        t = torch.empty(1026, dtype=torch.uint8)[2:]
    with pytest.raises(ValueError, match="not aligned to 64 bytes"):
        jax.dlpack.from_dlpack(t, copy=False)
    assert jax.dlpack.from_dlpack(t).unsafe_buffer_pointer() != t.data_ptr()


def test_plain_misaligned_slice_from_brief():
    base = aligned((1025,), torch.uint8)
    arr, copied = dlpack.to_jax_ex(base[1:])
    assert copied
    np.testing.assert_array_equal(np.asarray(arr), base[1:].numpy())


@pytest.mark.parametrize(
    "view",
    [lambda x: x.t(), lambda x: x[:, ::2], lambda x: x[:, 16:32]],
    ids=["transpose", "step", "columns"],
)
def test_non_contiguous_is_copied(view):
    x = aligned((64, 64), torch.bfloat16)
    t = view(x)
    assert not t.is_contiguous()
    arr, copied = dlpack.to_jax_ex(t)
    assert copied
    assert arr.shape == tuple(t.shape)
    np.testing.assert_array_equal(values(arr), values(t))


def test_requires_grad_tensor_converts_without_copy():
    t = aligned((32,), torch.float32).requires_grad_(True)
    arr, copied = dlpack.to_jax_ex(t)
    assert not copied
    np.testing.assert_array_equal(values(arr), values(t))


def test_empty_and_scalar():
    arr, _ = dlpack.to_jax_ex(torch.empty(0, dtype=torch.float32))
    assert arr.shape == (0,)
    arr, _ = dlpack.to_jax_ex(torch.tensor(2.5, dtype=torch.bfloat16))
    assert arr.shape == () and float(arr) == 2.5


def test_pinned_shim_exports_as_plain_cpu():
    # Real pinned memory needs an accelerator; the shim itself must alias a CPU tensor.
    t = aligned((256,), torch.bfloat16)
    arr = jax.dlpack.from_dlpack(dlpack._AsCPU(t))
    assert arr.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(values(arr), values(t))


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.float64, torch.bool, torch.complex64], ids=str
)
def test_unsupported_dtype_raises_value_error(dtype):
    with pytest.raises(ValueError, match="supported dtypes are bfloat16, float16, float32, uint8"):
        dlpack.to_jax(torch.zeros(4, dtype=dtype))


def test_non_tensor_raises_type_error():
    with pytest.raises(TypeError, match="must be a torch.Tensor, got ndarray"):
        dlpack.to_jax(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="must be a jax.Array, got Tensor"):
        dlpack.to_torch(torch.zeros(4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(dtype):
    t = aligned((4, 8, 16), dtype)
    back = dlpack.to_torch(dlpack.to_jax(t))
    assert back.dtype == dtype
    assert back.shape == t.shape
    assert torch.equal(back, t)


def test_to_torch_is_zero_copy_on_cpu():
    a = jax.jit(lambda x: x * 2)(jnp.arange(1024, dtype=jnp.bfloat16))
    t = dlpack.to_torch(a)
    assert t.dtype == torch.bfloat16
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(values(t), values(a))


def test_copy_into_casts_and_reshapes():
    a = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4) / 8
    dst = torch.empty(2, 12, dtype=torch.bfloat16)
    dlpack.copy_into(dst, a)
    np.testing.assert_array_equal(values(dst), np.asarray(a).reshape(2, 12))


def test_copy_into_non_contiguous_destination():
    base = torch.zeros(8, 6, dtype=torch.float32)
    dst = base.t()  # (6, 8) view, not contiguous
    a = jnp.arange(48, dtype=jnp.bfloat16).reshape(6, 8)
    dlpack.copy_into(dst, a)
    np.testing.assert_array_equal(base.t().numpy(), np.asarray(a).astype(np.float32))


def test_copy_into_element_count_mismatch():
    with pytest.raises(ValueError, match=r"source shape \(3,\) has 3 elements but dst"):
        dlpack.copy_into(torch.empty(4), jnp.zeros(3))


def test_numpy_view_uint8_is_writable_alias():
    t = torch.zeros(64, dtype=torch.uint8)
    v = dlpack.numpy_view(t)
    assert v.dtype == np.uint8
    assert v.ctypes.data == t.data_ptr()
    v[3] = 9
    assert int(t[3]) == 9


def test_numpy_view_bf16_is_writable_alias():
    t = aligned((4, 16), torch.bfloat16)
    v = dlpack.numpy_view(t)
    assert v.dtype == np.dtype(ml_dtypes.bfloat16)
    assert v.ctypes.data == t.data_ptr()
    assert v.shape == (4, 16)
    np.testing.assert_array_equal(v.astype(np.float64), values(t))
    v[0, 0] = 1.5
    assert float(t[0, 0]) == 1.5


def test_numpy_view_rejects_non_cpu():
    with pytest.raises(ValueError, match="needs a CPU tensor, got one on meta"):
        dlpack.numpy_view(torch.empty(4, dtype=torch.uint8, device="meta"))
