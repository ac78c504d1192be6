# Every target delegates to a script in scripts/, so each also runs without make.
.PHONY: demo test daprd image lint bench proto setup

demo:  ## the main job: Redis, the component, daprd and a subscriber; delayed messages published with curl
	@scripts/demo.sh

test:  ## set-up, lint, then the whole test suite (end-to-end under a real daprd included)
	@scripts/test.sh

daprd:  ## print the path of a daprd, building it into ~/.cache on first use (takes minutes)
	@scripts/daprd.sh

image:  ## build the component's container image with podman (base from Debian packages, cached)
	@scripts/image.sh

lint:  ## ruff + mypy --strict
	@scripts/lint.sh

bench:  ## the quick set of bench/ (`python -m bench`; `python -m bench --list` names every benchmark)
	@scripts/bench.sh

proto:  ## regenerate proto/delayed_pubsub_pb from the .proto sources
	.venv/bin/python scripts/genproto.py

setup:  ## idempotent: .venv, pip install -e '.[dev,spark,examples,dashboard]', redis-server, Java, podman, chromium, daprd
	@scripts/setup.sh
