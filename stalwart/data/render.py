"""One row to token ids and a loss mask: which tokens the model is trained to predict.

- text: every token, and an end-of-sequence token after it (the model learns where text ends).
- prompt/completion: the completion and the end-of-sequence token; the prompt is context only.
- messages: the assistant turns as the tokenizer's chat template renders them, end-of-turn
  tokens included (the model learns to stop); system and user turns are context only.

A chat is tokenized once, whole, so its tokens are exactly those the model sees at inference.
The assistant turns are found as character spans: the template renders the conversation up to
each assistant turn with the generation prompt, then through that turn; the text between the two
is the turn. Tokens whose characters lie inside a span carry the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stalwart.core.errors import TaskError
from stalwart.data.rows import Row


def check_tokenizer(tokenizer: Any, kinds: set[str], where: str) -> None:
    """The tokenizer can render every row kind in `kinds`: it has an end-of-sequence token, and a
    chat template when there are chat rows. Run on the driver, before any worker starts."""
    if tokenizer.eos_token_id is None:
        raise TaskError(f"the tokenizer at {where} has no eos token; set eos_token in its "
                        f"tokenizer_config.json (the loss teaches the model where a document ends)")
    if "messages" in kinds and not getattr(tokenizer, "chat_template", None):
        raise TaskError(_no_template(where))


def _no_template(where: str) -> str:
    return (f"task.args.data has chat rows (messages) but the tokenizer at {where} has no chat "
            f"template; write the rows as {{\"prompt\": ..., \"completion\": ...}} instead, or use "
            f"a tokenizer with a chat template (an instruct model's, or add chat_template.jinja "
            f"to the tokenizer folder)")


def render(tokenizer: Any, row: Row, kind: str) -> tuple[list[int], list[bool]]:
    """The row's token ids and, per token, whether the loss is taken on it."""
    if kind == "text":
        return _render_text(tokenizer, row.value["text"])
    if kind == "prompt_completion":
        return _render_prompt_completion(tokenizer, row.value["prompt"], row.value["completion"])
    if kind == "messages":
        return _render_messages(tokenizer, row)
    raise TaskError(f"{row.where}: unknown row kind {kind!r}; allowed: messages, "
                    f"prompt_completion, text")


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    # verbose=False: a long document is no mistake here (packing cuts it), so no length warning.
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def _render_text(tokenizer: Any, text: str) -> tuple[list[int], list[bool]]:
    eos = tokenizer.eos_token_id
    ids = _ids(tokenizer, text, special=True)
    if not ids or ids[-1] != eos:  # some tokenizers append it themselves
        ids.append(eos)
    return ids, [True] * len(ids)


def _render_prompt_completion(tokenizer: Any, prompt: str,
                              completion: str) -> tuple[list[int], list[bool]]:
    eos = tokenizer.eos_token_id
    head = _ids(tokenizer, prompt, special=True)
    if head and head[-1] == eos:  # a tokenizer that appends eos would end the document early
        head.pop()
    tail = _ids(tokenizer, completion, special=False) + [eos]
    return head + tail, [False] * len(head) + [True] * len(tail)


def _render_messages(tokenizer: Any, row: Row) -> tuple[list[int], list[bool]]:
    if not getattr(tokenizer, "chat_template", None):
        raise TaskError(_no_template(getattr(tokenizer, "name_or_path", "") or "(in memory)"))
    messages = row.value["messages"]
    full = _chat(tokenizer, messages, row, generation_prompt=False)
    spans = _assistant_spans(tokenizer, messages, full, row)
    try:
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True,
                            verbose=False)
    except NotImplementedError as e:  # a Python ("slow") tokenizer has no character offsets
        raise TaskError(f"{row.where}: chat rows need a fast tokenizer (a tokenizer.json) to "
                        f"find the assistant tokens, and this one has no offsets: {e}") from e
    ids = list(encoded["input_ids"])
    return ids, _inside(encoded["offset_mapping"], spans)


def _chat(tokenizer: Any, messages: list[dict], row: Row, *, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:  # a template raises anything (jinja errors, its own raise_exception)
        raise TaskError(f"{row.where}: the tokenizer's chat template cannot render these "
                        f"messages: {type(e).__name__}: {e}") from e


def _assistant_spans(tokenizer: Any, messages: list[dict], full: str,
                     row: Row) -> list[tuple[int, int]]:
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _chat(tokenizer, messages[:i], row, generation_prompt=True)
        through = _chat(tokenizer, messages[: i + 1], row, generation_prompt=False)
        if not through.startswith(before) or not full.startswith(through):
            raise TaskError(f"{row.where}: the chat template does not render prefixes stably "
                            f"(the conversation up to message {i} is not the start of the "
                            f"conversation through it), so the assistant turns cannot be found; "
                            f"use prompt/completion rows for this tokenizer")
        spans.append((len(before), len(through)))
    return spans


def _inside(offsets: Sequence[Sequence[int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: its characters lie inside one of `spans` (sorted, disjoint). Tokens without
    characters (zero-width offsets) carry no loss."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        mask.append(k < len(spans) and end > start and spans[k][0] <= start and end <= spans[k][1])
    return mask
