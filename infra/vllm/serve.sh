#!/usr/bin/env bash
# One vLLM OpenAI-compatible server per model, one GPU each (run on a GPU node, in vLLM's own environment:
# `pip install vllm` pins its own CUDA torch, so never install it beside rlens).
# Usage: infra/vllm/serve.sh MODEL_ID SERVED_NAME PORT [GPU]
#   infra/vllm/serve.sh meta-llama/Llama-3.1-8B-Instruct llama-8b 8001 0
set -euo pipefail
model=${1:?model id or path}; name=${2:?served model name}; port=${3:?port}; gpu=${4:-0}
# --max-logprobs: rlens asks logprobs=1 for choice scoring (echo); RLAE over servers (issue 5) asks top-k (<= 20).
# --enable-prefix-caching: the choices of one question share their prompt.
CUDA_VISIBLE_DEVICES=$gpu exec vllm serve "$model" \
  --served-model-name "$name" --host 0.0.0.0 --port "$port" \
  --max-logprobs 20 --enable-prefix-caching --gpu-memory-utilization 0.90 --max-model-len 4096
