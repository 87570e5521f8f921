"""The entropy-coder study's own checks: the row code is a valid length-limited prefix
code whose decoder inverts its encoder, the page code (static rANS) round-trips and
spends what its table prices plus its flush, and the design cells have the design's
probabilities."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.studies import ecsq_coders as E


@pytest.fixture(scope="module", params=[(4.7, 12), (3.5, 10)])
def design(request):
    return E.Design(*request.param)


def test_code_is_prefix_free_within_its_length_limit(design):
    lengths, codes = design.lengths, design.codes
    assert lengths.max() <= design.max_len
    assert (2.0 ** -lengths.astype(float)).sum() <= 1.0  # Kraft
    words = [format(int(c), f"0{int(n)}b") for c, n in zip(codes, lengths)]
    for i, a in enumerate(words):
        for j, b in enumerate(words):
            assert i == j or not b.startswith(a), (a, b)


def test_redundancy_is_small_and_nonnegative(design):
    """A prefix code spends at least the entropy, and Huffman less than one bit more;
    length-limited at these rates it stays within a tenth of a bit."""
    assert abs(design.cell_entropy - design.entropy) < 1e-3  # the step hits the design entropy
    assert 0 <= design.mean_length - design.cell_entropy < 0.1


def test_decode_table_names_each_window_by_its_leading_code(design):
    m = design.max_len
    for s in np.nonzero(design.p > 1e-6)[0][:: max(1, len(design.p) // 12)]:
        n, c = int(design.lengths[s]), int(design.codes[s])
        for tail in (0, (1 << (m - n)) - 1):
            w = (c << (m - n)) | tail
            assert (design.sym[w], design.len[w]) == (s, n)


def test_rows_round_trip_and_overflow_is_flagged(design):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, E.D))
    idx = design.indices(x)
    bits = design.row_bits(idx)  # a budget some rows overflow: the one nearest half
    row_bytes = min(range(int(bits.min()) // 8, int(bits.max()) // 8 + 2), key=lambda r: abs((bits <= 8 * r).mean() - 0.5))
    rows, fits = design.encode(idx, row_bytes)
    assert rows.shape == (512, row_bytes)
    assert 0 < fits.mean() < 1
    np.testing.assert_array_equal(fits, design.row_bits(idx) <= 8 * row_bytes)
    got = np.asarray(E.decoder(design, row_bytes)(jnp.asarray(rows)))
    np.testing.assert_array_equal(got[fits], idx[fits])


def test_indices_follow_the_design_probabilities():
    """Normalised Gaussian vectors land in the cells with the design's probabilities."""
    des = E.Design(3.5, 12)
    idx = des.indices(np.random.default_rng(4).standard_normal((20000, E.D)))
    freq = np.bincount(idx.ravel(), minlength=len(des.p)) / idx.size
    assert np.abs(freq - des.p).max() < 0.01


@pytest.mark.parametrize("entropy,page", [(4.7, 16), (3.4, 4)])
def test_pages_round_trip_and_spend_near_the_table_entropy(entropy, page):
    """rANS pages decode to their indices; a page spends the quantised table's cross
    entropy plus at most its 32-bit flush and a word of rounding, and a page budget one
    word short of a page's length refuses exactly that page."""
    des = E.Design(entropy, 12)
    code = E.PageCode(des, page)
    assert code.freq.sum() == 1 << E.PREC and code.freq.min() >= 1
    assert code.static_bits >= des.cell_entropy
    idx = des.indices(np.random.default_rng(5).standard_normal((64 * page, E.D))).reshape(64, page * E.D)
    _, _, used = code.encode(idx, None)
    bits = used * 16 / (page * E.D)
    price = -np.log2(code.freq[idx] / (1 << E.PREC)).sum(axis=1) / (page * E.D)
    assert np.all(bits >= price) and np.all(bits <= price + (32 + 16) / (page * E.D))
    words = int(np.median(used))
    pages, fits, _ = code.encode(idx, words)
    np.testing.assert_array_equal(fits, used <= words)
    got = np.asarray(E.page_decoder(code, words)(jnp.asarray(pages)))
    np.testing.assert_array_equal(got[fits], idx[fits])
