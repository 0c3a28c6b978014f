"""lm-evaluation-harness, a client no one here wrote, runs a small multiple-choice task (written
here: no dataset download) against the proxy with `local-completions`; every choice's
loglikelihood equals the one transformers computes on the same weights within 1e-3."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvpool.serve.launch import ServingCluster
from tests.support.require import require_module

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("The cache keeps the", ["prefix", "blocks of the prompt", "weather"], 1),
    ("A decode step makes one", ["token", "table"], 0),
    ("Prefill computes the KV of the", ["prompt", "moon", "whole sequence at once"], 0),
]


def write_task(folder: Path) -> str:
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (folder / "kvpool_mc.yaml").write_text(f"""task: kvpool_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
""")
    return "kvpool_mc"


def reference(model_dir: Path, context: str, continuation: str) -> float:
    """The continuation's loglikelihood, split as lm-eval splits it, by transformers."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ctx = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(lsm[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def test_lm_eval_loglikelihoods_equal_transformers(cluster: ServingCluster,
                                                   tmp_path: Path) -> None:
    lm_eval = require_module("lm_eval", "pip install -e '.[evals]' (.ci/run does)")
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    task = write_task(tmp_path)
    args = (f"model={cluster.model_name},base_url={cluster.proxy_url}/v1/completions,"
            f"tokenizer={cluster.model_dir},tokenized_requests=True,num_concurrent=2,"
            "max_retries=1")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[task],
                                  task_manager=TaskManager(include_path=str(tmp_path)),
                                  log_samples=True, batch_size=1)
    assert out is not None
    samples = out["samples"][task]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"],
                                                 strict=True):
            got = resp[0][0]
            want = reference(cluster.model_dir, context, continuation)
            assert got == pytest.approx(want, abs=1e-3), (context, continuation)
            checked += 1
    assert checked == sum(len(c) for _, c, _ in QUESTIONS)
    assert 0.0 <= out["results"][task]["acc,none"] <= 1.0
