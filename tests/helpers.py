"""Test helpers shared across test modules."""

from __future__ import annotations

import torch

from radixserve import LLM, SamplingParams


def hf_greedy(
    model_path, prompts: list[list[int]], max_new_tokens: int, gguf_file=None
) -> list[list[int]]:
    """Greedy continuations from Hugging Face transformers (float32), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, **kwargs)
    model.eval()
    # No early stop and no EOS masking: radixserve runs these with ignore_eos.
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_idle()
    return [o.token_ids for o in outs]
