"""The chapters' kernels run over encrypted channels (CurveZMQ), so ipykernel has no plain-text TCP to warn of."""

from __future__ import annotations

from sphinx.application import Sphinx

from looped_kv.book import encrypt_kernel_channels


def setup(app: Sphinx) -> dict[str, object]:
    encrypt_kernel_channels()
    return {"parallel_read_safe": True, "parallel_write_safe": True}
