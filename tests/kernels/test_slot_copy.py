import pytest
import torch

from flashrt.kernels import masked_copy_rows, masked_copy_rows_reference
from flashrt.kernels.slot_copy import masked_copy_rows_triton, scatter_rows_reference, scatter_rows_triton
from tests.kernels.kernel_devices import DEVICES


def test_reference_copies_only_masked_rows():
    dst = torch.arange(12, dtype=torch.int64).view(4, 3)
    src = -dst
    masked_copy_rows(dst, src, torch.tensor([False, True, False, True]))
    assert dst.tolist() == [[0, 1, 2], [-3, -4, -5], [6, 7, 8], [-9, -10, -11]]


def test_reference_gathers_indexed_rows():
    dst = torch.zeros(3, 2, dtype=torch.int64)
    src = torch.arange(10, dtype=torch.int64).view(5, 2)
    masked_copy_rows(dst, src, torch.tensor([True, False, True]), torch.tensor([4, 0, 1]))
    assert dst.tolist() == [[8, 9], [0, 0], [2, 3]]


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="of one row length and dtype"):
        masked_copy_rows(torch.zeros(4, 3), torch.zeros(4, 2), torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows", "row_len", "dtype"), [(1, 8, torch.int64), (64, 3000, torch.int64), (7, 5, torch.uint8)]
)
def test_triton_kernel_matches_reference_and_leaves_unmasked_rows(device, rows, row_len, dtype):
    g = torch.Generator(device=device).manual_seed(rows)
    for density in (0.0, 0.3, 1.0):
        src = torch.randint(0, 100, (rows, row_len), device=device, generator=g).to(dtype)
        poison = torch.full((rows, row_len), 77, device=device, dtype=dtype)  # unwritten rows must stay 77
        mask = torch.rand(rows, device=device, generator=g) < density
        got, want = poison.clone(), poison.clone()
        masked_copy_rows_triton(got, src, mask)
        masked_copy_rows_reference(want, src, mask)
        assert torch.equal(got, want)
        index = torch.randint(0, rows, (rows,), device=device, generator=g)
        got, want = poison.clone(), poison.clone()
        masked_copy_rows_triton(got, src, mask, index)
        masked_copy_rows_reference(want, src, mask, index)
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "row_len"), [(5, 3), (64, 3000)])
def test_scatter_rows_broadcast_fork_and_per_row(device, rows, row_len):
    g = torch.Generator(device=device).manual_seed(rows)
    arena = torch.randint(0, 1 << 40, (rows, row_len), device=device, generator=g)
    targets = torch.randperm(rows, device=device, generator=g)[: rows // 2 + 1]
    for src in (arena[2:3], torch.randint(0, 9, (len(targets), row_len), device=device, generator=g)):
        got, want = arena.clone(), arena.clone()
        source = got[2:3] if src.shape[0] == 1 else src  # a fork reads a live row of the same arena
        scatter_rows_triton(got, targets, source)
        scatter_rows_reference(want, targets, src if src.shape[0] > 1 else want[2:3])
        assert torch.equal(got, want)
        untouched = torch.ones(rows, dtype=torch.bool, device=device)
        untouched[targets] = False
        assert torch.equal(got[untouched], arena[untouched])
