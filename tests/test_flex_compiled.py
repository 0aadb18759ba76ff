"""book/flex.py compiled: one FlexAttention kernel with a mask_mod and a
score_mod of the book (a sliding window with ALiBi's bias), compiled by
inductor in an empty cache, checked in float32 against eager float64
(tests/test_flex.py checks eager float64 against the book's own code).
Then the same kernel with one tile dropped from its BlockMask: the output
must change on the queries of that tile's row and nowhere else, and equal
eager attention over the keys left. The first check alone could not fail
if the kernel computed every tile (the mask_mod masks them anyway); the
second fails unless the kernel skips the tiles the BlockMask leaves out."""

import shutil

import pytest
import torch
from conftest import BOOK  # noqa: F401  (puts book/ on sys.path)
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import flex

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor needs a C++ compiler: apt-get install g++",
)


def without_tile(mask, row, column):
    """A copy of a BlockMask (one batch row, one head) whose row of tiles
    `row` no longer lists the partial tile `column`."""
    num, indices = mask.kv_num_blocks.clone(), mask.kv_indices.clone()
    n = int(num[0, 0, row])
    kept = [c for c in indices[0, 0, row, :n].tolist() if c != column]
    assert len(kept) == n - 1, "not a partial tile of that row"
    indices[0, 0, row, : n - 1] = torch.tensor(kept)
    num[0, 0, row] = n - 1
    return BlockMask.from_kv_blocks(
        num,
        indices,
        mask.full_kv_num_blocks,
        mask.full_kv_indices,
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=mask.mask_mod,
        seq_lengths=mask.seq_lengths,
    )


def test_compiled_kernel_computes_the_block_masks_tiles_only(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty
    gen = torch.Generator().manual_seed(0)
    Q, K, V = (
        torch.randn(1, 2, 300, 16, generator=gen, dtype=torch.float64)
        for _ in range(3)
    )
    window = flex.sliding_window(100)
    expected = flex.attend(Q, K, V, window, flex.alibi(2))  # eager, float64
    mask = flex.block_mask(window, 300, 300, block=64)
    assert flex.block_counts(mask)[0] < flex.grid(300, 300, 64)  # skips
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(block_mask):
        out = compiled(
            Q.float(), K.float(), V.float(),
            score_mod=flex.alibi(2, dtype=torch.float32),
            block_mask=block_mask,
        )  # fmt: skip
        assert out.dtype == torch.float32
        return out.double()

    torch.testing.assert_close(run(mask), expected, atol=1e-5, rtol=0)

    # the diagonal tile of queries and keys 128 ... 191 left out: each of
    # these queries loses at least its own key, no other query any key
    ours = run(without_tile(mask, 2, 2))
    gap = (ours - expected).abs().amax(dim=(0, 1, 3))  # (T,): per query
    assert (gap[128:192] > 1e-3).all(), gap[128:192].min()
    assert (gap[:128] < 1e-5).all() and (gap[192:] < 1e-5).all()

    def left(b, h, q_idx, kv_idx):  # the window without that tile
        tile = (q_idx // 64 == 2) & (kv_idx // 64 == 2)
        return window(b, h, q_idx, kv_idx) & ~tile

    reference = flex.attend(Q, K, V, left, flex.alibi(2))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
