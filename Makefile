# Every target sets itself up on a fresh machine: a virtual environment in .venv with the
# package and its test tools. Nothing needs installing by hand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck crd docs deploy dashboards chart-crd chart-docs images release tools cluster clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,plot]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specgate demo $(DEMO_ARGS)

test: $(STAMP) tools
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy --strict lab/bench
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy --strict lab/bench

crd: $(STAMP)
	$(BIN)/specgate crd > crds/specdecodedeployments.specgate.io.yaml

docs: $(STAMP)
	$(BIN)/specgate crd --markdown > docs/crd-reference.md

dashboards: $(STAMP)
	$(BIN)/specgate dashboards --out charts/specgate/dashboards

# The chart's README, from the values' `# --` comments (helm-docs, installed by `make tools`).
chart-docs:
	.tools/bin/helm-docs --chart-search-root charts --skip-version-footer --sort-values-order file

# The specgate image (operator and routers) and the engine stand-in (a simulated pod behind
# SGLang's command line) as dist/images/*.oci.tar, built without a container engine from
# Debian packages and PyPI wheels (scripts/build_image.py; as root: mmdebstrap). The engine's
# worker image is built with docker (worker-image/).
images: $(STAMP) tools
	$(BIN)/python scripts/build_image.py --out $(DIST)/images

# The chart as dist/specgate-<version>.tgz, every place checked to name pyproject.toml's version
# and the changelog to have its section; REGISTRY=oci://HOST/PATH pushes it (PLAIN_HTTP=1 for a
# registry without TLS), and IMAGES=HOST/PATH builds the images and pushes them there as
# HOST/PATH/specgate:<version> and HOST/PATH/engine-sim:<version>.
DIST ?= dist
release: $(STAMP) tools $(if $(IMAGES),images)
	$(BIN)/python scripts/release.py package --out $(DIST) \
		$(if $(REGISTRY),--registry $(REGISTRY)) $(if $(PLAIN_HTTP),--plain-http) \
		$(if $(IMAGES),--images $(IMAGES) --image-dir $(DIST)/images)

chart-crd:
	cp crds/specdecodedeployments.specgate.io.yaml charts/specgate/files/

tools: $(STAMP)
	bash scripts/install-tools.sh

# A real single-node cluster until Ctrl-C (as root): kube-apiserver, kube-controller-manager,
# kube-scheduler and etcd, and a node (kubelet, kube-proxy, containerd, runc, CNI bridge) that
# runs the images `make images` built; it prints the KUBECONFIG to export (tests/node.py).
cluster: images
	$(BIN)/python -m tests.control_plane --images $(DIST)/images

deploy: $(STAMP)
	$(BIN)/specgate install-manifests > deploy/operator.yaml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info out
