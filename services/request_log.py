"""vLLM's ``--enable-log-requests`` / ``--enable-log-outputs``: prompts and outputs in the log.

Off by default: a server's log never holds what users sent or got unless its operator asks.
The tokenizer process logs each request as it goes to the engine (it holds the rendered
prompt and its token ids), the detokenizer each output as it finishes (it holds the text);
``--max-log-len`` cuts prompts, outputs and id lists to that many characters or ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def _cut(self, value: str | Sequence[int] | None) -> object:
        if value is None or self.max_log_len is None:
            return value
        return value[: self.max_log_len]

    def inputs(
        self, req_id: str, prompt: str | None, prompt_token_ids: Sequence[int], params: object
    ) -> None:
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            req_id,
            self._cut(prompt),
            params,
            self._cut(list(prompt_token_ids)),
        )

    def outputs(
        self, req_id: str, text: str, token_ids: Sequence[int], finish_reason: str | None
    ) -> None:
        logger.info(
            "Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s",
            req_id,
            self._cut(text),
            self._cut(list(token_ids)),
            finish_reason,
        )
