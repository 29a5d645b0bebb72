# One command each, on a fresh Linux box with Python 3.11: `make train`, `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python: requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	touch $(BIN)/python

venv: $(BIN)/python

train: venv  ## SFT warm-up (reused if present) + GRPO with speculative rollouts on 2 CPU ranks
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 train.py --config configs/default.yaml

draft: venv  ## the small draft model for `method: draft_model` (SFT only; runs/draft)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 train.py --config configs/draft.yaml --sft-only

mlp: venv    ## the n-gram MLP for `method: suffix_mlp`, distilled from runs/sft (~40 s; runs/ngram_mlp)
	$(BIN)/python distill_mlp.py --model runs/sft --out runs/ngram_mlp

head: venv   ## the draft head for `method: head` on SmolLM2's task (runs/head_smollm2; 45-100 min on 2 cores)
	OMP_NUM_THREADS=2 $(BIN)/python distill_head.py --config configs/smollm2_arith.yaml --out runs/head_smollm2_warm \
	  --prompts 128 --samples 4 --epochs 20 --draft-vocab 4096
	OMP_NUM_THREADS=2 $(BIN)/python distill_head.py --config configs/smollm2_arith.yaml --out runs/head_smollm2 \
	  --prompts 256 --samples 4 --epochs 4 --init runs/head_smollm2_warm

smollm2: venv  ## a real model: SmolLM2-135M-Instruct (fetched once, ~93 MB) + GRPO on word problems, 2 CPU ranks
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 train.py --config configs/smollm2_arith.yaml

test: venv   ## the whole suite, slow end-to-end tests included (CI runs exactly this)
	$(BIN)/python -m pytest -q tests

bench: venv
	$(BIN)/python bench.py --suite all

.PHONY: venv train draft mlp head smollm2 test bench
