# Two entry points (README): `make demo` runs the main job, `make test` runs the tests. Both run the
# idempotent set-up first (scripts/setup_env.sh: virtual environment, pinned deps, colcon build).
SHELL := /bin/bash
WITH_ENV := source scripts/env.sh &&

.PHONY: setup test test-fast demo demo-data train-demo eval-demo memory-record train-qa eval-memory bench-model bench-engine bench-fleet bench-roofline clean

setup:
	@bash scripts/setup_env.sh

# The suite runs in TEST_WORKERS pytest-xdist processes (default 2; 0 runs it in this one): on this project's
# 2-core machines a serial run keeps 1.2 cores busy on average (the rest is DDS discovery, node processes
# starting, sockets), two processes keep both busy. --dist loadfile: each test module runs whole in one process,
# so its module fixtures are built once; --no-loadscope-reorder keeps test/conftest.py's order (long modules
# first) instead of xdist's (most tests first, which left the packaging build and the demo to run alone at the
# end). PYTEST_ARGS passes options (`make test PYTEST_ARGS="-x"`).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	@$(WITH_ENV) pytest $(PARALLEL) $(PYTEST_ARGS)

# The inner loop of a change: the unit tests of models, engine, node helpers and tools, without the tests that start
# rclpy nodes (marker dds) or take long (slow); `make test` runs everything. PYTEST_ARGS passes options.
test-fast: setup
	@$(WITH_ENV) OXYGEN_TEST_FAST=1 pytest $(PARALLEL) -m "not dds and not slow" $(PYTEST_ARGS)

demo: setup
	@$(WITH_ENV) python -m oxygen_ros.tools.demo $(DEMO_ARGS)

# The demo policy (docs/demo-policy.md): scripted demonstrations in the simulator, then training π0.5 on
# them. DATA_ARGS / STARTS_ARGS / TRAIN_ARGS / FINETUNE_ARGS pass options (e.g. DATA_ARGS="--episodes 4",
# TRAIN_ARGS="--steps 100" FINETUNE_ARGS="--steps 50").
# The shipped recipe: 100 DART demonstrations, 800 start frames (cube seeds 2000-2799, one image set each: only
# the cameras can tell where the cube is there), the top camera cropped to the workspace.
demo-data: setup
	@$(WITH_ENV) python -m oxygen_ros.tools.demo_data --out runs/demo-data $(DATA_ARGS)
	@$(WITH_ENV) python -m oxygen_ros.tools.demo_data --out runs/demo-starts --seed 2000 --episodes 800 \
		--image-every 1000000 --perturb 0 $(STARTS_ARGS)

# Training in stages: a fresh start (runs/train-demo-base, 5000 steps), then FINETUNE_STAGES continued runs
# (--init-from the stage before) that weigh the start frames and their location target more; the last writes
# runs/train-demo. TRAIN_ARGS goes to the first stage, FINETUNE_ARGS to the continued ones (a continued stage
# must have the base's model settings: pass --image-size / --crop / --cameras changes through TRAIN_DATA).
# FINETUNE_STAGE_ARGS: what each continued stage adds, in order (stage 3 on: every subtask drawn alike; stage 4:
# the speech trained on the state labels); stages past the list add nothing.
TOP_CROP := top=0.35,0.35,0.466667,0.35
TRAIN_DATA := --data runs/demo-data --extra-data runs/demo-starts --crop $(TOP_CROP)
FINETUNE := --start-repeat 3 --start-locate 0.75 --lr 3e-4 --warmup 50 --steps 2500
FINETUNE_STAGE_ARGS := "" "" "--approach-repeat 1" "--approach-repeat 1 --subtask-labels state"
FINETUNE_STAGES ?= 4
# FINETUNE_STAGES=0: the base alone, written to runs/train-demo
BASE_OUT = $(if $(filter 0,$(FINETUNE_STAGES)),runs/train-demo,runs/train-demo-base)
train-demo: setup
	@$(WITH_ENV) python -m oxygen_ros.training.train $(TRAIN_DATA) --out $(BASE_OUT) $(TRAIN_ARGS)
	@$(WITH_ENV) prev=$(BASE_OUT) && stage_args=($(FINETUNE_STAGE_ARGS)) && for stage in $$(seq 1 $(FINETUNE_STAGES)); do \
		out=runs/train-demo-stage$$stage; if [ $$stage -eq $(FINETUNE_STAGES) ]; then out=runs/train-demo; fi; \
		echo "[train-demo] stage $$stage: $$prev -> $$out $${stage_args[$$((stage - 1))]}"; \
		python -m oxygen_ros.training.train $(TRAIN_DATA) --init-from $$prev/checkpoint $(FINETUNE) \
			$${stage_args[$$((stage - 1))]} --out $$out $(FINETUNE_ARGS) || exit 1; prev=$$out; done

# Closed-loop evaluation of the trained policy (docs/demo-policy.md, "Closed-loop evaluation"): node on
# simulated time, node in real time, synchronous, random weights, scripted expert; EVAL_ARGS passes options
# (e.g. EVAL_ARGS="--episodes 2 --conditions sync,expert").
# EVAL_CHECKPOINT: the shipped demo policy unless given (e.g. runs/train-demo/checkpoint after make train-demo).
EVAL_CHECKPOINT ?= oxygen_ros/assets/demo_policy
eval-demo: setup
	@$(WITH_ENV) python -m oxygen_ros.tools.evaluate --checkpoint $(EVAL_CHECKPOINT) $(EVAL_ARGS)

# Answers from memory (docs/memory.md, "Measured: answers with and without memory"): a recorded run of the demo
# (real-time episodes of 20 s through the node with the shipped policy; held-out cube seeds 5000-5023, never
# trained on), the QA fine-tune of the demo policy on generated memory lines, and the demo's questions asked
# through ~/ask with and without {memory}. eval-memory reads the shipped question set
# (oxygen_ros/demo_task/demo_questions.json) unless MEMORY_ARGS="--record runs/memory-record".
memory-record: setup
	@$(WITH_ENV) python -m oxygen_ros.tools.evaluate --conditions node-realtime --chunking rtc --max-steps 990 \
		--episodes 24 --start-seed 5000 --memory-every 2 --out runs/memory-record $(RECORD_ARGS)

train-qa: setup
	@$(WITH_ENV) python -m oxygen_ros.training.qa --out runs/train-qa $(QA_ARGS)

eval-memory: setup
	@$(WITH_ENV) python -m oxygen_ros.tools.memory_eval --checkpoint runs/train-qa/checkpoint $(MEMORY_ARGS)

# The same programs as the console scripts `oxygen-bench-model` / `oxygen-bench-engine` of `pip install .`.
bench-model: setup
	@$(WITH_ENV) python -m oxygen_ros.bench.model_bench $(BENCH_ARGS)

bench-engine: setup
	@$(WITH_ENV) python -m oxygen_ros.bench.engine_bench $(BENCH_ARGS)

# R robots on one engine vs R separate engines (docs/fleet.md); `oxygen-bench-fleet` of `pip install .`.
bench-fleet: setup
	@$(WITH_ENV) python -m oxygen_ros.bench.fleet_bench $(BENCH_ARGS)

# Per phase: FLOP, bytes, achieved rates and this machine's GEMM / streaming ceilings (docs/benchmarks.md).
bench-roofline: setup
	@$(WITH_ENV) python -m oxygen_ros.bench.roofline $(BENCH_ARGS)

clean:
	rm -rf build install log
