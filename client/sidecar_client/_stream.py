"""Assemble a streamed generation (per-chunk text and ids) and record it once, at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sidecar_client._models import RecordResult

if TYPE_CHECKING:
    from sidecar_client._async import AsyncSidecarClient
    from sidecar_client._sync import SidecarClient

__all__ = ["OutputAssembler"]


class OutputAssembler:
    """Accumulates the deltas of ONE choice of one request. Not thread-safe.

        asm = OutputAssembler("qwen3", prompt_text=r.prompt_text, prompt_token_ids=r.token_ids)
        for chunk in stream:
            asm.add(chunk.text, chunk.token_ids)
        asm.record(client, finish_reason=chunk.finish_reason, stop_reason=chunk.stop_reason)

    Recording twice is refused (``RuntimeError``): one generation, one record.
    """

    def __init__(self, model: str, *, prompt_text: str, prompt_token_ids: Sequence[int],
                 cache_salt: str | None = None, prompt_add_special_tokens: bool = False) -> None:
        self.model = model
        self.prompt_text = prompt_text
        self.prompt_token_ids = list(prompt_token_ids)
        self.cache_salt = cache_salt
        self.prompt_add_special_tokens = prompt_add_special_tokens
        self._text: list[str] = []
        self._ids: list[int] = []
        self._done = False

    def add(self, text: str, token_ids: Sequence[int]) -> None:
        """Append one chunk's text delta and id delta."""
        if self._done:
            raise RuntimeError("output already recorded")
        self._text.append(text)
        self._ids.extend(token_ids)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def request(self, finish_reason: str | None, stop_reason: int | str | None = None) -> dict[str, Any]:
        """The keyword arguments of ``record_output`` for the assembled output (marks it done)."""
        if self._done:
            raise RuntimeError("output already recorded")
        self._done = True
        return {"prompt_text": self.prompt_text, "prompt_token_ids": self.prompt_token_ids,
                "output_text": self.text, "output_token_ids": self._ids, "finish_reason": finish_reason,
                "stop_reason": stop_reason, "cache_salt": self.cache_salt,
                "prompt_add_special_tokens": self.prompt_add_special_tokens}

    def record(self, client: SidecarClient, finish_reason: str | None,
               stop_reason: int | str | None = None) -> RecordResult:
        """Record with a sync client."""
        return client.record_output(self.model, **self.request(finish_reason, stop_reason))

    async def arecord(self, client: AsyncSidecarClient, finish_reason: str | None,
                      stop_reason: int | str | None = None) -> RecordResult:
        """Record with an asyncio client."""
        return await client.record_output(self.model, **self.request(finish_reason, stop_reason))
