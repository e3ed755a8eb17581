"""worker/postprocess.py combine: the weighted mean of the rows that share an output, against its
definition (np.add.at's scatter), for rows in any order, outputs of one row and outputs of many (CHUNK_MEAN windows)."""
import numpy as np
import pytest

from pollen.worker.postprocess import combine


def by_definition(rows, out_index, weights, n_out):
    sums = np.zeros((n_out, rows.shape[1]))
    np.add.at(sums, out_index, rows.astype(np.float64) * weights[:, None])
    return sums / np.bincount(out_index, weights=weights, minlength=n_out)[:, None]


@pytest.mark.parametrize("n_rows, n_out, shuffled", [(1, 1, False), (40, 40, False), (40, 40, True), (50, 7, False),
                                                     (50, 7, True), (300, 1, False)])
def test_combine_is_the_weighted_mean_per_output(n_rows, n_out, shuffled):
    rng = np.random.default_rng(n_rows + n_out)
    rows = rng.standard_normal((n_rows, 24)).astype(np.float32)
    out_index = np.sort(np.r_[np.arange(n_out), rng.integers(0, n_out, n_rows - n_out)])
    weights = rng.random(n_rows) + 0.5
    if shuffled:
        order = rng.permutation(n_rows)
        rows, out_index, weights = rows[order], out_index[order], weights[order]
    np.testing.assert_allclose(combine(rows, out_index, weights, n_out), by_definition(rows, out_index, weights, n_out),
                               rtol=1e-5, atol=1e-6)


def test_one_row_per_output_is_that_row():
    rows = np.random.default_rng(0).standard_normal((30, 8)).astype(np.float32)
    np.testing.assert_allclose(combine(rows, np.arange(30), np.ones(30), 30), rows, rtol=1e-6)
    # weights other than 1 divide out
    np.testing.assert_allclose(combine(rows, np.arange(30), np.full(30, 2.0), 30), rows, rtol=1e-6)
