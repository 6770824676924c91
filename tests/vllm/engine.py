"""One vLLM engine in its own process, for the vLLM integration tests and benchmark.

``python tests/vllm/engine.py --model DIR --load-format nccl_back --out result.json``
starts an engine (``LLM(...)``, which spawns vLLM's engine core), writes what it
generated (greedy token ids for fixed prompts) and how long the start took to
``--out``, then, with ``--hold FILE``, keeps serving until FILE exists (so a test
can start a second engine against this one) and shuts down cleanly.

``make_model(dir)`` writes the tiny random Llama the tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 301, 302], [1, 5, 5, 5, 5, 5, 5], [1, 250, 12]]


def make_model(path: str, *, hidden: int = 256, layers: int = 2, intermediate: int = 512,
               vocab: int = 512, seed: int = 0) -> str:
    """Write a random bf16 Llama (head size 64, as the CPU attention kernel needs) to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=vocab,
        max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="nccl_back")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--extra", default=None, help="model_loader_extra_config as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--hold", default=None, help="keep serving until this file exists")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--compile", action="store_true",
                   help="let vLLM compile (no enforce_eager): compile caches are made and shared")
    p.add_argument("--compilation-config", default=None, help="compilation_config as JSON")
    p.add_argument("--serve-every", type=float, default=3.0,
                   help="while held, answer a request every this many seconds (0: none)")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Several engines share the machine: let the OS place threads (vLLM pins to core 0).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kwargs = {}
    if args.extra:
        kwargs["model_loader_extra_config"] = json.loads(args.extra)
    if args.compilation_config:
        kwargs["compilation_config"] = json.loads(args.compilation_config)
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype,
              skip_tokenizer_init=True, enforce_eager=not args.compile, max_model_len=128,
              tensor_parallel_size=args.tp, **kwargs)
    ready = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    t1 = time.perf_counter()
    first = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])],
                         SamplingParams(temperature=0.0, max_tokens=1, detokenize=False),
                         use_tqdm=False)
    first_token = time.perf_counter() - t0
    first_token_unix = time.time()  # a benchmark measures from the process launch
    del first, t1
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS], params,
                        use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "ready_s": ready,
        "first_token_s": first_token,
        "first_token_unix": first_token_unix,
        "pid": os.getpid(),
    }
    if args.load_format == "nccl_back":
        from nccl_back.engines import vllm_cache

        result["early_modelinfos"] = vllm_cache.early_outcome
    tmp = args.out + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, args.out)
    if args.hold:
        while not os.path.exists(args.hold):
            # Keep answering requests while held: serving weights must not block inference.
            # Seldom: after each request vLLM's worker busy-polls for a second, and the
            # CPUs are shared with the engine that is starting.
            if args.serve_every > 0:
                llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])], params, use_tqdm=False)
            time.sleep(args.serve_every or 0.2)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
