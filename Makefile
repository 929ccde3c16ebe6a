# ddpk — `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# The CUDA image: an official PyTorch CUDA runtime base, pinned.
BASE_IMAGE ?= pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
IMAGE      ?= ddpk:latest
# The offline CPU stand-in base (docker/build-cpu-base.sh) and the image built on it.
CPU_BASE   ?= ddpk-base:cpu
CPU_IMAGE  ?= ddpk:cpu
KIND_CLUSTER ?= ddpk
# The OCI revision label of both images.
REVISION   ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
PYTEST_ARGS ?=

STAMP := $(VENV)/.ddpk-installed

.PHONY: help venv demo test image image-cpu base-cpu manifests kind-up kind-load kind-test bench clean

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-11s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

venv: $(STAMP) ## Create .venv with ddpk and ddpk-trainer (editable) and the dev tools

$(STAMP): trainer/pyproject.toml cli/pyproject.toml requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/dev.txt
	$(BIN)/pip install -q -e trainer -e cli
	touch $@

demo: venv ## The main job: a 2-replica DDP job on this machine, ending with its eval accuracy
	$(BIN)/ddpk submit --replicas 2 --follow --replace --name ddpk-demo

test: venv ## Every test tier this machine can run (unit, integration, e2e-docker, kind)
	$(BIN)/pytest $(PYTEST_ARGS)

base-cpu: ## The offline CPU stand-in base image (CPU_BASE, default ddpk-base:cpu), built without a registry
	docker/build-cpu-base.sh $(CPU_BASE)

image: ## The CUDA image from docker/Dockerfile on BASE_IMAGE, tagged IMAGE
	docker build -f docker/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg REVISION=$(REVISION) -t $(IMAGE) .

image-cpu: ## The same Dockerfile on the CPU stand-in base, tagged CPU_IMAGE (default ddpk:cpu)
	docker image inspect $(CPU_BASE) >/dev/null 2>&1 || docker/build-cpu-base.sh $(CPU_BASE)
	docker build -f docker/Dockerfile --build-arg BASE_IMAGE=$(CPU_BASE) --build-arg REVISION=$(REVISION) -t $(CPU_IMAGE) .

manifests: venv ## Regenerate the committed examples in k8s/ from the renderer
	$(BIN)/python -m ddpk.examples k8s

kind-up: ## Create the kind cluster from k8s/kind-config.yaml (if none is running)
	kind get clusters 2>/dev/null | grep -qx $(KIND_CLUSTER) || kind create cluster --name $(KIND_CLUSTER) --config k8s/kind-config.yaml

kind-load: image-cpu ## Load $(CPU_IMAGE) into the kind cluster
	kind load docker-image $(CPU_IMAGE) --name $(KIND_CLUSTER)

kind-test: venv kind-up kind-load ## Submit a 2-replica job to kind and follow it to completion
	DDPK_KIND_CLUSTER=$(KIND_CLUSTER) $(BIN)/pytest -m kind tests/kind

bench: venv ## Benchmarks: medians and ratios against baselines, into bench/RESULTS.md
	$(BIN)/python -m bench

clean: ## Remove the venv, caches and local run state
	rm -rf $(VENV) .cache .pytest_cache build dist trainer/build cli/build
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
