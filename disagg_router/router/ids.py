"""Request ids for one P/D dispatch.

vLLM appends ``-<8 hex>`` to every external request id and strips exactly such a suffix again when
it matches a decode registration with a finished prefill (push mode). An id that itself ended in
``-<8 hex>`` could therefore collide after stripping. Ours are 32 lowercase hex characters with no
dash at all, fresh per dispatch (a retry on a fresh pair gets a fresh id).
"""

from __future__ import annotations

import os


def new_request_id() -> str:
    """A fresh dispatch id: 16 random bytes as 32 hex chars (never ends in ``-<8 hex>``); as
    unique as ``uuid4().hex`` without building a ``UUID`` for every request."""
    return os.urandom(16).hex()
