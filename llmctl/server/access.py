"""What a request may ask for, decided before it reaches the engine: its API key's attributes
(models, `max_tokens` cap, priority), the input filter, and what the output filter rules out.

Owns `RequestPolicy.admit(body, request)`, called by each generation route with the validated
body: a refusal is an `APIError` (403 `permission_denied` for a model or priority the key may not
use, 400 over the key's `max_tokens` cap or for a prompt an `--input-filter` rule matches); what
passes leaves the body with the key's defaults applied (its priority when the request sent none,
its cap on a default `max_tokens`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Union

from fastapi import Request

from llmctl.server.api_keys import ApiKey
from llmctl.server.errors import APIError
from llmctl.server.middleware import API_KEY_SCOPE, AUDIT_KEY
from llmctl.server.protocol import ChatCompletionRequest, CompletionRequest, requested_max_tokens
from llmctl.server.text_filter import FilterCounters, RuleSet

AnyRequest = Union[CompletionRequest, ChatCompletionRequest]


def key_of(request: Request) -> Optional[ApiKey]:
    """The caller's API key (None when the server has no keys)."""
    return request.scope.get(API_KEY_SCOPE)


def check_model_access(key: Optional[ApiKey], model: str) -> None:
    """403 `permission_denied` unless the key may use `model` (any model without keys)."""
    if key is not None and not key.may_use(model):
        raise APIError(403, f"the API key {key.name!r} may not use the model '{model}'", param="model",
                       code="permission_denied")


class RequestPolicy:
    def __init__(self, served_model: str, *, tokenizer: Any = None, input_rules: Optional[RuleSet] = None,
                 output_filtered: bool = False, counters: Optional[FilterCounters] = None):
        self.served_model = served_model
        self.tokenizer = tokenizer
        self.input_rules = input_rules
        self.output_filtered = output_filtered
        self.counters = counters

    async def admit(self, body: AnyRequest, request: Request) -> None:
        key = key_of(request)
        if key is not None:
            self._check_key(key, body)
        if self.output_filtered:
            self._check_logprobs(body)
        if self.input_rules is not None:
            await self._check_input(body, request.scope.get(AUDIT_KEY, {}))

    # ---- the key's attributes -------------------------------------------------------------------
    def _check_key(self, key: ApiKey, body: AnyRequest) -> None:
        check_model_access(key, body.model or self.served_model)
        if key.max_tokens is not None:
            asked = requested_max_tokens(body)
            if asked is not None and asked > key.max_tokens:
                param = ("max_completion_tokens" if isinstance(body, ChatCompletionRequest)
                         and body.max_completion_tokens is not None else "max_tokens")
                raise APIError(400, f"{param} {asked} exceeds the limit of the API key {key.name!r}: "
                                    f"{key.max_tokens} tokens per request", param=param, code="max_tokens_exceeded")
            body.limit_max_tokens(key.max_tokens)
        if key.priority is not None:
            if "priority" not in body.model_fields_set:
                body.priority = key.priority
            elif body.priority < key.priority:
                raise APIError(403, f"the API key {key.name!r} may not ask for priority {body.priority}: its "
                                    f"requests run at priority {key.priority} or later (higher numbers)",
                               param="priority", code="permission_denied")

    # ---- what the output filter rules out --------------------------------------------------------
    @staticmethod
    def _check_logprobs(body: AnyRequest) -> None:
        asked = body.logprobs is not None if isinstance(body, CompletionRequest) else body.logprobs
        if asked:
            raise APIError(400, "logprobs are not available on this server: its --output-filter rewrites the "
                                "text, and token log-probabilities would show what it removed", param="logprobs",
                           code="unsupported_parameter")

    # ---- the input filter -----------------------------------------------------------------------
    async def _check_input(self, body: AnyRequest, audit: dict[str, Any]) -> None:
        texts, param = self._texts(body)
        # Off the event loop: a prompt can be megabytes of text.
        rule = await asyncio.to_thread(lambda: next((r for t in texts if (r := self.input_rules.find(t))), None))
        if rule is None:
            return
        audit["input_filter_refused"] = rule.name
        if self.counters is not None:
            self.counters.refusals.labels(self.counters.model_name, rule.name).inc()
        raise APIError(400, f"the {'messages match' if param == 'messages' else 'prompt matches'} the input "
                            f"filter rule '{rule.name}' (--input-filter), so this server refuses it",
                       param=param, code="input_filter")

    def _texts(self, body: AnyRequest) -> tuple[list[str], str]:
        """The text the caller supplied: chat messages (content and names), or the prompts, token-id
        prompts decoded (a filter that token ids could walk around would filter nothing)."""
        if isinstance(body, ChatCompletionRequest):
            return [m["content"] + "\n" + m.get("name", "") for m in body.plain_messages()], "messages"
        prompt = body.prompt
        if prompt is None:
            return [], "prompt"
        items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        return [item if isinstance(item, str) else self._decode(item) for item in items], "prompt"

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so its --input-filter cannot read token-id prompts",
                           param="prompt")
        try:
            return self.tokenizer.decode(token_ids)
        except OverflowError:  # a negative or huge id: the engine refuses it next, naming it
            return ""
