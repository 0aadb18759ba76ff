"""book/flex.py compiled: one FlexAttention kernel with a mask_mod and a
score_mod of the book (a sliding window with ALiBi's bias), compiled by
inductor in an empty cache, checked in float32 against eager float64
(tests/test_flex.py checks eager float64 against the book's own code).
Its BlockMask skips tiles, which eager FlexAttention never does: this is
the one test of the tiles the kernel leaves out."""

import shutil

import pytest
import torch
from conftest import BOOK  # noqa: F401  (puts book/ on sys.path)
from torch.nn.attention.flex_attention import flex_attention

import flex

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor needs a C++ compiler: apt-get install g++",
)


def test_compiled_window_with_alibi_is_eager_float64(tmp_path, monkeypatch):
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
    ours = compiled(
        Q.float(), K.float(), V.float(),
        score_mod=flex.alibi(2, dtype=torch.float32), block_mask=mask,
    )  # fmt: skip
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=0)
