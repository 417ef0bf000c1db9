"""Same answers, whole model: what each server says of a fixed set of prompts, teacher-forced.

Speed means nothing if the answers changed. Each process, after its timed levels, sends
`PROMPTS` fixed prompts of `PROMPT_TOKENS` token ids (the same ids in every process, distinct
from the load's) to `/v1/completions` with `prompt_logprobs: 1`, `max_tokens: 1`, temperature 0,
and keeps per prompt position the log-probability of the prompt's own next token and the
server's top-1 token id (answers.json). Teacher-forced, positions line up between servers
whatever each would have generated.

`compare` reports for two processes the top-1 agreement (share of positions whose top-1 token is
the same) and the largest difference of the prompt tokens' log-probabilities. vLLM's dummy
loader seeds its weights, so every server of one model and format holds the same weights; two
`vllm serve` processes compared this way are the noise floor.
"""
from __future__ import annotations

import math
from typing import Any

import httpx

from moe_serve.bench.serve.load import prompt_ids

PROMPTS = 8
PROMPT_TOKENS = 64
ANSWERS = "answers.json"
LEVEL = -1                      # the prompt_ids level these prompts are drawn from (no load level)


def parse_prompt_logprobs(ids: list[int], prompt_logprobs: list[dict[str, Any] | None]) -> dict[str, list]:
    """{"logprob": [...], "top1": [...]} per position 1..len(ids)-1 from vLLM's `prompt_logprobs`
    (position 0 is None; each later one maps token id -> {logprob, rank, ...}, the prompt's own
    token always among them)."""
    if len(prompt_logprobs) != len(ids):
        raise ValueError(f"prompt_logprobs holds {len(prompt_logprobs)} positions for {len(ids)} prompt tokens")
    logprob, top1 = [], []
    for tok, entry in zip(ids[1:], prompt_logprobs[1:]):
        if not entry or str(tok) not in entry:
            raise ValueError(f"prompt_logprobs lacks the prompt's token {tok}")
        logprob.append(float(entry[str(tok)]["logprob"]))
        best = [int(k) for k, v in entry.items() if v.get("rank") == 1]
        top1.append(best[0] if best else None)
    return {"logprob": logprob, "top1": top1}


async def collect(http: httpx.AsyncClient, base_url: str, model: str, vocab: int) -> dict[str, Any]:
    """Every fixed prompt's teacher-forced answer from the server at base_url."""
    out = []
    for i in range(PROMPTS):
        ids = prompt_ids(LEVEL, i, PROMPT_TOKENS, vocab)
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
        r = await http.post(base_url.rstrip("/") + "/v1/completions", json=body)
        r.raise_for_status()
        out.append(parse_prompt_logprobs(ids, r.json()["choices"][0]["prompt_logprobs"]))
    return {"prompt_tokens": PROMPT_TOKENS, "prompts": out}


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Top-1 agreement and the largest |log-probability difference| of two processes' answers."""
    same = total = 0
    worst = 0.0
    for pa, pb in zip(a["prompts"], b["prompts"], strict=True):
        for ta, tb in zip(pa["top1"], pb["top1"], strict=True):
            same += ta == tb
            total += 1
        for la, lb in zip(pa["logprob"], pb["logprob"], strict=True):
            worst = max(worst, abs(la - lb) if math.isfinite(la) and math.isfinite(lb) else math.inf)
    return {"positions": total, "top1_agreement": same / total if total else math.nan, "max_logprob_diff": worst}
